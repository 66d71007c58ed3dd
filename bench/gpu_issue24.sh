#!/usr/bin/env bash
# Issue #24 on one H200 in one call: CPU/GPU equivalence of the trainer, quickstart rewards per seed with
# the trainer on cuda, repeatability, and the one-GPU engine_device=cuda config. Logs under $OUT.
#   bash bench/gpu_issue24.sh PART...   (run tool: carry [".whl"], kind nvidia-h200; .whl/ holds megatron-core)
# parts:
#   equiv          tests/gpu/equivalence.py: CPU path vs each GPU variant (10 steps), and GPU vs GPU (repeat)
#   quick:S1,S2..  examples/quickstart.yaml, trainer on cuda, engine on the CPU, seeds S1,S2..; EXTRA=... adds overrides
#   twice:S        the same seed twice, rewards compared step by step
#   onegpu         rl-cli run examples/quickstart.yaml rollout.engine_device=cuda (trainer and engine on GPU 0), 20 steps
#   pytest         tests/gpu/test_equivalence_gpu.py and the one-GPU run test
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
quick() {  # quick SEED EXTRA...: one quickstart run; prints seed, last-10 reward, entropy at 100, wall
  local seed=$1 tag=$2; shift 2
  local dir=$LOGS/runs/$tag-s$seed t0=$(date +%s)
  timeout ${QUICK_LIMIT:-300} python3 -m posttrain.cli.main run examples/quickstart.yaml --run-dir $dir seed=$seed \
    rollout.use_router=false rollout.weight_sync=disk ${EXTRA:-} "$@" > $LOGS/$tag-s$seed.log 2>&1
  local rc=$?
  python3 - "$dir/metrics.jsonl" "$tag seed $seed rc $rc wall $(( $(date +%s) - t0 ))s" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])] if __import__("os").path.exists(sys.argv[1]) else []
r = [x["rollout/reward_mean"] for x in rows]
ent = rows[100].get("train/entropy") if len(rows) > 100 else None
print(f"| {sys.argv[2]} | steps {len(r)} | last10 {statistics.mean(r[-10:]) if r else float('nan'):.3f} | "
      f"reward@100 {r[100] if len(r) > 100 else float('nan'):.3f} entropy@100 {ent} |")
json.dump(r, open(sys.argv[1] + ".rewards.json", "w"))
PY
}
for part in "$@"; do case $part in
  equiv) equiv ;;
  quick:*) for s in $(echo ${part#quick:} | tr , ' '); do TABLE+=("$(quick $s q)"); done ;;
  twice:*) s=${part#twice:}; TABLE+=("$(quick $s a)") ; TABLE+=("$(quick $s b)")
           TABLE+=("| same curve (seed $s): $(python3 -c "import json,sys; a=json.load(open('$LOGS/runs/a-s$s/metrics.jsonl.rewards.json')); b=json.load(open('$LOGS/runs/b-s$s/metrics.jsonl.rewards.json')); print(a==b, 'first diff at step', next((i for i,(x,y) in enumerate(zip(a,b)) if x!=y), None))") |") ;;
  onegpu) t0=$(date +%s); timeout 300 python3 -m posttrain.cli.main run examples/quickstart.yaml --run-dir $LOGS/runs/onegpu \
            rollout.engine_device=cuda rollout.use_router=false rollout.num_rollouts=20 > $LOGS/onegpu.log 2>&1
          TABLE+=("| onegpu engine_device=cuda | rc $? $(( $(date +%s) - t0 ))s | $(grep -h -i -m2 'weight_sync\|error' $LOGS/onegpu.log | cut -c1-200 | tr '\n' ' ') | $(wc -l < $LOGS/runs/onegpu/metrics.jsonl 2>/dev/null) steps |") ;;
  pytest) python3 -m pytest -q -p no:cacheprovider tests/gpu/test_equivalence_gpu.py 2>&1 | tail -15 | tee $LOGS/pytest.log
          TABLE+=("| pytest tests/gpu/test_equivalence_gpu.py | $(tail -1 $LOGS/pytest.log) |") ;;
  *) echo "unknown part $part"; exit 2 ;;
esac; done
tar czf "$OUT/logs.tgz" -C "$LOGS" --exclude='*.pt' --exclude='hf-*' --exclude='checkpoints' . 2>/dev/null
echo; for row in "${TABLE[@]}"; do echo "$row"; done
