"""A call at every transformer layer of a Megatron model's forward and backward passes.

Used by the fully-async trainer on CPU to re-read how many cores its neighbours leave idle (relax.wire.core_share)
often enough to follow them: a layer is a few milliseconds to a few hundred of a pass that takes seconds. The
forward call comes before each layer (also when activation recomputation runs it again); the backward call when
the gradient of a layer's output has been computed, i.e. before that layer's own backward."""

from __future__ import annotations

from typing import Any, Callable

import torch
from megatron.core.transformer.transformer_layer import TransformerLayer

from relax.backends.megatron.hf_weights import unwrap_model


def at_every_layer(model: Any, call: Callable[[], Any]) -> int:
    """Registers `call` on every TransformerLayer of `model` (a module, a DDP wrapper or a list of chunks).
    Returns the number of layers hooked."""

    def before(module, args):
        call()

    def on_grad(grad):
        call()  # returns None: the gradient passes unchanged

    def after(module, args, output):
        out = output[0] if isinstance(output, (tuple, list)) else output
        if isinstance(out, torch.Tensor) and out.requires_grad:
            out.register_hook(on_grad)

    hooked = 0
    chunks = model if isinstance(model, (list, tuple)) else [model]
    for chunk in chunks:
        for module in unwrap_model(chunk).modules():
            if isinstance(module, TransformerLayer):
                module.register_forward_pre_hook(before)
                module.register_forward_hook(after)
                hooked += 1
    return hooked
