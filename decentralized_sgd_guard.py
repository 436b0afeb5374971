"""The averager side of issue 13: whom a peer lets into its groups, and whom it averages with once a group formed.

hivemind 1.1.12 gives us two places, both in the averager process:

- ``rpc_join_group`` (a leader answering a join request, averager.py ``rpc_join_group`` -> matchmaking.py
  ``Matchmaking.rpc_join_group``): we refuse, before hivemind looks at it, a request whose gathered token does not
  match its libp2p-authenticated sender (swarm secret), or that comes from a peer refused in one of our recent groups.
  A refused follower just asks the next leader (matchmaking.py ``_request_join_group``).
- ``_aggregate_with_group`` (averager.py): every member holds the same ``GroupInfo`` (peer ids and gathered data, in
  the leader's order), so the verdict of :func:`decentralized_sgd_outliers.judge_group` is the same everywhere. The
  members it keeps run hivemind's AllReduce among themselves (same group id, a ``GroupInfo`` without the others);
  the refused ones skip it. A refused peer that runs other code and sends its parts anyway is turned away by the
  others' AllReduceRunner (allreduce.py ``rpc_aggregate_part``: it is not among their senders).

The step's result (what ``StepControl.result()`` returns in the trainer's process) is the *whole* gathered dict, so
the trainer reaches the same verdict with :meth:`GroupGuard.verdict` and logs, counts and heals.
"""

from __future__ import annotations

import ctypes
import logging
import multiprocessing as mp
from collections.abc import Mapping
from typing import Any, AsyncIterator  # noqa: UP035 (hivemind's ServicerBase only parses typing hints)

import hivemind
from hivemind.averaging.group_info import GroupInfo
from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils import get_dht_time

from decentralized_sgd_outliers import OutlierRule, Summary, Verdict, judge_group
from decentralized_sgd_secret import SwarmSecret

logger = logging.getLogger(__name__)


class GroupGuard(hivemind.DecentralizedAverager):
    """A DecentralizedAverager that refuses outsiders and recent outliers at matchmaking and averages only with the
    members a group's verdict keeps. Gather :meth:`payload` in every ``step``.

    ``ban_s``: how long a peer refused by a verdict is refused at our matchmaking too (as leader; as a follower we may
    still meet it in someone else's group, where the verdict decides again).
    """

    _rpc_handlers = None  # hivemind caches handlers per class: collect ours
    _stub_type = None

    def __init__(self, *args, summary_size: int, secret: SwarmSecret | None = None, rule: OutlierRule | None = None,
                 ban_s: float = 60.0, **kwargs):  # fmt: skip
        self.summary_size, self.secret, self.rule, self.ban_s = summary_size, secret, rule or OutlierRule(), ban_s
        self._banned_until: dict[PeerID, float] = {}  # averager process only
        # shared with the trainer's process (the averager process counts, the trainer reads)
        self.joins_refused_banned = mp.Value(ctypes.c_long, 0)
        self.joins_refused_token = mp.Value(ctypes.c_long, 0)
        super().__init__(*args, **kwargs)

    # --- used in both processes ---
    def payload(self, summary: Summary) -> dict[str, Any]:
        """What we gather: our weight summary, and our member token when there is a swarm secret."""
        payload: dict[str, Any] = {"summary": summary.to_wire()}
        if self.secret is not None:
            payload["token"] = self.secret.member_token(self.peer_id.to_bytes())
        return payload

    def is_member(self, peer: PeerID, token: object) -> bool:
        return self.secret is None or self.secret.is_member(peer.to_bytes(), token)

    def verdict(self, gathered: Mapping[PeerID, Any]) -> Verdict[PeerID]:
        """The group's verdict from a step's result (or the gathered data): the same at every member."""
        return judge_group(gathered, self.summary_size, self.rule, self.is_member if self.secret else None)[1]

    # --- averager process ---
    def _join_refusal(self, request: averaging_pb2.JoinRequest, sender: PeerID,
                      ) -> averaging_pb2.MessageFromLeader | None:  # fmt: skip
        until = self._banned_until.get(sender)
        if until is not None and until > get_dht_time():
            with self.joins_refused_banned.get_lock():
                self.joins_refused_banned.value += 1
            return averaging_pb2.MessageFromLeader(code=averaging_pb2.NOT_LOOKING_FOR_GROUP)
        self._banned_until.pop(sender, None)
        if self.secret is None:
            return None
        try:
            _bandwidth, _mode, user_bytes = self.serializer.loads(request.gather)
            token = self.serializer.loads(user_bytes).get("token")
        except Exception:  # anything malformed: not one of ours
            token = None
        if self.is_member(sender, token):
            return None
        with self.joins_refused_token.get_lock():
            self.joins_refused_token.value += 1
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
        gathered = self._decode_gathered(group_info)
        verdict = self.verdict(gathered)
        if self.peer_id not in verdict.outliers:
            until = get_dht_time() + self.ban_s
            for peer in verdict.outliers:
                self._banned_until[peer] = until
        kept = [i for i, peer in enumerate(group_info.peer_ids) if peer not in verdict.outliers]
        if self.peer_id in verdict.outliers or len(kept) < 2:  # refused, or nobody left to average with
            self._running_groups[group_info.group_id].cancel()  # registered by hivemind, ends without an AllReduce
            return gathered
        if len(kept) < len(group_info.peer_ids):
            group_info = GroupInfo(group_info.group_id, tuple(group_info.peer_ids[i] for i in kept),
                                   tuple(group_info.gathered[i] for i in kept))  # fmt: skip
        await super()._aggregate_with_group(group_info, min_vector_size, **kwargs)
        return gathered
