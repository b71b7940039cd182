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
