"""`ds4 bench serve` against a live server on the built-in tiny model (with MTP speculation): the table, the JSON,
and figures that add up (every request streams exactly --output-len tokens, the counts match, times are ordered)."""

import json

import pytest
from live_server import LiveServer

from ds4.bench import serve as bench_serve
from ds4.engine.async_engine import AsyncEngine
from ds4.engine.engine import LLMEngine
from ds4.serve.app import create_app


@pytest.fixture(scope="module")
def server():
    engine = LLMEngine.from_pretrained(
        device="cpu",
        seed=0,
        max_num_seqs=4,
        max_num_batched_tokens=256,
        kv_cache_memory=64 << 20,
        max_model_len=512,
        speculative_config={"method": "mtp", "num_speculative_tokens": 2},
    )
    live = LiveServer(create_app(AsyncEngine(engine), served_model_names="tiny"))
    yield live, engine
    live.stop()


def test_bench_serve_table_and_json(server, tmp_path, capsys):
    live, engine = server
    out = tmp_path / "serve.json"
    argv = ["--base-url", live.url, "--model", "tiny", "--concurrency", "1,2", "--trials", "2"]
    argv += ["--input-len", "24", "--output-len", "5", "--acceptance-lengths", "1.5,2", "--json", str(out)]
    assert bench_serve.main(argv) == 0
    printed = capsys.readouterr().out
    assert "conc | per-req tok/s | median ITL ms | TTFT p50/p99 ms | aggregate tok/s | failed" in printed
    result = json.loads(out.read_text())
    assert [lv["concurrency"] for lv in result["levels"]] == [1, 2]
    assert [(t["concurrency"], t["num_requests"]) for t in result["trials"]] == [(1, 2), (1, 2), (2, 4), (2, 4)]
    for trial in result["trials"]:
        assert trial["failed"] == 0 and trial["errors"] == []
        assert trial["output_tokens"] == 5 * trial["num_requests"]
        for request in trial["requests"]:
            assert request["ok"] and request["output_tokens"] == 5
            assert 0 < request["ttft_s"] <= request["latency_s"]
            assert sum(request["itl_s"]) <= request["latency_s"] - request["ttft_s"]
        assert trial["ttft_p50_ms"] <= trial["ttft_p99_ms"]
        assert trial["aggregate_tokens_per_s"] == pytest.approx(trial["output_tokens"] / trial["wall_s"])
    for lv in result["levels"]:
        assert lv["failed"] == 0 and lv["aggregate_tokens_per_s"] > 0
        assert lv["implied_tokens_per_s"]["2.0"] == pytest.approx(2000 / lv["median_itl_ms"])
    assert engine.stats().spec_decode.num_drafts > 0


def test_bench_serve_counts_failures(tmp_path):
    """A server that is not there: every request fails, none raises."""
    out = tmp_path / "serve.json"
    argv = ["--base-url", "http://127.0.0.1:9", "--model", "x", "--concurrency", "2", "--trials", "1"]
    argv += ["--input-len", "4", "--output-len", "2", "--timeout", "5", "--json", str(out)]
    assert bench_serve.main(argv) == 0
    trial = json.loads(out.read_text())["trials"][0]
    assert trial["failed"] == trial["num_requests"] == 4 and trial["errors"]
