"""Relax: Ray-actor distributed RL post-training for LLMs."""

from relax import heap as _heap
from relax import lazy_jit as _lazy_jit
from relax import transformers_index as _transformers_index

__version__ = "0.1.0"

_heap.install()  # torch, transformers and Megatron import with the cyclic collector paused (see the module)
_lazy_jit.install()  # Megatron's jit fuser without torch._dynamo at import (see the module)
_transformers_index.install()  # transformers' index of its model modules read from a file (see the module)
