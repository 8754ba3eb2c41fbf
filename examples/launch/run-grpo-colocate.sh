#!/usr/bin/env bash
# GRPO, colocated on one 8-GPU node: trainer and engines share the GPUs and take turns.
# Usage: MODEL=qwen3-4B bash examples/launch/run-grpo-colocate.sh [extra flags...]
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
MODEL="${MODEL:-qwen3-4B}"
source "$HERE/models/$MODEL.sh"
DATA="${DATA:-/root/data/dapo-math-17k.jsonl}"

CKPT_ARGS=(--hf-checkpoint "/root/models/$MODEL" --ref-load "/root/models/${MODEL}_torch_dist"
           --load "/root/ckpt/$MODEL-grpo" --save "/root/ckpt/$MODEL-grpo" --save-interval 20)
ROLLOUT_ARGS=(--prompt-data "$DATA" --input-key prompt --label-key label --apply-chat-template
              --rollout-shuffle --rm-type deepscaler --num-rollout 3000 --rollout-batch-size 32
              --n-samples-per-prompt 8 --rollout-max-response-len 8192 --rollout-temperature 1.0
              --global-batch-size 256 --balance-data)
PERF_ARGS=(--tensor-model-parallel-size 2 --sequence-parallel --pipeline-model-parallel-size 1
           --context-parallel-size 1 --expert-model-parallel-size 1 --expert-tensor-parallel-size 1
           --recompute-granularity full --recompute-method uniform --recompute-num-layers 1
           --use-dynamic-batch-size --max-tokens-per-gpu 9216)
GRPO_ARGS=(--advantage-estimator grpo --use-kl-loss --kl-loss-coef 0.00 --kl-loss-type low_var_kl
           --entropy-coef 0.00 --eps-clip 0.2 --eps-clip-high 0.28)
OPTIMIZER_ARGS=(--optimizer adam --lr 1e-6 --lr-decay-style constant --weight-decay 0.1
                --adam-beta1 0.9 --adam-beta2 0.98)
SGLANG_ARGS=(--rollout-num-gpus-per-engine 2 --sglang-mem-fraction-static 0.7)
MISC_ARGS=(--attention-dropout 0.0 --hidden-dropout 0.0 --accumulate-allreduce-grads-in-fp32
           --attention-softmax-in-fp32 --attention-backend flash --colocate
           --resource '{"actor": [1, 8], "rollout": [1, 8]}' --use-tensorboard --tb-project-name relax)

${RELAX_TRAIN:-relax-train} "${MODEL_ARGS[@]}" "${CKPT_ARGS[@]}" "${ROLLOUT_ARGS[@]}" "${PERF_ARGS[@]}" \
  "${GRPO_ARGS[@]}" "${OPTIMIZER_ARGS[@]}" "${SGLANG_ARGS[@]}" "${MISC_ARGS[@]}" "$@"
