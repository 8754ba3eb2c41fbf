#!/usr/bin/env bash
# Create .venv and install Relax with its test dependencies, from scratch, on a CPU machine.
# torch is installed FIRST as torch==2.13.0 (the CPU wheel); everything else keeps it.
#
# RELAX_SETUP_SGLANG=1 also installs real SGLang for CPU into .venv-sglang (scripts/install_sglang_cpu.sh), for
# the real-SGLang tests (CI sets it). Best effort: if that install fails (network, resolver), setup still succeeds,
# prints one line saying so, and those tests skip with their reason. See docs/sglang-cpu.md.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
PIP=(.venv/bin/python -m pip install -q --disable-pip-version-check)
"${PIP[@]}" torch==2.13.0
"${PIP[@]}" -e ".[test]"
# Relax's own bytecode, written once: with PYTHONDONTWRITEBYTECODE set (as on some CI machines) every process of
# a run would compile the modules it imports again (~0.5 CPU s in each of the run's heavier processes).
.venv/bin/python -m compileall -q relax >/dev/null
.venv/bin/python - <<'PYCHECK'
import torch, sys
if not torch.__version__.startswith("2.13.0"):
    sys.exit(f"torch changed to {torch.__version__}; expected 2.13.0 (a dependency pinned another torch)")
print(f"relax setup ok: torch {torch.__version__}, python {sys.version.split()[0]}")
PYCHECK

if [ "${RELAX_SETUP_SGLANG:-0}" = 1 ]; then
  log=.venv/install_sglang_cpu.log  # inside .venv: ignored by git, and gone with it
  limit=900  # it takes 95-207 s; a stalled mirror must not hold CI
  if timeout "$limit" bash scripts/install_sglang_cpu.sh >"$log" 2>&1; then
    tail -n 3 "$log" | head -n 2
  else
    rc=$?
    # A half-made venv would not skip the tests but fail them: take it away.
    rm -rf .venv-sglang
    if [ "$rc" = 124 ]; then why="timed out after $limit s"; else why=$(grep -v '^WARNING: Location' "$log" | tail -n 1 | cut -c1-200); fi
    echo "relax setup: SGLang for CPU not installed (scripts/install_sglang_cpu.sh: $why; full log: $log); the real-SGLang tests will skip"
  fi
fi
