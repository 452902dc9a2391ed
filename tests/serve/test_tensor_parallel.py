"""Tensor and expert parallelism through `LLM` and the server's app: N ranks (processes over gloo) give what one
rank gives on the tiny official-format model, in fp32: identical greedy tokens (with MTP speculation and prefix
caching, whose snapshot copies and draft steps the other ranks mirror), prompt logprobs within 1e-5, the same
streamed chat reply and strict tool call. Layouts: TP=4 and EP=2 with the ranks the engine starts itself, TP=2 as
two "hosts" on localhost joined by the rendezvous (host 1 a `ds4 serve --node-rank 1` process). A rank that hangs
fails the engine at the collective timeout: the request fails and /health turns 503."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from types import SimpleNamespace

import httpx
import pytest
import torch
from live_server import LiveServer

from ds4 import LLM, SamplingParams
from ds4.checkpoint.tiny import make_tiny, tiny_config
from ds4.engine.async_engine import AsyncEngine
from ds4.engine.config import EngineConfig, EngineConfigError, Launch
from ds4.engine.model_runner import check_same_setup, rank_setup
from ds4.engine.structured_output import GrammarCache, grammar_tokenizer_info
from ds4.serve.app import create_app

# The tiny model with output groups that split 4 ways (the CPU holds weights dequantised: no FP8 block to keep whole).
SPLITTABLE = {"o_groups": 4}
ENGINE = dict(
    device="cpu",
    dtype="float32",
    seed=0,
    kv_cache_memory=64 << 20,
    max_model_len=1024,
    page_size=16,  # prefix caching resumes from page ends: short prompts share whole pages
    max_num_seqs=4,
    speculative_config={"method": "mtp", "num_speculative_tokens": 2},
)
SHARED = [0, 9906, 11, 1917, 0, 128803, 3923, 374, 279, 6864, 315, 9822, 30, 128804, 128822, 791, 6864, 315] * 2
PROMPTS = [SHARED + [1000, 2000, 3000], SHARED + [4000], [0, 42, 4242, 424]]
CHAT = {
    "model": "tiny",
    "messages": [{"role": "user", "content": "Hi"}],
    "max_tokens": 4,
    "temperature": 0,
    "chat_template_kwargs": {"thinking": False},
}
# No parameters: the shortest call the tool grammar allows (random weights take every token it leaves open).
PING = {"type": "function", "function": {"name": "ping", "parameters": {"type": "object", "properties": {}}}}
HANG_TIMEOUT_S = 5.0


@dataclass
class Outputs:
    offline: list  # (greedy tokens, prompt logprobs) per prompt
    served: tuple[str, dict]  # the streamed chat text, the tool call


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("tp") / "tiny", format="official", seed=5, config_overrides=SPLITTABLE)


@pytest.fixture(scope="module")
def reference(model_dir) -> Outputs:
    """One rank: the outputs every layout must reproduce."""
    with LLM(model_dir, **ENGINE) as llm:
        return Outputs(_offline(llm), _served(llm))


def _offline(llm: LLM) -> list:
    first = llm.generate(PROMPTS[:1], SamplingParams(max_tokens=4, temperature=0, prompt_logprobs=2), use_tqdm=False)
    # The second prompt resumes after the first's cached pages (a snapshot restore), in a batch with the third.
    rest = llm.generate(PROMPTS[1:], SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)
    assert llm.engine.stats().prefix_cache_hit_tokens > 0
    return [(o.token_ids, o.prompt_logprobs) for o in first + rest]


def _served(llm: LLM, then=None) -> tuple[str, dict]:
    """One streaming chat request and one strict tool call through the server's app on this engine; then(url)
    before the server stops (which stops the engine's other ranks too)."""
    info = grammar_tokenizer_info(llm.tokenizer.backend, llm.engine.model.cfg.vocab_size, llm.tokenizer.special.eos)
    grammars = GrammarCache(info, max_whitespace=1)  # random weights fill every blank a grammar allows
    live = LiveServer(create_app(AsyncEngine(llm.engine), served_model_names="tiny", grammar_cache=grammars))
    try:
        text = ""
        with httpx.stream("POST", live.url + "/v1/chat/completions", json={**CHAT, "stream": True}, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    delta = json.loads(line[6:])["choices"][0]["delta"]
                    text += (delta.get("content") or "") + (delta.get("reasoning_content") or "")
        tool = {**CHAT, "max_tokens": 100, "tools": [PING], "tool_choice": "required", "parallel_tool_calls": False}
        reply = httpx.post(live.url + "/v1/chat/completions", json=tool, timeout=120).json()
        assert "choices" in reply and reply["choices"][0]["finish_reason"] == "tool_calls", reply
        call = reply["choices"][0]["message"]["tool_calls"][0]["function"]
        if then is not None:
            then(live.url)
        return text, {"name": call["name"], "arguments": json.loads(call["arguments"])}
    finally:
        live.stop()
        grammars.close()


def _assert_equal(got: list, expected: list) -> None:
    assert [tokens for tokens, _ in got] == [tokens for tokens, _ in expected]
    prompt_logprobs, reference = got[0][1], expected[0][1]
    assert prompt_logprobs[0] is None and len(prompt_logprobs) == len(reference) == len(PROMPTS[0])
    errors = []
    for pos in range(1, len(reference)):
        assert prompt_logprobs[pos].keys() == reference[pos].keys(), pos
        # 1e-5 relative to the logprob's size (fp32 sums in another order: expert parallel adds the ranks' experts
        # as partial sums), absolute below 1.
        errors += [abs(prompt_logprobs[pos][t] - lp) / max(1.0, abs(lp)) for t, lp in reference[pos].items()]
    assert max(errors) < 1e-5, max(errors)


def test_tensor_parallel_4_equals_one_rank(model_dir, reference):
    with LLM(model_dir, **ENGINE, tensor_parallel_size=4) as llm:
        _assert_equal(_offline(llm), reference.offline)
        assert _served(llm) == reference.served


def test_expert_parallel_2_equals_one_rank_and_a_hung_rank_fails_the_server(model_dir, reference):
    layout = dict(tensor_parallel_size=2, enable_expert_parallel=True, distributed_timeout_s=HANG_TIMEOUT_S)
    with LLM(model_dir, **ENGINE, **layout) as llm:
        (rank1,) = llm.engine.workers.processes.values()

        def hang(url: str) -> None:
            os.kill(rank1.pid, signal.SIGSTOP)
            start = time.monotonic()
            request = {"model": "tiny", "prompt": "Hi", "max_tokens": 2}
            reply = httpx.post(url + "/v1/completions", json=request, timeout=60)
            assert reply.status_code == 500, reply.text
            assert time.monotonic() - start < HANG_TIMEOUT_S + 20
            assert httpx.get(url + "/health", timeout=10).status_code == 503
            rank1.join(10)
            assert not rank1.is_alive()  # killed with the engine's failure, stopped as it was

        try:
            _assert_equal(_offline(llm), reference.offline)
            assert _served(llm, then=hang) == reference.served
        finally:
            if rank1.is_alive():
                rank1.kill()


def test_two_hosts_on_localhost_equal_one_rank(model_dir, reference, tmp_path):
    port = _free_port()
    hosts = Launch(nnodes=2, node_rank=0, master_addr="127.0.0.1", master_port=port)
    engine = ENGINE | {"distributed_timeout_s": 120.0}  # host 0 waits for host 1's start at the rendezvous
    command = [sys.executable, "-m", "ds4.cli", "serve", "--model", str(model_dir), *_flags(engine)]
    command += ["--tensor-parallel-size", "2", "--nnodes", "2", "--node-rank", "1", "--master-port", str(port)]
    log = tmp_path / "host1.log"
    with open(log, "wb") as stderr:
        host1 = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=stderr)
    try:
        with LLM(model_dir, **engine, tensor_parallel_size=2, launch=hosts) as llm:
            assert llm.engine.workers.processes == {}  # rank 1 is host 1's
            _assert_equal(_offline(llm), reference.offline)
            assert _served(llm) == reference.served
        # Host 0 stopped its engine, which told host 1's rank to stop: it exits cleanly.
        assert host1.wait(timeout=30) == 0, log.read_text()[-3000:]
    finally:
        if host1.poll() is None:
            host1.kill()
            host1.wait()


def test_layout_that_does_not_split_is_refused_before_reading(tmp_path):
    # 4 heads do not split 3 ways; the error names the reason and no weight file is opened (there is none).
    model = make_tiny(tmp_path / "tiny", format="official", config_overrides=SPLITTABLE)
    for shard in model.glob("*.safetensors"):
        shard.unlink()
    with pytest.raises(EngineConfigError, match="num_attention_heads"):
        LLM(model, device="cpu", tensor_parallel_size=3)


def test_ranks_with_different_settings_are_refused():
    # Each host builds its ranks from its own flags: they must agree before the first step.
    model = SimpleNamespace(cfg=tiny_config(), dtype=torch.float32, kv_cache_dtype="bf16")
    rank0 = rank_setup(model, EngineConfig(page_size=16))
    check_same_setup([rank0, rank_setup(model, EngineConfig(page_size=16))])
    with pytest.raises(EngineConfigError, match=r"\(max_num_seqs, page_size\)"):
        check_same_setup([rank0, rank0, rank_setup(model, EngineConfig(page_size=32, max_num_seqs=2))])
    fp8 = SimpleNamespace(cfg=model.cfg, dtype=model.dtype, kv_cache_dtype="fp8")
    with pytest.raises(EngineConfigError, match=r"\(kv_cache_dtype\)"):
        check_same_setup([rank0, rank_setup(fp8, EngineConfig(page_size=16))])


def _flags(engine: dict) -> list[str]:
    """The command-line flags of these LLM keyword arguments."""
    flags = []
    for name, value in engine.items():
        flags += ["--" + name.replace("_", "-"), json.dumps(value) if isinstance(value, dict) else str(value)]
    return flags


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
