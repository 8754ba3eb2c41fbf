"""Let Megatron-core run on a machine without CUDA.

This is the only module of the Megatron backend that knows CUDA may be missing.
`apply_cpu_compat()` does nothing when `torch.cuda.is_available()`; otherwise it
applies the smallest set of patches that megatron-core 0.16 needs on CPU:

1. `torch.cuda.current_device()` returns the CPU device.
2. The CUDA RNG state functions used by Megatron's RNG tracker are routed to
   the default CPU generator, so `model_parallel_cuda_manual_seed` and
   `get_cuda_rng_tracker().fork()` keep their meaning (per-TP-rank streams).
3. Tensor factories and `.to()/.cuda()` calls that name a CUDA device are
   rewritten to the CPU by a `TorchFunctionMode` pushed on each thread that
   calls `apply_cpu_compat()` (torch keeps the mode stack per thread).
4. `Tensor.type()` without arguments reports the CUDA type name for CPU float
   tensors ("torch.cuda.FloatTensor"), which Megatron's optimizers assert.
5. `torch.cuda.synchronize()` is a no-op.
6. `torch.cuda.current_stream()/default_stream()/stream()/Stream/Event` are dummies.
7. Code reached from backward (where no function mode is active): causal masks
   built on the CPU, MoE split sizes converted to NumPy as on GPU.
8. (No Transformer Engine) the MoE router's `te_general_gemm` name is defined as None.

The patches are idempotent: the process-wide ones are applied once, and the
function mode is pushed at most once per thread. Call `apply_cpu_compat()` at
the entry of every public operation that may run on a new thread.
"""

from __future__ import annotations

import contextlib
import threading

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["apply_cpu_compat", "cpu_compat_active", "compute_device", "native_device_ops"]

_CPU = torch.device("cpu")
_process_patched = False
_process_lock = threading.Lock()
_thread_state = threading.local()

_CUDA_TYPE_NAMES = {
    "torch.FloatTensor": "torch.cuda.FloatTensor",
    "torch.HalfTensor": "torch.cuda.HalfTensor",
    "torch.BFloat16Tensor": "torch.cuda.BFloat16Tensor",
    "torch.DoubleTensor": "torch.cuda.DoubleTensor",
}


def _is_cuda_device(device) -> bool:
    if device is None or isinstance(device, bool):
        return False
    if isinstance(device, int):
        return True  # a bare index names a CUDA device
    if isinstance(device, str):
        return device.startswith("cuda")
    if isinstance(device, torch.device):
        return device.type == "cuda"
    return False


def _to_cpu_args(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Rewrite CUDA devices among the positional/keyword arguments of `Tensor.to`."""
    if "device" in kwargs and _is_cuda_device(kwargs["device"]):
        kwargs = {**kwargs, "device": _CPU}
    if len(args) > 1 and _is_cuda_device(args[1]):
        args = (args[0], _CPU) + tuple(args[2:])
    return args, kwargs


class _CudaToCpuMode(TorchFunctionMode):
    """Rewrites CUDA devices to CPU and reports CUDA type names for CPU tensors."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if "device" in kwargs and _is_cuda_device(kwargs["device"]):
            kwargs = {**kwargs, "device": _CPU}
        if func is torch.Tensor.to:
            args, kwargs = _to_cpu_args(args, kwargs)
        elif func is torch.Tensor.cuda:
            return args[0]
        elif func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return _CUDA_TYPE_NAMES.get(name, name)
        elif func is torch.Tensor.record_stream:
            return None
        return func(*args, **kwargs)


class _DummyEvent:
    """Stands in for a CUDA event: already complete."""

    def __init__(self, *args, **kwargs):
        pass

    def record(self, stream=None) -> None:
        pass

    def wait(self, stream=None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


class _DummyStream:
    """Stands in for a CUDA stream: every operation completes immediately."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, stream) -> None:
        pass

    def wait_event(self, event) -> None:
        pass

    def record_event(self, event=None):
        return event if event is not None else _DummyEvent()

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


def _cpu_get_rng_state(device="cuda", clone: bool = False, graph_safe: bool = False):
    return torch.get_rng_state()


def _cpu_set_rng_state(new_state, device=-1, graph_safe: bool = False) -> None:
    torch.set_rng_state(new_state)


def _cpu_manual_seed(seed: int) -> None:
    torch.default_generator.manual_seed(int(seed))


def _patch_process() -> None:
    cuda = torch.cuda
    cuda.current_device = lambda: _CPU
    cuda.synchronize = lambda device=None: None
    cuda.current_stream = lambda device=None: _DummyStream()
    cuda.default_stream = lambda device=None: _DummyStream()
    cuda.Stream = _DummyStream
    cuda.Event = _DummyEvent
    cuda.stream = lambda stream=None: contextlib.nullcontext()
    cuda.get_rng_state = lambda device="cuda": torch.get_rng_state()
    cuda.set_rng_state = lambda new_state, device="cuda": torch.set_rng_state(new_state)
    cuda.manual_seed = _cpu_manual_seed
    cuda.random.get_rng_state = cuda.get_rng_state
    cuda.random.set_rng_state = cuda.set_rng_state

    from megatron.core.tensor_parallel import random as mcore_random

    mcore_random._get_cuda_rng_state = _cpu_get_rng_state
    mcore_random._set_cuda_rng_state = _cpu_set_rng_state

    _patch_backward_paths()

    # Without Transformer Engine, megatron-core 0.16 leaves this name undefined
    # but tests it in the MoE router's gating linear.
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def _cpu_causal_mask(sq: int) -> torch.Tensor:
    return torch.triu(torch.ones(sq, sq, device=_CPU), diagonal=1).bool()


def _cpu_sliding_window_mask(sq, skv, window_size) -> torch.Tensor:
    m = torch.ones(sq, skv, dtype=torch.bool, device=_CPU)
    upper = torch.triu(m, diagonal=skv - sq - window_size[0])
    return ~torch.tril(upper, diagonal=skv - sq + window_size[1])


def _maybe_move_tensor_to_cpu(tensor, as_numpy: bool = False, record_stream: bool = False):
    # Megatron converts split sizes to NumPy only when moving them off the GPU;
    # all_to_all_single rejects tensors, so convert CPU tensors too.
    if torch.is_tensor(tensor) and as_numpy:
        return tensor.numpy()
    return tensor


def _patch_backward_paths() -> None:
    """Code that also runs during backward, where the function mode is not active.

    torch pops a `TorchFunctionMode` while it handles a call, and the whole
    backward pass runs inside the handling of `torch.autograd.backward`, so
    custom autograd backwards and activation recomputation see no mode. What
    they need: `current_device()` (patched to the CPU device), the causal masks
    (hard-coded "cuda"), MoE split sizes (left as tensors on CPU) and the rotary
    embedding's context-parallel slice (a pinned index moved with `.cuda()`).
    """
    from megatron.core.fusions import fused_softmax
    from megatron.core.models.common.embeddings import rotary_pos_embedding
    from megatron.core.transformer import utils as transformer_utils
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    for module in (fused_softmax, transformer_utils):
        module.get_default_causal_mask = _cpu_causal_mask
        module.get_sliding_window_causal_mask = _cpu_sliding_window_mask
    moe_utils.maybe_move_tensor_to_cpu = _maybe_move_tensor_to_cpu
    token_dispatcher.maybe_move_tensor_to_cpu = _maybe_move_tensor_to_cpu
    rotary_pos_embedding.get_pos_emb_on_this_cp_rank = _cpu_pos_emb_on_this_cp_rank


def _cpu_pos_emb_on_this_cp_rank(pos_emb: torch.Tensor, seq_dim: int, cp_group) -> torch.Tensor:
    """Megatron's rotary slice for this context-parallel rank (chunks r and 2 cp - 1 - r), whose index tensor
    is pinned and moved with `.cuda()` (the model's forward runs without the device-rewriting mode)."""
    cp, rank = cp_group.size(), cp_group.rank()
    index = torch.tensor([rank, 2 * cp - rank - 1], device=pos_emb.device)
    pos_emb = pos_emb.view(*pos_emb.shape[:seq_dim], 2 * cp, -1, *pos_emb.shape[seq_dim + 1:])
    pos_emb = pos_emb.index_select(seq_dim, index)
    return pos_emb.view(*pos_emb.shape[:seq_dim], -1, *pos_emb.shape[seq_dim + 2:])


def cpu_compat_active() -> bool:
    """True when the CPU patches are in force (CUDA absent and `apply_cpu_compat` called)."""
    return _process_patched


def apply_cpu_compat() -> bool:
    """Apply the CPU patches (no-op with CUDA). Returns True when they are active.

    Idempotent; also pushes the device-rewriting mode on the calling thread if it
    is not yet there.
    """
    global _process_patched
    if torch.cuda.is_available():
        return False
    with _process_lock:
        if not _process_patched:
            _patch_process()
            _process_patched = True
    if not getattr(_thread_state, "mode_pushed", False):
        mode = _CudaToCpuMode()
        mode.__enter__()  # stays for the life of the thread
        _thread_state.mode_pushed = True
    return True


@contextlib.contextmanager
def native_device_ops():
    """Suspend the device-rewriting mode of this thread for a block (no-op with CUDA or without the mode).

    Every torch call under the mode passes through Python (`_CudaToCpuMode.__torch_function__`): ~37,000
    calls per step of the embedded default, a fifth of its training time on 2 cores (cProfile). The model's
    forward and the loss need none of its rewrites: their device comes from `torch.cuda.current_device()`,
    patched to the CPU for the whole process (backward already runs without the mode, see
    `_patch_backward_paths`). Megatron's schedule and optimizer around them keep the mode."""
    if not getattr(_thread_state, "mode_pushed", False) or not any(
            isinstance(m, _CudaToCpuMode) for m in torch.overrides._get_current_function_mode_stack()):
        yield
        return
    with torch.overrides._pop_mode_temporarily() as mode:
        if not isinstance(mode, _CudaToCpuMode):  # another mode is on top: leave the stack as it was
            with mode:
                yield
            return
        yield


def compute_device() -> torch.device:
    """The device Megatron computes on: the current CUDA device, or the CPU without CUDA."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return _CPU
