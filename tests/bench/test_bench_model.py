"""`ds4 bench model` end to end on the CPU with the tiny config and tiny lengths (a smoke test: no timings checked)."""

import json

import pytest

from ds4.bench.profile import FAMILIES
from ds4.cli import main


def test_bench_model_runs_end_to_end_on_dummy_weights(tmp_path, capsys):
    pytest.importorskip("transformers")
    out = tmp_path / "bench.json"
    argv = ["bench", "model", "--load-format", "dummy", "--device", "cpu", "--context", "24"]
    argv += ["--batch-sizes", "1,3", "--prefill-lengths", "20,40", "--prefill-chunk", "16", "--decode-steps", "1"]
    argv += ["--json", str(out), "--plot", str(tmp_path / "decode.svg"), "--compare-transformers"]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    result = json.loads(out.read_text())

    assert [r["batch"] for r in result["decode"]] == [1, 3]
    assert [r["tokens"] for r in result["prefill"]] == [20, 40]
    for row in result["decode"]:
        assert row["context"] >= 24 and row["roofline_ms"] > 0 and row["ratio"] > 0
    weights = result["weights"]
    assert len(weights["resident_per_layer_gb"]) == len(weights["checkpoint_per_layer_gb"]) == 4
    for profile in (result["decode"][-1]["profile"], result["prefill"][0]["profile"]):
        assert set(profile) == {*FAMILIES, "total"}
        assert sum(profile[f]["ms"] for f in FAMILIES) == pytest.approx(profile["total"]["ms"])
        assert profile["GEMMs"]["ms"] > 0 and profile["MoE"]["ms"] > 0 and profile["attention"]["ms"] > 0
    assert [r["batch"] for r in result["transformers"]["decode"]] == [1, 3]
    assert "ms/step" in printed and "x roofline" in printed and "transformers DeepseekV4" in printed
    assert (tmp_path / "decode.svg").read_text().startswith("<svg")


def test_bench_model_names_published_figures_for_the_shipped_configs():
    from ds4.bench.model import PUBLISHED

    sources = [entry[-1] for entries in PUBLISHED.values() for entry in entries]
    assert "SGLang DSv4 benchmark docs" in sources and "LMSYS blog, 2026-04-25" in sources
