#!/usr/bin/env bash
# The GPU check (scripts/gpu_check.py) on a machine with CUDA and torch but no network and none of our other
# packages: installs the folder that `make gpu-bundle` made (wheels of everything but torch and torchvision, and
# the project's source) into a fresh virtual environment on top of this machine's own torch, runs the check,
# and leaves gpu_check.json and gpu_check.md in OUT_DIR. Without a CUDA GPU the check says so and exits 0.
# The wheels in BUNDLE_DIR/wheels_if_missing (scipy) are installed only where this machine's own package is
# missing, too old or does not import: for a machine that has them, copying the bundle without that folder is enough.
#
#   bash gpu_check.sh BUNDLE_DIR OUT_DIR [gpu_check.py options]
#   PYTHON=/opt/conda/bin/python bash gpu_check.sh BUNDLE_DIR OUT_DIR   # the Python that has torch (default python3)
#   bash gpu_check.sh BUNDLE_DIR OUT_DIR --cpu_smoke    # on a CPU: the whole code path with swav_tiny
set -euo pipefail

usage="usage: bash gpu_check.sh BUNDLE_DIR OUT_DIR [gpu_check.py options] (PYTHON=... picks the Python that has \
torch; default python3)"
fail() { echo "gpu_check.sh: $*" >&2; exit 2; }

[[ $# -ge 2 ]] || fail "$usage"
[[ -d $1/wheels && -f $1/source.tar.gz && -f $1/python_version ]] || fail "$1 is not a folder made by make gpu-bundle"
bundle=$(cd "$1" && pwd)
mkdir -p "$2"
out=$(cd "$2" && pwd)
python=${PYTHON:-python3}
command -v "$python" >/dev/null || fail "no $python here: set PYTHON to the Python that has torch"

want=$(cat "$bundle/python_version")
have=$("$python" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
[[ $have == "$want" ]] || fail "the bundle holds wheels for Python $want but $python is Python $have: \
make one with make gpu-bundle GPU_PYTHON=$have"

# The names of the requirements in file $1 that this Python does not meet (checked with pip's own packaging),
# one per line; with --import a package that is installed but does not import (built for another numpy) is unmet.
unmet() {
    "$python" - "$@" <<'EOF'
import importlib
import sys
from importlib.metadata import PackageNotFoundError, version

from pip._vendor.packaging.requirements import Requirement

for line in open(sys.argv[1]).read().split("\n"):
    if not line.strip():
        continue
    requirement = Requirement(line)
    try:
        installed = version(requirement.name)
        if not requirement.specifier.contains(installed, prereleases=True):
            raise LookupError(f"{requirement.name} {installed} is installed, the project needs {requirement}")
        if "--import" in sys.argv:
            importlib.import_module(requirement.name.replace("-", "_"))
    except PackageNotFoundError:
        print(f"gpu_check.sh: {requirement.name} is not installed in {sys.executable}", file=sys.stderr)
        print(requirement.name)
    except Exception as error:
        print(f"gpu_check.sh: {error}", file=sys.stderr)
        print(requirement.name)
    else:
        print(f"gpu_check.sh: using this machine's {requirement.name} {installed}", file=sys.stderr)
EOF
}

# this machine's torch and torchvision, in versions our requirements allow
missing=$(unmet "$bundle/machine_requirements.txt") || fail "cannot check $python's packages (see above)"
[[ -z $missing ]] || fail "this Python needs torch and torchvision (see above)"
# the machine's scipy where it will do, else the bundle's
wheels=("$bundle"/wheels/*.whl)
if [[ -f $bundle/if_missing_requirements.txt ]]; then
    missing=$(unmet "$bundle/if_missing_requirements.txt" --import) || fail "cannot check $python's packages"
    for name in $missing; do
        found=("$bundle"/wheels_if_missing/"${name//-/_}"-*.whl)
        [[ -e ${found[0]} ]] || fail "this machine has no usable $name and $bundle/wheels_if_missing/ holds no \
wheel of it: copy the bundle's wheels_if_missing/ folder too, or install $name into $python"
        echo "gpu_check.sh: installing $name from the bundle"
        wheels+=("${found[@]}")
    done
fi

work=$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX")
echo "gpu_check.sh: installing the bundle into $work/venv"
"$python" -m venv --without-pip "$work/venv"
venv_python=$work/venv/bin/python
site_packages=$("$venv_python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
# the machine's own site-packages (torch, torchvision, numpy, pip...) after ours: a .pth file, which works whether
# that Python is a system one, a conda env or another virtual environment
"$python" -c 'import sys; print("\n".join(p for p in sys.path if p.endswith(("site-packages", "dist-packages"))))' \
    > "$site_packages/machine_site_packages.pth"
"$venv_python" -m pip install --quiet --no-index --no-deps --ignore-installed --no-warn-script-location \
    "${wheels[@]}"

mkdir -p "$work/source"
tar -xzf "$bundle/source.tar.gz" -C "$work/source"
echo "gpu_check.sh: running the GPU check (logs in $work/run)"
cd "$work/source"
"$venv_python" -m scripts.gpu_check --out "$out" --work_dir "$work/run" "${@:3}"
