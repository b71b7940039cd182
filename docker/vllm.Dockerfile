# vLLM's OpenAI server image with the PromptCache connector (docs/vllm.md, examples/vllm-deployment.yaml). Build from
# the repository root:
#   docker build -f docker/vllm.Dockerfile -t ghcr.io/promptcache/vllm-promptcache:v0.33.0 .
# Only the client package goes in: installed with --no-deps (none of the server's dependencies, no RocksDB), then
# the connector's own runtime dependencies, the `vllm` extra of pyproject.toml (read from the wheel's metadata, so
# the list lives in one place). vLLM brings torch.

ARG VLLM_IMAGE=vllm/vllm-openai:v0.33.0
ARG PYTHON_IMAGE=python:3.12.8-slim-bookworm

# The wheel is built in a plain Python image (the gRPC stubs are generated at build time by grpcio-tools).
FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY proto/ proto/
COPY sidecar/ sidecar/
COPY operator/ operator/
RUN pip wheel --no-deps -w /wheels .

FROM ${VLLM_IMAGE}
COPY --from=build /wheels/ /tmp/wheels/
RUN python3 -m pip install --no-cache-dir --no-deps /tmp/wheels/promptcache-*.whl \
 && python3 -m pip install --no-cache-dir $(python3 -c 'import importlib.metadata as m; print(" ".join(r.split(";")[0] for r in m.requires("promptcache") if "extra == \"vllm\"" in r))') \
 && python3 -c 'import promptcache.client.vllm_connector' \
 && rm -rf /tmp/wheels
# The image's entrypoint is vLLM's OpenAI server; give it --kv-transfer-config as in examples/vllm-deployment.yaml.
