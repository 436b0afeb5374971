"""The swarm secret: only peers that hold it average together and write the swarm's DHT records. Three layers, as
each alone leaves a gap: a keyed prefix (the DHT keys where groups meet and the RPC names are not derived from the run
id alone; libp2p's identify still shows them), member tokens (``HMAC(secret, peer id)`` in join requests and gathered
data, checked against the sender's authenticated id), and signed DHT records (``SwarmSecretValidator``; only
``members_key`` is exempt, so a peer whose secret matches nobody's can say so). A weak secret can be guessed offline
from a tag: use ``secrets.token_hex(16)``."""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable, Mapping
from typing import Any

from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.utils import get_dht_time

TAG_BYTES = 16


class SwarmSecretError(ValueError):
    """An empty secret, or two secrets for one DHT; the message says what to do."""


class SwarmSecret:
    """A shared secret and the keyed hashes derived from it (one purpose string per use, so tags never mix)."""

    def __init__(self, secret: bytes):
        if not secret:
            raise SwarmSecretError("the swarm secret is empty")
        self._key = hashlib.sha256(b"swav-swarm-secret\0" + secret).digest()

    def __repr__(self) -> str:
        return "SwarmSecret(<hidden>)"

    def tag(self, purpose: str, *parts: bytes) -> bytes:
        """HMAC over the purpose and length-prefixed parts (so that no two different inputs share a message)."""
        message = b"".join(len(part).to_bytes(4, "big") + part for part in (purpose.encode(), *parts))
        return hmac.new(self._key, message, hashlib.sha256).digest()[:TAG_BYTES]

    def verify(self, tag: object, purpose: str, *parts: bytes) -> bool:
        return isinstance(tag, bytes) and hmac.compare_digest(tag, self.tag(purpose, *parts))

    def keyed_prefix(self, prefix: str) -> str:
        """The averaging prefix of this swarm: the run's prefix plus a keyed hash (hex, so no '.')."""
        return f"{prefix}_{self.tag('prefix', prefix.encode()).hex()[:16]}"

    def member_token(self, peer_id: bytes) -> bytes:
        """Proof of membership for the peer with this id (its join requests and gathered data carry it)."""
        return self.tag("member", peer_id)

    def is_member(self, peer_id: bytes, token: object) -> bool:
        return self.verify(token, "member", peer_id)


def keyed_prefix(prefix: str, secret: SwarmSecret | None) -> str:
    """The prefix unchanged without a secret (as before), else the keyed one."""
    return prefix if secret is None else secret.keyed_prefix(prefix)


def members_key(prefix: str) -> str:
    """The one DHT key every peer of a run writes, with or without a secret (see :func:`diagnose_members`)."""
    return f"{prefix}_members"


def announce_member(dht: Any, prefix: str, secret: SwarmSecret | None, ttl: float = 60.0) -> Any:
    """Write our entry under :func:`members_key`, a tag of our id (b"" without a secret), for ``ttl`` s; returns the
    DHT's future (True if stored)."""
    peer_id = dht.peer_id.to_bytes()
    return dht.store(
        members_key(prefix),
        subkey=peer_id,
        value=b"" if secret is None else secret.tag("members-key", peer_id),
        expiration_time=get_dht_time() + ttl,
        return_future=True,
    )


def read_members(dht: Any, prefix: str, timeout: float = 10.0) -> dict[bytes, object]:
    """{peer id bytes: tag} of the peers of this run that announced themselves; TimeoutError if the DHT is stuck."""
    return _entries(dht.get(members_key(prefix), latest=True, return_future=True).result(timeout=timeout))


def _entries(found: Any) -> dict[bytes, object]:
    if found is None or not isinstance(found.value, dict):
        return {}
    return {peer: entry.value for peer, entry in found.value.items() if isinstance(peer, bytes)}


def diagnose_members(
    entries: Mapping[bytes, object], own_peer_id: bytes, secret: SwarmSecret | None, run: str
) -> str | None:
    """The line to log when other peers of the run are online but none shares our secret (or our lack of one)."""
    others = {peer: tag for peer, tag in entries.items() if peer != own_peer_id}
    if not others:
        return None
    if any(tag == b"" if secret is None else secret.verify(tag, "members-key", peer) for peer, tag in others.items()):
        return None
    if secret is None:
        return (
            f"no peer of this swarm accepts us: {len(others)} peer(s) of run {run!r} are online, and all of them "
            "use a swarm secret; start this peer with the same --swarm_secret / --swarm_secret_file"
        )
    with_secret = sum(1 for tag in others.values() if tag)
    return (
        f"no peer of this swarm accepts our secret: {len(others)} peer(s) of run {run!r} are online, "
        f"{with_secret} with another swarm secret and {len(others) - with_secret} without one; check "
        "--swarm_secret / --swarm_secret_file (it must be the same on every peer)"
    )


class MembershipCheck:
    """Keeps our entry under :func:`members_key` fresh and, while no group formed, reads the run's entries, at first
    ``READ_PERIOD_S`` after the last group, then twice as long after each read for the rest of the run, up to
    ``READ_PERIOD_MAX_S``: each read is a DHT search that matchmaking's own searches wait behind, and a swarm whose
    groups come seconds apart would otherwise read after nearly every gap. ``problem`` is what they say of our secret
    (:func:`diagnose_members`); ``poll`` returns it once no group formed for ``patience`` s (inf: never). Never
    blocks: each call starts or collects a DHT future."""

    READ_PERIOD_S, READ_PERIOD_MAX_S = 5.0, 60.0

    def __init__(self, dht: Any, run: str, secret: SwarmSecret | None, patience: float = 60.0, ttl: float = 60.0):
        self.dht, self.run, self.secret, self.patience, self.ttl = dht, run, secret, patience, ttl
        self.problem: str | None = None
        self._next_announce = self._next_read = 0.0
        self._read_period = self.READ_PERIOD_S
        self._quiet_since: float | None = None
        self._announcing: Any = None
        self._reading: Any = None

    def poll(self, now: float, group_formed: bool) -> str | None:
        """``now``: time.monotonic(); ``group_formed``: a group formed since the previous call."""
        if (self._announcing is None or self._announcing.done()) and now >= self._next_announce:
            self._announcing = announce_member(self.dht, self.run, self.secret, self.ttl)
            self._next_announce = now + self.ttl / 3
        if group_formed or self._quiet_since is None:
            self._quiet_since, self._next_read, self.problem = now, now + min(self.patience, self._read_period), None
            return None
        if self._reading is None and now >= self._next_read:
            self._reading = self.dht.get(members_key(self.run), latest=True, return_future=True)
            self._next_read = now + self._read_period
            self._read_period = min(2 * self._read_period, self.READ_PERIOD_MAX_S)
        if self._reading is not None and self._reading.done():
            reading, self._reading = self._reading, None
            if reading.exception() is None:
                own = self.dht.peer_id.to_bytes()
                self.problem = diagnose_members(_entries(reading.result()), own, self.secret, self.run)
        if self.problem is None or now - self._quiet_since < self.patience:
            return None
        self._quiet_since = now  # said again after another ``patience`` s without a group
        return self.problem


class SwarmSecretValidator(RecordValidatorBase):
    """Every DHT record must end with an HMAC of (key, subkey, value, expiration), except under the exempt keys. Add
    it to every DHT of the swarm. Priority 20: it signs last (covering the RSA signature) and validates first."""

    _MAGIC = b"[swarm-hmac]"

    def __init__(self, secret: SwarmSecret, exempt_keys: Iterable[str] = ()):
        self._secret = SwarmSecret.__new__(SwarmSecret)  # a plain copy: it travels to the DHT process (pickled)
        self._secret._key = secret._key
        self._exempt = {DHTID.generate(source=key).to_bytes() for key in exempt_keys}

    def _record_tag(self, record: DHTRecord, value: bytes) -> bytes:
        expiration = repr(float(record.expiration_time)).encode()
        return self._secret.tag("dht-record", record.key, record.subkey, value, expiration)

    def sign_value(self, record: DHTRecord) -> bytes:
        if record.key in self._exempt:
            return record.value
        return record.value + self._MAGIC + self._record_tag(record, record.value)

    def validate(self, record: DHTRecord) -> bool:
        if record.key in self._exempt:
            return True
        suffix = len(self._MAGIC) + TAG_BYTES
        value, tail = record.value[:-suffix], record.value[-suffix:]
        if len(record.value) < suffix or not tail.startswith(self._MAGIC):
            return False
        return hmac.compare_digest(tail[len(self._MAGIC) :], self._record_tag(record, value))

    def strip_value(self, record: DHTRecord) -> bytes:
        if record.key in self._exempt:
            return record.value
        return record.value[: -(len(self._MAGIC) + TAG_BYTES)]

    @property
    def priority(self) -> int:
        return 20

    def merge_with(self, other: RecordValidatorBase) -> bool:
        """A second validator with the same secret adds its exempt keys; another secret is an error."""
        if not isinstance(other, SwarmSecretValidator):
            return False
        if other._secret._key != self._secret._key:
            raise SwarmSecretError("a DHT can serve one swarm secret only")
        self._exempt |= other._exempt
        return True
