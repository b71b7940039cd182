#!/usr/bin/env bash
# Fetch, here (where pip reaches the registry), the wheels a borrowed GPU machine lacks into .whl/, which
# hack/test-gpu.sh installs there: its python3 (3.12, x86-64, no network) has torch, grpcio, protobuf, xxhash,
# transformers and prometheus-client, but not gRPC's health and reflection services, rocksdict (the disk tier),
# zstandard (quantization modes k8v4 and k6v4z, which the TTFT benchmark runs), nor the grpcio and protobuf versions
# our generated stubs require. The versions are this checkout's virtualenv's.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV_PY=${VENV_PY:-.venv/bin/python}
exclude=$(git rev-parse --git-path info/exclude)
grep -qxF '/.whl/' "$exclude" 2> /dev/null || echo '/.whl/' >> "$exclude"
rm -rf .whl && mkdir .whl
pins=$("$VENV_PY" - << 'PY'
from importlib.metadata import version
print(" ".join(f"{n}=={version(n)}" for n in ("grpcio", "grpcio-health-checking", "grpcio-reflection", "protobuf",
                                                "rocksdict", "zstandard")))
PY
)
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
  platforms+=(--platform "$p")
done
for pin in $pins; do
  "$VENV_PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${platforms[@]}" -d .whl "$pin"
done
ls -la .whl
du -sh .whl
