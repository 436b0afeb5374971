"""export_trunk.py: a VISSL checkpoint's trunk loads into torchvision's resnet50 and computes the same features,
the ViT-S/16 trunk carries timm's names and shapes and computes what timm's architecture computes, --average
averages, and unusable input is named."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torchvision

from export_trunk import ExportError, average_trunks, export_trunk, timm_vit_small_patch16_224_shapes
from tests.conftest import REPO, trainer_env


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """The tests share 2 cores with other tests."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def build_vissl_model(config_name: str) -> Any:
    """The config's model (trunk and SwAV head) as VISSL builds it, seeded like run_eval's random init."""
    from vissl.models import build_model

    from vissl_swarm.config_loading import compose_config

    config, _ = compose_config(config_name, [], has_gpu=False)
    torch.manual_seed(config.SEED_VALUE)
    return build_model(config.MODEL, config.OPTIMIZER)


def save_vissl_checkpoint(model: Any, folder: Path) -> Path:
    """A final checkpoint written by VISSL's own CheckpointWriter, with the model's own classy state (the trainer's
    also holds the optimizer's and the loss's, which the export does not read)."""
    from vissl.utils.checkpoint import CheckpointWriter

    content = {
        "phase_idx": 0,
        "iteration": 2,
        "loss": {},
        "iteration_num": 2,
        "train_phase_idx": 0,
        "classy_state_dict": {"base_model": model.get_classy_state(), "phase_idx": 0},
    }
    CheckpointWriter(
        str(folder), is_final_train_phase=True, mode="phase", mode_num=0, backend="disk"
    ).save_consolidated_checkpoint(content)
    return folder / "model_final_checkpoint_phase0.torch"


def perturb(model: Any, seed: int) -> None:
    """Other weights than the initial ones (noise on every parameter) and BatchNorm statistics of real forward
    passes in train mode, as training leaves them."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.02 * torch.randn(param.shape, generator=generator))
        model.trunk.train()
        for _ in range(2):
            model.trunk(torch.randn(2, 3, 64, 64, generator=generator), [])
    model.eval()


@pytest.fixture(scope="module")
def resnet_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, list[Path]]:
    """swav_resnet50's initial model and two perturbed ones, each saved as a peer's checkpoint folder."""
    root = tmp_path_factory.mktemp("resnet")
    model = build_vissl_model("swav_resnet50").eval()
    folders = [root / "initial", root / "peer0", root / "peer1"]
    save_vissl_checkpoint(model, folders[0])
    for seed, folder in enumerate(folders[1:]):
        perturb(model, seed)
        save_vissl_checkpoint(model, folder)
    return model, folders  # the model holds peer1's weights


def vissl_trunk(config_name: str, folder: Path) -> torch.nn.Module:
    from run_eval import build_trunk, load_trunk_state, resolve_checkpoint

    path = resolve_checkpoint(folder)
    return build_trunk(config_name, load_trunk_state(path), path)[0]


def test_resnet50_export_loads_into_torchvision_and_computes_the_same_features(
    resnet_checkpoints: tuple[Any, list[Path]], tmp_path: Path
) -> None:
    _, folders = resnet_checkpoints
    images = torch.randn(2, 3, 96, 96, generator=torch.Generator().manual_seed(7))
    for folder in (folders[0], folders[2]):  # the initial weights and trained-like ones
        out = tmp_path / f"{folder.name}.pth"
        export_trunk([folder], "swav_resnet50", out)
        model = torchvision.models.resnet50()
        result = model.load_state_dict(torch.load(out, weights_only=True), strict=False)
        assert sorted(result.missing_keys) == ["fc.bias", "fc.weight"] and result.unexpected_keys == []
        model.fc = torch.nn.Identity()  # the features before fc: avgpool + flatten, as VISSL's trunk ends
        model.eval()
        with torch.no_grad():
            expected = vissl_trunk("swav_resnet50", folder)(images, [])[0]  # [] as the trainer passes it
            features = model(images)
        assert features.shape == (2, 2048)
        torch.testing.assert_close(features, expected, atol=1e-5, rtol=1e-5)
    # the perturbed checkpoint really differs from the initial one (so the comparison above is not vacuous)
    initial = torch.load(tmp_path / "initial.pth", weights_only=True)
    trained = torch.load(tmp_path / "peer1.pth", weights_only=True)
    assert not torch.equal(initial["layer4.2.conv3.weight"], trained["layer4.2.conv3.weight"])
    assert not torch.equal(initial["bn1.running_mean"], trained["bn1.running_mean"])


def test_average_of_two_checkpoints_is_the_average_of_their_exports(
    resnet_checkpoints: tuple[Any, list[Path]], tmp_path: Path
) -> None:
    _, folders = resnet_checkpoints
    first = export_trunk([folders[1]], "swav_resnet50", tmp_path / "peer0.pth")
    second = export_trunk([folders[2]], "swav_resnet50", tmp_path / "peer1.pth")
    result = subprocess.run(
        [
            sys.executable,
            str(REPO / "export_trunk.py"),
            "--average",
            "--checkpoint",
            str(folders[1]),
            str(folders[2]),
            "--config",
            "swav_resnet50",
            "--out",
            str(tmp_path / "average.pth"),
        ],
        cwd=REPO,
        env=trainer_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "average of 2 checkpoints" in result.stdout
    averaged = torch.load(tmp_path / "average.pth", weights_only=True)
    assert averaged.keys() == first.keys()
    for name, tensor in averaged.items():
        if tensor.is_floating_point():  # weights and BatchNorm running statistics
            torch.testing.assert_close(tensor, (first[name] + second[name]) / 2, atol=1e-6, rtol=1e-6)
        else:  # num_batches_tracked: the first checkpoint's
            assert torch.equal(tensor, first[name])
    assert not torch.equal(averaged["bn1.running_var"], first["bn1.running_var"])
    assert torchvision.models.resnet50().load_state_dict(averaged, strict=False).unexpected_keys == []


def reference_vit_forward(state: dict[str, torch.Tensor], images: torch.Tensor, heads: int = 6) -> torch.Tensor:
    """timm's VisionTransformer (global_pool="token", pre-norm blocks, fused attention, exact GELU, LayerNorm eps
    1e-6) written out on the exported state dict: its pre-logits features, what VISSL's ViT trunk returns."""
    functional = torch.nn.functional
    dim = state["cls_token"].shape[-1]

    def norm(x: torch.Tensor, prefix: str) -> torch.Tensor:
        return functional.layer_norm(x, (dim,), state[f"{prefix}.weight"], state[f"{prefix}.bias"], eps=1e-6)

    def linear(x: torch.Tensor, prefix: str) -> torch.Tensor:
        return functional.linear(x, state[f"{prefix}.weight"], state[f"{prefix}.bias"])

    x = functional.conv2d(images, state["patch_embed.proj.weight"], state["patch_embed.proj.bias"], stride=16)
    x = x.flatten(2).transpose(1, 2)
    x = torch.cat([state["cls_token"].expand(len(x), -1, -1), x], dim=1) + state["pos_embed"]
    blocks = 1 + max(int(name.split(".")[1]) for name in state if name.startswith("blocks."))
    for block in range(blocks):
        prefix = f"blocks.{block}"
        batch, tokens, _ = x.shape
        qkv = linear(norm(x, f"{prefix}.norm1"), f"{prefix}.attn.qkv")
        q, k, v = qkv.reshape(batch, tokens, 3, heads, dim // heads).permute(2, 0, 3, 1, 4).unbind(0)
        attention = functional.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(batch, tokens, dim)
        x = x + linear(attention, f"{prefix}.attn.proj")
        hidden = functional.gelu(linear(norm(x, f"{prefix}.norm2"), f"{prefix}.mlp.fc1"))
        x = x + linear(hidden, f"{prefix}.mlp.fc2")
    return norm(x, "norm")[:, 0]


def test_vit_small_export_has_timms_names_and_shapes_and_computes_the_same_features(tmp_path: Path) -> None:
    model = build_vissl_model("swav_vit_small")
    perturb_vit = torch.Generator().manual_seed(3)  # LayerNorms at 1/0 and zero biases would hide mix-ups
    with torch.no_grad():
        for param in model.trunk.parameters():
            param.add_(0.02 * torch.randn(param.shape, generator=perturb_vit))
    folder = tmp_path / "vit_peer"
    save_vissl_checkpoint(model, folder)
    exported = export_trunk([folder], "swav_vit_small", tmp_path / "vit.pth")

    timm_shapes = timm_vit_small_patch16_224_shapes()
    assert set(timm_shapes) - set(exported) == {"head.weight", "head.bias"}  # the classifier, as fc for ResNet
    for name, tensor in exported.items():  # key by key: every exported tensor is one of timm's, same shape
        assert tuple(tensor.shape) == timm_shapes[name], name
    assert len(exported) == 4 + 12 * 12 + 2

    images = torch.randn(2, 3, 224, 224, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        expected = model.trunk.eval()(images, [])[0]
        features = reference_vit_forward(torch.load(tmp_path / "vit.pth", weights_only=True), images)
    assert features.shape == (2, 384)
    torch.testing.assert_close(features, expected, atol=1e-5, rtol=1e-5)

    # a ViT checkpoint exported as a ResNet: the error says which config fits
    with pytest.raises(ExportError, match="does not fit torchvision resnet50.*pass --config swav_vit_small"):
        export_trunk([folder], "swav_resnet50", tmp_path / "wrong.pth")


def test_unusable_input_is_named(resnet_checkpoints: tuple[Any, list[Path]], tmp_path: Path) -> None:
    _, folders = resnet_checkpoints
    out = tmp_path / "out.pth"
    not_torch = tmp_path / "notes.torch"
    not_torch.write_text("not a checkpoint")
    with pytest.raises(ExportError, match=f"{not_torch}: cannot be read as a torch checkpoint"):
        export_trunk([not_torch], "swav_resnet50", out)
    foreign = tmp_path / "foreign.torch"
    torch.save({"state_dict": {"weight": torch.zeros(2)}}, foreign)
    with pytest.raises(ExportError, match=f"{foreign}: not a VISSL checkpoint"):
        export_trunk([foreign], "swav_resnet50", out)
    with pytest.raises(ExportError, match="holds no VISSL checkpoint"):
        export_trunk([tmp_path], "swav_resnet50", out)
    with pytest.raises(ExportError, match="does not fit timm vit_small_patch16_224.*pass --config swav_resnet50"):
        export_trunk([folders[0]], "swav_vit_small", out)
    with pytest.raises(ExportError, match="pass one, or --average"):
        export_trunk(folders[:2], "swav_resnet50", out)
    with pytest.raises(ExportError, match="export supports swav_resnet50, swav_vit_small"):
        export_trunk([folders[0]], "swav_tiny", out)
    assert not out.exists()

    # averaging trunks of different widths: both checkpoints and the tensor are named
    state = {"conv1.weight": torch.zeros(64, 3, 7, 7), "bn1.num_batches_tracked": torch.tensor(3)}
    wider = dict(state, **{"conv1.weight": torch.zeros(128, 3, 7, 7)})
    with pytest.raises(
        ExportError,
        match=r"a.torch and b.torch: conv1.weight has shape \(64, 3, 7, 7\) in the "
        r"first and \(128, 3, 7, 7\)",
    ):
        average_trunks([state, wider], [Path("a.torch"), Path("b.torch")])
    with pytest.raises(ExportError, match="different parameters"):
        average_trunks([state, {"conv1.weight": state["conv1.weight"]}], [Path("a.torch"), Path("b.torch")])

    # from the command line: a message, exit status 2, no traceback
    result = subprocess.run(
        [
            sys.executable,
            str(REPO / "export_trunk.py"),
            "--checkpoint",
            str(foreign),
            "--config",
            "swav_resnet50",
            "--out",
            str(out),
        ],
        cwd=REPO,
        env=trainer_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2 and "not a VISSL checkpoint" in result.stderr
    assert "Traceback" not in result.stderr
