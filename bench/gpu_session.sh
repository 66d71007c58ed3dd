#!/usr/bin/env bash
# One call on lent H200s (bench/RESULTS.md): installs the carried wheels and posttrain into /tmp/site, runs
# the named parts, keeps every log under $OUT and prints a table last (also when a signal stops it: run it under
# `timeout N` a little inside the call's limit, and the logs of the steps so far still come back).
#   bash bench/gpu_session.sh PART...      (run tool: carry [".whl"], kind nvidia-h200-x2 for two GPUs)
# parts:
#   tests     GPU tests (tests/gpu: colocated, NCCL, async runs at a small shape; engine and trainer GPU tests)
#   sync      weight-sync bench: Qwen3-1.7B shape, trainer GPU 0 -> engine GPU 1 over NCCL
#   sync4b    weight-sync bench: Qwen3-4B shape to two engines sharing GPU 1 (issue 9 shrunk to two GPUs)
#   rollout   engine decode variants at the Qwen3-1.7B shape, 256 prompts x 128, 256 new tokens
#   train     train-step levers at Qwen3-1.7B, micro-batch 4 x 2048
#   levers    train-step levers one at a time on top of gqa + compile + 8 micro-batches (LEVERS picks some:
#             base keep fused mb8 mb16 nopack nocompile best4 best8 best16 tests), with a kernel-time profile
#   tp2       TP=2 train step on both GPUs (torchrun)
#   colocated GRPO, Qwen3-1.7B shape, 64 x 8 x 512 new tokens, trainer and engine on GPU 0 (issue 17's levers
#             as the config sets them: old log-probs from the train step, no reference pass without KL,
#             micro-batches of 16k tokens)
#   colocated5 the same, 5 steps (the compiled trainer reaches steady state at step 4)
#   colocated5c the same with the compiled engine decode (rollout.engine.compile=true)
#   stable17  the CUDA VMM probe (vmm.vmm_supported) and the engine's GPU tests (stable memory keeps the graphs)
#   gen17     engine decode at the colocated run's shape (512 x 8-token prompts, 512 new) with its kernel table,
#             then at the benchmark shape (256 x 128, 256 new; triton, triton+compile)
#   ropecheck the THD rotary (trainers/megatron/rope.py) compiled by Inductor on the GPU equals its eager self
#   levers17  the same, one lever less each: with the reference pass (trainer.log_kl=true, the reference
#             resident on the GPU), then with the compiled engine decode
#   diag17    decode parts alone (attention-kernel launch grid, fused vs separate matmuls; bench/decode_parts.py)
#             and the engine's decode at the benchmark shape with its kernel table (triton+compile)
#   gputests17 the engine's GPU tests (stable memory, compiled variants), then tests/gpu's runs and equivalence
#   overlap17 the engine's GPU tests (overlap, fused projections, graphs, compiled variants), then decode at the
#             benchmark shape: overlapped + fused (the defaults), then without each (triton+compile throughout)
#   prefill17 the same tests, then decode at the benchmark shape with the compiled prefill (triton+compile), and triton
#   decode17b the new kernels' GPU tests (cache writes inside the decode attention, one-pass sampling), decode at the
#             benchmark shape with each new lever off in turn (kernel tables of each variant), the engine's GPU tests
#   decode17c the same kernels' tests, decode with the new levers and without (kernel table), the engine's GPU tests,
#             the colocated GPU run test, then decode with inductor's max-autotune (long compiles: last)
#   decode17d the decode step's matmul shapes under cuBLAS, cuBLASLt, addmm and a Triton matmul (bench/decode_parts.py
#             --gemm-backends), decode at the benchmark shape with the layers joined and not (kernel tables, the
#             trace's device-busy fraction), the engine's GPU tests
#   decode17e the kernels' and the engine's GPU tests (sampling inside the decode graph among them), the decode
#             attention at equal slot lengths (a quick launch grid), decode at the benchmark shape with the new
#             defaults and with sampling after the graph (kernel tables)
#   decode17f the sampling kernel's GPU tests, the decode attention at equal lengths writing the step's K/V (quick
#             grid), decode at the benchmark shape: the defaults, three attention stages, Inductor's combo kernels
#             (the trace's idle time per step by the operations around it)
#   decode17g the kernels' and the engine's GPU tests, decode at the benchmark shape with the new defaults (three
#             attention stages, combo kernels), without combo kernels, and with two stages
#   decode17h the decode kernel's GPU tests, the decode attention at equal lengths writing the step's K/V with slots
#             sharing programs (slots_per_program 1, 2, 4, 8) and the read ceiling, decode at the benchmark shape:
#             the defaults, four and eight slots per program
#   decode17i the kernels' and the engine's GPU tests, decode at the benchmark shape with the new defaults (eight
#             slots per attention program, the step's inputs and draw in the runner's step buffers), the same with
#             one slot per program, and the defaults again (the drift within one call)
#   decode17j the decode kernel's GPU tests (Qwen3's Q/K norms and the rotary inside the attention among them), decode
#             at the benchmark shape: the new defaults (rope in the attention), the rotary apart, the defaults again
#             (kernel tables; where the run's wall time goes outside the steps)
#   decode17k the kernels' and the engine's GPU tests, decode at the benchmark shape: the new defaults (rope in the
#             attention, its loads reordered, programmatic dependent launch of the attention and of Inductor's
#             kernels), without PDL, with Inductor's PDL only, with the rotary apart, the defaults again
#   decode17l the kernels' and the engine's GPU tests, decode at the benchmark shape: the new defaults (rope in the
#             attention, positions left on the device by the graphs), positions copied every step, the rotary apart,
#             the defaults again (what the copies between graphs cost; where a prefill idles)
#   decode17m the engine's and the sampling kernel's GPU tests, decode at the benchmark shape: the new defaults,
#             positions copied in every step, the defaults again (call 4 of 2026-12-04 also ran a host mailbox,
#             since measured, found to corrupt an in-flight step at a mid-run capture, and removed: RESULTS.md)
#   decode17n decode at the benchmark shape with the new defaults and with the rotary apart, then colocated5
#   decode17o the decode kernel's GPU tests, the decode attention alone with the rotary and without at the benchmark
#             shape (eight slots a program, three and four stages; BASELINE_KERNEL=path: another decode_kernel.py timed
#             beside it, setting by setting), decode at the benchmark shape: the defaults, the rotary apart, four
#             attention stages, the defaults again
#   attention17 the decode kernel's GPU tests, the decode attention alone at the benchmark shape with the rotary
#             (ATTN_SETTINGS: launches BLOCKxWARPSxSTAGES, ATTN_GROUPS: slots per program; BASELINE_KERNEL as decode17o), then decode at the
#             benchmark shape (VARIANTS, default the defaults) with the device's clocks sampled
#   decode17p the kernels' and the engine's GPU tests, decode at the benchmark shape: the defaults (a prefill's K/V
#             written by one Triton launch a layer), torch's copies instead, a GIL switch interval of 0.1 ms, the
#             defaults again (the device's clocks sampled)
#   decode17q decode at the benchmark shape with the defaults twice (answered requests freed after the answers), then
#             colocated5
#   recompile17 the compiled trainer meets a small micro-batch after large ones without recompiling (and with torch's
#             defaults it does: the control)
#   decode17r decode at the benchmark shape with the defaults three times (the step's copies against its graph in
#             one power state: step_io_ms, step_graph_ms)
#   symbatch17 the engine's decode parts compiled once with the row count symbolic (the default) against
#             rollout.py's staticbatch (static at the largest bucket, then symbolic): each alone with empty compile
#             caches (first_run_s: its compiles and captures; compiled_graphs), then both twice on one model (tok/s)
#   sampling17 the sampling kernel's GPU tests, the one-pass sampler alone (BASELINE_KERNEL=path: another
#             sampling_kernel.py beside it), decode at the benchmark shape with the defaults twice
#   sampling17b the sampling kernel's GPU tests; the one-pass sampler alone at the default launch (four uniforms a
#             Philox call; BASELINE_KERNEL beside it) and over a grid of launches (SAMPLER_SETTINGS,
#             BLOCKxWARPSxPROGRAMS_PER_SM); decode at the benchmark shape: the defaults, the grid's fastest greedy
#             launch (variant word samplerBxWxP), the defaults again
#   sampling17c the sampling kernel's GPU tests; the one-pass sampler alone (BASELINE_KERNEL: other copies beside it)
#             at the default launch and over SAMPLER_SETTINGS; decode at the benchmark shape with the defaults twice
#   engine17s the graphs' and the compiled decode's GPU tests, then colocated5 with Dynamo's recompiles logged and the
#             engine's own figures per step from its metrics (engine/prefill_s, decode_s, graph captures, ...), then
#             decode at the benchmark shape with the defaults
#   trainer17 the compiled trainer's GPU equivalence test, then colocated5 with Dynamo's recompiles and graph breaks
#             logged (counted, the breaks' places listed) and each step's train seconds (the first step's compiles)
#   offload17 the trainer offload's GPU tests (Megatron's optimizer state round trip, a small colocated run), then
#             colocated GRPO for 4 steps with resources.offload_trainer (the trainer's state in host memory while the
#             engine generates), offloading only the optimizer state and gradients
#             (trainer.backend.offload_parts=[optimizer,grads]: the weights and the reference stay), and without the
#             offload, each phase's GPU memory
#   offloadab17 offload17's colocated runs with the offload and without (no tests); offloadtests17 its tests alone
#   pintests17 the host buffer's and the offload's GPU tests; offload4_17 offloadab17's run with the offload alone
#             (OFFLOAD_EXTRA, here and in offloadab17: more overrides, e.g.
#             trainer.max_tokens_per_micro_batch=8192 to fit an H100)
#   startup17 colocated GRPO with the trainer offloaded for 2 steps, the engines starting on hf-init's model files (the
#             default: weights from the first push), then on the trainer's initial weights (checkpoint.hf_init_weights;
#             it runs second, on warm compile caches); each run's start-up lines (OFFLOAD_EXTRA as in offload4_17)
#   startupdisagg17 the same for the disaggregated example (two GPUs: the engines start before the trainer builds)
#   warm17    startup17's colocated offloaded run with the engines warmed for the run's sampling before they answer
#             (the default: the decode step's compiles and graphs), then with rollout.engine.warm_up=false (in step 0)
#   warmdisagg17 the same, disaggregated (two GPUs: the warm-up runs while the trainer builds)
#   pin17     a 28.8 GiB pinned host buffer made four ways (bench/pin_memory.py; PIN_METHODS picks): seconds, bytes
#             pinned, copy bandwidth
#   offloadrun17 the small colocated GPU run with the offload (tests/gpu), then the same with the allocator's
#             expandable segments (PYTORCH_CUDA_ALLOC_CONF), each step's GPU peak while generating and the trainer's
#             reserved memory
#   offloadparts17 colocated GRPO for 4 steps offloading everything with the optimizer's state moved with the rest
#             (offload_overlap=false), against offload17's run (the optimizer's state back behind the passes and out
#             behind the weight push)
#   halves17  a decode step's 28 layers (attention + matmuls, as one CUDA graph) with all rows on one stream, the
#             two halves one after the other, and the two halves on two streams forked in the graph
#             (bench/decode_parts.py --overlap): does one half's attention hide under the other's matmuls?
#   memory17  the graphs' GPU tests (a warm-up out of memory puts the cache back), then colocated5 with each phase's
#             GPU memory peak (perf/gpu_peak_gib_<phase>, NVML: trainer and engine together) printed per step
#   ragged17  the decode attention over lengths spread +-128 in random slot order (mean 256 and 1024), one slot a
#             program against four and eight
#   autotune17 decode at the benchmark shape with inductor's max-autotune (Triton matmul templates against cuBLAS)
#   gpuruns17 tests/gpu's runs, then its trainer-engine equivalence variants (each with its own limit)
#   offloadtest1 the trainer-offloaded colocated GPU run test alone (two qwen3-0.6B runs; OFFLOADED_TEST_S, default 560)
#   colocated_test, compiled_gpu_tests: the colocated GPU run tests alone (three qwen3-0.6B runs: 150 s was short on an
#             H200, COLOCATED_TEST_S, default 330); the compiled decode variants' GPU tests
#   trl_gpu   TRL's GRPOTrainer on that workload (bench/trl_gpu.py; wheels in .whl/trl/: trl, datasets, dill,
#             multiprocess), for the side-by-side ratio
#   disagg    the same, trainer GPU 0 / engine GPU 1, synchronous then async
#   shrunk    issue 9 shrunk: trainer GPU 0, two engines on GPU 1 behind sglang-router
#   moe       moe_train moe_rollout moe_grpo (issue 16's H200 measurement, one H200, ~3.5 min together):
#   moe_train   train step of Qwen3-30B-A3B cut to MOE_LAYERS (8) layers, bf16, micro-batch 4 x 2048 x 2,
#               TFLOP/s on active parameters (out of memory without a result: again at micro-batch 2 x 4)
#   moe_experts grouped vs sequential experts (issue 54; alone in one call, up to ~9 min): the grouped experts' and
#               the engine MoE kernels' GPU tests (bf16, 128 experts, against SequentialMLP and transformers), then
#               moe_train's step with each expert layer (bench/train.py --experts both: one JSON line each,
#               gpu_ms_by_kind), then the engine's decode at moe_rollout's shape with transformers' experts and with
#               the engine's MoE kernels (moe_kernel: fused routing, two grouped GEMM launches)
#   moe_rollout local-engine decode at that shape (MOE_ROLLOUT_LAYERS, default MOE_LAYERS), 256 x 128 prompt,
#               256 new tokens, triton decode attention
#   moe_grpo    3-step colocated GRPO, examples/gpu/qwen3-30b-a3b-grpo.yaml (16 x 8 x 128 new), routing replay on
# needs: .whl/ with megatron-core 0.16.1 (cp312), math-verify, latex2sympy2_extended, antlr4-python3-runtime,
#        orjson (cp312: sglang-router's dependency, which a pip install brings; without it the rollout protocol's
#        JSON falls back to the standard library, slower for a batched /generate's answers, core/jsonio.py);
#        optional .whl/extra/ with sglang-router and what its launcher imports (fastapi, uvicorn, orjson, ...),
#        for the parts with rollout.use_router: true (sync4b, shrunk); without it they fail, the rest run
set -u
OUT=${OUT:-/tmp/out}; LOGS=/tmp/gpu-logs; mkdir -p "$OUT" "$LOGS"  # logs come back as $OUT/logs.tgz
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
extra=(.whl/extra/*.whl)  # optional: only the parts with rollout.use_router: true need the router's web stack
if [ -e "${extra[0]}" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/extra "${extra[@]}" || exit 1
else
  echo "no .whl/extra/*.whl: sglang-router not installed (parts with rollout.use_router: true will fail)"
fi
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir --target /tmp/site . || exit 1
# /tmp/extra last: it only fills what the image lacks (the router's web stack)
export PYTHONPATH=/tmp/site:/tmp/extra PATH=/tmp/site/bin:$PATH OMP_NUM_THREADS=8 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 -c "import torch, transformers, megatron.core; print('torch', torch.__version__, 'transformers', transformers.__version__, 'gpus', torch.cuda.device_count())"
python3 -c "from posttrain.core import jsonio; print('rollout JSON:', 'orjson' if jsonio.orjson else 'the standard library')"
if python3 -c "import sglang_router.launch_router" 2>/dev/null; then echo "router importable"; else echo "router not importable"; fi
CFG=examples/gpu/qwen3-1.7b-grpo.yaml
MOE_CFG=examples/gpu/qwen3-30b-a3b-grpo.yaml
MOE_LAYERS=${MOE_LAYERS:-8}                            # the cut of MOE_CFG (its memory arithmetic: 8 layers)
MOE_ROLLOUT_LAYERS=${MOE_ROLLOUT_LAYERS:-$MOE_LAYERS}  # decode alone fits all 48 (57 GiB of weights)
declare -A RC; ORDER=()
CHILD= CURRENT=
finish() {  # the logs back as $OUT/logs.tgz, and the table of steps
  tar czf "$OUT/logs.tgz" -C "$LOGS" . 2>/dev/null
  echo; echo "| step | rc (wall) |"; echo "|---|---|"
  for k in "${ORDER[@]}"; do echo "| $k | ${RC[$k]} |"; done
}
# stopped from outside (`timeout 590 bash bench/gpu_session.sh ...` running out): end the running step, keep the logs
trap 'echo "== stopped by a signal"; if [ -n "$CHILD" ]; then kill $CHILD 2>/dev/null; wait $CHILD
      RC[$CURRENT]="stopped"; ORDER+=("$CURRENT"); fi; finish; exit 124' TERM INT
step() {  # step NAME TIMEOUT_S CMD...: run, keep the log, remember the exit code and wall time
  local name=$1 limit=$2; shift 2
  local t0=$(date +%s)
  # in the background and waited for, so a signal to this script (the call's own `timeout`) stops it at once and
  # the trap below still returns the logs
  CURRENT=$name; timeout "$limit" "$@" > "$LOGS/$name.log" 2>&1 & CHILD=$!
  wait $CHILD; RC[$name]="$? ($(( $(date +%s) - t0 )) s)"; ORDER+=("$name"); CHILD=
  echo "== $name: rc ${RC[$name]}"; grep -h '^{' "$LOGS/$name.log" | cut -c1-1500; tail -n 3 "$LOGS/$name.log" | cut -c1-300
}
e2e() {  # the run stops itself 15 s before the step's limit and reports the steps it finished
  local name=$1 limit=$2; shift 2
  # TORCH_LOGS=recompiles: a guard that fails mid-run says which one, in the run's .out (stderr)
  step "$name" "$limit" env TORCH_LOGS=${TORCH_LOGS:-recompiles} python3 bench/e2e.py --config $CFG --name "$name" --keep "$LOGS/runs" --timeout $((limit - 15)) "$@"
  grep -h "^step \|^\[" "$LOGS/runs/$name.out" 2>/dev/null | tail -n 12 | cut -c1-300
  grep -h -A3 "Recompiling function" "$LOGS/runs/$name.out" 2>/dev/null | head -n 24 | cut -c1-300
}
engine_tests() {  # the kernels' and the engine's GPU tests (the decode parts' common first steps)
  step kernel_gpu_tests 150 python3 -m pytest -q -p no:cacheprovider -m gpu \
    tests/unit/rollout/test_decode_kernel.py tests/unit/rollout/test_sampling_kernel.py tests/unit/rollout/test_cache_write.py
  step engine_gpu_tests 170 python3 -m pytest -q -p no:cacheprovider -m gpu tests/unit/rollout/test_rollout_gpu.py \
    tests/unit/rollout/test_decode_variants.py tests/unit/rollout/test_engine_overlap.py \
    tests/unit/rollout/test_fused_projections.py
}
bench_shape() {  # bench_shape NAME VARIANTS: decode at the benchmark shape, variants back to back on one model
  # (the GPU's clocks, power and throttle reasons sampled every 100 ms meanwhile, summarized after: what the device
  # ran at, read only)
  nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_event_reasons.active \
    --format=csv,noheader,nounits -lms 100 > "$LOGS/smi_$1.csv" 2>/dev/null & local smi=$!
  step "$1" ${ROLLOUT_S:-200} python3 bench/rollout.py --device cuda --shape qwen3-1.7b --prompts 256 \
    --prompt-len 128 --new-tokens 256 --skip-hf --profile --variants "${VARIANTS:-$2}" ${KT:-}
  kill $smi 2>/dev/null
  python3 - "$LOGS/smi_$1.csv" <<'PY' || true
import collections, statistics, sys
rows = [[x.strip() for x in l.split(",")] for l in open(sys.argv[1]) if l.count(",") >= 5]
busy = [r for r in rows if float(r[3]) > 200]  # samples under load (W)
if busy:
    sm = [float(r[1]) for r in busy]
    print(f"smi under load: {len(busy)} samples, SM MHz min {min(sm):.0f} median {statistics.median(sm):.0f} max {max(sm):.0f}, "
          f"memory MHz {busy[0][2]}, power W max {max(float(r[3]) for r in busy):.0f}, temperature C max "
          f"{max(float(r[4]) for r in busy):.0f}, throttle reasons {dict(collections.Counter(r[5] for r in busy))}")
PY
}
phase_table() {  # phase_table NAME: each step's seconds and GPU peak per phase of an e2e run (perf/gpu_peak_gib_*)
  python3 - "$LOGS/runs/$1-metrics.jsonl" <<'PY' || true
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
phases = list(dict.fromkeys(k[len("perf/time_"):] for r in rows for k in r if k.startswith("perf/time_")))
print("step | " + " | ".join(f"{p} s / GPU peak GiB" for p in phases) + " | trainer peak | engine peak | offloaded GiB"
      " | trainer reserved GiB | trainer allocated GiB | optimizer state wait s | host buffers made s"
      " | trainer alloc retries | trainer compiled graphs")
for r in rows:
    print(r["step"], "|", " | ".join(f"{r.get('perf/time_' + p, 0):.2f} / {r.get('perf/gpu_peak_gib_' + p, float('nan')):.1f}"
                                     for p in phases), "|", round(r.get("perf/trainer_peak_gib", 0), 1), "|",
          round(r.get("perf/engine_peak_gib", 0), 1), "|", round(r.get("perf/trainer_offloaded_gib", 0), 1), "|",
          round(r.get("perf/trainer_reserved_gib", float("nan")), 2), "|",
          round(r.get("perf/trainer_allocated_gib", float("nan")), 3), "|",
          round(r.get("train/offload_wait_s", float("nan")), 3), "|", round(r.get("train/offload_pin_s", float("nan")), 2),
          "|", r.get("perf/trainer_alloc_retries", "-"), "|", r.get("perf/trainer_compiled_graphs", "-"))
PY
  # the engine's start-up parts, and its first generation (the readiness check: the prefill's compiles)
  grep -h "ready after\|first generation" "$LOGS"/runs/$1*engine*.log 2>/dev/null | tail -n 3 | cut -c1-300
}
PARTS=(); for p in "$@"; do if [ "$p" = moe ]; then PARTS+=(moe_train moe_rollout moe_grpo); else PARTS+=("$p"); fi; done
for part in "${PARTS[@]}"; do case $part in
  tests) step tests 240 python3 -m pytest -q -p no:cacheprovider tests/unit/rollout/test_rollout_gpu.py tests/unit/rollout/test_decode_variants.py tests/gpu ;;
  diag) step diag 150 python3 -m pytest -q -x -p no:cacheprovider tests/gpu -k disaggregated
        grep -h -A12 "engine step failed" $LOGS/diag.log | head -40 ;;
  sync) step sync 120 python3 bench/weight_sync.py $CFG --pushes 5 ;;
  sync4b) step sync4b 200 python3 bench/weight_sync.py $CFG model.preset=qwen3-4B rollout.engine.device=cuda:1 \
            resources.num_engines=2 rollout.use_router=true rollout.engine.max_running_requests=8 --pushes 5 ;;
  rollout) step rollout 200 python3 bench/rollout.py --device cuda --shape qwen3-1.7b --prompts 256 --prompt-len 128 \
             --new-tokens 256 --skip-hf --profile --variants ${ROLLOUT_VARIANTS:-sdpa,bmm,sdpa+compile,bmm+compile} --kernel-tables $LOGS/kernels ;;
  train)
    step train_gqa_accum8 90 python3 bench/train.py --device cuda --preset qwen3-1.7B --micro-batch 4 --seq-len 2048 --steps 3 --warmup 1 --sdpa-gqa --grad-accum 8
    step train_compile_accum8 150 python3 bench/train.py --device cuda --preset qwen3-1.7B --micro-batch 4 --seq-len 2048 --steps 3 --warmup 1 --sdpa-gqa --grad-accum 8 --compile ;;
  levers)
    B="--device cuda --preset qwen3-1.7B --seq-len 2048 --steps 3 --warmup 1 --sdpa-gqa --compile"
    for v in ${LEVERS:-base keep fused mb8 nopack}; do case $v in
      base) step lev_base 150 python3 bench/train.py $B --micro-batch 4 --grad-accum 8 --profile --kernel-table $LOGS/kt_base.txt ;;
      keep) step lev_keep 150 python3 bench/train.py $B --micro-batch 4 --grad-accum 8 --keep-logits ;;
      fused) step lev_keep_fused 150 python3 bench/train.py $B --micro-batch 4 --grad-accum 8 --keep-logits --fused-adam \
               --profile --kernel-table $LOGS/kt_fused.txt ;;
      mb8) step lev_mb8 150 python3 bench/train.py $B --micro-batch 8 --grad-accum 4 --keep-logits --fused-adam ;;
      nopack) step lev_nopack 150 python3 bench/train.py $B --micro-batch 4 --grad-accum 8 --keep-logits --fused-adam --no-packing ;;
      mb16) step lev_mb16 150 python3 bench/train.py $B --micro-batch 16 --grad-accum 2 --keep-logits --fused-adam ;;
      nocompile) step lev_nocompile 150 python3 bench/train.py ${B/--compile/} --micro-batch 4 --grad-accum 8 --keep-logits --fused-adam ;;
      best4) step lev_best4 150 python3 bench/train.py $B --micro-batch 4 --grad-accum 8 --keep-logits --fused-adam \
               --profile --kernel-table $LOGS/kt_best4.txt ;;
      best16) step lev_best16 150 python3 bench/train.py $B --micro-batch 16 --grad-accum 2 --keep-logits --fused-adam ;;
      best8) step lev_best8 150 python3 bench/train.py $B --micro-batch 8 --grad-accum 4 --keep-logits --fused-adam ;;
      tests) step lev_tests 150 python3 -m pytest -q -p no:cacheprovider tests/unit/train/test_gpu.py ;;
    esac; done ;;
  tp2) step tp2 120 python3 -m torch.distributed.run --nproc_per_node 2 bench/train.py --device cuda --preset qwen3-1.7B \
         --tp 2 --micro-batch 4 --seq-len 2048 --steps 3 --warmup 1 --grad-accum 8 ;;
  colocated) e2e colocated ${COLOCATED_S:-300} resources.colocate=true ;;
  ropecheck) step ropecheck 120 python3 -c "
import torch
from posttrain.plugins.trainers.megatron.rope import apply_rotary_pos_emb_thd as f
g = torch.compile(f)
for L in ([5, 3, 9], [1, 12], [7, 7, 2, 4], [16], [2, 3, 5, 7, 11]):
    cu = torch.tensor([0] + torch.tensor(L).cumsum(0).tolist(), dtype=torch.int32, device='cuda')
    x = torch.randn(sum(L), 4, 16, device='cuda', dtype=torch.bfloat16)
    fr = torch.randn(max(L), 1, 1, 16, device='cuda')
    torch.testing.assert_close(g(x, cu, fr), f(x, cu, fr), atol=2e-2, rtol=2e-2)  # bf16: Inductor fuses in fp32
print('ropecheck ok: compiled THD rotary equals eager on cuda (bf16 tolerance) for 5 sets of lengths')" ;;
  gen17) step gen_colocated_shape 200 python3 bench/rollout.py --device cuda --shape qwen3-1.7b --prompts 512 --prompt-len 8 \
           --new-tokens 512 --skip-hf --profile --variants triton --kernel-tables $LOGS/kernels_gen512
         head -30 $LOGS/kernels_gen512/*.txt
         step rollout_bench_shape 200 python3 bench/rollout.py --device cuda --shape qwen3-1.7b --prompts 256 --prompt-len 128 \
           --new-tokens 256 --skip-hf --profile --variants triton,triton+compile ;;
  offload17)
    step offload_gpu_test 240 python3 -m pytest -q -p no:cacheprovider -m gpu tests/unit/train/test_offload.py \
      tests/gpu/test_runs_gpu.py -k "offload"
    e2e colocated4_offload ${COLOCATED4_S:-220} resources.colocate=true rollout.num_rollouts=4 resources.offload_trainer=true
    phase_table colocated4_offload
    e2e colocated4_offload_opt ${COLOCATED4_S:-220} resources.colocate=true rollout.num_rollouts=4 \
      resources.offload_trainer=true "trainer.backend.offload_parts=[optimizer,grads]"
    phase_table colocated4_offload_opt
    e2e colocated4 ${COLOCATED4_S:-220} resources.colocate=true rollout.num_rollouts=4
    phase_table colocated4 ;;
  offloadab17)  # offload17's runs with and without the offload, its tests left out (one call's room on an H200)
    e2e colocated4_offload ${COLOCATED4_S:-220} resources.colocate=true rollout.num_rollouts=4 resources.offload_trainer=true \
      ${OFFLOAD_EXTRA:-}
    phase_table colocated4_offload
    e2e colocated4 ${COLOCATED4_S:-220} resources.colocate=true rollout.num_rollouts=4 ${OFFLOAD_EXTRA:-}
    phase_table colocated4 ;;
  pintests17) step pin_gpu_tests 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/unit/train/test_host_memory.py \
                tests/unit/train/test_offload.py ;;
  offload4_17) e2e colocated4_offload ${COLOCATED4_S:-220} resources.colocate=true rollout.num_rollouts=4 \
                 resources.offload_trainer=true ${OFFLOAD_EXTRA:-}
               phase_table colocated4_offload ;;
  pin17) step pin_memory 240 python3 bench/pin_memory.py ${PIN_METHODS:+--methods $PIN_METHODS} ;;
  offloadtests17) step offload_gpu_test 240 python3 -m pytest -q -p no:cacheprovider -m gpu tests/unit/train/test_offload.py \
      tests/gpu/test_runs_gpu.py -k "offload" ;;
  offloadrun17)  # the small colocated run with the offload, with the allocator's expandable segments and without
    step offload_run_test 150 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_runs_gpu.py -k offload
    step offload_run_test_expandable 150 env PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True \
      python3 -m pytest -q -p no:cacheprovider tests/gpu/test_runs_gpu.py -k offload
    grep -h "^E  " "$LOGS/offload_run_test.log" "$LOGS/offload_run_test_expandable.log" | head -8 ;;
  offloadparts17)
    e2e colocated4_offload_noprefetch ${COLOCATED4_S:-220} resources.colocate=true rollout.num_rollouts=4 \
      resources.offload_trainer=true trainer.backend.offload_overlap=false
    phase_table colocated4_offload_noprefetch ;;
  startup17)  # the engines on hf-init's model files (the default) first, then on the trainer's initial weights
    e2e startup_files ${STARTUP_S:-200} resources.colocate=true resources.offload_trainer=true rollout.num_rollouts=2 \
      ${OFFLOAD_EXTRA:-}
    e2e startup_weights ${STARTUP_S:-200} resources.colocate=true resources.offload_trainer=true rollout.num_rollouts=2 \
      checkpoint.hf_init_weights=true ${OFFLOAD_EXTRA:-}
    phase_table startup_files; phase_table startup_weights ;;
  warm17)  # the engines warmed for the run's sampling before they answer (the default), then not (step 0 does it)
    e2e warm_on ${STARTUP_S:-200} resources.colocate=true resources.offload_trainer=true rollout.num_rollouts=2 \
      ${OFFLOAD_EXTRA:-}
    e2e warm_off ${STARTUP_S:-200} resources.colocate=true resources.offload_trainer=true rollout.num_rollouts=2 \
      rollout.engine.warm_up=false ${OFFLOAD_EXTRA:-}
    phase_table warm_on; phase_table warm_off ;;
  warmdisagg17) e2e warm_disagg_on 190 rollout.num_rollouts=2; e2e warm_disagg_off 190 rollout.num_rollouts=2 \
                  rollout.engine.warm_up=false
                phase_table warm_disagg_on; phase_table warm_disagg_off ;;
  startupdisagg17) e2e startup_disagg_files 190 rollout.num_rollouts=2
                   e2e startup_disagg_weights 190 rollout.num_rollouts=2 checkpoint.hf_init_weights=true ;;
  colocated5) e2e colocated5 ${COLOCATED5_S:-330} resources.colocate=true rollout.num_rollouts=5
              grep -rh "stable memory off" $LOGS/runs 2>/dev/null | head -2 ;;
  colocated5c) e2e colocated5c ${COLOCATED5_S:-330} resources.colocate=true rollout.num_rollouts=5 rollout.engine.compile=true
               grep -rh "stable memory off" $LOGS/runs 2>/dev/null | head -2 ;;
  stable17) step stable17 150 python3 -c "
from posttrain.plugins.engines.local.vmm import vmm_supported
why = vmm_supported(0); print('vmm:', why or 'supported'); raise SystemExit(1 if why else 0)"
            step stable17_tests 150 python3 -m pytest -q -p no:cacheprovider tests/unit/rollout/test_rollout_gpu.py ;;
  levers17) e2e colocated_kl 200 resources.colocate=true trainer.log_kl=true
            e2e colocated_compiled_engine 300 resources.colocate=true rollout.engine.compile=true ;;
  trl_gpu) python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/trl .whl/trl/*.whl \
             && step trl_gpu ${TRL_S:-420} env PYTHONPATH=/tmp/site:/tmp/extra:/tmp/trl python3 bench/trl_gpu.py --steps 3 ;;
  disagg) e2e disagg_sync 190; e2e disagg_async 170 rollout.mode=async ;;
  shrunk) e2e shrunk 150 rollout.engine.device=cuda:1 resources.num_engines=2 rollout.use_router=true \
            rollout.engine.max_running_requests=256 rollout.num_rollouts=2 rollout.rollout_batch_size=32 \
            trainer.global_batch_size=256 rollout.max_new_tokens=256 ;;
  kernel) step kernel 90 python3 -m pytest -q -p no:cacheprovider -m gpu tests/unit/rollout/test_decode_kernel.py \
            tests/unit/rollout/test_decode_variants.py
          ROLLOUT_VARIANTS=triton,triton+compile; step rollout_triton 120 python3 bench/rollout.py --device cuda \
            --shape qwen3-1.7b --prompts 256 --prompt-len 128 --new-tokens 256 --skip-hf --profile --variants triton,triton+compile ;;
  diag17) step decode_parts 150 python3 bench/decode_parts.py --attention --gemms
          step rollout17 200 python3 bench/rollout.py --device cuda --shape qwen3-1.7b --prompts 256 --prompt-len 128 \
            --new-tokens 256 --skip-hf --profile --variants triton+compile --kernel-tables $LOGS/kernels17
          head -45 $LOGS/kernels17/*.txt ;;
  gputests) step gputests 170 python3 -m pytest -q -p no:cacheprovider tests/gpu ;;
  gputests17) step engine_gpu_tests 100 python3 -m pytest -q -p no:cacheprovider tests/unit/rollout/test_rollout_gpu.py \
                tests/unit/rollout/test_decode_variants.py
              step runs_gpu_tests 180 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_runs_gpu.py
              step equivalence_gpu_tests 230 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_equivalence_gpu.py ;;
  overlap17) step engine_gpu_tests 150 python3 -m pytest -q -p no:cacheprovider tests/unit/rollout/test_rollout_gpu.py \
               tests/unit/rollout/test_decode_variants.py -m gpu
             step rollout_overlap 330 python3 bench/rollout.py --device cuda --shape qwen3-1.7b --prompts 256 --prompt-len 128 \
               --new-tokens 256 --skip-hf --profile \
               --variants triton+compile,triton+compile+sync+unfused,triton+compile+sync,triton+compile+unfused ;;
  prefill17) step engine_gpu_tests 150 python3 -m pytest -q -p no:cacheprovider tests/unit/rollout/test_rollout_gpu.py \
               tests/unit/rollout/test_decode_variants.py -m gpu
             step rollout_prefill 200 python3 bench/rollout.py --device cuda --shape qwen3-1.7b --prompts 256 --prompt-len 128 \
               --new-tokens 256 --skip-hf --profile --variants triton+compile,triton ;;
  decode17b) step kernel_gpu_tests 150 python3 -m pytest -q -p no:cacheprovider -m gpu \
               tests/unit/rollout/test_decode_kernel.py tests/unit/rollout/test_sampling_kernel.py
             step rollout_levers ${LEVERS_S:-330} python3 bench/rollout.py --device cuda --shape qwen3-1.7b --prompts 256 \
               --prompt-len 128 --new-tokens 256 --skip-hf --profile --kernel-tables "$LOGS/kernels" \
               --variants ${DECODE_VARIANTS:-triton+compile,triton+compile+kvwrites+torchsample+prefill8k,triton+compile+kvwrites,triton+compile+torchsample,triton+compile+prefill8k}
             head -n 45 "$LOGS/kernels/triton+compile.txt" | cut -c1-180
             step engine_gpu_tests 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/unit/rollout/test_rollout_gpu.py \
               tests/unit/rollout/test_decode_variants.py tests/unit/rollout/test_engine_overlap.py \
               tests/unit/rollout/test_fused_projections.py ;;
  decode17c) step kernel_gpu_tests 150 python3 -m pytest -q -p no:cacheprovider -m gpu \
               tests/unit/rollout/test_decode_kernel.py tests/unit/rollout/test_sampling_kernel.py
             step rollout_levers 200 python3 bench/rollout.py --device cuda --shape qwen3-1.7b --prompts 256 \
               --prompt-len 128 --new-tokens 256 --skip-hf --profile --kernel-tables "$LOGS/kernels" \
               --variants triton+compile,triton+compile+kvwrites,triton+compile+kvwrites+torchsample+prefill8k
             head -n 30 "$LOGS/kernels/triton+compile.txt" | cut -c1-180
             step engine_gpu_tests 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/unit/rollout/test_rollout_gpu.py \
               tests/unit/rollout/test_decode_variants.py tests/unit/rollout/test_engine_overlap.py \
               tests/unit/rollout/test_fused_projections.py
             step colocated_test 150 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_runs_gpu.py -k colocated
             step rollout_autotune ${AUTOTUNE_S:-150} python3 bench/rollout.py --device cuda --shape qwen3-1.7b \
               --prompts 256 --prompt-len 128 --new-tokens 256 --skip-hf --profile --variants triton+autotune ;;
  decode17d) step gemm_backends 150 python3 bench/decode_parts.py --gemm-backends
             step rollout_joined ${ROLLOUT_S:-240} python3 bench/rollout.py --device cuda --shape qwen3-1.7b --prompts 256 \
               --prompt-len 128 --new-tokens 256 --skip-hf --profile --kernel-tables "$LOGS/kernels" \
               --variants ${VARIANTS:-triton+compile,triton+compile+unjoined}
             head -n 30 "$LOGS/kernels/triton+compile.txt" | cut -c1-180
             head -n 24 "$LOGS/kernels/triton+compile.prefill.txt" | cut -c1-180
             step engine_gpu_tests 170 python3 -m pytest -q -p no:cacheprovider -m gpu tests/unit/rollout/test_rollout_gpu.py \
               tests/unit/rollout/test_decode_variants.py tests/unit/rollout/test_engine_overlap.py \
               tests/unit/rollout/test_fused_projections.py tests/unit/rollout/test_sampling_kernel.py ;;
  decode17e) step kernel_gpu_tests 150 python3 -m pytest -q -p no:cacheprovider -m gpu \
               tests/unit/rollout/test_decode_kernel.py tests/unit/rollout/test_sampling_kernel.py
             step engine_gpu_tests 170 python3 -m pytest -q -p no:cacheprovider -m gpu tests/unit/rollout/test_rollout_gpu.py \
               tests/unit/rollout/test_decode_variants.py tests/unit/rollout/test_engine_overlap.py \
               tests/unit/rollout/test_fused_projections.py
             step attention_equal 90 python3 bench/decode_parts.py --attention --equal-lengths --quick
             grep -h '^{' "$LOGS/attention_equal.log" | python3 -c "import sys, json; rows = [json.loads(l) for l in sys.stdin]; \
               [print(r) for r in sorted((r for r in rows if 'us' in r), key=lambda r: r['us'])[:5]]"
             step rollout_e ${ROLLOUT_S:-200} python3 bench/rollout.py --device cuda --shape qwen3-1.7b --prompts 256 \
               --prompt-len 128 --new-tokens 256 --skip-hf --profile --kernel-tables "$LOGS/kernels" \
               --variants ${VARIANTS:-triton+compile,triton+compile+aftersample} ;;
  decode17f) step kernel_gpu_tests 120 python3 -m pytest -q -p no:cacheprovider -m gpu tests/unit/rollout/test_sampling_kernel.py
             step attention_write 90 python3 bench/decode_parts.py --attention --equal-lengths --quick --write-new
             grep -h '^{' "$LOGS/attention_write.log" | python3 -c "import sys, json; rows = [json.loads(l) for l in sys.stdin]; \
               [print(r) for r in sorted((r for r in rows if 'us' in r), key=lambda r: r['us'])[:4]]"
             step rollout_f ${ROLLOUT_S:-200} python3 bench/rollout.py --device cuda --shape qwen3-1.7b --prompts 256 \
               --prompt-len 128 --new-tokens 256 --skip-hf --profile \
               --variants ${VARIANTS:-triton+compile,triton+compile+stages3,triton+compile+combo} ;;
  decode17g) engine_tests; bench_shape rollout_g triton+compile,triton+compile+nocombo,triton+compile+stages2 ;;
  decode17h) step kernel_gpu_tests 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/unit/rollout/test_decode_kernel.py
             step attention_grouped ${ATTENTION_S:-200} python3 bench/decode_parts.py --attention --equal-lengths --quick \
               --write-new --slots-per-program ${ATTN_GROUPS:-1,2,4,8}
             grep -h '^{' "$LOGS/attention_grouped.log" | python3 -c "import sys, json; rows = [json.loads(l) for l in sys.stdin]; \
               [print(r) for b in ('read_ceiling', 'decode_attention') for p in (1, 2, 4, 8) for r in sorted((r for r in rows \
               if 'us' in r and r['bench'] == b and r.get('slots_per_program', 1) == p), key=lambda r: r['us'])[:2 if b == 'decode_attention' else 1 if p == 1 else 0]]"
             bench_shape rollout_h triton+compile,triton+compile+group4,triton+compile+group8 ;;
  decode17i) engine_tests; bench_shape rollout_i triton+compile,triton+compile+group1,triton+compile ;;
  decode17j) step kernel_gpu_tests 180 python3 -m pytest -q -p no:cacheprovider -m gpu tests/unit/rollout/test_decode_kernel.py
             KT="--kernel-tables $LOGS/kernels" bench_shape rollout_j triton+compile,triton+compile+ropeapart,triton+compile
             head -n 32 "$LOGS/kernels/triton+compile.txt" | cut -c1-180
             head -n 32 "$LOGS/kernels/triton+compile+ropeapart.txt" | cut -c1-180 ;;
  decode17o) step kernel_gpu_tests 180 python3 -m pytest -q -p no:cacheprovider -m gpu tests/unit/rollout/test_decode_kernel.py
             for rope in --rope ""; do
               step attention_o${rope:+_rope} 150 python3 bench/decode_parts.py --attention --equal-lengths --write-new $rope \
                 --no-ceiling --slots-per-program 8 --settings 64x4x3,64x4x4 ${BASELINE_KERNEL:+--kernel-files $BASELINE_KERNEL}
             done
             bench_shape rollout_o triton+compile,triton+compile+ropeapart,triton+compile+stages4,triton+compile ;;
  attention17) step kernel_gpu_tests 180 python3 -m pytest -q -p no:cacheprovider -m gpu tests/unit/rollout/test_decode_kernel.py
               step attention_17 150 python3 bench/decode_parts.py --attention --equal-lengths --write-new --rope \
                 --no-ceiling --slots-per-program ${ATTN_GROUPS:-8} --settings ${ATTN_SETTINGS:-64x4x3} \
                 ${BASELINE_KERNEL:+--kernel-files $BASELINE_KERNEL}
               grep -h '^{' "$LOGS/attention_17.log" | python3 -c "import sys, json; rows = [json.loads(l) for l in sys.stdin]; \
                 [print(r.get('kernel'), r['slots_per_program'], r['block_n'], r['num_warps'], r['num_stages'], r.get('us'), \
                 r.get('fraction_of_bound'), r.get('error', '')) for r in sorted(rows, key=lambda r: r.get('us', 1e9))]"
               bench_shape rollout_17 ${VARIANTS:-triton+compile} ;;
  decode17p) engine_tests
             bench_shape rollout_p triton+compile,triton+compile+prefillcopy,triton+compile+switch100us,triton+compile ;;
  decode17q) bench_shape rollout_q triton+compile,triton+compile
             e2e colocated5 ${COLOCATED5_S:-330} resources.colocate=true rollout.num_rollouts=5 ;;
  decode17r) bench_shape rollout_r triton+compile,triton+compile,triton+compile ;;
  symbatch17) for v in triton+compile+staticbatch triton+compile; do  # each in its own process, its caches empty
                export TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) TRITON_CACHE_DIR=$(mktemp -d)
                bench_shape "cold_${v//+/_}" "$v"
              done
              unset TORCHINDUCTOR_CACHE_DIR TRITON_CACHE_DIR
              bench_shape rollout_sym triton+compile+staticbatch,triton+compile,triton+compile+staticbatch,triton+compile ;;
  sampling17) step sampling_gpu_tests 120 python3 -m pytest -q -p no:cacheprovider -m gpu tests/unit/rollout/test_sampling_kernel.py
              step sampler 60 python3 bench/decode_parts.py --sampling ${BASELINE_KERNEL:+--kernel-files $BASELINE_KERNEL}
              bench_shape rollout_s triton+compile,triton+compile ;;
  decode17n) bench_shape rollout_n triton+compile,triton+compile+ropeapart,triton+compile
             e2e colocated5 ${COLOCATED5_S:-330} resources.colocate=true rollout.num_rollouts=5 ;;
  decode17m) step engine_gpu_tests 170 python3 -m pytest -q -p no:cacheprovider -m gpu tests/unit/rollout/test_rollout_gpu.py \
               tests/unit/rollout/test_decode_variants.py tests/unit/rollout/test_engine_overlap.py \
               tests/unit/rollout/test_fused_projections.py tests/unit/rollout/test_sampling_kernel.py
             bench_shape rollout_m triton+compile,triton+compile+poshost,triton+compile ;;
  decode17l) engine_tests
             bench_shape rollout_l triton+compile,triton+compile+poshost,triton+compile+ropeapart,triton+compile ;;
  decode17k) python3 -c "import torch._inductor.config as c; print('inductor enable_pdl:', hasattr(c.triton, 'enable_pdl'))"
             engine_tests
             bench_shape rollout_k triton+compile,triton+compile+nopdl,triton+compile+inductorpdl,triton+compile+ropeapart,triton+compile ;;
  sampling17b) step sampling_gpu_tests 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/unit/rollout/test_sampling_kernel.py
               step sampler 200 python3 bench/decode_parts.py --sampling ${BASELINE_KERNEL:+--kernel-files $BASELINE_KERNEL} \
                 --settings ${SAMPLER_SETTINGS:-4096x8x4,4096x8x8,2048x8x4,2048x8x8,2048x4x8,1024x4x8,1024x4x16,1024x8x8,512x4x16}
               best=$(grep -h '^{"bench": "fused_sample"' "$LOGS/sampler.log" | python3 -c "import sys, json; \
                 rows = [json.loads(l) for l in sys.stdin]; rows = [r for r in rows if r['temperature'] == 0 and \
                 isinstance(r['launch'], dict)]; b = min(rows, key=lambda r: r['us'])['launch'] if rows else None; \
                 print('+sampler%dx%dx%d' % (b['block'], b['num_warps'], b['programs_per_sm']) if b else '')")
               echo "fastest greedy launch: ${best:-none}"
               bench_shape rollout_t triton+compile,triton+compile$best,triton+compile ;;
  sampling17c) step sampling_gpu_tests 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/unit/rollout/test_sampling_kernel.py
               step sampler 200 python3 bench/decode_parts.py --sampling ${BASELINE_KERNEL:+--kernel-files $BASELINE_KERNEL} \
                 --settings ${SAMPLER_SETTINGS:-1024x4x16,1024x4x8,1024x4x32,2048x4x8,2048x4x16,2048x8x8,512x4x16,4096x8x4}
               bench_shape rollout_u triton+compile,triton+compile ;;
  ragged17) for mean in 256 1024; do
               step attention_ragged_$mean 150 python3 bench/decode_parts.py --attention --quick --write-new \
                 --shuffled-lengths --mean-context $mean --slots-per-program ${ATTN_GROUPS:-1,4,8}
               grep -h '^{"bench": "decode_attention"' "$LOGS/attention_ragged_$mean.log" | python3 -c "import sys, json; \
                 rows = [json.loads(l) for l in sys.stdin]; [print(r) for p in (1, 4, 8) for r in sorted((r for r in rows \
                 if 'us' in r and r['slots_per_program'] == p and r['num_splits'] == 1), key=lambda r: r['us'])[:2]]"
             done ;;
  autotune17) step rollout_autotune ${AUTOTUNE_S:-330} python3 bench/rollout.py --device cuda --shape qwen3-1.7b \
                --prompts 256 --prompt-len 128 --new-tokens 256 --skip-hf --profile --variants triton+autotune
              grep -h "^AUTOTUNE\|^  mm \|^  triton_mm" "$LOGS/rollout_autotune.log" | grep -A1 "^AUTOTUNE" | cut -c1-60 ;;
  gpuruns17) step runs_gpu_tests 200 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_runs_gpu.py
             step equivalence_gpu_tests 320 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_equivalence_gpu.py ;;
  engine17s) step graphs_gpu_tests 170 python3 -m pytest -q -p no:cacheprovider -m gpu tests/unit/rollout/test_graphs.py \
               tests/unit/rollout/test_decode_variants.py -k "graph or compile or warm"
             export TORCH_LOGS=recompiles; e2e colocated5 ${COLOCATED5_S:-250} resources.colocate=true rollout.num_rollouts=5
             unset TORCH_LOGS
             python3 -c "import json; rows = [json.loads(l) for l in open('$LOGS/runs/colocated5-metrics.jsonl')]; \
               keys = ['perf/time_generate'] + sorted(k for k in rows[0] if k.startswith('engine/')); \
               print('step', *keys); [print(r['step'], *(round(r.get(k, -1), 3) for k in keys)) for r in rows]"
             bench_shape rollout_e triton+compile ;;
  trainer17) step compile_equivalence 170 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_equivalence_gpu.py -k compile
             export TORCH_LOGS=recompiles,graph_breaks; e2e colocated5 ${COLOCATED5_S:-250} resources.colocate=true rollout.num_rollouts=5
             unset TORCH_LOGS
             echo "trainer recompiles: $(grep -c '\[__recompiles\] Recompiling' "$LOGS/runs/colocated5.out")," \
               "graph breaks: $(grep -c '\[__graph_breaks\] Graph break' "$LOGS/runs/colocated5.out")"
             grep -h '\[__graph_breaks\] Graph break in user code' "$LOGS/runs/colocated5.out" | sed 's/.*user code at //' \
               | sort | uniq -c | head -8
             python3 -c "import json; rows = [json.loads(l) for l in open('$LOGS/runs/colocated5-metrics.jsonl')]; \
               [print(r['step'], *(round(r.get(k, -1), 2) for k in ('perf/step_time', 'perf/time_generate', \
               'perf/time_train', 'engine/prefill_s', 'engine/graph_capture_s'))) for r in rows]" ;;
  offloadtest1) step offloaded_run_test ${OFFLOADED_TEST_S:-560} python3 -m pytest -q -x -rf --durations=0 -p no:cacheprovider \
                  tests/gpu/test_runs_gpu.py -k offloaded ;;
  colocated_test) step colocated_test ${COLOCATED_TEST_S:-330} python3 -m pytest -q -p no:cacheprovider tests/gpu/test_runs_gpu.py -k colocated ;;
  compiled_gpu_tests) step compiled_gpu_tests 170 python3 -m pytest -q -p no:cacheprovider -m gpu \
                        tests/unit/rollout/test_decode_variants.py -k compile ;;
  moe_train)
    M="--device cuda --spec qwen3_moe --preset qwen3-30B-A3B --layers $MOE_LAYERS --seq-len 2048 --steps 2 --warmup 1
       --sdpa-gqa --keep-logits --fused-adam"
    step moe_train 120 env PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True python3 bench/train.py $M \
      --micro-batch 4 --grad-accum 2 --profile --kernel-table $LOGS/kt_moe_train.txt
    if [ "${MOE_RETRY:-1}" = 1 ] && ! grep -q '^{' "$LOGS/moe_train.log" && grep -q "out of memory\|OutOfMemoryError" "$LOGS/moe_train.log"; then
      # no line and out of memory: the same tokens per step in smaller micro-batches
      step moe_train_mb2 120 env PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True python3 bench/train.py $M \
        --micro-batch 2 --grad-accum 4
    fi ;;
  moe_experts)
    step moe_experts_test 200 python3 -m pytest -q -rf -p no:cacheprovider -m gpu tests/unit/train/test_grouped_experts.py \
      tests/unit/rollout/test_moe_kernel.py
    step moe_experts_train 330 env PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True python3 bench/train.py \
      --device cuda --spec qwen3_moe --preset qwen3-30B-A3B --layers $MOE_LAYERS --seq-len 2048 --steps 2 --warmup 1 \
      --sdpa-gqa --keep-logits --fused-adam --micro-batch 4 --grad-accum 2 --profile --experts both
    step moe_experts_rollout 200 python3 bench/rollout.py --device cuda --shape qwen3-30b-a3b \
      --layers $MOE_ROLLOUT_LAYERS --prompts 256 --prompt-len 128 --new-tokens 256 --skip-hf --profile \
      --variants triton+moehf,triton+moekernel --kernel-tables $LOGS/kernels_moe_experts ;;
  moe_rollout) step moe_rollout 100 python3 bench/rollout.py --device cuda --shape qwen3-30b-a3b \
                 --layers $MOE_ROLLOUT_LAYERS --prompts 256 --prompt-len 128 --new-tokens 256 --skip-hf --profile \
                 --variants triton --kernel-tables $LOGS/kernels_moe ;;
  moe_grpo) step moe_grpo 210 python3 bench/e2e.py --config $MOE_CFG --name moe_grpo --keep "$LOGS/runs" \
              model.overrides.num_hidden_layers=$MOE_LAYERS ;;
  halves17) step halves 120 python3 bench/decode_parts.py --overlap ;;
  recompile17) step trainer_recompile_test 240 python3 -m pytest -q -rf -p no:cacheprovider tests/unit/train/test_gpu.py \
                 -k small_micro_batch ;;
  memory17) step graphs_gpu_tests 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/unit/rollout/test_graphs.py
            e2e colocated5 ${COLOCATED5_S:-250} resources.colocate=true rollout.num_rollouts=5
            phase_table colocated5 ;;
  *) echo "unknown part $part"; exit 2 ;;
esac; done
finish
