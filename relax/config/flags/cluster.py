"""Cluster, resources, data queue and training-mode flags."""

from relax.config.types import json_object, str2bool


def add_flags(parser):
    g = parser.add_argument_group("Ray launch")
    g.add_argument("--rollout-num-gpus-per-engine", type=int, default=1,
                   help="GPUs behind one rollout engine; becomes the engine's tensor-parallel size.")
    g.add_argument("--num-gpus-per-node", type=int, default=8,
                   help="GPUs on each node; lower it on smaller nodes (colocated runs pack by node).")
    g.add_argument("--resource", type=json_object, default=None,
                   help='Per-role replicas and GPUs as JSON, e.g. \'{"actor": [1, 8], "rollout": [1, 8]}\'.')
    g.add_argument("--colocate", action="store_true", default=False,
                   help="Share the same GPUs between rollout engines and trainers, taking turns; implies --offload. "
                        "Engines are placed on the trainer ranks' placement-group bundles.")
    g.add_argument("--offload", action="store_true", default=False,
                   help="Shorthand for --offload-train and --offload-rollout.")
    g.add_argument("--offload-train", action="store_true", default=None,
                   help="Move the trainer's weights, grad buffers and optimizer state off the device while rollout "
                        "runs (GPU: to pinned host memory; CPU: to a spill file under --output-dir/offload).")
    g.add_argument("--offload-rollout", action="store_true", default=None,
                   help="Release rollout engine memory while training runs; the weights come back for the weight "
                        "push, the KV cache after it.")
    # --distributed-backend and --distributed-timeout-minutes are Megatron's flags (merged below).

    g = parser.add_argument_group("TransferQueue data queue")
    g.add_argument("--num-data-storage-units", type=int, default=1,
                   help="How many TransferQueue storage-unit actors hold samples between rollout and training.")
    g.add_argument("--max-staleness", type=int, default=0,
                   help="With --fully-async: how many steps rollout may run ahead of training; step N+1 starts "
                        "only while N+1 minus the oldest untrained step is at most this (0 = strict alternation, "
                        "the synchronous schedule).")
    g.add_argument("--polling-mode", type=str2bool, nargs="?", const=True, default=True,
                   help="Consumers poll TransferQueue for ready samples instead of blocking (true/false).")
    g.add_argument("--num-iters-per-train-update", type=int, default=1,
                   help="With --fully-async: iterations per global batch, i.e. chunks each step streams in. K > 1: "
                        "the rollout produces the step in K chunks of whole prompt groups and the trainer runs "
                        "each chunk's old log-probs, advantages and forward/backward passes as it arrives, "
                        "accumulating gradients, with one optimizer step after the last chunk (the same update "
                        "as K = 1). Needs --rollout-batch-size divisible by K and one optimizer step per "
                        "rollout step; refused with a reference, critic or teacher, --normalize-advantages and "
                        "hooks that see a whole step.")

    g = parser.add_argument_group("Training backend and mode")
    g.add_argument("--train-backend", type=str, default="megatron", choices=["megatron"],
                   help="Training backend.")
    g.add_argument("--qkv-format", type=str, default="thd", choices=["thd", "bshd"],
                   help="Accepted for launch-script compatibility; unlike the reference, it does not change the "
                        "attention layout: Relax's Megatron trainer always runs attention on right-padded "
                        "micro-batches (each padded to its longest sample), so the results are the same either way. "
                        "thd allows --use-dynamic-batch-size (token-budget micro-batches, the role packing plays); "
                        "bshd refuses it and uses the fixed --micro-batch-size.")
    g.add_argument("--megatron-to-hf-mode", type=str, default="raw", choices=["raw", "bridge"],
                   help="How trainer weights are converted to Hugging Face names: Relax's own mapping (raw) or Megatron-Bridge.")
    g.add_argument("--true-on-policy-mode", action="store_true", default=False,
                   help="Train with the engine's log-probs as the old policy and check every step that the "
                        "trainer's recomputed log-probs match them (max abs diff 1e-4 on trained tokens), stopping "
                        "with the step, sample and token otherwise; needs --keep-old-actor when "
                        "--update-weights-interval > 1.")
    g.add_argument("--fully-async", action="store_true", default=False,
                   help="Run rollout beside training: the rollout generates the next steps (at most "
                        "--max-staleness ahead) while the trainer runs the oldest generated step's stages; weights "
                        "are pushed with generation paused in place. Not with --colocate. The stages of one step "
                        "still run one after the other in the trainer's roles (no per-stage roles or streaming "
                        "chunks yet).")
    g.add_argument("--rollout-backend", type=str, default="auto", choices=["auto", "sglang", "embedded"],
                   help="Inference engine behind the SGLang HTTP API: real SGLang servers, the embedded "
                        "transformers engine, or auto.")
