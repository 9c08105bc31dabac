# Sourced by bench/gpu_check.sh (never run alone). Installs the carried wheels, sets the
# environment, prints the machine header, and gives the helpers the check uses.
# Knobs (environment): OUT (required), GPU_DRY=1 (CPU dry run), GPU_SITE (wheel target,
# default /tmp/site), GPU_WHL (wheel folder, default .whl at the repository's root; made by
# bench/gpu/fetch_wheels.sh). Where no wheel folder exists, nothing is installed (a CPU dry run
# in the project's venv needs none).

G="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"   # bench/gpu
ROOT="$(cd "$G/../.." && pwd)"                       # the repository
: "${OUT:?set OUT to an empty output folder}"
mkdir -p "$OUT"
DRY=${GPU_DRY:-0}
SITE=${GPU_SITE:-/tmp/site}
WHL=${GPU_WHL:-$ROOT/.whl}
T_START=$(date +%s)
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 \
  TOKENIZERS_PARALLELISM=false TRANSFORMERS_VERBOSITY=error HF_HUB_DISABLE_TELEMETRY=1 \
  WANDB_DISABLED=true WANDB_MODE=disabled DISABLE_MLFLOW_INTEGRATION=TRUE
SUMMARY_ROWS=()

elapsed() { echo $(( $(date +%s) - T_START )); }
# row CHECK RESULT SECONDS NOTES: one line of the final markdown table (pipes escaped)
row() {
  local a=("$@") i
  for i in "${!a[@]}"; do a[$i]="${a[$i]//|/\\|}"; a[$i]="${a[$i]//$'\n'/ }"; done
  SUMMARY_ROWS+=("| ${a[0]} | ${a[1]} | ${a[2]:-} | ${a[3]:-} |")
}
# section TITLE: a header in the full log and on stdout
section() { echo; echo "===== [$(elapsed)s] $* ====="; }
# budget CAP RESERVE: CAP, or less so that RESERVE seconds stay before the script's own limit
budget() {
  local cap=$1 reserve=$2 left
  left=$(( SCRIPT_LIMIT - $(elapsed) - reserve ))
  (( left < cap )) && cap=$left
  (( cap < 0 )) && cap=0
  echo "$cap"
}
# gpu_sampler FILE: samples total GPU memory used (MiB) and utilisation (%) every 0.5 s
# into FILE until killed; prints the sampler's pid. No-op (no pid) without nvidia-smi.
gpu_sampler() {
  command -v nvidia-smi >/dev/null 2>&1 || return 0
  nvidia-smi --query-gpu=memory.used,utilization.gpu --format=csv,noheader,nounits -lms 500 >"$1" 2>/dev/null &
  echo $!
}
# gpu_peak FILE: "peak MiB / max util %" from a sampler file
gpu_peak() {
  [ -s "$1" ] || { echo "n/a"; return; }
  awk -F', *' '{if($1>m)m=$1; if($2>u)u=$2} END{printf "%d MiB / %d%%", m, u}' "$1"
}
stop_pid() { [ -n "${1:-}" ] && kill "$1" 2>/dev/null; wait "$1" 2>/dev/null; true; }

section "install carried wheels into $SITE"
t0=$(date +%s)
EXTRA_WHL=()
# pydantic 2.14 needs typing_extensions >= 4.16; carry it only where the image's is older.
if ! python3 -c 'import importlib.metadata as m,sys; v=tuple(int(x) for x in m.version("typing_extensions").split(".")[:2]); sys.exit(v < (4, 16))' 2>/dev/null; then
  echo "image's typing_extensions is older than 4.16: installing the carried one too"
  EXTRA_WHL=("$WHL"/extra/typing_extensions-*.whl)
fi
if [ "$DRY" != 1 ] && compgen -G "$WHL/*.whl" >/dev/null; then
  timeout -k 5 120 python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$SITE" "$WHL"/*.whl "${EXTRA_WHL[@]}" >/tmp/gpu_pip.log 2>&1
  PIP_RC=$?
else
  echo "no wheels in $WHL (or a dry run): nothing to install" >/tmp/gpu_pip.log; PIP_RC=0
fi
grep -v -i "target directory" /tmp/gpu_pip.log | tail -n 15
echo "pip install exit $PIP_RC"
export PYTHONPATH="$ROOT/src:$SITE:$ROOT:$G${PYTHONPATH:+:$PYTHONPATH}"
# Tests start subprocesses with PYTHONPATH=src alone: a .pth puts the wheels on every
# interpreter's path (first, so a carried typing_extensions wins).
SP=$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
if [ ! -d "$SITE" ]; then
  echo "no $SITE: no .pth written"
elif printf 'import sys; p = %s; p in sys.path or sys.path.insert(0, p)\n' "'$SITE'" >"$SP/zz_gpu_site.pth" 2>/dev/null; then
  echo "wrote $SP/zz_gpu_site.pth"
else
  echo "WARNING: could not write a .pth into $SP: tests that reset PYTHONPATH will not find pydantic"
fi
# `loomrl` on PATH without installing the project
mkdir -p /tmp/gpubin
printf '#!/bin/sh\nexec python3 -m loomrl.cli "$@"\n' >/tmp/gpubin/loomrl && chmod +x /tmp/gpubin/loomrl
export PATH="/tmp/gpubin:$PATH"
IMPORTS=$(timeout -k 5 120 python3 - 2>&1 <<'EOF'
import importlib, importlib.metadata as m
bad = []
for mod in ["pydantic", "pydantic_core", "zstandard", "tensorboardX", "datasets", "trl", "loomrl.config", "loomrl.job"]:
    try:
        importlib.import_module(mod)
    except Exception as err:  # report and go on: the steps that need it will fail visibly
        bad.append(f"{mod}: {type(err).__name__}: {err}")
try:
    from trl import GRPOConfig, GRPOTrainer  # noqa: F401
except Exception as err:
    bad.append(f"trl.GRPOTrainer: {type(err).__name__}: {err}")
vers = []
for d in ["pydantic", "zstandard", "tensorboardX", "datasets", "trl", "dill", "multiprocess", "typing_extensions",
          "pyarrow", "fsspec", "huggingface_hub", "accelerate", "peft", "tokenizers", "safetensors",
          "pytest", "pytest-xdist", "pytest-timeout", "hypothesis", "uvloop", "numpy"]:
    try:
        vers.append(f"{d} {m.version(d)}")
    except Exception:
        vers.append(f"{d} MISSING")
print("versions: " + ", ".join(vers))
print("imports: " + ("ok" if not bad else "FAILED: " + " ; ".join(bad)))
EOF
)
echo "$IMPORTS"
IMPORT_STATUS=$(echo "$IMPORTS" | grep '^imports:' | sed 's/^imports: //')
row "install + imports (pydantic, zstandard, tensorboardX, datasets, trl, loomrl)" "pip exit $PIP_RC; imports ${IMPORT_STATUS:-no answer}" "$(( $(date +%s) - t0 ))" "$(echo "$IMPORTS" | grep '^versions:' | cut -c11-900)"

section "machine"
nvidia-smi -L 2>&1 || echo "(no nvidia-smi here)"
echo "cpus: $(nproc), $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2); memory: $(free -g | awk '/Mem:/ {print $2 " GiB"}')"
echo "/dev/shm: $(df -h /dev/shm 2>/dev/null | tail -1 | awk '{print $2 " size, " $4 " free"}'); /tmp: $(df -h /tmp | tail -1 | awk '{print $4 " free"}')"
HEADER=$(timeout -k 5 90 python3 -c '
import torch, transformers
ok = torch.cuda.is_available()
name = torch.cuda.get_device_name(0) if ok else "-"
print(f"torch {torch.__version__} (cuda {torch.version.cuda}), transformers {transformers.__version__}, "
      f"cuda available {ok}, device {name}, bf16 {ok and torch.cuda.is_bf16_supported()}")
' 2>&1 | tail -1)
echo "$HEADER"
GPU_LINE=$(nvidia-smi -L 2>/dev/null | head -1 | cut -c1-70)
row "machine" "${GPU_LINE:-no GPU (nvidia-smi absent)}" "" "$HEADER; $(nproc) CPUs; /dev/shm $(df -h /dev/shm 2>/dev/null | tail -1 | awk '{print $2}')"
if [ "$DRY" != 1 ] && ! echo "$HEADER" | grep -q "cuda available True"; then
  echo "WARNING: torch sees no CUDA device; the GPU steps below will fail or fall back to the CPU"
fi

# print_summary FILE TITLE [NOTES]: NOTES (markdown) then the table, to FILE and stdout;
# the table comes last, so the end of the output always holds it.
print_summary() {
  {
    echo "## $2"
    echo
    if [ -n "${3:-}" ]; then echo "$3"; echo; fi
    echo "| check | result | s | notes |"
    echo "| --- | --- | --- | --- |"
    printf '%s\n' "${SUMMARY_ROWS[@]}"
    echo
    echo "total wall: $(elapsed) s (dry run: $DRY)"
  } >"$1"
  echo
  cat "$1"
}
