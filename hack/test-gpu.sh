#!/usr/bin/env bash
# The GPU lane (`make test-gpu`): the tests marked cuda (tests/test_cuda.py), the TTFT benchmark with the model on
# CUDA and the sidecar as the operator runs it by default (a host tier; the client on the bulk channel too; the CUDA
# tier with GPU_TTFT_SIDECAR=cuda), and the vLLM connector's worker-side save and load on CUDA KV caches in vLLM's
# layouts (`promptcache bench paged`: torch alone, bit-exact check, GB/s next to a pinned cudaMemcpy), in one call
# that ends within about 8 minutes. Results go to $RESULTS (default: $OUT when set, as on the device machine, else
# bench-results/gpu/): summary.json (what ran, on what, the outcome), cuda-tests.xml and cuda-tests.log (pytest),
# ttft.json and ttft.log (the benchmark), paged.json and paged.log (the save/load round trip), copy-paths.json (what
# each way of moving bytes between the GPU and the host costs: hack/gpu-copy-paths.py; CUDA only). Eight files at
# most: what a borrowed machine's $OUT returns.
#
# Without a CUDA device it runs the same steps on the CPU, quickly (the cuda tests skip, naming why; the benchmark
# runs a toy model), so that it cannot rot: tests/test_gpu_lane.py runs it that way in `make test`.
#
# On a machine with no network and no virtualenv (a borrowed GPU machine whose python3 has torch, grpcio, protobuf,
# xxhash, transformers and prometheus-client): wheels of what is missing go in .whl/ (hack/gpu-wheels.sh fetches
# them, here), and the package is imported from the source tree. docs/gpu-lane.md says how to run it there.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
RESULTS=${RESULTS:-${OUT:-$ROOT/bench-results/gpu}}
mkdir -p "$RESULTS"
RESULTS=$(cd "$RESULTS" && pwd)
if [ -z "${PYTHON:-}" ]; then
  if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
TESTS_TIMEOUT=${TESTS_TIMEOUT:-200}   # seconds for the cuda tests (20-34 s on an H200)
BENCH_TIMEOUT=${BENCH_TIMEOUT:-210}   # seconds for the benchmark
PAGED_TIMEOUT=${PAGED_TIMEOUT:-90}    # seconds for the paged KV save/load round trip
COPY_TIMEOUT=${COPY_TIMEOUT:-60}      # seconds for the copy-path probe
started=$(date +%s)

if ! "$PYTHON" -c "import promptcache.sidecar.server" 2> /dev/null; then
  # Not installed (a borrowed machine): the wheels carried in .whl/, and the namespace package's three source roots
  # (pyproject.toml), the generated stubs included when they were carried, and devtools/ (the benchmarks).
  if compgen -G ".whl/*.whl" > /dev/null; then
    site=${TMPDIR:-/tmp}/promptcache-gpu-site
    "$PYTHON" -m pip install -q --root-user-action=ignore --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" \
      .whl/*.whl || { echo "test-gpu: installing .whl/ failed" >&2; exit 2; }
    export PYTHONPATH=$site${PYTHONPATH:+:$PYTHONPATH}
  fi
  export PYTHONPATH=$ROOT/sidecar:$ROOT/proto:$ROOT/operator:$ROOT/devtools${PYTHONPATH:+:$PYTHONPATH}
fi
if ! "$PYTHON" -c "import promptcache.sidecar.server, promptcache.v1.kvcache_pb2_grpc" > "$RESULTS/import.log" 2>&1; then
  echo "test-gpu: the package does not import (missing wheels, or proto stubs not generated/carried):" >&2
  cat "$RESULTS/import.log" >&2
  exit 2
fi
rm -f "$RESULTS/import.log"

CUDA=$("$PYTHON" -c "import torch; print(int(torch.cuda.is_available()))")
if [ "$CUDA" = 1 ]; then
  DEVICE=cuda
  # SmolLM2-135M's shape with random weights: its GGUF (98 MB) cannot travel to a borrowed machine.
  BENCH=(--model "${GPU_BENCH_MODEL:-smollm2-random}" --dtype bfloat16 --prefixes 512,1024,2048,4096 --repeats 5
         --full-repeats 3 --threads 0 --sidecar-device "${GPU_TTFT_SIDECAR:-cpu}")
  [ "${GPU_TTFT_SIDECAR:-cpu}" = cpu ] && BENCH+=(--bulk)  # a CUDA tier cannot lend: gRPC, as before
  # Llama-3-8B's KV shape (32 layers, 8 KV heads of 128), 2048 tokens: 268 MB per save and load
  PAGED=(--device cuda --layouts LBNHC,LBHNC --dtypes bfloat16,float16 --tokens 2048 --repeats 3
         --sidecar-device "${GPU_PAGED_SIDECAR_DEVICE:-cpu}")
else
  DEVICE=cpu
  echo "test-gpu: no CUDA device: the cuda tests skip and the benchmark runs a toy model on the CPU"
  BENCH=(--model tiny --prefixes 64 --chunk-tokens 64 --suffix 16 --modes none,k8v8 --repeats 1 --full-repeats 1
         --bulk)
  PAGED=(--device cpu --layouts LBNHC,LBHNC --dtypes float32,bfloat16 --layers 4 --kv-heads 2 --head-dim 64
         --tokens 256 --chunk-tokens 64 --repeats 1)
fi

echo "== cuda tests ($PYTHON, device $DEVICE)"
timeout -k 10 "$TESTS_TIMEOUT" "$PYTHON" -m pytest tests/test_cuda.py -m cuda -q -rs -p no:cacheprovider \
  -p no:randomly --timeout 120 --junitxml "$RESULTS/cuda-tests.xml" 2>&1 | tee "$RESULTS/cuda-tests.log"
tests_rc=${PIPESTATUS[0]}

echo "== TTFT benchmark on $DEVICE"
timeout -k 10 "$BENCH_TIMEOUT" "$PYTHON" -m promptcache.cli bench ttft --device "$DEVICE" "${BENCH[@]}" \
  --json "$RESULTS/ttft.json" 2>&1 | tee "$RESULTS/ttft.log"
bench_rc=${PIPESTATUS[0]}

echo "== paged KV save/load round trip on $DEVICE (vLLM's CUDA layouts, torch alone)"
timeout -k 10 "$PAGED_TIMEOUT" "$PYTHON" -m promptcache.cli bench paged "${PAGED[@]}" --json "$RESULTS/paged.json" \
  2>&1 | tee "$RESULTS/paged.log"
paged_rc=${PIPESTATUS[0]}

copy_rc=0
if [ "$DEVICE" = cuda ]; then
  echo "== copy paths between the GPU and the host"
  timeout -k 10 "$COPY_TIMEOUT" "$PYTHON" hack/gpu-copy-paths.py --json "$RESULTS/copy-paths.json" > /dev/null
  copy_rc=$?
fi

"$PYTHON" - "$RESULTS" "$tests_rc" "$bench_rc" "$started" "$paged_rc" "$copy_rc" << 'EOF'
import json, os, sys, time
import xml.etree.ElementTree as ET

import torch

results, tests_rc, bench_rc, started = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
paged_rc, copy_rc = int(sys.argv[5]), int(sys.argv[6])
summary = {"cuda": torch.cuda.is_available(), "torch": torch.__version__, "torch_cuda": torch.version.cuda,
           "device_name": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
           "tests_exit": tests_rc, "bench_exit": bench_rc, "paged_exit": paged_rc, "copy_paths_exit": copy_rc,
           "seconds": round(time.time() - started, 1)}
try:
    suite = ET.parse(os.path.join(results, "cuda-tests.xml")).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    summary["tests"] = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    summary["skip_reasons"] = sorted({s.get("message", "") for s in suite.iter("skipped")})
except (OSError, ET.ParseError) as exc:
    summary["tests"] = f"no report: {exc}"
try:
    with open(os.path.join(results, "ttft.json")) as f:
        bench = json.load(f)
    summary["ttft"] = [{"prefix": r["prefix"], "full_s": r["full_s"], "floor_s": r["floor_s"],
                        **{m: {k: r[m][k] for k in ("ttft_s", "speedup_vs_full", "first_token_same")}
                           for m in r if isinstance(r[m], dict) and "ttft_s" in r[m]}} for r in bench["rows"]]
except (OSError, ValueError, KeyError) as exc:
    summary["ttft"] = f"no results: {exc}"
try:
    with open(os.path.join(results, "paged.json")) as f:
        paged = json.load(f)
    summary["paged"] = {"rows": [{k: v for k, v in r.items() if not k.endswith("_s")} for r in paged["rows"]],
                        **{k: paged[k] for k in ("pinned_memcpy", "link", "shape")}}
except (OSError, ValueError, KeyError) as exc:
    summary["paged"] = f"no results: {exc}"
try:
    with open(os.path.join(results, "copy-paths.json")) as f:
        summary["copy_paths"] = json.load(f)
except (OSError, ValueError) as exc:
    summary["copy_paths"] = f"no results: {exc}" if summary["cuda"] else "skipped: no CUDA device"
with open(os.path.join(results, "summary.json"), "w") as f:
    json.dump(summary, f, indent=2)
print(json.dumps(summary, indent=2))
EOF
echo "test-gpu: results in $RESULTS"
[ "$tests_rc" = 0 ] && [ "$bench_rc" = 0 ] && [ "$paged_rc" = 0 ] && [ "$copy_rc" = 0 ]
