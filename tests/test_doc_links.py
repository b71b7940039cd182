"""Every relative link of README.md and docs/*.md reaches a file, and every #anchor a heading there
(hack/check-doc-links.py): the README links the docs its sections moved to."""
from __future__ import annotations

import importlib.util
import sys

from support import REPO


def test_relative_links_and_anchors_resolve():
    spec = importlib.util.spec_from_file_location("check_doc_links", REPO / "hack" / "check-doc-links.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    assert module.broken() == []
    # and it does see links: the one from the benchmarks back to the README's headline figures
    assert "../README.md#headline-figures" in module.LINK.findall((REPO / "docs" / "benchmarks.md").read_text())
