"""A/B tests that may be checked at any time: an always-valid sequential test (mSPRT) on the
serving logs, guardrails that stop harm early, and the decision with its evidence."""

from vatra.serve.ab._records import ABConfig, ABResult, Decision, Evidence, Guardrail
from vatra.serve.ab.decide import analyse
from vatra.serve.ab.html import render
from vatra.serve.ab.logs import ABLog, read_log
from vatra.serve.ab.sequential import SequentialStats, sequential_test, z_test_p

__all__ = [
    "ABConfig",
    "ABLog",
    "ABResult",
    "Decision",
    "Evidence",
    "Guardrail",
    "SequentialStats",
    "analyse",
    "read_log",
    "render",
    "sequential_test",
    "z_test_p",
]
