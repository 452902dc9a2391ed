"""`ds4 bench mtp` end to end on the CPU with the tiny model (a smoke test: no timings checked), and the bytes its
ceiling counts for a verification."""

import json

from ds4.bench.mtp import verify_bytes
from ds4.bench.roofline import decode_bytes
from ds4.checkpoint.tiny import default_model_dir
from ds4.cli import main
from ds4.config import load_config


def test_bench_mtp_times_every_k_and_batch(tmp_path, capsys):
    out = tmp_path / "mtp.json"
    argv = ["bench", "mtp", "--device", "cpu", "--ks", "0,2", "--batch-sizes", "1,2", "--context", "20"]
    argv += ["--steps", "2", "--kv-cache-memory", str(1 << 26), "--json", str(out)]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    result = json.loads(out.read_text())
    assert [(r["k"], r["batch"]) for r in result["steps"]] == [(0, 2), (0, 1), (2, 2), (2, 1)]
    for row in result["steps"]:
        assert row["context"] >= 20 and row["ms_per_step"] > 0 and row["roofline_ms"] > 0
        assert 1 <= row["tokens_per_step"] <= row["k"] + 1
        # Only acceptance lengths a step of k drafts can reach (at most k + 1; none without drafts).
        assert set(row["implied_tokens_per_s_per_request"]) == ({"1.5", "2.0", "2.5"} if row["k"] else set())
    assert "ms/step" in printed and "@AL 2.5" in printed


def test_a_verification_reads_the_weights_its_tokens_need_and_each_cache_once():
    cfg = load_config(default_model_dir())
    one, four = decode_bytes(cfg, 2, 100, 64, 32), decode_bytes(cfg, 8, 100, 64, 32)
    verify = verify_bytes(cfg, 2, 3, 100, 64, 32)
    assert verify["kv_cache"] == one["kv_cache"] and verify["index_keys"] == one["index_keys"]
    assert verify["experts"] == four["experts"] > one["experts"] and verify["dense"] == four["dense"]
