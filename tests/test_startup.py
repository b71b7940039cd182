"""Start-up: the CLI answers --version, --help and admin commands without importing torch; the harness's waits
for a starting process last while it makes progress and end at once when it exits or stalls."""
from __future__ import annotations

import ast
import json
import subprocess
import sys
import time

import pytest

from promptcache import cli
from promptcache_devtools import procs
from promptcache_devtools.bench.startup import imported_modules
from support import REPO


def importtime(*argv: str) -> tuple[subprocess.CompletedProcess, set[str]]:
    out = subprocess.run([sys.executable, "-X", "importtime", *argv], capture_output=True, text=True, timeout=120)
    return out, imported_modules(out.stderr)


def test_version_answers_before_anything_heavy_is_imported():
    out, modules = importtime("-m", "promptcache.cli", "--version")
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.startswith("promptcache ")
    assert "promptcache" in modules
    assert not {"torch", "numpy", "grpc", "promptcache_devtools"} & modules


@pytest.mark.parametrize("argv", [["--help"], ["bench", "--help"], ["stats", "--help"],
                                  ["serve", "--help"]])
def test_the_cli_answers_without_importing_torch(argv):
    out, modules = importtime("-m", "promptcache.cli", *argv)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "promptcache" in out.stdout
    assert "promptcache.sidecar.config" in modules  # the report is read right (and the negative control below)
    assert "torch" not in modules
    assert "promptcache_devtools" not in modules  # the benchmarks are another distribution, imported on use only


def test_the_import_report_shows_torch_when_something_loads_it():
    """Negative control: a lookup of a torch dtype loads torch, and the report shows it."""
    out, modules = importtime("-c", "from promptcache.contract.layout import TORCH_DTYPES; TORCH_DTYPES['float32']")
    assert out.returncode == 0, out.stderr[-2000:]
    assert "torch" in modules


def test_admin_stats_answers_a_sidecar_without_importing_torch(sidecar):
    out, modules = importtime("-m", "promptcache.cli", "stats", "--address", sidecar.address, "-o", "json")
    assert out.returncode == 0, out.stderr[-2000:]
    assert "chunk_tokens" in out.stdout or json.loads(out.stdout)
    assert not {"torch", "promptcache_devtools"} & modules


def test_bench_help_lines_are_the_modules_own():
    for name, (module_name, help_line) in cli.BENCHES.items():
        path = REPO / "devtools" / (module_name.replace(".", "/") + ".py")
        doc = ast.get_docstring(ast.parse(path.read_text()))
        assert doc.strip().splitlines()[0] == help_line, name


def test_a_named_bench_gets_its_flags_and_only_it_is_imported():
    # sys.modules at exit (-X importtime does not see importlib.import_module, which the CLI uses for benches).
    code = ("import json, sys\nfrom promptcache import cli\ntry:\n    cli.main(['bench', 'startup', '--help'])\n"
            "except SystemExit:\n    pass\nprint(json.dumps(sorted(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "--repeats" in out.stdout
    modules = set(json.loads(out.stdout.splitlines()[-1]))
    assert "promptcache_devtools.bench.startup" in modules
    assert "promptcache_devtools.bench.throughput" not in modules
    assert "torch" not in modules


HIDE_DEVTOOLS = "import sys\nsys.modules['promptcache_devtools'] = None  # as if not installed\nfrom promptcache import cli\n"


@pytest.mark.parametrize("argv", [["bench", "replay", "--synthetic", "chat"], ["bench", "startup", "--help"]])
def test_a_bench_without_promptcache_devtools_exits_2_naming_the_package(argv):
    out = subprocess.run([sys.executable, "-c", HIDE_DEVTOOLS + f"sys.exit(cli.main({argv!r}))"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr[-2000:]
    assert "promptcache-devtools" in out.stderr and "pip install -e devtools/" in out.stderr
    assert "Traceback" not in out.stderr


def test_help_version_and_serve_flags_work_without_promptcache_devtools():
    for argv in (["--version"], ["--help"], ["bench", "--help"], ["serve", "--help"]):
        out = subprocess.run([sys.executable, "-c", HIDE_DEVTOOLS + f"sys.exit(cli.main({argv!r}))"],
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, (argv, out.stderr[-2000:])
        assert "promptcache" in out.stdout


def test_a_wait_ends_at_once_when_the_process_exits():
    proc = subprocess.Popen([sys.executable, "-c", "import sys; sys.exit(3)"])
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="exited with 3"):
        procs.wait_until(lambda: False, "the child", proc=proc)
    assert time.monotonic() - start < 30


def test_a_wait_lasts_while_the_process_works_and_ends_when_it_stalls(monkeypatch):
    monkeypatch.setattr(procs, "STALL_SECONDS", 1.5)
    busy = subprocess.Popen([sys.executable, "-c", "import time\nend = time.time() + 60\nwhile time.time() < end: pass"])
    idle = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        time.sleep(0.5)  # past the interpreter's own start
        deadline = time.monotonic() + 4
        # Busy for 4 s, past the 1.5 s stall bound: the wait goes on (the check ends it).
        procs.wait_until(lambda: time.monotonic() > deadline, "the busy child", proc=busy)
        start = time.monotonic()
        with pytest.raises(TimeoutError, match="no progress"):
            procs.wait_until(lambda: False, "the idle child", proc=idle)
        assert time.monotonic() - start < 10
        with pytest.raises(TimeoutError, match="within 0.2 s"):  # an explicit timeout still bounds the wait
            procs.wait_until(lambda: False, "the busy child", timeout=0.2, proc=busy)
    finally:
        busy.kill()
        idle.kill()
        busy.wait()
        idle.wait()


def test_the_startup_bench_reports_both_figures():
    out = subprocess.run([sys.executable, "-m", "promptcache.cli", "bench", "startup", "--repeats", "1", "--json"],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout)
    assert result["version_imports_torch"] is False
    assert result["version_s"] > 0 and result["healthy_s"] > 0 and result["healthy_cpu_s"] > 0
    assert "load_average_1m" in result
