"""Choose the next token of every request in a batch, each request with its own sampling parameters.

Per row, in this order (the order matters when options combine; it is vLLM's):
    raw logits -> + logit_bias -> min_tokens mask -> penalties -> greedy rows: argmax
    -> / temperature -> min_p -> top_k -> top_p -> one draw from the remaining distribution.

- min_tokens: until a request has min_tokens output tokens, its stop_token_ids and the EOS ids
  (unless ignore_eos) get -inf, so it cannot stop on a token early.
- Penalties: repetition (HF / vLLM: a logit of a token seen in prompt or output is divided by the
  penalty when positive, multiplied when negative), then frequency and presence (OpenAI: minus
  frequency * count and minus presence * [count > 0], counting output tokens only).
- top_k keeps every token tied with the k-th largest logit. top_p keeps the smallest set of most
  likely tokens whose mass reaches top_p (the first token always stays).
- Randomness: every request owns a CPU `torch.Generator` (seeded from its `seed`, or from the
  sampler's own generator when it has none). A random row takes exactly one float64 uniform from its
  stream per sampled token and inverts the row's cumulative distribution, so a seeded request gives the
  same tokens whatever else shares the batch, in any row, on any device with the same logits. The
  uniforms are drawn from the generator in blocks (CPU draws are serial, so a block of n is the next n
  single draws).
- The common batch costs a few tensor ops, whatever its size: all-greedy is one argmax, all-random one
  warp and one draw over the batch; per-request work (grammar, bias, min_tokens, penalties, logprobs) is
  done only for the requests that ask for it. Host lists reach the device through ds4.engine.uploads.
- Logprobs are RAW: log_softmax of the model's logits, before bias, penalties, temperature and
  filtering (vLLM's default "raw_logprobs"), so they describe the model, not the sampling options.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from ds4.engine.sampling_params import SamplingParams
from ds4.engine.uploads import upload
from ds4.kernels.argmax import argmax

_SEED_RANGE = 2**62
_UNIFORM_BLOCK = 64


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """logits.argmax(dim=-1) of [rows, vocab]: the first index of each row's largest value, NaN counting as the
    largest (`kernels.argmax`: two launches on CUDA)."""
    return argmax(logits)


@dataclass
class TokenLogprobs:
    """The log-probability of one chosen token and of the `num_top` most likely ones (most likely first)."""

    token_id: int
    logprob: float
    top: dict[int, float]


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # [B] int64, on the logits' device
    logprobs: list[TokenLogprobs | None]  # per row; None where the request asked for none


class RequestSampling:
    """One request's sampling state across steps: its params, its random stream, the tokens it has seen.

    `prompt_token_ids` is kept by reference, not copied. Call `append` for every output token the
    request keeps (after speculative verification), so penalties and min_tokens see it.
    """

    def __init__(self, params: SamplingParams, prompt_token_ids: Sequence[int], seed: int):
        self.params = params
        self.prompt_token_ids = prompt_token_ids
        self.output_token_ids: list[int] = []
        self.generator = torch.Generator().manual_seed(seed)
        self._uniforms: list[float] = []  # drawn from generator, not yet used; the next one last
        # Built on first use, only for requests with penalties: [vocab] on the logits' device.
        self._seen_in_prompt: torch.Tensor | None = None
        self._output_counts: torch.Tensor | None = None

    def append(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        if self._output_counts is not None:
            self._output_counts[token_id] += 1

    def draw_uniform(self) -> float:
        """The next uniform in [0, 1) of this request's own stream."""
        if not self._uniforms:
            self._uniforms = torch.rand(_UNIFORM_BLOCK, dtype=torch.float64, generator=self.generator).tolist()
            self._uniforms.reverse()
        return self._uniforms.pop()

    def penalty_state(self, vocab_size: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(seen in prompt [vocab] bool, output token counts [vocab] int32)."""
        if self._output_counts is None or self._output_counts.device != device:
            self._seen_in_prompt = torch.zeros(vocab_size, dtype=torch.bool, device=device)
            self._seen_in_prompt[_ids_tensor(self.prompt_token_ids, vocab_size, device)] = True
            self._output_counts = torch.zeros(vocab_size, dtype=torch.int32, device=device)
            outputs = _ids_tensor(self.output_token_ids, vocab_size, device)
            self._output_counts.index_add_(0, outputs, torch.ones_like(outputs, dtype=torch.int32))
        return self._seen_in_prompt, self._output_counts


class Sampler:
    """Samples a [B, vocab] fp32 logits tensor for B requests; knows the model's EOS ids."""

    def __init__(self, eos_token_ids: Iterable[int], seed: int | None = None):
        self.eos_token_ids = tuple(eos_token_ids)
        self._seed_source = torch.Generator()
        if seed is None:
            self._seed_source.seed()
        else:
            self._seed_source.manual_seed(seed)

    def new_request(self, params: SamplingParams, prompt_token_ids: Sequence[int]) -> RequestSampling:
        seed = params.seed
        if seed is None:
            seed = int(torch.randint(_SEED_RANGE, (), generator=self._seed_source))
        return RequestSampling(params, prompt_token_ids, seed)

    def sample(self, logits: torch.Tensor, requests: Sequence[RequestSampling]) -> SamplerOutput:
        if logits.dim() != 2 or logits.dtype != torch.float32:
            raise ValueError(
                f"logits must be a [batch, vocab] float32 tensor, got {logits.dtype} {tuple(logits.shape)}"
            )
        if logits.shape[0] != len(requests):
            raise ValueError(f"{logits.shape[0]} logits rows for {len(requests)} requests")
        processed = self.process(logits, requests)
        greedy = [request.params.is_greedy for request in requests]
        if all(greedy):
            token_ids = greedy_tokens(processed)
        elif not any(greedy):
            token_ids = sample_random(processed, requests)
        else:
            greedy_rows = [row for row, is_greedy in enumerate(greedy) if is_greedy]
            random_rows = [row for row, is_greedy in enumerate(greedy) if not is_greedy]
            greedy_index, random_index = upload(logits.device, (greedy_rows, torch.long), (random_rows, torch.long))
            token_ids = torch.empty(len(requests), dtype=torch.long, device=logits.device)
            token_ids[greedy_index] = greedy_tokens(processed[greedy_index])
            token_ids[random_index] = sample_random(processed[random_index], [requests[row] for row in random_rows])
        return SamplerOutput(token_ids, self._logprobs(logits, token_ids, requests))

    def process(self, logits: torch.Tensor, requests: Sequence[RequestSampling]) -> torch.Tensor:
        """Grammar masks, logit bias, the min_tokens mask and penalties: the logits greedy rows take the
        argmax of and random rows warp. A new tensor when anything applies: raw logprobs read the input."""
        if all(_nothing_to_process(request) for request in requests):
            return logits
        # Imported here: xgrammar takes ~1 s to import, which the ranks of a tensor-parallel engine other than
        # rank 0 (they never sample) and the processes that serve no grammar need not pay.
        from ds4.engine.structured_output import apply_structured_output

        processed = apply_structured_output(logits, requests)
        return apply_penalties(self._mask_early_stops(apply_logit_bias(processed, requests), requests), requests)

    def _mask_early_stops(self, logits: torch.Tensor, requests: Sequence[RequestSampling]) -> torch.Tensor:
        rows, cols = [], []
        for row, request in enumerate(requests):
            params = request.params
            if len(request.output_token_ids) >= params.min_tokens:
                continue
            stops = list(params.stop_token_ids) + ([] if params.ignore_eos else list(self.eos_token_ids))
            rows += [row] * len(stops)
            cols += stops
        if not rows:
            return logits
        _check_ids(cols, logits.shape[1])
        index = upload(logits.device, (rows, torch.long), (cols, torch.long))
        return logits.index_put(tuple(index), logits.new_full((), float("-inf")))

    @staticmethod
    def _logprobs(
        logits: torch.Tensor, token_ids: torch.Tensor, requests: Sequence[RequestSampling]
    ) -> list[TokenLogprobs | None]:
        wanted = [row for row, request in enumerate(requests) if request.params.logprobs is not None]
        out: list[TokenLogprobs | None] = [None] * len(requests)
        if wanted:
            (rows,) = upload(logits.device, (wanted, torch.long))
            num_top = [requests[row].params.logprobs for row in wanted]
            for row, entry in zip(wanted, compute_logprobs(logits[rows], token_ids[rows], num_top)):
                out[row] = entry
        return out


def _nothing_to_process(request: RequestSampling) -> bool:
    """No grammar, logit bias, min_tokens mask or penalty applies to this request now."""
    params = request.params
    return (
        params.structured_output is None
        and not params.logit_bias
        and not params.uses_penalties
        and len(request.output_token_ids) >= params.min_tokens
    )


def samples_from_logits_alone(request: RequestSampling) -> bool:
    """Its next token is drawn from the logits alone and only the token returns to the host (no grammar, bias,
    min_tokens mask, penalties or logprobs), so it may be sampled before the request's previous token is known."""
    return _nothing_to_process(request) and request.params.logprobs is None


def apply_logit_bias(logits: torch.Tensor, requests: Sequence[RequestSampling]) -> torch.Tensor:
    rows, cols, biases = [], [], []
    for row, request in enumerate(requests):
        bias = request.params.logit_bias
        rows += [row] * len(bias)
        cols += bias.keys()
        biases += bias.values()
    if not rows:
        return logits
    _check_ids(cols, logits.shape[1])
    index_rows, index_cols, values = upload(
        logits.device, (rows, torch.long), (cols, torch.long), (biases, logits.dtype)
    )
    return logits.index_put((index_rows, index_cols), values, accumulate=True)


def apply_penalties(logits: torch.Tensor, requests: Sequence[RequestSampling]) -> torch.Tensor:
    penalised = [row for row, request in enumerate(requests) if request.params.uses_penalties]
    if not penalised:
        return logits
    vocab_size, device = logits.shape[1], logits.device
    states = [requests[row].penalty_state(vocab_size, device) for row in penalised]
    seen_in_prompt = torch.stack([seen for seen, _ in states])
    counts = torch.stack([count for _, count in states]).to(logits.dtype)

    def column(name: str) -> tuple[list[float], torch.dtype]:
        return [getattr(requests[row].params, name) for row in penalised], logits.dtype

    rows, repetition, frequency, presence = upload(
        device,
        (penalised, torch.long),
        column("repetition_penalty"),
        column("frequency_penalty"),
        column("presence_penalty"),
    )
    repetition, frequency, presence = repetition.unsqueeze(1), frequency.unsqueeze(1), presence.unsqueeze(1)
    x = logits[rows]
    repeated = torch.where(x > 0, x / repetition, x * repetition)
    x = torch.where(seen_in_prompt | (counts > 0), repeated, x)
    x = x - frequency * counts - presence * (counts > 0).to(x.dtype)
    logits = logits.clone()
    logits[rows] = x
    return logits


def sample_random(logits: torch.Tensor, requests: Sequence[RequestSampling]) -> torch.Tensor:
    """One inverse-CDF draw per row of the warped distribution, from the row's own request generator."""
    cdf = warp_logits(logits, [request.params for request in requests]).softmax(dim=-1).double().cumsum(dim=-1)
    (uniforms,) = upload(logits.device, ([request.draw_uniform() for request in requests], torch.float64))
    # right=True picks the first token whose cdf exceeds the target, so never a zero-probability token.
    targets = (uniforms * cdf[:, -1]).unsqueeze(1)
    return torch.searchsorted(cdf, targets, right=True).squeeze(1).clamp_(max=logits.shape[1] - 1)


def warp_logits(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Temperature, then min_p, then top_k, then top_p (filtered tokens get -inf); random rows only."""
    vocab_size = logits.shape[1]
    uses_min_p = any(p.min_p > 0 for p in params)
    uses_top = any(p.top_k > 0 or p.top_p < 1 for p in params)
    fields = [([p.temperature for p in params], logits.dtype)]
    if uses_min_p:
        fields.append(([p.min_p for p in params], logits.dtype))
    if uses_top:
        fields.append(([min(p.top_k, vocab_size) if p.top_k > 0 else vocab_size for p in params], torch.long))
        fields.append(([p.top_p for p in params], torch.float64))
    columns = [column.unsqueeze(1) for column in upload(logits.device, *fields)]
    x = logits / columns.pop(0)
    if uses_min_p:
        probs = x.softmax(dim=-1)
        min_p = columns.pop(0)
        x = x.masked_fill(probs < min_p * probs.amax(dim=-1, keepdim=True), float("-inf"))
    if uses_top:
        top_k, top_p = columns
        x = x.masked_fill(top_k_top_p_drop(x, top_k, top_p), float("-inf"))
    return x


def top_k_top_p_drop(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Bool [n, vocab]: the tokens top_k ([n, 1], vocab = off) and top_p ([n, 1], 1 = off) remove."""
    ordered, order = logits.sort(dim=-1, descending=True, stable=True)
    drop = ordered < ordered.gather(1, top_k - 1)
    probs = ordered.masked_fill(drop, float("-inf")).softmax(dim=-1).double()
    mass_before = probs.cumsum(dim=-1) - probs
    drop |= (mass_before >= top_p) & (top_p < 1)
    return torch.empty_like(drop).scatter_(1, order, drop)


def compute_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, num_top: Sequence[int]) -> list[TokenLogprobs]:
    """Per row: log_softmax(logits)[token_ids] and the num_top[row] most likely tokens.

    Also serves prompt logprobs: pass the logits of positions 0..T-2 and the prompt tokens 1..T-1.
    """
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen = logprobs.gather(1, token_ids.view(-1, 1)).squeeze(1).tolist()
    most = max(num_top, default=0)
    top_values, top_ids = logprobs.topk(most, dim=-1) if most else (logprobs[:, :0], logprobs[:, :0].long())
    top_values, top_ids = top_values.tolist(), top_ids.tolist()
    return [
        TokenLogprobs(token_id, chosen[row], dict(zip(top_ids[row][:n], top_values[row][:n])))
        for row, (token_id, n) in enumerate(zip(token_ids.tolist(), num_top))
    ]


def _check_ids(ids: Sequence[int], vocab_size: int) -> None:
    bad = [token_id for token_id in ids if not 0 <= token_id < vocab_size]
    if bad:
        raise ValueError(f"token ids outside the vocabulary of {vocab_size}: {bad[:8]}")


def _ids_tensor(ids: Sequence[int], vocab_size: int, device: torch.device) -> torch.Tensor:
    _check_ids(ids, vocab_size)
    (tensor,) = upload(device, (list(ids), torch.long))
    return tensor
