"""The container's memory limit, read from its cgroup, so the sidecar never promises more host memory than the
kernel will let it use (an OOM kill throws the whole cache away)."""
from __future__ import annotations

from pathlib import Path

# Room left under the limit for the interpreter, torch, gRPC buffers and chunks in flight.
OVERHEAD_BYTES = 256 << 20


def memory_limit(root: Path = Path("/sys/fs/cgroup")) -> int | None:
    """The cgroup v2 (or v1) memory limit of this process in bytes, or None when unlimited or unknown."""
    candidates = []
    try:
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            if controllers == "":  # v2 unified hierarchy
                candidates.append(root / path.lstrip("/") / "memory.max")
            elif "memory" in controllers.split(","):
                candidates.append(root / "memory" / path.lstrip("/") / "memory.limit_in_bytes")
    except (OSError, ValueError):
        pass
    candidates += [root / "memory.max", root / "memory" / "memory.limit_in_bytes"]
    for path in candidates:
        try:
            text = path.read_text().strip()
        except OSError:
            continue
        if text == "max":
            return None
        try:
            value = int(text)
        except ValueError:
            continue
        return None if value >= 1 << 60 else value  # v1 reports "unlimited" as a huge number
    return None


def check_budget(memory_bytes: int, on_host: bool, limit: int | None, what: str = "--memory-bytes") -> None:
    """Raise ValueError when a host-memory budget does not fit under the cgroup limit with its overhead."""
    if not on_host or limit is None:
        return
    if memory_bytes + OVERHEAD_BYTES > limit:
        raise ValueError(f"{what} {memory_bytes} does not fit under this container's cgroup memory limit of "
                         f"{limit} bytes (with {OVERHEAD_BYTES} bytes left for the process itself): lower it to at "
                         f"most {max(0, limit - OVERHEAD_BYTES)} or raise the container's memory limit")
