"""What `relax-train --help` says about each flag: what it does, whether it is built, its real default.

Nothing here holds a default value. The default shown is read, when help is printed, from where the
run takes it: the parser's default after Relax's overrides (`relax.config.megatron.RELAX_DEFAULT_OVERRIDES`
applied with `set_defaults`), the embedded default's preset (`relax.config.presets.EMBEDDED_PRESET`) and the
derivation rules (`relax.config.validate.DERIVED_FROM`). Whether a flag is built comes from
`relax.config.support`.
"""

from __future__ import annotations

import argparse
import enum
import json
from typing import Any

from relax.config.megatron_options import OPTION_HELP
from relax.config.presets import EMBEDDED_PRESET, PRESET_NOTES
from relax.config.rules_arch import ARCH_FLAG_HELP
from relax.config.support import IMPLEMENTED, SUPPORTED_VALUES, is_sglang_server_flag, same_value
from relax.config.support_deps import DEPENDENCY_REFUSALS
from relax.config.support_gpu import GPU_ONLY_OPTION_REASONS
from relax.config.support_megatron import NO_EFFECT_REASONS
from relax.config.validate import DERIVED_FROM

# What each Megatron flag that Relax honours controls, in Relax's terms (the flags in
# relax.config.support.IMPLEMENTED that come from Megatron's parser; a test keeps the two in step).
MEGATRON_HELP: dict[str, str] = {
    **ARCH_FLAG_HELP,
    # passed to Megatron-core's config objects as they are (relax.config.megatron_options)
    **{dest: text + (f" GPU only: {GPU_ONLY_OPTION_REASONS[dest]}." if dest in GPU_ONLY_OPTION_REASONS else "")
       for dest, text in OPTION_HELP.items()},
    "accumulate_allreduce_grads_in_fp32": "Accumulate and all-reduce gradients in fp32. The trainer always does "
                                          "(unlike Megatron, which does so by default only with --bf16).",
    "attention_backend": "Attention implementation: flash and fused are Transformer Engine's GPU kernels (without "
                         "CUDA and transformer_engine the trainer warns and runs Megatron's own attention, the same "
                         "computation); local is Megatron's own unfused attention (with Megatron's local layer "
                         "spec); unfused is Transformer Engine's unfused attention on GPU, Megatron's own on CPU; "
                         "auto lets Transformer Engine choose on GPU and is Megatron's own attention on CPU.",
    "attention_dropout": "Dropout probability of the attention probabilities in training passes (log-prob passes "
                         "run without dropout). Relax's default is 0, Megatron's 0.1: RL updates should see the "
                         "log-probs the rollout saw.",
    "attention_softmax_in_fp32": "Run attention masking and softmax in fp32. The trainer always does, also without "
                                 "this flag (unlike Megatron, which otherwise uses the bf16/fp16 compute dtype).",
    "hidden_dropout": "Dropout probability of the transformer hidden states in training passes (log-prob passes run "
                      "without dropout). Relax's default is 0, Megatron's 0.1: RL updates should see the log-probs "
                      "the rollout saw.",
    "expert_model_parallel_size": "Split each MoE layer's experts over this many trainer ranks (Megatron's expert "
                                  "parallelism); it must divide the expert count and the trainer ranks per "
                                  "pipeline stage. Weight pushes gather the full experts for the engines.",
    "lr_warmup_init": "The learning rate the warm-up starts from: over --lr-warmup-iters optimizer steps it rises "
                      "linearly to --lr (Megatron's scheduler; Relax's first update already takes one step of it).",
    "expert_tensor_parallel_size": "Split each expert's matrices over this many ranks (Megatron's expert tensor "
                                   "parallelism). Relax builds 1 (whole experts) or the --tensor-model-parallel-size "
                                   "(split like the dense layers); Relax's default is 1, Megatron's unset value means "
                                   "the TP size.",
    "context_parallel_size": "Split every sequence over this many ranks (Megatron's context parallelism, in its "
                             "load-balanced chunks); sequences are padded to a multiple of 2 x this. Dense models "
                             "without pipeline parallelism. On GPU Transformer Engine's attention exchanges keys and "
                             "values; on CPU Relax's own all-gather attention does.",
    "moe_router_dtype": "Precision of the MoE router's logits and softmax (fp32 or fp64); unset: the model's "
                        "compute dtype. Only for models with experts.",
    "moe_token_dispatcher_type": "How MoE tokens reach their experts' ranks. Relax's default and only choice is "
                                 "alltoall (Megatron's default is allgather): the trainer's micro-batches vary in "
                                 "length, which the all-to-all dispatcher handles.",
    "optimizer_cpu_offload": "Keep the optimizer's state in CPU memory and step it there (Megatron's hybrid-device "
                             "optimizer). GPU only: a run without a GPU stops before Ray.",
    "overlap_cpu_optimizer_d2h_h2d": "Overlap the GPU-CPU copies of --optimizer-cpu-offload with compute (CUDA "
                                     "streams). GPU only.",
    "use_precision_aware_optimizer": "Keep the optimizer's state in lower precision with Transformer Engine's fused "
                                     "Adam. GPU only.",
    "moe_grouped_gemm": "Run each rank's experts as one grouped GEMM (Transformer Engine). GPU only.",
    "moe_permute_fusion": "Permute MoE tokens with Transformer Engine's fused kernels. GPU only.",
    "moe_router_fusion": "Run the MoE router's top-k and softmax as Transformer Engine's fused kernels. GPU only.",
    "use_torch_optimizer_for_cpu_offload": "With --optimizer-cpu-offload, step the CPU copy of the optimizer state "
                                           "with torch's optimizer. GPU only.",
    "disable_bf16_reduced_precision_matmul": "Switch off cuBLAS's reduced-precision reductions in bf16 matrix "
                                             "products. GPU only.",
    # switches asking for what the trainer always builds (relax.config.support_megatron.ALWAYS_SO)
    "masked_softmax_fusion": "Run the masked softmax unfused. The trainer always does (no CUDA fusion kernels).",
    "bias_gelu_fusion": "Run bias and activation unfused. The trainer always does (no CUDA fusion kernels).",
    "bias_swiglu_fusion": "Run bias and activation unfused. The trainer always does (no CUDA fusion kernels).",
    "bias_dropout_fusion": "Run bias, dropout and residual add unfused. The trainer always does (no CUDA fusion "
                           "kernels).",
    "apply_rope_fusion": "Apply rotary embeddings unfused. The trainer always does (no CUDA fusion kernels).",
    "gradient_accumulation_fusion": "Accumulate weight gradients without the fused CUDA kernel. The trainer always "
                                    "does.",
    "no_persist_layer_norm": "Use the plain (non-persistent) layer norm. The trainer always does.",
    "overlap_p2p_comm": "Do not overlap pipeline-parallel sends and receives with compute (interleaved schedule "
                        "only). The trainer never overlaps them.",
    "optimizer": "The trainer's optimizer, built by Megatron: adam (AdamW, decoupled weight decay) or sgd (with "
                 "--sgd-momentum). muon, dist_muon and lion need a newer Megatron than the installed one.",
    "sgd_momentum": "Momentum of --optimizer sgd.",
    "sequence_parallel": "With --tensor-model-parallel-size > 1, split the sequence over the tensor-parallel ranks "
                         "between the linear layers (norms, dropout), as Megatron does; without tensor parallelism "
                         "it does nothing.",
    "recompute_activations": "Recompute activations in backward instead of keeping them: Megatron's shorthand for "
                             "--recompute-granularity selective.",
    "recompute_granularity": "Activation recompute (Megatron-core's): full recomputes whole transformer layers "
                             "(needs --recompute-method and --recompute-num-layers); selective recomputes the "
                             "submodules of --recompute-modules. Same loss and gradients, less activation memory.",
    "recompute_method": "Which layers full recompute covers: uniform splits each pipeline stage's layers into "
                        "chunks of --recompute-num-layers and recomputes every chunk; block recomputes the first "
                        "--recompute-num-layers layers of each stage only.",
    "recompute_modules": "Submodules selective recompute recomputes: core_attn (Megatron's default), mlp, moe (MoE "
                         "models), shared_experts (MoE models with a shared expert, Qwen2-MoE), layernorm (needs "
                         "Transformer Engine on a GPU); mla_up_proj and moe_act need features the trainer's "
                         "models lack.",
    "recompute_num_layers": "Layers per recompute chunk (--recompute-method uniform) or layers recomputed per "
                            "pipeline stage (block); full recompute only.",
    "adam_beta1": "Adam's first-moment decay rate (beta1) of the trainer's optimizer.",
    "adam_beta2": "Adam's second-moment decay rate (beta2) of the trainer's optimizer.",
    "adam_eps": "Adam's epsilon, added to the denominator for numerical stability.",
    "async_save": "Write checkpoints in the background while training goes on (needed by --rotate-ckpt).",
    "bf16": "Train in bfloat16 mixed precision (the optimizer keeps fp32 master weights).",
    "calculate_per_token_loss": "Normalise the loss by the step's response tokens (every token weighs the same) "
                                "instead of averaging per sample.",
    "clip_grad": "Clip the global gradient norm to this value before each optimizer step.",
    "distributed_backend": "torch.distributed backend between trainer workers (nccl on GPUs, gloo on CPU).",
    "distributed_timeout_minutes": "Timeout of the trainer workers' collective operations, in minutes.",
    "fp16": "Train in float16 mixed precision with dynamic loss scaling.",
    "global_batch_size": "Samples per optimizer step, summed over all data-parallel workers.",
    "load": "Checkpoint directory to resume the actor from (its latest checkpoint, or --ckpt-step's).",
    # checkpoint contents and run control (relax.config.support_megatron.CHECKPOINT_AND_RUN_CONTROL); Megatron's
    # iteration is Relax's rollout step
    "ckpt_step": "Load this iteration (rollout step) of the checkpoint that is loaded instead of its latest: of "
                 "--load's save root, or of --pretrained-checkpoint's while --load holds no checkpoint. An iteration "
                 "that is not there stops the run before it starts, listing the complete ones.",
    "finetune": "Load only the model weights of --load (or --pretrained-checkpoint): the run starts at step 0 with a "
                "fresh optimizer and LR schedule, the trainer's RNG and the rollout position (data order, sample "
                "counter) are not restored, as Megatron's --finetune. Drop it when resuming the finetuning run itself.",
    "pretrained_checkpoint": "Weights the actor starts from while --load holds no checkpoint yet (a Relax save root, "
                             "iteration or role folder, or a Hugging Face model folder), loaded as with --finetune; "
                             "once --load holds a checkpoint the run resumes from that instead.",
    "save_retain_interval": "Checkpoints whose rollout step is a multiple of this are never deleted by rotation. "
                            "Alone it rotates like Megatron (only the last checkpoint is kept besides them); with "
                            "--max-actor-ckpt-to-keep N (or --rotate-ckpt) the newest N are kept besides them.",
    "exit_duration_in_mins": "Stop after the first rollout step that ends more than this many minutes after the "
                             "run's controller started: save a checkpoint first when --save is set (unless that step "
                             "was just saved), then exit 0 with a line saying why. 0 or unset: no limit. Not with "
                             "--fully-async yet.",
    "exit_signal_handler": "On --exit-signal, finish the current rollout step, save a checkpoint when --save is set "
                           "and exit 0 (without it SIGTERM/SIGINT stop the run at once, exit 143/130); a second signal "
                           "stops at once. Not with --fully-async yet.",
    "exit_signal": "The signal --exit-signal-handler waits for (SIGKILL and SIGSTOP cannot be caught).",
    "iterations_to_skip": "Rollout steps whose update is skipped, 1-indexed as Megatron's iterations (step S in "
                          "metrics.jsonl is iteration S + 1). Relax still rolls the step out (its prompts are used, "
                          "as Megatron's skipped iteration consumes its batch) but runs none of its training stages; "
                          "the step's record has train/skipped_iteration 1. Not with --fully-async yet.",
    "flight_recorder_dump_path": "Switch on NCCL's flight recorder for the trainer ranks: where each rank's dump "
                                 "goes (a folder gets the prefix <folder>/_dump_), set as TORCH_FR_DUMP_TEMP_FILE. "
                                 "Variables already set in the environment or --train-env-vars win. GPU only.",
    "flight_recorder_trace_buffer_size": "Collectives the flight recorder keeps (TORCH_NCCL_TRACE_BUFFER_SIZE; with "
                                         "--flight-recorder-dump-path). GPU only.",
    "flight_recorder_dump_on_timeout": "Do not dump the flight recorder when a collective times out (it does by "
                                       "default: TORCH_NCCL_DUMP_ON_TIMEOUT; with --flight-recorder-dump-path). GPU "
                                       "only.",
    "flight_recorder_include_stack_trace": "Record stack traces in the flight recorder (TORCH_INCLUDE_STACK_TRACE; "
                                           "with --flight-recorder-dump-path). GPU only.",
    "flight_recorder_include_only_active": "Dump every recorded collective, not only those still in flight (the "
                                           "default: TORCH_INCLUDE_ONLY_ACTIVE; with --flight-recorder-dump-path). "
                                           "GPU only.",
    "flight_recorder_extra_dump_on_exec": "Do not dump the flight recorder once more on exec (it does by default: "
                                          "TORCH_NCCL_EXTRA_DUMP_ON_EXEC; with --flight-recorder-dump-path). GPU "
                                          "only.",
    "lr": "Peak learning rate of the actor's optimizer (also the critic's unless --critic-lr is set).",
    "lr_decay_iters": "Optimizer steps over which the learning rate decays from --lr to --min-lr.",
    "lr_decay_style": "Shape of the learning-rate decay after the warm-up.",
    "lr_warmup_iters": "Optimizer steps of linear learning-rate warm-up up to --lr.",
    "micro_batch_size": "Samples per forward/backward pass on one worker; gradients accumulate over micro-batches "
                        "up to --global-batch-size.",
    "min_lr": "Learning rate at the end of the decay.",
    "no_load_optim": "On resume, load the weights only; the optimizer state starts afresh.",
    "no_save_optim": "Leave the optimizer state out of checkpoints (smaller; a resume restarts the optimizer).",
    "pipeline_model_parallel_size": "Number of pipeline stages the model's layers are split across.",
    "save": "Directory where the actor's checkpoints are written.",
    "save_interval": "Save a checkpoint every this many rollout steps (and after the last one).",
    "seed": "Seed of the trainer: weight initialisation and dropout (prompt order and sampling use --rollout-seed).",
    "tensor_model_parallel_size": "Number of workers each layer's weight matrices are split across.",
    "use_distributed_optimizer": "Shard the optimizer state across data-parallel workers.",
    "weight_decay": "Decoupled weight-decay coefficient of the optimizer.",
}

NOT_SUPPORTED = "Not supported yet."
MEGATRON_NOT_SUPPORTED = "Megatron-LM flag. " + NOT_SUPPORTED
# Said once, at the end of --help, instead of after every such flag.
EPILOG = ('Flags marked "Not supported yet" are accepted, but a real run stops before starting when one is set '
          "to anything other than its default; `relax-train --dry-run` lists them.")


def describe_flags(parser: argparse.ArgumentParser, megatron_dests: frozenset[str]) -> None:
    """Give every flag its description and support status (once, when the parser is built)."""
    for action in parser._actions:
        dest = action.dest
        if not action.option_strings or dest == "help":
            continue
        if dest in NO_EFFECT_REASONS:  # accepted with a warning (relax.config.support_megatron)
            # Relax's own text of such a flag describes the reference's behaviour, which Relax does not have.
            own = _megatron_text(action.help) if dest in megatron_dests else ""
            action.help = f"{own} Accepted for launch scripts; no effect in Relax: {NO_EFFECT_REASONS[dest]}.".strip()
        elif dest in megatron_dests:
            if dest in IMPLEMENTED:
                action.help = MEGATRON_HELP.get(dest) or _megatron_text(action.help)
            else:
                own = _megatron_text(action.help)
                action.help = f"{own} {NOT_SUPPORTED}" if own else MEGATRON_NOT_SUPPORTED
        elif is_sglang_server_flag(dest):
            continue  # forwarded to SGLang servers, honoured with SGLang engines (relax.config.support)
        elif dest not in IMPLEMENTED:
            action.help = f"{(action.help or '').rstrip()} {NOT_SUPPORTED}".strip()
        if dest in SUPPORTED_VALUES and action.choices is not None:
            built = sorted(str(v) for v in SUPPORTED_VALUES[dest])
            if set(built) != {str(c) for c in action.choices}:
                action.help = f"{(action.help or '').rstrip()} Built so far: {', '.join(built)}."
        for value, why in DEPENDENCY_REFUSALS.get(dest, {}).items():  # a stated reason (relax.config.support_deps)
            action.help = f"{(action.help or '').rstrip()} {value} is refused, a dependency conflict: {why}."


def _megatron_text(text: str | None) -> str:
    """Megatron's own help, when its parser supplied one (the mirror carries none)."""
    return "" if not text or text.startswith("Megatron-LM flag") else text.strip()


def default_text(action: argparse.Action) -> str:
    """The flag's effective default in words: parser default, derivation and embedded-default preset."""
    dest, value = action.dest, action.default
    if value is None and is_sglang_server_flag(dest):
        return "default: unset, so SGLang's own default"
    if dest in DERIVED_FROM and value is None:
        text = f"default: {DERIVED_FROM[dest]}"
    else:
        text = f"default: {format_value(value, action)}"
        if dest in DERIVED_FROM:
            text += f"; {DERIVED_FROM[dest]}"
    if dest in PRESET_NOTES:
        text += f"; the embedded default run uses {PRESET_NOTES[dest]}"
    elif dest in EMBEDDED_PRESET and not same_value(EMBEDDED_PRESET[dest], value):
        preset = format_value(EMBEDDED_PRESET[dest], action)
        if not (value is None and DERIVED_FROM.get(dest) == preset):
            text += f"; the embedded default run uses {preset}"
    return text


def format_value(value: Any, action: argparse.Action) -> str:
    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction, argparse.BooleanOptionalAction)):
        on = not value if isinstance(action, argparse._StoreFalseAction) else bool(value)
        return "on" if on else "off"
    if value is None:
        return "unset"
    if isinstance(value, enum.Enum):
        return value.name
    if isinstance(value, (list, tuple)):
        return " ".join(_item(v) for v in value) if value else "empty"
    if isinstance(value, dict):
        return json.dumps(value)
    if value == "":
        return '""'
    return str(value)


def _states_derivation(action: argparse.Action, text: str) -> bool:
    """The help already says which flag an unset value follows ("default: --max-tokens-per-gpu")."""
    derived = DERIVED_FROM.get(action.dest)
    return action.default is None and derived is not None and derived.startswith("--") and derived in text


def _item(value: Any) -> str:
    return value.name if isinstance(value, enum.Enum) else json.dumps(value) if isinstance(value, dict) else str(value)


class RelaxHelpFormatter(argparse.HelpFormatter):
    """Appends each flag's effective default (see `default_text`) to its help."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if (not action.option_strings or action.dest == "help" or action.default is argparse.SUPPRESS
                or "%(default)" in text or _states_derivation(action, text)):
            return text
        return f"{text.rstrip()} ({default_text(action).replace('%', '%%')})".lstrip()
