"""The formats Relax reads and checks before any runtime starts, as pure rules (no torch, Ray or backend):
a model's architecture from its HF config or flags (`model_arch`), a Megatron checkpoint folder (`checkpoint_layout`),
prompt files and their rows (`prompt_files`, `row_checks`) and a recorded run (`replay_record`). Validation reads
them before Ray; the backends and the data plane that act on them import the same definitions."""
