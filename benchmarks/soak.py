#!/usr/bin/env python3
"""Soak: 3 real peers train swav_tiny on the digits for a set time while one of them is killed and restarted.

A table says whether the swarm survived it: no crash of the survivors, nothing non-finite, rounds succeed again
once the faults stop, memory does not grow.

    python -m benchmarks.soak --minutes 15 --json benchmarks/results/soak.json --markdown benchmarks/results/soak.md
    python -m benchmarks.soak --quick    # the same code path in ~3 minutes: 1 minute of soak, one kill

After the warm-up, peer1 or peer2 is SIGKILLed (its process group) every ``--kill_every`` seconds of the soak's first
``--fault_fraction`` and restarts ``--down_for`` seconds later; a quiet tail measures recovery (``DEFINITIONS``). The
peers run ``--schedule local`` past the soak's end: a peer that exits on its own is a crash of a survivor.
"""

from __future__ import annotations

import argparse
import math
import os
import random
import signal
import statistics
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from tempfile import mkdtemp

from benchmarks.common import (
    REPO,
    fast_round_flags,
    git_state,
    kill_sessions,
    markdown_table,
    session_pids,
    write_json,
    write_text,
)
from vissl_swarm.local_swarm import LocalPeer, start_swarm, stop_all, wait_until

FLAGS = [*fast_round_flags("soak"), "--schedule", "local"]
STEPS_PER_EPOCH = 10  # DATA_LIMIT 160 / batch 16
DEFINITIONS = {
    "soak window": "from the end of the warm-up (every peer applied a round, then --settle s) to the moment the "
    "harness starts stopping the peers; round counts only take rounds with t_start and t_applied in it",
    "rounds_attempted": "per-peer round records (one per peer per round, all incarnations) whose group formed "
    "(t_group_formed or group set), plus those that failed for any reason other than a "
    "cancellation or 'could not find a group'",
    "rounds_succeeded": "attempted records with applied=true",
    "success_ratio": "rounds_succeeded / rounds_attempted over the whole soak window, faults included",
    "faults_over_at": "the last restart + --grace s, or the restarted peer's first applied round if later; the soak "
    "start if there was no fault",
    "success_ratio_after_faults": "the same ratio over rounds with t_start >= faults_over_at",
    "max_seconds_without_applied_round": "longest gap between consecutive applied rounds (t_applied) of one peer "
    "incarnation while it was up, gaps ending in the soak window, including "
    "from its last applied round to its kill / the end; a restarted peer's "
    "own downtime and its time to rejoin are excluded (see rejoin_seconds)",
    "rejoin_seconds": "from a restart to that incarnation's first applied round, before it ended (null: it never "
    "rejoined)",
    "killed_before_rejoining": "restarts killed again before their first applied round (the next kill came sooner "
    "than the restart could rejoin); restarts_rejoined is measured against the other restarts",
    "nonfinite_events": "round records whose error says 'not finite' (local snapshot or averaged result) plus "
    "progress.jsonl lines whose loss is NaN or inf, whole run, all peers",
    "survivor_crashes": "times a peer process exited while the harness had not killed or stopped it",
    "rss_mb": "VmRSS summed over the trainer and every process of its session (averager, DHT, p2pd children); "
    "median of 3 samples 1 s apart",
    "rss_growth_ratio": "peer0's rss_mb at the end of the soak / at its start (after the warm-up)",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add = parser.add_argument
    add("--minutes", type=float, default=15.0, help="length of the soak, after the warm-up")
    add("--fault_fraction", type=float, default=0.67, help="faults in this first share of the soak, then quiet")
    pair = dict(type=float, nargs=2, metavar=("MIN", "MAX"))
    add("--kill_every", **pair, default=[45.0, 90.0], help="seconds from a (re)start to the next kill, uniform")
    add("--down_for", **pair, default=[10.0, 25.0], help="seconds a killed peer stays down, uniform")
    add("--grace", type=float, default=30.0, help="seconds after the last restart before the 'after faults' counts")
    add("--settle", type=float, default=30.0, help="seconds after every peer's first round before the soak starts")
    add("--seed", type=int, default=0, help="which peer is killed when, and for how long")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="the whole code path in about 3 minutes: 1 minute of soak, a kill after 5-10 s, 3 s down, a 5 s "
        "settle and a 10 s grace (overrides those options); its exit status says only whether it ran through, "
        "as a minute is too short for the targets",
    )
    add("--data_path", type=Path, default=REPO / "data/digits", help="exported digits (make data)")
    add("--out", type=Path, default=None, help="checkpoints and logs (default: a new temp folder)")
    add("--json", type=Path, default=None, help="write the report here")
    add("--markdown", type=Path, default=None, help="write the table here")
    return parser


def _vm_rss_kb(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0  # exited, or a zombie


def tree_rss_mb(leader: int, samples: int = 1) -> float | None:
    """Median over ``samples`` (1 s apart) of the session's summed VmRSS: one sample can land on an AllReduce."""
    values = []
    for index in range(samples):
        if index:
            time.sleep(1.0)
        pids = session_pids(leader)
        if pids:
            values.append(sum(_vm_rss_kb(pid) for pid in pids) / 1024.0)
    return round(statistics.median(values), 1) if values else None


@dataclass
class Incarnation:
    """One process of one peer, from its start to its kill, crash or final stop (times are time.time())."""

    peer: str
    pid: int
    started: float
    ended: float | None = None
    end: str | None = None  # killed | crashed | stopped
    exit_code: int | None = None
    log_tail: str | None = None
    rss_mb: list[tuple[float, float]] = field(default_factory=list)  # (t since run start, MB)


class Soak:
    """Starts the swarm, injects the faults, watches for crashes and samples memory; analysis is ``report``."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.rng = random.Random(args.seed)
        self.out = args.out or Path(mkdtemp(prefix="soak_"))
        self.peers = [LocalPeer(f"peer{index}", self.out) for index in range(3)]
        # plenty of epochs (10 steps/s of headroom, --schedule local) so that no peer finishes during the run
        epochs = max(300, math.ceil((args.minutes + 5) * 60 * 10 / STEPS_PER_EPOCH))
        self.overrides = [
            "config.DATA.TRAIN.DATA_LIMIT=160",
            f"config.OPTIMIZER.num_epochs={epochs}",
            "config.CHECKPOINT.CHECKPOINT_FREQUENCY=5",
            "config.CHECKPOINT.CHECKPOINT_ITER_FREQUENCY=50",
            "config.LOG_FREQUENCY=5",
        ]
        self.addresses: list[str] = []
        self.incarnations: list[Incarnation] = []
        self.faults: list[dict] = []
        self.crashes: list[dict] = []
        self.t0 = time.time()
        self.soak_start: float | None = None
        self.stop_at: float | None = None
        self.rss_start: float | None = None
        self.rss_end: float | None = None
        self.aborted: str | None = None
        self._next_rss = 0.0
        self._next_status = 0.0

    def _seed(self, peer: LocalPeer) -> list[str]:
        return [f"config.SEED_VALUE={self.peers.index(peer)}"]

    def _current(self, peer: LocalPeer) -> Incarnation:
        return next(inc for inc in reversed(self.incarnations) if inc.peer == peer.name)

    def _started(self, peer: LocalPeer) -> None:
        self.incarnations.append(Incarnation(peer.name, peer.process.pid, peer.started_at))

    def _restart(self, peer: LocalPeer) -> None:
        peer.start(self.args.data_path, self.addresses, FLAGS, self.overrides + self._seed(peer))
        self._started(peer)

    def start(self) -> None:
        """Start the swarm and wait out the warm-up, so that import-time memory and the first rounds are not soaked."""
        self.addresses = start_swarm(
            self.peers, self.args.data_path, FLAGS, self.overrides, per_peer_overrides=self._seed
        )
        for peer in self.peers:
            self._started(peer)
        print(f"swarm started in {self.out}; warming up", flush=True)
        for peer in self.peers:
            wait_until(
                lambda peer=peer: self._check_exits() or peer.applied_rounds(),
                600,
                f"the first applied round of {peer.name}",
            )
        self._watch(time.time() + self.args.settle)
        self.soak_start = time.time()
        self.rss_start = tree_rss_mb(self.peers[0].process.pid, samples=3)
        print(f"warm-up done after {self.soak_start - self.t0:.0f} s; peer0 RSS {self.rss_start} MB", flush=True)

    def _check_exits(self) -> None:
        """A process that exited without the harness killing it is a crash of a survivor; restart peers 1..2."""
        for peer in self.peers:
            if peer.process is None or peer.is_running():
                continue
            inc = self._current(peer)
            if inc.end is not None:
                continue
            lines = peer.log_text().splitlines()
            inc.ended, inc.end, inc.exit_code, inc.log_tail = (
                time.time(),
                "crashed",
                peer.process.returncode,
                "\n".join(lines[-60:]),
            )
            self.crashes.append(
                {
                    "peer": peer.name,
                    "t": round(inc.ended - self.t0, 1),
                    "exit_code": inc.exit_code,
                    "log_tail": inc.log_tail,
                }
            )
            print(f"CRASH: {peer.name} exited with code {inc.exit_code}; see {peer.log_path}", flush=True)
            if peer is self.peers[0] or self.soak_start is None:
                self.aborted = f"{peer.name} crashed" + (
                    " (the bootstrap peer)" if peer is self.peers[0] else " during the warm-up"
                )
            else:
                self._restart(peer)
        if self.aborted:
            raise RuntimeError(self.aborted)

    def _watch(self, until: float) -> None:
        """Poll for crashes every 2 s until ``until``; sample memory every 30 s and print a status line."""
        while time.time() < until and not self.aborted:
            self._check_exits()
            now = time.time()
            if now >= self._next_rss:
                self._next_rss = now + 30.0
                for peer in self.peers:
                    if peer.is_running():
                        rss = tree_rss_mb(peer.process.pid)
                        if rss is not None:
                            self._current(peer).rss_mb.append((round(now - self.t0, 1), rss))
            if now >= self._next_status:
                self._next_status = now + 30.0
                print(
                    f"t={now - self.t0:5.0f} s  "
                    + "  ".join(
                        f"{peer.name}: {'up' if peer.is_running() else 'DOWN'} step {peer.last_step()} "
                        f"applied {len(peer.applied_rounds())}"
                        for peer in self.peers
                    ),
                    flush=True,
                )
            time.sleep(min(2.0, max(until - time.time(), 0.0)))

    def soak(self) -> None:
        """The fault phase (kill, wait, restart, at random), then the quiet tail."""
        end = self.soak_start + self.args.minutes * 60.0
        faults_end = self.soak_start + self.args.fault_fraction * self.args.minutes * 60.0
        while True:
            kill_at = time.time() + self.rng.uniform(*self.args.kill_every)
            if kill_at >= faults_end:
                break
            self._watch(kill_at)
            peer = self.rng.choice(self.peers[1:])
            down = self.rng.uniform(*self.args.down_for)
            if not peer.is_running():  # crashed and restarting right now: nothing to kill
                continue
            inc = self._current(peer)
            peer.kill()
            inc.ended, inc.end, inc.exit_code = time.time(), "killed", peer.process.returncode
            print(f"t={inc.ended - self.t0:5.0f} s  KILL {peer.name}, down for {down:.0f} s", flush=True)
            self._watch(inc.ended + down)
            self._restart(peer)
            self.faults.append({"peer": peer.name, "killed_at": inc.ended, "restarted_at": peer.started_at})
            print(f"t={peer.started_at - self.t0:5.0f} s  RESTART {peer.name}", flush=True)
        print(f"t={time.time() - self.t0:5.0f} s  faults over; quiet tail until t={end - self.t0:.0f} s", flush=True)
        self._watch(end)

    def stop(self) -> None:
        """Stop every peer cleanly (Ctrl-C), then SIGKILL whatever is left of any process this harness started."""
        if self.stop_at is None:
            self.stop_at = time.time()
        if self.rss_start is not None and self.peers[0].is_running():
            self.rss_end = tree_rss_mb(self.peers[0].process.pid, samples=3)
        try:
            stop_all(self.peers)
        finally:
            kill_sessions([inc.pid for inc in self.incarnations] + [p.process.pid for p in self.peers if p.process])
            for inc in self.incarnations:
                if inc.end is None:
                    process = next(p.process for p in self.peers if p.name == inc.peer)
                    inc.ended, inc.end, inc.exit_code = time.time(), "stopped", process.poll()


def is_attempt(record: dict) -> bool:
    if record.get("t_group_formed") is not None or record.get("group") is not None:
        return True
    error = record.get("error") or ""
    return "CancelledError" not in error and "could not find a group" not in error


def applied_at(record: dict) -> float:
    return record.get("t_applied") or record.get("t_end") or record["t_start"]


def ratio(succeeded: int, attempted: int) -> float | None:
    return round(succeeded / attempted, 4) if attempted else None


def report(soak: Soak) -> dict:
    """Every metric of DEFINITIONS from the peers' own files (rounds, progress) and the harness's timeline."""
    t0, start, stop = soak.t0, soak.soak_start, soak.stop_at
    last = soak.faults[-1] if soak.faults else None
    by_peer = {peer.name: peer for peer in soak.peers}
    rejoins: list[float | None] = []
    for fault in soak.faults:
        inc = next(i for i in soak.incarnations if i.peer == fault["peer"] and i.started == fault["restarted_at"])
        up_to = inc.ended or stop
        rounds = by_peer[inc.peer].rounds()
        applied = [applied_at(r) for r in rounds if r.get("applied") and inc.started <= r["t_start"] < up_to]
        fault["rejoin_seconds"] = round(min(applied) - inc.started, 1) if applied else None
        fault["killed_before_rejoining"] = not applied and inc.end == "killed"
        rejoins.append(fault["rejoin_seconds"])
    faults_over = start
    if last is not None:
        faults_over = last["restarted_at"] + soak.args.grace
        if last["rejoin_seconds"] is not None:
            faults_over = max(faults_over, last["restarted_at"] + last["rejoin_seconds"])

    attempted = succeeded = attempted_after = succeeded_after = nonfinite = 0
    max_gap, errors, peers = 0.0, Counter(), []
    for peer in soak.peers:
        records, progress = peer.rounds(), peer.progress()
        nonfinite += sum("not finite" in (r.get("error") or "") for r in records)
        nonfinite += sum(isinstance(e.get("loss"), float) and not math.isfinite(e["loss"]) for e in progress)
        in_window = [r for r in records if start <= r["t_start"] and applied_at(r) <= stop and is_attempt(r)]
        peer_ok = sum(bool(r.get("applied")) for r in in_window)
        attempted, succeeded = attempted + len(in_window), succeeded + peer_ok
        after = [r for r in in_window if r["t_start"] >= faults_over]
        attempted_after += len(after)
        succeeded_after += sum(bool(r.get("applied")) for r in after)
        errors.update((r.get("error") or "")[:100] for r in in_window if not r.get("applied"))
        incs = [inc for inc in soak.incarnations if inc.peer == peer.name]
        for inc in incs:
            up_to = min(inc.ended or stop, stop)
            times = sorted(applied_at(r) for r in records if r.get("applied") and inc.started <= r["t_start"] < up_to)
            if times:  # an incarnation killed (or crashed) before its first applied round has no gap of its own
                gaps = [b - a for a, b in zip(times, [*times[1:], up_to], strict=True) if b > start]
                max_gap = max([max_gap, *gaps])
        peers.append(
            {
                "peer": peer.name,
                "final_step": peer.last_step(),
                "rounds_attempted": len(in_window),
                "rounds_succeeded": peer_ok,
                "incarnations": [
                    {
                        **{k: v for k, v in asdict(inc).items() if k not in ("peer", "log_tail")},
                        "started": round(inc.started - t0, 1),
                        "ended": None if inc.ended is None else round(inc.ended - t0, 1),
                    }
                    for inc in incs
                ],
            }
        )

    config = {key: str(value) if isinstance(value, Path) else value for key, value in vars(soak.args).items()}
    config.update(
        argv=sys.argv[1:],
        out=str(soak.out),
        flags=FLAGS,
        overrides=soak.overrides,
        cpus=os.cpu_count(),
        loadavg_end=os.getloadavg(),
        git=git_state(),
    )
    rss_ratio = round(soak.rss_end / soak.rss_start, 4) if soak.rss_start and soak.rss_end else None
    result = {
        "survivor_crashes": len(soak.crashes),
        "nonfinite_events": nonfinite,
        "rounds_attempted": attempted,
        "rounds_succeeded": succeeded,
        "success_ratio": ratio(succeeded, attempted),
        "rounds_attempted_after_faults": attempted_after,
        "rounds_succeeded_after_faults": succeeded_after,
        "success_ratio_after_faults": ratio(succeeded_after, attempted_after),
        "max_seconds_without_applied_round": round(max_gap, 1),
        "rss_start_mb": soak.rss_start,
        "rss_end_mb": soak.rss_end,
        "rss_growth_ratio": rss_ratio,
        "faults": len(soak.faults),
        "restarts_rejoined": sum(r is not None for r in rejoins),
        "killed_before_rejoining": sum(f["killed_before_rejoining"] for f in soak.faults),
        "rejoin_seconds_max": max((r for r in rejoins if r is not None), default=None),
        "aborted": soak.aborted,
        "timeline_s": {
            "warmup_done": round(start - t0, 1),
            "faults_over_at": round(faults_over - t0, 1),
            "stopped_at": round(stop - t0, 1),
        },
        "fault_timeline": [
            {
                "peer": f["peer"],
                "killed_at": round(f["killed_at"] - t0, 1),
                "restarted_at": round(f["restarted_at"] - t0, 1),
                "rejoin_seconds": f["rejoin_seconds"],
                "killed_before_rejoining": f["killed_before_rejoining"],
            }
            for f in soak.faults
        ],
        "failed_round_errors": dict(errors.most_common(10)),
        "crashes": soak.crashes,
        "peers": peers,
        "definitions": DEFINITIONS,
        "config": config,
    }
    result["targets"] = targets(result)
    return result


def targets(result: dict) -> list[dict]:
    """The acceptance criteria (a missing value is not met); met is None for the numbers only reported."""

    def check(metric: str, target: str, ok: bool | None) -> dict:
        return {"metric": metric, "value": result[metric], "target": target, "met": ok}

    ratio_after, growth = result["success_ratio_after_faults"], result["rss_growth_ratio"]
    could = result["faults"] - result["killed_before_rejoining"]  # the restarts that lived long enough to rejoin
    return [
        check("survivor_crashes", "0", result["survivor_crashes"] == 0),
        check("nonfinite_events", "0", result["nonfinite_events"] == 0),
        check("success_ratio_after_faults", ">= 0.95", ratio_after is not None and ratio_after >= 0.95),
        check("rss_growth_ratio", "< 1.10", growth is not None and growth < 1.10),
        check("success_ratio", "—", None),
        check("rounds_attempted", "—", None),
        check("rounds_succeeded", "—", None),
        check("rounds_attempted_after_faults", "—", None),
        check("max_seconds_without_applied_round", "—", None),
        check("faults", "—", None),
        check("restarts_rejoined", f"{could}", result["restarts_rejoined"] == could),
        check("killed_before_rejoining", "—", None),
        check("rejoin_seconds_max", "—", None),
    ]


def markdown(result: dict) -> str:
    """The targets' table under a header: what ran, on what machine, and the success share after the faults."""
    config, timeline = result["config"], result["timeline_s"]
    soaked = (timeline["stopped_at"] - timeline["warmup_done"]) / 60.0
    load = ", ".join(f"{value:.1f}" for value in config["loadavg_end"])
    header = (
        f"Soak of {soaked:.1f} minutes (3 peers, swav_tiny on the digits, --schedule local), {result['faults']} "
        f"kills with restarts, commit {(config['git']['commit'] or '?')[:10]}"
        f"{' with local changes' if config['git']['dirty'] else ''}; a shared, loaded machine: {config['cpus']} "
        f"cores, load average at the end {load}. Rounds that succeeded once the faults were over: "
        f"{result['rounds_succeeded_after_faults']} of {result['rounds_attempted_after_faults']} "
        f"(success_ratio_after_faults {result['success_ratio_after_faults']}). Peers up until the harness stopped "
        f"them: {', '.join(p['peer'] for p in result['peers'] if p['incarnations'][-1]['end'] == 'stopped')} "
        f"(final steps {', '.join(str(p['final_step']) for p in result['peers'])})."
        + (f" **Ended early: {result['aborted']}.**" if result["aborted"] else "")
    )
    rows = [
        {
            "metric": t["metric"],
            "value": t["value"],
            "target": t["target"],
            "met": {True: "yes", False: "**NO**", None: ""}[t["met"]],
        }
        for t in result["targets"]
    ]
    return header + "\n\n" + markdown_table(rows)


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt  # SIGTERM too: the finally block stops every peer


def main() -> int:
    args = build_parser().parse_args()
    if args.quick:
        args.minutes, args.kill_every, args.down_for, args.settle, args.grace = 1.0, [5.0, 10.0], [3.0, 3.0], 5.0, 10.0
        args.fault_fraction = 0.5
    if not (args.data_path / "train").is_dir():
        print(f"no {args.data_path}/train: run `make data` first", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, _interrupt)
    soak = Soak(args)
    try:
        soak.start()
        soak.soak()
    except (KeyboardInterrupt, RuntimeError, TimeoutError) as error:
        soak.aborted = soak.aborted or f"{type(error).__name__}: {error}"
        print(f"soak ended early: {soak.aborted}", file=sys.stderr)
    finally:
        soak.stop()
    if soak.soak_start is None:
        for crash in soak.crashes:
            print(f"--- {crash['peer']} log tail ---\n{crash['log_tail']}", file=sys.stderr)
        return 1
    result = report(soak)
    table = markdown(result)
    print(f"\n{table}\n\nlogs and checkpoints: {soak.out}")
    write_json(args.json, result)
    write_text(args.markdown, table)
    met = args.quick or all(t["met"] is not False for t in result["targets"])
    return 0 if not soak.aborted and met else 1


if __name__ == "__main__":
    sys.exit(main())
