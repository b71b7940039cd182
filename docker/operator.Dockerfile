# PromptCache operator image (chart value image.repository: ghcr.io/promptcache/promptcache-operator).
# Build from the repository root:
#   docker build -f docker/operator.Dockerfile -t ghcr.io/promptcache/promptcache-operator:0.1.0 .
# Only the operator's code and its dependencies go in (no torch; grpcio, protobuf and the generated promptcache.v1
# messages for the sidecars' Resize, prometheus-client for its own /metrics and for reading the sidecars'):
# promptcache.operator is a PEP 420 namespace portion, runnable as `python -m promptcache.operator`.

# Pinned base (by exact version; pin by digest as well in the release pipeline).
ARG PYTHON_IMAGE=python:3.12.8-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /venv \
 && /venv/bin/pip install --only-binary=:all: kopf==1.45.2 kubernetes==37.0.2 PyYAML==6.0.4 grpcio==1.85.1 \
      protobuf==7.36.2 prometheus-client==0.26.0 \
 && /venv/bin/pip uninstall -y pip setuptools wheel || true
# The promptcache.v1 stubs (never committed): the messages only (kvcache_pb2, protobuf; no service code), generated
# from proto/ by the grpcio-tools the package build pins (its gencode needs protobuf >= 7.35.1), in a throwaway
# virtualenv of this stage.
COPY proto/promptcache/v1/kvcache.proto /proto/promptcache/v1/kvcache.proto
RUN python -m venv /protoc \
 && /protoc/bin/pip install --only-binary=:all: grpcio-tools==1.85.1 \
 && mkdir -p /app \
 && /protoc/bin/python -m grpc_tools.protoc -I/proto --python_out=/app promptcache/v1/kvcache.proto \
 && rm -rf /protoc
COPY operator/promptcache/operator /app/promptcache/operator
# The one Kubernetes-quantity parser, shared with the sidecar (promptcache.contract.quantity), and the bounded
# /metrics server (promptcache.sidecar.metricsserver); tests/operator/test_operator_dockerfiles.py checks that every
# promptcache module the operator imports is here.
COPY sidecar/promptcache/contract/quantity.py /app/promptcache/contract/quantity.py
COPY sidecar/promptcache/sidecar/metricsserver.py /app/promptcache/sidecar/metricsserver.py
RUN /venv/bin/python -m compileall -q /app

FROM ${PYTHON_IMAGE}
# Final stage: no compiler, no pip, no package manager use; runs as an unprivileged user.
RUN python -m pip uninstall -y pip setuptools wheel 2>/dev/null || true
COPY --from=build /venv /venv
COPY --from=build /app /app
ENV PATH=/venv/bin:$PATH PYTHONPATH=/app PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
# The uid the chart runs as (65532) gets a passwd/group entry: without one getpass.getuser() (kopf's peering
# identity, among others) raises KeyError and the pod crash-loops. HOME=/tmp: the only writable path.
RUN echo 'nonroot:x:65532:65532:nonroot:/tmp:/usr/sbin/nologin' >> /etc/passwd \
 && echo 'nonroot:x:65532:' >> /etc/group
ENV USER=nonroot HOME=/tmp
USER 65532:65532
EXPOSE 8080 8081
ENTRYPOINT ["python", "-m", "promptcache.operator"]
