"""The settings a round runs with, in one object that the optimizer builds and hands to the parts that need them
(``scheduler``, ``exchange``), as hivemind's ``Optimizer`` hands its parts their arguments: no part reads them
from the optimizer."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RoundSettings:
    """See ``DecentralizedSGD`` for what each one means to a user; the last five are the ablations of the
    benchmarks (the old design's behaviour, one improvement at a time)."""

    min_matchmaking_time: float = 5.0  # a group that cannot fill forms no sooner (hivemind's matchmaking)
    next_chunk_timeout: float = 10.0  # also how long a formed round may wait for the trainer's lock (scheduler)
    allreduce_timeout: float = 60.0
    averager_timeout: float = 30.0  # every call to the averager process is bounded by it (supervisor)
    boundary_wait_share: float = 0.05  # a fill waits at most this share of an AllReduce for a step boundary
    weight_by_samples: bool = False
    delta_rule: bool = True  # False: overwrite the parameters with the average
    refresh_before_allreduce: bool = True  # False: the snapshot is taken when matchmaking starts
    pipeline: bool = True  # False: the next matchmaking starts only once the round before has ended
    fill_when_formed: bool = True  # False: fill at the first step boundary after the group formed

    def __post_init__(self) -> None:
        if not 0.0 <= self.boundary_wait_share < 1.0:
            raise ValueError(
                f"boundary_wait_share must be in [0, 1) (a share of an AllReduce's time; 0: never wait "
                f"for a step boundary before a fill), got {self.boundary_wait_share}"
            )
