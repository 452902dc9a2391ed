"""AsyncEngine: the event loop never waits for the model, outputs stream per request, aborts free the cache."""

import asyncio
import threading

import pytest
from tiny_model import load_tiny_model

from ds4.engine.async_engine import AsyncEngine
from ds4.engine.config import EngineConfig
from ds4.engine.engine import LLMEngine, RequestRejected
from ds4.engine.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def model():
    return load_tiny_model()


def new_engine(model):
    config = EngineConfig(
        page_size=16, max_model_len=128, max_num_seqs=4, max_num_batched_tokens=32, kv_cache_memory=1 << 24
    )
    return LLMEngine(model, config, seed=0)


def greedy(n):
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


PROMPTS = [[11 + i, 2000 + 7 * i, 30000 + i, 5, 9] * (i + 1) for i in range(5)]


def sync_tokens(model):
    eng = new_engine(model)
    for i, p in enumerate(PROMPTS):
        eng.add_request(f"r{i}", p, greedy(6))
    tokens = {f"r{i}": [] for i in range(len(PROMPTS))}
    while eng.has_unfinished_requests():
        for out in eng.step():
            tokens[out.request_id] += out.new_token_ids
    return tokens


def test_concurrent_streams_match_the_synchronous_engine(model):
    expected = sync_tokens(model)

    async def main():
        engine = AsyncEngine(new_engine(model))

        async def consume(i):
            outs = [out async for out in await engine.add_request(f"r{i}", PROMPTS[i], greedy(6))]
            assert outs[-1].finished and not any(o.finished for o in outs[:-1])
            return [t for o in outs for t in o.new_token_ids]

        got = await asyncio.gather(*(consume(i) for i in range(len(PROMPTS))))
        await engine.shutdown()
        return got

    got = asyncio.run(main())
    assert {f"r{i}": t for i, t in enumerate(got)} == expected


def test_the_event_loop_runs_while_a_step_is_in_the_model(model):
    """The step waits for an event only a coroutine sets: were the loop blocked by the step, it would time out."""
    engine = AsyncEngine(new_engine(model))
    gate = threading.Event()
    timed_out = []
    launch = engine.engine.runner.launch

    def gated_launch(*args, **kwargs):
        if not gate.wait(timeout=10):
            timed_out.append(True)
        return launch(*args, **kwargs)

    engine.engine.runner.launch = gated_launch

    async def main():
        stream = await engine.add_request("g", PROMPTS[0], greedy(3))
        await asyncio.sleep(0.2)
        gate.set()
        outs = [out async for out in stream]
        await engine.shutdown()
        return outs

    outs = asyncio.run(main())
    assert not timed_out and outs[-1].finished and sum(len(o.new_token_ids) for o in outs) == 3


def test_abort_and_leaving_the_stream_free_every_page(model):
    async def main():
        engine = AsyncEngine(new_engine(model))
        kept = await engine.add_request("kept", PROMPTS[1], greedy(40))
        left = await engine.add_request("left", PROMPTS[2], greedy(40))
        aborted = await engine.add_request("aborted", PROMPTS[3], greedy(40))
        async for _ in left:
            break  # the client went away
        await left.aclose()
        first = await aborted.__anext__()
        engine.abort("aborted")
        rest = [out async for out in aborted]
        kept_outs = [out async for out in kept]
        await asyncio.sleep(0.05)
        stats = engine.stats()
        await engine.shutdown()
        return first, rest, kept_outs, stats, engine

    first, rest, kept_outs, stats, engine = asyncio.run(main())
    assert rest[-1].finish_reason == "abort" and len(first.new_token_ids) + sum(len(o.new_token_ids) for o in rest) < 40
    assert kept_outs[-1].finish_reason == "length" and sum(len(o.new_token_ids) for o in kept_outs) == 40
    assert stats.num_running == stats.num_waiting == 0 and stats.num_free_pages == stats.num_pages
    assert engine.engine.requests == {}


def test_bad_requests_are_refused_at_once(model):
    async def main():
        engine = AsyncEngine(new_engine(model))
        with pytest.raises(RequestRejected, match="max_model_len"):
            await engine.add_request("long", [5] * 200, greedy(2))
        with pytest.raises(ValueError, match="vocabulary"):
            await engine.add_request("bad", [10**9], greedy(2))
        assert not engine.is_running  # nothing was started for refused requests
        await engine.shutdown()

    asyncio.run(main())
