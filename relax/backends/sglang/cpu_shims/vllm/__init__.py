"""Stub of vllm for the CPU SGLang subprocess: only `vllm._custom_ops` exists.

SGLang's rotary embedding imports `vllm._custom_ops.rotary_embedding` as a fallback kernel when it
runs on a device it does not treat as CUDA; on CPU the torch-native path is used, so the import
only has to succeed. Every other `vllm.*` import still fails with ImportError, which SGLang
handles as "vllm not installed".
"""

__version__ = "0.0.0+relaxstub"
