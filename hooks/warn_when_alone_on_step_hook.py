"""A box that has averaged with nobody for ``--alone_warning_after`` seconds says so once, with the cause where the
swarm's records tell it (another secret, another config or recipe, no box reachable, another run id) and the fix."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from hooks.quiet_hook import QuietHook
from vissl_swarm.averaging_protocol import Averaging
from vissl_swarm.dht_rejoin import dht_peer_count
from vissl_swarm.recipe import recipe_fixes
from vissl_swarm.swarm import ALONE_AFTER_S  # the warning, after this long with no applied round


def alone_cause(secret_problem: str | None, progress: Any, dht_peers: int | None, run_id: str, config_name: str) -> str:
    """The likely cause and its fix, from what this box sees: the run's members (a secret that matches nobody's,
    ``DecentralizedSGD.membership_problem``), live records of its run id with another config or recipe, and how many
    peers its DHT knows."""
    if secret_problem:
        return secret_problem
    for record in getattr(progress, "others", []):
        box = f"box {record['peer_id'][-8:]} of run {run_id!r}"
        if record["config"] != config_name:
            return f"{box} trains --config {record['config']}: start this one with --config {record['config']}"
        fixes = recipe_fixes(progress.recipe, record["recipe"])
        return f"{box} trains another recipe: restart this one with the swarm's: {'; '.join(fixes)}"
    if dht_peers == 0:
        return (
            "no other box is reachable: our DHT knows no other peer. Check that --initial_peers names a running box "
            "(its join line), that its port is open, and that this box's port (--host_maddrs) is open to the others"
        )
    if dht_peers:
        return (
            f"our DHT knows {dht_peers} other peer(s), but none of them trains --run_id {run_id} --config "
            f"{config_name}: start this box with the others' --run_id and --config (their join line has them)"
        )
    return "our DHT did not answer how many peers it knows; no other box of this swarm may be running yet"


def alone_message(seconds: float, failed: int, cause: str) -> str:
    return (
        f"This box has averaged with nobody for {seconds:.0f} s ({failed} rounds found no group); it trains alone. "
        f"Likely cause: {cause}. run_monitor.py with the same --run_id shows which boxes train."
    )


class WarnWhenAloneOnStepHook(QuietHook):
    """Counts the seconds since the averager last applied a round (or since the start) and logs one WARNING once
    they pass ``alone_after_s``; a round ends the stretch. Runs on the trainer's thread in ``on_step``; asks the DHT
    (at most 3 s) only when it warns."""

    def __init__(self, alone_after_s: float = ALONE_AFTER_S, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self.alone_after_s, self.clock = alone_after_s, clock
        self._since = 0.0  # when the last round was applied, or the start
        self._applied = 0  # rounds applied when last seen
        self._warned = False
        self.warnings = 0

    def on_start(self, task) -> None:
        self._since, self._warned = self.clock(), False
        optimizer: Averaging | None = getattr(task, "decentralized_sgd", None)
        self._applied = int(optimizer.counters["rounds_applied"]) if optimizer is not None else 0

    def on_step(self, task) -> None:
        optimizer: Averaging | None = getattr(task, "decentralized_sgd", None)
        if optimizer is None or self.alone_after_s <= 0:
            return
        now, applied = self.clock(), int(optimizer.counters["rounds_applied"])
        if applied != self._applied:
            self._applied, self._since, self._warned = applied, now, False
            return
        if self._warned or now - self._since < self.alone_after_s:
            return
        settings = task.swarm_settings
        cause = alone_cause(
            getattr(optimizer, "membership_problem", None),  # DecentralizedSGD's (the baselines have none)
            getattr(task, "swarm_progress", None),
            dht_peer_count(getattr(task, "dht", None)),
            settings.run_id,
            settings.config_name,
        )
        # ours counts a round without a group apart; hivemind's baselines count it among the failed ones
        failed = int(optimizer.counters.get("rounds_no_group", optimizer.counters.get("rounds_failed", 0)))
        logging.warning(alone_message(now - self._since, failed, cause))
        self._warned = True
        self.warnings += 1
