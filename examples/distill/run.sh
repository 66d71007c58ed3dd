#!/usr/bin/env bash
# On-policy distillation on the quickstart task (README "SFT and on-policy distillation"):
#   1. the teacher: the quickstart's GRPO run (examples/quickstart.yaml); its final weights as an HF checkpoint
#      (RUN_DIR/hf-final, or RUN_DIR/hf-latest, which rollout.weight_sync=disk keeps at the last step's weights);
#      TEACHER_RUN=runs/quickstart-... reuses a finished one;
#   2. the student: a fresh model half the teacher's width (qwen3 preset tiny-small) distilled on-policy
#      (distill.yaml: estimator opd, the teacher as a second engine fleet);
#   3. print the teacher's and the student's reward and the student's reverse KL, first and last steps.
# Stages chain through run directories under $RUNS. SMOKE=1 runs every stage for two steps.
#   bash examples/distill/run.sh              (after `pip install -e .`; RL_CLI=/path/to/rl-cli to pick one)
set -euo pipefail
cd "$(dirname "$0")/../.."
RL_CLI=${RL_CLI:-rl-cli}
PYTHON=${PYTHON:-python}
RUNS=${RUNS:-runs/distill-$(date +%Y%m%d-%H%M%S)}
SMOKE_ARGS=()
if [ "${SMOKE:-0}" = 1 ]; then SMOKE_ARGS=(--smoke); fi

TEACHER_RUN=${TEACHER_RUN:-$RUNS/teacher}
if [ ! -f "$TEACHER_RUN/metrics.jsonl" ]; then
  "$RL_CLI" run examples/quickstart.yaml --run-dir "$TEACHER_RUN" rollout.weight_sync=disk "${SMOKE_ARGS[@]}"
fi
TEACHER="$TEACHER_RUN/hf-final"
if [ ! -f "$TEACHER/config.json" ]; then TEACHER="$TEACHER_RUN/hf-latest"; fi
"$RL_CLI" run examples/distill/distill.yaml --run-dir "$RUNS/student" teacher.path="$TEACHER" "${SMOKE_ARGS[@]}"
"$PYTHON" bench/pipelines.py distill "$TEACHER_RUN" "$RUNS/student"
