"""Process groups: torch.distributed and Megatron's model-parallel state.

The only process-wide state is what torch.distributed and Megatron's
`parallel_state` keep themselves.
"""

from __future__ import annotations

import datetime
import random
import socket
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import torch
import torch.distributed as dist

from relax.backends.megatron.cpu_compat import apply_cpu_compat

__all__ = [
    "ParallelLayout",
    "free_port",
    "init_distributed",
    "init_model_parallel",
    "seed_all",
    "layout",
    "destroy",
]


@dataclass(frozen=True)
class ParallelLayout:
    """This rank's place in the parallel grid."""

    world_size: int
    rank: int
    tp: int
    pp: int
    cp: int
    ep: int
    dp: int
    tp_rank: int
    pp_rank: int
    cp_rank: int
    dp_rank: int

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1


def free_port() -> int:
    """A free TCP port on 127.0.0.1 (the rendezvous of a one-rank group)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def init_distributed(
    rank: int,
    world_size: int,
    master_addr: str = "127.0.0.1",
    master_port: int = 29500,
    backend: Optional[str] = None,
    timeout_minutes: float = 30.0,
    local_rank: Optional[int] = None,
) -> None:
    """Join the default process group (no-op if already joined).

    `backend` defaults to "nccl" with CUDA and "gloo" without. With NCCL the
    CUDA device is chosen from `local_rank` (default: rank modulo device count).
    """
    apply_cpu_compat()
    if dist.is_initialized():
        if dist.get_world_size() != world_size or dist.get_rank() != rank:
            raise RuntimeError(
                f"torch.distributed already initialised as rank {dist.get_rank()}/"
                f"{dist.get_world_size()}, asked for {rank}/{world_size}"
            )
        return
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        count = torch.cuda.device_count()
        torch.cuda.set_device(local_rank if local_rank is not None else rank % count)
    dist.init_process_group(
        backend=backend,
        init_method=f"tcp://{master_addr}:{master_port}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(minutes=timeout_minutes),
    )


def init_model_parallel(
    tp: int = 1,
    pp: int = 1,
    cp: int = 1,
    ep: int = 1,
    etp: Optional[int] = None,
    timeout_minutes: float = 30.0,
    seed: Optional[int] = 1234,
    te_rng_tracker: bool = False,
    data_parallel_random_init: bool = False,
    **group_options: Any,
) -> ParallelLayout:
    """Initialise Megatron's parallel state over the default group, then `seed_all(seed)`.

    Re-initialising with the same sizes only re-seeds; other sizes raise.
    `seed=None` leaves the random state alone. `group_options`: further arguments of Megatron's
    `initialize_model_parallel` (relax.backends.megatron.megatron_options.parallel_fields); `te_rng_tracker`:
    Transformer Engine's RNG tracker (--te-rng-tracker); `data_parallel_random_init`: a seed per data-parallel rank
    (--data-parallel-random-init).
    """
    from megatron.core import parallel_state as ps

    apply_cpu_compat()
    if not dist.is_initialized():
        raise RuntimeError("call init_distributed() first")
    world = dist.get_world_size()
    if world % (tp * pp * cp):
        raise ValueError(f"world size {world} is not divisible by tp*pp*cp={tp * pp * cp}")
    if ps.model_parallel_is_initialized():
        current = (
            ps.get_tensor_model_parallel_world_size(),
            ps.get_pipeline_model_parallel_world_size(),
            ps.get_context_parallel_world_size(),
            ps.get_expert_model_parallel_world_size(),
        )
        if current != (tp, pp, cp, ep):
            raise RuntimeError(f"model parallel already initialised with {current}")
    else:
        ps.initialize_model_parallel(
            tensor_model_parallel_size=tp,
            pipeline_model_parallel_size=pp,
            context_parallel_size=cp,
            expert_model_parallel_size=ep,
            expert_tensor_parallel_size=etp,
            distributed_timeout_minutes=int(max(1, timeout_minutes)),
            **group_options,
        )
    if seed is not None:
        seed_all(seed, te_rng_tracker=te_rng_tracker, data_parallel_random_init=data_parallel_random_init)
    return layout()


def seed_all(seed: int, te_rng_tracker: bool = False, data_parallel_random_init: bool = False) -> None:
    """Seed Python, NumPy, torch and Megatron's RNG tracker as Megatron-LM does.

    Pipeline stages get different streams (seed + 100 * pp_rank); within a
    stage, tensor-parallel ranks share the default stream and get distinct
    tensor-parallel streams (tracker).
    """
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    apply_cpu_compat()
    seed = seed + 100 * ps.get_pipeline_model_parallel_rank()
    if data_parallel_random_init:  # Megatron-LM: each data-parallel rank its own seed (the weights are broadcast)
        seed += 10 * ps.get_data_parallel_rank()
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed, te_rng_tracker=te_rng_tracker, force_reset_rng=True)


def layout() -> ParallelLayout:
    """This rank's coordinates (requires `init_model_parallel`)."""
    from megatron.core import parallel_state as ps

    return ParallelLayout(
        world_size=dist.get_world_size(),
        rank=dist.get_rank(),
        tp=ps.get_tensor_model_parallel_world_size(),
        pp=ps.get_pipeline_model_parallel_world_size(),
        cp=ps.get_context_parallel_world_size(),
        ep=ps.get_expert_model_parallel_world_size(),
        dp=ps.get_data_parallel_world_size(),
        tp_rank=ps.get_tensor_model_parallel_rank(),
        pp_rank=ps.get_pipeline_model_parallel_rank(),
        cp_rank=ps.get_context_parallel_rank(),
        dp_rank=ps.get_data_parallel_rank(),
    )


def destroy() -> None:
    """Tear down Megatron's parallel state and the default process group."""
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
