"""Reward, generative reward model and on-policy distillation flags."""

from relax.config.types import json_object


def add_flags(parser):
    g = parser.add_argument_group("Reward")
    g.add_argument("--rm-type", type=str, default=None,
                   help="Built-in reward: exact_match, math, dapo, deepscaler, f1, gpqa, multiple_choice, random, "
                        "remote_rm; prefix boxed_ to score the last \\boxed{} answer.")
    g.add_argument("--custom-rm-path", type=str, default=None,
                   help="Dotted path of a reward function (args, sample) -> float|dict, sync or async.")
    g.add_argument("--reward-key", type=str, default=None, help="Key of the reward when the reward function returns a dict.")
    g.add_argument("--eval-reward-key", type=str, default=None, help="Reward key for evaluation (default --reward-key).")
    g.add_argument("--group-rm", action="store_true", default=False, help="Score each prompt's group of responses in one call.")
    g.add_argument("--rm-url", type=str, default=None, help="URL of the remote reward service (--rm-type remote_rm), or of the "
                   "teacher's SGLang-API server (--opd-type sglang).")
    g.add_argument("--custom-reward-post-process-path", type=str, default=None,
                   help="Dotted path of fn(args, samples) -> (raw_rewards, rewards), one float per sample each; "
                        "replaces the default reward normalisation (GRPO group centring/scaling): group estimators "
                        "and rloo use `rewards` as the advantage as given, the others in place of the raw rewards.")
    g.add_argument("--custom-convert-samples-to-train-data-path", type=str, default=None,
                   help="Dotted path of fn(args, samples) -> dict of per-sample lists: tokens and "
                        "response_lengths (required), loss_masks, rewards (post-processed, used as given; required "
                        "unless --disable-compute-advantages-and-returns), advantages (per token, only with that "
                        "flag), rollout_log_probs, raw_reward. See relax.training.train_data.")
    g.add_argument("--reward-error-policy", type=str, default="fail", choices=["fail", "zero"],
                   help="When a reward function raises: stop the run naming the sample (fail), or score it 0 and "
                        "count it in the metrics (zero).")
    g.add_argument("--reward-timeout", type=float, default=600.0,
                   help="Seconds one reward call (a sample, or a group with --group-rm) may take; a call that has "
                        "not returned by then is a reward failure and follows --reward-error-policy (Relax's own "
                        "flag: without it a reward function that never returns would hang the step). With "
                        "--use-fault-tolerance also how long a step waits for a reward server (--rm-url) that does "
                        "not answer before the run stops.")

    g = parser.add_argument_group("Generative reward model")
    g.add_argument("--genrm-model-path", type=str, default=None,
                   help="Model of the generative reward model (GenRM); enables it: engines of its own behind a "
                        "router of their own, started by the rollout manager, never given the policy's weights. "
                        "Samples whose reward type is genrm (--rm-type genrm, or metadata rm_type) are judged by "
                        "it (relax.rollout.rewards.genrm).")
    g.add_argument("--genrm-num-gpus", type=int, default=1,
                   help="GPUs for all GenRM engines; engines = this / --genrm-num-gpus-per-engine (on CPU as "
                        "many embedded engines, one CPU each).")
    g.add_argument("--genrm-num-gpus-per-engine", type=int, default=1, help="GPUs per GenRM engine.")
    g.add_argument("--genrm-engine-config", type=json_object, default=None,
                   help="GenRM engine options as a JSON object, e.g. '{\"max_running_requests\": 64}': SGLang "
                        "server options with --rollout-backend sglang; with the embedded engine its own options "
                        "(max_running_requests, context_length, max_prefill_tokens, dtype, random_seed, "
                        "num_threads), SGLang's sizing options (dp_size, pp_size, max_total_tokens, ...) having "
                        "no effect. Checked before the run starts.")
    g.add_argument("--genrm-sampling-config", type=json_object, default=None,
                   help="GenRM sampling as JSON: temperature (default 0.1), top_p (1.0), top_k (-1), "
                        "max_response_len (4096). Checked before the run starts.")
    g.add_argument("--genrm-template-path", type=str, default=None,
                   help="Dotted path of fn(prompt, response, label, metadata) -> chat messages (rendered with the "
                        "GenRM model's chat template) or a string (the judge prompt as is); default: "
                        "relax.rollout.rewards.genrm.default_template (Relax's own flag).")
    g.add_argument("--genrm-parser-path", type=str, default=None,
                   help="Dotted path of fn(judge_text) -> float, None (or raising) when the verdict has no score, "
                        "which follows --reward-error-policy; default: relax.rollout.rewards.genrm.default_parser, "
                        "the last \\boxed{score} or a final Yes/No line (Relax's own flag).")

    g = parser.add_argument_group("On-policy distillation")
    g.add_argument("--use-opd", action="store_true", default=False, help="Enable on-policy distillation (needs --opd-type).")
    g.add_argument("--opd-type", type=str, default=None, choices=["sglang", "megatron"],
                   help="Teacher log-probs from an SGLang-API server (sglang: the server at --rm-url, scored by POST "
                        "/generate with max_new_tokens 0 and return_logprob, reading meta_info.input_token_logprobs) "
                        "or a Megatron teacher (megatron, needs --opd-teacher-load).")
    g.add_argument("--opd-kl-coef", type=float, default=1.0, help="Weight of the distillation term.")
    g.add_argument("--opd-teacher-load", type=str, default=None, help="Teacher checkpoint for --opd-type megatron.")
    g.add_argument("--opd-teacher-ckpt-step", type=int, default=None, help="Teacher checkpoint step.")
