"""Stub of IPython for the CPU SGLang subprocess (sglang.utils imports IPython.display)."""
from _relax_stub import install

install(__name__)
