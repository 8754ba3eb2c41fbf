#!/usr/bin/env bash
# Fully asynchronous GRPO on two 8-GPU nodes: trainer and engines on separate GPUs, bounded staleness.
# Usage: MODEL=qwen3-30B-A3B bash examples/launch/run-grpo-fully-async.sh [extra flags...]
# (EP=1 for a dense model: expert parallelism needs experts)
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
MODEL="${MODEL:-qwen3-30B-A3B}"
source "$HERE/models/$MODEL.sh"
DATA="${DATA:-/root/data/dapo-math-17k.jsonl}"
# Megatron -> HF weight conversion for the engines' weight pushes: NVIDIA Megatron-Bridge on GPUs. It needs
# Transformer Engine and CUDA, so a CPU run (run-cpu-async.sh) sets HF_MODE=raw, Relax's own converter.
HF_MODE="${HF_MODE:-bridge}"

CKPT_ARGS=(--hf-checkpoint "/root/models/$MODEL" --ref-load "/root/models/${MODEL}_torch_dist"
           --save "/root/ckpt/$MODEL-async" --save-interval 50 --megatron-to-hf-mode "$HF_MODE")
ROLLOUT_ARGS=(--prompt-data "$DATA" --input-key prompt --label-key label --apply-chat-template
              --rollout-shuffle --rm-type math --num-epoch 2 --rollout-batch-size 64
              --n-samples-per-prompt 8 --rollout-max-response-len 16384 --rollout-temperature 1.0
              --over-sampling-batch-size 96
              --dynamic-sampling-filter-path relax.engine.filters.dynamic_sampling_filters.check_reward_nonzero_std
              --num-steps-per-rollout 2)
ASYNC_ARGS=(--fully-async --max-staleness 2 --num-data-storage-units 4
            --resource '{"actor": [1, 8], "rollout": [1, 8]}')
PERF_ARGS=(--tensor-model-parallel-size 4 --sequence-parallel --expert-model-parallel-size "${EP:-8}"
           --expert-tensor-parallel-size 1 --recompute-granularity full --recompute-method uniform
           --recompute-num-layers 1 --use-dynamic-batch-size --max-tokens-per-gpu 16384)
# Optimizer-state memory savers that exist only on GPUs (state moved from GPU memory to the CPU, copies overlapped
# on CUDA streams, Transformer Engine's fused Adam); a CPU-only run refuses them with the reason, so
# GPU_OPTIMIZER=0 (run-cpu-async.sh) leaves them out.
GPU_OPTIMIZER_ARGS=(--optimizer-cpu-offload --overlap-cpu-optimizer-d2h-h2d --use-precision-aware-optimizer)
if [[ "${GPU_OPTIMIZER:-1}" == 0 ]]; then GPU_OPTIMIZER_ARGS=(); fi
GRPO_ARGS=(--advantage-estimator grpo --use-kl-loss --kl-loss-coef 0.001 --kl-loss-type low_var_kl
           --eps-clip 0.2 --eps-clip-high 0.28 --use-tis --tis-clip 2.0)
OPTIMIZER_ARGS=(--optimizer adam --lr 1e-6 --lr-decay-style constant --weight-decay 0.1
                --adam-beta1 0.9 --adam-beta2 0.98)
SGLANG_ARGS=(--rollout-num-gpus-per-engine 8 --sglang-mem-fraction-static 0.8 --sglang-enable-dp-attention
             --sglang-dp-size 8 --sglang-ep-size 8 --sglang-cuda-graph-bs 1 2 4 8 16 24 32 64 128
             --sglang-moe-a2a-backend deepep --sglang-router-policy cache_aware)
MISC_ARGS=(--attention-dropout 0.0 --hidden-dropout 0.0 --accumulate-allreduce-grads-in-fp32
           --attention-softmax-in-fp32 --attention-backend flash --use-health-check
           --use-fault-tolerance --use-tensorboard --tb-project-name relax)

${RELAX_TRAIN:-relax-train} "${MODEL_ARGS[@]}" "${CKPT_ARGS[@]}" "${ROLLOUT_ARGS[@]}" "${ASYNC_ARGS[@]}" \
  "${PERF_ARGS[@]}" "${GPU_OPTIMIZER_ARGS[@]}" "${GRPO_ARGS[@]}" "${OPTIMIZER_ARGS[@]}" "${SGLANG_ARGS[@]}" \
  "${MISC_ARGS[@]}" "$@"
