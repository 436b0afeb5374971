"""How many samples the whole swarm has trained on: the position of the swarm-wide schedule.

A run's recipe (``num_epochs: 100``) is a budget of samples for the whole swarm, as a DDP run's epochs count the
global batch: three equal boxes each train about a third of it. What every box needs to know is how far the swarm
is, and that count must

- grow only, and survive boxes leaving: a box that left still did its samples;
- survive restarts: it lives in every box's memory and checkpoint, and travels with state downloads to joiners;
- be raised only by the box that did the work.

So it is a grow-only counter (a G-counter): every box counts its own samples; the swarm's count is the sum, over
the boxes ever seen, of the largest count seen from each. Each count is signed with its box's RSA key (hivemind's
process-wide key, the one that signs its DHT records) over the run's name, so a count read from the DHT, a
checkpoint or a donor's state download is taken only if its signature checks: nobody can raise another box's
count, nor replay one from another run. With a swarm secret, the DHT takes records from members only.

The count rides in the box's one record under ``<run_id>_peers`` with what the monitor shows (``run_monitor.py``)
and what makes the run one: its config and recipe (a box of another recipe counts for another run). A record that
says its box left takes it out of the live count at once; a box restarted with the same identity replaces its
earlier life's record (:func:`live_records`).

Why not hivemind's ``ProgressTracker``: it counts samples toward its *global epoch* and resets them at every
epoch, it sums only live records (a box that left takes its samples with it, since signed DHT records expire and
only their author can refresh them), and it saves nothing. Its way of publishing (a signed record per peer under
one key, refreshed every few seconds, extrapolated by each peer's speed between refreshes) is the one used here.

hivemind + pydantic only (no VISSL): the VISSL task and the plain-PyTorch benchmark both use it.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import pydantic.v1 as pydantic  # hivemind's SchemaValidator is written against pydantic's v1 API
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.schema import BytesWithPublicKey, SchemaValidator
from hivemind.dht.validation import RecordValidatorBase
from hivemind.utils import MSGPackSerializer, get_dht_time
from hivemind.utils.crypto import RSAPrivateKey, RSAPublicKey

from decentralized_sgd.secret import SwarmSecret, SwarmSecretValidator

logger = logging.getLogger(__name__)

PERIOD_S = 3.0  # publish our record and read the others' this often (ProgressTracker's default refresh period)
EXPIRATION_S = 60.0  # a record lives this long in the DHT; a box whose record is gone is not counted as live
DHT_TIMEOUT_S = 10.0  # one store or get that takes longer is given up (and retried next period)
SHUTDOWN_TIMEOUT_S = 5.0  # the last record is published within this at shutdown
Text = pydantic.constr(strict=True, max_length=256)


class PeerRecord(pydantic.BaseModel):
    """One box's record: its signed count (``owner`` to ``signature``, signed again by the box so that it can be
    checked after it left the DHT: in a checkpoint, a state download), the run it counts for (``run``: run id,
    config and recipe hash; ``recipe``: the values that decide the schedule), whether it ``left``, and what the monitor
    shows. Strict types and no defaults: hivemind rejects a record that pydantic would have to convert or complete."""

    owner: pydantic.StrictBytes  # the box's RSA public key (hivemind's RSAPublicKey.to_bytes())
    samples: pydantic.conint(ge=0, strict=True)
    batch: pydantic.conint(ge=1, strict=True)  # the box's batch (all its GPUs): the swarm's batch is their sum
    signature: pydantic.StrictBytes
    run: Text
    config: Text
    recipe: dict[Text, Text]
    peer_id: Text  # the box's libp2p id: stable across restarts with --identity_path, unlike the process's RSA key
    time: pydantic.StrictFloat  # the publisher's wall clock (time.time())
    left: pydantic.StrictBool  # the box ended or was stopped: out of the count at once
    samples_per_s: pydantic.confloat(ge=0.0, strict=True)  # not signed: only for the estimate between reads
    step: pydantic.conint(ge=0, strict=True)
    loss: pydantic.StrictFloat | None  # None when not finite (NaN != NaN would fail hivemind's equality check)
    group_size: pydantic.conint(ge=1, strict=True) | None  # of the last applied averaging round; None: none yet
    staleness_steps: pydantic.conint(ge=0, strict=True) | None
    rounds_ok: pydantic.conint(ge=0, strict=True)
    rounds_failed: pydantic.conint(ge=0, strict=True)
    averager_failures: pydantic.conint(ge=0, strict=True)  # times the averager was found dead or unresponsive
    no_group_s: pydantic.confloat(ge=0.0, strict=True)  # seconds since its last applied round (or its start)


class PeersSchema(pydantic.BaseModel):
    """The DHT key ``<run_id>_peers``: {owner's public key subkey: that owner's PeerRecord}."""

    peers: dict[BytesWithPublicKey, PeerRecord]


def records_key(run_id: str) -> str:
    return f"{run_id}_peers"


def record_validators(
    run_id: str, private_key: RSAPrivateKey | None = None, secret: SwarmSecret | None = None
) -> list[RecordValidatorBase]:
    """The schema of the records key and hivemind's signature check (the subkey is the owner's public key, so no
    box can overwrite another's record), and the swarm secret's check if there is one. Every DHT that reads the key
    needs them, the monitor's included (hivemind cannot decode a signed value without its validator). Adding them
    again with the same key is harmless; with another key, hivemind keeps the DHT's first one and leaves records of
    the other unsigned (``swarm.start_dht`` adds them with this process's key)."""
    validators = [SchemaValidator(PeersSchema, prefix=run_id), RSASignatureValidator(private_key)]
    return validators + ([SwarmSecretValidator(secret)] if secret is not None else [])


def fetch_records(dht: Any, run_id: str, timeout: float = DHT_TIMEOUT_S) -> dict[bytes, dict[str, Any]]:
    """{subkey: record} of every record in the DHT whose subkey is its owner's; TimeoutError if the DHT does not
    answer in time. ``dht`` must have :func:`record_validators`."""
    found = dht.get(records_key(run_id), latest=True, return_future=True).result(timeout=timeout)
    records = {}
    for subkey, entry in (found.value if found is not None and isinstance(found.value, dict) else {}).items():
        try:
            record = PeerRecord.parse_obj(entry.value).dict()
        except (pydantic.ValidationError, AttributeError, TypeError):
            continue
        if subkey == RSASignatureValidator.PUBLIC_KEY_FORMAT.replace(b"_key_", record["owner"]):
            records[subkey] = record  # the DHT checked the subkey's signature: the record is that owner's
    return records


def live_records(records: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """The boxes training now: per box (its peer id), its newest record, unless that record says it left. A box
    restarted with the same identity has a new process key, so a new record: it replaces the one of its earlier
    life. What the trainers count and what the monitor shows."""
    newest: dict[str, dict[str, Any]] = {}
    for record in records:
        if record["peer_id"] not in newest or record["time"] > newest[record["peer_id"]]["time"]:
            newest[record["peer_id"]] = record
    return [record for record in newest.values() if not record["left"]]


def status_fields(
    *,
    step: int = 0,
    loss: float | None = None,
    group_size: int | None = None,
    staleness_steps: int | None = None,
    rounds_ok: int = 0,
    rounds_failed: int = 0,
    averager_failures: int = 0,
    no_group_s: float = 0.0,
) -> dict[str, Any]:
    """What the trainer reports for the monitor, coerced to the record's exact types (a non-finite loss: None)."""
    finite = loss is not None and math.isfinite(float(loss))
    return {
        "step": max(0, int(step)),
        "loss": float(loss) if finite else None,
        "group_size": int(group_size) if group_size is not None and group_size >= 1 else None,
        "staleness_steps": max(0, int(staleness_steps)) if staleness_steps is not None else None,
        "rounds_ok": max(0, int(rounds_ok)),
        "rounds_failed": max(0, int(rounds_failed)),
        "averager_failures": max(0, int(averager_failures)),
        "no_group_s": round(max(0.0, float(no_group_s)), 1) if math.isfinite(float(no_group_s)) else 0.0,
    }


@dataclass(frozen=True)
class SignedCount:
    """One box's sample count, signed by that box for one run."""

    owner: bytes
    samples: int
    batch: int
    signature: bytes

    @staticmethod
    def payload(run: str, owner: bytes, samples: int, batch: int) -> bytes:
        return MSGPackSerializer.dumps(["swarm_progress", run, owner, samples, batch])

    @classmethod
    def sign(cls, run: str, key: RSAPrivateKey, samples: int, batch: int) -> SignedCount:
        owner = key.get_public_key().to_bytes()
        return cls(owner, samples, batch, key.sign(cls.payload(run, owner, samples, batch)))

    def verify(self, run: str) -> bool:
        try:
            public_key = RSAPublicKey.from_bytes(self.owner)
            return public_key.verify(self.payload(run, self.owner, self.samples, self.batch), self.signature)
        except Exception:  # a malformed key: not a count we can trust
            return False

    def to_wire(self) -> list:
        """Plain values (msgpack and torch.save keep them as they are)."""
        return [self.owner, self.samples, self.batch, self.signature]

    @classmethod
    def from_wire(cls, wire: Any) -> SignedCount | None:
        try:
            owner, samples, batch, signature = wire
            if not (isinstance(owner, bytes) and isinstance(signature, bytes)):
                return None
            return cls(owner, int(samples), int(batch), signature)
        except (TypeError, ValueError):
            return None


@dataclass
class _Seen:
    """What we know of one box: its largest signed count, and, while its record is live, its speed."""

    count: SignedCount
    received_at: float = 0.0  # time.monotonic() when its count last grew (for the estimate between reads)
    samples_per_s: float = 0.0
    live: bool = False  # its record was in the DHT at our last read


class SwarmProgress:
    """This box's record in the swarm (its count and status) and its view of the others'.

    Threads: the trainer's calls :meth:`add`, :meth:`report`, :meth:`position` and :meth:`swarm_batch` (no DHT call,
    no tensor, one short lock); a background thread publishes our record and reads the others' every ``period``
    seconds; :meth:`state_dict` / :meth:`load_state_dict` run in the trainer's thread (checkpoints) or hivemind's
    state-serving thread (a joiner's download). ``self._lock`` guards every field below.

    ``run``: the name the counts are signed for (run id, config, recipe hash); ``run_id``: the key the records live
    under (default ``run``), shared with boxes of another config or recipe, which are listed in :attr:`others`.
    """

    def __init__(
        self,
        dht: Any,
        run: str,
        batch: int,
        *,
        run_id: str | None = None,
        config: str = "",
        recipe: dict[str, str] | None = None,
        secret: SwarmSecret | None = None,
        period: float = PERIOD_S,
        expiration: float = EXPIRATION_S,
        private_key: RSAPrivateKey | None = None,
        start: bool = True,
    ) -> None:
        if batch < 1:
            raise ValueError(f"batch must be at least 1, got {batch}")
        self.dht, self.run, self.batch = dht, run, batch
        self.run_id, self.config, self.recipe, self.secret = run_id or run, config, dict(recipe or {}), secret
        self.period, self.expiration = period, expiration
        self._key = private_key or RSAPrivateKey.process_wide()
        self.owner = self._key.get_public_key().to_bytes()
        self.peer_id = str(dht.peer_id)
        self._subkey = RSASignatureValidator.PUBLIC_KEY_FORMAT.replace(b"_key_", self.owner)
        self._lock = threading.Lock()
        self._own = 0  # samples this box trained on since this process started (its count under self.owner)
        self._seen: dict[bytes, _Seen] = {}  # other owners: this process's earlier lives included
        self._position = 0
        self._rate_since = (time.monotonic(), 0)
        self._own_rate = 0.0
        self._status = status_fields()
        self._left = False
        self.others: list[dict[str, Any]] = []  # live records of this run id with another config or recipe
        self.refused = 0  # our records the DHT refused in a row
        self.rejected = 0  # counts whose signature did not check (from the DHT, a checkpoint or a donor)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        dht.add_validators(record_validators(self.run_id, self._key))
        if start:
            self.start()

    # --- the trainer's side ---
    def add(self, samples: int) -> None:
        with self._lock:
            self._own += samples

    def report(self, **status: Any) -> None:
        """The trainer's latest status (:func:`status_fields`' arguments), published with the next record."""
        fields = status_fields(**status)
        with self._lock:
            self._status = fields

    @property
    def own_samples(self) -> int:
        return self._own

    def position(self) -> int:
        """The swarm's samples as far as we know: the sum of the largest signed counts, plus, for boxes whose
        record is live, their speed times the time since their count last grew (at most two periods). Never less
        than the value returned before, so the schedule never steps back."""
        now = time.monotonic()
        with self._lock:
            known = self._known_locked()
            ahead = sum(
                min(now - seen.received_at, 2 * self.period) * seen.samples_per_s
                for seen in self._seen.values()
                if seen.live
            )
            self._position = max(self._position, known + int(ahead))
            return self._position

    def known_samples(self) -> int:
        """The sum of the signed counts only (no estimate)."""
        with self._lock:
            return self._known_locked()

    def _known_locked(self) -> int:
        return self._own + sum(seen.count.samples for seen in self._seen.values())

    def swarm_batch(self) -> int:
        """The summed batch of the boxes training now (:func:`live_records` at our last read), ours included: the
        global batch of the swarm as it trains now."""
        with self._lock:
            return self.batch + sum(seen.count.batch for seen in self._seen.values() if seen.live)

    def live_boxes(self) -> int:
        with self._lock:
            return 1 + sum(seen.live for seen in self._seen.values())

    # --- checkpoints and state downloads ---
    def state_dict(self) -> dict:
        """Every count we know, ours signed now: what a checkpoint keeps and what a joiner downloads."""
        own = SignedCount.sign(self.run, self._key, self._own, self.batch)
        with self._lock:
            counts = [own, *(seen.count for seen in self._seen.values())]
        return {"run": self.run, "counts": [count.to_wire() for count in counts]}

    def load_state_dict(self, state: dict | None) -> int:
        """Merge the counts of a checkpoint or a donor (their signatures checked); returns how many were taken.
        A count of ours from an earlier life of this process's key is merged like any other box's."""
        if not state:
            return 0
        taken = 0
        for wire in state.get("counts", []):
            count = SignedCount.from_wire(wire)
            if count is not None and self._merge(count):
                taken += 1
        return taken

    @staticmethod
    def total_of(state: dict | None, run: str) -> int:
        """The swarm's samples a state dict vouches for (its verified counts, the largest per box)."""
        largest: dict[bytes, int] = {}
        for wire in (state or {}).get("counts", []):
            count = SignedCount.from_wire(wire)
            if count is not None and count.verify(run):
                largest[count.owner] = max(largest.get(count.owner, 0), count.samples)
        return sum(largest.values())

    def _merge(self, count: SignedCount, samples_per_s: float | None = None) -> bool:
        """Take a count if it is signed and larger than the one we have from that box (a G-counter's merge)."""
        if count.owner == self.owner:
            return False  # ours: only this process counts it
        with self._lock:
            seen = self._seen.get(count.owner)
            if seen is not None and count.samples <= seen.count.samples:
                if samples_per_s is not None:
                    seen.samples_per_s = samples_per_s
                return False
        if not count.verify(self.run):
            with self._lock:
                self.rejected += 1
            logger.warning(
                f"Ignored a progress count with a bad signature ({count.samples} samples): a box of "
                "another run, or one that tried to count for another box"
            )
            return False
        with self._lock:
            seen = self._seen.setdefault(count.owner, _Seen(count))
            seen.count = count if count.samples >= seen.count.samples else seen.count
            seen.received_at = time.monotonic()
            if samples_per_s is not None:
                seen.samples_per_s = samples_per_s
        return True

    # --- the background thread ---
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="swarm-progress", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                if not self.publish():
                    self.refused += 1
                else:
                    self.refused = 0
                self.refresh()
                if self.refused == 2:  # twice in a row: not a record caught in a DHT that was busy
                    logger.warning(REFUSED)
            except Exception as error:  # a DHT that fails now may answer next period; training goes on
                logger.warning(
                    f"Swarm progress: could not publish or read the swarm's records ({error!r}); "
                    f"retrying in {self.period:g} s"
                )
            self._stop.wait(self.period)

    def record(self) -> dict[str, Any]:
        """Our record as we publish it now (the count and the status of one moment)."""
        samples_per_s = float(self._measure_rate())
        with self._lock:
            own, status, left = self._own, dict(self._status), self._left
        count = SignedCount.sign(self.run, self._key, own, self.batch)
        return PeerRecord(
            owner=count.owner,
            samples=count.samples,
            batch=count.batch,
            signature=count.signature,
            run=self.run,
            config=self.config,
            recipe=self.recipe,
            peer_id=self.peer_id,
            time=time.time(),
            left=left,
            samples_per_s=samples_per_s,
            **status,
        ).dict()

    def publish(self, timeout: float = DHT_TIMEOUT_S) -> bool:
        """Store our record under our subkey; True if the DHT took it."""
        future = self.dht.store(
            records_key(self.run_id),
            self.record(),
            expiration_time=get_dht_time() + self.expiration,
            subkey=self._subkey,
            return_future=True,
        )
        return bool(future.result(timeout=timeout))

    def refresh(self, timeout: float = DHT_TIMEOUT_S) -> None:
        """Read every record: merge the counts of our run; a box is live while its newest record is in the DHT and
        does not say it left (:func:`live_records`); a box that is not live stays counted."""
        records = fetch_records(self.dht, self.run_id, timeout=timeout).values()
        live = set()
        for record in live_records(r for r in records if r["peer_id"] != self.peer_id or r["owner"] == self.owner):
            if record["run"] == self.run:
                count = SignedCount(record["owner"], record["samples"], record["batch"], record["signature"])
                self._merge(count, samples_per_s=record["samples_per_s"])
                live.add(record["owner"])
        others = [r for r in live_records(records) if r["run"] != self.run and r["peer_id"] != self.peer_id]
        with self._lock:
            for owner, seen in self._seen.items():
                seen.live = owner in live
            self.others = others

    def _measure_rate(self) -> float:
        now = time.monotonic()
        with self._lock:
            since, samples = self._rate_since
            if now - since >= self.period:
                self._own_rate = (self._own - samples) / (now - since)
                self._rate_since = (now, self._own)
            return max(0.0, self._own_rate)

    def shutdown(self) -> bool | None:
        """Stop the thread and publish our last record, which says we left: the others count us out at once (our
        samples stay counted) and nobody extrapolates our count any more. True if the DHT took it; None if we had
        left already."""
        if self._stop.is_set():
            return None
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=SHUTDOWN_TIMEOUT_S)  # a daemon: one stuck in a DHT call ends with us
        with self._lock:
            self._own_rate, self._left = 0.0, True
            self._rate_since = (time.monotonic(), self._own)
        try:
            return self.publish(timeout=SHUTDOWN_TIMEOUT_S)
        except Exception:
            return False


# why the DHT refuses our record, when the members' key cannot tell: the schema and signatures are ours, so the one
# cause a user makes is a swarm secret that differs from the other boxes' (their DHTs drop a record without its tag)
REFUSED = (
    "The other boxes refuse this box's records: they run with another swarm secret, or without one, or this box runs "
    "without theirs; give every box a copy of the same --swarm_secret_file"
)


WHERE_BELOW_ONE = 1.0 - 1e-9  # VISSL's train step asserts where < 1 (classy_vision's schedulers are defined on [0, 1))


@dataclass(frozen=True)
class SwarmSchedule:
    """The recipe's position from the swarm's samples, in the units VISSL reads.

    ``budget``: the samples of the whole run, one box's recipe (``num_epochs`` x its iterations per epoch x its
    batch): the swarm together trains on that many, as a DDP run whose epochs count the global batch. A box alone
    gets exactly VISSL's own position, since its count is its iterations times its batch.
    """

    budget: int
    box_batch: int

    def where(self, position: int) -> float:
        """The share of the run done, for the LR and weight-decay schedules (clamped below 1)."""
        return min(position / self.budget, WHERE_BELOW_ONE)

    def iteration(self, position: int) -> int:
        """The swarm's position in this box's iterations: what prototype freezing and the queue's start, which
        the recipe gives in this box's iterations, are compared with."""
        return position // self.box_batch

    def done(self, position: int) -> bool:
        return position >= self.budget


SWARM_LR_RULES = ("box", "sqrt", "linear")


def swarm_lr_factor(rule: str, swarm_batch: int, box_batch: int) -> float:
    """How much a box's LR (given for its own batch) is raised while the swarm trains with ``swarm_batch`` in all:
    ``box`` not at all; ``linear`` as DDP would for the global batch; ``sqrt`` half-way (in log scale). One box
    alone: 1 whatever the rule. The rule was chosen by measurement: see README, "The LR for a swarm"."""
    if rule not in SWARM_LR_RULES:
        raise ValueError(f"unknown swarm LR rule {rule!r} (known: {', '.join(SWARM_LR_RULES)})")
    ratio = max(swarm_batch, box_batch) / box_batch
    return {"box": 1.0, "sqrt": ratio**0.5, "linear": ratio}[rule]
