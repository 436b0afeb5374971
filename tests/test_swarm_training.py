"""Real VISSL SwAV peers (run_trainer.py processes) averaging over hivemind on 127.0.0.1."""

from __future__ import annotations

import itertools
import math
import re
import time
from pathlib import Path

import pytest
import torch

from run_eval import resolve_checkpoint
from tests.conftest import run_trainer
from tests.paced_trainer import paced_peer
from tests.test_recipe import build_task_model
from vissl_swarm.address_book import KNOWN_PEERS_FILE, AddressBook
from vissl_swarm.initial_model import weights_fingerprint
from vissl_swarm.local_replicas import compare_replica_logs
from vissl_swarm.local_swarm import LocalPeer, fixed_address, read_jsonl, start_swarm, stop_all, wait_until
from vissl_swarm.swarm_progress import SwarmProgress

# 10 batches of 16 real images per epoch, plenty of epochs (for the whole swarm: the swarm-wide schedule): the test
# decides when peers stop
SWARM_OVERRIDES = [
    "config.DATA.TRAIN.DATA_LIMIT=160",
    "config.OPTIMIZER.num_epochs=3000",
    "config.CHECKPOINT.CHECKPOINT_ITER_FREQUENCY=10",
    "config.LOG_FREQUENCY=5",
]
SWARM_SECRET = "swarmtest-secret"  # the peers average with a swarm secret (it reaches spawned workers too)
SWARM_FLAGS = [
    "--run_id",
    "swarmtest",
    "--target_group_size",
    "3",
    "--min_matchmaking_time",
    "2",
    "--averaging_timeout",
    "20",
    "--next_chunk_timeout",
    "4",
    "--compression",
    "none",
    "--swarm_secret",
    SWARM_SECRET,
]
# --join_timeout, how long a joiner keeps dialing its --initial_peers: while the first box runs, as long as a first box
# that shares two loaded cores with the others may take to answer (seen: over 15 s, beside a swarm of 16 in the
# suite); it answers within seconds otherwise, so the test only waits that long where it would fail. In the whole
# swarm's restart the first box is down, and every joiner waits all of it before it dials the peers it met: half the
# default, still five pings of the first box.
JOIN_A_RUNNING_BOX = ["--join_timeout", "90"]
JOIN_A_STOPPED_BOX = ["--join_timeout", "15"]


def float_tensors(model_state: dict) -> dict[str, torch.Tensor]:
    """VISSL's classy state of a model: {"trunk": {...}, "heads": {...}}."""
    return {
        f"{part}.{name}": tensor
        for part in ("trunk", "heads")
        for name, tensor in model_state[part].items()
        if tensor.is_floating_point()
    }


def latest_weights(peer: LocalPeer) -> dict[str, torch.Tensor]:
    state = torch.load(resolve_checkpoint(peer.checkpoint_dir), map_location="cpu")
    return float_tensors(state["classy_state_dict"]["base_model"]["model"])


def distance(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return math.sqrt(sum(float((a[name].double() - b[name].double()).pow(2).sum()) for name in a))


def resumed_checkpoint(log: str) -> tuple[int, int]:
    """The checkpoint VISSL says it resumed in ``log`` ("Resume from file: ..."; its pick, which may not be the file
    checkpoint.torch links to: the phase's checkpoint written right after the step's): its iteration and the
    swarm's samples it vouches for."""
    state = torch.load(re.findall(r"Resume from file: (\S+)", log)[-1], map_location="cpu")
    counts = state["classy_state_dict"].get("swarm_progress") or {}
    return int(state["iteration"]), SwarmProgress.total_of(counts, counts.get("run", ""))


def swarm_position_at(entries: list[dict], when: float) -> float | None:
    """The swarm's samples as a box logged them (``entries``, its progress lines) at ``when``: linear between its two
    lines around it, at most 20 s apart; None where it logged nothing around that time."""
    points = [(entry["time"], entry["swarm_samples"]) for entry in entries]
    for (t0, p0), (t1, p1) in itertools.pairwise(points):
        if t0 <= when <= t1 and t1 - t0 <= 20:
            return p0 + (p1 - p0) * (when - t0) / max(t1 - t0, 1e-9)
    return None


def off_schedule(peers: list[LocalPeer], starts: dict[str, list[float]], share: float, slack: int) -> list[str]:
    """Log lines at which a box's swarm position differs from another box's at that moment by more than ``share``
    of it plus ``slack`` samples (what the swarm trains while a count travels: a few seconds); ``starts[name]``:
    when a box was started. Its first line after each start is left out, as a line to check and as a point of
    another box's position (it may still lag by a logging period: the box's own samples only, the swarm's count
    not in yet)."""
    settled = {}
    for peer in peers:
        entries = peer.progress()
        first_lines = {next((e["time"] for e in entries if e["time"] > start), None) for start in starts[peer.name]}
        settled[peer.name] = [e for e in entries if e["time"] > starts[peer.name][0] and e["time"] not in first_lines]
    found = []
    for peer in peers:
        for entry in settled[peer.name]:
            for other in peers:
                theirs = swarm_position_at(settled[other.name], entry["time"]) if other is not peer else None
                if theirs is not None and abs(entry["swarm_samples"] - theirs) > share * theirs + slack:
                    found.append(
                        f"{peer.name} at step {entry['step']}: {entry['swarm_samples']} samples, "
                        f"{other.name}: {theirs:.0f}"
                    )
    return found


def logged_fingerprint(peer: LocalPeer) -> str:
    """The trunk fingerprint of the initial model the peer built (decentralized_task.py logs it)."""
    match = re.search(r"trunk fingerprint (\w+)", peer.log_text())
    return match.group(1) if match else ""


@pytest.mark.long
@pytest.mark.xdist_group("swarm_scenarios")
@pytest.mark.timeout(1500)
def test_three_peers_average_survive_the_first_box_restarting_take_in_a_late_joiner_and_the_whole_swarm_restarting(
    digits_dir: Path, tmp_path: Path
) -> None:
    peers = [paced_peer(f"peer{index}", tmp_path) for index in range(3)]
    double_batch = ["config.DATA.TRAIN.BATCHSIZE_PER_REPLICA=32"]  # peer1: twice the others' batch (GPUs)
    # every box as the README starts it: an identity file and a fixed port (the same address across restarts); the
    # first box without --initial_peers, the others joining through it. commands: each box's (initial peers, flags,
    # overrides), what it is started again with
    identities = {peer.name: fixed_address(peer) for peer in peers}
    addresses = identities["peer0"][1]
    commands = {
        peer.name: (
            [] if index == 0 else addresses,
            [*SWARM_FLAGS, *JOIN_A_RUNNING_BOX, *identities[peer.name][0]],
            [*SWARM_OVERRIDES, f"config.SEED_VALUE={index}", *(double_batch if index == 1 else [])],
        )
        for index, peer in enumerate(peers)
    }
    try:
        # each peer its own seed (data order) and, at this first start only, no download of the first peer's
        # weights: each builds the run's initial model
        start_swarm(
            peers,
            digits_dir,
            [*SWARM_FLAGS, *JOIN_A_RUNNING_BOX, "--load_state_timeout", "0"],
            SWARM_OVERRIDES,
            per_peer_overrides=lambda peer: commands[peer.name][2][len(SWARM_OVERRIDES) :],
            per_peer_flags=lambda peer: identities[peer.name][0],
        )
        fingerprints = [
            wait_until(lambda peer=peer: logged_fingerprint(peer), 120, f"{peer.name}'s initial model")
            for peer in peers
        ]
        assert len(set(fingerprints)) == 1, f"the peers of one run built different initial models: {fingerprints}"

        # 1. every peer applies rounds in groups of at least 2
        for peer in peers:
            wait_until(
                lambda peer=peer: len([r for r in peer.applied_rounds() if r["group_size"] >= 2]) >= 2,
                300,
                f"two averaging rounds on {peer.name}",
            )

        # 2. the first box (the others' only --initial_peers) is killed mid-training, once it has a checkpoint to
        #    resume and has noted the others in its address book; the other two keep averaging with each other
        wait_until(
            lambda: (
                (peers[0].checkpoint_dir / "checkpoint.torch").is_file()
                and len(AddressBook(peers[0].checkpoint_dir / KNOWN_PEERS_FILE)) >= 2
            ),
            120,
            "peer0's first checkpoint and the others in its address book",
        )
        peers[0].kill()
        killed_at = time.time()
        for peer in peers[1:]:
            wait_until(
                lambda peer=peer: any(r["group_size"] == 2 for r in peer.applied_rounds(since=killed_at)),
                180,
                f"a round of the two survivors on {peer.name}",
            )

        # 3. the first box restarts with its README command: it dials the peers it met (nobody dials it: it has no
        #    --initial_peers, and the others have each other), VISSL resumes its checkpoint, which is behind the
        #    swarm by now, so it takes over the swarm's weights and counts, then averages again
        swarm_samples = max(peer.progress()[-1]["swarm_samples"] for peer in peers[1:])
        peers[0].start(digits_dir, *commands["peer0"])
        restarted_at = peers[0].started_at
        wait_until(
            lambda: "Resume from file" in peers[0].log_text() and "is behind the swarm" in peers[0].log_text(),
            180,
            "peer0 resuming from its checkpoint, then catching up with the swarm",
        )
        assert "peers this box met before" in peers[0].log_text()  # it dialed its address book (then the rounds)
        wait_until(
            lambda: (
                any(r["group_size"] >= 2 for r in peers[0].applied_rounds(since=restarted_at))
                and any(e["time"] > restarted_at for e in peers[0].progress())
            ),  # and a logged step (every 5th)
            180,
            "peer0 averaging with the others after its restart",
        )
        first_after_restart = next(e for e in peers[0].progress() if e["time"] > restarted_at)
        assert first_after_restart["swarm_samples"] >= swarm_samples, (first_after_restart, swarm_samples)
        assert first_after_restart["step"] < first_after_restart["swarm_samples"] // 16  # its own steps: fewer

        # 4. a late joiner without a checkpoint (the join line's command: a fixed port and an identity file) takes
        #    over the swarm's weights and its position in the schedule
        swarm_samples = max(peer.progress()[-1]["swarm_samples"] for peer in peers)
        late = paced_peer("late", tmp_path)
        peers.append(late)
        commands["late"] = (addresses, [*SWARM_FLAGS, *JOIN_A_RUNNING_BOX, *fixed_address(late)[0]], SWARM_OVERRIDES)
        late.start(digits_dir, *commands["late"])
        late.join_addresses()  # it keeps pinging the first box until it answers (start_dht): one start
        wait_until(lambda: late.progress(), 180, "the late joiner's first logged step")
        assert "Joined the swarm at its position" in late.log_text()
        assert late.progress()[0]["swarm_samples"] >= swarm_samples  # the swarm's schedule, not from warm-up
        wait_until(lambda: late.applied_rounds(), 180, "the late joiner averaging")
        joined_at = late.started_at

        # 5. the whole swarm is stopped with Ctrl-C (README: stopping and restarting the whole swarm), once every box
        #    has a checkpoint and knows the three others; each finishes its step and exits 0
        wait_until(
            lambda: all(
                (peer.checkpoint_dir / "checkpoint.torch").is_file()
                and len(AddressBook(peer.checkpoint_dir / KNOWN_PEERS_FILE)) >= 3
                for peer in peers
            ),
            240,
            "a checkpoint of every box, and the three others in its address book",
        )
        stop_all(peers, timeout=180)
        assert all(peer.process.returncode == 0 for peer in peers), [peer.exit_message() for peer in peers]
        stopped_at = time.time()
        last_steps = {peer.name: peer.progress()[-1]["step"] for peer in peers}  # logged every 5th step

        # 6. all started again with the same commands, the last joined first and the first box last: each of the
        #    three joiners finds its --initial_peers (the first box) down, starts anyway after --join_timeout (it
        #    met peers before) and dials those; the first box dials the peers it met
        log_sizes = {peer.name: len(peer.log_text()) for peer in peers}

        def this_life(peer: LocalPeer) -> str:
            return peer.log_text()[log_sizes[peer.name] :]

        back_order = [late, peers[2], peers[1], peers[0]]
        for peer in back_order[:-1]:
            initial_peers, flags, overrides = commands[peer.name]
            peer.start(digits_dir, initial_peers, [*flags, *JOIN_A_STOPPED_BOX], overrides)  # the last flag counts
            time.sleep(3)  # one after the other, as boxes restarted by hand
        wait_until(
            lambda: all("starting without --initial_peers" in this_life(peer) for peer in back_order[:-1]),
            180,
            "the three joiners starting without their --initial_peers",
        )
        peers[0].start(digits_dir, *commands["peer0"])
        swarm_started_at = {peer.name: peer.started_at for peer in peers}
        for peer in back_order:  # VISSL resumes each box's own checkpoint (its steps go on from there), then rounds
            wait_until(
                lambda peer=peer: (
                    "Resume from file" in this_life(peer)
                    and any(r["group_size"] >= 2 for r in peer.applied_rounds(since=swarm_started_at[peer.name]))
                    and any(e["time"] > swarm_started_at[peer.name] for e in peer.progress())
                ),
                300,
                f"{peer.name} resuming its checkpoint and averaging after the whole swarm's restart",
            )
        assert "peers this box met before" in this_life(peers[0])  # the first box dialed its address book
    finally:
        stop_all(peers, timeout=180)
    assert all(peer.process.returncode == 0 for peer in peers), [peer.exit_message() for peer in peers]

    # after the whole swarm's restart each box went on from its own checkpoint, of its last steps before the stop
    # (one every 10th step and at each epoch's end), not from step 0, and from the swarm's count it held; once back
    # together, the swarm's count is at least the largest any checkpoint held
    resumes = {peer.name: resumed_checkpoint(this_life(peer)) for peer in peers}
    for peer in peers:
        after = [e for e in peer.progress() if e["time"] > swarm_started_at[peer.name]]
        iteration, samples = resumes[peer.name]
        assert iteration > 0 and last_steps[peer.name] - 10 <= iteration <= last_steps[peer.name] + 10, peer.name
        assert after[0]["step"] > iteration, (peer.name, iteration, after[0])
        assert after[0]["step"] <= iteration + 40, (peer.name, iteration, after[0])  # no restart from 0
        assert after[0]["swarm_samples"] >= samples, (peer.name, samples, after[0])
        assert after[-1]["swarm_samples"] >= max(held for _, held in resumes.values()), (peer.name, after[-1])
        assert any(r["group_size"] >= 2 for r in peer.applied_rounds(since=swarm_started_at[peer.name])), peer.name

    # every box, the one at twice the batch, the restarted one and the late joiner, is on the swarm's schedule: from
    # its second log line after each start (one logging period), its position is the others' at the same moment,
    # and its LR schedule's position is that share of the run (the budgets are equal: 3000 epochs of 160 images)
    starts = {
        name: [start, swarm_started_at[name]]
        for name, start in (("peer0", restarted_at), ("peer1", 0), ("peer2", 0), ("late", joined_at))
    }
    wrong = off_schedule(peers, starts, share=0.2, slack=2000)
    assert not wrong, wrong[:10]
    for peer in peers:
        assert all(abs(e["where"] - e["swarm_samples"] / 480_000) < 1e-5 for e in peer.progress()), peer.name
    # the box at twice the batch counts twice the samples per step (its first life: no checkpoint resumed)
    first_life = [e for e in peers[1].progress() if e["time"] < stopped_at]
    assert all(e["own_samples"] == 32 * e["step"] for e in first_life), first_life[:3]

    for peer in peers:
        losses = [entry["loss"] for entry in peer.progress()]
        assert losses and all(math.isfinite(loss) for loss in losses), peer.name
        assert SWARM_SECRET not in peer.log_text(), f"{peer.name} logged the swarm secret"  # (VISSL logs its config)
        assert "diverged from the swarm" not in peer.log_text(), peer.name  # healthy peers are never refused
        # each was stopped with Ctrl-C twice (peer0's SIGKILL leaves no text): a peer that leaves ends without a
        # traceback, and a restarted one starts without one
        assert "Traceback" not in peer.log_text(), peer.log_text()[peer.log_text().index("Traceback") - 500 :][:4000]
    # the prototypes stay on the unit sphere, also at the steps that applied a round (normalised after averaging)
    for peer in peers:
        errors = [entry["prototypes_norm_error"] for entry in peer.progress()]
        assert max(errors) < 1e-6, f"{peer.name}'s prototypes left the unit sphere: {max(errors)}"
    logged_at_apply = [
        entry
        for peer in peers[:2]
        for entry in peer.progress()
        if entry["step"] in {r["step_at_apply"] for r in peer.applied_rounds()}
    ]
    assert logged_at_apply, "no logged step applied a round: the check above saw none"
    first_losses = [entry["loss"] for entry in peers[0].progress()[:3]]
    last_losses = [entry["loss"] for entry in peers[0].progress()[-3:]]
    assert sum(last_losses) < sum(first_losses), "SwAV loss of the first peer did not fall"

    # averaging kept the peers together: they ended much closer to each other than to the initial model they
    # started from (the run's, rebuilt here exactly as the peers built it)
    initial = build_task_model("swarmtest", seed_value=0)
    assert logged_fingerprint(peers[0]) == weights_fingerprint(initial.trunk)
    initial_weights = float_tensors(initial.get_classy_state()["model"])
    moved = distance(latest_weights(peers[0]), initial_weights)
    final_distance = distance(latest_weights(peers[0]), latest_weights(peers[1]))
    assert final_distance < 0.5 * moved, (final_distance, moved)


@pytest.mark.xdist_group("swarm_scenarios")
@pytest.mark.timeout(600)
def test_box_with_two_local_processes_keeps_its_replicas_identical(digits_dir: Path, tmp_path: Path) -> None:
    """Two local ranks (gloo on CPU, VISSL's own DDP) form one peer; only rank 0 is in the swarm. It downloads the
    swarm's state (momentum included) and averages momentum too: rank 1 holds exactly rank 0's parameters and
    momentum at every step, and its buffers at every step where rank 0 applied a round (between rounds each rank's
    BatchNorm statistics follow its own batches, as in any DDP run without SyncBatchNorm)."""
    box = paced_peer("box", tmp_path)
    single = paced_peer("single", tmp_path)
    every_step = [o for o in SWARM_OVERRIDES if not o.startswith("config.LOG_FREQUENCY")] + ["config.LOG_FREQUENCY=1"]
    box_overrides = [*every_step, "config.DISTRIBUTED.NUM_PROC_PER_NODE=2", "config.SEED_VALUE=5"]
    flags = [*SWARM_FLAGS, "--target_group_size", "2", "--average_optimizer_state"]
    try:
        single.start(digits_dir, [], [*flags, "--load_state_timeout", "0"], SWARM_OVERRIDES)
        addresses = single.join_addresses()
        wait_until(lambda: single.progress(), 180, "the first logged step of the single peer")  # it has momentum
        box.start(digits_dir, addresses, flags, box_overrides)
        rank1_log = box.checkpoint_dir / "progress_rank1.jsonl"
        wait_until(
            lambda: compare_replica_logs(box.progress(), read_jsonl(rank1_log))["round_steps_compared"] >= 3,
            420,
            "three rounds on the two-process peer, in the logs of both ranks",
        )
    finally:
        stop_all([box, single])
    assert "Joined the swarm at its position" in box.log_text()  # rank 0 downloaded the single peer's state
    report = compare_replica_logs(box.progress(), read_jsonl(rank1_log))
    assert report["first_step_compared"], "rank 1 did not log the first step after the download"
    assert report["optimizer_state_present"] and report["round_steps_compared"] >= 3, report
    assert report["param_mismatch_steps"] == report["optimizer_mismatch_steps"] == [], report
    assert report["buffer_mismatch_steps"] == [], report


def test_malformed_multiaddr_fails_fast(digits_dir: Path) -> None:
    """Refused as it is parsed: the error names the address, not --join_timeout's dialing."""
    result = run_trainer(
        "--config",
        "swav_tiny",
        "--data_path",
        str(digits_dir),
        "--initial_peers",
        "/ip4/127.0.0.1/tcp/notaport/p2p/QmX",
    )
    assert result.returncode != 0
    assert "is not a multiaddr" in result.stderr and "/p2p/" in result.stderr
    assert "none of --initial_peers answered" not in result.stderr


def test_initial_peer_without_peer_id(digits_dir: Path) -> None:
    result = run_trainer(
        "--config",
        "swav_tiny",
        "--data_path",
        str(digits_dir),
        "--initial_peers",
        "/ip4/127.0.0.1/tcp/31337",
    )
    assert result.returncode != 0 and "has no /p2p/<peer id> part" in result.stderr


def test_unreachable_initial_peers_fail_with_a_clear_error(digits_dir: Path, tmp_path: Path) -> None:
    """One error line after --join_timeout, not the daemon's text nor hivemind's identity check once per try, and
    nothing left behind: neither the checkpoint folder nor the identity file the box would have made."""
    unreachable = "/ip4/127.0.0.1/tcp/9/p2p/QmUNLLsPACCz1vLxQVkXqqLX5R1X345qqfHbsf67hvA3Nn"
    folder, identity = tmp_path / "box", tmp_path / "box.key"
    result = run_trainer(
        *("--config", "swav_tiny", "--data_path", str(digits_dir), "--checkpoint_dir", str(folder)),
        *("--initial_peers", unreachable, "--host_maddrs", "/ip4/127.0.0.1/tcp/0", "--join_timeout", "8"),
        *("--identity_path", str(identity)),
    )
    assert result.returncode == 3, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and errors[0].startswith("error: could not join the swarm: none of --initial_peers"), errors
    assert "first peer is running" in errors[0] and "bootstrap" not in result.stderr
    assert result.stderr.count("Checking that identity") <= 1 and "Traceback" not in result.stderr
    assert not folder.exists() and not identity.exists(), sorted(tmp_path.rglob("*"))


def test_bad_averaging_knobs_are_rejected(digits_dir: Path) -> None:
    result = run_trainer("--config", "swav_tiny", "--data_path", str(digits_dir), "--target_group_size", "1")
    assert result.returncode != 0 and "--target_group_size must be at least 2" in result.stderr
