#!/usr/bin/env bash
# Issue #24 on one H200 in one call: CPU/GPU equivalence of the trainer, quickstart rewards per seed with
# the trainer on cuda, repeatability, and the one-GPU engine_device=cuda config. Logs under $OUT.
#   bash bench/gpu_issue24.sh PART...   (run tool: carry [".whl"], kind nvidia-h200; .whl/ holds megatron-core)
# parts:
#   equiv          tests/gpu/equivalence.py: CPU path vs each GPU variant (10 steps), and GPU vs GPU (repeat)
#   par            PAR="TAG:SEED[:KEY=VALUE,...] ..." quickstart runs side by side (trainer on cuda, no router)
#   same:A,FILE    run A's reward curve against another metrics.jsonl (path) step by step
#   pytest         tests/gpu/test_equivalence_gpu.py (WORKERS parallel)
set -u
OUT=${OUT:-/tmp/out}; LOGS=/tmp/i24; mkdir -p "$OUT" "$LOGS"
if [ -z "${SKIP_INSTALL:-}" ]; then  # SKIP_INSTALL=1: a machine that has them (trying the script on the CPU)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir --target /tmp/site . >/dev/null || exit 1
fi
export PYTHONPATH=$PWD:/tmp/site PATH=/tmp/site/bin:$PATH OMP_NUM_THREADS=8 PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
python3 -c "import torch, megatron.core, posttrain; print('torch', torch.__version__, torch.cuda.is_available() and torch.cuda.get_device_name(0), 'posttrain from', posttrain.__file__, 'tf32', torch.backends.cuda.matmul.allow_tf32)"
EQ="python3 tests/gpu/equivalence.py"
TABLE=()
equiv() {
  local steps=${STEPS:-10}
  $EQ --device cpu --out $LOGS/cpu.pt --steps $steps || return
  $EQ --device cpu --out $LOGS/cpu_clip.pt --steps $steps --set grad_clip=0.05 || return
  $EQ --device cpu --out $LOGS/cpu_wd.pt --steps $steps --set weight_decay=0.1 || return
  local plain="--set use_distributed_optimizer=false --set fused_adam=false"
  declare -A V=(
    [plain]="$plain" [distopt]="--set fused_adam=false" [fused]="--set use_distributed_optimizer=false"
    [keep_logits]="$plain --set log_probs_recompute=false" [packing]="$plain --set sequence_packing=true"
    [compile]="$plain --set compile=true" [defaults]="" [defaults_clip]="--set grad_clip=0.05"
    [defaults_wd]="--set weight_decay=0.1")
  for v in plain distopt fused keep_logits packing compile defaults defaults_clip defaults_wd; do
    $EQ --device cuda --out $LOGS/gpu_$v.pt --steps $steps ${V[$v]} > $LOGS/gpu_$v.log 2>&1 || { tail -5 $LOGS/gpu_$v.log; continue; }
    local ref=$LOGS/cpu.pt; case $v in *_clip) ref=$LOGS/cpu_clip.pt;; *_wd) ref=$LOGS/cpu_wd.pt;; esac
    TABLE+=("| cpu vs gpu $v | $($EQ --compare $ref $LOGS/gpu_$v.pt) |")
  done
  $EQ --device cuda --out $LOGS/gpu_defaults2.pt --steps $steps > /dev/null 2>&1
  TABLE+=("| gpu defaults run 1 vs run 2 | $($EQ --compare $LOGS/gpu_defaults.pt $LOGS/gpu_defaults2.pt) |")
}
summary() {  # summary DIR TAG: steps, last-10 reward, reward and entropy at step 100, step-0 grad norm
  python3 - "$1/metrics.jsonl" "$2" <<'PY'
import json, os, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])] if os.path.exists(sys.argv[1]) else []
r = [x["rollout/reward_mean"] for x in rows]
at = lambda i, k: round(rows[i][k], 4) if len(rows) > i and k in rows[i] else None
print(f"| {sys.argv[2]} | steps {len(r)} | last10 {statistics.mean(r[-10:]) if r else float('nan'):.3f} | "
      f"reward@100 {at(100, 'rollout/reward_mean')} entropy@100 {at(100, 'train/entropy')} | "
      f"grad_norm@0 {at(0, 'train/grad_norm')} | sync {rows[0].get('perf/weight_push_s', 0) if rows else 0:.3f}s |")
PY
}
same_curve() {  # same_curve A B: are the reward curves of two runs equal, and where do they first differ
  python3 - "$1" "$2" <<'PY'
import json, os, sys
def curve(p):
    return [json.loads(l)["rollout/reward_mean"] for l in open(p)] if os.path.exists(p) else []
a, b = curve(sys.argv[1]), curve(sys.argv[2])
first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
print(f"| {os.path.basename(os.path.dirname(sys.argv[1]))} vs {os.path.basename(os.path.dirname(sys.argv[2]))} | "
      f"equal {a == b and len(a) > 0} | first different step {first} of {min(len(a), len(b))} |")
PY
}
par() {  # par "TAG:SEED[:OVERRIDE,...] ...": quickstart runs side by side, trainer on cuda, 2 threads each
  local pids=() specs=($1)
  for spec in "${specs[@]}"; do
    IFS=: read -r tag seed extra <<< "$spec"
    PYTHONWARNINGS=default OMP_NUM_THREADS=2 timeout ${QUICK_LIMIT:-400} python3 -m posttrain.cli.main run examples/quickstart.yaml \
      --run-dir $LOGS/runs/$tag seed=$seed rollout.use_router=false ${extra//,/ } > $LOGS/$tag.log 2>&1 &
    pids+=($!)
  done
  for i in "${!pids[@]}"; do
    wait ${pids[$i]}; local rc=$? tag=${specs[$i]%%:*}
    TABLE+=("$(summary $LOGS/runs/$tag "${specs[$i]} rc $rc") non-deterministic ops: $(grep -o '[A-Za-z_:.]* does not have a deterministic implementation' $LOGS/$tag.log | sort -u | tr '\n' ' ') |")
  done
}
for part in "$@"; do case $part in
  equiv) equiv ;;
  par) par "$PAR" ;;
  same:*) pair=${part#same:}; TABLE+=("$(same_curve $LOGS/runs/${pair%%,*}/metrics.jsonl ${pair##*,})") ;;
  pytest) python3 -m pytest -q -p no:cacheprovider -n ${WORKERS:-6} tests/gpu/test_equivalence_gpu.py 2>&1 | tail -15 > $LOGS/pytest.log
          grep -E "^E  |passed|failed" $LOGS/pytest.log | cut -c1-400
          TABLE+=("| pytest tests/gpu/test_equivalence_gpu.py | $(tail -1 $LOGS/pytest.log) |") ;;
  *) echo "unknown part $part"; exit 2 ;;
esac; done
tar czf "$OUT/logs.tgz" -C "$LOGS" --exclude='*.pt' --exclude='hf-*' --exclude='checkpoints' --exclude='tensorboard' \
  --exclude='rollouts.jsonl' . 2>/dev/null
echo; for row in "${TABLE[@]}"; do echo "$row"; done
