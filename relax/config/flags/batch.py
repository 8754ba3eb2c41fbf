"""Batching flags owned by Relax (--global-batch-size and --micro-batch-size are Megatron's)."""


def add_flags(parser):
    g = parser.add_argument_group("Batching")
    g.add_argument("--num-steps-per-rollout", type=int, default=None,
                   help="Optimizer steps per rollout; sets --global-batch-size to samples per rollout / this.")
    g.add_argument("--use-dynamic-batch-size", action="store_true", default=False,
                   help="Pack variable-length samples into micro-batches bounded by --max-tokens-per-gpu.")
    g.add_argument("--max-tokens-per-gpu", type=int, default=None,
                   help="Token budget of one micro-batch per GPU with dynamic batching (about max length / CP size).")
    g.add_argument("--log-probs-max-tokens-per-gpu", type=int, default=None,
                   help="Token budget when only computing log-probs (default: --max-tokens-per-gpu).")
    g.add_argument("--balance-data", action="store_true", default=False,
                   help="Balance tokens across data-parallel ranks (Karmarkar-Karp, equal sample counts); colocated "
                        "sync mode only. Metric: train/dp_token_spread.")
