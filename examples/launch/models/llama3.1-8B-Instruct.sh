# Llama-3.1-8B-Instruct: Llama 3 RoPE scaling (HF rope_scaling of rope_type llama3, factor 8). --use-rope-scaling
# builds it; --rotary-scaling-factor is what public Llama 3.1 flag files pass beside it (Megatron reads it only for
# multi-latent attention, so it has no effect, and a value other than the model's factor is refused before Ray).
MODEL_ARGS=(
   --swiglu --num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336
   --num-attention-heads 32 --group-query-attention --num-query-groups 8
   --max-position-embeddings 131072 --use-rotary-position-embeddings --disable-bias-linear
   --normalization "RMSNorm" --norm-epsilon 1e-5 --rotary-base 500000 --vocab-size 128256 --kv-channels 128
   --use-rope-scaling --rotary-scaling-factor 8.0 --untie-embeddings-and-output-weights
)
