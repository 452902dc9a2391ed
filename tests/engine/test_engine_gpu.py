"""The engine on CUDA: greedy outputs under continuous batching equal each request alone, with CUDA graphs on.

Decode graphs are checked twice: on a small graph-safe toy model (so the padding, static buffers and
replay are tested whatever the DSv4 model supports), and on the tiny DSv4 model when its forward is
graph safe.

On CUDA the kernels multiply in bf16 on the tensor cores and pick their plans (key splits, GEMM tiles, MoE
tiers) from the batch's shape, so one request's logits move by rounding with what shares its batch. Greedy
output then equals the request alone up to near ties: the first token where they part must be one the
reference scores within NEAR_TIE of its own choice (the tiny model's logits: std ~3, top-two gaps 0.36 at the
median, under 0.045 at one position in ten); from there on the two continuations are different texts.
"""

import functools
import random
import warnings
from types import SimpleNamespace

import pytest
import torch
from tiny_model import load_tiny_model
from torch import nn

from ds4.checkpoint.tiny import default_model_dir
from ds4.config import load_config
from ds4.engine.config import EngineConfig
from ds4.engine.cuda_graphs import shared_logits_bytes
from ds4.engine.engine import LLMEngine
from ds4.engine.sampling_params import SamplingParams
from ds4.kernels.fp8_kv import dequantize_kv
from ds4.model.batch import ForwardBatch

pytestmark = pytest.mark.gpu
PAGE = 16
NEAR_TIE = 0.1


class ToyModel(nn.Module):
    """Graph-safe stand-in: each slot keeps a running sum of its tokens' embeddings, scaled by position."""

    cuda_graph_safe = True

    def __init__(self, cfg, device):
        super().__init__()
        self.cfg, self.dtype, self.with_mtp, self.kv_cache_dtype = cfg, torch.float32, False, "bf16"
        self.embed = nn.Parameter(
            torch.randn(cfg.vocab_size, 8, generator=torch.Generator().manual_seed(0)).to(device), requires_grad=False
        )

    def new_cache(self, num_slots, num_pages, page_size, num_snapshots=0, spare=0):
        return SimpleNamespace(state=torch.zeros(num_slots, 8, device=self.embed.device))

    def forward(self, batch, cache):
        t = batch.input_ids.shape[0]
        loc = batch.query_start_loc.long()
        req = torch.searchsorted(loc[1:], torch.arange(t, device=loc.device), right=True)
        x = self.embed[batch.input_ids] * torch.cos(batch.positions.float()).unsqueeze(1)
        sums = x.cumsum(0)
        before = torch.where(loc[req].unsqueeze(1) > 0, sums[(loc[req] - 1).clamp(min=0)], torch.zeros_like(sums))
        h = cache.state[batch.slots.long()[req]] + sums - before
        cache.state[batch.slots.long()] = h[loc[1:] - 1]
        return h

    def compute_logits(self, hidden):
        return hidden.float() @ self.embed.T


def greedy(n):
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def run_all(eng, prompts, max_tokens, arrive_every=2):
    tokens, pending, step = {}, list(enumerate(prompts)), 0
    while pending or eng.has_unfinished_requests():
        if pending and step % arrive_every == 0:
            i, p = pending.pop(0)
            eng.add_request(f"r{i}", p, greedy(max_tokens[i]))
            tokens[f"r{i}"] = []
        for out in eng.step():
            tokens[out.request_id] += out.new_token_ids
        step += 1
    return [tokens[f"r{i}"] for i in range(len(prompts))]


def random_prompts(n, seed):
    rng = random.Random(seed)
    return [[rng.randrange(2, 129000) for _ in range(rng.randint(1, 60))] for _ in range(n)]


def count_replays(eng):
    calls = {"replays": 0}
    run = eng.runner.graphs.run

    def counted(batch, key):
        calls["replays"] += 1
        return run(batch, key)

    eng.runner.graphs.run = counted
    return calls


def test_decode_graphs_replay_equals_eager_on_a_toy_model():
    cfg = load_config(default_model_dir())
    model = ToyModel(cfg, "cuda")
    flags = dict(
        page_size=PAGE,
        max_model_len=128,
        max_num_seqs=12,
        max_num_batched_tokens=64,
        long_prefill_token_threshold=16,
        kv_cache_memory=1 << 26,
        max_cuda_graph_batch_size=8,
        enable_prefix_caching=False,  # the toy's running sums have no page-end state to keep
    )
    prompts, lens = random_prompts(11, seed=1), [3 + 2 * i for i in range(11)]
    eager = run_all(LLMEngine(model, EngineConfig(enforce_eager=True, **flags)), prompts, lens)
    graphed_engine = LLMEngine(model, EngineConfig(**flags))
    graphs = graphed_engine.runner.graphs
    assert graphs is not None and graphs.sizes == [1, 2, 4, 8]
    # the logits buffer the graphs share is the one the cache plan set aside: 8 rows of the vocabulary, fp32
    assert graphs.logits.shape == (8, cfg.vocab_size) and graphs.logits.dtype == torch.float32
    assert graphs.logits.nbytes == shared_logits_bytes(cfg.vocab_size, 8, 1)
    calls = count_replays(graphed_engine)
    assert run_all(graphed_engine, prompts, lens) == eager
    assert calls["replays"] > 5


@pytest.fixture(scope="module")
def model():
    return load_tiny_model("cuda")


class Greedy(list):
    """A reference greedy continuation (its tokens) with the logits each token was chosen from."""

    def __init__(self, tokens, logits):
        super().__init__(tokens)
        self.logits = logits

    def disagreement(self, got: list[int]) -> str | None:
        """Why `got` is not this continuation up to a near tie, or None when it is."""
        for j, (want, token) in enumerate(zip(self, got)):
            if want != token:
                shortfall = float(self.logits[j][want] - self.logits[j][token])
                if shortfall > NEAR_TIE:
                    return f"token {j}: {token} scores {shortfall:.4f} below the reference's {want}"
                return None
        return None if len(got) == len(self) else f"{len(got)} tokens, expected {len(self)}"


def reference_greedy(model, prompt, max_tokens) -> Greedy:
    cache = model.new_cache(1, 8, PAGE)

    def batch(ids, start):
        n = len(ids)
        i32 = dict(dtype=torch.int32, device="cuda")
        return ForwardBatch(
            torch.tensor(ids, device="cuda"),
            torch.arange(start, start + n, device="cuda"),
            torch.tensor([0, n], **i32),
            torch.tensor([start], **i32),
            torch.zeros(1, **i32),
            torch.arange(8, **i32).unsqueeze(0),
        )

    logits = [model.compute_logits(model.forward(batch(prompt, 0), cache)[-1:])[0].float().cpu()]
    out = [int(logits[-1].argmax())]
    while len(out) < max_tokens:
        hidden = model.forward(batch(out[-1:], len(prompt) + len(out) - 1), cache)
        logits.append(model.compute_logits(hidden)[0].float().cpu())
        out.append(int(logits[-1].argmax()))
    return Greedy(out, logits)


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "cuda-graphs"])
def test_greedy_under_continuous_batching_equals_each_request_alone(model, graphs):
    flags = dict(
        page_size=PAGE,
        max_model_len=128,
        max_num_seqs=6,
        max_num_batched_tokens=48,
        long_prefill_token_threshold=16,
        kv_cache_memory=1 << 26,
        enforce_eager=not graphs,
    )
    prompts, lens = random_prompts(9, seed=2), [4 + 2 * i for i in range(9)]
    eng = LLMEngine(model, EngineConfig(**flags))
    calls = count_replays(eng) if graphs else None
    got = run_all(eng, prompts, lens)
    for i, prompt in enumerate(prompts):
        assert reference_greedy(model, prompt, lens[i]).disagreement(got[i]) is None, f"request r{i}"
    if graphs:  # decode steps launched ahead of the previous one's tokens (async decode) among them
        assert calls["replays"] > 5 and eng.stats().num_steps_ahead > 5
    assert eng.allocator.num_free_pages == eng.allocator.num_pages


def test_async_decode_on_cuda_graphs_equals_the_synchronous_engine(model):
    """The same requests through the CUDA-graph engine with async decode on and off: the same steps in the same
    batches (every request runs to the same max_tokens, so no row is dropped), hence the same tokens exactly,
    greedy and seeded."""
    flags = dict(
        page_size=PAGE,
        max_model_len=128,
        max_num_seqs=6,
        max_num_batched_tokens=48,
        long_prefill_token_threshold=16,
        kv_cache_memory=1 << 26,
    )
    prompts = random_prompts(5, seed=3)
    params = [
        SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True),
        SamplingParams(temperature=0.9, top_p=0.9, seed=11, max_tokens=40, ignore_eos=True),
    ]
    tokens, steps_ahead = [], []
    for async_decode in (False, True):
        eng = LLMEngine(model, EngineConfig(async_decode=async_decode, **flags), seed=0)
        for i, prompt in enumerate(prompts):
            eng.add_request(f"r{i}", prompt, params[i % 2])
        got = {f"r{i}": [] for i in range(len(prompts))}
        while eng.has_unfinished_requests():
            for out in eng.step():
                got[out.request_id] += out.new_token_ids
        tokens.append(got)
        steps_ahead.append(eng.stats().num_steps_ahead)
        assert eng.allocator.num_free_pages == eng.allocator.num_pages
    assert tokens[1] == tokens[0]
    assert steps_ahead[0] == 0 and steps_ahead[1] > 20


def test_decode_path_never_syncs_and_its_graph_replays_the_eager_steps(model):
    """The decode path runs under sync debug mode "error", and a graph of it (2 real rows, 2 padding rows)
    gives the eager steps' hidden states and caches, step after step."""
    from ds4.engine.cuda_graphs import DecodeInputs, GraphKey

    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(2, model.cfg.vocab_size, (n,), generator=gen).tolist() for n in (37, 20)]
    tables = [[3, 0, 5, 1], [2, 6, 4, 7]]
    caches = [model.new_cache(3, 8, PAGE) for _ in range(2)]  # slot 2: the scratch slot
    for cache in caches:
        for r, prompt in enumerate(prompts):  # all but the last token, which the first decode step runs
            n, i32 = len(prompt) - 1, dict(dtype=torch.int32, device="cuda")
            model.forward(
                ForwardBatch(
                    torch.tensor(prompt[:-1], device="cuda"),
                    torch.arange(n, device="cuda"),
                    torch.tensor([0, n], **i32),
                    torch.zeros(1, **i32),
                    torch.tensor([r], **i32),
                    torch.tensor([tables[r]], **i32),
                ),
                cache,
            )
    eager_cache, graph_cache = caches
    inputs = DecodeInputs(4, 6, padding_slot=2, device=torch.device("cuda"))  # tables 4 of 6 columns wide
    key = GraphKey(tokens_per_request=1, size=4, pages=4)
    inputs.load(key, [], [], [], [], [])
    model.forward(inputs.view(key), graph_cache)  # warm-up: padding rows only
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = model.forward(inputs.view(key), graph_cache)

    tokens = [prompts[0][-1], prompts[1][-1]]
    for step in range(20):
        pos = [len(p) + step - 1 for p in prompts]
        i32 = dict(dtype=torch.int32, device="cuda")
        batch = ForwardBatch(
            torch.tensor(tokens, device="cuda"),
            torch.tensor(pos, device="cuda"),
            torch.arange(3, **i32),
            torch.tensor(pos, **i32),
            torch.tensor([0, 1], **i32),
            torch.tensor(tables, **i32),
            decode_only=True,
        )
        torch.cuda.set_sync_debug_mode("error")
        try:
            eager = model.forward(batch, eager_cache)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        inputs.load(key, tokens, pos, pos, [0, 1], [p for table in tables for p in table])
        graph.replay()
        assert torch.allclose(out[:2], eager, rtol=1e-5, atol=1e-5), f"step {step}"
        tokens = model.compute_logits(eager).argmax(dim=-1).tolist()
    for eager_layer, graph_layer in zip(eager_cache.layers, graph_cache.layers):
        assert torch.allclose(eager_layer.window[:2], graph_layer.window[:2], rtol=1e-5, atol=1e-5)
        if eager_layer.compressed is not None:
            _assert_entries_agree(eager_layer.compressed[:8], graph_layer.compressed[:8], model.cfg)


def _assert_entries_agree(eager: torch.Tensor, graph: torch.Tensor, cfg) -> None:
    """Compressed entries of the eager steps and of the graph's. Their compressors' projections are fp32 sums in
    another order (fp32_product: the eager step's 2 rows by the Triton GEMV, the graph's 4 by cuBLAS), so an FP8
    entry may round a value to the next e4m3 code (the bytes differed on an H100, the hidden states agreeing to
    1e-5): the same bytes but for a few, and values within one e4m3 step. Rows of the compute dtype agree to 1e-5."""
    if eager.dtype != torch.uint8:
        assert torch.allclose(eager, graph, rtol=1e-5, atol=1e-5)
        return
    assert (eager != graph).float().mean() <= 0.05
    rows = [dequantize_kv(e.flatten(0, -2), cfg.head_dim, cfg.qk_rope_head_dim, torch.float32) for e in (eager, graph)]
    torch.testing.assert_close(rows[1], rows[0], rtol=2**-3, atol=1e-3 * float(rows[0].abs().max()))


def test_a_prefill_step_syncs_once_for_its_layout(model):
    """A prefill step of two requests (one continuing from 24 cached tokens, across compressor windows and pages)
    reads its batch's layout back once (StepLayout) and waits on the device nowhere else: no sync per layer."""
    gen = torch.Generator().manual_seed(5)
    i32 = dict(dtype=torch.int32, device="cuda")
    tables = torch.tensor([[3, 0, 5, 1], [2, 6, 4, 7]], **i32)
    cache = model.new_cache(3, 8, PAGE)
    first, second = (torch.randint(2, model.cfg.vocab_size, (n,), generator=gen).cuda() for n in (40, 30))
    arange = functools.partial(torch.arange, device="cuda")
    model.forward(ForwardBatch(first[:24], arange(24), torch.tensor([0, 24], **i32), torch.zeros(1, **i32),
                               torch.zeros(1, **i32), tables[:1]), cache)  # fmt: skip
    batch = ForwardBatch(torch.cat([first[24:], second]), torch.cat([arange(24, 40), arange(30)]),
                         torch.tensor([0, 16, 46], **i32), torch.tensor([24, 0], **i32), torch.tensor([0, 1], **i32),
                         tables)  # fmt: skip
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model.forward(batch, cache)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    syncs = [(w.filename, w.lineno) for w in caught if "prototype" not in str(w.message)]
    assert len(syncs) == 1 and syncs[0][0].endswith("batch.py"), syncs


def test_a_step_returns_its_tokens_while_the_step_launched_ahead_still_runs(model):
    """The host reads a decode step's tokens without waiting for the step launched ahead of it: with a second of
    GPU spin queued behind that step, step() still returns before the spin is over."""
    eng = LLMEngine(model, EngineConfig(page_size=PAGE, max_model_len=128, max_num_seqs=4, kv_cache_memory=1 << 26))
    for i, prompt in enumerate(random_prompts(2, seed=4)):
        eng.add_request(f"r{i}", prompt, greedy(40))
    while eng.stats().num_steps_ahead < 3:
        eng.step()
    launch, spins = eng.runner.launch, []

    def launch_then_spin(chunks, snapshots=None, after=None):
        launched = launch(chunks, snapshots, after)
        if after is not None:
            torch.cuda._sleep(2_000_000_000)  # about a second at the H200's clock
            spins.append(torch.cuda.Event())
            spins[-1].record()
        return launched

    eng.runner.launch = launch_then_spin
    outs = eng.step()
    assert spins and not spins[-1].query(), "step() waited for the step launched ahead"
    assert len(outs) == 2 and all(len(out.new_token_ids) == 1 for out in outs)
    torch.cuda.synchronize()
    eng.runner.launch = launch
    while eng.has_unfinished_requests():
        eng.step()
    assert eng.allocator.num_free_pages == eng.allocator.num_pages
