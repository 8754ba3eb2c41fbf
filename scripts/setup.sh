#!/usr/bin/env bash
# Create .venv and install Relax with its test dependencies, from scratch, on a CPU machine.
# torch is installed FIRST as torch==2.13.0 (the CPU wheel); everything else keeps it.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
PIP=(.venv/bin/python -m pip install -q --disable-pip-version-check)
"${PIP[@]}" torch==2.13.0
"${PIP[@]}" -e ".[test]"
.venv/bin/python - <<'PYCHECK'
import torch, sys
if not torch.__version__.startswith("2.13.0"):
    sys.exit(f"torch changed to {torch.__version__}; expected 2.13.0 (a dependency pinned another torch)")
print(f"relax setup ok: torch {torch.__version__}, python {sys.version.split()[0]}")
PYCHECK
