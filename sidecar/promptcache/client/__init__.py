"""Python client of the PromptCache sidecar, for inference pods.

The names below load on first use (PEP 562), so that `promptcache.client.errors` (admin commands, the CLI) does
not pull in the client and what it needs."""
from __future__ import annotations

import importlib

__all__ = ["PromptCacheClient", "LookupResult", "PutResult", "ChunkInfo", "errors"]


def __getattr__(name: str):
    if name == "errors":
        return importlib.import_module("promptcache.client.errors")
    if name in __all__:
        return getattr(importlib.import_module("promptcache.client.client"), name)
    raise AttributeError(f"module 'promptcache.client' has no attribute {name!r}")
