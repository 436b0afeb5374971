"""Vetting, an optional part: whom a peer averages with, what a round must pass before its update is applied, and
the heal of a peer its group found diverged. ``judge`` applies ``outliers``' rules to one group's gathered payloads,
the same verdict in every member and in both processes: the averager's ``GroupGuard`` (refused joins; only the kept
members run the AllReduce) and the scheduler's ``RoundVetting`` (payload, verdict, update check); the trainer heals
at a step boundary (``heal_if_asked``, outside ``dsgd.lock``), taking a donor's state and keeping its step count."""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from hivemind.averaging.group_info import GroupInfo
from hivemind.p2p import PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils import get_dht_time

from .hivemind_slow_peer_fixes import SharedCounts
from .outliers import OutlierRule, Summary, UpdateCheck, Verdict, WeightSketch, expected_update_norm
from .secret import MembershipCheck, SwarmSecret

if TYPE_CHECKING:  # the trainer's side only names them: the averager (which imports this module) is below them
    from .rounds import Round, RoundBook, TrainerState
    from .state_transfer import StateTransfer
    from .supervisor import AveragerSupervisor

logger = logging.getLogger(__name__)

COUNTERS = (  # RoundVetting.counts
    *"rounds_outliers_excluded rounds_refused_as_outlier rounds_rejected_large_update".split(),
    *"outlier_heals outlier_heals_failed".split(),
)
JOIN_COUNTS = ("joins_refused_banned", "joins_refused_token")  # GroupGuard.counts, added to by the averager
LOCK_POLL_S = 0.1  # longest the summary waits for dsgd.lock (then the round starts at a later tick)
REFUSED = "refused by its group as an outlier"  # discard reasons (the records' "error")
ALONE = "no groupmate left after refusing outliers"
TOO_LARGE = "update larger than expected"


@dataclass
class Judgement:
    """What :meth:`RoundVetting.judge` found about one ended round."""

    group: list[str]  # the members whose values were averaged: the verdict's inliers
    refusal: str | None = None  # why the result must not be applied; None: go on
    expected: float | None = None  # the size of the update that the summaries predict
    own_norm: float = 0.0  # |w| in our summary: the scale of the update check's floor


def judge(
    gathered: Mapping[PeerID, Any], size: int, rule: OutlierRule | None, secret: SwarmSecret | None
) -> tuple[dict[PeerID, Summary | None], Verdict[PeerID]]:
    """The verdict on one group from its gathered payloads (``{"summary": Summary.to_wire(), "token": ...}``), and
    the parsed summaries. With a secret, a member whose token does not prove it holds it is refused before its
    weights are looked at; without a rule, that is the only test."""
    refused: dict[PeerID, str] = {}
    summaries: dict[PeerID, Summary | None] = {}
    for peer, payload in gathered.items():
        payload = payload if isinstance(payload, dict) else {}
        if secret is not None and not secret.is_member(peer.to_bytes(), payload.get("token")):
            refused[peer] = "no valid swarm token (not a member of this swarm)"
        else:
            summaries[peer] = Summary.from_wire(payload.get("summary"), size)
    verdict = rule.judge(summaries) if rule is not None else Verdict(tuple(summaries))
    outliers = {p: refused.get(p) or verdict.outliers[p] for p in gathered if p in refused or p in verdict.outliers}
    return summaries, dataclasses.replace(verdict, members=tuple(gathered), outliers=outliers)


class GroupGuard:
    """The averager process's side: whom it lets into its groups, whom it averages with once a group formed. Built in
    the trainer's process (sketch, rule and secret shared with ``RoundVetting``; ``counts`` in shared memory) and handed
    to every averager it starts. ``ban_s``: how long a leader refuses a peer a verdict refused."""

    BAN_S = 30.0

    def __init__(self, sketch: WeightSketch, secret: SwarmSecret | None = None, ban_s: float = BAN_S):
        self.sketch, self.secret, self.ban_s = sketch, secret, ban_s
        self.rule, self.counts = OutlierRule(), SharedCounts(JOIN_COUNTS)
        self._banned_until: dict[PeerID, float] = {}  # averager process only
        self._logged_outsiders: set[PeerID] = set()

    def refuse_join(
        self, serializer: Any, request: averaging_pb2.JoinRequest, sender: PeerID
    ) -> averaging_pb2.MessageFromLeader | None:
        """A leader's answer to a join request it refuses; None: let hivemind answer it."""
        until = self._banned_until.get(sender)
        if until is not None and until > get_dht_time():
            self.counts.add("joins_refused_banned")
            return averaging_pb2.MessageFromLeader(code=averaging_pb2.NOT_LOOKING_FOR_GROUP)
        self._banned_until.pop(sender, None)
        if self.secret is None:
            return None
        try:
            _bandwidth, _mode, user_bytes = serializer.loads(request.gather)
            token = serializer.loads(user_bytes).get("token")
        except Exception:  # anything malformed: not one of ours
            token = None
        if self.secret.is_member(sender.to_bytes(), token):
            return None
        self.counts.add("joins_refused_token")
        if sender not in self._logged_outsiders:  # once per peer: it asks again every round
            self._logged_outsiders.add(sender)
            logger.warning(
                f"Refused a join request from {sender}: no valid swarm token (it knows this swarm's "
                "averaging key but not its secret)"
            )
        return averaging_pb2.MessageFromLeader(code=averaging_pb2.PROTOCOL_VIOLATION)

    def vet(self, serializer: Any, group_info: GroupInfo, own: PeerID) -> tuple[dict[PeerID, Any], GroupInfo | None]:
        """The group's gathered payloads (None for one that cannot be decoded), and the group to average with: the
        members the verdict keeps (same group id); None if we are refused or left alone."""
        gathered: dict[PeerID, Any] = {}
        for peer, data in zip(group_info.peer_ids, group_info.gathered, strict=True):
            try:
                gathered[peer] = serializer.loads(serializer.loads(data)[2])
            except Exception:
                gathered[peer] = None
        verdict = judge(gathered, self.sketch.size, self.rule, self.secret)[1]
        if own in verdict.outliers:
            return gathered, None
        until = get_dht_time() + self.ban_s
        self._banned_until.update(dict.fromkeys(verdict.outliers, until))
        for peer in verdict.inliers:
            self._banned_until.pop(peer, None)
        kept = [i for i, peer in enumerate(group_info.peer_ids) if peer not in verdict.outliers]
        if len(kept) < 2:
            return gathered, None
        peers, data = (tuple(items[i] for i in kept) for items in (group_info.peer_ids, group_info.gathered))
        return gathered, GroupInfo(group_info.group_id, peers, data)


class RoundVetting:
    """The trainer's side: one peer's summaries, verdicts, update check, heal and membership check. ``guard``: the
    averager's; ``membership``: says when our secret matches nobody's (None: nobody to tell); ``heal_timeout``: how
    long a heal waits for a donor."""

    def __init__(
        self,
        guard: GroupGuard,
        trainer: TrainerState,
        book: RoundBook,
        supervisor: AveragerSupervisor,
        state: StateTransfer,
        membership: MembershipCheck | None,
        *,
        peer_id: PeerID,
        heal_timeout: float,
        update_check: UpdateCheck | None = None,
    ):
        self.trainer, self.tensors, self.book = trainer, trainer.tensors, book
        self.supervisor, self.state = supervisor, state
        self.counts, self.peer_id, self.heal_timeout = dict.fromkeys(COUNTERS, 0), peer_id, heal_timeout
        self.sketch, self.rule, self.secret = guard.sketch, guard.rule, guard.secret
        self.update_check = update_check or UpdateCheck()
        self.membership = membership
        # the point of the last average we applied (or of a heal) and our local step it stands for: changed with
        # dsgd.lock held, as the weights they describe are (so a summary's point and reference always agree)
        self._reference: np.ndarray | None = None
        self._reference_step: int | None = None
        self._pending: dict[int, tuple[np.ndarray, int | None]] = {}  # round -> its average's point, until applied
        self._pending_lock = threading.Lock()  # the scheduler adds, the trainer takes
        self._heal = threading.Event()  # set by the scheduler thread, cleared by the trainer's after the heal
        self._met_member = False  # a round had another member of the swarm since the last membership poll

    # --- scheduler thread ---
    def payload(self) -> dict[str, Any] | None:
        """What we gather when a round starts; None: start no round now (we are healing, or the trainer holds
        dsgd.lock: the next tick asks again)."""
        trainer = self.trainer
        if self._heal.is_set() or not trainer.lock.acquire(timeout=LOCK_POLL_S):
            return None
        try:
            point, step = self.sketch(self.tensors.local()), trainer.local_step
            summary = Summary(np.asarray(point), step, self._reference, self._reference_step)
        finally:
            trainer.lock.release()
        payload: dict[str, Any] = {"summary": summary.to_wire()}
        if self.secret is not None:
            payload["token"] = self.secret.member_token(self.peer_id.to_bytes())
        return payload

    def accept_group(self, r: Round) -> bool:
        """A group formed: not while a heal is pending (our weights would only pull the others)."""
        return not self._heal.is_set()

    def on_tick(self) -> None:
        if self.membership is None:
            return
        line = self.membership.poll(time.monotonic(), group_formed=self._met_member)
        self._met_member = False
        if line is not None:
            logger.error(f"DecentralizedSGD: {line}")

    def judge(self, r: Round, gathered: Mapping[PeerID, Any]) -> Judgement:
        """A triggered round ended with hivemind's gathered payloads: the verdict our averager process reached too."""
        own = self.peer_id
        summaries, verdict = judge(gathered, self.sketch.size, self.rule, self.secret)
        if any(peer != own and "token" not in verdict.outliers.get(peer, "") for peer in gathered):
            self._met_member = True  # another member of the swarm (with a secret: one whose token matched)
        group = [str(peer) for peer in verdict.inliers]
        r.extra["outliers"] = [str(peer) for peer in verdict.outliers]
        if own in verdict.outliers:
            self.counts["rounds_refused_as_outlier"] += 1
            if not r.stale:  # a round that started before a heal says nothing about the healed weights
                self._ask_heal(r, verdict.explain(own))
            return Judgement(group, REFUSED)
        if verdict.outliers:
            self.counts["rounds_outliers_excluded"] += 1
            if len(verdict.inliers) < 2:
                logger.warning(
                    f"Round {r.index}: no groupmate left after refusing outliers, keeping local weights: "
                    f"{verdict.describe()}"
                )
                return Judgement(group, ALONE)
            logger.warning(
                f"Round {r.index}: averaged without {len(verdict.outliers)} member(s) of the group: "
                f"{verdict.describe()}"
            )
        own_summary = summaries.get(own)
        return Judgement(
            group, None, expected_update_norm(summaries, verdict, own), 0.0 if own_summary is None else own_summary.norm
        )

    def check_update(
        self, r: Round, judgement: Judgement, update_norm: float, update: Sequence[torch.Tensor] | None = None
    ) -> str | None:
        """The update of a round the verdict kept (finite): None to apply it, else why not. ``update``: its tensors,
        to measure it as the summaries measure the expected one (None: its size only, see ``UpdateCheck``)."""
        r.extra["update_norm"] = update_norm
        sketched = None if update is None else float(np.linalg.norm(self.sketch.project(update)))
        ok, line = self.update_check.check(update_norm, judgement.expected, judgement.own_norm, sketched)
        if ok:
            return None
        self.counts["rounds_rejected_large_update"] += 1
        logger.warning(f"Round {r.index}: the update is far larger than expected, keeping local weights: {line}")
        return TOO_LARGE

    def reference_of(self, averaged: Sequence[torch.Tensor]) -> np.ndarray:
        """The point of a round's averaged values (holding the averager's buffers), kept if the round is applied."""
        return np.asarray(self.sketch(averaged))

    def accepted(self, r: Round, reference: np.ndarray, update_norm: float) -> None:
        """A round's update goes to the trainer: its size joins our history; its average becomes our reference once
        the trainer applied it (``applied``)."""
        with self._pending_lock:
            self._pending[r.index] = (reference, r.step_at_snapshot)
        self.update_check.applied(update_norm)

    def _ask_heal(self, r: Round, why: str) -> None:
        if self._heal.is_set():
            return
        logger.error(
            f"DecentralizedSGD: this peer's weights diverged from the swarm's (round {r.index}: {why}). It takes the "
            "swarm's state now (load_state_from_peers) and does not average until then; look for what made it "
            "diverge (the learning rate, the data, the hardware)"
        )
        self._heal.set()

    # --- trainer thread ---
    def applied(self, rounds: list[Round]) -> None:
        """Holding dsgd.lock, right after the trainer added these rounds' updates (oldest first)."""
        if not rounds:
            return
        with self._pending_lock:
            for r in rounds:
                if r.index in self._pending:
                    self._reference, self._reference_step = self._pending[r.index]
            for index in [index for index in self._pending if index <= rounds[-1].index]:
                del self._pending[index]  # these, and older ones that were discarded

    def heal_if_asked(self) -> bool:
        """At a step boundary, outside dsgd.lock: take the swarm's state if a group found us diverged. Returns whether
        it took it (the parameters changed)."""
        if not self._heal.is_set():
            return False
        trainer, t0 = self.trainer, time.monotonic()
        averager = self.supervisor.averager
        sharing = averager.allow_state_sharing
        averager.allow_state_sharing = False  # nobody downloads our diverged weights meanwhile
        self.book.cancel_untriggered("healing")  # hivemind owns the triggered ones; their results are discarded (stale)
        step, samples = trainer.local_step, trainer.samples
        try:
            taken = self.state.load(averager, self.heal_timeout, accept=None) is not None
        finally:
            averager.allow_state_sharing = sharing
        if taken:
            with trainer.lock:
                trainer.took_over(step, samples)  # the swarm's weights, our own step count
                with self._pending_lock:
                    self._pending.clear()
                self._reference = np.asarray(self.sketch(self.tensors.local()))  # shared with the swarm
                self._reference_step = step
            self.update_check.reset()
            self.counts["outlier_heals"] += 1
            logger.warning(
                f"DecentralizedSGD: took the swarm's state in {time.monotonic() - t0:.1f}s; averaging resumes"
            )
        else:
            self.counts["outlier_heals_failed"] += 1
            logger.error(
                "DecentralizedSGD: could not take the swarm's state (no peer shared it in time); this peer "
                "keeps training and tries again when a group refuses it next"
            )
        self._heal.clear()
        return taken
