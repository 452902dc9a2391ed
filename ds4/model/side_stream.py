"""Independent work beside the main stream: on CUDA a second stream runs it, so that two short, latency-bound
chains of launches (a decode step's) overlap instead of following each other; the main stream waits for it
before reading its results. Work of more than OVERLAP_MAX_TOKENS tokens (a prefill chunk's) runs on the main
stream: its launches fill the GPU on their own, and two streams of them only contend (an 8K prefill of 16 Flash
layers on an H100 at e923bad: 0.250 s with the overlaps, 0.243 without). In a CUDA graph the fork and the join
are captured as the graph's edges. Elsewhere a no-op: the work runs where it is issued.

Kernels that share a device-wide resource (ds4.kernels._device.arrival_counters) must not run on both streams at
once, and the side stream's work may make a batch's shared values (ForwardBatch.shared) that the main stream
reads only after the join: the side stream's work is chosen so (the shared expert's linears beside the router
and the routed experts, whose kernels use no counters; a layer's compressor and its attention entries' norm and
RoPE, which use none, beside its query projections)."""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator

import torch

# False: forked work runs on the main stream, to time a step without the overlaps (`ds4 bench model --serial` sets
# DS4_SIDE_STREAM=0, which the ranks' processes inherit).
OVERLAP = os.environ.get("DS4_SIDE_STREAM", "1") != "0"
OVERLAP_MAX_TOKENS = 256  # decode batches (a request's speculative tokens included); prefill chunks are thousands


class SideStream:
    def __init__(self, device: torch.device):
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" and OVERLAP else None
        self.forked = False

    @contextlib.contextmanager
    def fork(self, tokens: int) -> Iterator[None]:
        """Work issued inside runs on the side stream, after everything issued on the current stream so far (on
        the current stream itself for more than OVERLAP_MAX_TOKENS tokens)."""
        if self.stream is None or tokens > OVERLAP_MAX_TOKENS:
            yield
            return
        self.stream.wait_stream(torch.cuda.current_stream(self.stream.device))
        self.forked = True
        with torch.cuda.stream(self.stream):
            yield

    def join(self) -> None:
        """The current stream's later work waits for the side stream's work since the last join; nothing without a
        fork since (a join of a layer that forked nothing must not wait on older work: in a CUDA graph's capture
        that may be work outside the graph, which invalidates the capture)."""
        if self.forked:
            torch.cuda.current_stream(self.stream.device).wait_stream(self.stream)
            self.forked = False


@functools.cache
def side_stream(device: torch.device) -> SideStream:
    """The device's side stream (one: every fork is joined before the next)."""
    return SideStream(device)
