"""Fixtures of the operator tests; the harness (control plane, helm, operator subprocesses) is in opharness.py."""
from opharness import *  # noqa: F401,F403  (fixtures and helpers)


def pytest_addoption(parser):
    parser.addoption("--closed-loop-plot", default="", help="test_closed_loop writes a PNG of the autoscaler's "
                     "trajectory here (needs matplotlib: promptcache-devtools[plots])")
