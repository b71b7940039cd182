"""One offline vLLM engine in its own process, driven over stdin/stdout with JSON lines (tests and `bench vllm`).

Run with the vLLM virtualenv's python and the checkout's source roots on PYTHONPATH (hack/vllm-env.sh):

    python -m promptcache_devtools.vllm_engine --model DIR --dtype float32 [--connector '{"address": ...}']

Requests, one JSON object per line; each answer is one line starting with ``@@`` (vLLM's own logging also goes to
stdout/stderr):
    {"op": "generate", "prompts": [[ids...], ...], "max_tokens": 8, "cache_salts": [null, ...],
     "loras": [null | adapter name of --lora-modules, ...]}
        -> {"outputs": [[ids...], ...], "seconds": s, "metrics": {name: value}}
    {"op": "flush"}    wait for the connector's background saves -> {"ok": true, "metrics": {...}}
    {"op": "metrics"}  -> {"metrics": {...}} (promptcache_client_* samples of this process)
    {"op": "reset", "connector": true}  vLLM's reset_prefix_cache (and the connector's, as a pause that clears the
        caches does) -> {"ok": bool, "metrics": {...}}
    {"op": "exit"}
The engine core runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0) so the connector's metrics are readable here.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

CONNECTOR_MODULE = "promptcache.client.vllm_connector"


def metrics() -> dict:
    from prometheus_client import REGISTRY

    out = {}
    for family in REGISTRY.collect():
        for s in family.samples:
            if s.name.startswith("promptcache_client_") and not s.name.endswith("_created"):
                labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "le")
                if "le" in s.labels:
                    continue
                out[s.name + (f"{{{labels}}}" if labels else "")] = s.value
    return out


def _connector(llm):
    try:
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        return get_kv_transfer_group()
    except Exception:  # noqa: BLE001 - no connector configured
        return None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--connector", default="", help="kv_connector_extra_config as JSON; empty: no connector")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--max-num-seqs", type=int, default=8)
    p.add_argument("--max-num-batched-tokens", type=int, default=0, help="0: vLLM's default")
    p.add_argument("--prefix-caching", action="store_true", help="vLLM's own automatic prefix caching")
    p.add_argument("--kv-cache-gib", default="1")
    p.add_argument("--lora-modules", default="", help='LoRA adapters as JSON {"name": "path"}: enables LoRA')
    p.add_argument("--max-lora-rank", type=int, default=16)
    p.add_argument("--tensor-parallel-size", type=int, default=1)
    args = p.parse_args(argv)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", args.kv_cache_gib)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    from vllm import LLM

    kwargs = dict(model=args.model, dtype=args.dtype, max_model_len=args.max_model_len, enforce_eager=True,
                  enable_prefix_caching=args.prefix_caching, max_num_seqs=args.max_num_seqs, seed=0)
    if args.tensor_parallel_size > 1:
        # vLLM's CPU backend binds OpenMP threads per NUMA node by default and fails on one node ("Not enough
        # allowed NUMA nodes"); the workers are processes of their own.
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        kwargs.update(tensor_parallel_size=args.tensor_parallel_size, distributed_executor_backend="mp")
    if args.max_num_batched_tokens:
        kwargs["max_num_batched_tokens"] = args.max_num_batched_tokens
    if args.connector:
        kwargs["kv_transfer_config"] = {
            "kv_connector": "PromptCacheConnector", "kv_connector_module_path": CONNECTOR_MODULE,
            "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": json.loads(args.connector)}
    loras = json.loads(args.lora_modules) if args.lora_modules else {}
    if loras:
        kwargs.update(enable_lora=True, max_loras=len(loras), max_lora_rank=args.max_lora_rank)
    llm = LLM(**kwargs)
    llm._promptcache_loras = loras
    connector = _connector(llm) if args.connector else None
    out = sys.stdout

    def reply(obj) -> None:
        out.write("@@" + json.dumps(obj) + "\n")
        out.flush()

    def handle(req):
        _handle(llm, connector, reply, req)

    reply({"ready": True, "layout": getattr(connector, "_layout", None),
           "disabled": getattr(connector, "disabled", None)})
    for line in sys.stdin:
        req = json.loads(line)
        if req.get("op") == "exit":
            break
        try:
            handle(req)
        except Exception as exc:  # noqa: BLE001 - report it to the driver, keep serving
            reply({"error": f"{type(exc).__name__}: {exc}"})
    return 0


def _handle(llm, connector, reply, req) -> None:
    from vllm import SamplingParams

    op = req.get("op")
    if op == "metrics":
        reply({"metrics": metrics()})
    elif op == "flush":
        ok = connector.flush() if connector is not None else True
        reply({"ok": ok, "metrics": metrics()})
    elif op == "reset":
        ok = llm.reset_prefix_cache(reset_connector=bool(req.get("connector")))
        reply({"ok": ok, "metrics": metrics()})
    elif op == "generate":
        salts = req.get("cache_salts") or [None] * len(req["prompts"])
        prompts = []
        for ids, salt in zip(req["prompts"], salts):
            prompt = {"prompt_token_ids": ids}
            if salt:
                prompt["cache_salt"] = salt
            prompts.append(prompt)
        params = SamplingParams(max_tokens=req.get("max_tokens", 8), temperature=0.0,
                                ignore_eos=req.get("ignore_eos", True))
        lora_requests = None
        if any(req.get("loras") or ()):
            from vllm.lora.request import LoRARequest

            known = getattr(llm, "_promptcache_loras", {})
            names = sorted(known)
            lora_requests = [None if not n else LoRARequest(n, names.index(n) + 1, known[n]) for n in req["loras"]]
        t0 = time.perf_counter()
        results = llm.generate(prompts, params, use_tqdm=False, lora_request=lora_requests)
        seconds = time.perf_counter() - t0
        reply({"outputs": [list(r.outputs[0].token_ids) for r in results], "seconds": seconds,
               "metrics": metrics()})
    else:
        reply({"error": f"unknown op {op!r}"})


class EngineProcess:
    """The driving side (any python, no vLLM import): start `python -m promptcache_devtools.vllm_engine` and talk to it."""

    def __init__(self, python: str, model: str, *, dtype: str = "float32", connector: dict | None = None,
                 log_path: str | None = None, env: dict | None = None, **options):
        import subprocess
        from pathlib import Path

        root = Path(__file__).resolve().parents[2]  # the checkout: devtools/promptcache_devtools/ up
        argv = [python, "-m", "promptcache_devtools.vllm_engine", "--model", model, "--dtype", dtype]
        if connector is not None:
            argv += ["--connector", json.dumps(connector)]
        for k, v in options.items():
            flag = "--" + k.replace("_", "-")
            argv += [flag] if v is True else ([] if v is False else [flag, str(v)])
        full_env = dict(os.environ)
        full_env["PYTHONPATH"] = os.pathsep.join(str(root / d) for d in ("sidecar", "proto", "operator", "devtools"))
        full_env.update(env or {})
        self.log = open(log_path or os.devnull, "w")
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, env=full_env, cwd=str(root))
        self.ready: dict | None = None
        import queue
        import threading

        self._answers: queue.Queue = queue.Queue()
        self._pump_thread = threading.Thread(target=self._pump, name=f"vllm-engine-{self.proc.pid}", daemon=True)
        self._pump_thread.start()

    def _pump(self) -> None:
        """Reader thread: answers to the queue, everything else (vLLM's logging) to the log file."""
        for line in self.proc.stdout:
            if line.startswith("@@"):
                self._answers.put(json.loads(line[2:]))
            else:
                self.log.write(line)
                self.log.flush()
        self._answers.put(None)

    def _read(self, timeout: float) -> dict:
        import queue

        try:
            answer = self._answers.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(f"vLLM engine process {self.proc.pid} gave no answer in {timeout:.0f}s") from None
        if answer is None:
            raise RuntimeError(f"vLLM engine process {self.proc.pid} exited with {self.proc.wait()}")
        return answer

    def wait_ready(self, timeout: float = 600) -> dict:
        if self.ready is None:
            self.ready = self._read(timeout)
        return self.ready

    def call(self, timeout: float = 600, **request) -> dict:
        self.wait_ready(timeout)
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        answer = self._read(timeout)
        if "error" in answer:
            raise RuntimeError(answer["error"])
        return answer

    def generate(self, prompts, max_tokens: int = 8, cache_salts=None, timeout: float = 600, loras=None) -> dict:
        return self.call(timeout, op="generate", prompts=[list(map(int, p)) for p in prompts],
                         max_tokens=max_tokens, cache_salts=cache_salts, loras=loras)

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(json.dumps({"op": "exit"}) + "\n")
                self.proc.stdin.flush()
                self.proc.wait(30)
            except Exception:  # noqa: BLE001 - then kill it
                self.proc.kill()
                self.proc.wait()
        self._pump_thread.join(10)
        self.log.close()


if __name__ == "__main__":
    sys.exit(main())
