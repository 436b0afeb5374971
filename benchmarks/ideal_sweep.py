#!/usr/bin/env python3
"""Screen the ideal swarm's levers (``ideal_swarm``) at bench_optimizer's recipe: one deterministic run per job, a
job per line of the output, then a table of each variant against the plain ideal at the same period.

    .venv/bin/python -m benchmarks.ideal_sweep run --plan screening --seeds 5 --out benchmarks/results/ideal_sweep.jsonl
    .venv/bin/python -m benchmarks.ideal_sweep table benchmarks/results/ideal_sweep.jsonl \
        > benchmarks/results/ideal_sweep.md

Why apart from bench_optimizer: these runs need no hivemind and no pacing, take ~22 s each on one thread whatever
the machine's load, and are exact for a seed, so dozens of variants can be screened before the few that look
useful are run against the real swarm (``bench_optimizer.py --experiments outer``). A job's keys: ``rule`` (the
swarm_lr rule), ``seed``, ``period`` and the ``IdealOptions`` fields (``group``, ``staleness``,
``momentum_buffers``, ``spacing``, ``wire``), the outer step's ``b`` (momentum), ``a`` (lr), ``nesterov``, and
``samples`` (the swarm's budget S, default bench_optimizer's 120k: plan ``budget`` asks how the gap to DDP's math and
the outer step's gain change when a run holds more rounds at the same period; plan ``wire`` whether 8-bit's twice the
rounds for the same bytes pay for its rounding).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path
from statistics import mean, stdev

from benchmarks.common import git_state

OUTER_KEYS = ("b", "a", "nesterov")
BASE_KEYS = ("rule", "period", "samples")  # a variant's plain ideal: the same of these, no lever

PLANS = {
    "screening": [
        *(
            dict(job, period=period)
            for period in (25, 150)
            for job in (
                dict(rule="sqrt"),
                dict(rule="box"),
                dict(rule="linear"),
                dict(rule="box", a=1.5),
                dict(rule="box", a=2.0),
                dict(rule="sqrt", a=1.5),
                dict(rule="box", b=0.5),
                dict(rule="sqrt", b=0.5),
                dict(rule="box", b=0.67, a=0.7, nesterov=True),
                dict(rule="sqrt", b=0.5, a=0.7, nesterov=True),
                dict(rule="sqrt", momentum_buffers="average"),
                dict(rule="sqrt", momentum_buffers="reset"),
            )
        ),
        dict(rule="sqrt", period=25, group="pairs"),
        dict(rule="sqrt", period=25, staleness=3),
        dict(rule="linear", period=1, momentum_buffers="average"),
    ],
    "system": [  # what the swarm's rounds really see (bench_optimizer's rounds: ~20 steps, ~9 steps stale, full groups)
        dict(rule="sqrt", period=25, staleness=9),
        dict(rule="sqrt", period=20),
        dict(rule="sqrt", period=20, staleness=9),
        dict(rule="sqrt", period=25, staleness=9, b=0.5, a=0.7, nesterov=True),
        dict(rule="sqrt", period=25, group="pairs", b=0.5, a=0.7, nesterov=True),
    ],
    "post_local": [  # the same 6 rounds as at 179 steps per round, denser early (> 1) or late (< 1)
        dict(rule="sqrt", period=179),
        dict(rule="sqrt", period=179, spacing=2.0),
        dict(rule="sqrt", period=179, spacing=1.5),
        dict(rule="sqrt", period=179, spacing=0.7),
    ],
    "wire": [  # more rounds for the same bytes: 8-bit halves fp16's bytes, so at a link-bound period twice the rounds
        dict(rule="sqrt", period=179, wire="fp16"),
        dict(rule="sqrt", period=179, wire="uint8"),
        dict(rule="sqrt", period=90),
        dict(rule="sqrt", period=90, wire="fp16"),
        dict(rule="sqrt", period=90, wire="uint8"),
    ],
    **{
        name: [  # the real boxes' period in runs 3x and 9x as long (20 and 60 rounds), against DDP's update
            dict(job, samples=samples)
            for job in (
                dict(rule="sqrt", period=179),
                dict(rule="sqrt", period=179, b=0.5, a=0.7, nesterov=True),
                dict(rule="linear", period=1, momentum_buffers="average"),  # every step, momentum too: DDP's math
            )
        ]
        for name, samples in (("budget", 360_000), ("budget_long", 1_080_000))
    },
}


def run_job(job: dict) -> dict:
    """One ideal run: the mean final accuracy of its replicas."""
    import torch

    torch.set_num_threads(1)
    from benchmarks import optimizer_plan as bench
    from benchmarks.ideal_swarm import IdealOptions, train_ideal
    from decentralized_sgd.outer import OuterSettings

    options = {key: value for key, value in job.items() if key not in ("seed", *BASE_KEYS, *OUTER_KEYS)}
    outer = OuterSettings(job.get("b", 0.0), job.get("a", 1.0), job.get("nesterov", False))
    started = time.time()
    peers = train_ideal(
        bench.RunSpec("swarm", job["seed"], swarm_lr=job["rule"]),
        bench.Settings(samples=job.get("samples", bench.Settings().samples)),
        bench.FashionMNIST.load(bench.DATA_DIR),
        IdealOptions(period=job["period"], outer=outer, **options),
        bench,
    )
    return {**job, "acc": mean(peer["final_accuracy"] for peer in peers), "s": time.time() - started}


def variant_of(job: dict) -> str:
    return json.dumps({key: value for key, value in sorted(job.items()) if key not in ("seed", "acc", "s", "commit")})


def short(commit: str) -> str:
    """A hash's first 10 digits; anything else (a note written with the commit) as it is."""
    return commit[:10] if len(commit) == 40 and all(c in "0123456789abcdef" for c in commit) else commit


def table(rows: list[dict]) -> str:
    """Per variant: mean ± std over seeds, and the per-seed difference to the plain ideal (same rule, period)."""
    by_variant: dict[str, dict[int, float]] = defaultdict(dict)
    for row in rows:
        by_variant[variant_of(row)][row["seed"]] = row["acc"]
    lines = [
        "| variant | seeds | final test acc | − plain ideal, same rule and period (per seed) |",
        "|---|---|---|---|",
    ]

    def order(item: tuple[str, dict]) -> tuple:
        job = json.loads(item[0])
        return job.get("samples", 0), job["period"], item[0]

    for name, accs in sorted(by_variant.items(), key=order):
        job = json.loads(name)
        plain = by_variant.get(variant_of({key: job[key] for key in BASE_KEYS if key in job}), {})
        diffs = [accs[seed] - plain[seed] for seed in accs if seed in plain]
        spread = f" ± {stdev(accs.values()):.4f}" if len(accs) > 1 else ""
        gain = "—" if plain is accs or not diffs else f"{mean(diffs):+.4f}"
        if len(diffs) > 1 and plain is not accs:
            gain += f" ± {stdev(diffs):.4f}"
        lines.append(f"| {name} | {len(accs)} | {mean(accs.values()):.4f}{spread} | {gain} |")
    commits = sorted({short(row.get("commit", "?")) for row in rows})
    return "\n".join(lines) + f"\n\nMeasured at commit(s) {', '.join(commits)}.\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("run", help="run a plan's jobs, appending one JSON line each to --out")
    run.add_argument("--plan", choices=sorted(PLANS), required=True)
    run.add_argument("--seeds", type=int, default=5)
    run.add_argument("--out", type=Path, required=True)
    run.add_argument("--job", default=None, help=argparse.SUPPRESS)  # internal: one job, printed as JSON
    show = commands.add_parser("table", help="the markdown table of a --out file")
    show.add_argument("results", type=Path)
    args = parser.parse_args()
    if args.command == "table":
        print(table([json.loads(line) for line in args.results.read_text().splitlines() if line.strip()]))
        return 0
    if args.job is not None:
        print(json.dumps(run_job(json.loads(args.job))))
        return 0
    commit = git_state()["commit"]
    done = set()
    if args.out.exists():
        done = {(variant_of(row), row["seed"]) for row in map(json.loads, args.out.read_text().splitlines())}
    jobs = [dict(job, seed=seed) for seed in range(args.seeds) for job in PLANS[args.plan]]
    jobs = [job for job in jobs if (variant_of(job), job["seed"]) not in done]
    print(f"{len(jobs)} jobs, ~22 s each on one thread", flush=True)
    for index, job in enumerate(jobs):  # a process per job: two of these commands can share a 2-core machine
        result = subprocess.run(
            [
                sys.executable,
                "-m",
                "benchmarks.ideal_sweep",
                "run",
                "--plan",
                args.plan,
                "--out",
                str(args.out),
                "--job",
                json.dumps(job),
            ],
            capture_output=True,
            text=True,
            check=True,
        )
        row = {**json.loads(result.stdout.strip().splitlines()[-1]), "commit": commit}
        with args.out.open("a") as out:
            out.write(json.dumps(row) + "\n")
        print(f"[{index + 1}/{len(jobs)}] {variant_of(job)} seed {job['seed']}: {row['acc']:.4f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
