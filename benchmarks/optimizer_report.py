"""bench_optimizer's report: curves over seeds, crossings, per-seed paired differences, the tables and the plots."""

from __future__ import annotations

import argparse
from pathlib import Path
from statistics import mean, median
from typing import Any

from benchmarks import common
from benchmarks.common import (
    crossing,
    fmt,
    paired_difference,
    plot_band,
    pyplot,
    save_figure,
    spread,
    value_at,
    write_json,
    write_text,
)


def summarize_run(peers: list[dict]) -> dict:
    """A run's curve: at each checkpoint the mean accuracy over the peers that evaluated (ddp: rank 0)."""
    evaluated = [peer for peer in peers if peer["curve"]]
    by_step = [{point["step"]: point for point in peer["curve"]} for peer in evaluated]
    points = []
    for first in evaluated[0]["curve"]:  # churn: a peer away at a checkpoint has no point there
        accuracies = [curve[first["step"]]["accuracy"] for curve in by_step if first["step"] in curve]
        points.append({"step": first["step"], "swarm_samples": first["swarm_samples"], "accuracy": mean(accuracies)})
    per_round = [peer["steps_per_round"] for peer in peers if peer.get("steps_per_round")]
    return {
        "curve": points,
        "final_accuracy": points[-1]["accuracy"],
        "steps_per_peer": peers[0]["steps"],
        "rounds_applied_per_peer": mean(peer.get("rounds_applied", 0) for peer in peers),
        "steps_per_round": mean(per_round) if per_round else None,
        "peer_final_accuracies": [peer["final_accuracy"] for peer in evaluated],
    }


def summarize(runs: list[dict]) -> list[dict]:
    """Per variant: seeds, final accuracy mean ± std, the mean curve, steps per round, the comparisons to alone, ddp."""
    variants: dict[str, list[dict]] = {}
    for run in runs:
        variants.setdefault(run["variant"], []).append(run)
    summaries = []
    for variant, group in variants.items():
        done = [run for run in group if run["error"] is None]
        entry: dict[str, Any] = {
            "variant": variant,
            "mode": group[0]["mode"],
            "swarm_lr": group[0]["swarm_lr"],
            "unequal": group[0]["unequal"],
            "regime": group[0]["regime"],
            "weight_by_samples": group[0]["weight_by_samples"],
            "period": group[0].get("period", 0),
            "churn": group[0].get("churn", ""),
            "pace_s": group[0].get("pace_s", 0.0),
            "outer": [group[0].get("outer_momentum", 0.0), group[0].get("outer_lr", 1.0)]
            + [group[0].get("outer_nesterov", False)],
            "runs": len(group),
            "seeds": [run["seed"] for run in done],
            "errors": len(group) - len(done),
        }
        if done:
            finals = [run["final_accuracy"] for run in done]
            entry["final_mean"], entry["final_std"] = spread(finals)
            entry["per_seed"] = {str(run["seed"]): round(run["final_accuracy"], 4) for run in done}
            curves = [run["curve"] for run in done if len(run["curve"]) == len(done[0]["curve"])]
            entry["curve"] = [
                {
                    "step": point["step"],
                    "swarm_samples": point["swarm_samples"],
                    "accuracy": mean(curve[at]["accuracy"] for curve in curves),
                    "std": spread([curve[at]["accuracy"] for curve in curves])[1],
                }
                for at, point in enumerate(curves[0])
            ]
            entry["steps_per_peer"] = done[0]["steps_per_peer"]
            entry["rounds_per_peer"] = mean(run["rounds_applied_per_peer"] for run in done)
            per_round = [run["steps_per_round"] for run in done if run["steps_per_round"]]
            entry["steps_per_round"], entry["steps_per_round_std"] = spread(per_round)
            entry["steps_per_round_per_seed"] = [round(value, 1) for value in per_round]
            if variant.endswith("unequal, weight_by_samples") or variant.endswith("unequal, equal weights"):
                entry["fast_peer_final_mean"] = mean(run["peer_final_accuracies"][-1] for run in done)
                entry["slow_peers_final_mean"] = mean(mean(run["peer_final_accuracies"][:-1]) for run in done)
        summaries.append(entry)
    add_comparisons(summaries)
    return summaries


def add_comparisons(summaries: list[dict]) -> None:
    by_name = {entry["variant"]: entry for entry in summaries}
    alone, ddp = by_name.get("alone"), by_name.get("ddp")
    for entry in summaries:
        if "curve" not in entry:
            continue
        curve = [(point["step"], point["accuracy"]) for point in entry["curve"]]
        if alone is not None and "curve" in alone:
            alone_curve = [(point["step"], point["accuracy"]) for point in alone["curve"]]
            alone_steps = alone_curve[-1][0]
            targets = {
                "final": (alone["final_mean"], alone_steps),
                "half": (value_at(alone_curve, alone_steps / 2), alone_steps / 2),
                "third": (value_at(alone_curve, alone_steps / 3), alone_steps / 3),
            }
            for name, (target, steps) in targets.items():
                reached = steps if entry is alone else crossing(curve, target)  # alone: the reference, by definition
                entry[f"target_{name}"] = target
                entry[f"steps_to_alone_{name}"] = reached
                entry[f"speedup_{name}"] = steps / reached if reached else None
        if ddp is not None and ddp.get("final_mean") is not None:
            entry["vs_ddp"] = entry["final_mean"] - ddp["final_mean"]


def mean_std(entry: dict) -> str:
    return common.mean_std(entry.get("final_mean"), entry.get("final_std"))


def speedup(entry: dict, name: str) -> str:
    if entry.get(f"target_{name}") is None:
        return "—"
    value = entry.get(f"speedup_{name}")
    return "not reached" if value is None else f"{value:.2f}x"


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join([*lines, *("| " + " | ".join(row) + " |" for row in rows)])


def row(entry: dict) -> list[str]:
    return [
        entry["variant"],
        mean_std(entry),
        str(len(entry.get("seeds", []))),
        str(entry.get("steps_per_peer", "—")),
        speedup(entry, "final"),
        speedup(entry, "half"),
        speedup(entry, "third"),
        fmt(entry.get("vs_ddp"), signed=True),
        steps_per_round(entry),
        fmt(entry.get("rounds_per_peer"), 1),
    ]


def steps_per_round(entry: dict) -> str:
    """Median (min-max) over seeds: one run on a busy machine can average far less often than the others."""
    values = entry.get("steps_per_round_per_seed")
    if not values:
        return "—"
    return f"{median(values):.0f} ({min(values):.0f}–{max(values):.0f})" if len(values) > 1 else f"{values[0]:.0f}"


HEADER = [
    "variant",
    "final test acc (mean ± std)",
    "seeds",
    "steps per peer",
    "speed-up to alone's final",
    "speed-up to alone's half-run acc",
    "speed-up to alone's third-run acc",
    "final acc − ddp's",
    "local steps per applied round (median (min–max) over seeds)",
    "applied rounds per peer",
]


def markdown(result: dict) -> str:
    summaries, settings = result["summary"], result["settings"]
    by_exp: dict[str, list[dict]] = {"main": [], "lr": [], "weighting": [], "slowed": [], "gap": [], "churn": []}
    for entry in summaries:
        if entry["churn"] or entry["pace_s"]:
            by_exp["churn"].append(entry)
        elif entry["mode"] == "ideal" or entry["outer"][:2] != [0.0, 1.0]:
            by_exp["gap"].append(entry)
        elif entry["unequal"]:
            by_exp["weighting"].append(entry)
        elif entry["regime"] != "loopback":
            by_exp["slowed"].append(entry)
        elif entry["mode"] == "swarm" and entry["swarm_lr"] != result["swarm_lr"]:
            by_exp["lr"].append(entry)
        else:
            by_exp["main"].append(entry)
    reference = [e for e in by_exp["main"] if e["mode"] in ("alone", "ddp")]
    main_swarm = [e for e in by_exp["main"] if e["mode"] == "swarm"]
    parts = [
        f"Fashion-MNIST, S = {settings['samples']} samples (the swarm's total), B = {settings['batch']}, peak LR "
        f"{settings['lr']} at B, momentum {settings['momentum']}, warm-up {settings['warmup']:.0%} + cosine; "
        f"{settings['peers']} peers; commit {result['commit']['head'][:10]}"
        f"{' (dirty)' if result['commit']['dirty'] else ''}. Speed-ups: alone's steps / the steps per peer at "
        "which the variant's mean curve first reaches alone's mean accuracy (final, or at half or a third of its "
        "run; a third: the steps a swarm peer takes, so below 1x the swarm does worse than one peer alone in "
        'the same steps). "not reached": the variant\'s curve never gets there.',
        "",
    ]
    sections = [
        ("Modes", by_exp["main"], []),
        (f"LR scaling of the swarm (swarm_lr; main rule: {result['swarm_lr']})", by_exp["lr"], reference + main_swarm),
        ("Unequal peers: one at 2B; equal weights vs weight_by_samples", by_exp["weighting"], reference),
        ("Averaging frequency: slowed rounds", by_exp["slowed"], reference + main_swarm),
        ("The ideal swarm and the outer optimizer", by_exp["gap"], reference + main_swarm + by_exp["slowed"]),
        ("Churn: peer 2 away for the middle third of the run", by_exp["churn"], reference + main_swarm),
    ]
    for title, own, context in sections:
        if own:
            entries = sorted(context + own, key=lambda e: (e["mode"] not in ("alone", "ddp"), e["variant"]))
            parts += [f"### {title}", "", table(HEADER, [row(entry) for entry in entries]), ""]
    if by_exp["weighting"]:
        parts += [
            "Unequal: final accuracy of the 2B peer / of the B peers (mean over seeds): "
            + "; ".join(
                f"{e['variant']}: {fmt(e.get('fast_peer_final_mean'))} / {fmt(e.get('slow_peers_final_mean'))}"
                for e in by_exp["weighting"]
            ),
            "",
        ]
    if by_exp["gap"]:
        parts += gap_decomposition(summaries)
    if by_exp["churn"]:
        by_churn = {e["churn"]: e for e in by_exp["churn"] if e["mode"] == "swarm"}
        whole = by_churn.get("")
        if "kill" in by_churn and "pause" in by_churn:
            parts += [
                "Churn, per seed: kill − pause (what the crash costs beyond its lost samples) "
                f"{paired(by_churn['kill'], by_churn['pause'])}"
                + (
                    f"; pause − uninterrupted (what the lost samples cost) {paired(by_churn['pause'], whole)}"
                    if whole is not None
                    else ""
                ),
                "",
            ]
    parts += ["Per seed (final test accuracy, mean of the run's peers):", ""]
    parts += [
        f"- {e['variant']}: " + ", ".join(f"seed {seed} {acc:.4f}" for seed, acc in e.get("per_seed", {}).items())
        for e in summaries
    ]
    commits = sorted(
        {
            f"{run['commit']['head'][:10]}{' (dirty)' if run['commit']['dirty'] else ''}"
            for run in result["runs"]
            if run.get("commit")
        }
    )
    commands = result.get("commands", [result["command"]])
    parts += [
        "",
        f"Runs measured at commit(s) {', '.join(commits) or '—'}; command(s): "
        + "; ".join("`" + " ".join(command) + "`" for command in commands),
    ]
    errors = [run for run in result["runs"] if run["error"]]
    if errors:
        parts += [
            "",
            "Failed runs:",
            *(f"- {run['variant']} seed {run['seed']}: {run['error'][:300]}" for run in errors),
        ]
    return "\n".join(parts) + "\n"


def paired(a: dict, b: dict) -> str:
    """a − b over the seeds both have: mean ± std of the per-seed differences (n)."""
    difference = paired_difference(a.get("per_seed", {}), b.get("per_seed", {}))
    if difference is None:
        return "—"
    std = "" if difference["std"] is None else f" ± {difference['std']:.4f}"
    return f"{difference['mean']:+.4f}{std} (n={len(difference['seeds'])})"


def gap_decomposition(summaries: list[dict]) -> list[str]:
    """Per swarm variant with an ideal of the same regime, LR rule and outer optimizer: what the system costs
    (swarm − ideal, per seed) and what periodic averaging costs (ideal − ddp); and what the outer step adds."""
    ddp = next((e for e in summaries if e["variant"] == "ddp"), None)
    swarms = [  # not the churn runs: paced, they average at another period than their regime's ideal
        e
        for e in summaries
        if e["mode"] == "swarm" and not (e["unequal"] or e["churn"] or e["pace_s"]) and e.get("final_mean") is not None
    ]
    rows = []
    for swarm in swarms:
        ideal = next(
            (
                e
                for e in summaries
                if e["mode"] == "ideal"
                and (e["regime"], e["swarm_lr"], e["outer"]) == (swarm["regime"], swarm["swarm_lr"], swarm["outer"])
            ),
            None,
        )
        plain = next(
            (
                e
                for e in swarms
                if e is not swarm
                and e["outer"][:2] == [0.0, 1.0]
                and (e["regime"], e["swarm_lr"]) == (swarm["regime"], swarm["swarm_lr"])
            ),
            None,
        )
        if ideal is None:
            continue
        rows.append(
            [
                swarm["variant"],
                mean_std(swarm),
                f"{ideal['variant']}: {mean_std(ideal)}",
                paired(swarm, ideal),
                fmt(ideal["final_mean"] - ddp["final_mean"], signed=True) if ddp is not None else "—",
                paired(swarm, plain) if plain is not None and swarm["outer"][:2] != [0.0, 1.0] else "—",
            ]
        )
    ideals = [e for e in summaries if e["mode"] == "ideal" and e["outer"][:2] != [0.0, 1.0]]
    for ideal in ideals:
        plain = next(
            (
                e
                for e in summaries
                if e["mode"] == "ideal" and e["outer"][:2] == [0.0, 1.0] and e["period"] == ideal["period"]
            ),
            None,
        )
        if plain is not None:
            rows.append(
                [
                    ideal["variant"],
                    mean_std(ideal),
                    "—",
                    "—",
                    fmt(ideal["final_mean"] - ddp["final_mean"], signed=True) if ddp is not None else "—",
                    paired(ideal, plain),
                ]
            )
    if not rows:
        return []
    header = [
        "variant",
        "final test acc",
        "the ideal at its period (same LR rule, same outer step)",
        "system gap: swarm − ideal (per seed)",
        "algorithm gap: ideal − ddp",
        "outer step: variant − the same without it (per seed)",
    ]
    return ["### Where the gap to ddp goes", "", table(header, rows), ""]


def plot(result: dict, path: Path) -> None:
    plt = pyplot()

    figure, (by_samples, by_steps) = plt.subplots(1, 2, figsize=(13, 5))
    colors = plt.get_cmap("tab20").colors  # a color per variant (the default cycle repeats after 10)
    for index, entry in enumerate(result["summary"]):
        if "curve" not in entry:
            continue
        color = colors[(2 * index) % 20 + (2 * index) // 20 % 2]
        other_regime = entry["unequal"] or entry["regime"] != "loopback"
        style = "--" if entry["mode"] in ("alone", "ddp") else ("-." if other_regime else "-")
        samples = [point["swarm_samples"] for point in entry["curve"]]
        steps = [point["step"] for point in entry["curve"]]
        accuracy = [point["accuracy"] for point in entry["curve"]]
        label = f"{entry['variant']} (n={len(entry['seeds'])})"
        by_samples.plot(samples, accuracy, style, marker=".", label=label, color=color)
        by_steps.plot(steps, accuracy, style, marker=".", label=label, color=color)
    low = min((p["accuracy"] for e in result["summary"] for p in e.get("curve", [])[1:]), default=0.0)
    for axis, xlabel in ((by_samples, "samples the whole swarm processed"), (by_steps, "steps per peer")):
        axis.set_xlabel(xlabel)
        axis.set_ylabel("test accuracy (10k Fashion-MNIST test images)")
        axis.set_ylim(max(0.0, low - 0.02), None)
        axis.grid(alpha=0.3)
    by_steps.legend(fontsize=7, loc="lower right")
    figure.suptitle(
        f"bench_optimizer: S = {result['settings']['samples']}, B = {result['settings']['batch']}; mean over seeds"
    )
    save_figure(figure, path)


HEADLINE = ("alone", "swarm [sqrt]", "ddp", "hivemind_optimizer [sqrt]")  # what a user compares first


def plot_headline(result: dict, path: Path, variants: tuple[str, ...] = HEADLINE) -> None:
    """The README's picture: test accuracy against steps per box of one box, the swarm, DDP and hivemind.Optimizer."""
    plt = pyplot()

    by_name = {entry["variant"]: entry for entry in result["summary"] if "curve" in entry}
    labels = {
        "alone": "one box alone",
        "swarm [sqrt]": "3 boxes: this DecentralizedSGD",
        "ddp": "3 boxes: DDP (a cluster)",
        "hivemind_optimizer [sqrt]": "3 boxes: hivemind.Optimizer(use_local_updates=True)",
    }
    figure, axis = plt.subplots(figsize=(7, 4.5))
    for name in variants:
        entry = by_name.get(name)
        if entry is None:
            continue
        steps, accuracy = [p["step"] for p in entry["curve"]], [p["accuracy"] for p in entry["curve"]]
        label = f"{labels.get(name, name)} (n={len(entry['seeds'])})"
        plot_band(axis, steps, accuracy, [p.get("std") for p in entry["curve"]], marker=".", label=label)
    axis.set_xlabel("steps per box (batch 32 each)")
    axis.set_ylabel("Fashion-MNIST test accuracy")
    axis.set_ylim(0.8, None)
    axis.grid(alpha=0.3)
    axis.legend(fontsize=8, loc="lower right")
    axis.set_title(
        f"Same total samples ({result['settings']['samples']}): plain PyTorch, bench_optimizer.py", fontsize=9
    )
    save_figure(figure, path)


def write_outputs(args: argparse.Namespace, result: dict, final: bool = True) -> None:
    result["summary"] = summarize(result["runs"])
    result["complete"] = final
    write_json(args.json, result)
    text = markdown(result)
    write_text(args.markdown, text)
    if args.plot:
        plot(result, args.plot)
    if args.headline_plot:
        plot_headline(result, args.headline_plot)
    if final:
        print(text)
