"""Flag values refused for a stated dependency reason: the feature needs a package no release of which installs
beside this project's pins (torch 2.13.0, transformers 5, megatron-core 0.16.1). Like a hardware reason
(relax.config.support_gpu) the refusal is not "not built yet": it names the conflict (which releases, which pin)
and the fix, before Ray, in `--dry-run` and in the flag reference (relax.config.help_text).

Megatron-Bridge was checked by reading the Requires-Dist of every release on PyPI (`pip index versions
megatron-bridge`: 0.3.0 and 0.3.1; `pip download --no-deps megatron-bridge==X`): both require transformers<5.0.0
and transformer-engine[core_cu13,pytorch]>=2.10.0a0,<2.13.0 (with mamba-ssm and causal-conv1d, CUDA builds), and
`megatron.bridge` imports transformer_engine when imported. megatron-core<0.17.0,>=0.15.0a0 and torch>=2.6.0 fit.
"""

from __future__ import annotations

MEGATRON_BRIDGE_RELEASES = ("0.3.0", "0.3.1")

MEGATRON_BRIDGE_CONFLICT = (
    "Megatron-Bridge (PyPI megatron-bridge " + " and ".join(MEGATRON_BRIDGE_RELEASES) + ", every release) requires "
    "transformers<5.0.0, while Relax pins transformers 5 (its model configs and the embedded engine's models need "
    "it), and transformer-engine[core_cu13,pytorch]<2.13 (CUDA 13 builds, imported by megatron.bridge itself), which "
    "does not install on a CPU-only machine; its megatron-core<0.17 and torch>=2.6 pins fit")
MEGATRON_BRIDGE_FIX = ("use --megatron-to-hf-mode raw, Relax's own converter (the same HF tensors for every supported "
                       "family), until a Megatron-Bridge release accepts transformers 5")

# dest -> {refused value: why (the conflict, then the fix)}
DEPENDENCY_REFUSALS: dict[str, dict[str, str]] = {
    "megatron_to_hf_mode": {"bridge": f"{MEGATRON_BRIDGE_CONFLICT}; {MEGATRON_BRIDGE_FIX}"},
}


def dependency_reason(dest: str, value) -> str | None:
    """Why `value` of `dest` is refused for a dependency conflict (None when it is not)."""
    return DEPENDENCY_REFUSALS.get(dest, {}).get(str(value))
