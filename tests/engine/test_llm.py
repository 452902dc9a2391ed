"""The offline API end to end: the official-format tiny checkpoint through `LLM` against transformers reading
the same model from its hf-format twin (which holds exactly the dequantised official weights)."""

import pytest
import torch
import transformers

from ds4 import LLM, SamplingParams
from ds4.checkpoint.tiny import make_tiny

PROMPT = [0, 9906, 11, 1917, 0, 128803, 3923, 374, 279, 6864, 315, 9822, 30, 128804, 128822, 791, 6864, 315]


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    official = make_tiny(root / "official", format="official", seed=3)
    hf = make_tiny(root / "hf", format="hf", seed=3)
    oracle = transformers.DeepseekV4ForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    return LLM(official, device="cpu", dtype="float32"), LLM(hf, device="cpu", dtype="float32"), oracle


def _oracle_log_probs(oracle, ids):
    with torch.no_grad():
        return torch.log_softmax(oracle(torch.tensor([ids])).logits[0].double(), dim=-1)


def test_prompt_logprobs_equal_transformers(tiny_models):
    llm, _, oracle = tiny_models
    out = llm.generate([PROMPT], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=3), use_tqdm=False)[0]
    expected = _oracle_log_probs(oracle, PROMPT)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(PROMPT)
    for pos in range(1, len(PROMPT)):
        got = out.prompt_logprobs[pos]
        row = expected[pos - 1]
        top = set(torch.topk(row, 3).indices.tolist()) | {PROMPT[pos]}
        assert set(got) == top, pos
        for token_id, logprob in got.items():
            assert abs(logprob - row[token_id].item()) < 1e-3, (pos, token_id)


def test_official_and_hf_formats_give_the_same_logits(tiny_models):
    official_llm, hf_llm, _ = tiny_models
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=5)
    official = official_llm.generate([PROMPT], params, use_tqdm=False)[0].prompt_logprobs
    hf = hf_llm.generate([PROMPT], params, use_tqdm=False)[0].prompt_logprobs
    assert official == hf


def test_greedy_generation_equals_transformers_argmax(tiny_models):
    llm, _, oracle = tiny_models
    out = llm.generate([PROMPT], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True), use_tqdm=False)[0]
    ids = list(PROMPT)
    for _ in range(12):
        ids.append(int(_oracle_log_probs(oracle, ids)[-1].argmax()))
    assert out.token_ids == ids[len(PROMPT) :]
    assert out.finish_reason == "length"
    assert out.text == llm.tokenizer.decode(out.token_ids, skip_special_tokens=True)


def test_text_and_token_prompts_and_seeded_sampling(tiny_models):
    llm, _, _ = tiny_models
    text = "The capital of France is"
    params = SamplingParams(max_tokens=6, temperature=1.0, seed=7, logprobs=2)
    by_text, by_ids, other = llm.generate(
        [text, llm.tokenizer.encode(text), "Something else entirely"],
        [params, params, SamplingParams(max_tokens=3, seed=1)],
        use_tqdm=False,
    )
    assert by_text.prompt_token_ids == by_ids.prompt_token_ids
    assert by_text.token_ids == by_ids.token_ids and len(by_text.token_ids) == 6
    assert all(len(lp) in (2, 3) and tok in lp for lp, tok in zip(by_text.logprobs, by_text.token_ids))
    with pytest.raises(ValueError):
        llm.generate([text, text], [params])
