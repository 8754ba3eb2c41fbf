"""Evaluation flags (--eval-interval is Relax's: in rollout steps, not Megatron iterations)."""


def add_flags(parser):
    g = parser.add_argument_group("Evaluation")
    g.add_argument("--eval-interval", type=int, default=None, help="Evaluate every N rollout steps.")
    g.add_argument("--eval-prompt-data", type=str, nargs="+", default=None,
                   help="Evaluation sets as name/path pairs: NAME PATH [NAME PATH ...].")
    g.add_argument("--eval-config", type=str, default=None,
                   help="YAML/JSON file of evaluation sets with per-set overrides (replaces --eval-prompt-data).")
    g.add_argument("--eval-function-path", type=str, default=None,
                   help="Evaluation generation function fn(ctx, rollout_id, eval_set, groups) -> groups "
                        "(default: generate like the rollout function, with --custom-generate-function-path).")
    g.add_argument("--skip-eval-before-train", action="store_true", default=False, help="Do not evaluate before the first step.")
    g.add_argument("--eval-input-key", type=str, default=None, help="Prompt field in eval data (default --input-key).")
    g.add_argument("--eval-label-key", type=str, default=None, help="Label field in eval data (default --label-key).")
    g.add_argument("--eval-tool-key", type=str, default=None, help="Tools field in eval data (default --tool-key).")
    g.add_argument("--n-samples-per-eval-prompt", type=int, default=1, help="Responses per eval prompt.")
    g.add_argument("--eval-temperature", type=float, default=None, help="Eval temperature (default --rollout-temperature).")
    g.add_argument("--eval-top-p", type=float, default=None, help="Eval top-p (default --rollout-top-p).")
    g.add_argument("--eval-top-k", type=int, default=None, help="Eval top-k (default --rollout-top-k).")
    g.add_argument("--eval-max-response-len", type=int, default=None, help="Eval response limit (default --rollout-max-response-len).")
    g.add_argument("--eval-max-prompt-len", type=int, default=None, help="Eval prompt limit (default --rollout-max-prompt-len).")
    g.add_argument("--eval-min-new-tokens", type=int, default=None, help="Fewest new tokens in eval responses.")
    g.add_argument("--eval-max-context-len", type=int, default=None, help="Eval context limit (default --rollout-max-context-len).")
