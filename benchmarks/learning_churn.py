"""bench_learning's churn: the last box crashes at a third of its steps, comes back by the README's restart."""

from __future__ import annotations

import functools
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from benchmarks.learning_setup import BenchError, Plan
from vissl_swarm.local_swarm import LocalPeer, wait_until


@dataclass(frozen=True)
class Watch:
    """A run's waits, each until a condition holds, before its deadline; a process that fails meanwhile ends it."""

    mode: str
    seed: int
    peers: list[LocalPeer]
    deadline: float

    def until(
        self, condition: Callable[[], Any], what: str, watched: list[LocalPeer] | None = None, poll: float = 0.2
    ) -> Any:
        def checked() -> Any:
            check_exits(self.mode, self.seed, self.peers if watched is None else watched)
            return condition()

        return wait_until(
            checked, max(1.0, self.deadline - time.monotonic()), f"{what} (logs: {self.peers[0].out_dir})", poll
        )


CHURN_MEANS = (  # of a churn record, averaged over seeds in the summary
    "lost_steps",
    "steps_not_in_a_round",
    "away_share_of_budget",
    "share_of_steps",
    "steps_after_rejoin",
    "restart_s",
)
SPEED_WINDOW_S = 3.0  # the others' speed after the kill (when to restart the churned box): over this much at least


@dataclass(frozen=True)
class Churn:
    """swarm_churn: box ``box`` is killed at its step ``kill_step``, to be back when the swarm trained ``back_at``."""

    box: int
    kill_step: int
    back_at: int

    @classmethod
    def of(cls, plan: Plan) -> Churn:
        return cls(box=plan.boxes - 1, kill_step=max(1, plan.shared_steps // 3), back_at=2 * plan.budget_samples // 3)


def run_churn(churn: Churn, peers: list[LocalPeer], restart: Callable[[LocalPeer], None], watch: Watch) -> dict:
    """Kill the box at its step, ``restart`` it to be back at ``churn.back_at``, wait until it trains: its record."""
    box = peers[churn.box]
    others = [peer for peer in peers if peer is not box]
    first = watch.until(lambda: box.progress()[:1], f"{box.name}'s first step")[0]
    startup_s = first["time"] - box.started_at
    watch.until(
        lambda: box.last_step() >= churn.kill_step or not box.is_running(),
        f"{box.name} reaching step {churn.kill_step}",
        poll=0.05,
    )
    if not box.is_running():
        raise BenchError(f"{box.name} ended before its step {churn.kill_step}; its log: {box.log_path}")
    box.kill()  # its whole session (trainer, DHT, averager, p2pd): a box that lost power
    killed_at, at_kill = time.time(), box.progress()[-1]
    snapshots = [r["step_at_snapshot"] for r in box.applied_rounds() if r.get("step_at_snapshot") is not None]
    due = functools.partial(restart_due, others, churn.back_at, startup_s, killed_at)
    watch.until(due, "the swarm nearing two thirds", others)
    at_restart = swarm_position(others)
    log_offset = len(box.log_text())
    restart(box)
    back = watch.until(lambda: back_in_swarm(box, others), f"{box.name} training again after its restart")
    after = box.log_text()[log_offset:]
    joined = re.search(r"Joined the swarm at its position: (\d+) samples", after)
    if joined is None:  # it trained from its checkpoint: not the README's restart (no donor answered in time)
        raise BenchError(f"{box.name} restarted without taking the swarm's state; its log: {box.log_path}")
    resumed = re.search(r"Resume from file: .*model_iteration(\d+)\.torch", after)
    return {
        "box": churn.box,
        "kill_step_planned": churn.kill_step,
        "back_at_samples_planned": churn.back_at,
        "first_startup_s": round(startup_s, 1),
        "killed_at_step": at_kill["step"],
        "steps_not_in_a_round": at_kill["step"] - max(snapshots, default=0),
        "resumed_step": int(resumed.group(1)) if resumed else 0,
        "swarm_samples_at_kill": at_kill.get("swarm_samples"),
        "swarm_samples_at_restart": at_restart,
        "swarm_samples_at_rejoin": int(joined.group(1)),
        "restart_s": round(back - box.started_at, 1),
        "away_s": round(back - killed_at, 1),
    }


def swarm_position(peers: list[LocalPeer]) -> int:
    """The swarm's samples as the freshest logged step of ``peers`` says."""
    return freshest_steps(peers)[-1]["swarm_samples"]


def freshest_steps(peers: list[LocalPeer]) -> list[dict]:
    """The logged steps of the peer that logged last (each box knows where the swarm is)."""
    return max((peer.progress() for peer in peers), key=lambda lines: lines[-1]["time"] if lines else 0.0)


def restart_due(others: list[LocalPeer], back_at: int, startup_s: float, killed_at: float) -> bool:
    """Whether the churned box, started now, would be back about when the swarm reaches ``back_at`` samples, given
    its first start-up and the others' own speed since the kill (the swarm's position still counts the dead box's)."""
    lines = freshest_steps(others)
    if lines and lines[-1]["swarm_samples"] >= back_at:
        return True
    speed = sum(own_speed(peer, killed_at) for peer in others)
    return speed > 0 and (back_at - lines[-1]["swarm_samples"]) / speed <= startup_s


def own_speed(peer: LocalPeer, since: float) -> float:
    """The samples per second ``peer`` trained since ``since``, over at least ``SPEED_WINDOW_S`` of its steps."""
    lines = [line for line in peer.progress() if line["time"] >= since]
    if len(lines) < 2 or lines[-1]["time"] - lines[0]["time"] < SPEED_WINDOW_S:
        return 0.0
    return (lines[-1]["own_samples"] - lines[0]["own_samples"]) / (lines[-1]["time"] - lines[0]["time"])


def back_in_swarm(box: LocalPeer, others: list[LocalPeer]) -> float | None:
    """When the restarted box logged its first step (or ended); BenchError if the others finished before it was back."""
    steps = [line for line in box.progress() if line["time"] >= box.started_at]
    if steps:
        return steps[0]["time"]
    if not box.is_running():
        return time.time()  # exited: a failure is reported by the caller's check of the exits
    if not any(peer.is_running() for peer in others):
        box.kill()
        raise BenchError(
            f"{box.name} was not back before the others finished the budget (restarted "
            f"{time.time() - box.started_at:.0f} s ago); its log: {box.log_path}"
        )
    return None


def churn_summary(churn: dict, steps_per_box: list[int], batch: int, budget: int) -> dict:
    """The record with what follows from the run's end: the box's steps after its rejoin, its share of the swarm's
    steps, the samples lost (the box's since its checkpoint, the swarm's not in any round) and its time away."""
    after = steps_per_box[churn["box"]] - churn["resumed_step"]
    trained = [*steps_per_box]
    trained[churn["box"]] = churn["killed_at_step"] + after
    lost_steps = churn["killed_at_step"] - churn["resumed_step"]
    away = churn["swarm_samples_at_rejoin"] - (churn["swarm_samples_at_kill"] or 0)
    return {
        **churn,
        "steps_after_rejoin": after,
        "share_of_steps": round(trained[churn["box"]] / sum(trained), 4),
        "lost_steps": lost_steps,
        "lost_samples_of_box": lost_steps * batch,
        "lost_samples_of_swarm": churn["steps_not_in_a_round"] * batch,
        "away_share_of_budget": round(away / budget, 4),
    }


def crash_report(peers: list[LocalPeer]) -> str:
    """Every process that exited with an error, with the last error line of its log."""
    return "".join(
        f"\n  {peer.name} exited with code {peer.process.poll()} ({peer.log_path}): {last_error_line(peer)}"
        for peer in peers
        if peer.process is not None and peer.process.poll() not in (None, 0)
    )


def check_exits(mode: str, seed: int, peers: list[LocalPeer]) -> None:
    if report := crash_report(peers):
        raise BenchError(f"{mode} seed {seed}: a process failed{report}")


def last_error_line(peer: LocalPeer) -> str:
    lines = [line for line in peer.log_text().splitlines() if line.strip()]
    errors = [line for line in lines if "Error" in line or "error:" in line]
    return (errors or lines or ["(empty log)"])[-1][:300]
