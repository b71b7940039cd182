"""The tree itself: no merge-conflict markers left in any tracked file (golden files included, where a marker
would otherwise only show up as a confusing golden mismatch)."""
from __future__ import annotations

import re
import subprocess
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
