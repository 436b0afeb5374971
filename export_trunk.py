#!/usr/bin/env python3
"""Export a trained SwAV trunk from VISSL's checkpoint format to torchvision's or timm's naming.

    python export_trunk.py --checkpoint checkpoints/peer0 --config swav_resnet50 --out resnet50_swav.pth
    python export_trunk.py --average --checkpoint checkpoints/peer* --config swav_resnet50 --out resnet50_swav.pth

Why: downstream users fine-tune or probe the trunk with torchvision or timm, not with VISSL. A VISSL checkpoint
nests the trunk in ``classy_state_dict/base_model/model/trunk`` under VISSL's module names, next to the SwAV head,
the loss's queue and the training position. The output here is a plain state dict of the trunk alone:

    model = torchvision.models.resnet50()                                   # --config swav_resnet50
    model.load_state_dict(torch.load("resnet50_swav.pth"), strict=False)    # missing: only fc.weight, fc.bias
    model.fc = torch.nn.Identity()                                          # or a new classifier

    model = timm.create_model("vit_small_patch16_224", num_classes=0)       # --config swav_vit_small
    model.load_state_dict(torch.load("vit_small_swav.pth"))

ResNet-50: VISSL's trunk wraps torchvision's own ResNet layers in ``_feature_blocks``, so the export drops that
prefix and is checked against ``torchvision.models.resnet50()``'s keys and shapes (the tests also compare outputs).
ViT-S/16: VISSL's ViT is a copy of timm's, with timm's module names; the export is checked by name and shape
against timm's ``vit_small_patch16_224`` as written out in ``timm_vit_small_patch16_224_shapes`` (timm is not a
dependency here, so it was never loaded by timm itself; the tests compare outputs with a forward pass written
from timm's architecture).

``--average``: the boxes of a swarm end close to each other (they average their weights all along), so the mean
of their final trunks is one more model: parameters and BatchNorm running statistics are averaged,
``num_batches_tracked`` (a counter) is taken from the first checkpoint.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from run_eval import EvalError, load_trunk_state, resolve_checkpoint

StateDict = dict[str, torch.Tensor]
Shapes = dict[str, tuple[int, ...]]


class ExportError(ValueError):
    """Unusable checkpoints or options; the message says what was wrong and what to do."""


@dataclass(frozen=True)
class Target:
    """Where a config's trunk goes: the library model, how VISSL's names become its names, and its keys/shapes."""

    model: str
    rename: Callable[[str], str]
    shapes: Callable[[], Shapes]
    classifier: tuple[str, ...]  # the library model's classifier: not part of a trunk, left missing


def resnet50_name(vissl_name: str) -> str:
    """``_feature_blocks.layer1.0.conv1.weight`` -> ``layer1.0.conv1.weight`` (VISSL's ResNeXt trunk holds
    torchvision's own conv1/bn1/layer1..4 modules under ``_feature_blocks``)."""
    prefix = "_feature_blocks."
    return vissl_name[len(prefix) :] if vissl_name.startswith(prefix) else vissl_name


def torchvision_resnet50_shapes() -> Shapes:
    """torchvision's resnet50 state dict, built on the meta device (no memory, no init)."""
    import torchvision

    with torch.device("meta"):
        model = torchvision.models.resnet50()
    return {name: tuple(tensor.shape) for name, tensor in model.state_dict().items()}


def timm_vit_small_patch16_224_shapes() -> Shapes:
    """timm's ``vit_small_patch16_224`` state dict: patch 16, 224 px (196 patches + the class token), width 384,
    12 blocks with 6 heads, MLP 4x, qkv with bias, a 1000-class head (timm's VisionTransformer; LayerScale, q/k
    norms, fc_norm and norm_pre are Identity there and hold no weights)."""
    dim, hidden, depth, patches, classes = 384, 1536, 12, (224 // 16) ** 2, 1000
    shapes: Shapes = {
        "cls_token": (1, 1, dim),
        "pos_embed": (1, patches + 1, dim),
        "patch_embed.proj.weight": (dim, 3, 16, 16),
        "patch_embed.proj.bias": (dim,),
    }
    for block in range(depth):
        for name, shape in {
            "norm1.weight": (dim,),
            "norm1.bias": (dim,),
            "attn.qkv.weight": (3 * dim, dim),
            "attn.qkv.bias": (3 * dim,),
            "attn.proj.weight": (dim, dim),
            "attn.proj.bias": (dim,),
            "norm2.weight": (dim,),
            "norm2.bias": (dim,),
            "mlp.fc1.weight": (hidden, dim),
            "mlp.fc1.bias": (hidden,),
            "mlp.fc2.weight": (dim, hidden),
            "mlp.fc2.bias": (dim,),
        }.items():
            shapes[f"blocks.{block}.{name}"] = shape
    shapes |= {"norm.weight": (dim,), "norm.bias": (dim,), "head.weight": (classes, dim), "head.bias": (classes,)}
    return shapes


TARGETS = {
    "swav_resnet50": Target(
        "torchvision resnet50", resnet50_name, torchvision_resnet50_shapes, ("fc.weight", "fc.bias")
    ),
    "swav_vit_small": Target(
        "timm vit_small_patch16_224", lambda name: name, timm_vit_small_patch16_224_shapes, ("head.weight", "head.bias")
    ),
}


def trunk_kind(state: StateDict) -> str | None:
    """The config whose trunk this looks like, to suggest the right --config."""
    if "_feature_blocks.conv1.weight" in state:
        return "swav_resnet50"
    if "cls_token" in state and "patch_embed.proj.weight" in state:
        return "swav_vit_small"
    return None


def convert(state: StateDict, config: str, source: Path) -> StateDict:
    """VISSL's trunk state under the target library's names, checked key by key and shape by shape."""
    target = TARGETS[config]
    converted = {target.rename(name): tensor for name, tensor in state.items()}
    expected = target.shapes()
    problems = [f"{name} (not in {target.model})" for name in converted if name not in expected]
    problems += [
        f"{name} has shape {tuple(tensor.shape)}, {target.model} expects {expected[name]}"
        for name, tensor in converted.items()
        if name in expected and tuple(tensor.shape) != expected[name]
    ]
    problems += [f"{name} is missing" for name in expected if name not in converted and name not in target.classifier]
    if problems:
        kind = trunk_kind(state)
        hint = (
            f"it looks like a {kind} trunk: pass --config {kind}"
            if kind and kind != config
            else f"pass the --config it was trained with ({', '.join(TARGETS)}); only their standard "
            "architectures can be exported"
        )
        raise ExportError(
            f"--checkpoint {source}: its trunk does not fit {target.model} for --config {config} "
            f"({len(problems)} problems, first: {'; '.join(problems[:3])}); {hint}"
        )
    return converted


def average_trunks(states: list[StateDict], sources: list[Path]) -> StateDict:
    """The mean of several trunks of one architecture: floating tensors (weights, BatchNorm running mean and
    variance) averaged in float64, other tensors (``num_batches_tracked``) taken from the first."""
    first, first_source = states[0], sources[0]
    for state, source in zip(states[1:], sources[1:], strict=True):
        if state.keys() != first.keys():
            only = sorted(state.keys() ^ first.keys())[:3]
            raise ExportError(
                f"cannot average --checkpoint {first_source} and {source}: their trunks have "
                f"different parameters (e.g. {', '.join(only)}); average only the final checkpoints "
                "of one run's boxes"
            )
        for name, tensor in state.items():
            if tensor.shape != first[name].shape:
                raise ExportError(
                    f"cannot average --checkpoint {first_source} and {source}: {name} has shape "
                    f"{tuple(first[name].shape)} in the first and {tuple(tensor.shape)} in the other; "
                    "average only the final checkpoints of one run's boxes (one config)"
                )
    averaged = {}
    for name, tensor in first.items():
        if tensor.is_floating_point():
            total = sum(state[name].double() for state in states)
            averaged[name] = (total / len(states)).to(tensor.dtype)
        else:
            averaged[name] = tensor.clone()
    return averaged


def export_trunk(checkpoints: list[Path], config: str, out: Path, average: bool = False) -> StateDict:
    """Read, check, (average,) convert and save; return the exported state dict."""
    if config not in TARGETS:
        raise ExportError(
            f"--config {config}: export supports {', '.join(TARGETS)} (the trunks torchvision and "
            "timm have); pass the config the checkpoint was trained with"
        )
    if len(checkpoints) > 1 and not average:
        raise ExportError(f"{len(checkpoints)} checkpoints given: pass one, or --average to average them")
    try:
        sources = [resolve_checkpoint(path) for path in checkpoints]
        states = [load_trunk_state(path) for path in sources]
    except EvalError as error:
        raise ExportError(str(error)) from error
    state = average_trunks(states, sources) if len(states) > 1 else states[0]
    converted = convert(state, config, sources[0])  # the trunks are alike: checking the first checks them all
    out.parent.mkdir(parents=True, exist_ok=True)
    torch.save(converted, out)
    return converted


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument(
        "--checkpoint",
        type=Path,
        nargs="+",
        required=True,
        help="VISSL checkpoint files or peer checkpoint folders (a folder: its checkpoint.torch, "
        "else its newest model_*.torch)",
    )
    parser.add_argument(
        "--config",
        required=True,
        choices=sorted(TARGETS),
        help="the config the trunk was trained with: it decides the target naming",
    )
    parser.add_argument("--out", type=Path, required=True, help="the exported state dict (torch.save)")
    parser.add_argument(
        "--average",
        action="store_true",
        help="average the trunks of several checkpoints (e.g. every box's final checkpoint)",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        state = export_trunk(args.checkpoint, args.config, args.out, args.average)
    except ExportError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    target = TARGETS[args.config]
    print(
        f"wrote {args.out}: {len(state)} tensors in {target.model} naming "
        f"({'average of ' + str(len(args.checkpoint)) + ' checkpoints' if args.average else args.checkpoint[0]}); "
        f"load with strict=False, missing only {', '.join(target.classifier)}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
