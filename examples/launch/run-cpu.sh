#!/usr/bin/env bash
# The colocated launch script, unchanged, scaled down to CPU: the embedded default's tiny model (flag file
# models/tiny-cpu.sh) and task, 2 trainer ranks (tensor parallel 2 with sequence parallelism, as the script
# asks), 2 embedded engines, 2 steps. Flags after the script's own override its GPU-sized values.
# Usage: bash examples/launch/run-cpu.sh OUT_DIR [extra flags...]
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
OUT="${1:?usage: run-cpu.sh OUT_DIR [extra flags...]}"
shift
PYTHON="${PYTHON:-$HERE/../../.venv/bin/python}"
"$PYTHON" -c "import sys; from relax.models.embedded import build_embedded_assets; \
build_embedded_assets(sys.argv[1] + '/model', sys.argv[1] + '/train.jsonl', seed=234)" "$OUT/assets" >/dev/null
MODEL=tiny-cpu DATA="$OUT/assets/train.jsonl" RELAX_TRAIN="$PYTHON -m relax.entrypoints.train" \
  bash "$HERE/run-grpo-colocate.sh" \
  --hf-checkpoint "$OUT/assets/model" --ref-load "$OUT/assets/model" --load "$OUT/ckpt" --save "$OUT/ckpt" \
  --input-key input --rm-type exact_match --num-rollout 2 --rollout-batch-size 4 --n-samples-per-prompt 2 \
  --global-batch-size 8 --rollout-max-response-len 8 --resource '{"actor": [1, 2], "rollout": [1, 2]}' \
  --rollout-num-gpus-per-engine 1 --tb-project-name "$OUT/tensorboard" --distributed-backend gloo \
  --output-dir "$OUT/run" "$@"
