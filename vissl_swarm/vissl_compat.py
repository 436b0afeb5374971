"""Work-arounds that make VISSL 0.1.6 and classy_vision 0.7.0 (2021) run on today's stack.

Import this module before anything from ``vissl`` or ``classy_vision``: ``from vissl_swarm import vissl_compat`` then
``vissl_compat.apply()``. Each patch is small, names the upstream bug it works around, and is tested
(``tests/test_vissl_compat.py``; checkpoints and unreadable images in ``tests/test_bad_input.py``).
Config-level fixes live in :func:`adapt_config`, which ``run_trainer.py`` applies to every composed config,
so the shipped YAML files keep VISSL's own keys and meaning.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import warnings
from typing import Any

logger = logging.getLogger(__name__)

_applied = False


def alias_kinetics400() -> None:
    """classy_vision imports ``torchvision.datasets.kinetics.Kinetics400``, removed in torchvision 0.14.

    Upstream: facebookresearch/ClassyVision#798 ("from classy_vision import dataset will fail with current
    version of torchvision"). ``Kinetics(num_classes="400")`` is the same dataset.
    """
    import torchvision.datasets
    import torchvision.datasets.kinetics as kinetics

    if not hasattr(kinetics, "Kinetics400"):
        kinetics.Kinetics400 = kinetics.Kinetics
    if not hasattr(torchvision.datasets, "Kinetics400"):
        torchvision.datasets.Kinetics400 = kinetics.Kinetics


def require_pkg_resources() -> None:
    """VISSL's ``vissl/utils/misc.py`` imports ``pkg_resources``, which setuptools 81 removed.

    Upstream: pypa/setuptools#3085 (pkg_resources deprecation); VISSL is unmaintained, so we pin
    ``setuptools<81`` in requirements.txt and fail early with what to do, instead of a bare ImportError deep
    inside VISSL. The deprecation warning it prints on every import is silenced.
    """
    warnings.filterwarnings("ignore", message="pkg_resources is deprecated", category=UserWarning)
    try:
        import pkg_resources  # noqa: F401
    except ImportError as error:
        raise ImportError(
            "VISSL 0.1.6 needs pkg_resources, which setuptools>=81 no longer ships. "
            'Run: pip install "setuptools<81"  (or `make venv`, which installs requirements.txt)'
        ) from error


def silence_known_warnings() -> None:
    """Deprecation noise from 2021 code paths we do not use (video transforms, torch.jit.script, hydra 1.1
    defaults) hides the messages users need. Only these exact categories are muted."""
    warnings.filterwarnings("ignore", module=r"torchvision\.transforms\._(functional|transforms)_video")
    warnings.filterwarnings("ignore", message=r".*torch\.jit\.script.*is deprecated", category=FutureWarning)
    warnings.filterwarnings("ignore", message=r"\s*The version_base parameter is not specified")


def atomic_save_checkpoint(checkpoint_folder: str, state: Any, checkpoint_file: str) -> str:
    """classy_vision's ``save_checkpoint`` says "write checkpoint atomically" but writes straight into the final
    file: a crash or a full disk mid-write leaves a truncated checkpoint that AUTO_RESUME then picks as the
    newest. Write a temporary file, fsync, and rename it into place (classy_vision ``generic/util.py``,
    facebookresearch/ClassyVision; unmaintained upstream)."""
    import torch

    os.makedirs(checkpoint_folder, exist_ok=True)
    final_path = os.path.join(checkpoint_folder, checkpoint_file)
    temporary_path = f"{final_path}.tmp-{os.getpid()}"
    try:
        with open(temporary_path, "wb") as file:
            torch.save(state, file)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary_path, final_path)
    except BaseException:
        logger.error(f"Could not write checkpoint {final_path}; the previous checkpoints are untouched")
        if os.path.exists(temporary_path):
            os.remove(temporary_path)
        raise
    return final_path


def make_checkpoints_atomic() -> None:
    import vissl.utils.checkpoint

    vissl.utils.checkpoint.save_checkpoint = atomic_save_checkpoint


def skip_unreadable_images() -> None:
    """VISSL's ``DiskImageDataset.__getitem__`` loads a ``disk_folder`` image (``self.image_dataset[idx]``) *before*
    its try/except, so its own fallback for unreadable images (warn, use a mean image, mark it invalid) never runs
    and one corrupt JPEG kills the training (vissl/data/disk_dataset.py, 0.1.6). Run that fallback."""
    from vissl.data.disk_dataset import DiskImageDataset, get_mean_image

    load = DiskImageDataset.__getitem__
    if getattr(load, "_skips_unreadable", False):
        return

    def getitem(self, idx: int):
        try:
            return load(self, idx)
        except (OSError, ValueError, SyntaxError) as error:  # what PIL raises for broken files
            path = self.image_dataset.samples[idx][0] if hasattr(self.image_dataset, "samples") else idx
            logging.warning(f"Couldn't load: {path}; using a mean image instead. Exception: {error}")
            return get_mean_image(self.cfg["DATA"][self.split].DEFAULT_GRAY_IMG_SIZE), False

    getitem._skips_unreadable = True
    DiskImageDataset.__getitem__ = getitem


def unscale_before_clipping() -> None:
    """VISSL's ``GradClipHook`` clips in ``on_backward`` while torch AMP's gradients are still multiplied by the
    loss scale (vissl/hooks/grad_clip_hooks.py, 0.1.6 and VISSL's main branch): ``MAX_NORM`` is compared with
    scale x the gradient norm (the scale starts at 65536), so every step's gradient is shrunk to
    ``MAX_NORM / scale``, i.e. almost no update. Unscale first, as torch's AMP notes prescribe for clipping
    ("Working with unscaled gradients"); ``GradScaler.step`` then sees the optimizer unscaled and does not
    unscale again, and still skips the step if the gradients are not finite."""
    import torch
    from vissl.hooks.grad_clip_hooks import GradClipHook

    if getattr(GradClipHook.on_backward, "_unscales", False):
        return

    def on_backward(self, task) -> None:
        scaler = getattr(task, "amp_grad_scaler", None)
        if scaler is not None:  # torch AMP (VISSL creates the scaler only for AMP_TYPE pytorch)
            scaler.unscale_(task.optimizer)
        torch.nn.utils.clip_grad_norm_(task.model.parameters(), max_norm=self.max_norm, norm_type=self.norm_type)

    on_backward._unscales = True
    GradClipHook.on_backward = on_backward


WRAPPING_UP = "Wrapping up, caught exception: "
VISSL_ROOT_LOGGERS = ("vissl.utils.distributed_launcher", "vissl.engines.train")  # what setup_logging makes root
CUDA_EVENTS_WARNING = "CUDA unavailable: CUDA events are not logged."  # VISSL's and classy's PerfStats, no CUDA


class _FormatWrappingUp(logging.Filter):
    """VISSL's ``launch_distributed`` ends a run stopped with Ctrl-C by ``logging.error("Wrapping up, caught
    exception: ", e)``: an argument without a placeholder, so logging prints "--- Logging error ---" and two
    tracebacks instead of the line (vissl/utils/distributed_launcher.py, 0.1.6 and VISSL's main branch; VISSL is
    unmaintained). Give the argument its placeholder."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.msg == WRAPPING_UP and record.args:
            record.msg, record.args = WRAPPING_UP + "%r", record.args[:1]
        return True


def format_wrapping_up_message() -> None:
    """On the loggers that VISSL's ``setup_logging`` turns into ``logging.root`` (``logging.error`` goes there)."""
    for name in VISSL_ROOT_LOGGERS:
        target = logging.getLogger(name)
        if not any(isinstance(f, _FormatWrappingUp) for f in target.filters):
            target.addFilter(_FormatWrappingUp())


class _CudaEventsWarningOnce(logging.Filter):
    """On a box without CUDA, VISSL's and classy_vision's ``PerfStats()`` log "CUDA unavailable: CUDA events are
    not logged." each time one is made: at every phase start (``LogPerfTimeMetricsHook.on_phase_start``), every few
    steps with small epochs (vissl/utils/perf_stats.py, classy_vision/generic/perf_stats.py; unmaintained upstream).
    Let the first through, then drop the repeats."""

    def __init__(self) -> None:
        super().__init__()
        self.seen = False

    def filter(self, record: logging.LogRecord) -> bool:
        if record.msg != CUDA_EVENTS_WARNING:
            return True
        first, self.seen = not self.seen, True
        return first


def log_cuda_events_warning_once() -> None:
    """On the loggers that VISSL's ``setup_logging`` turns into ``logging.root``, where the warning is logged."""
    once = _CudaEventsWarningOnce()
    for name in VISSL_ROOT_LOGGERS:
        target = logging.getLogger(name)
        if not any(isinstance(f, _CudaEventsWarningOnce) for f in target.filters):
            target.addFilter(once)


def apply() -> None:
    """Apply the import-level patches once; safe to call many times."""
    global _applied
    if _applied:
        return
    require_pkg_resources()
    silence_known_warnings()
    alias_kinetics400()
    make_checkpoints_atomic()
    skip_unreadable_images()
    unscale_before_clipping()
    format_wrapping_up_message()
    log_cuda_events_warning_once()
    _applied = True


def adapt_config(config: Any, has_gpu: bool) -> list[str]:
    """Rewrite the parts of a composed VISSL config that cannot work on this stack; return what changed.

    - apex is gone (no wheels for current torch): LARC through VISSL's pure-torch ``sgd_fsdp`` optimizer
      (VISSL asserts apex for ``sgd`` + LARC, facebookresearch/vissl ``train_task._build_optimizer``), torch AMP
      instead of apex AMP, and torch SyncBatchNorm instead of apex's.
    - hivemind's averager is a ``multiprocessing.Process`` holding locks and pipes: under ``spawn``/``forkserver``
      (VISSL's default ``MULTI_PROCESSING_METHOD``) it must be pickled and fails; we use ``fork``.
    - ``DISTRIBUTED.RUN_ID`` must be set for the tcp rendezvous; each peer is its own single-node job, so
      ``auto`` (a free local port) is right (VISSL asserts it is set, ``vissl/utils/misc.get_dist_run_id``).
    - without a GPU, a GPU config is run on the CPU with gloo and without AMP, so that it can be tried out.
    """
    changes = []

    def set_value(section: Any, key: str, value: Any, why: str) -> None:
        if section[key] != value:
            changes.append(f"{key}: {section[key]!r} -> {value!r} ({why})")
            section[key] = value

    optimizer = config.OPTIMIZER
    if optimizer.get("use_larc", False) and optimizer.name == "sgd":
        set_value(optimizer, "name", "sgd_fsdp", "LARC without apex")
    amp = config.MODEL.AMP_PARAMS
    if amp.get("AMP_TYPE", "apex") == "apex":
        set_value(amp, "AMP_TYPE", "pytorch", "apex is not available")
    sync_bn = config.MODEL.SYNC_BN_CONFIG
    if sync_bn.get("SYNC_BN_TYPE", "") == "apex":
        set_value(sync_bn, "SYNC_BN_TYPE", "pytorch", "apex is not available")
    set_value(config, "MULTI_PROCESSING_METHOD", "fork", "the hivemind averager process cannot be pickled")
    if not config.DISTRIBUTED.RUN_ID or "x" * 8 in str(config.DISTRIBUTED.RUN_ID):
        set_value(config.DISTRIBUTED, "RUN_ID", "auto", "one node per peer")
    if not has_gpu:
        set_value(config.MACHINE, "DEVICE", "cpu", "no GPU found")
        set_value(config.DISTRIBUTED, "BACKEND", "gloo", "no GPU found")
        set_value(amp, "USE_AMP", False, "AMP needs a GPU")
        if config.DISTRIBUTED.NUM_PROC_PER_NODE > 1 and sync_bn.get("CONVERT_BN_TO_SYNC_BN", False):
            set_value(sync_bn, "CONVERT_BN_TO_SYNC_BN", False, "SyncBatchNorm needs a GPU")
    if config.DISTRIBUTED.NUM_PROC_PER_NODE == 1 and sync_bn.get("CONVERT_BN_TO_SYNC_BN", False):
        set_value(sync_bn, "CONVERT_BN_TO_SYNC_BN", False, "one process per peer: nothing to sync")
    return changes


def fork_start_method() -> None:
    """Make ``fork`` the start method of this process too (VISSL sets its config's method in each worker)."""
    if multiprocessing.get_start_method(allow_none=True) != "fork":
        multiprocessing.set_start_method("fork", force=True)
