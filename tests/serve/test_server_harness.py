"""What evaluation harnesses need from the live server (built-in tiny model): `echo` with prompt logprobs in
OpenAI's legacy format, equal to the engine's own prompt logprobs; several prompts and n choices, seeded choice j
reproducible on its own; and the exact request shapes lm-evaluation-harness sends (written from its
`lm_eval/models/openai_completions.py` and `api_models.py`), parsed the way lm-eval parses them.
"""

import json

import httpx
import pytest
from live_server import LiveServer

from ds4.engine.async_engine import AsyncEngine
from ds4.engine.engine import LLMEngine
from ds4.engine.sampling_params import SamplingParams
from ds4.serve.app import create_app
from ds4.tokenizer import EOS_TEXT

IDS_A = [0, 5, 9, 13, 200, 3000, 77]
IDS_B = [0, 4242, 17]
TEXT = "The quick brown fox"
TOP = 2


def _engine_prompt_logprobs(engine, prompt_ids):
    """The engine's own prompt logprobs: one TokenLogprobs per prompt token, None first."""
    engine.add_request("oracle", prompt_ids, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=TOP))
    found = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            found = out.prompt_logprobs or found
    return found


@pytest.fixture(scope="module")
def served():
    engine = LLMEngine.from_pretrained(
        device="cpu", seed=0, max_num_seqs=8, max_num_batched_tokens=512, kv_cache_memory=64 << 20, max_model_len=512
    )
    tokenizer = engine.tokenizer
    text_ids = [tokenizer.special.bos] + tokenizer.encode(TEXT)
    oracle = {tuple(ids): _engine_prompt_logprobs(engine, ids) for ids in (IDS_A, IDS_B, text_ids)}
    live = LiveServer(create_app(AsyncEngine(engine), served_model_names="tiny"))
    yield live, tokenizer, oracle
    live.stop()


def post(served, path, body):
    response = httpx.post(served[0].url + path, json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def stream(served, path, body):
    """The data events of a streamed response, [DONE] checked and dropped."""
    with httpx.stream("POST", served[0].url + path, json={**body, "stream": True}, timeout=120) as response:
        assert response.status_code == 200, response.read()
        events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def assert_matches_engine(logprobs, tokenizer, entries, first: int = 0):
    """Legacy logprobs of the prompt part against the engine's entries (from prompt position `first`)."""
    shown = entries[first:]
    for i, entry in enumerate(shown):
        if entry is None:
            assert logprobs["token_logprobs"][i] is None and logprobs["top_logprobs"][i] is None
            continue
        assert logprobs["tokens"][i] == tokenizer.decode([entry.token_id])
        assert logprobs["token_logprobs"][i] == pytest.approx(entry.logprob, abs=1e-4)
        top = logprobs["top_logprobs"][i]
        assert len(top) == TOP
        for token_id, value in entry.top.items():
            assert top[tokenizer.decode([token_id])] == pytest.approx(value, abs=1e-4)


@pytest.mark.parametrize("max_tokens", [0, 1, 3])
def test_echo_of_token_prompts_carries_the_engines_prompt_logprobs(served, max_tokens):
    _, tokenizer, oracle = served
    body = {"prompt": [IDS_A, IDS_B], "echo": True, "logprobs": TOP, "max_tokens": max_tokens, "temperature": 0}
    reply = post(served, "/v1/completions", body)
    assert [c["index"] for c in reply["choices"]] == [0, 1]
    for ids, choice in zip((IDS_A, IDS_B), reply["choices"]):
        logprobs = choice["logprobs"]
        assert len(logprobs["tokens"]) == len(ids) + max_tokens
        assert logprobs["token_logprobs"][0] is None  # nothing precedes the first token
        assert_matches_engine(logprobs, tokenizer, oracle[tuple(ids)])
        assert choice["text"].startswith(tokenizer.decode(ids))
        offsets = logprobs["text_offset"]
        assert offsets[0] == 0 and offsets == sorted(offsets)
        if max_tokens:  # the generated tokens' offsets continue after the echoed prompt
            assert offsets[len(ids)] == len(tokenizer.decode(ids))
        if max_tokens == 0:
            assert choice["text"] == tokenizer.decode(ids) and choice["finish_reason"] == "length"
    assert reply["usage"] == {
        "prompt_tokens": len(IDS_A) + len(IDS_B),
        "completion_tokens": 2 * max_tokens,
        "total_tokens": len(IDS_A) + len(IDS_B) + 2 * max_tokens,
    }


def test_echo_of_a_text_prompt_lists_the_texts_own_tokens(served):
    _, tokenizer, oracle = served
    reply = post(served, "/v1/completions", {"prompt": TEXT, "echo": True, "logprobs": TOP, "max_tokens": 0})
    choice = reply["choices"][0]
    assert choice["text"] == TEXT
    text_ids = tokenizer.encode(TEXT)
    assert choice["logprobs"]["tokens"] == [tokenizer.decode([t]) for t in text_ids]
    # The BOS ds4 puts in front is not listed: the text's first token has its logprob after BOS.
    assert None not in choice["logprobs"]["token_logprobs"]
    assert_matches_engine(choice["logprobs"], tokenizer, oracle[(tokenizer.special.bos, *text_ids)], first=1)
    assert reply["usage"]["prompt_tokens"] == len(text_ids) + 1


def test_echo_without_logprobs_and_streamed_echo_equals_the_whole_answer(served):
    body = {"prompt": [IDS_A], "echo": True, "logprobs": 1, "max_tokens": 4, "temperature": 0}
    whole = post(served, "/v1/completions", body)["choices"][0]
    chunks = stream(served, "/v1/completions", body)
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole["text"]
    streamed = {key: [] for key in whole["logprobs"]}
    for chunk in chunks:
        for key, values in (chunk["choices"][0]["logprobs"] or {}).items():
            streamed[key] += values
    assert streamed["token_logprobs"] == pytest.approx(whole["logprobs"]["token_logprobs"], abs=1e-4)
    assert (streamed["tokens"], streamed["text_offset"]) == (
        whole["logprobs"]["tokens"],
        whole["logprobs"]["text_offset"],
    )
    plain = post(served, "/v1/completions", {**body, "logprobs": None})["choices"][0]
    assert plain["text"] == whole["text"] and plain["logprobs"] is None


def test_seeded_choices_are_reproducible_one_by_one(served):
    body = {"prompt": "Once upon a time", "n": 3, "seed": 5, "temperature": 1.0, "max_tokens": 6}
    reply = post(served, "/v1/completions", body)
    assert [c["index"] for c in reply["choices"]] == [0, 1, 2]
    for j, choice in enumerate(reply["choices"]):
        alone = post(served, "/v1/completions", {**body, "n": 1, "seed": 5 + j})["choices"][0]
        assert choice["text"] == alone["text"]
    assert len({c["text"] for c in reply["choices"]}) > 1
    assert reply["usage"]["completion_tokens"] == 18


def test_prompt_lists_times_n_index_choices_prompt_major(served):
    prompts = ["a b", "c d e"]
    body = {"prompt": prompts, "n": 2, "seed": 1, "temperature": 1.0, "max_tokens": 3}
    reply = post(served, "/v1/completions", body)
    assert [c["index"] for c in reply["choices"]] == [0, 1, 2, 3]
    for p, prompt in enumerate(prompts):
        alone = post(served, "/v1/completions", {**body, "prompt": prompt})
        assert [c["text"] for c in reply["choices"][2 * p : 2 * p + 2]] == [c["text"] for c in alone["choices"]]
    prompt_tokens = sum(post(served, "/tokenize", {"prompt": p})["count"] for p in prompts)
    assert reply["usage"]["prompt_tokens"] == prompt_tokens and reply["usage"]["completion_tokens"] == 12


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_streamed_choices_interleave_by_index_and_equal_the_whole_answer(served, path):
    body = {"n": 3, "seed": 2, "temperature": 1.0, "max_tokens": 5, "stream_options": {"include_usage": True}}
    if path == "/v1/completions":
        body["prompt"] = "Hello"
    else:
        body |= {"messages": [{"role": "user", "content": "Hello"}], "chat_template_kwargs": {"thinking": False}}
    whole = post(served, path, body)
    chunks = stream(served, path, body)
    texts, finishes, order = {}, {}, []
    for chunk in chunks[:-1]:
        (choice,) = chunk["choices"]
        index = choice["index"]
        order.append(index)
        piece = choice["text"] if "text" in choice else choice["delta"].get("content") or ""
        texts[index] = texts.get(index, "") + piece
        if choice["finish_reason"]:
            finishes[index] = choice["finish_reason"]
    assert set(order) == {0, 1, 2} and order != sorted(order)  # interleaved, not one choice after another
    assert finishes == {0: "length", 1: "length", 2: "length"}
    for choice in whole["choices"]:
        expected = choice["text"] if "text" in choice else choice["message"]["content"]
        assert texts[choice["index"]] == expected
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == whole["usage"]
    assert whole["usage"]["completion_tokens"] == 15


def test_chat_seeded_choices_are_reproducible_one_by_one(served):
    body = {"messages": [{"role": "user", "content": "Hi"}], "n": 2, "seed": 9, "temperature": 1.0, "max_tokens": 5}
    reply = post(served, "/v1/chat/completions", body)
    for j, choice in enumerate(reply["choices"]):
        alone = post(served, "/v1/chat/completions", {**body, "n": 1, "seed": 9 + j})["choices"][0]
        assert choice["message"] == alone["message"] and choice["index"] == j


# lm-eval's requests, field for field.


def test_lm_eval_remote_tokenizer_endpoints(served):
    _, tokenizer, _ = served
    info = httpx.get(served[0].url + "/tokenizer_info").json()
    assert info["eos_token"] == EOS_TEXT and isinstance(info["bos_token"], str)
    # RemoteTokenizer.encode, and eos_token_id = encode(eos_token)[0]
    tokens = post(served, "/tokenize", {"prompt": info["eos_token"], "add_special_tokens": False})["tokens"]
    assert tokens == [tokenizer.special.eos]
    tokens = post(served, "/tokenize", {"prompt": "test", "add_special_tokens": False})["tokens"]
    assert tokens == tokenizer.encode("test")
    assert post(served, "/detokenize", {"tokens": tokens})["prompt"] == "test"


def _lm_eval_loglikelihood(outputs, ctxlens):
    """lm-eval's LocalCompletionsAPI.parse_logprobs, restated."""
    results = []
    for choice, ctxlen in zip(sorted(outputs["choices"], key=lambda c: c["index"]), ctxlens):
        continuation = choice["logprobs"]["token_logprobs"][ctxlen:-1]
        tops = choice["logprobs"]["top_logprobs"][ctxlen:-1]
        results.append((sum(continuation), all(lp == max(top.values()) for lp, top in zip(continuation, tops))))
    return results


def test_lm_eval_loglikelihood_request_tokenized_batch(served):
    _, _, oracle = served
    contexts, continuations = [IDS_A[:4], IDS_B[:1]], [IDS_A[4:], IDS_B[1:]]
    payload = {
        "model": "tiny",
        "prompt": [c + k for c, k in zip(contexts, continuations)],
        "temperature": 0,
        "max_tokens": 1,
        "logprobs": 1,
        "seed": 1234,
        "echo": True,
    }
    results = _lm_eval_loglikelihood(post(served, "/v1/completions", payload), [len(c) for c in contexts])
    for (total, is_greedy), ids, ctxlen in zip(results, (IDS_A, IDS_B), [4, 1]):
        entries = oracle[tuple(ids)][ctxlen:]
        assert total == pytest.approx(sum(e.logprob for e in entries), abs=1e-3)
        assert is_greedy == all(e.logprob >= max(e.top.values()) - 1e-6 for e in entries)


@pytest.mark.parametrize("batched", [False, True])
def test_lm_eval_loglikelihood_request_as_text(served, batched):
    """tokenized_requests=False: the prompt is the decoded text (one string, or a list when batched);
    ctxlen comes from lm-eval's own tokenizer (here: /tokenize without special tokens)."""
    _, tokenizer, oracle = served
    context, continuation = "The quick", " brown fox"
    assert context + continuation == TEXT
    payload = {
        "model": "tiny",
        "prompt": [TEXT, TEXT] if batched else TEXT,
        "temperature": 0,
        "max_tokens": 1,
        "logprobs": 1,
        "seed": 1234,
        "echo": True,
    }
    ctxlen = len(post(served, "/tokenize", {"prompt": context, "add_special_tokens": False})["tokens"])
    results = _lm_eval_loglikelihood(post(served, "/v1/completions", payload), [ctxlen] * (2 if batched else 1))
    entries = oracle[(tokenizer.special.bos, *tokenizer.encode(TEXT))][1 + ctxlen :]
    for total, _ in results:
        assert total == pytest.approx(sum(e.logprob for e in entries), abs=1e-3)


def test_lm_eval_generate_until_completions_request(served):
    _, tokenizer, _ = served
    prompt_ids = tokenizer.encode("Question: 2 + 2 = ?\nAnswer:")
    payload = {
        "prompt": [prompt_ids],
        "model": "tiny",
        "max_tokens": 8,
        "temperature": 0,
        "stop": ["\n\n", "Question:", EOS_TEXT],
        "seed": 1234,
    }
    reply = post(served, "/v1/completions", payload)
    texts = [None] * len(reply["choices"])
    for choice in reply["choices"]:  # parse_generations
        texts[choice["index"]] = choice["text"]
    assert len(texts) == 1 and isinstance(texts[0], str)
    assert reply["choices"][0]["finish_reason"] in ("stop", "length")


def test_lm_eval_generate_until_chat_request(served):
    payload = {
        "messages": [{"role": "user", "content": "Question: 2 + 2 = ?\nAnswer:"}],
        "model": "tiny",
        "max_tokens": 8,
        "temperature": 0,
        "stop": ["\n\n", "Question:"],
        "seed": 1234,
        "chat_template_kwargs": {"thinking": False},  # from the task's generation_kwargs
    }
    reply = post(served, "/v1/chat/completions", payload)
    assert [c["index"] for c in reply["choices"]] == [0]
    assert isinstance(reply["choices"][0]["message"]["content"], str)
