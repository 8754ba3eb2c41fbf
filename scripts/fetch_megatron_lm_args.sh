#!/usr/bin/env bash
# Make Megatron-LM's own argument parser (megatron.training.arguments) importable without
# touching the installed megatron-core: download the megatron-core 0.17.0 wheel (1.7 MB, it
# ships megatron/training) with no dependencies and unpack it into a private folder.
# Used by the test that checks Relax's built-in Megatron flag mirror against Megatron's parser,
# and by scripts/gen_megatron_mirror.py. Prints the folder to put on PYTHONPATH.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
VERSION="${MEGATRON_ARGS_VERSION:-0.17.0}"
DEST="${MEGATRON_ARGS_DIR:-$ROOT/.cache/megatron-lm-$VERSION}"
PY="${PYTHON:-$ROOT/.venv/bin/python}"
if [ ! -f "$DEST/megatron/training/arguments.py" ]; then
  TMP="$(mktemp -d)"
  "$PY" -m pip download -q --no-deps --ignore-requires-python --only-binary=:all: \
      "megatron-core==$VERSION" -d "$TMP" >&2
  mkdir -p "$DEST"
  "$PY" -m zipfile -e "$TMP"/megatron_core-*.whl "$DEST"
  rm -rf "$TMP"
fi
echo "$DEST"
