"""Other training, debug, network and run-control flags."""

from relax.config.types import byte_size, json_object


def add_flags(parser):
    g = parser.add_argument_group("Run control")
    g.add_argument("--custom-config-path", type=str, action="append", default=None,
                   help="YAML or TOML file of flag values (repeatable, merged left to right; command line wins).")
    g.add_argument("--dry-run", action="store_true", default=False,
                   help="Validate, write the resolved config to --output-dir, explain the batch arithmetic, and exit.")
    g.add_argument("--output-dir", type=str, default="runs/relax",
                   help="Run directory: resolved config, logs, metrics.jsonl, and checkpoints unless --save says otherwise.")

    g = parser.add_argument_group("Other training options")
    g.add_argument("--train-env-vars", type=json_object, default={},
                   help="Extra environment variables (JSON object) for training roles.")
    g.add_argument("--train-memory-margin-bytes", type=byte_size, default=1024**3,
                   help="Device memory kept free when sizing training buffers (accepts 1GB). Relax's trainer sizes no "
                        "buffer from free device memory (micro-batches come from --max-tokens-per-gpu), so there is "
                        "nothing to keep a margin for yet.")
    g.add_argument("--disable-weights-backuper", action="store_true", default=False,
                   help="Do not keep a host copy of weights (saves host memory).")
    g.add_argument("--custom-model-provider-path", type=str, default=None,
                   help="Dotted path (package.module.function) of a Megatron model provider: it builds each trainer "
                        "rank's model in place of Relax's GPTModel, called as Megatron-LM calls one (pre_process, "
                        "post_process, vp_stage), with config= (the TransformerConfig) and arch= (Relax's ModelArch) "
                        "when it takes them. Its parameter names must match the HF weight mapping.")
    g.add_argument("--recompute-loss-function", action="store_true", default=False,
                   help="Activation-checkpoint logits -> log-probs -> loss of each micro-batch: its float32 "
                        "softmax intermediates are recomputed in backward instead of kept (same loss and "
                        "gradients, less memory, the loss runs twice).")
    g.add_argument("--log-probs-chunk-size", type=int, default=-1,
                   help="Compute log-probs in chunks of this many tokens (-1: no chunking).")
    g.add_argument("--allgather-cp", action="store_true", default=False,
                   help="With --context-parallel-size > 1 on GPU: Transformer Engine's attention all-gathers the "
                        "keys and values of the sequence (cp_comm_type all_gather) instead of passing them around "
                        "a ring (p2p). Relax's CPU attention always all-gathers.")
    g.add_argument("--model-name", type=str, default=None,
                   help="Model family for weight conversion (default: read from --hf-checkpoint's config).")
    g.add_argument("--only-load-weight", action="store_true", default=False,
                   help="Reference and old-policy roles load weights only (no optimizer state).")
    g.add_argument("--rlsp-server-port", type=int, default=8234, help="HTTP port of the RLSP server. Relax has no RLSP server.")

    g = parser.add_argument_group("Model architecture extensions")
    g.add_argument("--post-self-attn-layernorm", action="store_true", default=False,
                   help="RMSNorm on the self-attention's output before the residual add (GLM4 models; with "
                        "--post-mlp-layernorm and --rotary-interleaved). With --hf-checkpoint it must agree with "
                        "the model's config.json (checked before the run).")
    g.add_argument("--post-mlp-layernorm", action="store_true", default=False,
                   help="RMSNorm on the MLP's output before the residual add (GLM4 models; with "
                        "--post-self-attn-layernorm and --rotary-interleaved). With --hf-checkpoint it must agree "
                        "with the model's config.json (checked before the run).")

    g = parser.add_argument_group("Debug")
    g.add_argument("--debug-rollout-only", action="store_true", default=False, help="Run rollout only; no training.")
    g.add_argument("--debug-train-only", action="store_true", default=False, help="Run training only; no rollout.")
    g.add_argument("--load-debug-rollout-data", type=str, default=None,
                   help="Train on saved rollout data (implies --debug-train-only); may contain {rollout_id}.")
    g.add_argument("--load-debug-rollout-data-subsample", type=float, default=None,
                   help="Fraction (0, 1] of the saved rollout data to use.")
    g.add_argument("--save-debug-rollout-data", type=str, default=None, help="Save each step's rollout data; may contain {rollout_id}.")
    g.add_argument("--save-debug-train-data", type=str, default=None, help="Save what each trainer rank trains on every step (tokens, masks, advantages, old/reference "
                        "log-probs) with torch.save, loadable with weights_only=True; the path may contain {rollout_id} "
                        "and {rank} (without {rank} only rank 0 writes).")
    g.add_argument("--dump-details", type=str, default=None, help="Directory for post-hoc analysis: sets --save-debug-rollout-data to DIR/rollout_data/{rollout_id}.jsonl "
                        "and --save-debug-train-data to DIR/train_data/{rollout_id}_{rank}.pt (unless given) and "
                        "writes the resolved config to DIR/config.yaml.")
    g.add_argument("--check-weight-update-equal", action="store_true", default=False,
                   help="After each weight sync, compare every engine tensor with the trainer's.")
    g.add_argument("--memory-snapshot-dir", type=str, default=".",
                   help="Directory for the memory records of --memory-snapshot-num-steps (one file per trainer rank).")
    g.add_argument("--memory-snapshot-num-steps", type=int, default=None,
                   help="Record the trainer ranks' memory over the run's first N training steps with "
                        "--memory-recorder (off when unset).")
    # Megatron-LM's profiler switches (its training arguments; the mirror does not carry them): same names,
    # defaults and meaning, here applied to the trainer ranks' training calls.
    g.add_argument("--use-pytorch-profiler", action="store_true", default=False,
                   help="Megatron-LM's flag: profile the --profile-target sections with torch.profiler on steps "
                        "[--profile-step-start, --profile-step-end) of the ranks in --profile-ranks; Chrome traces "
                        "go to OUTPUT_DIR/profiles/<target>-step<N>-rank<R>.json.")
    g.add_argument("--profile-step-start", type=int, default=10, help="Megatron-LM's flag: first profiled step.")
    g.add_argument("--profile-step-end", type=int, default=12,
                   help="Megatron-LM's flag: the step at which profiling stops (not profiled).")
    g.add_argument("--profile-ranks", type=int, nargs="+", default=[0],
                   help="Megatron-LM's flag: global trainer ranks to profile.")
    g.add_argument("--profile-target", type=str, nargs="+", default=["train_overall"],
                   choices=["train_overall", "train_actor", "train_log_probs"],
                   help="What --use-pytorch-profiler profiles: the whole training call of a step (train_overall), "
                        "the actor's optimizer updates (train_actor), the log-prob passes before them "
                        "(train_log_probs).")
    g.add_argument("--profile-with-stack", action="store_true", default=False,
                   help="Record Python stacks in profiles (torch.profiler's with_stack).")
    g.add_argument("--profile-with-memory", action="store_true", default=False,
                   help="Record tensor memory in profiles (torch.profiler's profile_memory).")
    g.add_argument("--profile-with-flops", action="store_true", default=False,
                   help="Estimate FLOPs of matrix operations in profiles (torch.profiler's with_flops).")
    g.add_argument("--memory-recorder", type=str, default="torch", choices=["torch", "memray"],
                   help="What --memory-snapshot-num-steps records: PyTorch's CUDA allocator history (torch; GPU "
                        "only) or the rank process's host allocations with memray.")
    g.add_argument("--enable-cuda-memory-check", action="store_true", default=False,
                   help="Log free GPU memory before every torch.distributed collective of the trainer ranks and add "
                        "it to the message of a collective that fails (GPU only).")

    g = parser.add_argument_group("Network")
    g.add_argument("--http-proxy", type=str, default=None, help="HTTP proxy for outgoing requests. Relax's engine, router and reward clients do not route through a "
                        "proxy yet.")
    g.add_argument("--use-distributed-post", action="store_true", default=False,
                   help="Spread HTTP posts over several Ray workers. Relax's rollout manager posts from its own threads; "
                        "the Ray-worker fan-out is not built.")
