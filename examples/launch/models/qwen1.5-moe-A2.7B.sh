# Qwen1.5-MoE-A2.7B (HF model_type qwen2_moe): 60 routed experts (top 4, weights not renormalised: norm_topk_prob
# false, hence --moe-router-pre-softmax) plus a shared expert whose output a sigmoid gate scales; QKV biases and
# no QK norm (what tells it from Qwen3-MoE).
MODEL_ARGS=(
   --disable-bias-linear --add-qkv-bias
   --num-attention-heads 16 --kv-channels 128
   --num-layers 24 --hidden-size 2048 --ffn-hidden-size 5632
   --normalization RMSNorm --position-embedding-type rope --norm-epsilon 1e-6 --rotary-percent 1.0
   --swiglu --untie-embeddings-and-output-weights --vocab-size 151936 --rotary-base 1000000
   --max-position-embeddings 8192
   --moe-ffn-hidden-size 1408 --moe-shared-expert-intermediate-size 5632 --moe-shared-expert-gate
   --moe-router-score-function softmax --moe-router-pre-softmax --moe-token-dispatcher-type alltoall
   --moe-router-topk 4 --moe-layer-freq "[1]*24" --num-experts 60 --moe-grouped-gemm
   --moe-token-drop-policy probs --moe-router-dtype fp32 --moe-permute-fusion --moe-aux-loss-coeff 0
)
