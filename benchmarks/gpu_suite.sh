#!/usr/bin/env bash
# Every GPU measurement in docs/memory.md, in one run on one CUDA GPU (planned for under 8 minutes on an
# H200), written into docs/memory.md between its marker comments, so a rerun replaces the tables.
#
#   benchmarks/gpu_suite.sh                         # with `python` from PATH
#   PYTHON=.venv/bin/python benchmarks/gpu_suite.sh
#   SUITE_OUT=/tmp/suite benchmarks/gpu_suite.sh    # keep the logs and raw tables there
#
# Phases (each a script in benchmarks/, each with a time limit in seconds):
#   memory-1.3B     gpu_memory.py: every swap × fp8 × checkpointing row of Wan 1.3B          85
#   memory-14B      gpu_memory.py: Wan 14B, one memory switch added per row                 120
#   swap            gpu_speed.py: 14B step time with half / all blocks swapped ÷ none         90
#   fp8_matmul      gpu_speed.py: 1.3B step time with fp8 matmul ÷ dequantized fp8            40
#   attention       gpu_speed.py: 1.3B, every installed attention backend ÷ sdpa              65
#   train-overhead  train_overhead.py: tuner's loop ÷ a bare loop on the GPU                  45
# The limits add up to 445 s, so the suite ends within 8 minutes even if every phase runs into its limit
# (they are estimates from FLOP counts and copy sizes: no GPU was at hand to time them). A phase that
# reaches its limit is stopped; the rows it measured stay and the doc says it was cut short (to complete
# it, run the command the suite printed for that phase by itself).
#
# It needs the repository's Python environment with a CUDA build of torch and installs nothing. The
# models are built from the shipped configs with random weights: no checkpoint or hub access is needed.
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python}
RESULTS=${SUITE_OUT:-$(mktemp -d -t gpu_suite.XXXXXX)}
mkdir -p "$RESULTS"
export PYTHONPATH="src${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
"$PYTHON" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 'gpu_suite.sh: no CUDA GPU')" || exit 1
echo "results and logs: $RESULTS"

notes=()
failed=0
phase() {  # phase NAME LIMIT ARGS...: run `python ARGS...` under a time limit, log to NAME.log
  local name=$1 limit=$2 start=$SECONDS rc
  shift 2
  echo "== $name (limit ${limit} s): $PYTHON $*"
  timeout --kill-after=3 "$limit" "$PYTHON" "$@" >"$RESULTS/$name.log" 2>&1
  rc=$?
  tail -n 40 "$RESULTS/$name.log"
  echo "== $name: exit $rc after $((SECONDS - start)) s"
  case $rc in
    0) ;;
    124 | 137) notes+=(--note "$name=Stopped at the suite's ${limit} s limit") ;;
    *) notes+=(--note "$name=The script exited with status $rc (see the notes under the table, and $name.log)"); failed=1 ;;
  esac
}

phase memory-1.3B 85 benchmarks/gpu_memory.py --models 1.3B --checkpointing none plain offload --steps 2 \
  --markdown "$RESULTS/memory-1.3B.md"
phase memory-14B 120 benchmarks/gpu_memory.py --models 14B --steps 1 --markdown "$RESULTS/memory-14B.md" \
  --rows 0/off/none 0/off/plain 0/on/plain half/on/plain all/on/plain all/on/offload
phase swap 90 benchmarks/gpu_speed.py --model 14B --compare swap --swap half all --steps 2 \
  --markdown-dir "$RESULTS"
phase fp8_matmul 40 benchmarks/gpu_speed.py --model 1.3B --compare fp8_matmul --steps 3 --markdown-dir "$RESULTS"
phase attention 65 benchmarks/gpu_speed.py --model 1.3B --compare attention --steps 3 --markdown-dir "$RESULTS"
phase train-overhead 45 benchmarks/train_overhead.py --dim 1024 --layers 8 --resolution 832,480 --dtype bf16 \
  --steps 20 --rounds 2 --markdown "$RESULTS/train-overhead.md"

sections=()
for name in memory-1.3B memory-14B swap fp8_matmul attention train-overhead; do
  sections+=("$name=$RESULTS/$name.md")
done
"$PYTHON" benchmarks/report.py docs/memory.md "${sections[@]}" "${notes[@]}" --environment || exit 1
echo "tables written to docs/memory.md after $SECONDS s"
exit $failed
