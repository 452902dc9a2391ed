"""`ds4 bench linear`'s fit of the M = 1 kernel's times: a fixed cost a launch plus the weight bytes at a rate."""

import pytest

from ds4.bench.linear import fixed_and_marginal


def test_fit_recovers_a_fixed_cost_and_a_rate():
    # 9 us a launch plus the bytes at 4 TB/s (4e9 bytes a ms)
    rows = [
        {"m": 1, "n": n, "k": k, "triton_ms": 0.009 + n * k / 4e9}
        for n, k in ((32768, 1024), (4096, 2048), (1536, 4096), (4096, 8192))
    ]
    rows.append({"m": 4, "n": 4096, "k": 4096, "triton_ms": 1.0})  # another M: left out
    fixed, rate = fixed_and_marginal(rows)
    assert fixed == pytest.approx(0.009) and rate == pytest.approx(4e9)


def test_fit_needs_two_sizes():
    assert fixed_and_marginal([{"m": 1, "n": 8, "k": 8, "triton_ms": 0.01}]) is None
    assert fixed_and_marginal([{"m": 1, "n": 8, "k": 8, "cublas_ms": 0.01}] * 3) is None
