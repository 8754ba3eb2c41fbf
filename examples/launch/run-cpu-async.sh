#!/usr/bin/env bash
# The fully-async launch script (run-grpo-fully-async.sh), unchanged in what it asks, scaled down to CPU for 2
# steps: the embedded default's tiny model (flag file models/tiny-cpu.sh) and task, 2 trainer ranks (tensor
# parallel 2 with sequence parallelism; EP=1, the tiny model is dense) and 1 embedded engine on devices of their
# own, 2 prompts x 2 samples a step, 3 prompts requested at a time (the script's 1.5x over-sampling) through its
# dynamic-sampling filter. The rest stays: --max-staleness 2, 4 storage units, 2 optimizer steps per rollout, the
# KL loss against the reference, TIS, full recompute, dynamic batching, health checks and engine fault tolerance;
# its SGLang server sizes are accepted with a warning (no effect on the embedded engine).
# Why tensor parallel 2, not the script's 4: with --fully-async the reference is a role of its own (one rank per
# actor rank; it may run beside an update), so 4 would start 8 Megatron processes. That runs too (add
# --tensor-model-parallel-size 4 --resource '{"actor": [1, 4], "rollout": [1, 1]}'), but on 2 cores it took
# ~130-155 CPU-seconds against ~80 for 2, as much as the colocated run-cpu.sh.
# Two hooks of the script differ from its GPU defaults:
#   HF_MODE=raw      NVIDIA Megatron-Bridge (bridge) needs Transformer Engine and CUDA; raw is Relax's own
#                    Megatron -> HF converter for the weight pushes.
#   GPU_OPTIMIZER=0  --optimizer-cpu-offload, --overlap-cpu-optimizer-d2h-h2d and --use-precision-aware-optimizer
#                    move the optimizer's state off the GPU or run it in Transformer Engine's fused Adam; a
#                    CPU-only run refuses them with that reason (its state is in CPU memory already).
# Flags after the script's own override its GPU-sized values.
# Usage: bash examples/launch/run-cpu-async.sh OUT_DIR [extra flags...]
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
OUT="${1:?usage: run-cpu-async.sh OUT_DIR [extra flags...]}"
shift
PYTHON="${PYTHON:-$HERE/../../.venv/bin/python}"
"$PYTHON" -c "import sys; from relax.models.embedded import build_embedded_assets; \
build_embedded_assets(sys.argv[1] + '/model', sys.argv[1] + '/train.jsonl', seed=234)" "$OUT/assets" >/dev/null
MODEL=tiny-cpu EP=1 HF_MODE=raw GPU_OPTIMIZER=0 DATA="$OUT/assets/train.jsonl" \
  RELAX_TRAIN="$PYTHON -m relax.entrypoints.train" bash "$HERE/run-grpo-fully-async.sh" \
  --hf-checkpoint "$OUT/assets/model" --ref-load "$OUT/assets/model" --save "$OUT/ckpt" \
  --input-key input --rm-type exact_match --num-rollout 2 --rollout-batch-size 2 --n-samples-per-prompt 2 \
  --over-sampling-batch-size 3 --rollout-max-response-len 8 --resource '{"actor": [1, 2], "rollout": [1, 1]}' \
  --tensor-model-parallel-size 2 --rollout-num-gpus-per-engine 1 --tb-project-name "$OUT/tensorboard" \
  --distributed-backend gloo --output-dir "$OUT/run" "$@"
