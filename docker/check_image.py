"""Fail the image build when an install changed torch or left a part of the stack unimportable.

    python docker/check_image.py --torch 2.13.0 [--gpu-stack]

Imports only (no GPU needed at build time): Relax and its roles, plus megatron-core, SGLang, sglang-router and
Transformer Engine with --gpu-stack."""

from __future__ import annotations

import argparse
import importlib
import sys


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--torch", required=True, help="the torch version every install must have kept")
    parser.add_argument("--gpu-stack", action="store_true", help="also import SGLang and Transformer Engine")
    args = parser.parse_args()

    import torch

    if not torch.__version__.startswith(args.torch):
        print(f"torch changed to {torch.__version__}; expected {args.torch} (a later install pinned another torch)",
              file=sys.stderr)
        return 1
    modules = ["relax.core.controller", "megatron.core", "transfer_queue", "ray", "sglang_router"]
    if args.gpu_stack:
        modules += ["sglang", "sglang.srt.server_args", "transformer_engine"]
    versions = []
    for name in modules:
        module = importlib.import_module(name)
        versions.append(f"{name} {getattr(module, '__version__', '')}".strip())
    print(f"image ok: torch {torch.__version__} (CUDA {torch.version.cuda}), python {sys.version.split()[0]}; "
          + ", ".join(versions))
    return 0


if __name__ == "__main__":
    sys.exit(main())
