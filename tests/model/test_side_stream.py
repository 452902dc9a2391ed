"""The side stream: work forked onto it is ordered after the main stream's earlier work and before the main
stream's work after the join, eagerly and in a CUDA graph (the forked work is slowed down so that a missing
edge would let the main stream read too early); on the CPU the work runs where it is issued."""

import pytest
import torch

from ds4.model.side_stream import SideStream

SPIN_CYCLES = 20_000_000  # ~10 ms of the side stream spinning before it writes


def test_cpu_work_runs_inline():
    side, x = SideStream(torch.device("cpu")), torch.zeros(4)
    with side.fork():
        x += 1
    side.join()
    assert torch.equal(x, torch.ones(4))


@pytest.mark.gpu
def test_the_join_orders_the_side_work_before_what_follows():
    side = SideStream(torch.device("cuda"))
    x = torch.zeros(1 << 20, device="cuda")
    x += 3  # main-stream work the fork must wait for
    with side.fork():
        torch.cuda._sleep(SPIN_CYCLES)
        y = x + 1
    side.join()
    assert torch.equal(y * 2, torch.full_like(x, 8.0))


@pytest.mark.gpu
def test_a_graph_keeps_the_fork_and_the_join():
    side = SideStream(torch.device("cuda"))
    x = torch.zeros(1 << 20, device="cuda")

    def step():
        with side.fork():
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
