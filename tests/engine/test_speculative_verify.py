"""Verification of drafts in isolation: random requests keep their target distribution, greedy ones its argmax,
and a grammar sees a draft window position by position, `</think>` inside it included, and only what is kept.
"""

import pytest
import torch
from test_structured_output import EOS, THINK_END, USER, allowed, new_state
from tool_schemas import BOUNDED

from ds4.engine.sampler import Sampler
from ds4.engine.sampling_params import SamplingParams
from ds4.engine.speculative import verify
from ds4.engine.structured_output import GrammarCache, GrammarSpec, grammar_tokenizer_info

# chi-square critical values at a false-alarm rate of 1e-3 per test, by degrees of freedom (scipy.stats.chi2.ppf).
CHI2_999 = {3: 16.266, 4: 18.467, 5: 20.515, 6: 22.458, 7: 24.322}
TRIALS = 6000


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    """Pearson's statistic over the cells of nonzero probability, and its degrees of freedom."""
    cells = probs > 0
    expected = probs[cells] * counts.sum()
    return float(((counts[cells] - expected) ** 2 / expected).sum()), int(cells.sum()) - 1


def test_random_verification_keeps_the_target_distribution():
    """Two drafts on an 8-token vocabulary, temperature 0.8 and top_k 6: the first kept token follows the first
    row's target distribution, the second (where the first draft was kept) the second row's."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 8, generator=gen) * 1.5
    drafts = [int(logits[0].argmax()), 5]  # a likely first draft, an arbitrary second
    params = SamplingParams(temperature=0.8, top_k=6, max_tokens=100)
    # The oracle: softmax of logits / T over the 6 largest logits of each row.
    scaled = logits / 0.8
    kth = scaled.topk(6, dim=-1).values[:, -1:]
    target = scaled.masked_fill(scaled < kth, float("-inf")).softmax(dim=-1).double()
    sampler = Sampler(eos_token_ids=(7,), seed=1)
    request = sampler.new_request(params, [1, 2, 3])
    first, second = torch.zeros(8, dtype=torch.float64), torch.zeros(8, dtype=torch.float64)
    kept_first_draft = 0
    for _ in range(TRIALS):
        tokens = verify(sampler, logits, [request], [drafts])[0]
        first[tokens[0]] += 1
        if tokens[0] == drafts[0]:
            kept_first_draft += 1
            second[tokens[1]] += 1
    for counts, probs in ((first, target[0]), (second, target[1])):
        assert counts[probs == 0].sum() == 0  # never a token the target forbids
        stat, dof = chi_square(counts, probs)
        assert stat < CHI2_999[dof], (stat, dof, counts, probs)
    # Acceptance itself is p(draft): within 4 standard deviations of a binomial.
    p = target[0, drafts[0]].item()
    assert abs(kept_first_draft - TRIALS * p) < 4 * (TRIALS * p * (1 - p)) ** 0.5


def test_greedy_verification_keeps_drafts_while_they_are_the_argmax():
    logits = torch.full((4, 10), -1.0)
    for row, token in enumerate([3, 4, 9, 2]):
        logits[row, token] = 5.0
    sampler = Sampler(eos_token_ids=(0,))
    request = sampler.new_request(SamplingParams(temperature=0), [1])
    assert verify(sampler, logits, [request], [[3, 4, 9]]) == [[3, 4, 9, 2]]  # all kept, plus the bonus token
    assert verify(sampler, logits, [request], [[3, 5, 9]]) == [[3, 4]]  # cut at the second
    assert verify(sampler, logits[:1], [request], [[]]) == [[3]]


def test_seeded_random_verification_is_reproducible():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(2))
    runs = []
    for _ in range(2):
        sampler = Sampler(eos_token_ids=(0,), seed=5)
        request = sampler.new_request(SamplingParams(temperature=1.0, seed=77), [1])
        runs.append([verify(sampler, logits, [request], [[4, 9]])[0] for _ in range(20)])
    assert runs[0] == runs[1]


@pytest.fixture(scope="module")
def grammars():
    from tokenizers import Tokenizer

    from ds4.tokenizer import default_tokenizer_path

    tokenizer = Tokenizer.from_file(str(default_tokenizer_path()))
    cache = GrammarCache(grammar_tokenizer_info(tokenizer, 129280, EOS))
    yield cache, tokenizer
    cache.close()


def _favouring(rows: list[list[int]], vocab: int = 129280) -> torch.Tensor:
    """Logits whose row j ranks rows[j]'s tokens first, second, ...; everything else far below."""
    logits = torch.zeros(len(rows), vocab)
    for j, tokens in enumerate(rows):
        for rank, token in enumerate(tokens):
            logits[j, token] = 50.0 - 10 * rank
    return logits


def test_think_end_inside_a_draft_window(grammars):
    """Drafts: a reasoning token, </think>, '{', then a control token the grammar forbids. The grammar masks only
    the positions after </think>; the forbidden draft is cut and the target's best allowed token replaces it;
    afterwards the grammar holds exactly the kept tokens."""
    cache, tokenizer = grammars
    spec = GrammarSpec.json_schema(BOUNDED)
    state = new_state(cache, spec, reasoning=True)
    sampler = Sampler(eos_token_ids=(EOS,))
    request = sampler.new_request(SamplingParams(temperature=0, structured_output=state, max_tokens=50), [1])
    thought = tokenizer.encode("hm", add_special_tokens=False).ids
    for token in thought:
        request.append(token)
    brace, quote = tokenizer.token_to_id("{"), tokenizer.token_to_id('"')
    reasoning = tokenizer.encode(" ok", add_special_tokens=False).ids[0]
    drafts = [reasoning, THINK_END, brace, USER]
    # Row 3 prefers the forbidden USER, then '"' (allowed after '{'), then '}' (not allowed before a key).
    logits = _favouring([[reasoning], [THINK_END], [brace], [USER, quote, tokenizer.token_to_id("}")], [EOS]])
    kept = verify(sampler, logits, [request], [drafts])[0]
    assert kept == [reasoning, THINK_END, brace, quote]
    # The grammar did not keep the drafts: still in the reasoning, at the tokens the request had.
    assert not state.active and state.num_tokens == len(thought) and not state.failed
    for token in kept:
        request.append(token)
    reference = new_state(cache, spec, reasoning=True)
    assert all(reference.accept(t) for t in thought + kept)
    state.sync(request.output_token_ids)
    assert state.active and allowed(state) == allowed(reference)


def test_think_end_draft_rejected_keeps_the_reasoning_open(grammars):
    cache, tokenizer = grammars
    state = new_state(cache, GrammarSpec.json_schema(BOUNDED), reasoning=True)
    sampler = Sampler(eos_token_ids=(EOS,))
    request = sampler.new_request(SamplingParams(temperature=0, structured_output=state, max_tokens=50), [1])
    word = tokenizer.encode(" so", add_special_tokens=False).ids[0]
    brace = tokenizer.token_to_id("{")
    # The target wants more reasoning where the draft ended it; a JSON-looking token is fine while reasoning.
    logits = _favouring([[word], [brace], [brace]])
    kept = verify(sampler, logits, [request], [[word, THINK_END]])[0]
    assert kept == [word, brace]
    assert not state.active and not state.failed and state.num_tokens == 0
    for token in kept:
        request.append(token)
    state.sync(request.output_token_ids)
    assert not state.active and allowed(state) is None


def test_grammar_rejected_draft_leaves_no_failure(grammars):
    """A draft the grammar rejects fails the matcher while the window is checked; that must not survive."""
    cache, tokenizer = grammars
    state = new_state(cache, GrammarSpec.json_schema(BOUNDED))
    sampler = Sampler(eos_token_ids=(EOS,))
    request = sampler.new_request(SamplingParams(temperature=0, structured_output=state, max_tokens=50), [1])
    brace, quote = tokenizer.token_to_id("{"), tokenizer.token_to_id('"')
    logits = _favouring([[brace], [USER, quote], [USER]])
    kept = verify(sampler, logits, [request], [[brace, USER]])[0]
    assert kept == [brace, quote]
    assert not state.failed and state.num_tokens == 0
