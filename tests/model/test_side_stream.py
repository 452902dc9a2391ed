"""The side stream: work forked onto it is ordered after the main stream's earlier work and before the main
stream's work after the join, eagerly and in a CUDA graph (the forked work is slowed down so that a missing
edge would let the main stream read too early); on the CPU the work runs where it is issued."""

import contextlib

import pytest
import torch

from ds4.model.side_stream import OVERLAP_MAX_TOKENS, SideStream

SPIN_CYCLES = 20_000_000  # ~10 ms of the side stream spinning before it writes


def test_cpu_work_runs_inline():
    side, x = SideStream(torch.device("cpu")), torch.zeros(4)
    with side.fork(1):
        x += 1
    side.join()
    assert torch.equal(x, torch.ones(4))


class _Stream:
    """Records the streams it was made to wait for."""

    def __init__(self, device):
        self.device, self.waited_for = device, []

    def wait_stream(self, other):
        self.waited_for.append(other)


def test_a_join_waits_only_for_work_forked_since_the_last_join(monkeypatch):
    """The stream calls a fork and a join make (CUDA's semantics stubbed on the CPU): a join with no fork before it
    makes the main stream wait for nothing (in a CUDA graph's capture, waiting on the side stream's earlier work,
    from outside the graph, invalidates the capture: a window layer joins without forking)."""
    main = _Stream(torch.device("cuda"))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: main)
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    side = SideStream(torch.device("cpu"))
    side.stream = _Stream(torch.device("cuda"))
    side.join()
    assert main.waited_for == [] and side.stream.waited_for == []
    with side.fork(1):
        pass
    assert side.stream.waited_for == [main] and main.waited_for == []
    side.join()
    side.join()
    assert main.waited_for == [side.stream]


def test_work_of_a_prefill_chunk_stays_on_the_main_stream(monkeypatch):
    main = _Stream(torch.device("cuda"))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: main)
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: pytest.fail("switched to the side stream"))
    side = SideStream(torch.device("cpu"))
    side.stream = _Stream(torch.device("cuda"))
    with side.fork(OVERLAP_MAX_TOKENS + 1):
        pass
    side.join()
    assert main.waited_for == [] and side.stream.waited_for == []


@pytest.mark.gpu
def test_a_graph_captures_a_join_without_a_fork_after_side_work_outside_it():
    """Side work (forked and joined) before a capture, then in the graph a join with no fork (a window layer's) and
    a fork and a join: the capture holds (a wait on the side stream's work from before it would invalidate it), and
    the replay orders the side work."""
    side = SideStream(torch.device("cuda"))
    x = torch.zeros(1 << 20, device="cuda")
    with side.fork(1):
        x.add_(1)
    side.join()
    torch.cuda.synchronize()

    def step():
        side.join()
        with side.fork(1):
            torch.cuda._sleep(SPIN_CYCLES)
            y = x + 1
        side.join()
        return y * 2

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    x.fill_(4.0)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, torch.full_like(x, 10.0))


@pytest.mark.gpu
def test_the_join_orders_the_side_work_before_what_follows():
    side = SideStream(torch.device("cuda"))
    x = torch.zeros(1 << 20, device="cuda")
    x += 3  # main-stream work the fork must wait for
    with side.fork(1):
        torch.cuda._sleep(SPIN_CYCLES)
        y = x + 1
    side.join()
    assert torch.equal(y * 2, torch.full_like(x, 8.0))


@pytest.mark.gpu
def test_a_graph_keeps_the_fork_and_the_join():
    side = SideStream(torch.device("cuda"))
    x = torch.zeros(1 << 20, device="cuda")

    def step():
        with side.fork(1):
            torch.cuda._sleep(SPIN_CYCLES)
            y = x + 1
        side.join()
        return y * 2

    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for value in (3.0, 5.0):
        x.fill_(value)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, torch.full_like(x, 2 * (value + 1)))
