#!/usr/bin/env bash
# SmolLM2-135M-Instruct as a generative reward model (GenRM) for the word-problem task, on CPU.
#   1. measure_judge.py: the judge's throughput and its agreement with the exact (last-number) reward on the same
#      samples, with the default judge prompt and with the yes/no prompt of judge_hooks.py;
#   2. a short GRPO run (SmolLM2 as the policy too) whose reward is the GenRM on engines of its own
#      (--rm-type genrm --genrm-model-path), with the yes/no hooks. STEPS=0 skips it.
# Usage: bash examples/genrm/run.sh [extra relax-train flags]   (after scripts/setup.sh)
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT="${OUT:-runs/genrm}"
MODEL="${MODEL:-runs/smollm2/model}"
PY=.venv/bin/python
bash scripts/fetch_smollm2.sh "$MODEL"
mkdir -p "$OUT"
HOOKS=(--template judge_hooks.yes_no_template --parser judge_hooks.yes_no_parser)
$PY examples/genrm/measure_judge.py --model "$MODEL" --prompts "${PROMPTS:-32}" --n 2 --judge-len 128 \
  --out "$OUT/judge_default.json"
$PY examples/genrm/measure_judge.py --model "$MODEL" --prompts "${PROMPTS:-32}" --n 2 --judge-len 8 "${HOOKS[@]}" \
  --out "$OUT/judge_yes_no.json"
if [ "${STEPS:-2}" -gt 0 ]; then
  $PY -c "from relax.models.tasks import generate_task_dataset as g; g('$OUT/train.jsonl', 64, 0, task='word_arith')"
  PYTHONPATH="$PWD/examples/genrm${PYTHONPATH:+:$PYTHONPATH}" .venv/bin/relax-train --output-dir "$OUT/run" \
    --hf-checkpoint "$MODEL" --prompt-data "$OUT/train.jsonl" --input-key input --label-key label \
    --apply-chat-template --rm-type genrm --genrm-model-path "$MODEL" \
    --genrm-template-path judge_hooks.yes_no_template --genrm-parser-path judge_hooks.yes_no_parser \
    --genrm-sampling-config '{"max_response_len": 8}' \
    --rollout-batch-size 4 --n-samples-per-prompt 4 --rollout-max-response-len 48 --rollout-temperature 1.0 \
    --num-rollout "${STEPS:-2}" --micro-batch-size 4 --lr 1e-6 --lr-decay-style constant \
    --distributed-backend gloo --rollout-shuffle "$@"
fi
