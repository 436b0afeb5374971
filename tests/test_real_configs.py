"""The configs users run on GPU boxes (ResNet-50 and ViT-S/16), trained for real by two boxes on CPU at a small batch:
they average and end by themselves at the swarm's budget, without a traceback. The suite's other scenarios train
swav_tiny; these catch what only the full-size models meet (their recipes, AMP and LARC on CPU, 100 MB rounds)."""

from __future__ import annotations

import pytest

from vissl_swarm.local_swarm import LocalPeer, start_swarm_together, stop_all, wait_until

# 10 batches of 4 real images an epoch and 2 epochs for the whole swarm: ~10 steps a box, a few rounds
OVERRIDES = [
    "config.DATA.TRAIN.DATA_LIMIT=40",
    "config.DATA.TRAIN.BATCHSIZE_PER_REPLICA=4",
    "config.DATA.NUM_DATALOADER_WORKERS=1",
    "config.OPTIMIZER.num_epochs=2",
    "config.LOG_FREQUENCY=2",
]
FLAGS = ["--run_id", "realconfig", "--min_matchmaking_time", "2", "--averaging_timeout", "60", "--join_timeout", "90"]


@pytest.mark.long
@pytest.mark.xdist_group("swarm_scenarios")
@pytest.mark.parametrize("config", ["swav_resnet50", "swav_vit_small"])
def test_two_boxes_train_a_real_config_to_its_end(config: str, digits_dir, tmp_path) -> None:
    peers = [LocalPeer(f"box{i}", tmp_path, config=config) for i in range(2)]
    try:
        start_swarm_together(peers, digits_dir, FLAGS, OVERRIDES)
        wait_until(lambda: not any(peer.is_running() for peer in peers), 900, f"both {config} boxes' end")
    finally:
        stop_all(peers)
    for peer in peers:
        log = peer.log_text()
        assert peer.process.returncode == 0, peer.exit_message()
        assert "Traceback" not in log, f"{peer.name} printed a traceback (see {peer.log_path})"
        assert "budget is done" in log, f"{peer.name} did not end at the swarm's budget (see {peer.log_path})"
        applied = peer.applied_rounds()
        assert applied, f"{peer.name} applied no averaging round: {peer.rounds()[-3:]}"
