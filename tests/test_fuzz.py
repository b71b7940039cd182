"""Short fuzz runs inside the suite (the long one is `make fuzz`): no crash, no hang, every rejection a proper
status (never UNKNOWN or INTERNAL), and the sidecar still serves correct bytes afterwards."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from promptcache_devtools import fuzz

FUZZ_SECONDS = float(os.environ.get("PROMPTCACHE_TEST_FUZZ_SECONDS", "45"))


def _assert_clean(report):
    assert report["crashes"] == 0 and report["hangs"] == 0, report["examples"]
    assert report["bad_statuses"] == 0, report["examples"]
    assert report["round_trip_failures"] == 0, report["examples"]
    assert not set(report["codes"]) & {"UNKNOWN", "INTERNAL", "DEADLINE_EXCEEDED"}


@pytest.mark.slow  # a fuzz run with auth through the CLI
@pytest.mark.timeout(240)
def test_fuzz_cli_with_auth(tmp_path):
    out = tmp_path / "fuzz.json"
    proc = subprocess.run([sys.executable, "-m", "promptcache_devtools.fuzz", "--requests", "200000", "--max-seconds",
                           str(FUZZ_SECONDS), "--workers", "3", "--seed", "11", "--json", str(out)],
                          capture_output=True, text=True, timeout=200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    _assert_clean(report)
    assert report["requests"] >= 1000
    # The run exercised authentication, authorization, parsing and the data path.
    for code in ("OK", "INVALID_ARGUMENT", "UNAUTHENTICATED", "PERMISSION_DENIED"):
        assert report["codes"].get(code, 0) > 0, report["codes"]
    assert report["bulk_puts"] > 0
    print(f"fuzzed {report['requests']} requests: {report['codes']}")


@pytest.mark.slow  # thousands of requests; the two tests below are the fast lane's bad-input checks
@pytest.mark.timeout(120)
def test_fuzz_without_auth():
    report = fuzz.fuzz(100_000, seed=5, workers=2, auth=False, max_seconds=FUZZ_SECONDS / 3, progress=False)
    _assert_clean(report)
    assert report["codes"].get("OK", 0) > 0 and report["codes"].get("INVALID_ARGUMENT", 0) > 0
    assert report["bulk_puts"] > 0


METHODS = sorted(fuzz.METHODS)


@pytest.fixture(scope="module")
def raw_channel():
    import dataclasses

    from support import CHUNK
    from promptcache.sidecar.config import Settings
    from promptcache.sidecar.app import Sidecar

    sidecar = Sidecar(dataclasses.replace(Settings(grpc_address="127.0.0.1:0", metrics_port=0, chunk_tokens=CHUNK,
                                                   memory_bytes=8 << 20))).start()
    with grpc.insecure_channel(sidecar.address) as ch:
        yield ch
    sidecar.stop(0)


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(method=st.sampled_from(METHODS), frames=st.lists(st.binary(max_size=300), min_size=1, max_size=4))
def test_arbitrary_bytes_get_a_proper_status(raw_channel, method, frames):
    code, details = fuzz._call(raw_channel, method, frames if fuzz.METHODS[method][0] == "su" else frames[0],
                               None, 10)
    assert code not in ("UNKNOWN", "INTERNAL", "DEADLINE_EXCEEDED"), (code, details)


def test_unparseable_bytes_are_invalid_argument_naming_the_problem(raw_channel):
    for method in METHODS:
        payload = b"\xff\xff\xff"
        code, details = fuzz._call(raw_channel, method, [payload] if fuzz.METHODS[method][0] == "su" else payload,
                                   None, 10)
        assert code == "INVALID_ARGUMENT" and "not a valid protobuf message" in details, (method, code, details)
