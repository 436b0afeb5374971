"""A box that has averaged with nobody for a minute says so, with the likely causes and what to check."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from classy_vision.hooks import ClassyHook

from decentralized_sgd.dht_rejoin import dht_peer_count
from vissl_swarm.averaging_protocol import Averaging
from vissl_swarm.swarm import ALONE_AFTER_S  # the first warning, after this long with no applied round

REPEAT_EVERY_S = 300.0  # then again this often while it lasts


def alone_message(seconds: float, failed: int, dht_peers: int | None, run_id: str, config_name: str) -> str:
    """The warning: how long, what the DHT sees, the causes in the order they are met in practice."""
    if dht_peers is None:
        seen = "Our DHT did not answer how many peers it knows."
    elif dht_peers == 0:
        seen = (
            "Our DHT knows no other peer: nobody reached us and we reached nobody (check --initial_peers, "
            "the network and the firewall first)."
        )
    else:
        seen = (
            f"Our DHT knows {dht_peers} other peer(s), so the network reaches some: check the run id, config "
            "and secret first."
        )
    return (
        f"This box has averaged with nobody for {seconds:.0f} s ({failed} rounds found no group); it trains alone. "
        f"{seen} Likely causes: (1) no other box runs this swarm yet: start one with the join line printed above; "
        f"(2) the others run another --run_id or --config (only boxes with --run_id {run_id} and --config "
        f"{config_name or '<the same config>'} average together); (3) the others cannot reach this box or it them: "
        "open the TCP port of --host_maddrs (behind a port forward add --announce_maddrs; behind NAT without one, "
        "--client_mode or --use_auto_relay); (4) a different swarm secret (every box needs a copy of the same "
        "--swarm_secret_file). run_monitor.py with the same --run_id shows which boxes publish progress."
    )


class WarnWhenAloneOnStepHook(ClassyHook):
    """Counts the seconds since the averager last applied a round (or since the start) and logs one WARNING once
    they pass ``alone_after_s``, then every ``repeat_every_s`` while no round is applied. Runs on the trainer's
    thread in ``on_step``; asks the DHT (at most 3 s) only when it warns."""

    on_phase_start = ClassyHook._noop
    on_forward = ClassyHook._noop
    on_loss_and_meter = ClassyHook._noop
    on_backward = ClassyHook._noop
    on_update = ClassyHook._noop
    on_phase_end = ClassyHook._noop
    on_end = ClassyHook._noop
    on_exception = ClassyHook._noop

    def __init__(
        self,
        alone_after_s: float = ALONE_AFTER_S,
        repeat_every_s: float = REPEAT_EVERY_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__()
        self.alone_after_s, self.repeat_every_s, self.clock = alone_after_s, repeat_every_s, clock
        self._since = 0.0  # when the last round was applied, or the start
        self._applied = 0  # rounds applied when last seen
        self._warned_at: float | None = None
        self.warnings = 0

    def on_start(self, task) -> None:
        self._since, self._warned_at = self.clock(), None
        optimizer: Averaging | None = getattr(task, "decentralized_sgd", None)
        self._applied = int(optimizer.counters["rounds_applied"]) if optimizer is not None else 0

    def on_step(self, task) -> None:
        optimizer: Averaging | None = getattr(task, "decentralized_sgd", None)
        if optimizer is None or self.alone_after_s <= 0:
            return
        now, applied = self.clock(), int(optimizer.counters["rounds_applied"])
        if applied != self._applied:
            self._applied, self._since, self._warned_at = applied, now, None
            return
        due = (
            now - self._since >= self.alone_after_s
            if self._warned_at is None
            else now - self._warned_at >= self.repeat_every_s
        )
        if not due:
            return
        settings = task.swarm_settings
        logging.warning(
            alone_message(
                now - self._since,
                # ours counts a round without a group apart; hivemind's baselines count it among the failed ones
                int(optimizer.counters.get("rounds_no_group", optimizer.counters.get("rounds_failed", 0))),
                dht_peer_count(getattr(task, "dht", None)),
                settings.run_id,
                settings.config_name,
            )
        )
        self._warned_at = now
        self.warnings += 1
