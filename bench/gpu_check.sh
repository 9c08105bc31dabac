#!/usr/bin/env bash
# The GPU check anyone can run: one script, one GPU, nothing to download. Prints one table.
#
#   OUT=/some/empty/folder bash bench/gpu_check.sh          # on a machine with one CUDA GPU
#   OUT=/tmp/gpu_dry bash bench/gpu_check.sh --dry          # a CPU dry run of every step
#
# Python packages the GPU machine lacks travel as wheels in .whl/ at the repository's root
# (made on a machine with PyPI by `bash bench/gpu/fetch_wheels.sh`); they are installed into
# /tmp/site first. Steps, each capped so the whole script ends inside its limit:
#   1. the default pytest suite on CUDA (model.device=auto), under pytest-xdist, while the
#      arithmetic demo's warm-start trains on the CPU beside it; then the demo on CUDA;
#   2. the side-by-side with TRL's GRPOTrainer on a 362M Qwen2 built from a config
#      (bench/gpu/side_by_side.py): TRL's default precision and TRL with bf16 weights as the
#      baselines, loomrl async on `local` and `process` with its CUDA defaults;
#   3. the HF engine's variants (bench/hf_engine.py) and the weight lanes (bench/weight_sync.py)
#      on the same model size, the trainer's step memory (bench/trainer_memory.py), colocated
#      generation and training on one device (bench/colocate.py: CUDA memory, turn cost),
#      quantized generation (bench/quantized.py: none, int8 and fp8 tokens/s and memory);
#   4. vLLM, where it is installed ("skipped: vllm not installed" where not).
# Writes $OUT/summary.md (the table), $OUT/full.log (the console) and per-step JSON; prints the
# table last. Knobs (environment): GPU_LIMIT (the whole script's seconds, default 540),
# PYTEST_WORKERS (default 12), GPU_SYSTEMS (the side-by-side's systems, in order).
set -u
[ "${1:-}" = "--dry" ] && export GPU_DRY=1
: "${OUT:?set OUT to an empty output folder}"
mkdir -p "$OUT"
SCRIPT_LIMIT=${GPU_LIMIT:-$([ "${GPU_DRY:-0}" = 1 ] && echo 900 || echo 540)}
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# A dry run on the CPU uses a venv with the bench extra (trl, datasets) and pytest-xdist:
# GPU_VENV, default the project's .venv (`make install` and `.venv/bin/pip install -c
# constraints-cpu.txt -e '.[bench]' pytest-xdist`).
VENV=${GPU_VENV:-$HERE/../.venv}
if [ "${GPU_DRY:-0}" = 1 ] && [ -x "$VENV/bin/python" ]; then
  export PATH="$VENV/bin:$PATH"
fi

main() {
source "$HERE/gpu/common.sh"
cd "$ROOT" || exit 1
L=/tmp/gpu_check_logs; RES=/tmp/gpu_check_res; M=/tmp/gpu_check_model
rm -rf "$L" "$RES" "$M" /tmp/gpu_check_demo /tmp/gpu_check_ws; mkdir -p "$L" "$RES"
FAILS=()
if [ "$DRY" = 1 ]; then
  DEVICE=cpu; WORKERS=${PYTEST_WORKERS:-2}; SIZE=dry; BUILD_ARGS=--dry
  PYTEST_SEL=${GPU_PYTEST_SEL:-tests/test_generation.py tests/test_config.py tests/test_sandbox_hostile.py}
  CAP_PYTEST=300; CAP_SYS=150; CAP_BENCH=120; CAP_DEMO=120; DEMO_STEPS=10; WS_ARGS="--steps 10 --target-accuracy 0"
  SYSTEMS=${GPU_SYSTEMS:-trl-bf16 loomrl-local loomrl-process}
else
  DEVICE=cuda; WORKERS=${PYTEST_WORKERS:-12}; SIZE=full; BUILD_ARGS=
  PYTEST_SEL=${GPU_PYTEST_SEL:-}
  CAP_PYTEST=130; CAP_SYS=45; CAP_BENCH=40; CAP_DEMO=35; DEMO_STEPS=300; WS_ARGS=""
  SYSTEMS=${GPU_SYSTEMS:-trl-bf16 loomrl-local trl-bf16w loomrl-process}
fi

# -- 1. the default suite on the device ----------------------------------------------------
if [ -z "$PYTEST_SEL" ]; then
  # the files that put models and tensors on the device first, the sandbox files (CPU) last
  ORDER=()
  for f in generation generation_static precision chunked_logprobs shared_prefix trainer_metrics controller job \
           runtime_process checkpoints weights_transports weights_publisher weights_shm_files golden_sync \
           sync_versions faults; do
    [ -f "tests/test_$f.py" ] && ORDER+=("tests/test_$f.py")
  done
  for f in tests/test_*.py; do
    case " ${ORDER[*]} " in *" $f "*) continue ;; esac
    case $f in tests/test_sandbox_*) continue ;; esac
    ORDER+=("$f")
  done
  for f in tests/test_sandbox_*.py; do ORDER+=("$f"); done
  PYTEST_SEL="${ORDER[*]}"
fi
# The demo's warm-start (supervised, CPU only) trains beside the suite; a copy made on another
# machine in .cache/arithmetic-warmstart (carried) is the fallback.
WS=/tmp/gpu_check_ws
# shellcheck disable=SC2086
( OMP_NUM_THREADS=2 timeout -k 5 "$(budget 125 250)" python3 -m examples.arithmetic.warmstart --out "$WS" $WS_ARGS \
    >"$L/warmstart.log" 2>&1; echo $? >"$L/warmstart.rc" ) &
WS_PID=$!
(cd "$ROOT" && python3 -c 'import xdist' 2>/dev/null) && XDIST=(-n "$WORKERS") || XDIST=()
cap=$(budget "$CAP_PYTEST" 200)
section "pytest ${XDIST[*]} on $DEVICE (cap ${cap}s): $(echo $PYTEST_SEL | wc -w) files"
t0=$(date +%s)
SMP=$(gpu_sampler "$L/gpu_pytest.csv")
# shellcheck disable=SC2086
# the default suite and the gpu-marked tests (pyproject's addopts leave those out)
OMP_NUM_THREADS=2 timeout -s INT -k 20 "$cap" python3 -m pytest -q -p no:cacheprovider "${XDIST[@]}" \
  -m "not slow and not ray and not vllm" \
  --timeout=90 -rfE --junitxml="$OUT/junit.xml" $PYTEST_SEL >"$L/pytest.log" 2>&1
rc=$?
stop_pid "$SMP"
dt=$(( $(date +%s) - t0 ))
tail -n 15 "$L/pytest.log"
PYRES=$(python3 "$HERE/gpu/junit_summary.py" "$OUT/junit.xml" "$L/pytest.log")
res=$(echo "$PYRES" | grep '^RESULT' | cut -c8-)
row "pytest ${XDIST[*]} on $DEVICE ($(echo $PYTEST_SEL | wc -w) files)" "$res" "$dt" \
  "exit $rc$( { [ "$rc" = 124 ] || [ "$rc" = 130 ]; } && echo ' (stopped at the cap)'); GPU $(gpu_peak "$L/gpu_pytest.csv")"
while IFS= read -r f; do [ -n "$f" ] && FAILS+=("- ${f#FAIL }"); done < <(echo "$PYRES" | grep '^FAIL')
cp "$L/pytest.log" "$OUT/pytest.log" 2>/dev/null

# -- the arithmetic demo on the device -----------------------------------------------------
wait "$WS_PID" 2>/dev/null
if [ -f "$WS/config.json" ]; then WS_USE=$WS; ws_note="warm-start built here ($(grep -o '[0-9.]*% on held-out' "$L/warmstart.log" | tail -1))"
elif [ -f .cache/arithmetic-warmstart/config.json ]; then WS_USE=.cache/arithmetic-warmstart; ws_note="the carried warm-start (.cache)"
else WS_USE=""; ws_note="no warm-start (exit $(cat "$L/warmstart.rc" 2>/dev/null)): demo skipped"; fi
if [ -n "$WS_USE" ]; then
  cap=$(budget "$CAP_DEMO" 190)
  section "demo: examples/arithmetic/job.toml on $DEVICE, $DEMO_STEPS steps (cap ${cap}s)"
  t0=$(date +%s)
  SMP=$(gpu_sampler "$L/gpu_demo.csv")
  COLUMNS=160 timeout -s INT -k 10 "$cap" python3 -m loomrl.cli run examples/arithmetic/job.toml "model.path=$WS_USE" \
    "model.device=$DEVICE" "trainer.num_steps=$DEMO_STEPS" "eval.every_steps=$(( DEMO_STEPS / 3 > 0 ? DEMO_STEPS / 3 : 1 ))" \
    --output-dir /tmp/gpu_check_demo >"$L/demo.log" 2>&1
  rc=$?
  stop_pid "$SMP"
  tail -n 6 "$L/demo.log"
  row "demo (arithmetic, async, local) on $DEVICE" "exit $rc$( { [ "$rc" = 124 ] || [ "$rc" = 130 ]; } && echo ' (stopped at the cap)')" \
    "$(( $(date +%s) - t0 ))" "$ws_note; $(python3 "$HERE/gpu/demo_summary.py" /tmp/gpu_check_demo 2>&1 | tail -1); GPU $(gpu_peak "$L/gpu_demo.csv")"
  cp "$L/demo.log" "$OUT/demo.log" 2>/dev/null
else
  row "demo (arithmetic) on $DEVICE" "skipped" "" "$ws_note"
fi

# -- 2. the side-by-side with TRL ------------------------------------------------------------
B="python3 $HERE/gpu/side_by_side.py"
section "build the 362M model, tokenizer and prompts"
t0=$(date +%s)
timeout -k 5 "$(budget 60 150)" $B build --out "$M" $BUILD_ARGS >"$L/build.log" 2>&1
rc=$?
tail -n 3 "$L/build.log"
row "build the model (random weights) + BPE tokenizer + prompts" "exit $rc" "$(( $(date +%s) - t0 ))" \
  "$(grep '^built' "$L/build.log" | cut -c1-200)"
if [ "$rc" = 0 ]; then
  for SYS in $SYSTEMS; do
    cap=$(budget "$CAP_SYS" 110)
    if (( cap < 25 )); then row "$SYS" "skipped" "" "${cap}s left in the script's budget"; continue; fi
    section "$SYS (cap ${cap}s)"
    case $SYS in
      trl-bf16)  CMD=($B trl --model "$M" --precision bf16 --name "$SYS" --res-dir "$RES") ;;
      trl-bf16w) CMD=($B trl --model "$M" --precision bf16w --name "$SYS" --res-dir "$RES") ;;
      trl-fp32)  CMD=($B trl --model "$M" --precision fp32 --name "$SYS" --res-dir "$RES") ;;
      loomrl-local)   CMD=($B loomrl --model "$M" --runtime local --name "$SYS" --res-dir "$RES") ;;
      loomrl-process) CMD=($B loomrl --model "$M" --runtime process --name "$SYS" --res-dir "$RES") ;;
      loomrl-local-fp32) CMD=($B loomrl --model "$M" --runtime local --name "$SYS" --res-dir "$RES"
                              model.dtype=float32 trainer.precision=fp32) ;;
      *) row "$SYS" "unknown system" "" ""; continue ;;
    esac
    t0=$(date +%s)
    SMP=$(gpu_sampler "$RES/$SYS.gpu.csv")
    sleep 0.6   # one sample of the idle GPU first: the memory rise is measured from it
    timeout -s INT -k 10 "$cap" "${CMD[@]}" >"$L/$SYS.log" 2>&1
    rc=$?
    stop_pid "$SMP"
    dt=$(( $(date +%s) - t0 ))
    grep '\[bench\]' "$L/$SYS.log" | tail -n 6
    err=""
    [ "$rc" != 0 ] && err="last lines: $(grep -v '^\s*$' "$L/$SYS.log" | grep -v '\[bench\]' | tail -n 3 | cut -c1-250 | tr '\n' ' ')"
    row "$SYS" "exit $rc$( { [ "$rc" = 124 ] || [ "$rc" = 130 ]; } && echo ' (stopped at the cap)')" "$dt" "$err"
    cp "$L/$SYS.log" "$OUT/$SYS.log" 2>/dev/null
  done
  TABLE=$(timeout -k 5 30 $B report --res-dir "$RES" --model "$M" 2>&1)
  cat "$RES"/*.json >"$OUT/side_by_side.json" 2>/dev/null
else
  TABLE="(no side-by-side: the build failed: $(tail -n 3 "$L/build.log" | tr '\n' ' ' | cut -c1-400))"
fi

# -- 3. the engine, the weight lanes, the trainer's memory and colocation on their own ------
for BENCH in hf_engine weight_sync trainer_memory colocate quantized; do
  case $BENCH in hf_engine|trainer_memory) cap0=$(( CAP_BENCH + 20 )) ;; *) cap0=$CAP_BENCH ;; esac
  cap=$(budget "$cap0" 15)
  if [ ! -f "bench/$BENCH.py" ] || (( cap < 15 )); then row "bench/$BENCH.py" "skipped" "" "missing or ${cap}s left"; continue; fi
  section "bench/$BENCH.py --size $SIZE --device $DEVICE (cap ${cap}s)"
  t0=$(date +%s)
  case $BENCH in
    weight_sync) ARGS=(--lane tensor --size "$([ "$SIZE" = dry ] && echo small || echo full)") ;;
    trainer_memory) ARGS=(--layers "$([ "$SIZE" = dry ] && echo 1 || echo 24)") ;;
    colocate) ARGS=(--steps 4 $([ "$SIZE" = dry ] && echo --hidden 256 --layers 2)) ;;
    quantized) ARGS=(--repeats 1 --models $([ "$SIZE" = dry ] && echo demo || echo 138m --new-tokens 64)) ;;
    *) ARGS=(--size "$SIZE") ;;
  esac
  [ "$BENCH" != trainer_memory ] && ARGS+=(--json "$OUT/$BENCH.json")  # (colocate: its rows)
  timeout -s INT -k 10 "$cap" python3 "bench/$BENCH.py" "${ARGS[@]}" --device "$DEVICE" \
    >"$L/$BENCH.log" 2>&1
  rc=$?
  tail -n 14 "$L/$BENCH.log"
  cp "$L/$BENCH.log" "$OUT/$BENCH.log" 2>/dev/null
  row "bench/$BENCH.py --size $SIZE" "exit $rc" "$(( $(date +%s) - t0 ))" "table in $BENCH.log"
done

# -- 4. vLLM ----------------------------------------------------------------------------------
# The engine's tests (parity with transformers after full and delta updates, no stale prefix
# cache, refused corrupted updates, sleep and wake, the AsyncLLM engine; a colocated job),
# bench/engines.py (tokens/s of HF and vLLM, update times) and vLLM's fp8 (test_vllm_quant.py).
if python3 -c 'import vllm' >/dev/null 2>&1; then
  cap=$(budget "$CAP_BENCH" 10)
  section "vLLM: tests/test_vllm_engine.py (cap ${cap}s)"
  t0=$(date +%s)
  timeout -s INT -k 10 "$cap" python3 -m pytest -q -p no:cacheprovider -m "vllm and not slow" \
    --timeout=120 -rfE tests/test_vllm_engine.py tests/test_vllm_async.py \
    tests/test_vllm_job.py::test_a_colocated_job_stops_the_vllm_engine_while_the_trainer_steps \
    >"$L/vllm_tests.log" 2>&1
  rc=$?
  tail -n 5 "$L/vllm_tests.log"
  cp "$L/vllm_tests.log" "$OUT/vllm_tests.log" 2>/dev/null
  row "vLLM engine tests ($(python3 -c 'import vllm; print(vllm.__version__)' 2>/dev/null))" "exit $rc" \
    "$(( $(date +%s) - t0 ))" "$(grep -E 'passed|failed' "$L/vllm_tests.log" | tail -1)"
  cap=$(budget "$CAP_BENCH" 5)
  section "vLLM: bench/engines.py on $DEVICE (cap ${cap}s)"
  t0=$(date +%s)
  if [ "$DEVICE" = cuda ]; then ENGINE_ARGS=(--device cuda --model "tiny:qwen2?hidden_size=896&num_layers=24&num_heads=14&intermediate_size=4864" --prompts 32 --new-tokens 128)
  else ENGINE_ARGS=(--prompts 8 --samples 4 --new-tokens 8 --repeats 2); fi
  timeout -s INT -k 10 "$cap" python3 bench/engines.py "${ENGINE_ARGS[@]}" >"$L/engines.log" 2>&1
  rc=$?
  grep '^|' "$L/engines.log"
  cp "$L/engines.log" "$OUT/engines.log" 2>/dev/null
  row "bench/engines.py (HF vs vLLM)" "exit $rc" "$(( $(date +%s) - t0 ))" "$(grep '^| vllm' "$L/engines.log" | tail -1)"
  # generation.engine.quantize='fp8' on vLLM (its online fp8_per_channel): weights follow full and
  # delta updates through the layerwise reload, log-probs the fp8 model's; three eager
  # in-process engines (the AsyncLLM one and the two jobs left to make test-vllm), with what
  # the budget has left.
  cap=$(budget 75 5)
  if (( cap >= 30 )); then
    section "vLLM: tests/test_vllm_quant.py, fp8 (cap ${cap}s)"
    t0=$(date +%s)
    timeout -s INT -k 10 "$cap" python3 -m pytest -q -p no:cacheprovider -m "vllm and not slow" \
      --timeout=120 -rfE -k "not async and not job_trains" tests/test_vllm_quant.py >"$L/vllm_quant.log" 2>&1
    rc=$?
    tail -n 5 "$L/vllm_quant.log"
    cp "$L/vllm_quant.log" "$OUT/vllm_quant.log" 2>/dev/null
    row "vLLM fp8 tests (tests/test_vllm_quant.py)" "exit $rc" "$(( $(date +%s) - t0 ))" \
      "$(grep -E 'passed|failed' "$L/vllm_quant.log" | tail -1)"
  else
    row "vLLM fp8 tests (tests/test_vllm_quant.py)" "skipped" "" "${cap}s left in the script's budget"
  fi
else
  row "vLLM engine" "skipped: vllm not installed" "" ""
fi

FAILS_TEXT=""
if [ ${#FAILS[@]} -gt 0 ]; then
  FAILS_TEXT=$(printf '### failed tests (first lines; all of them in junit.xml and pytest.log)\n\n'; printf '%s\n' "${FAILS[@]}" | head -20 | cut -c1-300)
fi
for BENCH in hf_engine weight_sync trainer_memory engines; do
  [ -f "$L/$BENCH.log" ] && FAILS_TEXT+=$'\n\n'"### bench/$BENCH.py"$'\n\n'"$(grep '^|' "$L/$BENCH.log" | tail -n 12)"
done
FAILS_TEXT+=$'\n\n'"### side by side with TRL"$'\n\n'"$TABLE"
print_summary "$OUT/summary.md" "GPU check: loomrl on $DEVICE" "$FAILS_TEXT"
}
main 2>&1 | tee "$OUT/full.log" | grep -v '^\[bench\]'
