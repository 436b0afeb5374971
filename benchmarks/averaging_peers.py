"""bench_averaging's peers: each one a forked OS process with its own DHT on 127.0.0.1 (or on its own shaped link in
a network namespace), training for a warm-up and the measured window(s); the orchestrator starts them together,
perturbs the last one in the uneven regimes, collects one result each and kills every process group it started."""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import queue
import signal
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from benchmarks import netns
from benchmarks.averaging_arms import make_driver
from benchmarks.averaging_metrics import _ratio, _to_wall, summarize_run
from benchmarks.averaging_setup import ABLATIONS, RunConfig, SimTrainer
from benchmarks.common import kill_group, missing_ablations

STRAGGLER_STOP_S, STRAGGLER_RUN_S = 0.4, 0.1  # the straggler's process group: stopped 80% of the time
LOG_DIR = Path(tempfile.gettempdir()) / "bench_averaging_logs"


# ----------------------------------------------------------------------------------------------------- peer process


@dataclass
class Channels:
    """IPC between the orchestrator and peers: one message queue each way plus a shared start time; `net_ready`:
    every peer's link is plugged in (regimes with links)."""

    to_parent: Any
    maddrs: Any
    start_at: Any
    go: Any
    net_ready: Any


def _start_dht(rank: int, cfg: RunConfig, channels: Channels) -> Any:
    """Peer 0 is the bootstrap; the others join it. Loopback, or the peer's own link in the link regimes."""
    import hivemind

    host = [f"/ip4/{netns.host_address(rank) if cfg.spec.link_mbit else '127.0.0.1'}/tcp/0"]
    if rank == 0:
        dht = hivemind.DHT(start=True, host_maddrs=host)
        addrs = [str(addr) for addr in dht.get_visible_maddrs()]
        for _ in range(cfg.peers - 1):
            channels.maddrs.put(addrs)
        return dht
    addrs = channels.maddrs.get(timeout=cfg.setup_timeout)
    return hivemind.DHT(start=True, initial_peers=addrs, host_maddrs=host)


def _train_window(cfg: RunConfig, trainer: Any, driver: Any, t_train: float) -> dict:
    """Train for warmup_s + seconds from t_train (the measured window [t0, t1] is the last `seconds`), and in the
    perturbed regimes on until t3. Remember when every local step ended (for throughput and the timeline)."""
    step_times: list[float] = []
    t0, t1, t2, t3 = cfg.windows(t_train)
    end = t1 if t3 is None else t3
    extend = cfg.extend_until_round_s if t3 is None and cfg.mode != "none" else 0.0
    extended, last_look = False, 0.0
    while True:
        now = time.time()
        if now >= end:
            if now >= t1 + extend or (now - last_look >= 0.2 and _window_has_round(driver, t0)):
                break
            extended, last_look = True, now
        driver.train_step()
        step_times.append(time.time())
    if extended:  # an extended window ends with its last step; a fixed one stays [t0, t1]
        t1 = step_times[-1]
    return {
        "t_train": t_train,
        "t0": t0,
        "t1": t1,
        "t2": t2,
        "t3": t3,
        "step_times": step_times,
        "hold_s": list(driver.holds),
        "batch_size": trainer.batch_size,
    }


def _window_has_round(driver: Any, t0: float) -> bool:
    """Whether a round was applied inside the window that began at t0: what the window's metrics need."""
    offset = time.time() - time.monotonic()
    return any(r.get("applied") and (_to_wall(r.get("t_end"), offset) or 0.0) >= t0 for r in driver.records())


def _suffix(cfg: RunConfig) -> str:
    return "" if cfg.compression == "none" else f"_{cfg.compression}"


def log_path(cfg: RunConfig, rank: int) -> Path:
    return LOG_DIR / f"{cfg.regime}_{cfg.mode}{_suffix(cfg)}_peer{rank}.log"


def _all_finite(model: nn.Module) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in [*model.parameters(), *model.buffers()] if t.is_floating_point())


def _redirect_output(cfg: RunConfig, rank: int) -> None:
    """Send this peer's (and its children's) stdout/stderr to a log file: keeps the table readable, keeps evidence."""
    LOG_DIR.mkdir(parents=True, exist_ok=True)
    fd = os.open(log_path(cfg, rank), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def _peer_main(rank: int, cfg: RunConfig, channels: Channels) -> None:
    """Entry point of one peer process. Reports exactly one result (or error) message, then cleans up."""
    os.setpgrp()  # own process group: the orchestrator can kill this peer's DHT/averager/p2pd children in one go
    torch.set_num_threads(1)
    if not cfg.verbose:
        _redirect_output(cfg, rank)
        logging.getLogger("hivemind").setLevel(logging.WARNING)
    dht = driver = None
    try:
        phases = {"start": time.time()}
        if cfg.spec.link_mbit:
            netns.enter_own_namespace()  # the orchestrator plugs our link in meanwhile
        trainer = SimTrainer(cfg, rank)
        phases["trainer"] = time.time()
        if cfg.spec.link_mbit and not channels.net_ready.wait(cfg.setup_timeout):
            raise TimeoutError("the orchestrator never plugged in our network link")
        dht = None if cfg.mode == "none" else _start_dht(rank, cfg, channels)
        phases["dht"] = time.time()
        driver = make_driver(cfg, trainer, dht)
        phases["driver"] = time.time()
        channels.to_parent.put(("ready", rank, phases))
        if not channels.go.wait(cfg.setup_timeout):
            raise TimeoutError("orchestrator never said go")
        time.sleep(max(0.0, channels.start_at.value - time.time()))
        if cfg.spec.perturbation == "slow_step" and rank == cfg.perturbed_rank:
            trainer.slow_from = cfg.windows(channels.start_at.value)[1]
        driver.begin()
        result = _train_window(cfg, trainer, driver, channels.start_at.value)
        result.update(
            rank=rank,
            records=driver.records(),
            in_flight=driver.in_flight(),
            counters=driver.counters(),
            final_step=driver.local_step,
            clock_offset=time.time() - time.monotonic(),
            peer_id=None if dht is None else str(dht.peer_id),
            finite=_all_finite(trainer.model),
        )
        channels.to_parent.put(("result", rank, result))
    except BaseException:
        channels.to_parent.put(("error", rank, traceback.format_exc()))
    finally:
        for name, closer in (("driver", driver), ("dht", dht)):
            t_close = time.time()
            try:
                if closer is not None:
                    closer.shutdown()
            except Exception:
                traceback.print_exc()
            print(f"[bench peer {rank}] {name} shutdown took {time.time() - t_close:.2f}s", file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------------------------------- orchestration


def _collect(channels: Channels, cfg: RunConfig, kind: str, deadline: float) -> dict[int, Any]:
    """Wait for one `kind` message from every peer; an error message from any peer aborts the run."""
    got: dict[int, Any] = {}
    while len(got) < cfg.peers:
        try:
            msg_kind, rank, payload = channels.to_parent.get(timeout=max(0.1, deadline - time.time()))
        except queue.Empty:
            missing = sorted(set(range(cfg.peers)) - set(got))
            raise TimeoutError(f"peers {missing} did not report '{kind}' in time") from None
        if msg_kind == "error":
            raise RuntimeError(f"peer {rank} failed:\n{payload}")
        got[rank] = payload
        if time.time() > deadline and len(got) < cfg.peers:
            raise TimeoutError(f"timed out waiting for '{kind}'")
    return got


class Throttle(threading.Thread):
    """Orchestrator: between `start` and `stop` (time.time()), stop process group `pgid` for STRAGGLER_STOP_S out of
    every STRAGGLER_STOP_S + STRAGGLER_RUN_S seconds, as a box whose CPUs other work saturates. Leaves it running."""

    def __init__(self, pgid: int, start: float, stop: float):
        super().__init__(name="straggler-throttle", daemon=True)
        self.pgid, self.start_at, self.stop_at = pgid, start, stop
        self.cancelled = threading.Event()
        self.stopped_s = self.throttled_s = 0.0

    def run(self) -> None:
        self.cancelled.wait(max(0.0, self.start_at - time.time()))
        began = time.time()
        try:
            while not self.cancelled.is_set() and time.time() < self.stop_at:
                t_stop = time.time()
                os.killpg(self.pgid, signal.SIGSTOP)
                self.cancelled.wait(STRAGGLER_STOP_S)
                os.killpg(self.pgid, signal.SIGCONT)
                self.stopped_s += time.time() - t_stop
                self.cancelled.wait(STRAGGLER_RUN_S)
        except ProcessLookupError:  # the peer is gone: its own error message says why
            pass
        finally:
            self.throttled_s = time.time() - began
            self._resume()

    def _resume(self) -> None:
        try:
            os.killpg(self.pgid, signal.SIGCONT)
        except ProcessLookupError:
            pass

    def close(self) -> None:
        self.cancelled.set()
        if self.is_alive():
            self.join()
        self._resume()


def _unavailable(cfg: RunConfig) -> str | None:
    """Why this run cannot run with the code at hand (it is then reported as skipped), or None."""
    missing = missing_ablations(ABLATIONS.get(cfg.mode, {}))
    return f"DecentralizedSGD has no {', '.join(missing)} flag" if missing else None


def _plug_in_links(cfg: RunConfig, procs: Sequence[Any], channels: Channels) -> None:
    """Link regimes: once each peer process is in its own network namespace, give it its shaped link."""
    for rank, proc in enumerate(procs):
        netns.wait_for_own_namespace(proc.pid, cfg.setup_timeout)
        netns.plug_in(proc.pid, rank, cfg.spec.link_mbit)
    channels.net_ready.set()


def run_one(cfg: RunConfig) -> dict:
    """Run one (regime, mode) with fresh peer processes and fresh DHTs; always kill every process it started."""
    summary: dict[str, Any] = {
        "regime": cfg.regime,
        "mode": cfg.mode,
        "compression": cfg.compression,
        "error": None,
        "skipped": _unavailable(cfg),
    }
    if summary["skipped"]:
        return summary
    ctx = mp.get_context("fork")
    channels = Channels(ctx.Queue(), ctx.Queue(), ctx.Value("d", 0.0), ctx.Event(), ctx.Event())
    procs = [ctx.Process(target=_peer_main, args=(rank, cfg, channels)) for rank in range(cfg.peers)]
    started = time.time()
    summary["loadavg_1m_before"] = os.getloadavg()[0]
    peers: dict[int, dict] = {}
    throttle = None
    try:
        for proc in procs:
            proc.start()
        if cfg.spec.link_mbit:
            _plug_in_links(cfg, procs, channels)
        ready = _collect(channels, cfg, "ready", time.time() + cfg.setup_timeout)
        summary["setup_s"] = max(p["driver"] for p in ready.values()) - started
        summary["setup_phases_s"] = {  # slowest peer per phase: where setup time goes
            name: max(p[name] - p[prev] for p in ready.values())
            for prev, name in pairwise(("start", "trainer", "dht", "driver"))
        }
        channels.start_at.value = time.time() + 0.2  # every peer starts its window at the same instant
        _, t1, _, t3 = cfg.windows(channels.start_at.value)
        if cfg.spec.perturbation == "straggler":
            throttle = Throttle(procs[cfg.perturbed_rank].pid, start=t1, stop=t3)
            throttle.start()
        channels.go.set()
        last_end = (t1 if t3 is None else t3) + cfg.extend_until_round_s
        peers = _collect(channels, cfg, "result", last_end + cfg.setup_timeout)
    except Exception as e:
        summary["error"] = f"{type(e).__name__}: {e}"[-2000:]
        summary["logs"] = [str(log_path(cfg, rank)) for rank in range(cfg.peers)]
    finally:
        if throttle is not None:
            throttle.close()
            summary["straggler_stopped_share"] = _ratio(throttle.stopped_s, throttle.throttled_s)
        deadline = time.time() + cfg.shutdown_grace
        for proc in procs:
            proc.join(max(0.0, deadline - time.time()))
        summary["clean_exit"] = all(proc.exitcode == 0 for proc in procs)
        for proc in procs:
            kill_group(proc.pid)
        for proc in procs:
            proc.join(1.0)
        if cfg.spec.link_mbit:
            for rank in range(cfg.peers):
                netns.unplug(rank)
    summary["wall_s"] = time.time() - started
    summary["loadavg_1m_after"] = os.getloadavg()[0]  # others share these 2 cores: keep the evidence with the number
    summary.update(summarize_run(cfg, [peers[rank] for rank in sorted(peers)]))
    return summary
