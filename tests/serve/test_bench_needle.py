"""`ds4 bench needle` plumbing on the built-in tiny model: prompts of the asked sizes with the needle where asked,
through a live server, scored and tabled (random weights recall nothing; a scripted answer is scored by hand)."""

import json

import pytest
from live_server import LiveServer

from ds4.bench import needle
from ds4.engine.async_engine import AsyncEngine
from ds4.engine.engine import LLMEngine
from ds4.serve.app import create_app


def test_needle_sits_at_its_depth_on_a_sentence_boundary():
    haystack = needle.default_haystack()
    assert len(haystack) > 100_000  # CPython's documentation topics
    for depth in (0.0, 0.3, 0.7, 1.0):
        prompt = needle.build_prompt(haystack, 20_000, depth, "NEEDLE.")
        at = prompt.index("NEEDLE.")
        assert len(prompt) == 20_000 + len("NEEDLE. ")
        assert abs(at - depth * 20_000) < 2_000
        assert at == 0 or prompt[at - 2 : at] == ". " or depth == 1.0
    short = needle.build_prompt("One. Two. ", 35, 0.5, "X.")
    assert short.replace("X. ", "") == ("One. Two. " * 4)[:35]


@pytest.fixture(scope="module")
def server():
    engine = LLMEngine.from_pretrained(
        device="cpu", seed=0, max_num_seqs=4, max_num_batched_tokens=512, kv_cache_memory=64 << 20, max_model_len=2048
    )
    live = LiveServer(create_app(AsyncEngine(engine), served_model_names="tiny"))
    yield live
    live.stop()


def test_needle_bench_through_a_live_server(server, tmp_path, capsys):
    out = tmp_path / "needle.json"
    argv = ["--base-url", server.url, "--model", "tiny", "--lengths", "256,1k", "--depths", "0,0.5,1"]
    argv += ["--max-tokens", "4", "--extra-body", '{"chat_template_kwargs": {"thinking": false}}', "--json", str(out)]
    assert needle.main(argv) == 0
    assert "length | prompt tokens | depth 0 | depth 0.5 | depth 1 | recall | failed" in capsys.readouterr().out
    result = json.loads(out.read_text())
    assert len(result["requests"]) == 6
    for request in result["requests"]:
        assert request["ok"]
        # ~4 characters a token: the server's count lands near the asked length (plus the question and template).
        assert 0.6 * request["length"] < request["prompt_tokens"] < 1.6 * request["length"] + 64


def test_scoring_counts_the_number_in_the_answer(monkeypatch):
    answers = iter(["It is 12345.", "no idea", "12345"])
    monkeypatch.setattr(needle, "_ask", lambda *a: {"ok": True, "prompt_tokens": 9, "content": next(answers)})
    monkeypatch.setattr(needle.random.Random, "randrange", lambda self, a, b: 12345)
    args = needle.argparse.Namespace(
        seed=0,
        base_url="http://x",
        api_key=None,
        model="m",
        trials=1,
        chars_per_token=4.0,
        max_tokens=4,
        timeout=1.0,
        count_reasoning=False,
    )
    result = needle.run(args, [100], [0.0, 0.5, 1.0], "A. B. C. ", {})
    assert [r["hit"] for r in result["requests"]] == [True, False, True]
    assert "1/1 |       0/1 |     1/1 |   0.67" in needle.table(result)
