"""Fixtures of the operator tests; the harness (control plane, helm, operator subprocesses) is in opharness.py."""
from opharness import *  # noqa: F401,F403  (fixtures and helpers)
