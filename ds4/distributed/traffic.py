"""The collective traffic of one forward of a sharded model, from its config alone.

What the model calls (ds4.model; counted the same way as Parallel.bytes_moved, the bytes each rank passes
in): the embedding all-reduces its [T, D] rows; every block all-reduces its attention output and its MoE
output, [T, D] each (expert parallel moves the same bytes: every rank already holds every token, so the
dispatch is free and the combine is the MoE's all-reduce); the head all-gathers [R, V / N] fp32 logits of
the R rows asked for; the MTP layer adds its embedding, its block and its logits.

On the wire, ring algorithms send per rank 2 (N - 1) / N of an all-reduce's payload and (N - 1) times an
all-gather's; `wire_bytes` is that, the figure an interconnect's one-way bandwidth divides.
"""

from __future__ import annotations

from dataclasses import dataclass

from ds4.config import ModelConfig
from ds4.distributed.parallel import ALL_GATHER, ALL_REDUCE, COLLECTIVES, REDUCE_SCATTER, ParallelConfig

LOGIT_BYTES = 4  # the head computes fp32 logits


@dataclass(frozen=True)
class Traffic:
    """Per collective kind: calls and payload bytes per rank (the tensors passed in), for one world size."""

    world_size: int
    calls: dict[str, int]
    payload: dict[str, int]

    @property
    def total_calls(self) -> int:
        return sum(self.calls.values())

    @property
    def total_payload(self) -> int:
        return sum(self.payload.values())

    @property
    def wire_bytes(self) -> float:
        """Bytes each rank sends with ring algorithms."""
        n = self.world_size
        share = {ALL_REDUCE: 2 * (n - 1) / n, ALL_GATHER: n - 1, REDUCE_SCATTER: (n - 1) / n}
        return sum(share[kind] * self.payload[kind] for kind in COLLECTIVES)

    def __add__(self, other: Traffic) -> Traffic:
        return Traffic(
            self.world_size,
            {k: self.calls[k] + other.calls[k] for k in COLLECTIVES},
            {k: self.payload[k] + other.payload[k] for k in COLLECTIVES},
        )


def forward_traffic(
    cfg: ModelConfig,
    pc: ParallelConfig,
    tokens: int,
    logit_rows: int,
    act_bytes: int = 2,
    mtp: bool = False,
) -> Traffic:
    """One forward of `tokens` tokens (the embedding and every main block), the logits of `logit_rows` rows, and
    with mtp one MTP forward of the same tokens and its logits. act_bytes: the activations' dtype size."""
    n = pc.world_size
    calls, payload = dict.fromkeys(COLLECTIVES, 0), dict.fromkeys(COLLECTIVES, 0)
    if n == 1:
        return Traffic(n, calls, payload)
    row = tokens * cfg.hidden_size * act_bytes
    passes = (cfg.num_hidden_layers, 1) if mtp else (cfg.num_hidden_layers,)
    for blocks in passes:
        # The embedding, then attention and MoE of each block.
        calls[ALL_REDUCE] += 1 + 2 * blocks
        payload[ALL_REDUCE] += (1 + 2 * blocks) * row
        calls[ALL_GATHER] += 1
        payload[ALL_GATHER] += logit_rows * (cfg.vocab_size // n) * LOGIT_BYTES
    return Traffic(n, calls, payload)


def decode_step_traffic(cfg: ModelConfig, pc: ParallelConfig, batch: int, act_bytes: int = 2) -> Traffic:
    """A decode step of `batch` requests: one token and one row of logits each."""
    return forward_traffic(cfg, pc, batch, batch, act_bytes)


def prefill_traffic(cfg: ModelConfig, pc: ParallelConfig, tokens: int, act_bytes: int = 2) -> Traffic:
    """The prefill of one `tokens`-token prompt: the logits of its last position only."""
    return forward_traffic(cfg, pc, tokens, 1, act_bytes)
