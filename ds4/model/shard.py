"""Which part of a stored tensor one rank's shard holds, and reading just that part.

A parameter of a sharded layer carries a `region` attribute (`hold`): the rows and columns of the full stored
tensor it holds. A parameter without one holds the whole tensor (every parameter at world size 1, and the
replicated ones at any size). A source is a tensor or a lazy slice (safetensors' `get_slice` semantics:
`source[rows, cols]` reads only that part, `.get_shape()` the full shape), so a rank reads only its part.

Quantised weights are read in whole scale groups (FP8 128 x 128 blocks, MXFP4 rows x 32 columns) covering the
region; a layer that keeps them quantised holds group-aligned regions only (ParallelConfig.validate), one that
dequantises them cuts the region out afterwards.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ds4.checkpoint.reader import SAFETENSORS_DTYPES


@dataclass(frozen=True)
class Region:
    """Rows (dim 0) and, for a matrix, columns (dim 1) of the full stored tensor; None: all of them."""

    rows: slice | None = None
    cols: slice | None = None


def hold(param: nn.Parameter, rows: slice | None = None, cols: slice | None = None) -> nn.Parameter:
    """Mark param as holding only rows / cols of its stored tensor (nothing to mark when both are None)."""
    if rows is not None or cols is not None:
        param.region = Region(rows, cols)
    return param


def region_of(param: torch.Tensor) -> Region | None:
    return getattr(param, "region", None)


def stored_shape(source) -> tuple[int, ...]:
    return tuple(source.shape) if isinstance(source, torch.Tensor) else tuple(source.get_shape())


def stored_dtype(source) -> torch.dtype:
    if isinstance(source, torch.Tensor):
        return source.dtype
    dtype = getattr(source, "dtype", None)
    return dtype if isinstance(dtype, torch.dtype) else SAFETENSORS_DTYPES[source.get_dtype()]


def read(source, region: Region | None) -> torch.Tensor:
    """The region of source (all of it when region is None; a tensor source is then returned as is)."""
    if region is None:
        return source if isinstance(source, torch.Tensor) else source[:]
    full = stored_shape(source)
    index = (region.rows or slice(None),)
    if len(full) > 1:
        index += (region.cols or slice(None),)
    return source[index]


def read_grouped(
    weight, scale, region: Region | None, group: tuple[int, int], packed: int = 1
) -> tuple[torch.Tensor, torch.Tensor, tuple[int, int]]:
    """The whole scale groups covering region: (stored weight, its scales, where region starts inside them).

    group: the logical rows x columns one scale covers (FP8: the block; MXFP4: 1 x 32); packed: logical columns
    per stored column (MXFP4: 2 codes a byte)."""
    if region is None:
        return read(weight, None), read(scale, None), (0, 0)
    rows, stored_cols = stored_shape(weight)
    (r0, r1), (c0, c1) = _bounds(region.rows, rows), _bounds(region.cols, stored_cols * packed)
    r0a, r1a = r0 - r0 % group[0], min(_round_up(r1, group[0]), rows)
    c0a, c1a = c0 - c0 % group[1], min(_round_up(c1, group[1]), stored_cols * packed)
    w = weight[r0a:r1a, c0a // packed : c1a // packed]
    s = scale[r0a // group[0] : -(-r1a // group[0]), c0a // group[1] : -(-c1a // group[1])]
    return w, s, (r0 - r0a, c0 - c0a)


def cut(full: torch.Tensor, offset: tuple[int, int], shape: torch.Size) -> torch.Tensor:
    """The [shape] block of a dequantised group-aligned read that the region asked for."""
    return full[offset[0] : offset[0] + shape[0], offset[1] : offset[1] + shape[1]]


def _bounds(s: slice | None, n: int) -> tuple[int, int]:
    return (0, n) if s is None else (s.start or 0, n if s.stop is None else s.stop)


def _round_up(x: int, unit: int) -> int:
    return -(-x // unit) * unit
