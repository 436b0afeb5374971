"""bench_learning's report: mean ± std over seeds, per-seed paired differences, the markdown tables and the plot."""

from __future__ import annotations

from pathlib import Path
from statistics import mean
from typing import Any

from benchmarks.common import markdown_table, paired_difference, plot_band, pyplot, rounded, save_figure, spread
from benchmarks.learning_churn import CHURN_MEANS
from benchmarks.learning_eval import reached
from benchmarks.learning_setup import FLOOR_ROWS, PAIRED, SWARM_MODES

# ----------------------------------------------------------------------------------------------------- reports


def summarize(mode: str, runs: list[dict], alone: dict[int, float]) -> dict:
    """Mean ± std over the seeds that finished; the steps (and samples) at which a seed's curve reaches the same
    seed's alone kNN."""
    done = [run for run in runs if "error" not in run]
    summary: dict[str, Any] = {"mode": mode, "seeds": len(done), "failed": len(runs) - len(done)}
    if not done:
        return summary
    knn, knn_std = spread([run["knn"] for run in done])
    summary.update(knn_mean=rounded(knn), knn_std=rounded(knn_std))
    if mode in FLOOR_ROWS:
        return summary
    reach = [
        (reached(run["curve"], alone[run["seed"]], "steps"), reached(run["curve"], alone[run["seed"]], "samples"))
        for run in done
        if run["seed"] in alone
    ]
    reaching = [pair for pair in reach if pair[0] is not None]
    summary.update(
        heldout_loss_mean=rounded(mean(run["heldout_loss"] for run in done)),
        steps_per_box_mean=round(mean(s for run in done for s in run["steps_per_box"]), 1),
        samples_of_swarm_mean=round(mean(run["samples_of_swarm"] for run in done), 1),
        seeds_reaching_alone=len(reaching),
        seeds_compared_with_alone=len(reach),
        steps_to_alone_mean=rounded(mean(p[0] for p in reaching), 1) if reaching else None,
        samples_to_alone_mean=rounded(mean(p[1] for p in reaching), 1) if reaching else None,
        curve=curve_over_seeds([run["curve"] for run in done]),
    )
    if mode in SWARM_MODES:
        ratios = [run["steps_per_round"] for run in done if run.get("steps_per_round") is not None]
        summary.update(
            steps_per_round_mean=rounded(mean(ratios), 1) if ratios else None,
            rounds_per_box_mean=round(mean(a for run in done for a in run["rounds_applied_per_box"]), 1),
        )
    if churns := [run["churn"] for run in done if "churn" in run]:
        summary["churn_mean"] = {key: rounded(mean(churn[key] for churn in churns)) for key in CHURN_MEANS}
    return summary


def curve_over_seeds(curves: list[list[dict]]) -> list[dict]:
    """Point k of every seed's curve (seeds share the checkpoint schedule), mean ± std."""
    points = []
    for group in zip(*curves, strict=False):
        point = {key: rounded(mean(p[key] for p in group), 1) for key in ("steps", "samples")}
        for key in ("knn", "heldout_loss"):
            value, std = spread([p[key] for p in group])
            point[key], point[f"{key}_std"] = rounded(value), rounded(std)
        points.append(point)
    return points


def markdown(summaries: list[dict]) -> str:
    def cell(value: Any, digits: int = 1) -> str:
        return "—" if value is None else (f"{value:.{digits}f}" if isinstance(value, float) else str(value))

    rows = []
    for summary in summaries:
        row = {
            "mode": summary["mode"],
            "kNN top-1 (mean ± std)": "—",
            "seeds": summary["seeds"],
            "steps per box": "—",
            "samples of the swarm": "—",
            "steps per box to alone's kNN": "—",
            "held-out SwAV loss": "—",
            "local steps per round": "—",
            "rounds per box": "—",
        }
        if summary["failed"]:
            row["seeds"] = f"{summary['seeds']} ({summary['failed']} failed)"
        if summary["seeds"]:
            row["kNN top-1 (mean ± std)"] = f"{summary['knn_mean']:.4f} ± {cell(summary['knn_std'], 4)}"
        if summary["seeds"] and summary["mode"] not in FLOOR_ROWS:
            reaching, compared = summary["seeds_reaching_alone"], summary["seeds_compared_with_alone"]
            to_alone = (
                "—"
                if not compared
                else (
                    "not reached"
                    if not reaching
                    else f"{summary['steps_to_alone_mean']:g}"
                    + (f" ({reaching}/{compared} seeds)" if reaching < compared else "")
                )
            )
            row.update(
                {
                    "steps per box": f"{summary['steps_per_box_mean']:g}",
                    "samples of the swarm": f"{summary['samples_of_swarm_mean']:g}",
                    "steps per box to alone's kNN": to_alone,
                    "held-out SwAV loss": cell(summary["heldout_loss_mean"], 4),
                    "local steps per round": cell(summary.get("steps_per_round_mean")),
                    "rounds per box": cell(summary.get("rounds_per_box_mean")),
                }
            )
        rows.append(row)
    return markdown_table(rows)


def plot(summaries: list[dict], path: Path, title: str) -> None:
    """kNN and held-out loss (rows) against samples of the swarm and steps per box (columns), mean ± std over seeds;
    the floors as horizontal lines."""
    figure, axes = pyplot().subplots(2, 2, figsize=(12, 8))
    for summary in summaries:
        if not summary["seeds"]:
            continue
        if summary["mode"] in FLOOR_ROWS:
            for axis in axes[0]:
                axis.axhline(
                    summary["knn_mean"], color="gray", linestyle=FLOOR_ROWS[summary["mode"]], label=summary["mode"]
                )
            continue
        curve = summary["curve"]
        for row, key in enumerate(("knn", "heldout_loss")):
            for column, axis_key in enumerate(("samples", "steps")):
                axis = axes[row][column]
                xs, ys = [point[axis_key] for point in curve], [point[key] for point in curve]
                stds = [point[f"{key}_std"] for point in curve]
                plot_band(axis, xs, ys, stds, marker="o", markersize=3, label=summary["mode"])
    for row, label in enumerate(("kNN top-1 on val", "held-out SwAV loss")):
        for column, xlabel in enumerate(("samples the swarm processed", "steps per box")):
            axis = axes[row][column]
            axis.set_xlabel(xlabel)
            axis.set_ylabel(label)
            axis.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    figure.suptitle(title)
    save_figure(figure, path)


def paired_differences(runs: list[dict]) -> list[dict]:
    """``variant − reference`` seed by seed (the same initial model), for each pair of ``PAIRED`` that ran: final kNN
    and held-out loss, each seed's difference and their mean ± std over the seeds where both finished."""
    done = {(run["mode"], run["seed"]): run for run in runs if "error" not in run}
    differences = []
    for variant, reference in PAIRED:
        entry: dict[str, Any] = {"variant": variant, "reference": reference}
        for key in ("knn", "heldout_loss"):
            arm = {
                mode: {seed: run[key] for (m, seed), run in done.items() if m == mode} for mode in (variant, reference)
            }
            entry[key] = paired_difference(arm[variant], arm[reference])
        if entry["knn"] is not None:
            entry["seeds"] = entry["knn"]["seeds"]
            differences.append(entry)
    return differences


def differences_markdown(differences: list[dict]) -> str:
    def signed(stats: dict) -> str:
        std = f" ± {stats['std']:.4f}" if stats["std"] is not None else ""
        return f"{stats['mean']:+.4f}{std} (per seed {', '.join(f'{d:+.4f}' for d in stats['per_seed'])})"

    return "\n".join(
        f"- {e['variant']} − {e['reference']}, seed by seed (n={len(e['seeds'])}, mean ± std): kNN "
        f"{signed(e['knn'])}; held-out SwAV loss {signed(e['heldout_loss'])}"
        for e in differences
    )


def churn_row(seed: int, churn: dict) -> dict:
    """A swarm_churn seed in the report: where the box left and came back, and what it lost."""
    return {
        "seed": seed,
        "box killed at step (planned)": f"{churn['killed_at_step']} ({churn['kill_step_planned']})",
        "resumed checkpoint's step": churn["resumed_step"],
        "lost steps of the box (samples)": f"{churn['lost_steps']} ({churn['lost_samples_of_box']})",
        "steps in no round (samples)": f"{churn['steps_not_in_a_round']} ({churn['lost_samples_of_swarm']})",
        "swarm samples at kill / restart / rejoin (planned rejoin)": (
            f"{churn['swarm_samples_at_kill']} / {churn['swarm_samples_at_restart']} / "
            f"{churn['swarm_samples_at_rejoin']} ({churn['back_at_samples_planned']})"
        ),
        "away, share of the budget": churn["away_share_of_budget"],
        "restart s (first start s)": f"{churn['restart_s']} ({churn['first_startup_s']})",
        "box steps after rejoin": churn["steps_after_rejoin"],
        "box share of the swarm's steps": churn["share_of_steps"],
    }


def report_markdown(summaries: list[dict], differences: list[dict], runs: list[dict]) -> str:
    """The table of modes, then the paired differences and the churn's rows where there are any."""
    parts = [markdown(summaries)]
    if differences:
        parts.append(differences_markdown(differences))
    churns = [run for run in runs if "churn" in run]
    if churns:
        box = churns[0]["churn"]["box"]
        headline = f"swarm_churn, per seed: box {box} crashed at a third of its steps and came back (README's restart)"
        parts.append(headline)
        parts.append(markdown_table([churn_row(run["seed"], run["churn"]) for run in churns]))
    return "\n\n".join(parts)
