#!/usr/bin/env bash
# One call on a lent H200 (see bench/RESULTS.md): installs the carried wheels and posttrain into /tmp/site,
# runs the GPU tests, the rollout and train benchmarks at the Qwen3-1.7B shape and the quickstart on the GPU,
# and prints a table last. Logs go to $OUT (the device tool brings them back).
#   needs: .whl/ with megatron-core 0.16.1 (cp312), math-verify, latex2sympy2_extended, antlr4-python3-runtime
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir --target /tmp/site . || exit 1
export PYTHONPATH=/tmp/site PATH=/tmp/site/bin:$PATH OMP_NUM_THREADS=8 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, transformers, megatron.core; print('torch', torch.__version__, 'transformers', transformers.__version__)"
declare -A RC
step() {  # step NAME TIMEOUT_S CMD...: run, keep the log, remember the exit code
  local name=$1 limit=$2; shift 2
  local t0=$(date +%s)
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; RC[$name]="$? ($(( $(date +%s) - t0 )) s)"
  echo "== $name: rc ${RC[$name]}"; tail -n 4 "$OUT/$name.log"
}
step gpu_tests 240 python3 -m pytest -q -p no:cacheprovider tests/unit/train/test_gpu.py \
  tests/unit/rollout/test_rollout_gpu.py tests/unit/algorithms/test_gpu.py
step rollout_bench 240 python3 bench/rollout.py --device cuda --shape qwen3-1.7b --prompts 256 --prompt-len 128 --new-tokens 256
step train_bench 200 python3 bench/train.py --device cuda --preset qwen3-1.7B --micro-batch 4 --seq-len 2048 --steps 5 --warmup 2
step quickstart_gpu 240 python3 -m posttrain.cli.main run examples/quickstart.yaml --run-dir /tmp/qs \
  rollout.engine_device=cuda rollout.use_router=false
cp /tmp/qs/metrics.jsonl "$OUT/quickstart_gpu_metrics.jsonl" 2>/dev/null
echo; echo "| step | rc (wall) |"; echo "|---|---|"
for k in gpu_tests rollout_bench train_bench quickstart_gpu; do echo "| $k | ${RC[$k]} |"; done
grep -h '^{' "$OUT"/rollout_bench.log "$OUT"/train_bench.log 2>/dev/null | tail -n 2
