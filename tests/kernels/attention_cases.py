"""Sparse-attention inputs laid out as DeepSeek-V4 attends, built by hand for the kernel tests (CPU and GPU).

A batch of requests, each bringing `new` tokens after `context` cached ones. A token at position p attends to
the window (positions p - window + 1 .. p: those before the step from its request's ring, row
slot * ring_rows + q % ring_rows; those in the step from the step's keys, row start + q - context) and, on
compressed layers, to entries i < (p + 1) // ratio of its request's pages (HCA: all of them; CSA: a random
top-k choice among them, -1 padded and shuffled).
"""

from dataclasses import dataclass

import torch

from ds4.kernels.fp8_kv import quantize_kv


@dataclass
class Case:
    q: torch.Tensor  # [T, H, D]
    key_sets: list  # [(pool, indices [T, K])]
    sink: torch.Tensor  # [H]
    rope_dim: int | None  # set when the pools hold FP8 entries


def build_case(
    requests: list[tuple[int, int]],
    heads: int,
    head_dim: int,
    kind: str,  # "window", "csa" or "hca"
    window: int = 8,
    ratio: int = 4,
    topk: int = 6,
    per_page: int = 4,
    fp8: bool = False,
    rope_dim: int = 64,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    seed: int = 0,
) -> Case:
    gen = torch.Generator().manual_seed(seed)
    total = sum(n for _, n in requests)
    ring_rows = window + 2
    ring_idx, fresh_idx, comp_idx = [], [], []
    fresh_width = min(window, max(n for _, n in requests))
    comp_width = 0
    pages_used = 0
    tables = []
    for context, new in requests:
        pages = -(-(context + new) // (ratio * per_page)) if kind != "window" else 0
        tables.append(torch.randperm(pages, generator=gen) + pages_used)
        pages_used += pages
    start = 0
    for r, (context, new) in enumerate(requests):
        pos = torch.arange(context, context + new)[:, None]
        q_pos = pos - window + 1 + torch.arange(window)[None, :]
        ring_idx.append(torch.where((q_pos >= 0) & (q_pos < context), r * ring_rows + q_pos % ring_rows, -1))
        f_pos = pos - fresh_width + 1 + torch.arange(fresh_width)[None, :]
        fresh_idx.append(torch.where(f_pos >= context, start + f_pos - context, -1))
        if kind != "window":
            visible = (pos[:, 0] + 1) // ratio
            rows = []
            for v in visible.tolist():
                entries = torch.arange(v)
                if kind == "csa":
                    entries = entries[torch.randperm(v, generator=gen)[:topk]]
                    entries = torch.cat([entries, torch.full((topk - len(entries),), -1)])
                    entries = entries[torch.randperm(topk, generator=gen)]
                page = tables[r][entries.clamp_min(0) // per_page]
                rows.append(torch.where(entries >= 0, page * per_page + entries % per_page, -1))
            comp_idx.append(rows)
            comp_width = max(comp_width, max(len(x) for x in rows))
        start += new
    key_sets = [
        (torch.randn(len(requests) * ring_rows, head_dim, generator=gen), torch.cat(ring_idx)),
        (torch.randn(total, head_dim, generator=gen), torch.cat(fresh_idx)),
    ]
    if kind != "window":
        padded = [torch.cat([x, torch.full((comp_width - len(x),), -1)]) for rows in comp_idx for x in rows]
        pool = torch.randn(max(1, pages_used) * per_page, head_dim, generator=gen)
        key_sets.append((pool, torch.stack(padded)))
    if fp8:
        key_sets = [(quantize_kv(kv, rope_dim), idx) for kv, idx in key_sets]
    else:
        key_sets = [(kv.to(dtype), idx) for kv, idx in key_sets]
    q = torch.randn(total, heads, head_dim, generator=gen) * 2
    sink = torch.randn(heads, generator=gen)
    return Case(
        q.to(dtype).to(device),
        [(kv.to(device), idx.to(device)) for kv, idx in key_sets],
        sink.to(device),
        rope_dim if fp8 else None,
    )
