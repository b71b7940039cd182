"""Every relative link of README.md and docs/*.md reaches a file, and every #anchor a heading there
(hack/check-doc-links.py): the README links the docs its sections moved to."""
from __future__ import annotations

import importlib.util
import sys

from support import REPO


def _checker():
    spec = importlib.util.spec_from_file_location("check_doc_links", REPO / "hack" / "check-doc-links.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_relative_links_and_anchors_resolve():
    module = _checker()
    assert module.broken() == []
    # and it does see links: the one from the benchmarks back to the README's headline figures
    assert "../README.md#headline-figures" in module.LINK.findall((REPO / "docs" / "benchmarks.md").read_text())


def test_a_missing_file_and_a_missing_anchor_are_reported(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text("# Real heading\n")
    (tmp_path / "README.md").write_text("[ok](docs/a.md#real-heading) [gone](docs/b.md) [bad](docs/a.md#other)\n"
                                        "```\n[in code](nowhere.md)\n```\n")
    problems = _checker().broken(tmp_path)
    assert len(problems) == 2
    assert "(docs/b.md): no such file" in problems[0]
    assert "(docs/a.md#other): no heading" in problems[1]
