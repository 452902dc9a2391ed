"""Read a DeepSeek-V4 model directory as a stream of (official name, stored tensor), one pass over its shards.

Both layouts are read: the official hub format (FP8 block-scaled linears, FP8 or MXFP4 routed experts, `mtp.0.*`)
and transformers' `save_pretrained` format (dequantised, `model.`-prefixed names). The expected tensor list
comes from the config (`ds4.checkpoint.weights_spec`), so every problem is found from the index and the shard headers
before a single data byte is read, and reported together in one CheckpointError.

Which tensors are read is decided from names alone: `mtp.*` only with `with_mtp=True`, and a shard holding nothing
needed is never opened. Each needed shard is opened once, its header parsed, and its tensors read in file order
with plain `readinto` calls, counted per tensor in `ReadStats` so the byte traffic is observable. Tensors come
as stored (FP8 / MXFP4 weights next to their `.scale`): the model keeps or dequantises them as it loads.

`lazy=True` yields `StoredSlice`s instead (safetensors' `get_slice` semantics): nothing is read until the
consumer indexes one, and then only the rows and columns it asks for (a rank of a sharded model its part).
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

import torch
from tqdm import tqdm

from ds4.checkpoint import hf_names
from ds4.checkpoint.weights_spec import INDEX, expected_parameter_shapes, stored_tensor_specs
from ds4.config import ModelConfig, load_config

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
OFFICIAL, HF = "official", "hf"
MTP_PREFIX = "mtp."

SAFETENSORS_DTYPES = {
    "BOOL": torch.bool,
    "U8": torch.uint8,
    "I8": torch.int8,
    "I16": torch.int16,
    "U16": torch.uint16,
    "I32": torch.int32,
    "U32": torch.uint32,
    "I64": torch.int64,
    "U64": torch.uint64,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F32": torch.float32,
    "F64": torch.float64,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "F8_E8M0": torch.float8_e8m0fnu,
}
_HF_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_INT_DTYPES = (torch.int32, torch.int64)
# A safetensors header is JSON of ~100 bytes per tensor; anything far larger is a corrupt length field.
_MAX_HEADER_BYTES = 1 << 30


class CheckpointError(ValueError):
    """A model directory that does not hold the checkpoint its config describes."""


@dataclass
class ReadStats:
    """What a load touched: shard files in the order opened, and data bytes read per stored tensor name."""

    shards_opened: list[str] = field(default_factory=list)
    bytes_read: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class _Entry:
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int
    end: int


@dataclass(frozen=True)
class _Expected:
    shape: tuple[int, ...]
    dtypes: tuple[torch.dtype, ...]


def detect_format(model_dir: str | Path) -> str:
    """OFFICIAL or HF, from the tensor names the index (or the single shard's header) lists."""
    return _format_of(_weight_map(Path(model_dir)))


def _format_of(weight_map: dict[str, str]) -> str:
    return HF if any(hf_names.is_transformers_name(n) for n in weight_map) else OFFICIAL


def load_checkpoint(
    model_dir: str | Path,
    config: ModelConfig | None = None,
    *,
    with_mtp: bool = False,
    progress: bool = True,
    stats: ReadStats | None = None,
    lazy: bool = False,
) -> Iterator[tuple[str, torch.Tensor]] | Iterator[tuple[str, StoredSlice]]:
    """(official name, stored CPU tensor) pairs for `DeepseekV4Model.load_weights`, one tensor at a time.

    Everything is checked against the config from the index and the shard headers first: this call raises
    CheckpointError before a data byte is read. An official checkpoint's tensors come as written (FP8 / MXFP4
    weights and their float8_e8m0fnu `.scale`s, bf16, fp32, int32); a transformers-format checkpoint's come
    under official names in the float dtype it was saved in. lazy: StoredSlices to index within the iteration
    (the shards close when it ends).
    """
    model_dir = Path(model_dir)
    cfg = config if config is not None else load_config(model_dir)
    weight_map = _weight_map(model_dir)
    fmt = _format_of(weight_map)
    if with_mtp and cfg.num_mtp_layers < 1:
        raise CheckpointError(
            f"{model_dir}: with_mtp=True, but the config has no MTP layer (num_nextn_predict_layers 0)"
        )
    expected = _expected_stored(cfg, fmt, with_mtp)
    stats = stats if stats is not None else ReadStats()
    files = ExitStack()
    try:
        plan = _plan_reads(model_dir, weight_map, expected, with_mtp, files, stats)
    except BaseException:
        files.close()
        raise
    return (_stream_lazy if lazy else _stream)(plan, fmt, files, stats, progress)


def _expected_stored(cfg: ModelConfig, fmt: str, with_mtp: bool) -> dict[str, _Expected]:
    """Stored name -> allowed shape and dtypes. The hf format is dequantised and may be saved in any float dtype."""
    if fmt == OFFICIAL:
        out = {}
        for name, s in stored_tensor_specs(cfg, with_mtp).items():
            out[name] = _Expected(s.shape, _INT_DTYPES if s.dtype in _INT_DTYPES else (s.dtype,))
        return out
    return {
        hf_names.official_to_saved(name): _Expected(s.shape, _INT_DTYPES if s.kind == INDEX else _HF_FLOAT_DTYPES)
        for name, s in expected_parameter_shapes(cfg, with_mtp).items()
    }


def _weight_map(model_dir: Path) -> dict[str, str]:
    """Tensor name -> shard file name."""
    index = model_dir / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index}: not a safetensors index (needs a 'weight_map' object): {e}") from e
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise CheckpointError(f"{index}: 'weight_map' must map tensor names to shard file names")
        return weight_map
    single = model_dir / SINGLE_FILE
    if single.is_file():
        with open(single, "rb") as f:
            entries, _ = _read_header(f, os.fstat(f.fileno()).st_size, SINGLE_FILE)
        return {name: SINGLE_FILE for name in entries}
    raise CheckpointError(f"{model_dir}: no {INDEX_FILE} or {SINGLE_FILE}")


_Plan = list[tuple[BinaryIO, list[tuple[str, _Entry]], int]]


def _plan_reads(
    model_dir: Path,
    weight_map: dict[str, str],
    expected: dict[str, _Expected],
    with_mtp: bool,
    files: ExitStack,
    stats: ReadStats,
) -> _Plan:
    """Validate everything from the index and headers; per needed shard (opened into `files`), its reads."""
    problems: list[str] = []
    wanted = {n: s for n, s in weight_map.items() if with_mtp or not n.startswith(MTP_PREFIX)}
    missing = sorted(set(expected) - set(wanted))
    if missing:
        problems.append(f"missing tensors ({len(missing)}): {_listing(missing)}")
    unexpected = sorted(set(wanted) - set(expected))
    if unexpected:
        problems.append(f"unexpected tensors ({len(unexpected)}): {_listing(unexpected)}")
    by_shard: dict[str, list[str]] = {}
    for name in sorted(set(wanted) & set(expected)):
        by_shard.setdefault(wanted[name], []).append(name)
    plan: _Plan = []
    for shard, names in sorted(by_shard.items()):
        path = model_dir / shard
        if not path.is_file():
            problems.append(
                f"shard {shard} (listed in the index for {len(names)} tensors, e.g. {names[0]}) does not exist"
            )
            continue
        f = files.enter_context(open(path, "rb"))
        stats.shards_opened.append(shard)
        try:
            entries, data_start = _read_header(f, os.fstat(f.fileno()).st_size, shard)
        except CheckpointError as e:
            problems.append(str(e))
            continue
        reads = []
        for name in names:
            problem = _check_entry(shard, name, entries.get(name), expected[name])
            if problem:
                problems.append(problem)
            else:
                reads.append((name, entries[name]))
        plan.append((f, sorted(reads, key=lambda r: r[1].begin), data_start))
    if problems:
        raise CheckpointError(f"{model_dir}: cannot load the checkpoint:\n  - " + "\n  - ".join(problems))
    return plan


def _stream(
    plan: _Plan, fmt: str, files: ExitStack, stats: ReadStats, progress: bool
) -> Iterator[tuple[str, torch.Tensor]]:
    with files:
        total = sum(e.end - e.begin for _, reads, _ in plan for _, e in reads)
        with tqdm(total=total, unit="B", unit_scale=True, desc="loading weights", disable=not progress) as bar:
            for f, reads, data_start in plan:
                for name, entry in reads:
                    tensor = _read_tensor(f, data_start, entry)
                    stats.bytes_read[name] = stats.bytes_read.get(name, 0) + entry.end - entry.begin
                    bar.update(entry.end - entry.begin)
                    yield (hf_names.saved_to_official(name) if fmt == HF else name), tensor


def _stream_lazy(
    plan: _Plan, fmt: str, files: ExitStack, stats: ReadStats, progress: bool
) -> Iterator[tuple[str, StoredSlice]]:
    with files, tqdm(unit="B", unit_scale=True, desc="loading weights", disable=not progress) as bar:
        for f, reads, data_start in plan:
            for name, entry in reads:
                stored = StoredSlice(f, data_start, entry, name, stats)
                yield (hf_names.saved_to_official(name) if fmt == HF else name), stored
                bar.update(stats.bytes_read.get(name, 0))


class StoredSlice:
    """One tensor of an open shard, not read yet: `[index]` reads only the part indexed (slices of step 1 over
    the first two dims), `.get_shape()` / `.get_dtype()` as safetensors' slices. Bytes read go to the stats."""

    def __init__(self, f: BinaryIO, data_start: int, entry: _Entry, name: str, stats: ReadStats):
        self.f, self.data_start, self.entry, self.name, self.stats = f, data_start, entry, name, stats

    @property
    def dtype(self) -> torch.dtype:
        return self.entry.dtype

    def get_shape(self) -> list[int]:
        return list(self.entry.shape)

    def get_dtype(self) -> str:
        return next(k for k, v in SAFETENSORS_DTYPES.items() if v == self.entry.dtype)

    def __getitem__(self, index) -> torch.Tensor:
        shape = self.entry.shape
        index = index if isinstance(index, tuple) else (index,)
        if len(index) > len(shape) or (len(index) > 2 and any(s != slice(None) for s in index[2:])):
            raise IndexError(f"{self.name}: a stored slice takes slices of the first two dims only, got {index}")
        spans = [_span(s, n, self.name) for s, n in zip(index, shape)] + [(0, n) for n in shape[len(index) :]]
        (r0, r1), rest = spans[0], shape[1:]
        row_elems = 1
        for n in rest:
            row_elems *= n
        size = self.entry.dtype.itemsize
        if len(shape) < 2 or spans[1] == (0, shape[1]):
            data = self._read(r0 * row_elems * size, (r1 - r0) * row_elems * size)
            return _as_tensor(data, self.entry.dtype, (r1 - r0, *rest))
        (c0, c1), inner = spans[1], row_elems // shape[1]
        out = bytearray()
        for r in range(r0, r1):
            out += self._read((r * row_elems + c0 * inner) * size, (c1 - c0) * inner * size)
        return _as_tensor(out, self.entry.dtype, (r1 - r0, c1 - c0, *shape[2:]))

    def _read(self, offset: int, size: int) -> bytearray:
        buffer = bytearray(size)
        self.f.seek(self.data_start + self.entry.begin + offset)
        if self.f.readinto(buffer) != size:
            raise CheckpointError(f"{self.f.name}: file shrank while reading {self.name}")
        self.stats.bytes_read[self.name] = self.stats.bytes_read.get(self.name, 0) + size
        return buffer


def _span(s: slice, n: int, name: str) -> tuple[int, int]:
    if not isinstance(s, slice) or s.step not in (None, 1):
        raise IndexError(f"{name}: a stored slice takes slices of step 1, got {s!r}")
    start, stop, _ = s.indices(n)
    return start, max(start, stop)


def _as_tensor(data: bytearray, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    if not data:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(data, dtype=torch.uint8).view(dtype).reshape(shape)


def _check_entry(shard: str, name: str, entry: _Entry | None, want: _Expected) -> str | None:
    if entry is None:
        return f"{name}: the index places it in {shard}, whose header does not list it"
    if entry.shape != want.shape:
        return f"{name}: shape {list(entry.shape)}, expected {list(want.shape)}"
    if entry.dtype not in want.dtypes:
        allowed = " or ".join(str(d).removeprefix("torch.") for d in want.dtypes)
        return f"{name}: dtype {str(entry.dtype).removeprefix('torch.')}, expected {allowed}"
    return None


def _read_header(f: BinaryIO, file_size: int, shard: str) -> tuple[dict[str, _Entry], int]:
    """Parse a safetensors header and check it against the file size: name -> entry, and where data starts."""
    head = f.read(8)
    if len(head) < 8:
        raise CheckpointError(f"shard {shard}: truncated ({file_size} bytes; not even a safetensors header length)")
    (n,) = struct.unpack("<Q", head)
    if n > min(_MAX_HEADER_BYTES, file_size - 8):
        raise CheckpointError(
            f"shard {shard}: corrupt or truncated safetensors header (claims {n} bytes, file has {file_size})"
        )
    try:
        header = json.loads(f.read(n))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"shard {shard}: corrupt safetensors header: {e}") from e
    if not isinstance(header, dict):
        raise CheckpointError(f"shard {shard}: corrupt safetensors header (not a JSON object)")
    entries = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        entries[name] = _parse_entry(shard, name, info)
    data_start = 8 + n
    data_size = max((e.end for e in entries.values()), default=0)
    if data_start + data_size != file_size:
        state = "truncated" if data_start + data_size > file_size else "corrupt (trailing bytes)"
        raise CheckpointError(
            f"shard {shard}: {state}: the header needs {data_start + data_size} bytes, the file has {file_size}"
        )
    return entries, data_start


def _parse_entry(shard: str, name: str, info: object) -> _Entry:
    try:
        dtype = SAFETENSORS_DTYPES[info["dtype"]]
        shape = tuple(int(d) for d in info["shape"])
        begin, end = (int(x) for x in info["data_offsets"])
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"shard {shard}: corrupt safetensors header entry for {name}: {info!r}") from e
    numel = 1
    for d in shape:
        numel *= d
    if end - begin != numel * dtype.itemsize or begin < 0:
        raise CheckpointError(
            f"shard {shard}: corrupt safetensors header: {name} has offsets [{begin}, {end}) for "
            f"{numel} x {dtype.itemsize} bytes"
        )
    return _Entry(dtype, shape, begin, end)


def _read_tensor(f: BinaryIO, data_start: int, entry: _Entry) -> torch.Tensor:
    size = entry.end - entry.begin
    buffer = bytearray(size)
    f.seek(data_start + entry.begin)
    if f.readinto(buffer) != size:
        raise CheckpointError(f"{f.name}: file shrank while reading")
    return _as_tensor(buffer, entry.dtype, entry.shape)


def _listing(names: list[str], limit: int = 20) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f", ... ({len(names) - limit} more)" if len(names) > limit else "")
