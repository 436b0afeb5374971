"""Each work-around in vissl_compat does what it says, on the installed stack."""

from __future__ import annotations

import multiprocessing
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from tests.conftest import REPO, trainer_env
from vissl_swarm import vissl_compat
from vissl_swarm.config_loading import compose_config


def test_classy_vision_dataset_imports_after_kinetics_alias() -> None:
    code = "from vissl_swarm import vissl_compat; vissl_compat.apply(); import classy_vision.dataset; print('ok')"
    result = subprocess.run([sys.executable, "-c", code], env=trainer_env(), cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    import torchvision.datasets.kinetics as kinetics

    vissl_compat.apply()
    assert kinetics.Kinetics400 is kinetics.Kinetics


def test_without_the_alias_classy_vision_fails_as_upstream_reports() -> None:
    """Guards the patch: if torchvision brings Kinetics400 back, this test tells us the patch can go."""
    code = "import classy_vision.dataset"
    result = subprocess.run([sys.executable, "-c", code], env=trainer_env(), cwd=REPO, capture_output=True, text=True)
    assert result.returncode != 0 and "Kinetics400" in result.stderr


def test_pkg_resources_is_available_for_vissl() -> None:
    vissl_compat.require_pkg_resources()
    import vissl.utils.misc  # imports pkg_resources at module level

    assert vissl.utils.misc.is_apex_available() is False


@pytest.mark.parametrize("name", ["swav_resnet50", "swav_vit_small"])
def test_adapt_config_replaces_apex_and_gpu_only_settings(name: str) -> None:
    # VISSL's own way to ask for LARC (sgd + use_larc) needs apex; the ViT's recipe is AdamW, asked for LARC here
    config, changes = compose_config(
        name,
        [
            "config.OPTIMIZER.name=sgd",
            "config.OPTIMIZER.use_larc=True",
            "config.MODEL.AMP_PARAMS.AMP_TYPE=apex",
            "config.MULTI_PROCESSING_METHOD=forkserver",
            "config.DISTRIBUTED.RUN_ID=xxxxxxxxxxxxxxxx",
        ],
        has_gpu=False,
    )
    assert config.OPTIMIZER.name == "sgd_fsdp" and config.OPTIMIZER.use_larc
    assert config.MODEL.AMP_PARAMS.AMP_TYPE == "pytorch" and not config.MODEL.AMP_PARAMS.USE_AMP
    assert config.MULTI_PROCESSING_METHOD == "fork"
    assert config.DISTRIBUTED.RUN_ID == "auto"
    assert config.MACHINE.DEVICE == "cpu" and config.DISTRIBUTED.BACKEND == "gloo"
    assert any("apex" in change for change in changes)


def test_adapt_config_keeps_gpu_settings_on_a_gpu_machine() -> None:
    config, _ = compose_config("swav_resnet50", ["config.DISTRIBUTED.NUM_PROC_PER_NODE=2"], has_gpu=True)
    assert config.MACHINE.DEVICE == "gpu" and config.MODEL.AMP_PARAMS.USE_AMP
    assert config.MODEL.SYNC_BN_CONFIG.CONVERT_BN_TO_SYNC_BN and config.MODEL.SYNC_BN_CONFIG.SYNC_BN_TYPE == "pytorch"


def test_fork_start_method_lets_a_hivemind_averager_start() -> None:
    """Under forkserver the averager (a multiprocessing.Process with locks and pipes) cannot be pickled."""
    import hivemind

    vissl_compat.fork_start_method()
    assert multiprocessing.get_start_method() == "fork"
    dht = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    try:
        averager = hivemind.DecentralizedAverager([torch.zeros(3)], dht, prefix="compat_test", start=True)
        averager.shutdown()
    finally:
        dht.shutdown()


def test_gradient_clipping_under_torch_amp_clips_the_unscaled_gradient() -> None:
    """VISSL's GradClipHook with torch AMP: the step must be the true gradient clipped to MAX_NORM, not the scaled
    gradient clipped and then divided by the loss scale (an update 65536 times too small)."""
    from vissl.hooks import GradClipHook

    vissl_compat.apply()
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    loss = model(10 * torch.randn(32, 8)).pow(2).mean()
    gradient = torch.autograd.grad(loss, list(model.parameters()), retain_graph=True)
    norm = torch.sqrt(sum(g.pow(2).sum() for g in gradient))
    assert norm > 1.0
    expected = [p.detach() - g / norm for p, g in zip(model.parameters(), gradient, strict=True)]  # lr 1, norm 1

    scaler.scale(loss).backward()
    task = SimpleNamespace(model=model, optimizer=optimizer, amp_grad_scaler=scaler)
    GradClipHook(norm_type=2, max_norm=1.0).on_backward(task)
    scaler.step(optimizer)  # must not unscale a second time
    scaler.update()
    for param, want in zip(model.parameters(), expected, strict=True):
        assert torch.allclose(param.detach(), want, atol=1e-5)


CTRL_C_SCRIPT = """
import sys
from vissl_swarm import vissl_compat
vissl_compat.apply()
from vissl_swarm.config_loading import compose_config
from vissl.utils.distributed_launcher import launch_distributed

def ctrl_c(cfg):  # VISSL calls the hook generator inside its training engine, after its logging is set up
    raise KeyboardInterrupt

config, _ = compose_config("swav_tiny", [f"config.CHECKPOINT.DIR={sys.argv[1]}"], has_gpu=False)
launch_distributed(config, node_id=0, engine_name="train", hook_generator=ctrl_c)
"""


def test_a_run_stopped_with_ctrl_c_ends_with_vissls_line_not_a_logging_error(tmp_path) -> None:
    result = subprocess.run(
        [sys.executable, "-c", CTRL_C_SCRIPT, str(tmp_path)],
        env=trainer_env(),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=480,  # VISSL's start took over 120 s beside two suites, make test-long and two busy processes
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-3000:]  # VISSL swallows the KeyboardInterrupt and wraps up
    assert "Wrapping up, caught exception: KeyboardInterrupt()" in output, output[-3000:]
    assert "Logging error" not in output and "Traceback" not in output, output[-3000:]


def test_the_cuda_events_warning_of_a_cpu_box_is_logged_once(caplog) -> None:
    """VISSL's PerfStats, made at every phase start, warns each time on a box without CUDA; once is enough."""
    import logging

    import torch
    from vissl.utils.perf_stats import PerfStats

    vissl_compat.apply()
    root = logging.getLogger(vissl_compat.VISSL_ROOT_LOGGERS[0])
    saved = logging.root
    logging.root = root  # as VISSL's setup_logging leaves it: logging.warning() goes to this logger
    try:
        with caplog.at_level(logging.WARNING):
            for _ in range(3):
                PerfStats()
    finally:
        logging.root = saved
    expected = 0 if torch.cuda.is_available() else 1
    assert caplog.text.count(vissl_compat.CUDA_EVENTS_WARNING) == expected
