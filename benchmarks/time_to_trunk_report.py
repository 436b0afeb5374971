"""bench_time_to_trunk's report: each arm's accuracy against training seconds, the time it takes to reach one box's
final accuracy, its accuracy at a half and a third of one box's time, the emulation's check (the step and AllReduce
times the runs produced against those aimed for), the markdown and the plot against GPU hours."""

from __future__ import annotations

import argparse
from pathlib import Path
from statistics import mean, median
from typing import Any

from benchmarks import common
from benchmarks.common import crossing, mean_std, spread, value_at

ORDER = ("alone", "swarm", "hivemind_optimizer", "ddp", "ideal")
COMPOSED = {  # an arm whose time comes from a few paced steps and whose accuracy from its <arm>_curve run
    "alone": "paced steps, the per-sample curve unpaced",
    "ddp": "steps on the link, the per-sample curve unshaped",
    "hivemind_optimizer": "steps of its first box on the link, over the boxes' mean steps by then; the per-sample "
    "curve unshaped and unpaced",
}
COLORS = {"alone": "k", "swarm": "tab:blue", "hivemind_optimizer": "tab:orange", "ddp": "tab:red", "ideal": "0.6"}


def mean_curve(peers: list[dict], pace_s: float) -> list[tuple[float, float]]:
    """(training seconds, accuracy) at each checkpoint, averaged over the peers that evaluated; a curve without
    times (the ideal: no link, no pace) is placed at its steps times the pace."""
    curves = [peer["curve"] for peer in peers if peer.get("curve")]
    points = []
    for index in range(min(len(curve) for curve in curves)):
        at = [curve[index] for curve in curves]
        seconds = mean(point.get("train_s", point["step"] * pace_s) for point in at)
        points.append((seconds, mean(point["accuracy"] for point in at)))
    return points


def step_seconds(run: dict) -> float | None:
    """A run's measured training seconds per step: its first box's last checkpoint, over the boxes' mean steps by then
    where the run ended with that box (``steps_reached``)."""
    last, reached = run["peers"][0]["curve"][-1], run.get("steps_reached")
    steps = mean(reached.values()) if reached else last.get("step")
    return last["train_s"] / steps if steps and "train_s" in last else None


def arm_curves(runs: list[dict], pace_s: float) -> dict[str, dict]:
    """A seed's arms: curve (seconds, accuracy), how it was made, and its measured timings."""
    ok = {run["arm"]: run for run in runs if run["error"] is None}
    for run in runs:  # missed its deadline: the boxes that finished, said so
        finished = (run.get("unfinished") or {}).get("finished")
        if run["error"] and finished and run["arm"] not in ok and run["arm"] not in ("ddp", "ddp_curve"):
            reached = run["unfinished"]["steps_reached"]
            how = (
                f"{len(finished)} of {len(reached)} boxes finished by the deadline; the last steps reported: {reached}"
            )
            ok[run["arm"]] = {**run, "peers": finished, "how": how}
    arms: dict[str, dict] = {}
    timing = {arm for arm in COMPOSED if arm in ok and ok[arm]["settings"]["curve_points"] == 1}  # jobs_for's
    for arm, run in ok.items():
        if arm in timing or arm.endswith("_curve"):
            continue
        peers = run["peers"]
        arms[arm] = {
            "curve": mean_curve(peers, pace_s),
            "how": run.get("how")
            or ("measured" if arm != "ideal" else f"ideal at H={run['spec']['period']}, link free"),
            "step_s": step_seconds(run) if arm != "ideal" else pace_s,
            "allreduce_s": median([p["allreduce_s_median"] for p in peers if p.get("allreduce_s_median")] or [0])
            or None,
            "group_size": mean([p["group_size_mean"] for p in peers if p.get("group_size_mean")] or [0]) or None,
            "steps_per_round": mean([p["steps_per_round"] for p in peers if p.get("steps_per_round")] or [0]) or None,
            "rounds_applied": mean([p.get("rounds_applied", 0) or 0 for p in peers]),
        }
    for arm in timing:
        if f"{arm}_curve" in ok:
            step_s = step_seconds(ok[arm])
            arms[arm] = {
                "curve": [
                    (point["step"] * step_s, point["accuracy"]) for point in ok[f"{arm}_curve"]["peers"][0]["curve"]
                ],
                "how": f"composed: {ok[arm]['peers'][0]['steps']} {COMPOSED[arm]}",
                "step_s": step_s,
                "allreduce_s": step_s if arm == "ddp" else None,
            }
    return arms


def seed_metrics(arms: dict[str, dict]) -> dict[str, dict]:
    """Time to one box's final accuracy, accuracy at a half and a third of one box's time, speed-up over one box."""
    if "alone" not in arms:
        return {}
    alone = arms["alone"]["curve"]
    target, alone_s = alone[-1][1], alone[-1][0]
    alone_to_target = crossing(alone, target)
    half_target = value_at(alone, alone_s / 2)  # a lower bar every arm may clear: one box's half-run accuracy
    alone_to_half = crossing(alone, half_target)
    metrics = {}
    for arm, entry in arms.items():
        curve = entry["curve"]
        reached = crossing(curve, target)
        metrics[arm] = {
            "target": target,
            "time_to_target_s": reached,
            "time_to_target_share": reached / alone_to_target if reached is not None else None,
            "speedup": alone_to_target / reached if reached else None,
            "accuracy_at_half": value_at(curve, alone_s / 2),
            "half_target": half_target,
            "time_to_half_target_share": None
            if crossing(curve, half_target) is None
            else crossing(curve, half_target) / alone_to_half,
            "accuracy_at_third": value_at(curve, alone_s / 3),
            "final_accuracy": curve[-1][1],
            "final_s": curve[-1][0],
            "final_share": curve[-1][0] / alone_s,
        }
    return metrics


def summarize(result: dict) -> list[dict]:
    """Per link: the arms' metrics over seeds, their mean curves and the emulation's check."""
    links = []
    for emulation in result["emulations"]:
        link, pace = emulation["link_mbit"], emulation["pace_s"]
        runs = [run for run in result["runs"] if run["link_mbit"] == link]
        seeds = sorted({run["seed"] for run in runs})
        per_seed = {seed: arm_curves([r for r in runs if r["seed"] == seed], pace) for seed in seeds}
        metrics = {seed: seed_metrics(arms) for seed, arms in per_seed.items()}
        arms = {}
        names = {arm for seed in seeds for arm in per_seed[seed]}
        for arm in [*[a for a in ORDER if a in names], *sorted(names - set(ORDER))]:
            entries = [metrics[s][arm] for s in seeds if arm in metrics[s]]
            if not entries:
                continue
            summary: dict[str, Any] = {"seeds": len(entries), "how": per_seed[seeds[0]].get(arm, {}).get("how")}
            for key in entries[0]:
                summary[key] = [common.rounded(e[key]) for e in entries]
            summary["reached"] = sum(e["time_to_target_s"] is not None for e in entries)
            summary["curve"] = (
                per_seed[seeds[0]][arm]["curve"]
                if len(entries) == 1
                else average_curves([per_seed[s][arm]["curve"] for s in seeds if arm in per_seed[s]])
            )
            for key in ("step_s", "allreduce_s", "group_size", "steps_per_round", "rounds_applied"):
                values = [per_seed[s][arm].get(key) for s in seeds if per_seed[s].get(arm, {}).get(key) is not None]
                summary[key] = common.rounded(mean(values), 4) if values else None
            arms[arm] = summary
        unfinished = [  # no box finished: no curve, how far it got
            f"{run['arm']} seed {run['seed']}: no box finished in {run['wall_s']:.0f} s; the last steps reported: "
            f"{run['unfinished']['steps_reached']} of {run['settings']['samples'] // 3 // run['settings']['batch']}"
            for run in runs
            if run["error"] and not (run.get("unfinished") or {}).get("finished")
        ]
        links.append({"link_mbit": link, "emulation": emulation, "arms": arms, "check": check(emulation, arms)})
        links[-1]["unfinished"] = unfinished
    return links


def average_curves(curves: list[list[tuple[float, float]]]) -> list[tuple[float, float]]:
    length = min(len(curve) for curve in curves)
    return [(mean(c[i][0] for c in curves), mean(c[i][1] for c in curves)) for i in range(length)]


def check(emulation: dict, arms: dict) -> list[dict]:
    """Did the emulation hold? The times the runs produced against the ones aimed for, in emulated seconds."""
    pace = emulation["pace_s"]
    values, mbit = emulation["values_emulated"], emulation["emulated_mbit"]

    def exchange(group: float, bytes_per_value: float = 2.0) -> float:  # in full frames, as the bench's aim
        return values * bytes_per_value * 2 * (group - 1) / group * 1514 / 1448 * 8 / (mbit * 1e6)

    rows = []
    for arm in ("alone", "swarm"):
        if arm in arms and arms[arm]["step_s"]:
            rows.append({"what": f"{arm}: s per step", "aimed": pace, "measured": arms[arm]["step_s"]})
    swarm = arms.get("swarm", {})
    if swarm.get("allreduce_s") and swarm.get("group_size"):
        aimed = exchange(swarm["group_size"])
        rows.append({"what": "swarm: AllReduce s (median)", "aimed": aimed, "measured": swarm["allreduce_s"]})
        rows.append(
            {
                "what": "swarm: AllReduce / step",
                "aimed": aimed / pace,
                "measured": swarm["allreduce_s"] / swarm["step_s"],
            }
        )
    if arms.get("hivemind_optimizer", {}).get("step_s"):  # its rounds block its steps: no aim for those
        what, measured = "hivemind_optimizer: s per step, its blocking rounds included", arms["hivemind_optimizer"]
        rows.append({"what": what, "aimed": pace, "measured": measured["step_s"]})
    if "ddp" in arms and arms["ddp"]["step_s"]:
        aimed = max(pace, exchange(3, 2.0 if emulation.get("ddp_fp16", True) else 4.0))
        rows.append({"what": "ddp: s per step (AllReduce-bound)", "aimed": aimed, "measured": arms["ddp"]["step_s"]})
    return [{**row, "aimed": round(row["aimed"], 4), "measured": round(row["measured"], 4)} for row in rows]


def hours(seconds: float | None, emulation: dict) -> float | None:
    return None if seconds is None else seconds / emulation["time_scale"] / 3600


def markdown(result: dict, links: list[dict]) -> str:
    git = result.get("git", {})
    commit = (git.get("commit") or "?")[:10] + ("+changes" if git.get("dirty") else "")
    commands = "; then ".join(f"`{' '.join(command)}`" for command in result.get("commands", [result["command"]]))
    lines = [
        "# Time to a trunk: 3 boxes on a shaped link against one box",
        "",
        f"Commit {commit}; commands {commands}; budget {result['samples']:,} samples "
        f"(one box's, and the swarm's total); seeds {result['seeds']}. Machine: 2 cores shared with other work "
        f"(load before {result.get('machine_before', {}).get('loadavg')}, after "
        f"{result.get('machine_after', {}).get('loadavg')}): the pace (a sleep floor per step) is what keeps the "
        "emulation honest under that load; the check below says how far it held.",
        "",
        "Emulated: each box's link (htb, ACKs first) at a rate that makes an exchange of the small CNN last as many "
        "paced steps as one of swav_resnet50 lasts GPU steps; a GPU step as a paced step. Not emulated: latency, "
        "fixed per-round costs (DHT, matchmaking RPCs: this machine's real seconds), data loading. GPU step: "
        "SwAV batch 64, 2x224+6x96 crops, at 2470 images/s (ResNet-50 v1.5, one A100 80GB, AMP: NVIDIA "
        "DeepLearningExamples' ResNet-50 v1.5 PyTorch README).",
        *(f"\n{note}" for note in result.get("notes", [])),  # written into the JSON by hand: link checks, history
    ]
    for entry in links:
        e = entry["emulation"]
        lines += [
            "",
            f"## {e['link_mbit']:g} Mbit/s, GPU step {e['gpu_step_s']} s",
            "",
            f"Aimed ratio (AllReduce of the model among 3 boxes, fp16 / one step): {e['aimed_ratio']:.1f}. "
            f"Emulated: step {e['pace_s']} s, link {e['emulated_mbit']:.3f} Mbit/s each way "
            f"({e['values_emulated']:,} values against {e['values_real']:,}); one emulated second = "
            f"{1 / e['time_scale']:.3f} GPU seconds. Swarm flags (pre-flight's advice, seconds scaled): "
            "`"
            + " ".join(f"--{k} {round(v, 2) if isinstance(v, float) else v}" for k, v in e["swarm_flags"].items())
            + "` (DecentralizedSGD's allreduce_timeout is run_trainer's --averaging_timeout).",
            "",
        ]
        rows = []
        for arm, s in entry["arms"].items():
            ttt, tt_sd = spread(s["time_to_target_s"])
            share, share_sd = spread(s["time_to_target_share"])
            rows.append(
                {
                    "arm": arm,
                    "seeds (reached)": f"{s['seeds']} ({s['reached']})",
                    "time to one box's final (GPU h)": mean_std(hours(ttt, e), hours(tt_sd, e), 3),
                    "of one box's time": mean_std(share, share_sd, 2),
                    "speed-up": mean_std(*spread(s["speedup"]), 2),
                    "acc. at 1/2 of one box's time": mean_std(*spread(s["accuracy_at_half"])),
                    "time to one box's half-run acc. (x one box's)": mean_std(
                        *spread(s["time_to_half_target_share"]), 2
                    ),
                    "acc. at 1/3": mean_std(*spread(s["accuracy_at_third"])),
                    "final acc.": mean_std(*spread(s["final_accuracy"])),
                    "ends at (x one box's time)": mean_std(*spread(s["final_share"]), 2),
                    "how": s["how"],
                }
            )
        lines += [common.markdown_table(rows), "", "Did the emulation hold (emulated seconds):", ""]
        lines += [common.markdown_table(entry["check"])]
        details = [
            f"{arm}: steps/round {common.fmt(s['steps_per_round'], 0)}, group {common.fmt(s['group_size'], 2)}, "
            f"rounds applied/peer {common.fmt(s['rounds_applied'], 1)}"
            for arm, s in entry["arms"].items()
            if s.get("rounds_applied")
        ]
        lines += ["", *(f"- {line}" for line in details + entry["unfinished"])]
    return "\n".join(lines)


def plot(links: list[dict], path: Path) -> None:
    plt = common.pyplot()
    figure, axes = plt.subplots(1, len(links), figsize=(6 * len(links), 4.2), squeeze=False)
    for axis, entry in zip(axes[0], links, strict=True):
        e = entry["emulation"]
        for arm, s in entry["arms"].items():
            xs = [hours(t, e) for t, _ in s["curve"]]
            share = spread(s["time_to_target_share"])[0]
            reached = "one box's final not reached" if share is None else f"one box's final in {share:.2f}x its time"
            label = f"{arm}: {reached}" + (" (composed)" if s["how"].startswith("composed") else "")
            base, longer = arm.split(" x")[0], " x" in arm
            axis.plot(
                xs, [a for _, a in s["curve"]], "--" if longer else "-", marker=".", color=COLORS[base], label=label
            )
        if "alone" in entry["arms"]:
            target = entry["arms"]["alone"]["curve"][-1][1]
            axis.axhline(target, color="k", lw=0.5, ls=":")
            axis.set_ylim(target - 0.1, target + 0.01)  # where the arms race; their first minutes lie below
        ends = [hours(s["curve"][-1][0], e) for s in entry["arms"].values()]
        axis.set_xscale("log")  # the arms end two orders of magnitude apart
        axis.set_xlim(min(ends) / 10, 1.2 * max(ends))
        axis.set_title(f"{e['link_mbit']:g} Mbit/s, GPU step {e['gpu_step_s']} s")
        axis.set_xlabel("wall-clock hours at the GPU's step time")
        axis.set_ylabel("test accuracy")
        axis.legend(fontsize=7, loc="lower right")
        axis.grid(alpha=0.3)
    common.save_figure(figure, path)


def merge(results: list[dict]) -> dict:
    """Results of the same budget on other links or arms (run side by side) in one report, each command kept."""
    emulations: dict[float, dict] = {}
    for result in results:
        for emulation in result["emulations"]:
            if emulations.setdefault(emulation["link_mbit"], emulation) != emulation:
                raise SystemExit(f"{emulation['link_mbit']:g} Mbit/s was measured with two emulations: rerun one")
    if len({result["samples"] for result in results}) > 1:
        raise SystemExit("these results have different budgets (--samples): report them apart")
    runs = [run for result in results for run in result["runs"]]
    commands = [command for result in results for command in result.get("commands", [result["command"]])]
    return {
        **results[0],
        "emulations": sorted(emulations.values(), key=lambda emulation: emulation["link_mbit"]),
        "runs": [run for i, run in enumerate(runs) if run not in runs[:i]],  # each once: --append copies them
        "commands": [command for i, command in enumerate(commands) if command not in commands[:i]],
        "seeds": max(result["seeds"] for result in results),
        "machine_after": results[-1].get("machine_after"),
        "notes": [note for result in results for note in result.get("notes", [])],
    }


def write_outputs(args: argparse.Namespace, result: dict) -> None:
    links = summarize(result)
    result["summary"] = [{k: v for k, v in entry.items() if k != "emulation"} for entry in links]
    common.write_json(args.json, result)
    common.write_text(args.markdown, markdown(result, links))
    if args.plot is not None and any(entry["arms"] for entry in links):
        plot(links, args.plot)
