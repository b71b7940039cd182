"""Conversions between the proto messages and the pure data types (ModelSpec), shared by server and client."""
from __future__ import annotations

from promptcache.contract.keys import ModelSpec
from promptcache.v1 import kvcache_pb2 as pb

DTYPE_TO_NAME = {pb.DTYPE_FLOAT32: "float32", pb.DTYPE_FLOAT16: "float16", pb.DTYPE_BFLOAT16: "bfloat16",
                 pb.DTYPE_FLOAT8_E4M3FN: "float8_e4m3fn", pb.DTYPE_FLOAT8_E5M2: "float8_e5m2"}
KIND_TO_NAME = {pb.KV_KIND_KV: "kv", pb.KV_KIND_MLA: "mla"}
NAME_TO_KIND = {v: k for k, v in KIND_TO_NAME.items()}
NAME_TO_DTYPE = {v: k for k, v in DTYPE_TO_NAME.items()}
TIER_NAMES = {pb.TIER_DEVICE: "device", pb.TIER_DISK: "disk", pb.TIER_CLUSTER: "cluster"}
AUTHORIZATION = "authorization"  # the bearer token's gRPC metadata key (the bulk channel's hello carries the same value)
POD_METADATA = "x-promptcache-pod"  # gRPC metadata naming the calling inference pod (for KV events)


def model_from_proto(msg: pb.Model) -> ModelSpec:
    """Raises ValueError naming the malformed field."""
    if msg.kv_dtype not in DTYPE_TO_NAME:
        raise ValueError(f"model.kv_dtype {pb.DType.Name(msg.kv_dtype) if msg.kv_dtype in pb.DType.values() else msg.kv_dtype} "
                         f"is not one of {', '.join(pb.DType.Name(d) for d in DTYPE_TO_NAME)}")
    if msg.kv_kind not in KIND_TO_NAME:
        raise ValueError(f"model.kv_kind {msg.kv_kind} is not one of "
                         f"{', '.join(pb.KVKind.Name(k) for k in KIND_TO_NAME)}")
    return ModelSpec(
        model_id=msg.model_id, revision=msg.revision, kv_dtype=DTYPE_TO_NAME[msg.kv_dtype],
        num_layers=msg.num_layers, num_kv_heads=msg.num_kv_heads, head_dim=msg.head_dim,
        quantization=msg.quantization or "none", tenant_salt=msg.tenant_salt, kv_kind=KIND_TO_NAME[msg.kv_kind],
    ).validate()


def model_to_proto(spec: ModelSpec) -> pb.Model:
    return pb.Model(model_id=spec.model_id, revision=spec.revision, kv_dtype=NAME_TO_DTYPE[spec.kv_dtype],
                    num_layers=spec.num_layers, num_kv_heads=spec.num_kv_heads, head_dim=spec.head_dim,
                    quantization=spec.quantization, tenant_salt=spec.tenant_salt, kv_kind=NAME_TO_KIND[spec.kv_kind])
