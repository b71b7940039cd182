"""A real consumer of our KV events: NVIDIA Dynamo's standalone KV indexer (`python -m dynamo.indexer`, from PyPI
ai-dynamo-runtime, installed by `make venv`), the radix tree of Dynamo's KV router as a service. It subscribes
over ZMQ to each worker's event socket, decodes vLLM's msgpack events itself, hashes each block's token ids at
the block size it is told, and answers POST /query {token_ids, model_name} with how many leading tokens each
worker holds. Here the workers are two sidecars (two "nodes"); the test asks it where a prompt's prefix is."""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

from support import CHUNK, SMALL, make_kv
from promptcache.client import PromptCacheClient
from promptcache_devtools.procs import free_port

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("dynamo") is None or importlib.util.find_spec("dynamo.indexer") is None,
    reason="ai-dynamo-runtime is not installed (make venv installs it: pip install --no-deps ai-dynamo-runtime)")

NODES = {1: "node-a", 2: "node-b"}  # Dynamo worker (instance) id -> sidecar


class Indexer:
    def __init__(self, workers: dict[int, str], block_size: int, model: str, log_path):
        self.port = free_port()
        self.model = model
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "dynamo.indexer", "--block-size", str(block_size), "--port", str(self.port),
             "--threads", "1", "--model-name", model,
             "--workers", ",".join(f"{wid}={address}" for wid, address in workers.items())],
            stdout=self._log, stderr=subprocess.STDOUT)
        self.log_path = log_path

    def http(self, path: str, body: dict | None = None):
        request = urllib.request.Request(f"http://127.0.0.1:{self.port}{path}",
                                         data=None if body is None else json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=5) as response:
            return json.loads(response.read())

    def wait_listening(self, workers: int, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.log()
            try:
                listed = self.http("/workers")
                if sum(lst["status"] == "active" for w in listed for lst in w["listeners"].values()) == workers:
                    time.sleep(0.5)  # a ZMQ PUB drops what it sends before the subscription has reached it
                    return
            except (urllib.error.URLError, ConnectionError):
                pass
            time.sleep(0.1)
        raise AssertionError("the Dynamo indexer did not start listening\n" + self.log())

    def matched(self, tokens: list[int]) -> dict[int, int]:
        """Dynamo's answer: worker id -> leading tokens of `tokens` it holds (workers holding none left out)."""
        answer = self.http("/query", {"token_ids": tokens, "model_name": self.model})
        return {int(wid): i["longest_matched"] for wid, i in answer["instances"].items() if i["longest_matched"]}

    def wait_for(self, tokens: list[int], expected: dict[int, int], timeout: float = 10.0) -> dict[int, int]:
        deadline = time.monotonic() + timeout
        while (got := self.matched(tokens)) != expected and time.monotonic() < deadline:
            time.sleep(0.05)
        return got

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")[-3000:]

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._log.close()


def pick(matched: dict[int, int]) -> str | None:
    """The node a prefix-aware router sends the request to: the one holding the longest prefix (none: no opinion)."""
    return NODES[max(matched, key=matched.get)] if matched else None


def test_dynamos_indexer_fed_by_two_sidecars_events_picks_the_node_holding_the_prefix(sidecar_factory, tmp_path):
    nodes = {name: sidecar_factory(kv_events_address="tcp://127.0.0.1:*", kv_events_id=name)
             for name in NODES.values()}
    # Dynamo hashes each block's token ids itself: the block size it is told must be our --chunk-tokens.
    indexer = Indexer({wid: nodes[name].events.address for wid, name in NODES.items()}, CHUNK, SMALL.model_id,
                      tmp_path / "indexer.log")
    try:
        indexer.wait_listening(2)
        system_a, system_b = list(range(1, 1 + 3 * CHUNK)), list(range(500, 500 + 3 * CHUNK))
        with PromptCacheClient(nodes["node-a"].address, timeout=10) as a, \
                PromptCacheClient(nodes["node-b"].address, timeout=10) as b:
            assert a.put(SMALL, system_a, make_kv(SMALL, len(system_a))).stored_chunks == 3
            assert b.put(SMALL, system_b, make_kv(SMALL, len(system_b))).stored_chunks == 3

            prompt_b = system_b + [7] * (CHUNK + 3)  # B's prefix, then a question neither node holds
            assert indexer.wait_for(prompt_b, {2: 3 * CHUNK}) == {2: 3 * CHUNK}, indexer.log()
            assert pick(indexer.matched(prompt_b)) == "node-b"
            assert pick(indexer.matched(system_a + [9] * 5)) == "node-a"
            # Block by block: a prompt sharing only B's first chunk matches one block there.
            assert indexer.matched(system_b[:CHUNK] + [1] * (2 * CHUNK)) == {2: CHUNK}
            assert indexer.matched([3] * (2 * CHUNK)) == {}

            # B deletes the prefix (BlockRemoved): Dynamo no longer sends the prompt to B.
            assert b.delete(SMALL, system_b) == 3
            assert indexer.wait_for(prompt_b, {}) == {}, indexer.log()
            assert pick(indexer.matched(prompt_b)) is None
            # ... and once A holds it, to A.
            assert a.put(SMALL, system_b, make_kv(SMALL, len(system_b))).stored_chunks == 3
            assert indexer.wait_for(prompt_b, {1: 3 * CHUNK}) == {1: 3 * CHUNK}, indexer.log()
            assert pick(indexer.matched(prompt_b)) == "node-a"
        assert "Failed to decode" not in indexer.log(), indexer.log()
    finally:
        indexer.stop()
