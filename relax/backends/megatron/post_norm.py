"""GLM4's post-sublayer norms in a Megatron-core transformer layer.

GLM4 (transformers' `Glm4DecoderLayer`) normalises each sublayer's output before adding it to the residual stream:

    h = h + post_self_attn_layernorm(self_attn(input_layernorm(h)))
    h = h + post_mlp_layernorm(mlp(post_attention_layernorm(h)))

Megatron-core's `TransformerLayer` (0.16) has no slot there: its submodules are input_layernorm, self_attention,
self_attn_bda, pre_mlp_layernorm, mlp and mlp_bda, and the two bias-dropout-adds are the only steps between a
sublayer's output and the residual add. `PostNormTransformerLayer` keeps Megatron's layer and adds the two norms
as submodules of their own (built as Megatron builds its norms, so sequence parallelism and Transformer Engine
norms work as for the others); it wraps each bias-dropout-add so that the norm sees the sublayer's output (bias
included) first. The parameters are named `decoder.layers.N.post_self_attn_layernorm.weight` and
`...post_mlp_layernorm.weight`, as in the HF checkpoint.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Union

from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

__all__ = ["PostNormLayerSubmodules", "PostNormTransformerLayer", "with_post_norms"]


@dataclass
class PostNormLayerSubmodules(TransformerLayerSubmodules):
    """Megatron's layer submodules plus the norms of the attention's and the MLP's outputs."""

    post_self_attn_layernorm: Union[ModuleSpec, type] = IdentityOp
    post_mlp_layernorm: Union[ModuleSpec, type] = IdentityOp


def _normed(add: Callable, norm: Any) -> Callable:
    """A bias-dropout-add function (Megatron's `get_bias_dropout_add(training, fused)`) that first normalises the
    sublayer's output (plus its bias)."""

    def apply(x_with_bias, residual, prob):
        out, bias = x_with_bias
        if bias is not None:
            out = out + bias
        return add((norm(out), None), residual, prob)

    return apply


class PostNormTransformerLayer(TransformerLayer):
    """Megatron's `TransformerLayer` with GLM4's post-attention and post-MLP norms (see the module docstring)."""

    def __init__(self, config, submodules: PostNormLayerSubmodules, *args: Any, **kwargs: Any):
        super().__init__(config, submodules, *args, **kwargs)
        for name in ("post_self_attn_layernorm", "post_mlp_layernorm"):
            setattr(self, name, build_module(getattr(submodules, name), config=config,
                                             hidden_size=config.hidden_size, eps=config.layernorm_epsilon))
        # Megatron's bias-dropout-add builders, which TransformerLayer calls as self.<x>_bda(training, fused) in each
        # forward; the bound methods in their place add the norm, read from the layer at each call
        self._plain_bda = {"attn": self.self_attn_bda, "mlp": self.mlp_bda}
        self.self_attn_bda = self._post_self_attn_bda
        self.mlp_bda = self._post_mlp_bda

    def _post_self_attn_bda(self, training: bool, fused: bool) -> Callable:
        return _normed(self._plain_bda["attn"](training, fused), self.post_self_attn_layernorm)

    def _post_mlp_bda(self, training: bool, fused: bool) -> Callable:
        return _normed(self._plain_bda["mlp"](training, fused), self.post_mlp_layernorm)


def with_post_norms(spec: ModuleSpec, norm: Union[ModuleSpec, type]) -> ModuleSpec:
    """`spec` (a `TransformerLayer` spec) as a `PostNormTransformerLayer` spec whose two extra norms are `norm`."""
    if spec.module is not TransformerLayer:
        raise ValueError(f"post-sublayer norms need Megatron's TransformerLayer, not {spec.module.__name__}")
    fields = {f.name: getattr(spec.submodules, f.name) for f in dataclasses.fields(spec.submodules)}
    submodules = PostNormLayerSubmodules(**fields, post_self_attn_layernorm=norm, post_mlp_layernorm=norm)
    return dataclasses.replace(spec, module=PostNormTransformerLayer, submodules=submodules)
