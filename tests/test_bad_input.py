"""Every malformed request gets a status whose message names what was wrong; nothing partial is stored; the
server keeps serving other clients."""
from __future__ import annotations

import dataclasses

import grpc
import pytest

from support import CHUNK, SMALL, make_kv
from promptcache.client import PromptCacheClient, errors
from promptcache.client.client import encode_chunk
from promptcache.contract.layout import chunk_nbytes
from promptcache.v1 import kvcache_pb2 as pb
from promptcache.v1 import kvcache_pb2_grpc as pb_grpc
from promptcache.contract.wire import model_to_proto

MODEL = model_to_proto(SMALL)
NBYTES = chunk_nbytes(SMALL, CHUNK)
SHAPE = [SMALL.num_layers, 2, SMALL.num_kv_heads, CHUNK, SMALL.head_dim]
TOKENS = list(range(2 * CHUNK))
BLOB = encode_chunk(SMALL, make_kv(SMALL, CHUNK), 0, CHUNK).numpy().tobytes()


@pytest.fixture
def stub(sidecar):
    with grpc.insecure_channel(sidecar.address) as channel:
        yield pb_grpc.KVCacheStub(channel)


def begin(**kw):
    fields = dict(index=0, nbytes=NBYTES, shape=SHAPE, dtype=pb.DTYPE_FLOAT32)
    fields.update(kw)
    return pb.PutRequest(chunk=pb.ChunkBegin(**fields))


def header(model=MODEL, tokens=TOKENS):
    return pb.PutRequest(header=pb.PutHeader(model=model, tokens=tokens))


def data(b):
    return pb.PutRequest(data=b)


def expect(code, fragment, call):
    with pytest.raises(grpc.RpcError) as info:
        call()
    assert info.value.code() == code, info.value.details()
    assert fragment in info.value.details(), info.value.details()


def put(stub, frames):
    return lambda: stub.Put(iter(frames), timeout=10)


BAD_PUTS = {
    "wrong dtype": ([header(), begin(dtype=pb.DTYPE_BFLOAT16), data(BLOB)], grpc.StatusCode.INVALID_ARGUMENT,
                    "dtype DTYPE_BFLOAT16 does not match"),
    "wrong shape": ([header(), begin(shape=[2, 2, 3, CHUNK, 8]), data(BLOB)], grpc.StatusCode.INVALID_ARGUMENT,
                    "shape [2, 2, 3, 16, 8] does not match"),
    "tokens per chunk differ from the chunk size": (
        [header(), begin(shape=[2, 2, 2, 32, 8]), data(BLOB)], grpc.StatusCode.INVALID_ARGUMENT,
        "shape[3] (tokens per chunk) is 32"),
    "nbytes not matching the layout": ([header(), begin(nbytes=NBYTES - 4), data(BLOB[:-4])],
                                       grpc.StatusCode.INVALID_ARGUMENT, f"need exactly {NBYTES}"),
    "fewer tokens than one chunk": ([header(tokens=list(range(CHUNK - 1)))], grpc.StatusCode.INVALID_ARGUMENT,
                                    "fewer than one chunk"),
    "empty token list": ([header(tokens=[])], grpc.StatusCode.INVALID_ARGUMENT, "tokens is empty"),
    "chunk index beyond the tokens": ([header(), begin(index=2), data(BLOB)], grpc.StatusCode.INVALID_ARGUMENT,
                                      "chunk index 2 needs tokens up to 48"),
    "stream ends mid-chunk": ([header(), begin(), data(BLOB[:100])], grpc.StatusCode.INVALID_ARGUMENT,
                              f"chunk 0 ended after 100 of its {NBYTES} bytes"),
    "next chunk before the last ended": ([header(), begin(), data(BLOB[:100]), begin(index=1)],
                                         grpc.StatusCode.INVALID_ARGUMENT, "chunk 0 ended after 100"),
    "more data than announced": ([header(), begin(), data(BLOB + b"x")], grpc.StatusCode.INVALID_ARGUMENT,
                                 "more than the"),
    "data before a chunk frame": ([header(), data(BLOB)], grpc.StatusCode.INVALID_ARGUMENT,
                                  "data frame arrived before any chunk frame"),
    "no header": ([begin(), data(BLOB)], grpc.StatusCode.INVALID_ARGUMENT, "must start with a header"),
    "two headers": ([header(), header()], grpc.StatusCode.INVALID_ARGUMENT, "exactly one header"),
    "checksum mismatch": ([header(), begin(xxh3_64=12345), data(BLOB)], grpc.StatusCode.DATA_LOSS, "checksum"),
    "missing model": ([pb.PutRequest(header=pb.PutHeader(tokens=TOKENS))], grpc.StatusCode.INVALID_ARGUMENT,
                      "model is missing"),
}


@pytest.mark.parametrize("name", list(BAD_PUTS))
def test_bad_put_is_rejected_and_nothing_is_stored(sidecar, stub, client, name):
    frames, code, fragment = BAD_PUTS[name]
    expect(code, fragment, put(stub, frames))
    assert sidecar.tier.usage() == {"entries": 0, "used": 0, "reserved": 0, "draining": 0,
                                    "budget": sidecar.tier.budget}
    # ...and the server keeps serving.
    assert client.put(SMALL, TOKENS, make_kv(SMALL, len(TOKENS))).stored_chunks == 2


def test_whole_chunks_before_a_cut_are_kept_and_the_cut_one_is_not(sidecar, stub, client):
    expect(grpc.StatusCode.INVALID_ARGUMENT, "chunk 1 ended after 10",
           put(stub, [header(), begin(), data(BLOB), begin(index=1), data(BLOB[:10])]))
    assert client.lookup(SMALL, TOKENS).cached_tokens == CHUNK
    assert sidecar.tier.usage()["reserved"] == 0


def test_same_chunk_twice_is_rejected_after_the_first_whole_copy(stub, client):
    expect(grpc.StatusCode.INVALID_ARGUMENT, "chunk index 0 was sent twice",
           put(stub, [header(), begin(), data(BLOB), begin(), data(BLOB)]))
    assert client.lookup(SMALL, TOKENS).cached_tokens == CHUNK


def test_chunk_over_the_size_limit(sidecar_factory):
    sidecar = sidecar_factory(max_chunk_bytes=NBYTES - 1)
    with grpc.insecure_channel(sidecar.address) as ch:
        expect(grpc.StatusCode.RESOURCE_EXHAUSTED, "exceed the limit of",
               put(pb_grpc.KVCacheStub(ch), [header(), begin(), data(BLOB)]))


def test_chunk_over_the_budget(sidecar_factory):
    sidecar = sidecar_factory(memory_bytes=NBYTES - 1)
    with grpc.insecure_channel(sidecar.address) as ch:
        expect(grpc.StatusCode.RESOURCE_EXHAUSTED, "exceeds the memory budget",
               put(pb_grpc.KVCacheStub(ch), [header(), begin(), data(BLOB)]))


MALFORMED_MODELS = {
    "model_id": dataclasses.replace(MODEL_SPEC := SMALL, model_id=""),
    "num_layers": dataclasses.replace(MODEL_SPEC, num_layers=0),
    "head_dim": dataclasses.replace(MODEL_SPEC, head_dim=70000),
    "tenant_salt": dataclasses.replace(MODEL_SPEC, tenant_salt=b"s" * 65),
}


@pytest.mark.parametrize("field", list(MALFORMED_MODELS))
def test_malformed_fingerprint_names_the_field(stub, field):
    spec = MALFORMED_MODELS[field]
    msg = pb.Model(model_id=spec.model_id, revision=spec.revision, kv_dtype=pb.DTYPE_FLOAT32,
                   num_layers=spec.num_layers, num_kv_heads=spec.num_kv_heads, head_dim=spec.head_dim,
                   quantization="none", tenant_salt=spec.tenant_salt)
    expect(grpc.StatusCode.INVALID_ARGUMENT, f"model.{field}",
           lambda: stub.Lookup(pb.LookupRequest(model=msg, tokens=TOKENS), timeout=5))


def test_unknown_dtype_and_quantization_are_named(stub):
    bad_dtype = pb.Model(model_id="m", kv_dtype=pb.DTYPE_UNSPECIFIED, num_layers=1, num_kv_heads=1, head_dim=1)
    expect(grpc.StatusCode.INVALID_ARGUMENT, "model.kv_dtype",
           lambda: stub.Lookup(pb.LookupRequest(model=bad_dtype, tokens=TOKENS), timeout=5))
    bad_quant = pb.Model(model_id="m", kv_dtype=pb.DTYPE_FLOAT32, num_layers=1, num_kv_heads=1, head_dim=1,
                         quantization="k3v3")
    expect(grpc.StatusCode.INVALID_ARGUMENT, "model.quantization 'k3v3'",
           lambda: stub.Get(pb.GetRequest(model=bad_quant, tokens=TOKENS), timeout=5).next())


@pytest.mark.parametrize("rpc", ["Lookup", "Get", "Delete"])
def test_empty_token_list(stub, rpc):
    request = {"Lookup": pb.LookupRequest, "Get": pb.GetRequest, "Delete": pb.DeleteRequest}[rpc](model=MODEL)
    call = getattr(stub, rpc)
    expect(grpc.StatusCode.INVALID_ARGUMENT, "tokens is empty",
           (lambda: list(call(request, timeout=5))) if rpc == "Get" else (lambda: call(request, timeout=5)))


@pytest.mark.parametrize("size", [0, -1, -(2**40)])
def test_resize_to_zero_or_negative(stub, sidecar, size):
    expect(grpc.StatusCode.INVALID_ARGUMENT, f"memory_bytes must be positive, got {size}",
           lambda: stub.Resize(pb.ResizeRequest(memory_bytes=size), timeout=5))
    assert sidecar.tier.budget > 0


def test_client_raises_one_exception_type_per_kind(client):
    with pytest.raises(errors.InvalidArgument, match="tokens is empty"):
        client.lookup(SMALL, [])
    with pytest.raises(ValueError, match="layer 0 K has dtype torch.float16"):
        client.put(SMALL, TOKENS, make_kv(dataclasses.replace(SMALL, kv_dtype="float16"), len(TOKENS)))
    with pytest.raises(errors.InvalidArgument, match="memory_bytes must be positive"):
        client.resize(0)


def test_cancelled_put_releases_its_reservation(sidecar):
    """A client that gives up mid-stream leaves nothing stored and nothing reserved."""
    import threading

    gate = threading.Event()

    def frames():
        yield header()
        yield begin()
        yield data(BLOB[:10])
        gate.wait(5)

    with grpc.insecure_channel(sidecar.address) as ch:
        future = pb_grpc.KVCacheStub(ch).Put.future(frames(), timeout=10)
        import time

        deadline = time.monotonic() + 5
        while sidecar.tier.usage()["reserved"] == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert sidecar.tier.usage()["reserved"] == NBYTES
        future.cancel()
        gate.set()
        deadline = time.monotonic() + 5
        while sidecar.tier.usage()["reserved"] and time.monotonic() < deadline:
            time.sleep(0.01)
    assert sidecar.tier.usage()["reserved"] == 0 and sidecar.tier.usage()["entries"] == 0


def test_server_survives_a_burst_of_garbage(sidecar, client):
    with grpc.insecure_channel(sidecar.address) as ch:
        raw = ch.unary_unary("/promptcache.v1.KVCache/Lookup", request_serializer=None, response_deserializer=None)
        for junk in (b"\xff" * 7, b"\x0a\x05abc", b"\x12\x03\x80\x80\x80"):
            with pytest.raises(grpc.RpcError):
                raw(junk, timeout=5)
    with PromptCacheClient(sidecar.address) as c:
        assert c.put(SMALL, TOKENS, make_kv(SMALL, len(TOKENS))).stored_chunks == 2


def test_a_model_no_chunk_can_have_is_refused_by_every_method(client):
    """k8v4 packs two values a byte: an odd head_dim has no layout. Found by the fuzzer on Lookup (INTERNAL)."""
    import dataclasses

    from promptcache.client import errors
    from support import SMALL

    odd = dataclasses.replace(SMALL, head_dim=1, quantization="k8v4")
    tokens = list(range(64))
    for call in (lambda: client.lookup(odd, tokens), lambda: client.get_blobs(odd, tokens)):
        with pytest.raises(errors.InvalidArgument, match="even head_dim"):
            call()
