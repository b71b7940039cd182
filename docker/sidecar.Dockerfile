# PromptCache cache sidecar image (chart value sidecarImage.repository: ghcr.io/promptcache/promptcache-sidecar).
# Build from the repository root:
#   docker build -f docker/sidecar.Dockerfile -t ghcr.io/promptcache/promptcache-sidecar:0.1.0 .
# The operator runs it with args ["serve"] and PROMPTCACHE_* settings from the PromptCache's ConfigMap.

# Pinned base (by exact version; pin by digest as well in the release pipeline).
ARG PYTHON_IMAGE=python:3.12.8-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY proto/ proto/
COPY sidecar/ sidecar/
COPY operator/ operator/
# Builds the gRPC stubs (grpcio-tools, in the isolated build env) and installs the package and its
# dependencies (torch among them) into /venv; build tools stay in this stage.
# The 'cluster' extra brings the Mooncake Store client and master (spec.cluster); they link libibverbs even over
# TCP, so its libraries are copied into the final stage (RDMA also needs the NIC's provider, ibverbs-providers).
RUN apt-get update -qq && apt-get install -y -qq --no-install-recommends libibverbs1 \
 && mkdir /ibverbs && cp -a /usr/lib/$(uname -m)-linux-gnu/libibverbs.so.1* /usr/lib/$(uname -m)-linux-gnu/libnl-3.so.200* \
    /usr/lib/$(uname -m)-linux-gnu/libnl-route-3.so.200* /ibverbs/ \
 && python -m venv /venv \
 && /venv/bin/pip install '/src[cluster]' \
 && /venv/bin/pip uninstall -y pip setuptools wheel || true

FROM ${PYTHON_IMAGE}
RUN python -m pip uninstall -y pip setuptools wheel 2>/dev/null || true
COPY --from=build /venv /venv
COPY --from=build /ibverbs/ /usr/local/lib/
RUN ldconfig
ENV PATH=/venv/bin:$PATH PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
# Writable paths are volumes (the pod's root filesystem is read-only): /var/cache/promptcache, /tmp.
# The uid the chart runs as (65532) gets a passwd/group entry: without one getpass.getuser() (kopf's peering
# identity, among others) raises KeyError and the pod crash-loops. HOME=/tmp: the only writable path.
RUN echo 'nonroot:x:65532:65532:nonroot:/tmp:/usr/sbin/nologin' >> /etc/passwd \
 && echo 'nonroot:x:65532:' >> /etc/group
ENV USER=nonroot HOME=/tmp
USER 65532:65532
EXPOSE 50051 9400
ENTRYPOINT ["promptcache"]
CMD ["serve"]
