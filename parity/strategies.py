"""Hypothesis's side of the parity suite: the profiles, and the Draw that feeds an op's samples
(v4train.testing.samples) from hypothesis, so a failing sample shrinks to a small one.

Profiles: `ci` (the default) is deterministic (derandomize, no example database) with 60
examples per test; `wide` draws fresh random examples, 1000 per test, for kernel work; `mutant` is
`ci` without shrinking (a mutation check wants the first failure fast, not its smallest case).
Pick one with V4TRAIN_HYPOTHESIS_PROFILE=wide (Bazel passes the variable through to tests).
"""

from __future__ import annotations

import os

import torch
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st

_COMMON = dict(deadline=None, print_blob=True, database=None,
               suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile("ci", max_examples=60, derandomize=True, **_COMMON)
settings.register_profile("wide", max_examples=1000, derandomize=False, **_COMMON)
settings.register_profile("mutant", max_examples=60, derandomize=True,
                          phases=[Phase.explicit, Phase.reuse, Phase.generate], **_COMMON)
PROFILE = os.environ.get("V4TRAIN_HYPOTHESIS_PROFILE") or "ci"
if PROFILE not in ("ci", "wide", "mutant"):
    raise ValueError(f"V4TRAIN_HYPOTHESIS_PROFILE={PROFILE!r}: expected 'ci', 'wide' or 'mutant'")
settings.load_profile(PROFILE)


class HypothesisDraw:
    """A v4train.testing.samples.Draw on hypothesis's `st.data()`."""

    def __init__(self, data):
        self.data = data

    def integers(self, lo: int, hi: int) -> int:
        return self.data.draw(st.integers(lo, hi))

    def sampled_from(self, options):
        return self.data.draw(st.sampled_from(options))

    def booleans(self) -> bool:
        return self.data.draw(st.booleans())


def devices() -> list[str]:
    """The devices parity runs on: the CPU, and CUDA where there is one."""
    return ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def seeds() -> st.SearchStrategy[int]:
    return st.integers(0, 2**31 - 1)
