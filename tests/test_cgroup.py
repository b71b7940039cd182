"""Reading the cgroup memory limit, and refusing budgets that do not fit (no real cgroup limit is set on the test
machine, so the files are laid out in a temporary folder the way the kernel presents them)."""
import pytest

from promptcache.sidecar import cgroup


def test_fallback_files(tmp_path):
    root = tmp_path / "cg"
    root.mkdir()
    (root / "memory.max").write_text("1073741824\n")
    assert cgroup.memory_limit(root) == 1073741824
    (root / "memory.max").write_text("max\n")
    assert cgroup.memory_limit(root) is None
    (root / "memory.max").unlink()
    (root / "memory").mkdir()
    (root / "memory" / "memory.limit_in_bytes").write_text(str(1 << 62))
    assert cgroup.memory_limit(root) is None  # v1's "unlimited"
    (root / "memory" / "memory.limit_in_bytes").write_text("536870912")
    assert cgroup.memory_limit(root) == 536870912


def test_budget_that_does_not_fit_is_refused_with_the_numbers():
    limit = 1 << 30
    cgroup.check_budget(limit - cgroup.OVERHEAD_BYTES, on_host=True, limit=limit)
    cgroup.check_budget(4 << 30, on_host=False, limit=limit)  # GPU memory is not the container's host memory
    cgroup.check_budget(4 << 30, on_host=True, limit=None)
    with pytest.raises(ValueError, match=r"--memory-bytes 1073741824 does not fit under .* limit of 1073741824"):
        cgroup.check_budget(limit, on_host=True, limit=limit)


def test_resize_beyond_the_cgroup_limit_is_refused(sidecar):
    import grpc

    from promptcache.client import PromptCacheClient, errors

    limit = [64 << 20]  # as if the container were limited to 64 MiB
    sidecar.engine.read_memory_limit = lambda: limit[0]
    with PromptCacheClient(sidecar.address) as c:
        with pytest.raises(errors.FailedPrecondition, match="cgroup memory limit of 67108864"):
            c.resize(1 << 30)
        assert c.stats().tiers[0].bytes_budget == sidecar.settings.memory_bytes
        limit[0] = 2 << 30  # a VPA in-place resize raised the limit: read again on the next Resize
        assert c.resize(1 << 30).memory_bytes == 1 << 30
    assert grpc  # imported for the status codes the client maps


def test_serve_refuses_a_budget_over_the_real_limit_when_one_is_set():
    limit = cgroup.memory_limit()
    if limit is None:
        pytest.skip("this machine's cgroup sets no memory limit; the check is covered with laid-out files above")
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "promptcache.cli", "serve", "--memory-bytes", str(limit),
                          "--metrics-port", "0"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "cgroup memory limit" in out.stdout + out.stderr
