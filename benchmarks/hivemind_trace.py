#!/usr/bin/env python
"""Where a peer's averaging time goes: timestamps of hivemind's matchmaking, DHT and AllReduce calls.

Why: to find where healthy peers lose their time when one peer of the swarm is overloaded, we
need to know, per call, how long it took and which remote peer it waited for. hivemind logs some of this at DEBUG,
without durations; this wraps the calls instead (benchmark instrumentation only, never used by the optimizer).

`install(folder)` wraps, in the current process and in every process forked from it afterwards (the DHT and the
averager, if they start later), these coroutines; each call appends one JSON line to folder/<pid>.jsonl:
    dht_rpc        DHTProtocol.call_ping / call_store / call_find: {peer, rpc, s, ok, keys} (the DHT process)
    dht_store, dht_get  DHTNode.store_many / get_many: {s, keys} (a whole DHT operation, all its RPCs)
    assembled      Matchmaking.leader_assemble_group / follower_assemble_group: {role, group}
    join           Matchmaking._request_join_group: {leader, s, outcome} (group / none / error) (averager process)
    look_for_group Matchmaking.look_for_group: {s, group_size}
    declare        GroupKeyManager.declare_averager: {active, s}
    get_averagers  GroupKeyManager.get_averagers: {s, found}
    allreduce      DecentralizedAverager._aggregate_with_group: {s, ok, group}

`python -m benchmarks.hivemind_trace TRACE_DIR BENCH_JSON [SUMMARY_JSON]` summarizes a perturbed run of
bench_averaging.py (run with --trace TRACE_DIR --json BENCH_JSON --json-peers): per window (reference / perturbed),
the healthy peers' calls of each kind, by whom they waited for (the perturbed peer or a healthy one).
"""

from __future__ import annotations

import functools
import json
import os
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

_folder: Path | None = None


def _emit(kind: str, t: float, seconds: float, **fields: Any) -> None:
    if _folder is None:
        return
    line = json.dumps({"kind": kind, "t": t, "s": seconds, **fields}, default=str)
    with open(_folder / f"{os.getpid()}.jsonl", "a") as f:  # one file per process: forked children write their own
        f.write(line + "\n")


def _wrap(owner: type, name: str, kind: str, describe: Callable[..., dict]) -> None:
    original = getattr(owner, name)
    if getattr(original, "_traced", False):
        return

    @functools.wraps(original)
    async def traced(self: Any, *args: Any, **kwargs: Any) -> Any:
        t, result, error = time.time(), None, None
        try:
            result = await original(self, *args, **kwargs)
            return result
        except BaseException as e:
            error = e
            raise
        finally:
            try:
                fields = describe(self, args, kwargs, result, error)
            except Exception as e:  # a trace must never break the traced call
                fields = {"describe_error": repr(e)}
            _emit(kind, t, time.time() - t, ok=error is None, **fields)

    traced._traced = True  # type: ignore[attr-defined]
    setattr(owner, name, traced)


def _group(result: Any) -> list[str] | None:
    return None if result is None else [str(peer) for peer in result.peer_ids]


def install(folder: Path) -> None:
    """Trace hivemind's calls of this process and of the processes it forks from now on into `folder`."""
    global _folder
    from hivemind.averaging import DecentralizedAverager
    from hivemind.averaging.key_manager import GroupKeyManager
    from hivemind.averaging.matchmaking import Matchmaking
    from hivemind.dht.node import DHTNode
    from hivemind.dht.protocol import DHTProtocol

    folder.mkdir(parents=True, exist_ok=True)
    _folder = folder
    for rpc in ("call_ping", "call_store", "call_find"):
        _wrap(
            DHTProtocol,
            rpc,
            "dht_rpc",
            lambda self, a, k, r, e, rpc=rpc: {
                "rpc": rpc,
                "peer": str(a[0] if a else k.get("peer")),
                "answered": r is not None,
                "keys": len(a[1]) if len(a) > 1 else None,
                "in_cache": k.get("in_cache", a[5] if len(a) > 5 else None),
            },
        )
    _wrap(
        DHTNode,
        "store_many",
        "dht_store",
        lambda self, a, k, r, e: {"keys": len(a[0]) if a else None, "key": str(a[0][0])[:80] if a else None},
    )
    _wrap(DHTNode, "get_many", "dht_get", lambda self, a, k, r, e: {"keys": len(a[0]) if a else None})
    for name in ("leader_assemble_group", "follower_assemble_group"):
        _wrap(
            Matchmaking,
            name,
            "assembled",
            lambda self, a, k, r, e, name=name: {"role": name.split("_")[0], "group": _group(r)},
        )
    _wrap(
        Matchmaking,
        "_request_join_group",
        "join",
        lambda self, a, k, r, e: {
            "leader": str(a[0] if a else k.get("leader")),
            "outcome": "error" if e is not None else "none" if r is None else "group",
            "group": _group(r),
        },
    )
    _wrap(
        Matchmaking,
        "look_for_group",
        "look_for_group",
        lambda self, a, k, r, e: {"group": _group(r), "me": str(self.peer_id)},
    )
    _wrap(
        GroupKeyManager,
        "declare_averager",
        "declare",
        lambda self, a, k, r, e: {"active": bool(k.get("looking_for_group", a[3] if len(a) > 3 else True))},
    )
    _wrap(GroupKeyManager, "get_averagers", "get_averagers", lambda self, a, k, r, e: {"found": len(r or ())})
    _wrap(DecentralizedAverager, "_trigger_declare_load_state", "state_priority_changed", lambda *_: {})
    _wrap(
        DecentralizedAverager,
        "_aggregate_with_group",
        "allreduce",
        lambda self, a, k, r, e: {"group": _group(a[0] if a else k.get("group_info"))},
    )


# ----------------------------------------------------------------------------------------------------- summary


def _events(folder: Path) -> list[dict]:
    events = []
    for path in sorted(folder.glob("*.jsonl")):
        for line in path.read_text().splitlines():
            if line.strip():
                events.append(json.loads(line))
    return events


def _target(event: dict, slow: str) -> str:
    """Whom a call waited for: the slow peer, a healthy one, or (DHT operations, matchmaking) the swarm."""
    remote = event.get("peer") or event.get("leader")
    if remote is not None:
        return "slow" if remote == slow else "healthy"
    if event["kind"] == "allreduce":
        return "with slow" if slow in (event.get("group") or ()) else "healthy only"
    return ""


def _name(event: dict, slow: str) -> str:
    kind = event["kind"]
    if kind == "dht_rpc":
        kind = event["rpc"]
    elif kind == "declare":
        kind += "+" if event.get("active") else "-"
    elif kind == "join":
        kind += f" ({event.get('outcome')})"
    target = _target(event, slow)
    return f"{kind} -> {target}" if target else kind


def _stats(values: list[float], minutes: float) -> dict:
    ordered = sorted(values)
    return {
        "per_min": len(values) / minutes,
        "mean_s": sum(values) / len(values),
        "p90_s": ordered[int(0.9 * (len(ordered) - 1))],
    }


def summarize(trace_dir: Path, run: dict) -> dict:
    """Per window: each kind of call of the healthy peers (calls per peer-minute, mean and p90 seconds) by whom it
    waited for, and look_for_group split at the moment its group was assembled (before: finding the group; after:
    hivemind's clean-up before it returns the group)."""
    peers = run["peers"]
    slow_rank = max(p["rank"] for p in peers)
    slow = next(p["peer_id"] for p in peers if p["rank"] == slow_rank)
    first = peers[0]
    windows = {"reference": (first["t0"], first["t1"]), "perturbed": (first["t2"], first["t3"])}
    healthy_events = [_events(trace_dir / f"peer{p['rank']}") for p in peers if p["rank"] != slow_rank]
    out: dict[str, Any] = {"slow_peer": slow, "windows": {}}
    for name, (lo, hi) in windows.items():
        minutes = (hi - lo) / 60 * len(healthy_events)
        durations: dict[str, list[float]] = defaultdict(list)
        for events in healthy_events:
            assembled = sorted(e["t"] for e in events if e["kind"] == "assembled")
            for event in events:
                if not lo <= event["t"] < hi or event["kind"] == "assembled":
                    continue
                durations[_name(event, slow)].append(event["s"])
                if event["kind"] == "look_for_group":
                    end = event["t"] + event["s"]
                    at = next((t for t in assembled if event["t"] <= t <= end), None)
                    if at is not None:
                        durations["look_for_group: until assembled"].append(at - event["t"])
                        durations["look_for_group: assembled until returned"].append(end - at)
        out["windows"][name] = {call: _stats(values, minutes) for call, values in sorted(durations.items())}
    return out


def markdown(summary: dict) -> str:
    calls = sorted({call for table in summary["windows"].values() for call in table})
    windows = list(summary["windows"])
    lines = [
        f"slow peer: {summary['slow_peer']}; per healthy peer: calls per minute, mean / p90 seconds",
        "",
        "| call | " + " | ".join(windows) + " |",
        "|---|" + "---|" * len(windows),
    ]
    for call in calls:
        cells = []
        for table in summary["windows"].values():
            row = table.get(call)
            cells.append("" if row is None else f"{row['per_min']:.0f}/min, {row['mean_s']:.3f} / {row['p90_s']:.3f}")
        lines.append(f"| {call} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    trace_dir, bench_json = Path(argv[0]), Path(argv[1])
    runs = [r for r in json.loads(bench_json.read_text())["runs"] if r.get("peers")]
    if not runs:
        raise SystemExit(f"{bench_json}: no run with per-peer data (run bench_averaging.py with --json-peers)")
    run = runs[0]
    suffix = "" if run.get("compression", "none") == "none" else f"_{run['compression']}"
    summary = summarize(trace_dir / run["regime"] / f"{run['mode']}{suffix}", run)
    print(markdown(summary))
    if len(argv) > 2:
        Path(argv[2]).write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main(sys.argv[1:])
