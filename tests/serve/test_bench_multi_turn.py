"""`ds4 bench serve --multi-turn` against live servers on the built-in tiny model, prefix caching on and off: the
table, the JSON, conversations that grow by each answer, and a hit rate read from /metrics that is positive with
caching and zero without (and whose token counts match the prompts the server reported in its usage)."""

import json

import pytest
from live_server import LiveServer

from ds4.bench import serve as bench_serve
from ds4.engine.async_engine import AsyncEngine
from ds4.engine.engine import LLMEngine
from ds4.serve.app import create_app

TURNS, OUTPUT_LEN = 3, 4


@pytest.fixture(scope="module", params=[True, False], ids=["caching", "no-caching"])
def server(request):
    engine = LLMEngine.from_pretrained(
        device="cpu",
        seed=0,
        max_num_seqs=4,
        max_num_batched_tokens=256,
        kv_cache_memory=64 << 20,
        max_model_len=1024,
        page_size=16,
        enable_prefix_caching=request.param,
    )
    live = LiveServer(create_app(AsyncEngine(engine), served_model_names="tiny"))
    yield live, request.param
    live.stop()


def test_multi_turn_table_json_and_hit_rate(server, tmp_path, capsys):
    live, caching = server
    out = tmp_path / "multi.json"
    argv = ["--base-url", live.url, "--model", "tiny", "--multi-turn", "--concurrency", "2", "--turns", str(TURNS)]
    argv += ["--system-prompt-len", "32", "--num-tools", "1", "--user-turn-len", "8", "--output-len", str(OUTPUT_LEN)]
    assert bench_serve.main(argv + ["--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "turn | prompt tokens p50 | TTFT p50/p99 ms | decode tok/s | failed" in printed
    assert "prefix-cache hit rate" in printed and "history share" in printed
    (level,) = json.loads(out.read_text())["levels"]
    assert level["clients"] == 2 and level["failed"] == 0 and level["errors"] == []
    assert [(t["turn"], t["num_requests"], t["failed"]) for t in level["turns"]] == [(1, 2, 0), (2, 2, 0), (3, 2, 0)]
    for t in level["turns"]:
        assert t["ttft_p50_ms"] <= t["ttft_p99_ms"]
    prompt_tokens = 0
    for conversation in level["conversations"]:
        assert [r["turn"] for r in conversation] == [1, 2, 3]
        for previous, r in zip(conversation, conversation[1:]):
            # The next prompt holds the previous one, the answer and a new user message of 8 words.
            assert r["prompt_tokens"] >= previous["prompt_tokens"] + OUTPUT_LEN + 8
        for r in conversation:
            assert r["ok"] and r["output_tokens"] == OUTPUT_LEN and 0 < r["ttft_s"] <= r["latency_s"]
            prompt_tokens += r["prompt_tokens"]
    assert 0.5 < level["history_share"] < 1
    cache = level["prefix_cache"]
    assert cache["metric"] == "ds4_prefix_cache"
    if caching:
        # Every admitted prompt is looked up once; the last token of each always runs.
        assert cache["queried_tokens"] == prompt_tokens
        assert 0 < cache["hit_tokens"] <= prompt_tokens - 2 * TURNS
        assert cache["hit_rate"] == pytest.approx(cache["hit_tokens"] / prompt_tokens)
    else:
        assert cache["hit_tokens"] == 0 and cache["hit_rate"] == 0


def test_multi_turn_without_a_server(tmp_path):
    """Nothing listens: every conversation fails at its first turn, no hit rate is claimed, nothing raises."""
    out = tmp_path / "multi.json"
    argv = ["--base-url", "http://127.0.0.1:9", "--model", "x", "--multi-turn", "--concurrency", "2", "--turns", "3"]
    argv += ["--system-prompt-len", "8", "--user-turn-len", "4", "--output-len", "2", "--timeout", "5"]
    assert bench_serve.main(argv + ["--json", str(out)]) == 0
    (level,) = json.loads(out.read_text())["levels"]
    assert level["prefix_cache"] is None and level["failed"] == 2 * 3 and level["errors"]
    assert [len(conversation) for conversation in level["conversations"]] == [1, 1]
