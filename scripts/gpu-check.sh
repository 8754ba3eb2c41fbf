#!/usr/bin/env bash
# GPU check (one GPU, e.g. an H200): a randomly initialised Qwen3-0.6B-shaped model (no hub), real
# SGLang and Megatron-core (Transformer Engine spec when installed) on one GPU, three GRPO steps with
# weight sync, timings printed. Budget: 8 minutes.
#
# Status: written for the GPU machine but NOT yet run — no GPU was lent to the sessions that built it.
# Needs: bash scripts/setup.sh, then `.venv/bin/pip install sglang` (GPU build) on the GPU machine.
# Colocation (--colocate) is not built yet, so actor and engine share the GPU with a reduced
# --sglang-mem-fraction-static instead.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-runs/gpu-check}"
PY=.venv/bin/python
mkdir -p "$OUT"
start=$(date +%s)
$PY - "$OUT" <<'PYEOF'
import sys, time
from pathlib import Path
import torch
from transformers import AutoModelForCausalLM, Qwen3Config
from relax.models.tiny import build_byte_tokenizer
from relax.models.tasks import generate_task_dataset
out = Path(sys.argv[1]); t0 = time.time()
tok = build_byte_tokenizer()
cfg = Qwen3Config(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                  num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=4096,
                  rope_theta=1e6, tie_word_embeddings=True, dtype="bfloat16")
cfg.eos_token_id, cfg.pad_token_id = tok.eos_token_id, tok.pad_token_id
torch.manual_seed(0)
AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).save_pretrained(out / "model")
tok.save_pretrained(out / "model")
generate_task_dataset(out / "train.jsonl", 256, 0, task="successor")
print(f"[gpu-check] model + data in {time.time() - t0:.1f}s")
PYEOF
.venv/bin/relax-train --output-dir "$OUT/run" --hf-checkpoint "$OUT/model" --prompt-data "$OUT/train.jsonl" \
  --input-key input --label-key label --apply-chat-template --rm-type exact_match \
  --rollout-batch-size 32 --n-samples-per-prompt 8 --rollout-max-response-len 64 --num-rollout 3 \
  --micro-batch-size 8 --lr 1e-6 --bf16 --rollout-backend sglang \
  --sglang-mem-fraction-static 0.4 --resource '{"actor": [1, 1], "rollout": [1, 1]}'
python3 - "$OUT/run/metrics.jsonl" <<'PYEOF'
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    print(f"[gpu-check] step {r['step']}: step {r['perf/step_time']:.1f}s rollout {r['perf/rollout_time']:.1f}s "
          f"train {r['perf/train_time']:.1f}s sync {r['perf/weight_sync_time']:.2f}s reward {r['rollout/reward_mean']:.3f}")
PYEOF
echo "[gpu-check] total $(( $(date +%s) - start ))s"
