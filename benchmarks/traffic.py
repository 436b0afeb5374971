#!/usr/bin/env python3
"""Network traffic per config: what one box sends (and receives) per averaging round and per day.

    .venv/bin/python -m benchmarks.traffic --json benchmarks/results/traffic.json \
        --markdown benchmarks/results/traffic.md

Counts what the averager really sends: the tensors ``DecentralizedSGD`` averages (``decentralized_sgd.tensors``:
the parameters VISSL's optimizer trains, and the model's float buffers, i.e. BatchNorm statistics; no optimizer
state by default), at the default compression (fp16: 2 bytes per value, ``decentralized_sgd.compression``), times
hivemind's butterfly AllReduce share ``2 (n-1)/n`` (``preflight.allreduce_bytes``). Left out: the summaries every
member gathers into a round (``vetting``: 33 numbers for its weights, 33 for its last average, ~0.5 kB) and
protocol framing. Per day: at the rounds/min bench_averaging measured on shaped links (``MEASURED_ROUNDS_PER_MIN``,
``benchmarks/results/wan_{100mbit,1gbit}.json``), beside the link's own cap.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.common import commit_label, parse_with_quick, write_json, write_text
from vissl_swarm import vissl_compat

vissl_compat.apply()

from vissl_swarm.preflight import BYTES_PER_VALUE, allreduce_bytes  # noqa: E402 (after vissl_compat.apply)

MEASURED_ROUNDS_PER_MIN = {"100 Mbit/s": 7.7, "1 Gbit/s": 11.8}  # README "Bandwidth-limited links", a92a56c
MEASURED_AT = "a92a56c"
LINK_MBIT = {"100 Mbit/s": 100.0, "1 Gbit/s": 1000.0}
MATCHMAKING_CAP_PER_MIN = 60 / 5.0  # one group per min_matchmaking_time (default 5 s)
GROUP_SIZES = (2, 4)  # the smallest group, and the default --target_group_size


def config_names() -> list[str]:
    from vissl_swarm.config_loading import available_configs

    return list(available_configs())


def averaged_values(name: str) -> dict[str, int]:
    """{"params", "buffers", "values", "tensors"} of config ``name``'s model as a peer builds it, counted as
    ``AveragedTensors`` selects them: trainable parameters (what VISSL's optimizer holds) and float buffers."""
    from decentralized_task import DecentralizedSelfSupervisionTask
    from vissl_swarm import swarm
    from vissl_swarm.config_loading import compose_config

    config, _ = compose_config(name, [], has_gpu=False)
    config.SWARM = swarm.SwarmSettings(run_id="traffic", config_name=name).to_config()
    model = DecentralizedSelfSupervisionTask(config)._build_model()
    params = [p for p in model.parameters() if p.requires_grad]
    buffers = [b for b in model.buffers() if b.is_floating_point()]
    return {
        "params": sum(p.numel() for p in params),
        "buffers": sum(b.numel() for b in buffers),
        "values": sum(t.numel() for t in [*params, *buffers]),
        "tensors": len(params) + len(buffers),
    }


def config_row(name: str, counts: dict[str, int], compression: str = "fp16") -> dict[str, Any]:
    per_value = BYTES_PER_VALUE[compression]
    row: dict[str, Any] = {"config": name, **counts, "compression": compression, "bytes_per_value": per_value}
    for n in GROUP_SIZES:
        row[f"sent_per_round_mb_group{n}"] = allreduce_bytes(counts["values"], per_value, n) / 1e6
    sent = allreduce_bytes(counts["values"], per_value, max(GROUP_SIZES))
    for link, rounds_per_min in MEASURED_ROUNDS_PER_MIN.items():
        row[f"sent_per_day_gb_{link}"] = sent * rounds_per_min * 60 * 24 / 1e9
        link_cap = 60 / (sent * 8 / (LINK_MBIT[link] * 1e6))  # one AllReduce at a time, link-bound
        row[f"rounds_per_min_cap_{link}"] = min(link_cap, MATCHMAKING_CAP_PER_MIN)
    row["gpu_memory"] = "not measured: no GPU here"
    return row


def _amount(value: float) -> str:
    return f"{value:,.0f}" if value >= 100 else f"{value:.3g}"


def markdown(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| config | values averaged (params + buffers) | MB sent per round per box, group 2 / 4 (fp16) | "
        "GB per day per box, group 4, at 7.7 r/min (100 Mbit/s) / 11.8 r/min (1 Gbit/s) | rounds/min the link "
        "allows at group 4: 100 Mbit/s / 1 Gbit/s | GPU memory |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['config']} | {r['values']:,} ({r['params']:,} + {r['buffers']:,}) | "
            f"{r['sent_per_round_mb_group2']:.3g} / {r['sent_per_round_mb_group4']:.3g} | "
            f"{_amount(r['sent_per_day_gb_100 Mbit/s'])} / {_amount(r['sent_per_day_gb_1 Gbit/s'])} | "
            f"{r['rounds_per_min_cap_100 Mbit/s']:.3g} / {r['rounds_per_min_cap_1 Gbit/s']:.3g} | {r['gpu_memory']} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", nargs="*", default=None, help="config names (default: every one in configs/)")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--markdown", type=Path, default=None)
    args = parse_with_quick(parser, argv, configs=["swav_tiny", "swav_resnet50"])
    names = args.configs or config_names()
    unknown = sorted(set(names) - set(config_names()))
    if unknown:
        print(f"error: unknown config(s) {', '.join(unknown)}; available: {', '.join(config_names())}", file=sys.stderr)
        return 2
    started = time.time()
    rows = [config_row(name, averaged_values(name)) for name in names]
    table = markdown(rows)
    print(table)
    meta = {
        "commit": commit_label(),
        "rounds_per_min": MEASURED_ROUNDS_PER_MIN,
        "rounds_per_min_commit": MEASURED_AT,
        "matchmaking_cap_per_min": MATCHMAKING_CAP_PER_MIN,
        "seconds": round(time.time() - started, 1),
        "gpu": "none: GPU memory not measured",
    }
    write_json(args.json, {"meta": meta, "rows": rows})
    intro = (
        f"Generated by `python -m benchmarks.traffic` at {meta['commit']}; rounds/min from the README at {MEASURED_AT}."
    )
    write_text(args.markdown, f"{intro}\n\n{table}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
