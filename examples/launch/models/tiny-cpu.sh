# The shape of the embedded default's tiny Qwen2 model (relax.models.tiny): for running the launch scripts
# scaled down on CPU (examples/launch/run-cpu.sh).
MODEL_ARGS=(
   --swiglu --num-layers 2 --hidden-size 64 --ffn-hidden-size 176
   --num-attention-heads 4 --group-query-attention --num-query-groups 2
   --use-rotary-position-embeddings --disable-bias-linear --add-qkv-bias --normalization "RMSNorm"
   --norm-epsilon 1e-6 --rotary-base 10000 --vocab-size 320 --kv-channels 16
   --untie-embeddings-and-output-weights --max-position-embeddings 512
)
