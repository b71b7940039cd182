"""The client side's Prometheus metrics, in the inference pod's default registry (its /metrics): one place for
the transformers integration and the vLLM connector, and for the dashboard's test to read their names."""
from __future__ import annotations

from prometheus_client import Counter, Histogram

FALLBACKS = Counter("promptcache_client_fallbacks_total",
                    "Requests that fell back to a full prefill because the cache could not be used, by reason",
                    ["reason"])
REUSED_TOKENS = Counter("promptcache_client_reused_tokens_total", "Prompt tokens loaded from the cache, not computed")
COMPUTED_TOKENS = Counter("promptcache_client_computed_tokens_total", "Prompt tokens computed by the model")
STORES = Counter("promptcache_client_stores_total", "Background stores by outcome (ok, error, dropped)", ["outcome"])
FETCH_SECONDS = Histogram("promptcache_client_fetch_seconds", "Time to fetch and decode a cached prefix",
                          buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10))

# vLLM connector only.
HITS = Counter("promptcache_client_hits_total", "vLLM requests that loaded a cached prefix from the sidecar")
LOAD_SECONDS = Histogram("promptcache_client_load_seconds",
                         "vLLM connector: time to write a fetched prefix into the engine's KV blocks",
                         buckets=(0.0005, 0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5))
SAVE_SECONDS = Histogram("promptcache_client_save_seconds",
                         "vLLM connector: time to convert and Put one request's new chunks (background)",
                         buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30))
SAVE_COPY_SECONDS = Histogram("promptcache_client_save_copy_seconds",
                              "vLLM connector: time on the engine's step to copy new chunks out of their blocks",
                              buckets=(0.0005, 0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1))
UNIDENTIFIED = Counter("promptcache_client_unidentified_requests_total",
                       "vLLM requests neither loaded nor stored: they carry an input the connector cannot identify "
                       "(so cannot key), by reason", ["reason"])
LOOKUPS = Counter("promptcache_client_lookups_total", "vLLM connector: Lookups the scheduler sent to the sidecar")
LOADED_TOKENS = Counter("promptcache_client_loaded_tokens_total",
                        "vLLM connector: prompt tokens the workers wrote into KV blocks from fetched chunks")
LOAD_ERRORS = Counter("promptcache_client_load_error_blocks_total",
                      "vLLM connector: KV blocks a Lookup promised but the load could not write (vLLM recomputes them)")
RECONNECTS = Counter("promptcache_client_reconnects_total",
                     "vLLM connector: times the sidecar answered again after a failure (no engine restart)")
