"""Chunk keys and fingerprints: the spec's vectors, an independent re-implementation, and properties."""
import hashlib
import json
import shutil
import struct
import subprocess

import pytest
from hypothesis import given, settings, strategies as st

from support import REPO
from promptcache.contract.keys import ModelSpec, chunk_keys, fingerprint

VECTORS = json.loads((REPO / "docs/key-vectors.json").read_text())
BASE = ModelSpec("m", "r", "float16", 4, 2, 8)


def spec_of(v) -> ModelSpec:
    m = v["model"]
    return ModelSpec(m["model_id"], m["revision"], m["kv_dtype"], m["num_layers"], m["num_kv_heads"],
                     m["head_dim"], m["quantization"], bytes.fromhex(m["tenant_salt_hex"]))


def reference_keys(v):
    """Written from docs/keys.md alone, sharing no code with promptcache.contract.keys."""
    m = v["model"]
    f = lambda tag, p: bytes([tag]) + len(p).to_bytes(4, "little") + p  # noqa: E731
    u = lambda x: x.to_bytes(4, "little")  # noqa: E731
    fp = hashlib.sha256(b"promptcache/fingerprint/v1\0" + f(1, m["model_id"].encode()) + f(2, m["revision"].encode())
                        + f(3, m["kv_dtype"].encode()) + f(4, u(m["num_layers"])) + f(5, u(m["num_kv_heads"]))
                        + f(6, u(m["head_dim"])) + f(7, {"k8v4": b"k8v4.3", "k6v4z": b"k6v4z.2"}.get(m["quantization"], m["quantization"].encode()))
                        + f(8, bytes.fromhex(m["tenant_salt_hex"]))).digest()
    keys, parent, c = [], bytes(32), v["chunk_tokens"]
    for i in range(len(v["tokens"]) // c):
        toks = struct.pack(f"<{c}I", *v["tokens"][i * c:(i + 1) * c])
        parent = hashlib.sha256(b"promptcache/chunk/v1\0" + fp + parent + toks).digest()
        keys.append(parent.hex())
    return fp.hex(), keys


@pytest.mark.parametrize("v", VECTORS, ids=[v["name"] for v in VECTORS])
def test_vectors_match_implementation_and_reference(v):
    fp = fingerprint(spec_of(v))
    assert fp.hex() == v["fingerprint"]
    assert [k.hex() for k in chunk_keys(fp, v["tokens"], v["chunk_tokens"])] == v["chunk_keys"]
    assert reference_keys(v) == (v["fingerprint"], v["chunk_keys"])


def test_vectors_match_go_implementation():
    go = shutil.which("go")
    assert go, "Go is part of this project's toolchain (hack/keyspec-go)"
    out = subprocess.run([go, "test", "./..."], cwd=REPO / "hack/keyspec-go", capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr


def test_600_shared_tokens_reuse_two_chunks_of_256():
    fp = fingerprint(BASE)
    a = list(range(1000))
    b = a[:600] + [7] * 400
    ka, kb = chunk_keys(fp, a, 256), chunk_keys(fp, b, 256)
    shared = next(i for i, (x, y) in enumerate(zip(ka, kb)) if x != y)
    assert shared == 2  # 512 tokens


@settings(max_examples=60, deadline=None)
@given(tokens=st.lists(st.integers(0, 2**32 - 1), min_size=0, max_size=64), chunk=st.sampled_from([1, 2, 4, 8]),
       cut=st.integers(0, 64))
def test_prefix_keys_are_a_prefix(tokens, chunk, cut):
    fp = fingerprint(BASE)
    assert chunk_keys(fp, tokens[:cut], chunk) == chunk_keys(fp, tokens, chunk)[:len(tokens[:cut]) // chunk]


@settings(max_examples=60, deadline=None)
@given(tokens=st.lists(st.integers(0, 50000), min_size=8, max_size=40), pos=st.integers(0, 39))
def test_changing_a_token_changes_its_chunk_and_later_only(tokens, pos):
    pos %= len(tokens)
    fp = fingerprint(BASE)
    changed = list(tokens)
    changed[pos] = (changed[pos] + 1) % 50001
    a, b = chunk_keys(fp, tokens, 4), chunk_keys(fp, changed, 4)
    for i, (x, y) in enumerate(zip(a, b)):
        assert (x == y) == (i < pos // 4)


@pytest.mark.parametrize("change", [dict(model_id="other"), dict(revision="r2"), dict(kv_dtype="bfloat16"),
                                    dict(num_layers=5), dict(num_kv_heads=1), dict(head_dim=16),
                                    dict(quantization="k8v4"), dict(tenant_salt=b"t")])
def test_every_fingerprint_field_separates_keys(change):
    import dataclasses

    other = dataclasses.replace(BASE, **change)
    tokens = list(range(32))
    assert fingerprint(other) != fingerprint(BASE)
    assert not set(chunk_keys(fingerprint(other), tokens, 8)) & set(chunk_keys(fingerprint(BASE), tokens, 8))


@pytest.mark.parametrize("change,field", [(dict(model_id=""), "model_id"), (dict(kv_dtype="int8"), "kv_dtype"),
                                          (dict(num_layers=0), "num_layers"), (dict(head_dim=-1), "head_dim"),
                                          (dict(quantization="k2"), "quantization"),
                                          (dict(tenant_salt=b"x" * 65), "tenant_salt")])
def test_malformed_spec_names_the_field(change, field):
    import dataclasses

    with pytest.raises(ValueError, match=field):
        fingerprint(dataclasses.replace(BASE, **change))
