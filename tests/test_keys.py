"""Chunk keys and fingerprints: the spec's vectors, an independent re-implementation, and properties."""
import hashlib
import json
import shutil
import struct
import subprocess

import pytest
from hypothesis import given, settings, strategies as st

from support import REPO
from promptcache.contract.keys import (Adapter, ModelSpec, MultiModalItem, Shard, chunk_keys, fingerprint,
                                       request_salt, scales_digest, shard_spec)

VECTORS = json.loads((REPO / "docs/key-vectors.json").read_text())
BASE = ModelSpec("m", "r", "float16", 4, 2, 8)


def spec_of(v) -> ModelSpec:
    """The vector's hashed spec: its salt derived with request_salt when it has a request (v2)."""
    m = v["model"]
    salt = bytes.fromhex(m["tenant_salt_hex"])
    r = v.get("request")
    if r is not None:
        adapter = Adapter(r["adapter"]["name"], bytes.fromhex(r["adapter"]["digest_hex"])) if "adapter" in r else None
        items = [MultiModalItem(i["modality"], i["content_hash"], i["offset"], i["length"]) for i in r.get("mm_items", [])]
        scales = r.get("kv_scales")
        if scales is not None:
            assert scales_digest(scales["k"], scales["v"]).hex() == scales["digest_hex"]
        salt = request_salt(salt, adapter=adapter, mm_items=items,
                            embeds_digest=bytes.fromhex(r.get("embeds_digest_hex", "")),
                            shard=Shard(*r["shard"]) if "shard" in r else None,
                            kv_scales=scales_digest(scales["k"], scales["v"]) if scales else b"")
        assert salt.hex() == v["request_salt_hex"]
    return ModelSpec(m["model_id"], m["revision"], m["kv_dtype"], m["num_layers"], m["num_kv_heads"],
                     m["head_dim"], m["quantization"], salt, m.get("kv_kind", "kv"))


def reference_salt(v) -> bytes:
    """docs/keys.md's request salt (v2), written from the page alone."""
    salt = bytes.fromhex(v["model"]["tenant_salt_hex"])
    r = v.get("request")
    if r is None:
        return salt
    f = lambda tag, p: bytes([tag]) + len(p).to_bytes(4, "little") + p  # noqa: E731
    msg = b"promptcache/request/v2\0" + f(1, salt)
    if "adapter" in r:
        msg += f(2, r["adapter"]["name"].encode()) + f(3, bytes.fromhex(r["adapter"]["digest_hex"]))
    for i in r.get("mm_items", []):
        msg += f(4, i["modality"].encode()) + f(5, i["content_hash"].encode()) + f(6, struct.pack("<2I", i["offset"], i["length"]))
    if r.get("embeds_digest_hex"):
        msg += f(7, bytes.fromhex(r["embeds_digest_hex"]))
    if "shard" in r:
        msg += f(8, struct.pack("<6I", *r["shard"]))
    if "kv_scales" in r:
        s = r["kv_scales"]
        scales = b"".join(struct.pack("<ff", k, x) for k, x in zip(s["k"], s["v"]))
        msg += f(9, hashlib.sha256(b"promptcache/kv-scales/v1\0" + scales).digest())
    return hashlib.sha256(msg).digest()


def reference_keys(v):
    """Written from docs/keys.md alone, sharing no code with promptcache.contract.keys."""
    m = v["model"]
    f = lambda tag, p: bytes([tag]) + len(p).to_bytes(4, "little") + p  # noqa: E731
    u = lambda x: x.to_bytes(4, "little")  # noqa: E731
    fp = hashlib.sha256(b"promptcache/fingerprint/v1\0" + f(1, m["model_id"].encode()) + f(2, m["revision"].encode())
                        + f(3, m["kv_dtype"].encode()) + f(4, u(m["num_layers"])) + f(5, u(m["num_kv_heads"]))
                        + f(6, u(m["head_dim"])) + f(7, {"k8v4": b"k8v4.3", "k6v4z": b"k6v4z.2"}.get(m["quantization"], m["quantization"].encode()))
                        + f(8, reference_salt(v)) + (f(9, b"mla") if m.get("kv_kind") == "mla" else b"")).digest()
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


IMAGE = MultiModalItem("image", "abc123", 3, 4)
ADAPTER = Adapter("a", hashlib.sha256(b"a").digest())


def test_request_salt_without_parts_is_the_v1_salt():
    """Backwards-clear: a plain request (and a whole-model shard) keeps the v1 salt, so its keys are unchanged."""
    assert request_salt(b"") == b"" and request_salt(b"tenant") == b"tenant"
    assert request_salt(b"t", shard=Shard(0, 2, 2, 0, 4, 4)) == b"t"


@pytest.mark.parametrize("parts", [
    dict(adapter=ADAPTER), dict(adapter=Adapter("b", ADAPTER.digest)), dict(adapter=Adapter("a", bytes(32))),
    dict(mm_items=[IMAGE]), dict(mm_items=[MultiModalItem("image", "abc124", 3, 4)]),
    dict(mm_items=[MultiModalItem("image", "abc123", 4, 4)]), dict(mm_items=[MultiModalItem("audio", "abc123", 3, 4)]),
    dict(mm_items=[IMAGE, IMAGE]), dict(embeds_digest=bytes(32)), dict(shard=Shard(0, 1, 2, 0, 4, 4)),
    dict(shard=Shard(1, 2, 2, 0, 4, 4)), dict(shard=Shard(0, 2, 2, 0, 2, 4)), dict(adapter=ADAPTER, mm_items=[IMAGE]),
])
def test_every_request_part_separates_keys(parts):
    """Every part of a request's identity gives keys disjoint from the plain request's and from every other case's."""
    salts = {request_salt(b"t", **parts)}
    assert request_salt(b"t", **parts) == request_salt(b"t", **parts)  # deterministic
    assert request_salt(b"t", **parts) not in (b"t", request_salt(b"u", **parts))
    tokens = list(range(32))
    other = ModelSpec(BASE.model_id, BASE.revision, BASE.kv_dtype, BASE.num_layers, BASE.num_kv_heads, BASE.head_dim,
                      tenant_salt=salts.pop())
    assert not set(chunk_keys(fingerprint(other), tokens, 8)) & set(chunk_keys(fingerprint(BASE), tokens, 8))


def test_request_parts_are_pairwise_distinct():
    cases = [dict(adapter=ADAPTER), dict(mm_items=[IMAGE]), dict(embeds_digest=ADAPTER.digest),
             dict(adapter=ADAPTER, mm_items=[IMAGE]), dict(mm_items=[IMAGE, MultiModalItem("image", "x", 9, 1)]),
             dict(shard=Shard(0, 1, 2, 0, 4, 4)), dict(shard=Shard(1, 2, 2, 0, 4, 4)),
             dict(shard=Shard(0, 1, 2, 0, 4, 4), adapter=ADAPTER)]
    salts = [request_salt(b"", **c) for c in cases]
    assert len(set(salts)) == len(salts)


def test_shard_spec_holds_the_rank_slice():
    whole = ModelSpec("m", "r", "float16", 4, 4, 8)
    r0, r1 = (shard_spec(whole, Shard(2 * r, 2 * r + 2, 4, 0, 4, 4)) for r in (0, 1))
    assert (r0.num_kv_heads, r0.num_layers) == (2, 4) and r0.tenant_salt != r1.tenant_salt
    assert fingerprint(r0) != fingerprint(r1)
    # Negative control: the rank's head count alone (what the spec would say without the shard) is one fingerprint
    # for both ranks, so rank 1 would be served rank 0's heads.
    import dataclasses

    assert dataclasses.replace(r0, tenant_salt=b"") == dataclasses.replace(r1, tenant_salt=b"")
    with pytest.raises(ValueError, match="shard of a model"):
        shard_spec(whole, Shard(0, 1, 2, 0, 4, 4))


@pytest.mark.parametrize("parts,what", [
    (dict(adapter=Adapter("", bytes(32))), "adapter.name"), (dict(adapter=Adapter("a", b"x")), "adapter.digest"),
    (dict(mm_items=[MultiModalItem("image", "", 0, 1)]), "multimodal item 0"),
    (dict(mm_items=[MultiModalItem("image", "h", 0, 0)]), "multimodal item 0"),
    (dict(shard=Shard(1, 1, 2, 0, 1, 1)), "shard heads"), (dict(shard=Shard(0, 1, 2, 0, 3, 2)), "shard layers"),
])
def test_malformed_request_parts_name_what(parts, what):
    with pytest.raises(ValueError, match=what):
        request_salt(b"", **parts)


# fp8 KV caches and MLA latents (issue 29)
SCALES_A = scales_digest([2.0, 0.5, 1.0, 1.0], [0.5, 0.5, 1.0, 1.0])


def test_fp8_scales_separate_keys_and_their_digest_is_the_scales_as_float32():
    fp8 = ModelSpec("m", "r", "float8_e4m3fn", 4, 2, 8)
    b = scales_digest([2.0, 0.5, 1.0, 1.0], [0.5, 0.5, 1.0, 0.999])
    swapped = scales_digest([0.5, 0.5, 1.0, 1.0], [2.0, 0.5, 1.0, 1.0])  # K and V scales are not interchangeable
    assert len({SCALES_A, b, swapped}) == 3
    assert scales_digest([2.0], [0.5]) == hashlib.sha256(b"promptcache/kv-scales/v1\0" + struct.pack("<ff", 2, .5)).digest()
    assert scales_digest([0.1], [1.0]) == scales_digest([0.10000000001], [1.0])  # float32, as vLLM keeps them
    keys = lambda salt: set(chunk_keys(fingerprint(ModelSpec("m", "r", "float8_e4m3fn", 4, 2, 8, tenant_salt=salt)),  # noqa: E731
                                       range(16), 8))
    a = keys(request_salt(b"", kv_scales=SCALES_A))
    assert not a & keys(request_salt(b"", kv_scales=b)) and not a & keys(b"")
    assert not a & set(chunk_keys(fingerprint(ModelSpec("m", "r", "float8_e5m2", 4, 2, 8,
                                                        tenant_salt=request_salt(b"", kv_scales=SCALES_A))), range(16), 8))
    assert fingerprint(fp8) != fingerprint(ModelSpec("m", "r", "float8_e5m2", 4, 2, 8))


@pytest.mark.parametrize("k,v,what", [([], [], "0 K and 0 V"), ([1.0], [], "1 K and 0 V"),
                                      ([1.0, 0.0], [1.0, 1.0], "layer 1"), ([float("nan")], [1.0], "layer 0"),
                                      ([1.0], [float("inf")], "layer 0")])
def test_malformed_scales_are_refused(k, v, what):
    with pytest.raises(ValueError, match=what):
        scales_digest(k, v)
    with pytest.raises(ValueError, match="kv_scales digest"):
        request_salt(b"", kv_scales=b"short")


def test_an_mla_chunk_never_shares_keys_with_a_kv_chunk_of_the_same_bytes():
    """kv_kind "mla" is fingerprint field 9: a latent chunk [L, 1, 1, T, 576] and a K/V chunk [L, 2, 1, T, 288] have
    the same size, never the same keys; a "kv" spec hashes as before (no field 9)."""
    from promptcache.contract.layout import chunk_nbytes, chunk_shape

    mla = ModelSpec("m", "r", "bfloat16", 4, 1, 576, kv_kind="mla")
    kv = ModelSpec("m", "r", "bfloat16", 4, 1, 288)
    assert chunk_shape(mla, 8) == (4, 1, 1, 8, 576) and chunk_nbytes(mla, 8) == chunk_nbytes(kv, 8)
    assert not set(chunk_keys(fingerprint(mla), range(32), 8)) & set(chunk_keys(fingerprint(kv), range(32), 8))
    assert fingerprint(mla) != fingerprint(ModelSpec("m", "r", "bfloat16", 4, 1, 576))


@pytest.mark.parametrize("kwargs,what", [
    (dict(kv_dtype="float8_e4m3fn", quantization="k8v8"), "not available for float8_e4m3fn chunks"),
    (dict(kv_dtype="float8_e5m2", quantization="k8v4"), "not available for float8_e5m2 chunks"),
    (dict(kv_kind="mla", num_kv_heads=1, quantization="k6v4z"), "not available for MLA latent chunks"),
    (dict(kv_kind="mla", num_kv_heads=2), "num_kv_heads must be 1 for an MLA"),
    (dict(kv_kind="latent"), "model.kv_kind"), (dict(kv_dtype="float8_e4m3fnuz"), "model.kv_dtype"),
])
def test_fp8_and_mla_specs_refuse_what_does_not_fit(kwargs, what):
    base = dict(model_id="m", revision="r", kv_dtype="float16", num_layers=4, num_kv_heads=2, head_dim=8)
    with pytest.raises(ValueError, match=what):
        ModelSpec(**{**base, **kwargs}).validate()
