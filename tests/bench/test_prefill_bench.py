"""`ds4 bench prefill` on the built-in tiny model: lengths that fit run, the rest are reported skipped, and the
profile splits the time over the model's parts (hand-checkable: every part of the tiny model does work)."""

import json

import pytest

from ds4.bench import prefill
from ds4.bench.lengths import parse_length


def test_parse_length():
    assert [parse_length(x) for x in ("512", "8k", "1m", "2K")] == [512, 8192, 1 << 20, 2048]
    for bad in ("", "k", "0", "1.5k", "-3"):
        with pytest.raises(ValueError):
            parse_length(bad)


def test_prefill_bench_table_json_and_profile(tmp_path, capsys):
    out = tmp_path / "prefill.json"
    argv = ["--device", "cpu", "--lengths", "64,32,2k", "--profile", "--max-model-len", "1024", "--page-size", "64"]
    argv += ["--kv-cache-memory", str(64 << 20), "--max-num-seqs", "2", "--json", str(out)]
    assert prefill.main(argv) == 0
    assert "length | TTFT ms | prefill tok/s | scaling" in capsys.readouterr().out
    result = json.loads(out.read_text())
    assert [row["length"] for row in result["rows"]] == [32, 64] and result["skipped_lengths"] == [2048]
    for row in result["rows"]:
        assert row["prefill_tokens_per_s"] == pytest.approx(row["length"] / row["ttft_s"])
        shares = row["profile"]
        assert sum(shares.values()) == pytest.approx(100)
        for part in ("indexer", "top-k", "attention", "MoE", "GEMMs", "mHC", "compressor", "norms"):
            assert shares[part] > 0, part
