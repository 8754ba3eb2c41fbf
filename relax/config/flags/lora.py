"""LoRA flags (named as verl and Megatron-Bridge users know them): adapters on the trainer's linear layers
(relax/backends/megatron/lora.py), checked before Ray by relax/config/rules_lora.py; docs/lora.md."""

from relax.config.rules_lora import ALL_LINEAR, LORA_DEFAULTS, LORA_INITS, LORA_SAVE_MODULES, LORA_TARGETS


def add_flags(parser):
    g = parser.add_argument_group("LoRA")
    g.add_argument("--lora-rank", type=int, default=0,
                   help="Rank r of the LoRA adapters on the trainer's linear layers (0: LoRA off, full fine-tuning). "
                        "With r > 0 the base weights are frozen; the optimizer, gradient clipping and checkpoints "
                        "hold only the adapters.")
    g.add_argument("--lora-alpha", type=float, default=LORA_DEFAULTS["lora_alpha"],
                   help="LoRA scale numerator: an adapter adds alpha / r * B @ A to its layer's weight.")
    g.add_argument("--lora-dropout", type=float, default=LORA_DEFAULTS["lora_dropout"],
                   help="Dropout on the adapters' input (training only; 0 <= p < 1).")
    g.add_argument("--lora-target-modules", type=str, nargs="+", default=list(LORA_DEFAULTS["lora_target_modules"]),
                   help=f"Megatron linear layers that get adapters: any of {', '.join(LORA_TARGETS)}, or "
                        f"{ALL_LINEAR} (all four). MoE expert layers are not supported yet.")
    g.add_argument("--lora-modules-to-save", type=str, nargs="+",
                   default=list(LORA_DEFAULTS["lora_modules_to_save"]),
                   help="Modules trained in full beside the adapters (PEFT's modules_to_save), by Megatron name: "
                        f"{', '.join(LORA_SAVE_MODULES)} (the LM head; untied models). Needs --lora-merge-sync; a "
                        "--save checkpoint keeps them with the adapters. The embedded default needs it to learn "
                        "(docs/lora.md).")
    g.add_argument("--lora-init", type=str, choices=list(LORA_INITS), default=LORA_DEFAULTS["lora_init"],
                   help="Initialisation of A (kaiming: PEFT's kaiming-uniform; gaussian: N(0, 1/r^2)); B starts "
                        "at zero, so the model starts as the base.")
    g.add_argument("--lora-load", type=str, default=LORA_DEFAULTS["lora_load"],
                   help="Start from these adapters: a PEFT adapter folder (adapter_config.json; what --save-hf "
                        "writes with LoRA) or a Relax checkpoint of a LoRA run (its --save folder or an iter_* "
                        "folder; same parallel layout); same rank and targets. The base comes from --hf-checkpoint "
                        "/ --ref-load.")
    g.add_argument("--lora-merge-sync", action="store_true", default=LORA_DEFAULTS["lora_merge_sync"],
                   help="Push merged weights (W + alpha / r * B @ A) to the engines through the normal weight "
                        "push, so the engines need no LoRA support. Without it each push moves only the adapter "
                        "(the embedded engine, or real SGLang launched with LoRA; docs/lora.md).")
