#!/usr/bin/env bash
# One command for a short GPU window (one H100 or H200, under 9 minutes): every figure the project has not yet
# measured on a GPU, each section under its own time limit, written with the GPU, driver and versions into
# bench/results/<gpu>_<date>/ (or $GPU_MEASURE_OUT; the CPU rehearsal: a scratch folder). Sections, in order of value:
#   ring     bench/ring_decomposition.py: the ring's per-rank kernel schedule vs one whole-sequence call (16K, 64K)
#   claim    bench/one_gpu_claim.py: the planner's one-GPU plan for Llama-3.1-8B at 1M tokens and at the longest length
#            it finds, a real layer of it run with the other layers' model state held, under an 80 GiB cap
#   ab       bench/attention_ab.py: a ~1.5B Llama trained 20 steps at 2K tokens with Megatron's attention and with ours,
#            same seed/data/optimizer: losses side by side, tokens/s, MFU (Megatron's local attention keeps the
#            [heads, s, s] scores, so 8K does not fit a 141 GiB GPU)
#   app      `nemo-longctx train`: the NeMo 2 app on the GPU (the ~1.5B Llama shape, bf16, 20 steps at 8K tokens);
#            needs NeMo 2 importable (the NGC container, or the carried wheels: scripts/gpu_wheels.sh)
#   calib    bench/max_seqlen.py --peak-breakdown: what is live at the CUDA peak, by site, with the planner's
#            prediction (the rows tests/test_planner_calibration.py checks the local_gpu coefficients against)
#
#   scripts/gpu_measure.sh                    # ring claim ab app, on the GPU (one 10-minute device call, with the
#                                             # wheels of scripts/gpu_wheels.sh carried: carry [".gpu"])
#   scripts/gpu_measure.sh ring claim         # some sections (calib runs only when named, or with --cpu-small)
#   scripts/gpu_measure.sh --cpu-small        # the CPU rehearsal: every section in its small CPU form (CI runs it)
#   GPU_MEASURE_OUT=/tmp/m scripts/gpu_measure.sh
#   GPU_MEASURE_TAR=/some/dir/results.tgz scripts/gpu_measure.sh   # also one archive of the results folder (for a
#                                             # machine that hands back only a few files)
#
# Megatron-core (claim, ab, calib) and NeMo 2 (app) are imported from the environment, else from wheels in .gpu/
# installed into a private folder (--no-deps; the device image has torch, lightning and transformers but neither).
# Exit status: 0 when every section ran and passed its own check, else 1 (the summary names each section's result);
# 2 on a bad argument.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
export PYTHONUNBUFFERED=1
CPU_SMALL=0
sections=()
for arg in "$@"; do
  case "$arg" in
    --cpu-small) CPU_SMALL=1 ;;
    ring|claim|ab|app|calib) sections+=("$arg") ;;
    -h|--help) sed -n '2,27p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "gpu_measure.sh: unknown argument '$arg' (sections: ring claim ab app calib; --cpu-small)" >&2; exit 2 ;;
  esac
done
# the default set fits one 10-minute device call (limits 60 + 220 + 80 + 150 s, plus ~70 s of installs); calib by name
if [ ${#sections[@]} -eq 0 ]; then
  sections=(ring claim ab app)
  [ "$CPU_SMALL" = 1 ] && sections+=(calib)
fi
PY="${PYTHON:-}"
if [ -z "$PY" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
t0=$(date +%s)
stamp() { echo "== gpu_measure: $1 at +$(( $(date +%s) - t0 ))s"; }

if [ "$CPU_SMALL" = 1 ]; then
  gpu=cpu
else
  if ! "$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    echo "gpu_measure.sh: no CUDA device visible to $PY (for the CPU rehearsal: --cpu-small)" >&2
    exit 2
  fi
  gpu=$("$PY" -c 'import torch; print(torch.cuda.get_device_name(0).split()[1].lower())' 2>/dev/null || echo gpu)
fi
if [ "$CPU_SMALL" = 1 ]; then  # the rehearsal's figures are not results: a scratch folder
  OUT="${GPU_MEASURE_OUT:-${TMPDIR:-/tmp}/gpu_measure_cpu_small}"
else
  OUT="${GPU_MEASURE_OUT:-bench/results/${gpu}_$(date -u +%Y-%m-%d)}"
fi
mkdir -p "$OUT" || exit 2
{
  echo "date $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  "$PY" -c 'import sys, torch; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, "gpus", torch.cuda.device_count())'
  echo "cpus $(nproc)"
  echo "checkout $(git describe --always --dirty 2>/dev/null || echo unknown)"
} | tee "$OUT/env.txt"

# Megatron-core / NeMo 2 from carried wheels when the environment lacks them (installed once per machine)
if ls .gpu/*.whl >/dev/null 2>&1 && ! "$PY" -c 'import megatron.core' >/dev/null 2>&1; then
  stamp "installing the carried wheels (.gpu/*.whl) into /tmp/gpu_site"
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/gpu_site .gpu/*.whl \
    || echo "== gpu_measure: installing .gpu/*.whl failed" >&2
  export PYTHONPATH="$PYTHONPATH:/tmp/gpu_site"
fi
"$PY" -c 'import megatron.core' >/dev/null 2>&1 && echo "megatron-core $("$PY" -c 'import megatron.core as m; print(m.__version__)')" | tee -a "$OUT/env.txt"

small=()
[ "$CPU_SMALL" = 1 ] && small=(--cpu-small)
declare -A result
run() {  # run SECTION LIMIT_S CMD...: the section's output to the console and $OUT/SECTION.txt
  local name=$1 limit=$2
  shift 2
  stamp "$name (limit ${limit}s)"
  timeout --kill-after=10 "$limit" "$@" 2>&1 | grep -v "Unknown MLP type\|UserWarning\|warnings.warn\|multihot" \
    | tee "$OUT/$name.txt"
  local rc=${PIPESTATUS[0]}
  case $rc in
    0) result[$name]=passed ;;
    124|137) result[$name]="TIMED OUT after ${limit}s" ;;
    *) result[$name]="FAILED (exit $rc)" ;;
  esac
}

for s in "${sections[@]}"; do
  case $s in
    ring)
      if [ "$CPU_SMALL" = 1 ]; then run ring 120 "$PY" bench/ring_decomposition.py --cpu-small
      else run ring 60 "$PY" bench/ring_decomposition.py --sizes 16384 65536 --repeats 5; fi ;;
    claim)
      run claim 220 "$PY" bench/one_gpu_claim.py "${small[@]}" --time-budget-s 200 --json "$OUT/claim.json" ;;
    ab)
      run ab 80 "$PY" bench/attention_ab.py "${small[@]}" --json "$OUT/ab.json" ;;
    app)
      if ! "$PY" -c 'import nemo.collections.llm' >/dev/null 2>&1; then
        echo "== gpu_measure: app: NeMo 2 is not importable with $PY (run in the NGC NeMo container, or carry its" \
          "wheels: scripts/gpu_wheels.sh --nemo)" | tee "$OUT/app.txt"
        result[app]="NOT RUN (no NeMo 2)"
        continue
      fi
      rm -rf "$OUT/app_run"
      if [ "$CPU_SMALL" = 1 ]; then
        run app 240 "$PY" -m nemo_longctx.apps.train model=tiny_llama cp=none trainer.devices=1 trainer.max_steps=4 \
          output_dir="$OUT/app_run" log.tensorboard=false
      else
        run app 150 "$PY" -m nemo_longctx.apps.train model=tiny_llama model.num_layers=16 model.hidden_size=2048 \
          model.ffn_hidden_size=8192 model.num_attention_heads=32 model.num_query_groups=8 model.vocab_size=128256 \
          model.rotary_base=500000 model.seq_length=8192 cp=none trainer.devices=1 trainer.precision=bf16-mixed \
          trainer.max_steps=20 optim.lr=3e-4 output_dir="$OUT/app_run" log.tensorboard=false
      fi
      if [ -f "$OUT/app_run/metrics.jsonl" ]; then
        cp "$OUT/app_run/metrics.jsonl" "$OUT/app_metrics.jsonl"
        cp "$OUT/app_run/.hydra/config.yaml" "$OUT/app_config.yaml" 2>/dev/null
        # tokens/s (median after the first step) and model FLOPs utilisation of the app's own step times
        "$PY" bench/attention_ab.py --summarize-app "$OUT/app_run" "${small[@]}" | tee -a "$OUT/app.txt"
        [ "${PIPESTATUS[0]}" -eq 0 ] || result[app]="FAILED (metrics)"
      fi
      rm -rf "$OUT/app_run" ;;
    calib)
      if [ "$CPU_SMALL" = 1 ]; then
        run calib 120 "$PY" bench/max_seqlen.py --cpu-tiny --stacks longctx --time-budget-s 20
      else
        run calib 150 "$PY" bench/max_seqlen.py --layers 2 --peak-breakdown 262144
      fi ;;
  esac
done

stamp "done"
{
  echo "| section | result |"
  echo "|---|---|"
  for s in "${sections[@]}"; do echo "| $s | ${result[$s]:-not run} |"; done
} | tee "$OUT/summary.md"
echo "== gpu_measure: results in $OUT"
if [ -n "${GPU_MEASURE_TAR:-}" ]; then
  tar czf "$GPU_MEASURE_TAR" -C "$(dirname "$OUT")" "$(basename "$OUT")" && echo "== gpu_measure: archive $GPU_MEASURE_TAR"
fi
for s in "${sections[@]}"; do [ "${result[$s]:-}" = passed ] || exit 1; done
exit 0
