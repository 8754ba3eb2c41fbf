"""Checkpoint flags owned by Relax (--load/--save/--save-interval/--async-save/--no-save-optim are Megatron's)."""


def add_flags(parser):
    g = parser.add_argument_group("Checkpoints")
    g.add_argument("--hf-checkpoint", type=str, default=None,
                   help="Hugging Face model folder: tokenizer, engine initialisation and (without --load) the initial weights.")
    g.add_argument("--ref-load", type=str, default=None,
                   help="Reference model checkpoint; also the starting point for the actor when --load is unset.")
    g.add_argument("--ref-ckpt-step", type=int, default=None, help="Step of the reference checkpoint to load.")
    g.add_argument("--save-hf", type=str, default=None,
                   help="Also write Hugging Face weights here at each save; may contain {rollout_id}. With "
                        "--lora-rank: the PEFT adapter (adapter_config.json + adapter_model.safetensors) of the "
                        "--hf-checkpoint base.")
    g.add_argument("--rotate-ckpt", action="store_true", default=False,
                   help="Keep a bounded set of checkpoints, deleting old ones (needs --save, --save-interval, --async-save).")
    g.add_argument("--max-actor-ckpt-to-keep", type=int, default=None,
                   help="Keep at most this many actor checkpoints (oldest removed first).")
    g.add_argument("--checkpoint-engine-backend", type=str, default="nccl",
                   help="Backend of the checkpoint-engine weight service used in fully-async mode. Relax pushes weights "
                        "to engines over their HTTP API (/update_weights_from_tensor) in every mode; the "
                        "checkpoint-engine service is not built.")
    g.add_argument("--critic-load", type=str, default=None, help="Critic checkpoint to load (defaults to --load).")
    g.add_argument("--critic-save", type=str, default=None, help="Where to save the critic.")
