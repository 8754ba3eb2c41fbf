"""Weight sync, trainer -> engines: versioned, verified, and loud when it fails.

`push_named_tensors` sends the HF-named tensors to each engine through SGLang's
`/update_weights_from_tensor` (shared memory on one host) in buffers of `buffer_bytes`, then asks
each engine which weight version it serves. An engine that does not report the new version is an
error naming that engine; nothing is left silently stale.
"""

from __future__ import annotations

import time
from typing import Sequence

import torch

from relax.backends.engine_client import EngineClient


class WeightSyncError(RuntimeError):
    pass


def push_named_tensors(named: Sequence[tuple[str, torch.Tensor]], engine_urls: Sequence[str], version: int,
                       buffer_bytes: int, timeout_s: float = 300.0) -> dict:
    t0 = time.perf_counter()
    total_bytes = 0
    for url in engine_urls:
        client = EngineClient(url, timeout_s=timeout_s)
        try:
            try:
                report = client.update_weights_from_tensor(named, weight_version=str(version),
                                                           buffer_bytes=buffer_bytes)
            except Exception as exc:
                raise WeightSyncError(f"weight sync to engine {url} failed: {exc}") from None
            served = client.get_weight_version()
            if str(served) != str(version):
                raise WeightSyncError(f"engine {url} serves weight version {served!r} after a sync to {version}")
            total_bytes += report["num_bytes"]
        finally:
            client.close()
    seconds = time.perf_counter() - t0
    return {"seconds": seconds, "bytes": total_bytes, "engines": len(engine_urls),
            "bytes_per_s": total_bytes / seconds if seconds > 0 else 0.0}
