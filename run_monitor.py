#!/usr/bin/env python3
"""Watch a swarm: a DHT peer that trains nothing, shows every trainer's progress and can bootstrap the swarm.

    # on a box with a stable address: it prints the join line for the trainers
    python run_monitor.py --run_id swav --host_maddrs /ip4/0.0.0.0/tcp/31337 --identity_path monitor.key
    # or watch a swarm that is already running
    python run_monitor.py --run_id swav --initial_peers /ip4/.../p2p/Qm...

Each trainer publishes a signed record every few seconds (vissl_swarm/swarm_progress.py); every
``--refresh_period`` seconds this prints them as a table, optionally writes it as JSON and to TensorBoard.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

from vissl_swarm import vissl_compat

vissl_compat.silence_known_warnings()  # torch's deprecation noise when hivemind imports it (no VISSL is imported)

from vissl_swarm import swarm  # noqa: E402
from vissl_swarm.swarm_progress import fetch_records, live_records  # noqa: E402

COLUMNS = (
    ("peer", "{:>10}"),
    ("step", "{:>7}"),
    ("samples/s", "{:>10}"),
    ("loss", "{:>8}"),
    ("group", "{:>6}"),
    ("stale", "{:>6}"),
    ("ok", "{:>5}"),
    ("failed", "{:>7}"),
    ("averager failures", "{:>17}"),
    ("seen s ago", "{:>11}"),
)


def build_parser() -> argparse.ArgumentParser:
    defaults = swarm.SwarmSettings()
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--run_id", default=defaults.run_id, help="the trainers' --run_id: whose records to show")
    parser.add_argument(
        "--config",
        default="",
        help="config name the trainers use; only fills in the printed join line (empty: <config>)",
    )
    parser.add_argument(
        "--initial_peers",
        nargs="*",
        default=[],
        help="multiaddrs of running peers; none: this monitor starts the swarm (bootstrap peer)",
    )
    parser.add_argument(
        "--host_maddrs",
        nargs="+",
        default=defaults.host_maddrs,
        help="multiaddrs to listen on; a fixed port (e.g. /ip4/0.0.0.0/tcp/31337) keeps the join "
        "line valid across restarts",
    )
    parser.add_argument(
        "--announce_maddrs", nargs="*", default=[], help="public multiaddrs to announce when behind a port forward"
    )
    parser.add_argument(
        "--identity_path",
        default="",
        help="file with this peer's private key: a stable peer id, so the join line stays valid "
        "across restarts (created if missing)",
    )
    parser.add_argument("--refresh_period", type=float, default=10.0, help="seconds between two reads of the DHT")
    parser.add_argument(
        "--tensorboard_dir",
        type=Path,
        default=None,
        help="also write swarm totals and per-peer loss and samples/s to TensorBoard here",
    )
    parser.add_argument(
        "--iterations", type=int, default=None, help="stop after this many refreshes; none: run until Ctrl-C"
    )
    parser.add_argument(
        "--json",
        type=Path,
        default=None,
        help="write the latest table here as JSON (replaced atomically at every refresh)",
    )
    swarm.add_secret_arguments(parser)  # the trainers' secret: without it their records cannot be read
    return parser


def peer_rows(records: dict[bytes, dict[str, Any]], now: float) -> list[dict[str, Any]]:
    """One row per box (its newest record: a restarted box's earlier life is not listed), sorted by peer id; alive
    as the trainers count it (``swarm_progress.live_records``). "Seen" uses the publisher's own clock (NTP is
    assumed)."""
    live = {record["peer_id"] for record in live_records(records.values())}
    newest = {record["peer_id"]: record for record in sorted(records.values(), key=lambda record: record["time"])}
    rows = [
        {
            **{key: value for key, value in record.items() if key not in ("owner", "signature")},
            "peer": record["peer_id"][-8:],
            "seen_s_ago": round(max(0.0, now - record["time"]), 1),
            "alive": record["peer_id"] in live,
        }
        for record in newest.values()
    ]
    return sorted(rows, key=lambda row: row["peer_id"])


def swarm_totals(rows: list[dict[str, Any]]) -> dict[str, Any]:
    alive = [row for row in rows if row["alive"]]
    losses = [row["loss"] for row in alive if row["loss"] is not None]
    return {
        "peers_alive": len(alive),
        "peers_listed": len(rows),
        "samples_per_s": round(float(sum(row["samples_per_s"] for row in alive)), 2),
        "max_step": max((row["step"] for row in alive), default=0),
        "mean_loss": sum(losses) / len(losses) if losses else None,
    }


def format_table(rows: list[dict[str, Any]], totals: dict[str, Any]) -> str:
    def show(value: Any, digits: int = 1) -> str:
        if value is None:
            return "-"
        return f"{value:.{digits}f}" if isinstance(value, float) else str(value)

    lines = ["  ".join(fmt.format(name) for name, fmt in COLUMNS)]
    for row in rows:
        cells = (
            row["peer"],
            row["step"],
            show(row["samples_per_s"]),
            show(row["loss"], 4),
            show(row["group_size"]),
            show(row["staleness_steps"]),
            row["rounds_ok"],
            row["rounds_failed"],
            row["averager_failures"],
            show(row["seen_s_ago"]) + ("" if row["alive"] else " (left)"),
        )
        lines.append("  ".join(fmt.format(cell) for (_, fmt), cell in zip(COLUMNS, cells, strict=True)))
    lines.append(
        f"swarm: {totals['peers_alive']} peers alive, {totals['samples_per_s']:.1f} samples/s in total, "
        f"latest step {totals['max_step']}, mean loss {show(totals['mean_loss'], 4)}"
    )
    alone = [row for row in rows if row["alive"] and row.get("no_group_s", 0.0) >= swarm.ALONE_AFTER_S]
    if alone:
        lines.append(
            "alone (no averaging round for over a minute; its log's warning says what to check): "
            + ", ".join(f"{row['peer']} ({row['no_group_s']:.0f} s)" for row in alone)
        )
    return "\n".join(lines)


def write_json(path: Path, snapshot: dict[str, Any]) -> None:
    """Write then rename: a reader (a test, a dashboard) never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.tmp")
    temporary.write_text(json.dumps(snapshot, indent=1))
    os.replace(temporary, path)


class TensorBoardLog:
    """Swarm totals and per-peer curves against the swarm's latest step, written when that step moves on."""

    def __init__(self, log_dir: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter  # imported here: torch is slow to import

        self.writer = SummaryWriter(log_dir=str(log_dir))
        self.last_step = -1

    def add(self, rows: list[dict[str, Any]], totals: dict[str, Any]) -> None:
        step = totals["max_step"]
        if step <= self.last_step or not totals["peers_alive"]:
            return
        self.last_step = step
        self.writer.add_scalar("swarm/peers_alive", totals["peers_alive"], step)
        self.writer.add_scalar("swarm/samples_per_s", totals["samples_per_s"], step)
        if totals["mean_loss"] is not None:
            self.writer.add_scalar("swarm/mean_loss", totals["mean_loss"], step)
        for row in rows:
            if row["alive"] and row["loss"] is not None:
                self.writer.add_scalar(f"peers/{row['peer']}/loss", row["loss"], step)
            if row["alive"]:
                self.writer.add_scalar(f"peers/{row['peer']}/samples_per_s", row["samples_per_s"], step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


def settings_from(args: argparse.Namespace) -> swarm.SwarmSettings:
    if "." in args.run_id or not args.run_id:
        raise swarm.SwarmError(f"--run_id must be a non-empty name without '.', got {args.run_id!r}")
    if args.refresh_period <= 0:
        raise swarm.SwarmError(f"--refresh_period must be positive, got {args.refresh_period}")
    if args.iterations is not None and args.iterations < 1:
        raise swarm.SwarmError(f"--iterations must be at least 1, got {args.iterations}")
    settings = swarm.SwarmSettings(
        run_id=args.run_id,
        initial_peers=args.initial_peers,
        host_maddrs=args.host_maddrs,
        announce_maddrs=args.announce_maddrs,
        identity_path=args.identity_path,
        config_name=args.config,
        **swarm.secret_settings(args),
    )
    for flag in ("--initial_peers", "--host_maddrs", "--announce_maddrs"):
        swarm.check_multiaddrs(flag, getattr(settings, flag[2:]))
    return settings


def monitor(dht: Any, args: argparse.Namespace, join_line: str) -> None:
    """Refresh until --iterations or Ctrl-C; each refresh prints the table (redrawn in place on a terminal)."""
    tensorboard = TensorBoardLog(args.tensorboard_dir) if args.tensorboard_dir else None
    stop = threading.Event()
    for signal_number in (signal.SIGINT, signal.SIGTERM):  # a flag, not KeyboardInterrupt: hivemind's futures
        signal.signal(signal_number, lambda *_: stop.set())  # may swallow it while the main thread waits on them
    try:
        for refresh in itertools.count(1):
            if stop.is_set():
                return
            try:
                records = fetch_records(dht, args.run_id, timeout=max(args.refresh_period, 10.0))
            except TimeoutError:
                print(f"refresh {refresh}: the DHT did not answer in time; trying again", flush=True)
            else:
                report(records, refresh, args, join_line, tensorboard)
            if args.iterations is not None and refresh >= args.iterations:
                return
            stop.wait(args.refresh_period)
    finally:
        if tensorboard is not None:
            tensorboard.close()


def report(
    records: dict[bytes, dict[str, Any]],
    refresh: int,
    args: argparse.Namespace,
    join_line: str,
    tensorboard: TensorBoardLog | None,
) -> None:
    rows = peer_rows(records, time.time())
    totals = swarm_totals(rows)
    if sys.stdout.isatty():
        print("\033[H\033[J" + join_line)
    print(
        f"run {args.run_id!r}, refresh {refresh}, {time.strftime('%H:%M:%S')}\n{format_table(rows, totals)}\n",
        flush=True,
    )
    if args.json is not None:
        write_json(
            args.json, {"run_id": args.run_id, "refresh": refresh, "time": time.time(), "peers": rows, "totals": totals}
        )
    if tensorboard is not None:
        tensorboard.add(rows, totals)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        settings = settings_from(args)
    except swarm.SwarmError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    try:
        dht = swarm.start_dht(settings)
    except swarm.SwarmError as error:
        print(f"error: {error}", file=sys.stderr)
        return 3
    try:
        join_line = f"To join this swarm, run on another box:\n  {swarm.join_command(dht, settings)}"
        print(join_line, flush=True)
        monitor(dht, args, join_line)
    except KeyboardInterrupt:
        pass
    finally:
        dht.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
