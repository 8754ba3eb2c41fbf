#!/usr/bin/env bash
# Smoke test of the GPU image (docker/Dockerfile), run inside it:
#   docker run --rm --gpus all --shm-size=16g relax:gpu bash docker/smoke-gpu.sh
# 1. the stack imports and sees a GPU; 2. relax-train validates a GPU configuration (--dry-run);
# 3. scripts/gpu-check.sh: three GRPO steps of a Qwen3-0.6B-shaped model with real SGLang and Megatron on
#    one GPU (about 8 minutes). SMOKE_QUICK=1 stops after step 2.
set -euo pipefail
cd "$(dirname "$0")/.."
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
python docker/check_image.py --torch "$(python -c 'import torch; print(torch.__version__.split("+")[0])')" --gpu-stack
python - <<'PY'
import torch
assert torch.cuda.is_available(), "torch sees no GPU: run the container with --gpus all"
import transformer_engine.pytorch  # noqa: F401  (loads the CUDA extension)
print(f"GPU ok: {torch.cuda.get_device_name(0)}, {torch.cuda.device_count()} device(s)")
PY
relax-train --output-dir /tmp/relax-smoke --dry-run --rollout-backend sglang --bf16 \
  --resource '{"actor": [1, 1], "rollout": [1, 1]}'
if [ "${SMOKE_QUICK:-0}" = 1 ]; then
  echo "smoke (quick) ok"
  exit 0
fi
bash scripts/gpu-check.sh
echo "smoke ok"
