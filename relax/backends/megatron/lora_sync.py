"""Adapter-only weight sync: a LoRA trainer pushes its adapter, not the model, to engines that serve LoRA through
SGLang's endpoints (the embedded engine: relax/backends/embedded/lora.py; real SGLang launched with LoRA:
relax.roles.engine.lora_server_args).

A push writes the adapter in PEFT's format (relax.backends.megatron.lora_peft, what --save-hf writes) to a folder
the engines read, then on each engine unloads the previous adapter of that name, loads the new one
(`/load_lora_adapter`, as SGLang takes an adapter from disk) and sets the weight version. The engine answers
with the checksum of what it loaded; a push whose checksum differs from the sender's raises, naming the engine.
Real SGLang answers no checksum: there the push checks that it lists the adapter under its name from the folder
just written (and --check-weight-update-equal is refused before Ray).
The bytes moved are the adapter's, about 2 x r x (in + out) per adapted linear: proportional to the rank.

In a run (`--lora-rank` without `--lora-merge-sync`), the trainer role's push calls `push_for_config` instead of
the full-weight push, under the same pause of generation and weight-version handshake (relax.core.step_tail);
once a version above 0 is pushed the rollout's requests name the adapter (`lora_path`, relax.rollout.generate).
Every push checks the engine's checksum of what it loaded and the weight version it serves; with
--check-weight-update-equal each adapted module's checksum is compared as well.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any, Sequence

import torch

__all__ = ["push_adapter", "push_for_config", "adapter_checksum", "module_checksums"]


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


def module_checksums(named: Sequence[tuple[str, torch.Tensor]]) -> dict[str, float]:
    """HF module name (PEFT's prefix removed, as the engine names it) -> sum of |A| + |B| in float64."""
    sums: dict[str, float] = {}
    for name, tensor in named:
        module = name.rsplit(".lora_", 1)[0].removeprefix("base_model.model.")
        sums[module] = sums.get(module, 0.0) + float(tensor.double().abs().sum())
    return sums


def _unload(client: Any, url: str, name: str) -> None:
    """Unload adapter `name` where it is loaded. The embedded engine answers success either way; real SGLang answers
    HTTP 400 "LoRA with name ... does not exist" when it is not loaded (the first push), which is fine."""
    from relax.wire.engine_client import EngineRequestError

    try:
        res = client._post("/unload_lora_adapter", {"lora_name": name})
    except EngineRequestError as exc:
        if exc.status == 400 and "does not exist" in str(exc):
            return
        raise
    if name in (res.get("loaded_adapters") or {}):
        raise RuntimeError(f"engine {url}: adapter {name!r} is still loaded after /unload_lora_adapter")


def push_for_config(trainer: Any, engine_urls: Sequence[str], version: int, config: Any) -> dict[str, Any]:
    """`push_adapter` with the run's settings: the adapter folder under --output-dir (only the last version is
    kept), --weight-update-timeout and --check-weight-update-equal."""
    from relax.config.rules_lora import ADAPTER_NAME

    folder = Path(getattr(config, "output_dir", None) or ".") / "lora_push"
    return push_adapter(trainer, engine_urls, folder, version, name=ADAPTER_NAME,
                        timeout_s=float(getattr(config, "weight_update_timeout", None) or 300.0),
                        check_equal=bool(getattr(config, "check_weight_update_equal", False)))


def push_adapter(trainer: Any, engine_urls: Sequence[str], folder: str | Path, version: int, *,
                 name: str = "policy", timeout_s: float = 300.0, check_equal: bool = False) -> dict[str, Any]:
    """Push `trainer`'s adapter to every engine as adapter `name` at weight version `version`. Collective over the
    trainer's ranks (the adapter is gathered over TP); rank 0 writes and sends. Returns the weight push's report
    ({"bytes" (summed over engines, as a full push counts them), "seconds", "bytes_per_s", "engines", "method",
    "checksum"}) on rank 0, {} elsewhere. `check_equal`: each adapted module's checksum on the engine is
    compared with the sender's, not only their total."""
    import torch.distributed as dist
    from safetensors.torch import save_file

    from relax.wire.engine_client import EngineClient, EngineRequestError
    from relax.backends.megatron.lora_peft import ADAPTER_FILE, peft_snapshot, write_config

    t0 = time.perf_counter()
    named, config = peft_snapshot(trainer)
    if dist.get_rank() != 0:
        return {}
    if not engine_urls:
        return {"seconds": 0.0, "bytes": 0, "engines": 0, "bytes_per_s": 0.0, "method": "lora_adapter"}
    out = Path(folder) / f"v{version}"
    out.mkdir(parents=True, exist_ok=True)
    save_file({n: t.contiguous() for n, t in named}, str(out / ADAPTER_FILE), metadata={"format": "pt"})
    write_config(out, config)
    checksum = adapter_checksum(named)
    sums = module_checksums(named) if check_equal else {}
    for url in engine_urls:
        client = EngineClient(url, timeout_s=timeout_s)
        try:
            _unload(client, url, name)
            try:
                res = client._post("/load_lora_adapter", {"lora_name": name, "lora_path": str(out)})
            except EngineRequestError as exc:  # SGLang answers a failed load with HTTP 400
                raise RuntimeError(f"engine {url}: /load_lora_adapter failed: {exc}") from None
            if not res.get("success"):
                raise RuntimeError(f"engine {url}: /load_lora_adapter failed: {res.get('error_message')}")
            if "checksum" not in res:
                # real SGLang: no checksum in its answer; it must list the adapter under `name`, from this folder
                ref = (res.get("loaded_adapters") or {}).get(name)
                path = ref.get("lora_path") if isinstance(ref, dict) else ref
                if path != str(out):
                    raise RuntimeError(f"engine {url}: adapter {name!r} serves {path!r} after loading {str(out)!r}")
                if check_equal:
                    raise RuntimeError(f"engine {url}: --check-weight-update-equal needs the engine's checksums of "
                                       "the adapter (the embedded engine's); SGLang does not report them")
            elif abs(float(res["checksum"]) - checksum) > 1e-9 * max(1.0, checksum):
                raise RuntimeError(f"engine {url}: loaded adapter checksum {res['checksum']} != sent {checksum}")
            got = res.get("module_checksums") or {}
            bad = [m for m, want in sums.items() if m not in got or abs(float(got[m]) - want) > 1e-9 * max(1.0, want)]
            if bad or (sums and set(got) != set(sums)):
                raise RuntimeError(f"engine {url}: adapter modules differ from the trainer's after the push of "
                                   f"version {version} (--check-weight-update-equal): {sorted(bad)[:8] or sorted(got)}")
            client.set_weight_version(str(version))
            served = client.get_weight_version()
            if str(served) != str(version):
                raise RuntimeError(f"engine {url} serves weight version {served!r} after the adapter push of {version}")
        finally:
            client.close()
    for old in Path(folder).glob("v*"):  # the engines hold the adapter in memory: earlier folders are not read again
        if old != out and old.is_dir():
            shutil.rmtree(old, ignore_errors=True)
    seconds = time.perf_counter() - t0
    total = (out / ADAPTER_FILE).stat().st_size * len(engine_urls)
    return {"bytes": total, "seconds": seconds, "bytes_per_s": total / seconds if seconds > 0 else 0.0,
            "engines": len(engine_urls), "method": "lora_adapter", "checksum": checksum}
