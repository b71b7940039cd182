"""Shared fixtures: a real sidecar (real gRPC server on loopback, real store) and a real client."""
from __future__ import annotations

import dataclasses

import pytest

from promptcache.client import PromptCacheClient
from promptcache.sidecar.config import Settings
from promptcache.sidecar.app import Sidecar
from support import CHUNK


@pytest.fixture
def sidecar_factory():
    started: list[Sidecar] = []

    def start(**overrides) -> Sidecar:
        settings = dataclasses.replace(Settings(grpc_address="127.0.0.1:0", metrics_port=0,
                                                chunk_tokens=CHUNK, memory_bytes=8 << 20), **overrides)
        sidecar = Sidecar(settings).start()
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
