"""`ds4 bench engine` on the built-in tiny model: one row per batch size, the model's time inside each step's."""

import json

import pytest

from ds4.bench import engine


def test_engine_bench_rows_and_json(tmp_path, capsys):
    out = tmp_path / "engine.json"
    argv = ["--device", "cpu", "--batch-sizes", "2,1", "--steps", "3", "--input-len", "8", "--json", str(out)]
    assert engine.main(argv + ["--kv-cache-memory", str(64 << 20), "--page-size", "64"]) == 0
    assert "batch | step ms | model ms" in capsys.readouterr().out
    result = json.loads(out.read_text())
    assert [row["batch"] for row in result["rows"]] == [1, 2]
    for row in result["rows"]:
        # Each step's model time is measured inside that step, so the medians keep the order.
        assert 0 < row["model_ms"] <= row["step_ms"]
        assert row["exposed_ms"] == row["step_ms"] - row["model_ms"]
        assert row["host_ms"] > 0
        # on the CPU the model's calls run on the host: their host time is their time
        assert row["launch_ms"] == row["model_ms"]
        # the logits' call is one of those calls: part of their time, not nothing (a medians' order, step by step)
        assert 0 < row["logits_launch_ms"] <= row["launch_ms"]


def test_engine_bench_profiles_the_host_calls_of_real_steps(capsys):
    argv = ["--device", "cpu", "--batch-sizes", "2", "--steps", "3", "--input-len", "8", "--api-profile", "5"]
    assert engine.main(argv + ["--kv-cache-memory", str(64 << 20), "--page-size", "64"]) == 0
    err = capsys.readouterr().err
    assert "real steps under torch.profiler (3 steps" in err
    # the model's own ops run in those steps: the table lists torch's ops by their own time
    assert "Self CPU" in err and "aten::" in err


def test_engine_bench_refuses_a_cache_too_small_for_its_batch():
    """None of the bench's requests finishes, so one that cannot start with the others would wait forever: the
    bench says so instead (2 requests need two 64-token pages; this budget holds one)."""
    argv = ["--device", "cpu", "--batch-sizes", "2", "--steps", "3", "--input-len", "8", "--page-size", "64"]
    with pytest.raises(SystemExit, match="the cache holds 64 tokens; 2 requests of"):
        engine.main(argv + ["--kv-cache-memory", "370000"])
