"""Shared fixtures: a real sidecar (real gRPC server on loopback, real store) and a real client."""
from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import tempfile

import pytest

from promptcache.client import PromptCacheClient
from promptcache.sidecar.config import Settings
from promptcache.sidecar.app import Sidecar
from support import CHUNK


@pytest.fixture
def sidecar_factory():
    started: list[Sidecar] = []

    def start(clock=None, **overrides) -> Sidecar:
        """clock: a support.FakeClock to run the sidecar's tiers on (TTL tests), instead of the real clocks."""
        # chunk_overhead_bytes 0: these tests size budgets in their 2 KiB chunks' bytes alone (the default's 8 KiB
        # of bookkeeping a chunk is tested in test_chunk_overhead.py)
        settings = dataclasses.replace(Settings(grpc_address="127.0.0.1:0", metrics_port=0,
                                                chunk_tokens=CHUNK, memory_bytes=8 << 20, chunk_overhead_bytes=0),
                                       **overrides)
        with clock.installed() if clock is not None else contextlib.nullcontext():
            sidecar = Sidecar(settings)
        sidecar.start()
        started.append(sidecar)
        return sidecar

    yield start
    for s in started:
        s.stop(0)


@pytest.fixture
def sidecar(sidecar_factory) -> Sidecar:
    return sidecar_factory()


@pytest.fixture
def client(sidecar):
    with PromptCacheClient(sidecar.address, timeout=10) as c:
        yield c


# Fixtures that run a built or installed tool (tests/operator/opharness.py): a test using one must be marked tools,
# so that `make test-fast` (-m "not tools and not slow") never waits for a tool build.
TOOL_FIXTURES = {"control_plane", "kube", "kubectl", "helm", "helm_offline", "helm_release", "crd",
                 "operator_kubeconfig", "start_operator"}


def pytest_collection_modifyitems(config, items):
    unmarked = []
    for item in items:
        if item.get_closest_marker("apiserver") and not item.get_closest_marker("tools"):
            item.add_marker(pytest.mark.tools)  # the API server is one of the tools
        if TOOL_FIXTURES & set(getattr(item, "fixturenames", ())) and not item.get_closest_marker("tools"):
            unmarked.append(item.nodeid)
    if unmarked:
        raise pytest.UsageError("tests using a tool fixture (" + ", ".join(sorted(TOOL_FIXTURES)) + ") must be "
                                "marked @pytest.mark.tools:\n  " + "\n  ".join(unmarked))


# Disk tiers in tmp_path refuse to spill below --disk-min-free-bytes (256 MiB) plus their reserve: a volume that
# runs low makes warm-up, export and spill tests fail far from the cause (CI lost four that way). Say how much
# there is at the start, and refuse to start with too little rather than fail late. (tmp_path_retention_policy in
# pyproject.toml keeps only failed tests' folders, so a run no longer piles up every tier it made.)
MIN_FREE_FOR_TESTS = 1 << 30  # one disk tier: 256 MiB kept free, a reserve of up to 130 MiB, its data


def _free(path: str) -> int:
    while not os.path.exists(path):  # an xdist worker's basetemp is made later
        path = os.path.dirname(path)
    return shutil.disk_usage(path).free


def _tmp_root(config) -> str:
    return str(config.option.basetemp or tempfile.gettempdir())


def pytest_report_header(config):
    tmp = _tmp_root(config)
    return [f"free space: {_free(tmp) >> 20} MiB in {tmp} (tmp_path), {_free(str(config.rootpath)) >> 20} MiB "
            f"in {config.rootpath}"]


def pytest_sessionstart(session):
    tmp = _tmp_root(session.config)
    free = _free(tmp)
    if free < MIN_FREE_FOR_TESTS:
        raise pytest.UsageError(f"{tmp} has {free >> 20} MiB free; the tests' disk tiers need at least "
                                f"{MIN_FREE_FOR_TESTS >> 20} MiB (set TMPDIR or --basetemp to a roomier volume)")
