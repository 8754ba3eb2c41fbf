# Nemotron-Mini-4B (HF model_type nemotron): a non-gated squared-ReLU MLP, zero-centred LayerNorms (layernorm1p)
# and RoPE on the two halves of the first half of each head (partial_rotary_factor 0.5).
MODEL_ARGS=(
   --squared-relu --apply-layernorm-1p --normalization LayerNorm --norm-epsilon 1e-5
   --num-layers 32 --hidden-size 3072 --ffn-hidden-size 9216
   --num-attention-heads 24 --group-query-attention --num-query-groups 8 --kv-channels 128
   --position-embedding-type rope --rotary-percent 0.5 --rotary-base 10000 --no-rope-fusion
   --max-position-embeddings 4096 --disable-bias-linear --untie-embeddings-and-output-weights --vocab-size 256000
)
