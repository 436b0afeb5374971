#!/usr/bin/env python
"""`make gpu-bundle`: everything the GPU check needs besides torch and torchvision, as wheels, in one folder.

Many GPU machines (clusters, rented boxes) have CUDA and torch but no network. This resolves our runtime
requirements for a target Python and x86-64 Linux with pip itself (``pip install --dry-run --report`` with
``--only-binary=:all: --python-version X --platform manylinux2014_x86_64``), downloads those wheels without
the torch stack (torch, torchvision, what only they need: the machine has them), builds the pure-Python
packages that PyPI has as sdists only (``pip wheel --no-deps``), and adds the project's source and
``scripts/gpu_check.sh``. On the GPU machine: ``bash BUNDLE/gpu_check.sh BUNDLE OUT_DIR``.

Big compiled packages that many GPU machines have already (``IF_MISSING``: scipy, 36 MB, in conda environments and
NGC containers) go to ``BUNDLE/wheels_if_missing/``, with what our packages ask of them in
``if_missing_requirements.txt``: ``gpu_check.sh`` installs one only where the machine's own is missing, too old or
does not import. The rest must stay under ``--max-mb``; leave ``wheels_if_missing/`` behind for a machine that has
them.

Usage: python scripts/gpu_bundle.py [--python-version 3.12] [--out gpu_bundle] [--max-mb 60]
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parents[1]
PLATFORM = "manylinux2014_x86_64"
MACHINE_HAS = {"torch", "torchvision"}  # the GPU machine has them, with the packages they need
# in requirements.txt but not imported by a training run (the check): tooling, plots, other commands' needs,
# optional VISSL extras (VISSL imports cv2 and tensorboard only when available and asked for)
NOT_FOR_THE_CHECK = {
    "pytest",
    "pytest-timeout",
    "ruff",
    "matplotlib",
    "tensorboard",
    "opencv-python-headless",
    "pycocotools",
    "submitit",
    "scikit-learn",
}
# hivemind declares grpcio-tools (with grpcio, 8 MB) but only uses it to compile its protobufs when it is built
BUILD_ONLY = {"grpcio-tools"}
IF_MISSING = {"scipy"}  # hivemind's averager and VISSL import it; the machine's own is used when it will do
NO_DEPS = ["vissl==0.1.6"]  # its metadata pins numpy 1.19.5 / scikit-learn 0.24.1 (see the Makefile)
# how pip names a requirement it found no wheel for: directly, or as the cause of a conflict
_MISSING = re.compile(r"No matching distribution found for (\S+)|conflict is caused by:\s+\S+ \S+ depends on (\S+)")


def pip(*args: str, quiet: bool = True) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "pip", *args, *(["-q"] if quiet else [])]
    return subprocess.run(command, capture_output=True, text=True)


def split_requirements() -> tuple[list[str], list[str]]:
    """requirements.txt as (what the check needs from us, what the machine's torch and torchvision must satisfy)."""
    lines = [line.split("#")[0].strip() for line in (REPO / "requirements.txt").read_text().splitlines()]
    names = {line: canonicalize_name(Requirement(line).name) for line in lines if line}
    ours = [line for line, name in names.items() if name not in NOT_FOR_THE_CHECK | MACHINE_HAS]
    return ours, [line for line, name in names.items() if name in MACHINE_HAS]


def target_options(python_version: str) -> list[str]:
    return ["--only-binary=:all:", "--python-version", python_version, "--platform", PLATFORM, "--implementation", "cp"]


def resolve(requirements: list[str], python_version: str, wheels: Path, work: Path) -> list[dict]:
    """pip's resolution for the target (torch included, to know its dependencies); a dependency that PyPI has only
    as an sdist is built into ``wheels`` (pure Python) and the resolution retried."""
    requirements_file = work / "requirements.txt"
    requirements_file.write_text("\n".join(requirements) + "\n")
    built: set[str] = set()
    while True:
        report = work / "report.json"
        result = pip(
            "install",
            "--dry-run",
            "--ignore-installed",
            "--report",
            str(report),
            "--target",
            str(work / "target"),
            "--find-links",
            str(wheels),
            *target_options(python_version),
            "-r",
            str(requirements_file),
            quiet=False,
        )
        if result.returncode == 0:
            return json.loads(report.read_text())["install"]
        missing = _MISSING.search(result.stderr + result.stdout)
        requirement = missing and (missing.group(1) or missing.group(2))
        if not requirement or requirement in built:
            errors = "\n".join(line for line in result.stderr.splitlines() if "is ignored" not in line)
            raise SystemExit(f"pip could not resolve the requirements for Python {python_version}:\n{errors}")
        build_wheel(requirement, wheels)
        built.add(requirement)


def build_wheel(requirement: str, wheels: Path) -> None:
    """An sdist-only dependency: build its wheel here; only a pure-Python one installs on another Python."""
    before = set(wheels.glob("*.whl"))
    result = pip("wheel", "--no-deps", "--wheel-dir", str(wheels), requirement)
    built = set(wheels.glob("*.whl")) - before
    if result.returncode != 0 or not built:
        raise SystemExit(f"cannot build a wheel of {requirement}:\n{result.stderr}")
    for wheel in built:
        if not wheel.name.endswith("-py3-none-any.whl") and not wheel.name.endswith("-py2.py3-none-any.whl"):
            raise SystemExit(f"{requirement} has no wheel for the target and is not pure Python ({wheel.name})")
    print(f"built {', '.join(w.name for w in built)} (PyPI has an sdist only)")


def target_environment(python_version: str) -> dict[str, str]:
    """The environment markers of the GPU machine (``python_version``, x86-64 Linux)."""
    return {
        **default_environment(),
        "python_version": python_version,
        "python_full_version": f"{python_version}.0",
        "sys_platform": "linux",
        "platform_system": "Linux",
        "platform_machine": "x86_64",
        "extra": "",
    }


def runtime_closure(installs: list[dict], python_version: str) -> dict[str, dict]:
    """What our requirements need at run time on the target, without the machine's own packages.

    Walks the dependencies from our requirements, not into torch and torchvision (the machine has them, with
    what they need) nor into BUILD_ONLY; leaves out compiled packages that torch or torchvision need too
    (numpy, pillow: the machine has them), keeps pure-Python ones (tiny; the machine's may be too old)."""
    environment = target_environment(python_version)
    by_name = {canonicalize_name(item["metadata"]["name"]): item for item in installs}

    def requires(name: str) -> set[str]:
        texts = by_name[name]["metadata"].get("requires_dist") or []
        requirements = [Requirement(text) for text in texts]
        return {canonicalize_name(r.name) for r in requirements if r.marker is None or r.marker.evaluate(environment)}

    def closure(roots: set[str], stop: set[str]) -> set[str]:
        seen, todo = set(), [name for name in roots if name in by_name]
        while todo:
            name = todo.pop()
            if name not in seen and name not in stop:
                seen.add(name)
                todo.extend(dep for dep in requires(name) if dep in by_name)
        return seen

    ours = closure({name for name, item in by_name.items() if item.get("requested")}, MACHINE_HAS | BUILD_ONLY)
    machine = closure(MACHINE_HAS, set())
    compiled = {name for name in ours if not by_name[name]["download_info"]["url"].endswith("-none-any.whl")}
    return {name: by_name[name] for name in sorted(ours - (machine & compiled))}


def download(needed: dict[str, dict], python_version: str, wheels: Path) -> None:
    have = {canonicalize_name(w.name.split("-")[0]) for w in wheels.glob("*.whl")}
    for name in have - set(needed):  # built for the resolution only
        for wheel in wheels.glob("*.whl"):
            if canonicalize_name(wheel.name.split("-")[0]) == name:
                wheel.unlink()
    pins = [
        f"{item['metadata']['name']}=={item['metadata']['version']}"
        for name, item in needed.items()
        if name not in have
    ]
    result = pip("download", "--no-deps", "--dest", str(wheels), *target_options(python_version), *pins, *NO_DEPS)
    if result.returncode != 0:
        raise SystemExit(f"pip download failed:\n{result.stderr}")


def requirement_on(name: str, needed: dict[str, dict], python_version: str) -> str:
    """What the packages we install ask of ``name``, as one requirement line (e.g. ``scipy>=1.2.1``)."""
    environment, specifiers = target_environment(python_version), SpecifierSet()
    for item in needed.values():
        for text in item["metadata"].get("requires_dist") or []:
            requirement = Requirement(text)
            if canonicalize_name(requirement.name) == name and (
                requirement.marker is None or requirement.marker.evaluate(environment)
            ):
                specifiers &= requirement.specifier
    return f"{name}{specifiers}"


def set_aside_if_missing(needed: dict[str, dict], python_version: str, out: Path) -> None:
    """Moves the wheels of IF_MISSING to ``out/wheels_if_missing`` and writes what we need of them."""
    aside = out / "wheels_if_missing"
    aside.mkdir()
    names = sorted(IF_MISSING & set(needed))
    for wheel in (out / "wheels").glob("*.whl"):
        if canonicalize_name(wheel.name.split("-")[0]) in names:
            wheel.rename(aside / wheel.name)
    lines = [requirement_on(name, needed, python_version) for name in names]
    (out / "if_missing_requirements.txt").write_text("".join(f"{line}\n" for line in lines))


def folder_mb(path: Path) -> float:
    return sum(file.stat().st_size for file in path.rglob("*") if file.is_file()) / 1e6


def write_source(out: Path) -> None:
    """This checkout's files as they are now (tracked, and new ones git does not ignore), for the machine to run."""
    files = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    )
    with tarfile.open(out / "source.tar.gz", "w:gz") as archive:
        for name in filter(None, files.stdout.split("\0")):
            if (REPO / name).is_file():
                archive.add(REPO / name, arcname=name)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--python-version", default="3.12", help="the GPU machine's Python (major.minor)")
    parser.add_argument("--out", type=Path, default=REPO / "gpu_bundle")
    parser.add_argument(
        "--max-mb",
        type=float,
        default=60.0,
        help="fail if the folder without wheels_if_missing/ is larger (1 MB = 10^6 bytes)",
    )
    args = parser.parse_args(argv)

    if args.out.exists():
        shutil.rmtree(args.out)
    wheels = args.out / "wheels"
    wheels.mkdir(parents=True)
    requirements, machine_requirements = split_requirements()
    with tempfile.TemporaryDirectory() as work:
        installs = resolve(requirements + machine_requirements, args.python_version, wheels, Path(work))
    needed = runtime_closure(installs, args.python_version)
    download(needed, args.python_version, wheels)
    set_aside_if_missing(needed, args.python_version, args.out)
    (args.out / "machine_requirements.txt").write_text("\n".join(machine_requirements) + "\n")
    (args.out / "python_version").write_text(args.python_version + "\n")
    shutil.copy2(REPO / "scripts" / "gpu_check.sh", args.out / "gpu_check.sh")
    write_source(args.out)
    aside = args.out / "wheels_if_missing"
    aside_mb = folder_mb(aside)
    size_mb = folder_mb(args.out) - aside_mb
    largest = sorted(wheels.glob("*.whl"), key=lambda path: -path.stat().st_size)[:5]
    print(
        f"{args.out}: {len(list(wheels.glob('*.whl')))} wheels for Python {args.python_version}, {size_mb:.1f} MB "
        f"(largest: {', '.join(f'{w.name} {w.stat().st_size / 1e6:.1f} MB' for w in largest)})"
    )
    print(
        f"{aside}: {', '.join(w.name for w in sorted(aside.glob('*.whl')))}, {aside_mb:.1f} MB, installed only "
        f"where the machine lacks {(args.out / 'if_missing_requirements.txt').read_text().split()}"
    )
    print(
        f"On the GPU machine: bash {args.out.name}/gpu_check.sh {args.out.name} <output folder> (copy "
        f"{aside.relative_to(args.out.parent)}/ too unless that machine has those packages)"
    )
    if size_mb > args.max_mb:
        print(
            f"error: the bundle is {size_mb:.1f} MB without {aside.name}/, over --max-mb {args.max_mb:.0f}",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
