#!/usr/bin/env bash
# Build the virtualenv of vLLM's CUDA wheel (the release GPU users run; ~9 GB, outside the checkout) for
# `make test-vllm-cuda`: without a GPU its compiled ops do not load, but its Python - configs, Request objects, the
# scheduler, the KV connector base class - does, so the connector's scheduler side is tested against it
# (tests/vllm/test_vllm_connector_scheduler.py with VLLM_TARGET_DEVICE=cpu). Rebuilt only when this file's pins
# change. Prints the venv's python on its last line.
set -euo pipefail
VLLM_VERSION=0.33.0
CACHE=${PROMPTCACHE_VLLM_CACHE:-$HOME/.cache/promptcache-vllm}
VENV=$CACHE/venv-$VLLM_VERSION-cuda
STAMP=$VENV/.built-$(sha256sum "$0" | cut -c1-16)
if [ -f "$STAMP" ]; then echo "$VENV/bin/python"; exit 0; fi
PY=${VLLM_PYTHON:-}
if [ -z "$PY" ]; then
  for c in python3.12 /root/.pyenv/versions/3.12.*/bin/python3.12 python3.13 python3.11; do
    if command -v "$c" >/dev/null 2>&1 && "$c" -c 'import venv' >/dev/null 2>&1; then PY=$(command -v "$c"); break; fi
  done
fi
[ -n "$PY" ] || { echo "vllm-cuda-env: no python3.11-3.13 found (set VLLM_PYTHON)" >&2; exit 1; }
start=$(date +%s)
rm -rf "$VENV"
mkdir -p "$CACHE"
"$PY" -m venv "$VENV" >&2
"$VENV/bin/pip" install -q uv >&2
"$VENV/bin/uv" pip install -q --python "$VENV/bin/python" "vllm==$VLLM_VERSION" "xxhash>=3.4" "zstandard>=0.22" >&2
touch "$STAMP"
echo "vllm-cuda-env: built $VENV in $(( $(date +%s) - start )) s" >&2
echo "$VENV/bin/python"
