"""Static checks of docker/*.Dockerfile (images cannot be built here): multi-stage, pinned base, non-root final
stage without build tools, and the chart's default images are the ones these files build."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DOCKER = ROOT / "docker"


def stages(text: str) -> list[list[str]]:
    out: list[list[str]] = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if line.upper().startswith("FROM "):
            out.append([])
        if out:
            out[-1].append(line)
    return out


@pytest.mark.parametrize("name", ["operator", "sidecar"])
def test_dockerfile_is_minimal_and_non_root(name):
    text = (DOCKER / f"{name}.Dockerfile").read_text()
    base = re.search(r"^ARG PYTHON_IMAGE=(\S+)$", text, re.M).group(1)
    assert re.fullmatch(r"python:\d+\.\d+\.\d+-slim-\w+(@sha256:[a-f0-9]{64})?", base), base  # exact version
    st = stages(text)
    assert len(st) >= 2, "multi-stage"
    final = st[-1]
    users = [line for line in final if line.upper().startswith("USER ")]
    assert users and users[-1].split()[1].split(":")[0] not in ("root", "0")
    joined = "\n".join(final)
    for tool in ("apt-get", "apk ", "gcc", "build-essential", "pip install"):
        assert tool not in joined, f"{tool} in the final stage"
    assert any(line.upper().startswith(("ENTRYPOINT", "CMD")) for line in final)


def test_chart_defaults_reference_these_images():
    values = yaml.safe_load((ROOT / "charts" / "promptcache-operator" / "values.yaml").read_text())
    op = (DOCKER / "operator.Dockerfile").read_text()
    side = (DOCKER / "sidecar.Dockerfile").read_text()
    assert values["image"]["repository"] in op
    assert values["sidecarImage"]["repository"] in side
    assert 'ENTRYPOINT ["python", "-m", "promptcache.operator"]' in op
    # The DaemonSet runs the sidecar image with args ["serve"]: the entrypoint must be the promptcache CLI.
    assert 'ENTRYPOINT ["promptcache"]' in side


@pytest.mark.parametrize("name", ["operator", "sidecar"])
def test_final_user_has_a_passwd_entry(name):
    """The final stage's USER uid has a passwd and group entry made in that stage: without one getpass.getuser()
    raises KeyError (kopf's peering identity did: the operator pod crash-looped as uid 65532)."""
    final = "\n".join(stages((DOCKER / f"{name}.Dockerfile").read_text())[-1])
    user = [line for line in final.splitlines() if line.upper().startswith("USER ")][-1].split()[1]
    uid, _, gid = user.partition(":")
    assert uid.isdigit(), f"USER {user}: give the numeric uid (runAsNonRoot checks it)"
    gid_re = gid or r"\d+"
    assert re.search(rf"'[a-z][a-z0-9_-]*:x:{uid}:{gid_re}:[^:]*:[^:]*:[^:']*' >> /etc/passwd", final, re.M), \
        f"no /etc/passwd entry for uid {uid} in the final stage"
    assert re.search(rf"'[a-z][a-z0-9_-]*:x:{gid or uid}:' >> /etc/group", final, re.M), \
        f"no /etc/group entry for gid {gid or uid} in the final stage"


def test_operator_image_ships_the_resize_stubs():
    """The operator's Resize uses the generated promptcache.v1 messages (kvcache_pb2), never committed: the build
    stage generates them from proto/ into /app with the grpcio-tools the package build pins (in a throwaway
    virtualenv, not /venv), /venv gets protobuf at least the operator extra's, and the final stage copies /app."""
    text = (DOCKER / "operator.Dockerfile").read_text()
    st = stages(text)
    build, final = "\n".join(line for s in st[:-1] for line in s), "\n".join(st[-1])
    assert re.search(r"^COPY proto/promptcache/v1/kvcache\.proto (\S+)$", build, re.M)
    protoc = re.search(r"(\S+)/bin/python -m grpc_tools\.protoc (.*)$", build, re.M)
    assert protoc and "--python_out=/app" in protoc.group(2) and "promptcache/v1/kvcache.proto" in protoc.group(2)
    assert protoc.group(1) != "/venv", "grpcio-tools belongs to the build only"
    pyproject = (ROOT / "pyproject.toml").read_text()
    tools = re.search(r'"grpcio-tools==([\d.]+)"', pyproject).group(1)
    assert f"grpcio-tools=={tools}" in build
    venv_install = re.search(r"/venv/bin/pip install (.*?)(?:&&|$)", build.replace("\\\n", " "), re.S).group(1)
    assert "grpcio-tools" not in venv_install
    pinned = re.search(r"\bprotobuf==([\d.]+)", venv_install)
    assert pinned, "protobuf (the stubs' runtime) in /venv"
    floor = re.search(r'^operator = \[.*"protobuf>=([\d.]+)"', pyproject, re.M).group(1)
    as_tuple = lambda v: tuple(int(x) for x in v.split("."))  # noqa: E731
    assert as_tuple(pinned.group(1)) >= as_tuple(floor)
    assert "COPY --from=build /app /app" in final


def test_operator_image_holds_every_promptcache_module_the_operator_imports():
    """The image copies promptcache.operator, the generated promptcache.v1 and single shared modules; an import of
    any other promptcache module (at the top or inside a function) would fail only in the image."""
    import ast

    text = (DOCKER / "operator.Dockerfile").read_text()
    copied = {m.group(1).replace("/", ".") for m in re.finditer(r"^COPY \S+ /app/(promptcache/\S+)\.py$", text, re.M)}
    imported = set()
    for path in (ROOT / "operator" / "promptcache" / "operator").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("promptcache."):
                imported.update(f"{node.module}.{a.name}" for a in node.names)  # a module, or a name in one
            elif isinstance(node, ast.Import):
                imported.update(a.name for a in node.names if a.name.startswith("promptcache."))
    outside = {m for m in imported if not m.startswith(("promptcache.operator", "promptcache.v1"))}
    assert outside, "the operator imports shared modules (quantity, metricsserver)"
    missing = {m for m in outside if m not in copied and m.rsplit(".", 1)[0] not in copied}
    assert not missing, f"imported by the operator but not in its image: {sorted(missing)}"
