"""Stub of vllm._custom_ops (see the package docstring)."""


def rotary_embedding(*args, **kwargs):
    raise NotImplementedError("vllm._custom_ops.rotary_embedding is a stub in Relax's CPU SGLang shims")
