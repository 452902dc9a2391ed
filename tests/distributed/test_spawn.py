"""The spawn helper: a failing or hung rank fails the call with its rank named, within the timeout, and leaves no
process behind (results in rank order: tests/distributed/test_sharded_model.py)."""

import multiprocessing
import time

import pytest
from spawn import run_ranks


def fail_on_rank_one(parallel):
    if parallel.rank == 1:
        raise ValueError("rank one refuses")
    return parallel.rank


def hang_on_rank_one(parallel):
    if parallel.rank == 1:
        time.sleep(600)
    return parallel.rank


def test_a_failing_rank_is_named_with_its_traceback():
    with pytest.raises(RuntimeError, match="(?s)rank 1 failed.*rank one refuses"):
        run_ranks(fail_on_rank_one, 2)
    assert not multiprocessing.active_children()


def test_a_hung_rank_times_out_and_is_killed():
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"ranks \[(0, )?1\] gave no result"):
        run_ranks(hang_on_rank_one, 2, timeout_s=10)
    assert time.monotonic() - start < 30
    assert not multiprocessing.active_children()
