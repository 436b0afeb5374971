"""The GPU check without a GPU: one clear line and exit 0; the offline script's errors; what the bundle holds."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from scripts.gpu_bundle import runtime_closure, set_aside_if_missing
from tests.conftest import REPO, trainer_env


def test_without_cuda_the_check_says_so_in_one_line_and_exits_0(tmp_path: Path) -> None:
    env = {**trainer_env(), "CUDA_VISIBLE_DEVICES": ""}
    result = subprocess.run(
        [sys.executable, "-m", "scripts.gpu_check", "--out", str(tmp_path)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [result.stdout.strip()] and "no CUDA GPU" in result.stdout
    assert list(tmp_path.iterdir()) == []  # nothing was run, nothing written


def run_script(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(REPO / "scripts" / "gpu_check.sh"), *args], capture_output=True, text=True, env=env, timeout=60
    )


def test_offline_script_rejects_a_folder_that_is_not_a_bundle(tmp_path: Path) -> None:
    result = run_script(str(tmp_path), str(tmp_path / "out"))
    assert result.returncode == 2 and "is not a folder made by make gpu-bundle" in result.stderr
    assert "usage: bash gpu_check.sh BUNDLE_DIR OUT_DIR" in run_script().stderr


def test_offline_script_names_the_python_the_bundle_was_made_for(tmp_path: Path) -> None:
    bundle = tmp_path / "bundle"
    (bundle / "wheels").mkdir(parents=True)
    (bundle / "source.tar.gz").write_bytes(b"")
    (bundle / "python_version").write_text("3.99\n")
    result = run_script(str(bundle), str(tmp_path / "out"), env={**trainer_env(), "PYTHON": sys.executable})
    assert result.returncode == 2
    assert "holds wheels for Python 3.99" in result.stderr and "make gpu-bundle GPU_PYTHON=" in result.stderr


def _install(name: str, requires: list[str], wheel_tag: str = "py3-none-any") -> dict:
    url = f"https://files.example/{name}-1.0-{wheel_tag}.whl"
    return {
        "metadata": {"name": name, "version": "1.0", "requires_dist": requires},
        "download_info": {"url": url},
        "requested": name in {"hivemind", "torch", "torchvision"},
    }


def test_bundle_leaves_out_the_torch_stack_and_build_only_dependencies() -> None:
    compiled = "cp312-cp312-manylinux2014_x86_64"
    installs = [
        _install("torch", ["sympy", "typing-extensions", "nvidia-cudnn-cu12; platform_system == 'Linux'"], compiled),
        _install("torchvision", ["torch", "numpy", "pillow"], compiled),
        _install("hivemind", ["torch", "numpy", "scipy", "grpcio-tools", "pydantic", "uvloop; sys_platform == 'win'"]),
        _install("scipy", ["numpy"], compiled),
        _install("numpy", [], compiled),
        _install("pillow", [], compiled),
        _install("grpcio-tools", ["grpcio"], compiled),
        _install("grpcio", [], compiled),
        _install("pydantic", ["typing-extensions"]),
        _install("typing-extensions", []),
        _install("sympy", []),
        _install("nvidia-cudnn-cu12", [], compiled),
        _install("uvloop", [], compiled),
    ]
    # numpy: compiled and torchvision needs it (the machine has it); typing-extensions: pure Python, kept
    assert sorted(runtime_closure(installs, "3.12")) == ["hivemind", "pydantic", "scipy", "typing-extensions"]


def test_bundle_sets_scipy_aside_with_what_our_packages_ask_of_it(tmp_path: Path) -> None:
    compiled = "cp312-cp312-manylinux2014_x86_64"
    installs = [
        _install("hivemind", ["scipy>=1.2.1", "scipy<1; sys_platform == 'win32'"]),
        _install("torch", [], compiled),
        _install("torchvision", ["torch"], compiled),
        _install("scipy", [], compiled),
    ]
    needed = runtime_closure(installs, "3.12")
    (tmp_path / "wheels").mkdir()
    for name in ("hivemind-1.0-py3-none-any.whl", f"scipy-1.0-{compiled}.whl"):
        (tmp_path / "wheels" / name).write_bytes(b"")
    set_aside_if_missing(needed, "3.12", tmp_path)
    assert [w.name for w in (tmp_path / "wheels").iterdir()] == ["hivemind-1.0-py3-none-any.whl"]
    assert [w.name for w in (tmp_path / "wheels_if_missing").iterdir()] == [f"scipy-1.0-{compiled}.whl"]
    assert (tmp_path / "if_missing_requirements.txt").read_text() == "scipy>=1.2.1\n"  # the win32 marker is not ours


def test_offline_script_uses_the_machines_scipy_and_names_a_missing_package_without_its_wheel(tmp_path: Path) -> None:
    bundle = tmp_path / "bundle"
    (bundle / "wheels").mkdir(parents=True)
    (bundle / "source.tar.gz").write_bytes(b"")
    (bundle / "python_version").write_text(f"{sys.version_info.major}.{sys.version_info.minor}\n")
    (bundle / "machine_requirements.txt").write_text("torch>=2\n")
    (bundle / "if_missing_requirements.txt").write_text("scipy>=1.2.1\nno-such-package-here>=1\n")
    result = run_script(str(bundle), str(tmp_path / "out"), env={**trainer_env(), "PYTHON": sys.executable})
    assert result.returncode == 2, result.stderr
    assert "using this machine's torch" in result.stderr and "using this machine's scipy" in result.stderr
    assert "no usable no-such-package-here" in result.stderr and "copy the bundle's wheels_if_missing/" in result.stderr
