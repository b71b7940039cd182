"""Python client of the PromptCache sidecar, for inference pods."""
from promptcache.client import errors
from promptcache.client.client import ChunkInfo, LookupResult, PromptCacheClient, PutResult

__all__ = ["PromptCacheClient", "LookupResult", "PutResult", "ChunkInfo", "errors"]
