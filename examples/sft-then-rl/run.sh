#!/usr/bin/env bash
# SFT, then RL, on the quickstart task (README "SFT and on-policy distillation"):
#   1. SFT the quickstart's tiny random model on correct "a+b=" answers for a few seconds (sft.yaml, no engines);
#   2. GRPO from its RUN_DIR/hf-final with the quickstart's own config (examples/quickstart.yaml);
#   3. print how many RL steps reached reward 0.8 (compare with the quickstart from random init).
# Stages chain through run directories under $RUNS. SMOKE=1 runs every stage for two steps.
#   bash examples/sft-then-rl/run.sh          (after `pip install -e .`; RL_CLI=/path/to/rl-cli to pick one)
set -euo pipefail
cd "$(dirname "$0")/../.."
RL_CLI=${RL_CLI:-rl-cli}
PYTHON=${PYTHON:-python}
RUNS=${RUNS:-runs/sft-then-rl-$(date +%Y%m%d-%H%M%S)}
SMOKE_ARGS=()
if [ "${SMOKE:-0}" = 1 ]; then SMOKE_ARGS=(--smoke); fi

"$RL_CLI" run examples/sft-then-rl/sft.yaml --run-dir "$RUNS/sft" "${SMOKE_ARGS[@]}"
"$RL_CLI" run examples/quickstart.yaml --run-dir "$RUNS/rl" model.path="$RUNS/sft/hf-final" "${SMOKE_ARGS[@]}"
"$PYTHON" bench/pipelines.py steps-to "$RUNS/rl" --reward 0.8
