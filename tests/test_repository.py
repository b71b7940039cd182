"""The tree itself: no merge-conflict markers left in any tracked file (golden files included, where a marker
would otherwise only show up as a confusing golden mismatch); the layout's import rules."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MARKER = re.compile(rb"^(<{7} |>{7} |={7}$)", re.M)


def test_no_conflict_markers_in_tracked_files():
    try:
        files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    bad = []
    for name in filter(None, files.split(b"\0")):
        path = ROOT / name.decode()
        if path.is_file() and path.suffix not in (".png",) and MARKER.search(path.read_bytes()):
            bad.append(name.decode())
    assert not bad, f"merge-conflict markers in: {bad}"


def _imported_modules(path: Path) -> set[str]:
    import ast

    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
    return names


@pytest.mark.parametrize("package", ["client", "contract"])
def test_clients_and_contracts_import_nothing_from_the_server(package):
    """Inference pods install the client; it and the wire contracts must not drag in the server (issue #14)."""
    root = ROOT / "sidecar" / "promptcache" / package
    offenders = {str(p.relative_to(root)): sorted(m for m in _imported_modules(p) if m.startswith("promptcache.sidecar"))
                 for p in root.rglob("*.py")}
    assert {p: m for p, m in offenders.items() if m} == {}


@pytest.mark.parametrize("module", ["engine", "errors", "identity", "limits", "store", "tenancy"])
def test_the_cache_engine_has_no_transport_in_it(module):
    """grpc lives in the adapters (server, guard, auth, app); the engine and what it stands on never load it."""
    path = ROOT / "sidecar" / "promptcache" / "sidecar" / f"{module}.py"
    assert not {m for m in _imported_modules(path) if m == "grpc" or m.startswith("grpc.")}
    loaded = subprocess.run([sys.executable, "-c", f"import sys, promptcache.sidecar.{module}; "
                             "print(sorted(m for m in sys.modules if m.split('.')[0] == 'grpc'))"],
                            capture_output=True, text=True, check=True).stdout.strip()
    assert loaded == "[]"
