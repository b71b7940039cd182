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
