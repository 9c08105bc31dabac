#!/usr/bin/env bash
# Downloads, on a machine with PyPI, the wheels that bench/gpu_check.sh installs on a GPU
# machine that can download nothing (its image has torch, transformers, accelerate, peft and
# pytest-xdist, but not these). Python 3.12, manylinux x86-64, no dependencies resolved: the
# list below is complete for that image. Into .whl/ at the repository's root (git-ignored).
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${GPU_PY_VERSION:-3.12}
DEST=${1:-.whl}
mkdir -p "$DEST/extra"
WHEELS=(
  pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.7.0 typing-inspection==0.4.2
  zstandard==0.25.0 tensorboardX==2.6.5 trl==1.16.0 datasets==5.0.1 dill==0.4.1 multiprocess==0.70.19
)
get() {
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PY" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$@"
}
get "$DEST" "${WHEELS[@]}"
get "$DEST/extra" typing_extensions==4.16.0   # installed only where the image's is older
ls -la "$DEST" "$DEST/extra"
