"""Adapter-only weight sync: a LoRA trainer pushes its adapter, not the model, to engines that serve LoRA through
SGLang's endpoints (the embedded engine: relax/backends/embedded/lora.py).

A push writes the adapter in PEFT's format (relax.backends.megatron.lora_peft, what --save-hf writes) to a folder
the engines read, then on each engine unloads the previous adapter of that name, loads the new one
(`/load_lora_adapter`, as SGLang takes an adapter from disk) and sets the weight version. The engine answers
with the checksum of what it loaded; a push whose checksum differs from the sender's raises, naming the engine.
The bytes moved are the adapter's, about 2 x r x (in + out) per adapted linear: proportional to the rank.

Built and tested at the engine level (tests/test_lora_sync.py); a run does not use it yet: the rollout's requests
do not name the adapter, so `--lora-rank` without `--lora-merge-sync` is refused before Ray
(relax.config.rules_lora).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Sequence

import torch

__all__ = ["push_adapter", "adapter_checksum"]


def adapter_checksum(named: Sequence[tuple[str, torch.Tensor]]) -> float:
    """Sum of |x| over the adapter's tensors in float64, summed per module in name order as the engine does."""
    by_module: dict[str, list[torch.Tensor]] = {}
    for name, tensor in named:
        by_module.setdefault(name.rsplit(".lora_", 1)[0], []).append(tensor)
    total = 0.0
    for module in sorted(by_module):
        a, b = by_module[module]  # lora_A then lora_B (lora_peft's order)
        total += float(a.double().abs().sum() + b.double().abs().sum())
    return total


def push_adapter(trainer: Any, engine_urls: Sequence[str], folder: str | Path, version: int, *,
                 name: str = "policy", timeout_s: float = 300.0) -> dict[str, Any]:
    """Push `trainer`'s adapter to every engine as adapter `name` at weight version `version`. Collective over the
    trainer's ranks (the adapter is gathered over TP); rank 0 writes and sends. Returns {"bytes", "seconds",
    "checksum"} on rank 0, {} elsewhere."""
    import torch.distributed as dist
    from safetensors.torch import save_file

    from relax.wire.engine_client import EngineClient
    from relax.backends.megatron.lora_peft import ADAPTER_FILE, peft_snapshot, write_config

    t0 = time.perf_counter()
    named, config = peft_snapshot(trainer)
    if dist.get_rank() != 0:
        return {}
    out = Path(folder) / f"v{version}"
    out.mkdir(parents=True, exist_ok=True)
    save_file({n: t.contiguous() for n, t in named}, str(out / ADAPTER_FILE), metadata={"format": "pt"})
    write_config(out, config)
    checksum = adapter_checksum(named)
    for url in engine_urls:
        client = EngineClient(url, timeout_s=timeout_s)
        try:
            if name in client._post("/unload_lora_adapter", {"lora_name": name}).get("loaded_adapters", {}):
                raise RuntimeError(f"engine {url}: adapter {name!r} is still loaded after /unload_lora_adapter")
            res = client._post("/load_lora_adapter", {"lora_name": name, "lora_path": str(out)})
            if not res.get("success"):
                raise RuntimeError(f"engine {url}: /load_lora_adapter failed: {res.get('error_message')}")
            if abs(float(res["checksum"]) - checksum) > 1e-9 * max(1.0, checksum):
                raise RuntimeError(f"engine {url}: loaded adapter checksum {res['checksum']} != sent {checksum}")
            client.set_weight_version(str(version))
        finally:
            client.close()
    return {"bytes": (out / ADAPTER_FILE).stat().st_size, "seconds": time.perf_counter() - t0, "checksum": checksum}
