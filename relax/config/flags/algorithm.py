"""Algorithm flags: advantages, losses, KL, critic, off-policy corrections, parameter selection."""

ADVANTAGE_ESTIMATORS = [
    "grpo", "gspo", "on_policy_distillation", "sapo", "cispo",
    "reinforce_plus_plus", "reinforce_plus_plus_baseline", "rloo", "ppo",
]


def add_flags(parser):
    g = parser.add_argument_group("Advantage estimation")
    g.add_argument("--advantage-estimator", type=str, default="grpo", choices=ADVANTAGE_ESTIMATORS,
                   help="How advantages are computed from rewards. On-policy distillation can be added to any "
                        "estimator with --use-opd; on_policy_distillation is pure distillation: rewards are ignored "
                        "and the advantage is only the OPD term opd_kl_coef * (log p_teacher - log p_student) "
                        "(needs --use-opd).")
    g.add_argument("--normalize-advantages", action="store_true", default=False,
                   help="Whiten advantages over the step's response tokens: (A - mean) / sqrt(var + 1e-8) with the "
                        "unbiased (n-1) masked variance, as verl and OpenRLHF.")
    g.add_argument("--disable-grpo-std-normalization", action="store_true", default=False,
                   help="Do not divide group-centred rewards by the group std (Dr. GRPO).")
    g.add_argument("--disable-rewards-normalization", action="store_true", default=False,
                   help="Use raw rewards as advantages (no group centring).")
    g.add_argument("--disable-compute-advantages-and-returns", action="store_true", default=False,
                   help="Skip advantage/return computation (SFT or custom losses that compute their own): "
                        "advantages are 0, or the 'advantages' a --custom-convert-samples-to-train-data-path "
                        "function returns; no returns (not with ppo, --kl-coef or --use-opd).")
    g.add_argument("--gamma", type=float, default=1.0, help="Discount factor for GAE and REINFORCE++ returns.")
    g.add_argument("--lambd", type=float, default=1.0, help="GAE lambda.")

    g = parser.add_argument_group("Loss")
    g.add_argument("--loss-type", type=str, default="policy_loss", choices=["policy_loss", "custom_loss", "sft"],
                   help="Policy-gradient loss, a user loss (--custom-loss-function-path) or supervised fine-tuning.")
    g.add_argument("--custom-loss-function-path", type=str, default=None, help="Dotted path of a custom loss function.")
    g.add_argument("--eps-clip", type=float, default=0.2, help="PPO ratio clip, lower side (1 - eps).")
    g.add_argument("--eps-clip-high", type=float, default=None, help="PPO ratio clip, upper side (1 + eps); default --eps-clip.")
    g.add_argument("--eps-clip-c", type=float, default=None, help="Dual-clip bound c (> 1) for negative advantages.")
    g.add_argument("--value-clip", type=float, default=0.2, help="Clip range of the critic's value updates.")
    g.add_argument("--entropy-coef", type=float, default=0.0, help="Weight of the entropy bonus.")

    g = parser.add_argument_group("KL divergence")
    g.add_argument("--kl-coef", type=float, default=0.0,
                   help="KL penalty folded into the reward before advantages (exclusive with --kl-loss-coef), "
                        "KL_t = --kl-loss-type estimate of log pi_rollout - log pi_ref per response token: "
                        "grpo/gspo/sapo/cispo/rloo and reinforce_plus_plus_baseline normalise (centre) the shaped "
                        "reward r - kl_coef * sum_t KL_t; ppo, reinforce_plus_plus and on_policy_distillation get "
                        "-kl_coef * KL_t as a per-token reward in their returns.")
    g.add_argument("--use-kl-loss", action="store_true", default=False, help="Add a KL term to the loss.")
    g.add_argument("--kl-loss-coef", type=float, default=0.0, help="Weight of the KL loss term (exclusive with --kl-coef).")
    g.add_argument("--kl-loss-type", type=str, default="k1", choices=["k1", "k2", "k3", "low_var_kl"],
                   help="KL estimator.")
    g.add_argument("--use-unbiased-kl", action="store_true", default=False,
                   help="Importance-weight the KL estimate by the current/old policy ratio.")
    g.add_argument("--ref-update-interval", type=int, default=None,
                   help="Copy the actor into the reference model every N rollout steps (default never).")

    g = parser.add_argument_group("SAPO")
    g.add_argument("--sapo-tau-pos", type=float, default=1.0, help="SAPO gate temperature for positive advantages.")
    g.add_argument("--sapo-tau-neg", type=float, default=1.05, help="SAPO gate temperature for negative advantages.")

    g = parser.add_argument_group("Critic")
    g.add_argument("--num-critic-only-steps", type=int, default=0, help="Train only the critic for the first N steps.")
    g.add_argument("--critic-train-only", action="store_true", default=False, help="Train only the critic.")
    g.add_argument("--critic-lr", type=float, default=None, help="Critic learning rate (default --lr).")
    g.add_argument("--critic-lr-warmup-iters", type=int, default=0, help="Linear warm-up iterations of the critic.")

    g = parser.add_argument_group("Off-policy correction")
    g.add_argument("--use-rollout-logprobs", action="store_true", default=False,
                   help="Use the engine's log-probs as the old policy in the importance ratio.")
    g.add_argument("--use-tis", action="store_true", default=False, help="Truncated importance sampling between trainer and engine.")
    g.add_argument("--tis-clip", type=float, default=2.0, help="Upper clip of the TIS weight.")
    g.add_argument("--tis-clip-low", type=float, default=0, help="Lower clip of the TIS weight.")
    g.add_argument("--custom-tis-function-path", type=str, default=None, help="Dotted path of a custom TIS / rejection function.")
    g.add_argument("--custom-pg-loss-reducer-function-path", type=str, default=None,
                   help="Dotted path of a reducer for the policy-gradient loss only.")

    g = parser.add_argument_group("Routing replay and OPSM")
    g.add_argument("--use-routing-replay", action="store_true", default=False,
                   help="Replay MoE routing decisions between log-prob and training passes.")
    g.add_argument("--use-rollout-routing-replay", action="store_true", default=False,
                   help="Replay the rollout engine's MoE routing in training (implies --use-routing-replay).")
    g.add_argument("--use-opsm", action="store_true", default=False, help="Off-policy sequence masking.")
    g.add_argument("--opsm-delta", type=float, default=1e-4, help="OPSM threshold on the sequence-level KL.")

    g = parser.add_argument_group("Other training options")
    g.add_argument("--reset-optimizer-states", action="store_true", default=False, help="Zero optimizer state after every rollout.")
    g.add_argument("--use-rollout-entropy", action="store_true", default=False,
                   help="Compute the per-token entropy of the rollout policy in the same pass as the old "
                        "log-probs; it reaches the loss as batch['old_entropy'] (for entropy-based loss masks in a "
                        "custom loss) and is the train/entropy metric (the training pass then skips entropy unless "
                        "--entropy-coef is set).")
    g.add_argument("--get-mismatch-metrics", action="store_true", default=False,
                   help="Report trainer/engine log-prob mismatch (needs --custom-tis-function-path).")

    g = parser.add_argument_group("Parameter freezing")
    g.add_argument("--only-train-params-name-list", type=str, nargs="+", default=None,
                   help="Regexes of parameter names to train; all others are frozen.")
    g.add_argument("--freeze-params-name-list", type=str, nargs="+", default=None,
                   help="Regexes of parameter names to freeze.")
