"""The sampler against plain per-row references written here, one token and one option at a time."""

import math
from collections import Counter

import pytest
import torch

from ds4.engine.sampler import Sampler, apply_penalties, compute_logprobs, sample_random
from ds4.engine.sampling_params import SamplingParams

EOS = 1


def reference_logits(logits, params, prompt, output):
    """Bias, min_tokens mask and penalties, token by token in float64."""
    x = [float(v) for v in logits]
    for token, bias in params.logit_bias.items():
        x[token] += bias
    if len(output) < params.min_tokens:
        for token in list(params.stop_token_ids) + ([] if params.ignore_eos else [EOS]):
            x[token] = -math.inf
    counts = Counter(output)
    for token in set(prompt) | set(output):
        r = params.repetition_penalty
        x[token] = x[token] / r if x[token] > 0 else x[token] * r
    for token, count in counts.items():
        x[token] -= params.frequency_penalty * count + params.presence_penalty
    return x


def reference_distribution(logits, params, prompt=(), output=()):
    """The probability of each token under temperature, then min_p, then top_k, then top_p."""
    x = [v / params.temperature for v in reference_logits(logits, params, prompt, output)]
    top = max(x)
    weights = [math.exp(v - top) for v in x]
    keep = [w / sum(weights) >= params.min_p * max(weights) / sum(weights) for w in weights]
    order = sorted((i for i in range(len(x)) if keep[i]), key=lambda i: -x[i])
    if params.top_k > 0 and params.top_k < len(order):
        kth = x[order[params.top_k - 1]]
        order = [i for i in order if x[i] >= kth]
    if params.top_p < 1:
        total = sum(weights[i] for i in order)
        mass, kept = 0.0, []
        for i in order:
            if mass >= params.top_p:
                break
            kept.append(i)
            mass += weights[i] / total
        order = kept
    total = sum(weights[i] for i in order)
    return torch.tensor([weights[i] / total if i in order else 0.0 for i in range(len(x))], dtype=torch.float64)


def greedy(**kwargs):
    return SamplingParams(temperature=0.0, max_tokens=100, **kwargs)


def test_greedy_rows_are_the_argmax_of_the_raw_logits():
    sampler = Sampler([EOS], seed=0)
    logits = torch.randn(9, 300, generator=torch.Generator().manual_seed(1))
    requests = [sampler.new_request(greedy() if row % 3 else SamplingParams(seed=row), [5]) for row in range(9)]
    tokens = sampler.sample(logits, requests).token_ids
    greedy_rows = [row for row in range(9) if row % 3]
    assert tokens[greedy_rows].tolist() == [int(torch.argmax(logits[row])) for row in greedy_rows]


@pytest.mark.parametrize(
    "options",
    [
        dict(temperature=0.7),
        dict(temperature=1.3, top_k=3),
        dict(top_p=0.6),
        dict(temperature=0.5, min_p=0.05),
        dict(temperature=0.8, top_k=5, top_p=0.8, min_p=0.02),
        dict(top_p=0.7, logit_bias={3: 2.5, 4: -1.0}),
        dict(temperature=0.9, repetition_penalty=1.5, frequency_penalty=0.4, presence_penalty=-0.3),
    ],
)
def test_random_rows_follow_the_reference_distribution(options):
    vocab, draws = 12, 20000
    logits = torch.randn(vocab, generator=torch.Generator().manual_seed(7)) * 2
    params = SamplingParams(max_tokens=50, **options)
    prompt, output = [2, 3, 3], [5, 3, 5, 5]
    expected = reference_distribution(logits.tolist(), params, prompt, output)
    sampler = Sampler([EOS], seed=3)
    requests = [sampler.new_request(params, prompt) for _ in range(draws)]
    for request in requests:
        for token in output:
            request.append(token)
    tokens = sampler.sample(logits.expand(draws, vocab).contiguous(), requests).token_ids
    observed = torch.bincount(tokens, minlength=vocab).double() / draws
    assert torch.all(observed[expected == 0] == 0), "a filtered-out token was sampled"
    assert (observed - expected).abs().max() < 0.02


class _FixedDraw:
    """A request whose random stream always yields `uniform`: pins the inverse-CDF boundaries."""

    def __init__(self, params, uniform):
        self.params, self.uniform = params, uniform

    def draw_uniform(self):
        return self.uniform


def test_boundaries_of_top_p_min_p_and_the_draw():
    four_equal = torch.zeros(1, 4)  # probabilities exactly 1/4 each
    # top_p = 1/2 is reached by exactly two of four equal tokens: the third is not needed.
    drawn = {int(sample_random(four_equal, [_FixedDraw(SamplingParams(top_p=0.5), u)])) for u in (0.0, 0.3, 0.6, 0.99)}
    assert drawn == {0, 1}
    # min_p = 1 keeps every token tied for the largest probability.
    drawn = {int(sample_random(four_equal, [_FixedDraw(SamplingParams(min_p=1.0), u)])) for u in (0.0, 0.3, 0.6, 0.99)}
    assert drawn == {0, 1, 2, 3}
    # A draw of exactly 0 must not land on a leading token that was filtered out.
    leading_loser = torch.tensor([[0.0, 5.0, 4.0]])
    assert int(sample_random(leading_loser, [_FixedDraw(SamplingParams(top_k=2), 0.0)])) == 1


def _run_steps(sampler, request, companions, position, steps_logits):
    tokens = []
    for step, row_logits in enumerate(steps_logits):
        batch = companions[:position] + [request] + companions[position:]
        others = torch.randn(len(companions), row_logits.shape[0], generator=torch.Generator().manual_seed(step))
        logits = torch.cat([others[:position], row_logits[None], others[position:]])
        token = int(sampler.sample(logits, batch).token_ids[position])
        request.append(token)
        for companion in companions:
            companion.append(0)
        tokens.append(token)
    return tokens


def test_seeded_request_is_reproducible_whatever_shares_its_batch():
    vocab = 64
    steps_logits = [torch.randn(vocab, generator=torch.Generator().manual_seed(100 + s)) for s in range(12)]
    params = SamplingParams(seed=1234, temperature=1.5, top_k=20, top_p=0.9, max_tokens=50)
    alone = _run_steps(Sampler([EOS], seed=0), Sampler([EOS]).new_request(params, [1]), [], 0, steps_logits)

    sampler = Sampler([EOS], seed=99)
    companions = [
        sampler.new_request(p, [4, 5])
        for p in (
            SamplingParams(),
            SamplingParams(seed=1234),
            greedy(),
            SamplingParams(min_p=0.2, frequency_penalty=1.0),
        )
    ]
    for position in (0, 2, 4):
        request = sampler.new_request(params, [1])
        assert _run_steps(sampler, request, companions, position, steps_logits) == alone

    other_seed = SamplingParams(seed=4321, temperature=1.5, top_k=20, top_p=0.9, max_tokens=50)
    assert _run_steps(sampler, sampler.new_request(other_seed, [1]), [], 0, steps_logits) != alone


def test_a_request_draws_the_successive_uniforms_of_its_seeded_generator():
    request = Sampler([EOS]).new_request(SamplingParams(seed=5), [1])
    generator = torch.Generator().manual_seed(5)
    expected = [torch.rand((), dtype=torch.float64, generator=generator).item() for _ in range(150)]
    assert [request.draw_uniform() for _ in range(150)] == expected


def test_all_greedy_and_all_random_batches_give_each_row_its_token_alone():
    vocab = 50
    logits = torch.randn(5, vocab, generator=torch.Generator().manual_seed(3)) * 2
    sampler = Sampler([EOS], seed=0)
    greedy_requests = [sampler.new_request(greedy(), [2]) for _ in range(5)]
    assert sampler.sample(logits, greedy_requests).token_ids.tolist() == logits.argmax(dim=-1).tolist()

    options = [dict(temperature=0.7), dict(top_k=4), dict(top_p=0.8), dict(min_p=0.1), dict(temperature=1.4)]
    batch = [sampler.new_request(SamplingParams(seed=10 + i, **o), [2]) for i, o in enumerate(options)]
    alone = [sampler.new_request(SamplingParams(seed=10 + i, **o), [2]) for i, o in enumerate(options)]
    for _ in range(3):
        together = sampler.sample(logits, batch).token_ids.tolist()
        assert together == [int(sampler.sample(logits[i : i + 1], [r]).token_ids[0]) for i, r in enumerate(alone)]


def test_unseeded_requests_follow_the_sampler_seed():
    logits = torch.zeros(1, 1000)

    def run(seed):
        sampler = Sampler([EOS], seed=seed)
        return [
            int(sampler.sample(logits, [sampler.new_request(SamplingParams(), [1])]).token_ids[0]) for _ in range(5)
        ]

    assert run(5) == run(5)
    assert run(5) != run(6)


def test_min_tokens_holds_back_eos_and_stop_tokens():
    vocab = 20
    logits = torch.zeros(1, vocab)
    logits[0, EOS], logits[0, 7], logits[0, 9] = 30.0, 20.0, 10.0
    sampler = Sampler([EOS])

    def generate(params):
        request = sampler.new_request(params, [3])
        for _ in range(5):
            request.append(int(sampler.sample(logits, [request]).token_ids[0]))
        return request.output_token_ids

    assert generate(greedy(min_tokens=3, stop_token_ids=[7])) == [9, 9, 9, EOS, EOS]
    assert generate(greedy(min_tokens=2, ignore_eos=True)) == [EOS] * 5
    assert generate(greedy()) == [EOS] * 5


def test_logit_bias_moves_greedy_choice_and_rejects_unknown_tokens():
    logits = torch.randn(2, 50, generator=torch.Generator().manual_seed(0))
    sampler = Sampler([EOS])
    requests = [
        sampler.new_request(greedy(logit_bias={"11": 100.0}), [1]),
        sampler.new_request(greedy(logit_bias={int(logits[1].argmax()): -100.0}), [1]),
    ]
    tokens = sampler.sample(logits, requests).token_ids.tolist()
    assert tokens == [11, int(logits[1].topk(2).indices[1])]
    with pytest.raises(ValueError, match="outside the vocabulary"):
        sampler.sample(logits[:1], [sampler.new_request(greedy(logit_bias={50: 1.0}), [1])])


def test_penalties_match_a_token_by_token_reference():
    vocab = 40
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(3, vocab, generator=gen) * 3
    sampler = Sampler([EOS])
    cases = [
        (greedy(repetition_penalty=1.7, frequency_penalty=0.5, presence_penalty=0.25), [1, 2, 2, 30], [2, 5, 5, 5]),
        (greedy(), [3, 4], [4]),
        (greedy(repetition_penalty=0.6, frequency_penalty=-0.7, presence_penalty=1.5), [7], [8, 8, 9, 7]),
    ]
    requests = []
    for params, prompt, output in cases:
        request = sampler.new_request(params, prompt)
        request.append(output[0])
        sampler.sample(logits[:1], [request])  # builds the penalty state, later appends must update it
        for token in output[1:]:
            request.append(token)
        requests.append(request)
    got = apply_penalties(logits, requests)
    for row, (params, prompt, output) in enumerate(cases):
        expected = torch.tensor(reference_logits(logits[row].tolist(), params, prompt, output), dtype=torch.float32)
        torch.testing.assert_close(got[row], expected)
    tokens = sampler.sample(logits, requests).token_ids.tolist()
    assert tokens == [int(torch.argmax(got[row])) for row in range(3)]


def test_logprobs_are_raw_log_softmax_with_the_top_tokens():
    vocab = 30
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(4))
    sampler = Sampler([EOS])
    requests = [
        sampler.new_request(SamplingParams(temperature=0.3, logprobs=4, logit_bias={0: 50.0}), [1]),
        sampler.new_request(greedy(), [1]),
        sampler.new_request(greedy(logprobs=0), [1]),
    ]
    out = sampler.sample(logits, requests)
    assert out.logprobs[1] is None
    for row, num_top in ((0, 4), (2, 0)):
        expected = torch.log_softmax(logits[row].double(), dim=-1)
        entry = out.logprobs[row]
        assert entry.token_id == int(out.token_ids[row])
        assert entry.logprob == pytest.approx(float(expected[entry.token_id]), abs=1e-5)
        best = sorted(range(vocab), key=lambda t: -float(expected[t]))[:num_top]
        assert list(entry.top) == best
        assert [entry.top[t] for t in best] == pytest.approx([float(expected[t]) for t in best], abs=1e-5)
    assert out.token_ids[0] == 0  # the bias chose the token; the logprob still describes the model


def test_prompt_logprobs_score_the_next_prompt_token():
    logits = torch.randn(5, 20, generator=torch.Generator().manual_seed(8))
    next_tokens = torch.tensor([3, 19, 0, 7, 7])
    entries = compute_logprobs(logits, next_tokens, [2] * 5)
    for row, entry in enumerate(entries):
        expected = logits[row].double() - torch.logsumexp(logits[row].double(), dim=0)
        assert entry.logprob == pytest.approx(float(expected[next_tokens[row]]), abs=1e-5)
        assert len(entry.top) == 2


def test_sampling_params_normalise_and_reject_out_of_range_values():
    params = SamplingParams(stop="END", logit_bias={"5": 1})
    assert params.stop == ["END"] and params.logit_bias == {5: 1.0} and params.stop_token_ids == []
    assert SamplingParams(temperature=0).is_greedy and not SamplingParams().is_greedy
    for bad in (
        dict(temperature=-0.1),
        dict(top_p=0.0),
        dict(top_p=1.1),
        dict(top_k=-2),
        dict(min_p=1.5),
        dict(max_tokens=0),
        dict(min_tokens=-1),
        dict(min_tokens=20, max_tokens=10),
        dict(stop=[""]),
        dict(presence_penalty=2.5),
        dict(frequency_penalty=-3),
        dict(repetition_penalty=0),
        dict(logprobs=-1),
        dict(prompt_logprobs=-1),
        dict(logit_bias={3: 101}),
        dict(logit_bias={"x": 1}),
        dict(stop_token_ids=[-1]),
    ):
        with pytest.raises(ValueError):
            SamplingParams(**bad)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        SamplingParams(stop_token_ids=[100]).validate(vocab_size=100)


def test_sampler_rejects_wrong_logits():
    sampler = Sampler([EOS])
    request = sampler.new_request(SamplingParams(), [1])
    with pytest.raises(ValueError, match="float32"):
        sampler.sample(torch.zeros(1, 8, dtype=torch.float16), [request])
    with pytest.raises(ValueError, match="rows"):
        sampler.sample(torch.zeros(2, 8), [request])


@pytest.mark.gpu
def test_seeded_sampling_on_cuda_matches_cpu():
    vocab = 129280
    steps_logits = [torch.randn(vocab, generator=torch.Generator().manual_seed(s)) * 3 for s in range(8)]
    params = SamplingParams(seed=7, temperature=0.8, top_k=50, top_p=0.95, min_p=0.01, max_tokens=50)
    on_cpu = _run_steps(Sampler([EOS]), Sampler([EOS]).new_request(params, [1]), [], 0, steps_logits)
    sampler = Sampler([EOS], seed=1)
    companions = [
        sampler.new_request(SamplingParams(repetition_penalty=1.2), [2, 3]),
        sampler.new_request(greedy(), [4]),
    ]
    cuda_logits = [row.cuda() for row in steps_logits]

    def run_cuda(position):
        tokens = []
        for step, row_logits in enumerate(cuda_logits):
            batch = companions[:position] + [request] + companions[position:]
            others = torch.randn(2, vocab, device="cuda", generator=torch.Generator("cuda").manual_seed(step))
            logits = torch.cat([others[:position], row_logits[None], others[position:]])
            token = int(sampler.sample(logits, batch).token_ids[position])
            request.append(token)
            tokens.append(token)
        return tokens

    for position in (0, 1, 2):
        request = sampler.new_request(params, [1])
        assert run_cuda(position) == on_cpu
