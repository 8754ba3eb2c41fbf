"""Stub of torchvision for the CPU SGLang subprocess.

The PyPI torchvision wheel cannot load beside the CPU torch 2.13 build, and SGLang only needs it
for multimodal processors that text models never use.
"""
from _relax_stub import install

__version__ = "0.0.0+relaxstub"
install(__name__)
