#!/usr/bin/env bash
# Multi-turn tool use (calculator) with GRPO on CPU: the tiny embedded model, one engine, two steps.
# Usage: bash examples/multiturn/run-cpu.sh [extra relax-train flags...]
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
OUT="${OUT:-$ROOT/runs/multiturn}"
PY="${PY:-$ROOT/.venv/bin/python}"
mkdir -p "$OUT"
"$PY" - "$OUT" <<'PY'
import json, sys
from pathlib import Path
from relax.models.tiny import TinyArch, build_tiny_model_dir
out = Path(sys.argv[1])
if not (out / "model" / "config.json").is_file():
    build_tiny_model_dir(out / "model", TinyArch(family="qwen2"), seed=0)
rows = [{"input": f"Use calc(...) to compute {a}+{b}.", "label": str(a + b), "metadata": {"max_turns": 3}}
        for a in range(4) for b in range(4)]
(out / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
PY
cd "$ROOT"
PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" "$ROOT/.venv/bin/relax-train" \
  --hf-checkpoint "$OUT/model" --prompt-data "$OUT/prompts.jsonl" --apply-chat-template --label-key label \
  --custom-generate-function-path examples.multiturn.tool_generate.generate \
  --custom-rm-path examples.multiturn.tool_generate.reward --log-multi-turn \
  --rollout-batch-size 4 --n-samples-per-prompt 4 --num-rollout 2 --rollout-max-response-len 96 \
  --micro-batch-size 4 --lr 1e-4 --lr-decay-style constant --distributed-backend gloo \
  --resource '{"actor": [1, 1], "rollout": [1, 1]}' --output-dir "$OUT/run" "$@"
