"""The tree itself: no merge-conflict markers left in any tracked file (golden files included, where a marker
would otherwise only show up as a confusing golden mismatch); the layout's import rules; what the promptcache
distribution ships (no benchmark, fuzzer or demo: those are promptcache-devtools, devtools/)."""
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


@pytest.mark.parametrize("package", ["client", "contract", "codec"])
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


SHIPPED_ROOTS = ("sidecar", "operator", "proto")   # the source roots of the promptcache distribution (setup.py)
DEV_TOOL = re.compile(r"(^|[._])(bench|benchmarks?|devtools|fuzz|demo)([._]|$)")


def _setup_packages() -> dict[str, str]:
    """What setup.py gives setuptools: {package: its folder}, computed by setup.py itself (setup() replaced)."""
    import runpy

    import setuptools

    seen = {}
    real = setuptools.setup
    setuptools.setup = lambda **kw: seen.update(kw)
    try:
        runpy.run_path(str(ROOT / "setup.py"), run_name="setup_probe")
    finally:
        setuptools.setup = real
    return {pkg: seen["package_dir"][pkg] for pkg in seen["packages"]}


def test_the_package_list_is_made_of_the_shipped_roots_only():
    packages = _setup_packages()
    assert {"promptcache", "promptcache.sidecar", "promptcache.client", "promptcache.codec", "promptcache.operator",
            "promptcache.v1"} <= set(packages)
    assert all(d.split("/")[0] in SHIPPED_ROOTS for d in packages.values()), packages


def test_the_installed_package_has_no_benchmark_fuzzer_or_demo_module():
    """Issue #30: benchmarks, the fuzzer and the demo are promptcache-devtools (devtools/), not in the wheel."""
    modules = []
    for pkg, folder in _setup_packages().items():
        modules.append(pkg)
        modules += [f"{pkg}.{p.stem}" for p in (ROOT / folder).glob("*.py") if p.stem != "__init__"]
    assert "promptcache.sidecar.mrc" in modules and "promptcache.cli" in modules  # the listing reads the tree
    assert DEV_TOOL.search("promptcache.devtools.bench.replay") and DEV_TOOL.search("promptcache_devtools.fuzz")
    assert [m for m in modules if DEV_TOOL.search(m)] == []


def _dev_tool_imports(path: Path) -> list[str]:
    return sorted(m for m in _imported_modules(path)
                  if m.split(".")[0] == "promptcache_devtools" or m.startswith("promptcache.devtools"))


def test_no_shipped_module_imports_promptcache_devtools():
    """The wheel must work without promptcache-devtools: no module of it imports it (the `bench` subcommand of
    promptcache.cli loads a benchmark by name, on use, and says how to install the package when it is missing)."""
    files = [p for root in SHIPPED_ROOTS for p in (ROOT / root).rglob("*.py")]
    assert len(files) > 50
    offenders = {str(p.relative_to(ROOT)): _dev_tool_imports(p) for p in files}
    assert {p: m for p, m in offenders.items() if m} == {}
    # negative control: the scan sees such an import where there is one
    assert _dev_tool_imports(ROOT / "tests" / "test_replay.py")
