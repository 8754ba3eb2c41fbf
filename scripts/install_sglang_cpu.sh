#!/usr/bin/env bash
# Install real SGLang for CPU into a separate virtual environment (default: .venv-sglang).
#
#   bash scripts/install_sglang_cpu.sh [VENV_DIR]
#
# `pip install sglang` cannot work as is on a CPU machine: SGLang pins torch 2.14.1 and CUDA-only
# packages (flashinfer, sgl-kernel, cutlass, deep-ep, ...). So: torch==2.13.0 first (the CPU wheel),
# then sglang with --no-deps, then exactly the pure-Python / CPU dependencies that
# `python -m sglang.launch_server --device cpu` imports, each with --no-deps, pinned.
# Modules SGLang imports but cannot use on CPU (triton, torchvision, vllm._custom_ops, IPython) are
# stubbed at run time by relax/backends/sglang/cpu_shims, which SGLangServerProcess puts on the
# server's PYTHONPATH; nothing is stubbed inside the venv. Triton (a 286 MB wheel, 1 GB installed)
# is left out unless SGLANG_WITH_TRITON=1: on CPU SGLang only defines Triton kernels, never runs
# one, and the shims then give it the stand-in SGLang itself uses on Apple Silicon.
#
# Relax's own .venv is never touched. Point Relax at the result with
#   export RELAX_SGLANG_PYTHON=$PWD/.venv-sglang/bin/python
# (tests/test_sglang_cpu.py also finds .venv-sglang by itself). See docs/sglang-cpu.md.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${1:-.venv-sglang}"
PY="${PYTHON:-python3}"
SGLANG_VERSION="${SGLANG_VERSION:-0.5.23}"
t0=$(date +%s)

if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
# Keep the venv out of git wherever it lies (as `python -m venv` does itself from Python 3.13 on).
[ -f "$VENV/.gitignore" ] || echo '*' > "$VENV/.gitignore"

PIP=("$VENV/bin/python" -m pip install -q --disable-pip-version-check)
"${PIP[@]}" torch==2.13.0
"${PIP[@]}" --no-deps "sglang==${SGLANG_VERSION}"

# What launch_server, its tokenizer/scheduler/detokenizer processes and the HTTP server import on
# CPU (found by starting the server until no ModuleNotFoundError was left), plus their own
# dependencies. Pinned: these versions were verified together with sglang 0.5.23 and torch 2.13.0.
DEPS=(
  # model and tokenizer stack (SGLang pins transformers and tokenizers)
  transformers==5.19.0 tokenizers==0.23.2 "huggingface_hub==1.33.0" safetensors==0.8.0 hf-xet==1.8.0
  numpy==2.4.6 regex==2026.11.19 PyYAML==6.0.4 tqdm==4.70.1 packaging==26.4 typer==0.29.2
  shellingham==1.5.4 rich==15.0.0 markdown-it-py==4.3.0 mdurl==0.1.2 Pygments==2.21.0 click==8.5.1
  # kernels and grammar: xgrammar is the default grammar backend
  xgrammar==0.2.7 apache-tvm-ffi==0.1.11 compressed-tensors==0.18.0 gguf==0.19.0
  einops==0.8.2 interegular==0.3.3 sentencepiece==0.2.3 tiktoken==0.14.0 pillow==13.0.0
  # HTTP server and IPC
  fastapi==0.165.0 starlette==1.10.0 annotated-doc==0.0.7 opentelemetry-api==1.45.2
  importlib_metadata==10.2.0 zipp==4.1.2 lazy-importer==0.1.0 uvicorn==0.54.0 uvloop==0.23.0 h11==0.16.0
  anyio==4.16.0 sniffio==1.3.1 python-multipart==0.0.34 pydantic==2.14.4 pydantic_core==2.50.5
  annotated-types==0.8.0 typing-inspection==0.4.5 orjson==3.13.0 pyzmq==27.3.0 msgspec==0.23.0
  pybase64==1.5.1 psutil==7.2.2 setproctitle==1.3.8 prometheus_client==0.26.0 dill==0.4.1 loguru==0.7.3
  partial-json-parser==0.2.1.1.post7 jsonschema==4.26.0 jsonschema-specifications==2025.9.1
  referencing==0.37.0 rpds-py==2026.9.1 soundfile==0.13.1 cffi==2.1.1 pycparser==3.12
  # HTTP clients (OpenAI-compatible entrypoints, hub)
  openai==2.8.0 jiter==0.19.0 distro==1.9.0 httpx==0.28.1 httpcore==1.0.9 requests==2.34.2
  urllib3==2.8.0 idna==3.20 certifi==2026.10.19.post1 charset-normalizer==3.5.3
  aiohttp==3.14.5 aiosignal==1.4.0 frozenlist==1.8.0 multidict==7.2.1 yarl==1.25.1 propcache==0.5.4
  attrs==26.1.0 aiohappyeyeballs==2.7.1
)
if [ "${SGLANG_WITH_TRITON:-0}" = 1 ]; then
  DEPS+=(triton==3.9.0)
fi
"${PIP[@]}" --no-deps "${DEPS[@]}"

PYTHONPATH="$PWD/relax/backends/sglang/cpu_shims" "$VENV/bin/python" - <<'PYCHECK'
import sys
import torch
if not torch.__version__.startswith("2.13.0"):
    sys.exit(f"torch changed to {torch.__version__}; expected 2.13.0")
import sglang
from sglang.srt.server_args import ServerArgs  # noqa: F401
import sglang.srt.entrypoints.http_server  # noqa: F401  (the whole server import chain)
import triton
kind = "stand-in (cpu_shims)" if getattr(triton, "__relax_stub__", False) else f"real {triton.__version__}"
print(f"sglang {sglang.__version__} ok: torch {torch.__version__}, triton {kind}, python {sys.version.split()[0]}")
PYCHECK

t1=$(date +%s)
echo "installed SGLang for CPU into $VENV in $((t1 - t0)) s; size $(du -sh "$VENV" | cut -f1)"
echo "use it with: export RELAX_SGLANG_PYTHON=$(cd "$VENV" && pwd)/bin/python"
