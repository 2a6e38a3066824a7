"""Comparing a run's metrics with metrics recorded by another machine (test fixtures).

XLA:CPU compiles for the CPU it runs on (vector width, AMX / AVX-512 paths), so float sums round differently on
another CPU kind: a fixture recorded on one machine is bit-for-bit only there (measured: the tiny GRPO step-2
`actor/ppo_kl` 0.0014295095 recorded, 0.0014295037 on an AMD EPYC, relative 4e-6; `rollout_corr/chi2_seq`
-1.13e-06 recorded, -5.96e-08 there: a difference of near-equal sums). `assert_recorded` checks every
key and every non-float value exactly and every float to a relative 2e-5, and says whether all of them were equal
bit for bit, (a params digest does not survive another CPU even when every metric does: the supervised trainers' step-2
metrics were equal bit for bit on the AMD EPYC and their final params' digests were not)."""

from __future__ import annotations

import math

RTOL, ATOL = 2e-5, 5e-6  # ATOL: metrics that are differences of near-equal sums (rollout_corr/chi2_*)


def assert_recorded(got: dict, want: dict, where: str = "") -> bool:
    """Assert `got` matches the recorded `want`: the same keys, non-floats equal, floats within RTOL relative
    (ATOL near zero). Returns True when every value is equal bit for bit."""
    assert sorted(got) == sorted(want), f"{where}: keys differ: {sorted(set(got) ^ set(want))}"
    exact = True
    for k, w in want.items():
        g = got[k]
        if isinstance(w, float) or isinstance(g, float):
            ok = math.isclose(g, w, rel_tol=RTOL, abs_tol=ATOL) or (math.isnan(g) and math.isnan(w))
            assert ok, f"{where}: {k} = {g!r}, recorded {w!r}"
            exact = exact and (g == w or (math.isnan(g) and math.isnan(w)))
        else:
            assert g == w, f"{where}: {k} = {g!r}, recorded {w!r}"
    return exact
