"""Joining the swarm: the DHT a peer runs, checked early, and the join line other peers copy.

hivemind only (no VISSL), so that run_trainer.py can fail fast on bad swarm flags before VISSL starts, and
the VISSL task can reuse the DHT that run_trainer.py already started in the same process.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

_shared_dht: Any = None  # a DHT started by run_trainer.py, reused by the task in the same process
SECRET_ENV = "SWAV_SWARM_SECRET"  # a secret from the environment (run_trainer.py moves it into a file: hide_secret)
PREFLIGHT_SUFFIX = "-preflight"  # a pre-flight's run id: the long run's plus this (preflight.SUFFIX)
JOIN_RETRY_S = 3.0  # start_dht dials the initial peers again this often until one answers (or join_timeout)


class SwarmError(ValueError):
    """Bad swarm flags or an unreachable swarm; the message says what to do."""


class NobodyAnswered(SwarmError):
    """None of --initial_peers answered within --join_timeout."""


ALONE_AFTER_S = 60.0  # a box with no applied round for this long is alone: it warns, and the monitor lists it


@dataclass
class SwarmSettings:
    """Everything a peer needs to join; stored in the VISSL config (``config.SWARM``) so spawned workers see it."""

    run_id: str = "swav"
    initial_peers: list[str] = field(default_factory=list)
    host_maddrs: list[str] = field(default_factory=lambda: ["/ip4/0.0.0.0/tcp/0"])
    announce_maddrs: list[str] = field(default_factory=list)
    identity_path: str = ""
    client_mode: bool = False
    use_auto_relay: bool = False
    use_relay: bool = True
    force_reachability: str = ""  # "private"/"public": skip libp2p's AutoNAT guess (it never dials private addresses)
    target_group_size: int = 4
    min_matchmaking_time: float = 5.0
    request_timeout: float = 3.0
    averaging_timeout: float = 60.0
    next_chunk_timeout: float = 10.0
    max_staleness: int = -1  # -1: asynchronous (ASP); s >= 0: wait when more than s steps pass without a round
    compression: str = "fp16"
    average_optimizer_state: bool = False
    outer_momentum: float = 0.0  # the outer optimizer on each round's average (decentralized_sgd.outer); 0, 1: off
    outer_lr: float = 1.0
    outer_nesterov: bool = False
    load_state_timeout: float = 60.0
    weight_by_samples: bool = True  # a box's weight in a round: its samples since its last round (as FedAvg)
    join_timeout: float = 30.0  # seconds a joiner keeps dialing --initial_peers at start before it gives up
    alone_warning_after: float = ALONE_AFTER_S  # seconds without an applied round before the box warns; 0: never
    address_book: str = ""  # the file where this box keeps the peers it met (vissl_swarm.address_book)
    averager: str = "improved"  # "old": hivemind's TrainingAverager, the benchmarks' baseline
    schedule: str = "swarm"  # "swarm": the recipe is the whole swarm's budget; "local": each box runs all of it
    swarm_lr: str = "sqrt"  # with the swarm schedule: each box's LR x sqrt(swarm batch / box batch); see README
    config_name: str = ""
    recipe: dict[str, str] = field(default_factory=dict)  # what every box of the swarm runs alike (recipe.swarm_recipe)
    preflight_s: float = 0.0  # > 0: a pre-flight of that many seconds (run_id then ends with preflight.SUFFIX)
    swarm_secret_file: str = ""  # a file holding the swarm secret (see secret())
    swarm_secret: str = field(default="", repr=False)  # --swarm_secret itself: left out of to_config()

    @classmethod
    def from_config(cls, section: Any) -> SwarmSettings:
        known = {name: section[name] for name in cls.__dataclass_fields__ if name in section}
        return cls(**{**known, "recipe": {str(k): str(v) for k, v in known.get("recipe", {}).items()}})

    @property
    def run_prefix(self) -> str:
        """The run's name in the swarm: boxes with the same run id, config and recipe share it (averaging, state
        downloads and the signed counts); a box of another recipe never averages with them."""
        from vissl_swarm.recipe import recipe_hash

        return f"{self.run_id}_{self.config_name or 'swav'}_{recipe_hash(self.recipe)}".replace(".", "_")

    def to_config(self) -> dict:
        """Everything but the secret itself: VISSL logs its config and saves it next to the checkpoints (the trainer
        passes a secret given as text through a private file instead, see hide_secret)."""
        config = asdict(self)
        config.pop("swarm_secret")
        return config

    def averager_timeouts(self) -> dict[str, float]:
        """These settings' waits as DecentralizedSGD's keyword arguments (its names are hivemind's)."""
        return dict(
            min_matchmaking_time=self.min_matchmaking_time,
            request_timeout=self.request_timeout,
            allreduce_timeout=self.averaging_timeout,
            next_chunk_timeout=self.next_chunk_timeout,
        )

    def outer_options(self) -> dict[str, Any]:
        """The outer optimizer's settings as DecentralizedSGD's keyword arguments, checked (a SwarmError says what
        was wrong)."""
        from decentralized_sgd.outer import OuterSettings

        try:
            outer = OuterSettings(self.outer_momentum, self.outer_lr, self.outer_nesterov)
        except ValueError as error:
            raise SwarmError(f"--{error}") from None
        return dict(outer=outer)

    def secret(self) -> Any:
        """The swarm secret (a ``decentralized_sgd.secret.SwarmSecret``) from --swarm_secret, --swarm_secret_file or
        else the SWAV_SWARM_SECRET environment variable, surrounding whitespace stripped; None without one. SwarmError
        for an empty or unreadable one, or for both flags."""
        from decentralized_sgd.secret import SwarmSecret

        text = self.swarm_secret or (None if self.swarm_secret_file else os.environ.get(SECRET_ENV)) or None
        if text and self.swarm_secret_file:
            raise SwarmError("pass either --swarm_secret or --swarm_secret_file, not both")
        if self.swarm_secret_file:
            path = Path(self.swarm_secret_file).expanduser()
            try:
                content = path.read_bytes().strip()
            except OSError as error:
                raise SwarmError(f"--swarm_secret_file: cannot read {path}: {error.strerror or error}") from None
            if not content:
                raise SwarmError(
                    f"--swarm_secret_file: {path} is empty; put the swarm's secret in it "
                    "(e.g. python -c 'import secrets; print(secrets.token_hex(16))' > swarm.key)"
                )
            return SwarmSecret(content)
        if text is not None and not text.strip():
            raise SwarmError("--swarm_secret is empty; leave it out to run without a secret")
        return SwarmSecret(text.strip().encode()) if text else None


def hide_secret(settings: SwarmSettings) -> SwarmSettings:
    """The same settings with a secret given as text (--swarm_secret or SWAV_SWARM_SECRET) moved into a private file
    (mode 0600, removed at exit) that ``swarm_secret_file`` names, and SWAV_SWARM_SECRET taken out of this process's
    environment: VISSL logs every environment variable and its whole config, and its workers (forked or spawned)
    read the secret from the file."""
    import atexit
    import tempfile
    from dataclasses import replace

    text = settings.swarm_secret or ("" if settings.swarm_secret_file else os.environ.get(SECRET_ENV, ""))
    os.environ.pop(SECRET_ENV, None)
    if not text:
        return settings
    descriptor, path = tempfile.mkstemp(prefix="swarm-secret-")  # readable by this user only
    with os.fdopen(descriptor, "w") as file:
        file.write(text)
    atexit.register(lambda: os.path.exists(path) and os.remove(path))
    return replace(settings, swarm_secret="", swarm_secret_file=path)


def add_secret_arguments(group: Any) -> None:
    """--swarm_secret / --swarm_secret_file, the same for the trainer and the monitor (an argparse group/parser)."""
    group.add_argument(
        "--swarm_secret_file",
        default="",
        help="file with the swarm's secret: only peers with the same secret average together and "
        "write the swarm's records (make one with python -c 'import secrets; "
        "print(secrets.token_hex(16))' > swarm.key and copy it to every box)",
    )
    group.add_argument(
        "--swarm_secret",
        default="",
        help="the swarm's secret itself (visible in the process list: prefer --swarm_secret_file; "
        f"the {SECRET_ENV} environment variable works too)",
    )


def secret_settings(args: argparse.Namespace) -> dict[str, str]:
    """The SwarmSettings fields of the secret flags, checked now (a SwarmError names the problem)."""
    fields = {"swarm_secret": args.swarm_secret, "swarm_secret_file": args.swarm_secret_file}
    SwarmSettings(**fields).secret()
    return fields


def check_multiaddrs(flag: str, addresses: list[str]) -> None:
    """Parse each multiaddr now: a typo should fail in a second, not after VISSL has built the model."""
    from hivemind.utils.multiaddr import Multiaddr

    for address in addresses:
        try:
            Multiaddr(address)
        except Exception as error:  # multiaddr raises several unrelated exception types
            raise SwarmError(
                f"{flag}: {address!r} is not a multiaddr ({error}). A multiaddr looks like "
                "/ip4/203.0.113.5/tcp/31337/p2p/QmPeerID (copy the line the first peer printed)"
            ) from error
    if flag == "--initial_peers":
        for address in addresses:
            if "/p2p/" not in address:
                raise SwarmError(
                    f"--initial_peers: {address!r} has no /p2p/<peer id> part; copy the whole multiaddr that "
                    "the first peer printed in its join line"
                )


def start_dht(settings: SwarmSettings, startup_timeout: float = 30.0) -> Any:
    """:func:`join`, and a box that could not join leaves no identity file it made (``--identity_path``)."""
    new_identity = settings.identity_path and not os.path.exists(settings.identity_path)
    try:
        return join(settings, startup_timeout)
    except SwarmError:
        if new_identity and os.path.exists(settings.identity_path):
            os.remove(settings.identity_path)
        raise


def join(settings: SwarmSettings, startup_timeout: float = 30.0) -> Any:
    """Start this peer's DHT and join the swarm through ``--initial_peers`` and the peers this box met before (its
    address book, ``settings.address_book``).

    A joiner dials ``--initial_peers`` again every few seconds for ``settings.join_timeout`` (one started a moment
    before the first peer listens, or whose one ping a busy first peer missed, joins all the same); if none answers,
    a box that met other peers before (a restart) starts all the same and dials those, and a box that never did
    fails with a SwarmError that says what to check. A box without ``--initial_peers`` (the first box) dials the
    peers of its address book once: after a restart it is back in the swarm at once; nobody answering means it is
    the first of a swarm started again. Afterwards ``keep_dht_connected`` dials all of them whenever our DHT is
    alone, and keeps the address book.

    hivemind's own bootstrap check is off (``ensure_bootstrap_success=False``): when none of the initial peers
    answers its single ping it raises, but leaves the DHT's p2p daemon running, holding the port of
    ``--host_maddrs`` (hivemind 1.1.12, ``DHTNode.create``). We ping them ourselves and shut the DHT down properly
    when nobody answered. A p2p daemon that cannot reach any initial peer at all fails before that and leaves
    nothing behind: it is started again.
    """
    from vissl_swarm.address_book import AddressBook
    from vissl_swarm.dht_rejoin import keep_dht_connected

    check_multiaddrs("--initial_peers", settings.initial_peers)
    check_multiaddrs("--host_maddrs", settings.host_maddrs)
    check_multiaddrs("--announce_maddrs", settings.announce_maddrs)
    book = AddressBook(settings.address_book or None)
    met_before = len(book.addresses())
    hint = (
        "check that the first peer is running and that its address and port are reachable from here (open "
        "the port; a first peer behind NAT, whose join line shows only a private address, cannot be joined from "
        "outside its LAN: start the swarm on a box with a public address)"
        if settings.initial_peers
        else "check --host_maddrs and --identity_path"
    )
    deadline = time.monotonic() + settings.join_timeout
    initial_peers = settings.initial_peers
    try:
        dht = _start_dht_process(settings, initial_peers, startup_timeout, deadline, hint)
    except SwarmError as error:
        if not (met_before and isinstance(error, NobodyAnswered)):
            raise
        logger.warning(
            f"None of --initial_peers answered within {settings.join_timeout:g} s; this box met "
            f"{met_before} address(es) of other peers before ({book.path}): starting without "
            "--initial_peers and dialing those"
        )
        initial_peers = []
        dht = _start_dht_process(settings, initial_peers, startup_timeout, deadline, hint)

    def known_addresses() -> list[str]:
        return [*settings.initial_peers, *book.addresses(exclude=[dht.peer_id])]

    if initial_peers and not _joined(dht, deadline, known_addresses):
        if not met_before:
            dht.shutdown()
            raise NobodyAnswered(
                f"could not join the swarm: none of --initial_peers answered within "
                f"{settings.join_timeout:g} s (--join_timeout); {hint}"
            )
        logger.warning(
            "None of --initial_peers answered; training alone until they or the peers met before "
            "answer (dialed every 10 s)"
        )
    elif not initial_peers and met_before:
        answered = _joined(dht, time.monotonic(), known_addresses, warn=False)  # one try: it may be the first
        print(
            f"[swarm] dialed the {met_before} address(es) of peers this box met before ({book.path}): "
            + (
                "back in the swarm"
                if answered
                else "nobody answered yet; dialing them every 10 s (the first "
                "box of a swarm started again, or the others are down)"
            ),
            file=sys.stderr,
            flush=True,
        )
    keep_dht_connected(dht, addresses=known_addresses, book=book)  # rejoin after an outage; keep the book
    return dht


def _start_dht_process(
    settings: SwarmSettings, initial_peers: list[str], startup_timeout: float, deadline: float, hint: str
) -> Any:
    """A FixedDHT started with these initial peers; started again while its p2p daemon reaches none of them (until
    ``deadline``). SwarmError when it cannot start."""
    import hivemind
    from hivemind.p2p import P2PDaemonError

    from decentralized_sgd import FixedDHT
    from vissl_swarm.swarm_progress import record_validators

    # from the start: a DHT takes the records other peers push to it as it joins, and one it cannot strip (another
    # secret's) leaves every later read of the key hanging (hivemind 1.1.12, _SearchState.finish_search)
    validators = record_validators(settings.run_id, secret=settings.secret())  # the optimizer adds its exempt key
    check_identity = True  # hivemind's check that no running peer has our identity dials the initial peers too
    while True:
        try:
            return FixedDHT(  # a hivemind.DHT that survives a restarted averager
                start=True,
                record_validators=validators,  # records signed
                initial_peers=initial_peers or None,
                host_maddrs=settings.host_maddrs,
                announce_maddrs=settings.announce_maddrs or None,
                identity_path=settings.identity_path or None,
                client_mode=settings.client_mode,
                use_auto_relay=settings.use_auto_relay,
                use_relay=settings.use_relay,
                force_reachability=settings.force_reachability or None,
                startup_timeout=startup_timeout,
                ensure_bootstrap_success=False,
                check_if_identity_free=check_identity,
            )
        except (P2PDaemonError, hivemind.p2p.P2PHandlerError, OSError, RuntimeError, TimeoutError) as error:
            if "failed to connect to bootstrap peers" not in str(error):
                raise SwarmError(f"could not start or join the swarm: {error}; {hint}") from error
            if time.monotonic() + JOIN_RETRY_S > deadline:  # the daemon's own text says no more than this
                raise NobodyAnswered(
                    f"could not join the swarm: none of --initial_peers answered within {settings.join_timeout:g} s "
                    f"(--join_timeout); {hint}"
                ) from None
            check_identity = False  # checked once: it fails as long as nobody answers
            time.sleep(JOIN_RETRY_S)


def _joined(dht: Any, deadline: float, addresses: Callable[[], list[str]], warn: bool = True) -> bool:
    """Dial and ping ``addresses()`` until one answered (then it is in our routing table) or the deadline."""
    import functools

    from vissl_swarm.dht_rejoin import rejoin_if_alone

    while True:
        rejoin = functools.partial(rejoin_if_alone, addresses=addresses())
        try:  # None: our routing table has peers already; a number: how many peers answered now
            answered = dht.run_coroutine(rejoin, return_future=True).result(timeout=3 * JOIN_RETRY_S)
        except Exception as error:  # the DHT is busy: count it as not joined yet
            logger.debug(f"join check failed: {error!r}")
            answered = 0
        if answered is None or answered > 0:
            return True
        if time.monotonic() > deadline:
            return False
        if warn:
            logger.warning("None of --initial_peers answered a ping yet; trying again")
        time.sleep(JOIN_RETRY_S)


def visible_maddrs(dht: Any) -> list[str]:
    """This peer's multiaddrs other peers can dial: loopback ones only when nothing else is visible."""
    addresses = [str(address) for address in dht.get_visible_maddrs()]
    public = [address for address in addresses if "/ip4/127." not in address and "/ip6/::1/" not in address]
    return public or addresses


PRIVATE_NETWORKS = ("10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "100.64.0.0/10")  # RFC 1918 and carrier NAT


def reachability_note(addresses: list[str]) -> str:
    """A warning for the join line when every address of this box is behind NAT (10.x, 172.16-31.x, 192.168.x,
    100.64-127.x) and none is a relay's (/p2p-circuit): boxes outside its LAN cannot dial it, so they cannot join
    through it (README, Behind NAT: a NATed box averages and serves its state over connections it opened)."""
    import ipaddress

    networks = [ipaddress.ip_network(n) for n in PRIVATE_NETWORKS]
    if not addresses or any("/p2p-circuit" in a or not a.startswith("/ip4/") for a in addresses):
        return ""
    hosts = sorted({a.split("/")[2] for a in addresses})
    if not all(any(ipaddress.ip_address(h) in n for n in networks) for h in hosts):
        return ""
    return (
        f"Note: this box's addresses are private ({', '.join(hosts)}): only boxes in its LAN can join through "
        "it. Boxes elsewhere should join through a box with a public address, or forward a port here and pass "
        "--host_maddrs /ip4/0.0.0.0/tcp/<port> --announce_maddrs /ip4/<public ip>/tcp/<port>"
    )


JOIN_FILE = "join.txt"  # in the box's checkpoint folder: its join line
PLACEHOLDERS = ("<your ImageFolder dataset>", "<this box's port>", "<its own key file>", "<its checkpoint folder>")


def join_command(dht: Any, settings: SwarmSettings) -> str:
    """The command another box runs to join this peer's swarm (never with the secret itself), its placeholders in
    angle brackets: a fixed port and an identity file of its own (a port its firewall can open, and an address that
    stays valid across its restarts: the other boxes dial it too), a checkpoint folder of its own, the swarm's recipe,
    then this peer's addresses and the initial peers it joined through (the line works while any of them runs)."""
    from vissl_swarm.recipe import recipe_words

    peers = " ".join(dict.fromkeys([*visible_maddrs(dht), *settings.initial_peers]))
    secret = " --swarm_secret_file <a copy of the swarm's key file>" if settings.secret() is not None else ""
    run_id, preflight = settings.run_id, ""
    if settings.preflight_s > 0:  # the joiner's --preflight appends the suffix itself
        run_id, preflight = run_id.removesuffix(PREFLIGHT_SUFFIX), f" --preflight {settings.preflight_s:g}"
    data, port, key, folder = PLACEHOLDERS
    recipe = "".join(f" {word}" for word in recipe_words(settings.recipe))
    return (
        f"{interpreter()} run_trainer.py --config {settings.config_name or '<config>'} --run_id {run_id}"
        f"{preflight} --data_path {data}{secret} --host_maddrs /ip4/0.0.0.0/tcp/{port} --identity_path {key} "
        f"--checkpoint_dir {folder}{recipe} --initial_peers {peers}"
    )


def interpreter() -> str:
    """How the join line names Python: as this box ran it when it lives in the working folder (``.venv/bin/python``,
    as the README's commands), else ``python``."""
    path = os.path.relpath(sys.executable)
    return path if not path.startswith("..") and not os.path.isabs(path) else "python"


def use_shared_dht(dht: Any) -> None:
    global _shared_dht
    _shared_dht = dht


def take_shared_dht() -> Any:
    """The DHT run_trainer.py started in this process, or None in a spawned worker."""
    return _shared_dht
