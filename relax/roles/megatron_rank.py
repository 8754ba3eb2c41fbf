"""What every Megatron rank actor (actor, reference, teacher, critic) shares: thread count, its place in
the group, the rendezvous address of rank 0, and joining the process group.

The roles' modules import the backend's modules that load Megatron-core (its trainer, model, checkpoint, layer
hooks, ...) inside the methods that use them: the driver imports these modules for their Ray actor classes alone,
and Megatron's import would cost it seconds of CPU at every launch. tests/test_import_costs.py checks that the
driver's imports leave it out."""

from __future__ import annotations

import contextlib
import os
import socket
from typing import Any

import ray

from relax.observability.heartbeat import start_heartbeat
from relax.observability import timeline
from relax.weights.sync import close_all as close_weight_syncs
from relax.wire.core_share import CORES_META, RANK_SLOTS, CoreBoard


class MegatronRank:
    """Plain base class; each role subclasses it under `@ray.remote`."""

    def __init__(self, config: Any, rank: int, world_size: int, threads: int = 1):
        import torch

        torch.set_num_threads(max(1, threads))
        self.threads = max(1, threads)
        # --fully-async on CPU: the run's board of busy cores on this node (relax.wire.core_share); None otherwise
        self.core_board = CoreBoard.for_run(config.meta.get(CORES_META))
        self.config = config
        self.rank = rank
        self.world_size = world_size
        self.trainer = None
        self.data = None
        self.offloader = None
        timeline.set_role(f"{type(self).__name__.replace('Worker', '').lower()} rank {rank}")  # its timeline track
        start_heartbeat(self)  # --use-health-check: beats from a thread of its own (relax.observability.heartbeat)

    def computing(self, role: str):
        """This rank's cores marked busy on the run's board while it computes (--fully-async on CPU: the actor's
        trainer then leaves them to it; relax.wire.core_share)."""
        if self.core_board is None:
            return contextlib.nullcontext()
        return self.core_board.computing(RANK_SLOTS[role] + self.rank, self.threads)

    def master_address(self) -> tuple[str, int]:
        """This node's address and a free port, for rank 0 to host the rendezvous."""
        host = ray.util.get_node_ip_address()
        with socket.socket() as sock:
            sock.bind(("", 0))
            return host, sock.getsockname()[1]

    def where(self) -> str:
        """This rank's node address and process id, as error lines name it."""
        return f"{ray.util.get_node_ip_address()} pid {os.getpid()}"

    def join_process_group(self, master_addr: str, master_port: int, backend: str) -> None:
        from relax.backends.megatron.cpu_compat import apply_cpu_compat
        from relax.backends.megatron.parallel import init_distributed

        apply_cpu_compat()
        init_distributed(self.rank, self.world_size, master_addr, master_port, backend=backend,
                         timeout_minutes=self.config.distributed_timeout_minutes)

    def save(self, path: str) -> str:
        return str(self.trainer.save_checkpoint(path))

    def load(self, path: str) -> int:
        return self.trainer.load_checkpoint(path)

    def weights_checksum(self, model: str = "trainer") -> float:
        """Sum of |w| over this rank's parameters; `model="reference"` for the reference model a trainer rank
        holds itself (config.reference_placement, relax.config.facts)."""
        owner = getattr(self, model, None)
        if owner is None:
            raise ValueError(f"rank {self.rank} holds no {model} model")
        if hasattr(owner, "weights_checksum"):  # the reference in a process of its own (ReferenceProcess)
            return owner.weights_checksum()
        from relax.backends.megatron.model import weights_checksum  # not at the top: loads Megatron-core

        return weights_checksum(owner.gpt_model)

    # --offload-train / --colocate: free the trainer's memory while the engines run (relax.core.colocate)
    def offload_memory(self) -> dict[str, float]:
        from relax.backends.megatron.offload import TrainerOffloader

        if self.offloader is None:
            import os

            spill = os.path.join(self.config.output_dir, "offload", f"{type(self).__name__}-{self.rank}.bin")
            self.offloader = TrainerOffloader(self.trainer, spill)
        return self.offloader.offload()

    def reload_memory(self) -> dict[str, float]:
        return self.offloader.reload() if self.offloader is not None else {"reload/bytes": 0.0}

    def resident_memory(self) -> int:
        from relax.backends.megatron.offload import rss_bytes

        return rss_bytes()

    def shutdown(self) -> None:
        from relax.backends.megatron.parallel import destroy

        close_weight_syncs()  # the shared-memory staging segment in /dev/shm goes with the run
        try:
            destroy()
        except Exception:  # best effort at exit
            pass
