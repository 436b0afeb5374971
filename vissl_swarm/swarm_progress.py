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

Why not hivemind's ``ProgressTracker``: it counts samples toward its *global epoch* and resets them at every
epoch, it sums only live records (a box that left takes its samples with it, since signed DHT records expire and
only their author can refresh them), and it saves nothing. Its way of publishing (a signed record per peer under
one key, refreshed every few seconds, extrapolated by each peer's speed between refreshes) is the one used here.

hivemind + pydantic only (no VISSL): the VISSL task and the plain-PyTorch benchmark both use it.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

import pydantic.v1 as pydantic  # hivemind's SchemaValidator is written against pydantic's v1 API
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.schema import BytesWithPublicKey, SchemaValidator
from hivemind.dht.validation import RecordValidatorBase
from hivemind.utils import MSGPackSerializer, get_dht_time
from hivemind.utils.crypto import RSAPrivateKey, RSAPublicKey

logger = logging.getLogger(__name__)

PERIOD_S = 3.0  # publish our count and read the others' this often (ProgressTracker's default refresh period)
EXPIRATION_S = 60.0  # a record lives this long in the DHT; a box whose record is gone is not counted as live
DHT_TIMEOUT_S = 10.0  # one store or get that takes longer is given up (and retried next period)
SHUTDOWN_TIMEOUT_S = 5.0  # the last count is published within this at shutdown


class ProgressRecord(pydantic.BaseModel):
    """One box's count as stored in the DHT: signed by the box (``signature``) besides the DHT's own signature, so
    that it can be checked again after it left the DHT (in a checkpoint, in a state download)."""

    owner: pydantic.StrictBytes  # the box's RSA public key (hivemind's RSAPublicKey.to_bytes())
    samples: pydantic.conint(ge=0, strict=True)
    batch: pydantic.conint(ge=1, strict=True)  # the box's batch (all its GPUs): the swarm's batch is their sum
    signature: pydantic.StrictBytes
    samples_per_s: pydantic.confloat(ge=0.0, strict=True) = 0.0  # not signed: only for the estimate between reads


class ProgressSchema(pydantic.BaseModel):
    """The DHT key ``<prefix>_swarm_progress``: {owner's public key subkey: that owner's ProgressRecord}."""

    swarm_progress: dict[BytesWithPublicKey, ProgressRecord]


def progress_key(prefix: str) -> str:
    return f"{prefix}_swarm_progress"


def progress_validators(prefix: str, private_key: RSAPrivateKey | None = None) -> list[RecordValidatorBase]:
    """The schema of the progress key and hivemind's signature check; every DHT that reads the key needs them
    (hivemind cannot decode a signed value without its validator). Adding them twice is harmless."""
    return [SchemaValidator(ProgressSchema, prefix=prefix), RSASignatureValidator(private_key)]


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
    """This box's view of the swarm's sample count.

    Threads: the trainer's calls :meth:`add`, :meth:`position` and :meth:`swarm_batch` once per step (no DHT call,
    no tensor, one short lock); a background thread publishes our signed count and reads the others' every
    ``period`` seconds; :meth:`state_dict` / :meth:`load_state_dict` run in the trainer's thread (checkpoints) or
    hivemind's state-serving thread (a joiner's download). ``self._lock`` guards every field below.
    """

    def __init__(
        self,
        dht: Any,
        run: str,
        batch: int,
        *,
        period: float = PERIOD_S,
        expiration: float = EXPIRATION_S,
        private_key: RSAPrivateKey | None = None,
        start: bool = True,
    ) -> None:
        if batch < 1:
            raise ValueError(f"batch must be at least 1, got {batch}")
        self.dht, self.run, self.batch = dht, run, batch
        self.period, self.expiration = period, expiration
        self._key = private_key or RSAPrivateKey.process_wide()
        self.owner = self._key.get_public_key().to_bytes()
        self._subkey = RSASignatureValidator.PUBLIC_KEY_FORMAT.replace(b"_key_", self.owner)
        self._lock = threading.Lock()
        self._own = 0  # samples this box trained on since this process started (its count under self.owner)
        self._seen: dict[bytes, _Seen] = {}  # other owners: this process's earlier lives included
        self._position = 0
        self._rate_since = (time.monotonic(), 0)
        self._own_rate = 0.0
        self.rejected = 0  # counts whose signature did not check (from the DHT, a checkpoint or a donor)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        dht.add_validators(progress_validators(run, self._key))
        if start:
            self.start()

    # --- the trainer's side ---
    def add(self, samples: int) -> None:
        with self._lock:
            self._own += samples

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
        """The summed batch of the boxes whose record was in the DHT at our last read (records live a minute),
        ours included: the global batch of the swarm as it trains now."""
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
                    seen.live, seen.samples_per_s = True, samples_per_s
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
                seen.live, seen.samples_per_s = True, samples_per_s
        return True

    # --- the background thread ---
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="swarm-progress", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.publish()
                self.refresh()
            except Exception as error:  # a DHT that fails now may answer next period; training goes on
                logger.warning(
                    f"Swarm progress: could not publish or read the swarm's count ({error!r}); "
                    f"retrying in {self.period:g} s"
                )
            self._stop.wait(self.period)

    def publish(self, timeout: float = DHT_TIMEOUT_S) -> bool:
        """Store our signed count (and our speed) under our subkey; True if the DHT took it."""
        count = SignedCount.sign(self.run, self._key, self._own, self.batch)
        record = ProgressRecord(
            owner=count.owner,
            samples=count.samples,
            batch=count.batch,
            signature=count.signature,
            samples_per_s=float(self._measure_rate()),
        ).dict()
        future = self.dht.store(
            progress_key(self.run),
            record,
            expiration_time=get_dht_time() + self.expiration,
            subkey=self._subkey,
            return_future=True,
        )
        return bool(future.result(timeout=timeout))

    def refresh(self, timeout: float = DHT_TIMEOUT_S) -> None:
        """Read every live record and merge its count; a box whose record is gone stays counted, not live."""
        found = self.dht.get(progress_key(self.run), latest=True, return_future=True).result(timeout=timeout)
        entries = found.value if found is not None and isinstance(found.value, dict) else {}
        live = set()
        for subkey, entry in entries.items():
            try:
                record = ProgressRecord.parse_obj(entry.value)
            except (pydantic.ValidationError, AttributeError, TypeError):
                continue
            if subkey != RSASignatureValidator.PUBLIC_KEY_FORMAT.replace(b"_key_", record.owner):
                continue  # the DHT checked the subkey's signature: the count must be that owner's
            count = SignedCount(record.owner, record.samples, record.batch, record.signature)
            self._merge(count, samples_per_s=record.samples_per_s)
            live.add(record.owner)
        with self._lock:
            for owner, seen in self._seen.items():
                seen.live = owner in live

    def _measure_rate(self) -> float:
        now = time.monotonic()
        with self._lock:
            since, samples = self._rate_since
            if now - since >= self.period:
                self._own_rate = (self._own - samples) / (now - since)
                self._rate_since = (now, self._own)
            return max(0.0, self._own_rate)

    def shutdown(self) -> None:
        """Stop the thread and publish our last count (the others keep it after our record expires)."""
        if self._stop.is_set():
            return
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=SHUTDOWN_TIMEOUT_S)  # a daemon: one stuck in a DHT call ends with us
        with self._lock:  # the last record says we stopped: nobody extrapolates our count any more
            self._own_rate = 0.0
            self._rate_since = (time.monotonic(), self._own)
        try:
            self.publish(timeout=SHUTDOWN_TIMEOUT_S)
        except Exception as error:
            logger.warning(
                f"Swarm progress: could not publish our last count ({error!r}); the others keep the one before"
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
