"""The averager process's side of vetting: whom a peer lets into its groups, and whom it averages with once a group
formed. ``GroupGuard`` is a ``DecentralizedAverager`` mixin of our ``averager.Averager``.

hivemind 1.1.12 gives us two places, both in the averager process:

- ``rpc_join_group`` (a leader answering a join request, averager.py ``rpc_join_group`` -> matchmaking.py
  ``Matchmaking.rpc_join_group``): we refuse, before hivemind looks at it, a request whose gathered token does not
  match its libp2p-authenticated sender (swarm secret), or that comes from a peer refused in one of our recent groups.
  A refused follower just asks the next leader (matchmaking.py ``_request_join_group``).
- ``_aggregate_with_group`` (averager.py): every member holds the same ``GroupInfo`` (peer ids and gathered data, in
  the leader's order), so the verdict of :func:`outliers.judge_group` is the same everywhere. The members it keeps
  run hivemind's AllReduce among themselves (same group id, a ``GroupInfo`` without the others); the refused ones
  skip it. A refused peer that runs other code and sends its parts anyway is turned away by the others'
  AllReduceRunner (allreduce.py ``rpc_aggregate_part``: it is not among their senders).

The step's result (what ``StepControl.result()`` returns in the trainer's process) is the *whole* gathered dict, so
the trainer reaches the same verdict (``vetting``) and logs, counts and heals.
"""

from __future__ import annotations

import ctypes
import logging
import multiprocessing as mp
from collections.abc import Callable, Mapping
from typing import Any, AsyncIterator  # noqa: UP035 (hivemind's ServicerBase only parses typing hints)

import hivemind
from hivemind.averaging.group_info import GroupInfo
from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils import get_dht_time

from .outliers import OutlierRule, Verdict, judge_group
from .secret import SwarmSecret

logger = logging.getLogger(__name__)

BAN_S = 30.0  # how long a leader refuses the join requests of a peer that a verdict refused


def member_test(secret: SwarmSecret | None) -> Callable[[PeerID, object], bool] | None:
    """``is_member`` for :func:`outliers.judge_group`: does this token prove that this peer holds the secret?"""
    if secret is None:
        return None
    return lambda peer, token: secret.is_member(peer.to_bytes(), token)


def group_verdict(
    gathered: Mapping[PeerID, Any], summary_size: int, rule: OutlierRule, secret: SwarmSecret | None
) -> tuple[dict, Verdict[PeerID]]:
    """The verdict on one group from its gathered payloads: the same in every member and in both processes."""
    return judge_group(gathered, summary_size, rule, member_test(secret))


class JoinRefusals:
    """Join requests refused, counted in the averager process and read by the trainer's (``counters``). Created by
    the trainer, handed to each averager it starts: the counts survive an averager restart."""

    def __init__(self) -> None:
        self.banned = mp.Value(ctypes.c_long, 0)  # from a peer refused in one of our recent groups
        self.token = mp.Value(ctypes.c_long, 0)  # without a valid swarm token

    @staticmethod
    def count(value: Any) -> None:
        with value.get_lock():
            value.value += 1


class GroupGuard(hivemind.DecentralizedAverager):
    """A DecentralizedAverager that refuses outsiders and recent outliers at matchmaking and averages only with the
    members a group's verdict keeps. Every member gathers ``vetting.RoundVetting.payload()``.

    ``ban_s``: how long a peer refused by a verdict is refused at our matchmaking too (as leader; as a follower we may
    still meet it in someone else's group, where the verdict decides again). A verdict that keeps it lifts the ban.
    """

    _rpc_handlers = None  # hivemind caches handlers per class: collect ours
    _stub_type = None

    def __init__(
        self,
        *args,
        summary_size: int = 0,
        secret: SwarmSecret | None = None,
        rule: OutlierRule | None = None,
        refusals: JoinRefusals | None = None,
        ban_s: float = BAN_S,
        **kwargs,
    ):
        """Defaults (no rule, no secret): an averager on its own, as hivemind's, whose groups nobody vets."""
        self.summary_size, self.secret, self.ban_s, self.rule = summary_size, secret, ban_s, rule
        self.refusals = refusals if refusals is not None else JoinRefusals()
        self._banned_until: dict[PeerID, float] = {}  # averager process only
        self._logged_outsiders: set[PeerID] = set()
        super().__init__(*args, **kwargs)

    def verdict(self, gathered: Mapping[PeerID, Any]) -> Verdict[PeerID]:
        return group_verdict(gathered, self.summary_size, self.rule, self.secret)[1]

    # --- averager process ---
    def _join_refusal(
        self,
        request: averaging_pb2.JoinRequest,
        sender: PeerID,
    ) -> averaging_pb2.MessageFromLeader | None:
        until = self._banned_until.get(sender)
        if until is not None and until > get_dht_time():
            JoinRefusals.count(self.refusals.banned)
            return averaging_pb2.MessageFromLeader(code=averaging_pb2.NOT_LOOKING_FOR_GROUP)
        self._banned_until.pop(sender, None)
        if self.secret is None:
            return None
        try:
            _bandwidth, _mode, user_bytes = self.serializer.loads(request.gather)
            token = self.serializer.loads(user_bytes).get("token")
        except Exception:  # anything malformed: not one of ours
            token = None
        if self.secret.is_member(sender.to_bytes(), token):
            return None
        JoinRefusals.count(self.refusals.token)
        if sender not in self._logged_outsiders:  # once per peer: it asks again every round
            self._logged_outsiders.add(sender)
            logger.warning(
                f"Refused a join request from {sender}: no valid swarm token (it knows this swarm's "
                "averaging key but not its secret)"
            )
        return averaging_pb2.MessageFromLeader(code=averaging_pb2.PROTOCOL_VIOLATION)

    async def rpc_join_group(
        self, request: averaging_pb2.JoinRequest, context: P2PContext
    ) -> AsyncIterator[averaging_pb2.MessageFromLeader]:
        refusal = self._join_refusal(request, context.remote_id)
        if refusal is not None:
            yield refusal
            return
        async for message in super().rpc_join_group(request, context):
            yield message

    def _decode_gathered(self, group_info: GroupInfo) -> dict[PeerID, Any]:
        """Each member's user payload; None for one that cannot be decoded (the verdict refuses it)."""
        gathered: dict[PeerID, Any] = {}
        for peer, data in zip(group_info.peer_ids, group_info.gathered, strict=True):
            try:
                gathered[peer] = self.serializer.loads(self.serializer.loads(data)[2])
            except Exception:
                gathered[peer] = None
        return gathered

    async def _aggregate_with_group(self, group_info: GroupInfo, min_vector_size: int, **kwargs) -> Any:
        if self.rule is None and self.secret is None:  # nobody vets: hivemind's averager
            return await self._allreduce(group_info, min_vector_size, **kwargs)
        gathered = self._decode_gathered(group_info)
        verdict = self.verdict(gathered)
        if self.peer_id not in verdict.outliers:
            until = get_dht_time() + self.ban_s
            for peer in verdict.outliers:
                self._banned_until[peer] = until
            for peer in verdict.inliers:
                self._banned_until.pop(peer, None)
        kept = [i for i, peer in enumerate(group_info.peer_ids) if peer not in verdict.outliers]
        if self.peer_id in verdict.outliers or len(kept) < 2:  # refused, or nobody left to average with
            self._running_groups[group_info.group_id].cancel()  # registered by hivemind, ends without an AllReduce
            return gathered
        if len(kept) < len(group_info.peer_ids):
            group_info = GroupInfo(
                group_info.group_id,
                tuple(group_info.peer_ids[i] for i in kept),
                tuple(group_info.gathered[i] for i in kept),
            )
        await self._allreduce(group_info, min_vector_size, **kwargs)
        return gathered

    async def _allreduce(self, group_info: GroupInfo, min_vector_size: int, **kwargs) -> Any:
        """hivemind's AllReduce of this group (the only place where one runs)."""
        return await super()._aggregate_with_group(group_info, min_vector_size, **kwargs)
