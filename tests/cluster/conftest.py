"""Fixtures of tests/cluster: one single-node cluster per session (hack/cluster/node.py), the chart installed once.
Runs only under `make test-cluster` (PROMPTCACHE_CLUSTER=1), as tests/vllm runs only under `make test-vllm`; there a
cluster that cannot start fails the session. PROMPTCACHE_CLUSTER_KUBECONFIG=PATH uses a node already up
(`hack/cluster/node.py up`) and leaves it running."""
from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from kcluster import CHART, RELEASE, RELEASE_NS, Cluster, nodemod


def pytest_collection_modifyitems(config, items):
    if os.environ.get("PROMPTCACHE_CLUSTER") == "1" or os.environ.get("PROMPTCACHE_CLUSTER_KUBECONFIG"):
        return
    skip = pytest.mark.skip(reason="needs the single-node cluster: run `make test-cluster`")
    for item in items:
        if "tests/cluster/" in str(item.fspath):
            item.add_marker(skip)


@pytest.fixture(scope="session")
def cluster():
    given = os.environ.get("PROMPTCACHE_CLUSTER_KUBECONFIG")
    if given:
        yield Cluster(Path(given), None)
        return
    node = nodemod.Node()
    try:
        node.up()
    except Exception:
        nodemod.down_from_state()
        raise
    c = Cluster(node.kubeconfig, node)
    try:
        yield c
    finally:
        nodemod.down_from_state()
        left = nodemod.leftovers()
        assert not left, f"the cluster's teardown left: {left}"


@pytest.fixture(scope="session")
def release(cluster):
    """The chart, installed once (helm install, as README says), its operator Ready."""
    start = time.monotonic()
    # `upgrade --install` is `install` on the fresh node; on a reused one (PROMPTCACHE_CLUSTER_KUBECONFIG) it upgrades.
    cluster.helm("upgrade", "--install", RELEASE, str(CHART), "--namespace", RELEASE_NS, "--create-namespace", "--wait",
                 "--timeout", "180s")
    return {"seconds": time.monotonic() - start}


def pytest_runtest_makereport(item, call):
    if call.when == "call" and call.excinfo is not None and "cluster" in item.fixturenames:
        c = item.funcargs.get("cluster")
        if c is not None:
            item.add_report_section("call", "cluster", c.diagnostics())
