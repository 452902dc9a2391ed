"""Small host values (a step's flat batch, rows to pick, sampling columns) to device tensors in one copy.

Built as fresh tensors, each list would cost a pinned allocation and a copy, or a copy from pageable memory
that blocks the host until the whole stream has drained (the forward included). `upload` packs the lists
(with Python's array module, no torch call per list) into a persistent pinned ring buffer (one per device) and
copies them to the device in one non-blocking transfer; the returned tensors are views of one fresh device
buffer, so later uploads never change them. Ring bytes are written again only after the copy that read them has
run (an event per upload), so the host never overwrites data still in flight. On CPU the lists simply become tensors.

`upload_into` packs the same way into a device buffer that outlives the upload (a CUDA graph's inputs), where
`views` of that buffer find the fields: one copy writes them all.
"""

from __future__ import annotations

import threading
from array import array
from collections import deque
from collections.abc import Sequence
from functools import cache

import torch

# Every field starts 16-byte aligned: a valid view of the byte buffer for any dtype, and the alignment Triton
# specialises pointers on (so kernels see the same alignment as for a fresh allocation).
_ALIGN = 16
_ARRAY_CODES = {torch.int32: "i", torch.long: "q", torch.float32: "f", torch.float64: "d"}


def upload(device: torch.device, *fields: tuple[Sequence[int] | Sequence[float], torch.dtype]) -> list[torch.Tensor]:
    """One 1-D tensor on `device` per (values, dtype), in order; on CUDA all in one non-blocking copy."""
    if device.type != "cuda":
        return [torch.tensor(values, dtype=dtype, device=device) for values, dtype in fields]
    return _uploader(device).upload(*fields)


def upload_into(buffer: torch.Tensor, *fields: tuple[Sequence[int] | Sequence[float], torch.dtype]) -> None:
    """The fields packed into the start of `buffer` (bytes, where `views` finds them) in one copy: on CUDA a
    non-blocking one, queued on the current stream after the work already there (which may still read the buffer)."""
    if buffer.device.type != "cuda":
        payload, _ = pack(fields)
        if payload:
            buffer[: len(payload)].copy_(torch.frombuffer(payload, dtype=torch.uint8))
        return
    _uploader(buffer.device).upload_into(buffer, *fields)


def padded(values: Sequence[int], dtype: torch.dtype, length: int, fill: int) -> tuple[array, torch.dtype]:
    """The field of `values`, then `fill` up to `length` values: repeated in C, not converted value by value."""
    code = _ARRAY_CODES[dtype]
    return array(code, values) + array(code, [fill]) * (length - len(values)), dtype


def layout(sizes: Sequence[tuple[int, torch.dtype]]) -> tuple[list[int], int]:
    """Where `pack` puts fields of these (length, dtype): each one's byte offset, and the bytes of all."""
    starts, end = [], 0
    for length, dtype in sizes:
        starts.append(end)
        end += length * dtype.itemsize
        end += -end % _ALIGN  # the next field starts aligned
    return starts, end


def views(buffer: torch.Tensor, sizes: Sequence[tuple[int, torch.dtype]]) -> list[torch.Tensor]:
    """The 1-D tensors of `buffer` (bytes) that hold fields of these (length, dtype) once packed into it."""
    return _views(buffer, sizes, layout(sizes)[0])


def pack(fields: Sequence[tuple[Sequence[int] | Sequence[float], torch.dtype]]) -> tuple[bytearray, list[int]]:
    """The fields' values end to end as native bytes, each field starting _ALIGN-aligned, and each one's offset.
    Python's array module packs a list in C: a field costs no torch call (one each would cost more than the copy)."""
    starts, size = layout([(len(values), dtype) for values, dtype in fields])
    payload = bytearray(size)
    for (values, dtype), start in zip(fields, starts):
        data = array(_ARRAY_CODES[dtype], values).tobytes()
        payload[start : start + len(data)] = data
    return payload, starts


def _views(buffer: torch.Tensor, sizes: Sequence[tuple[int, torch.dtype]], starts: list[int]) -> list[torch.Tensor]:
    return [buffer[s : s + length * dtype.itemsize].view(dtype) for (length, dtype), s in zip(sizes, starts)]


@cache
def _uploader(device: torch.device) -> Uploader:
    return Uploader(device)


class Uploader:
    """The pinned ring of one CUDA device."""

    def __init__(self, device: torch.device, capacity: int = 1 << 20):
        self.device = device
        self._ring = torch.empty(capacity, dtype=torch.uint8, pin_memory=True)
        self._offset = 0
        self._in_flight: deque[tuple[int, int, torch.cuda.Event]] = deque()  # (start, end, copy done), oldest first
        self._lock = threading.Lock()

    def upload(self, *fields: tuple[Sequence[int] | Sequence[float], torch.dtype]) -> list[torch.Tensor]:
        with self._lock:
            first, host, starts = self._stage(fields)
            device = host.to(self.device, non_blocking=True)
            self._copied(first, host.numel())
        return _views(device, [(len(values), dtype) for values, dtype in fields], starts)

    def upload_into(self, buffer: torch.Tensor, *fields: tuple[Sequence[int] | Sequence[float], torch.dtype]) -> None:
        with self._lock:
            first, host, _ = self._stage(fields)
            buffer[: host.numel()].copy_(host, non_blocking=True)
            self._copied(first, host.numel())

    def _stage(self, fields) -> tuple[int, torch.Tensor, list[int]]:
        """The fields packed into the ring: (offset, bytes, each field's offset in them)."""
        payload, starts = pack(fields)
        first, host = self._reserve(len(payload))
        if payload:
            host.copy_(torch.frombuffer(payload, dtype=torch.uint8))
        return first, host, starts

    def _copied(self, first: int, size: int) -> None:
        """A copy of the ring's bytes first:first + size is queued: they are written again only once it has run."""
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(self.device))
        self._in_flight.append((first, first + size, done))

    def _reserve(self, size: int) -> tuple[int, torch.Tensor]:
        """(offset, bytes) of the next `size` bytes of the ring (from its start when they do not fit before its
        end), once no copy in flight reads them."""
        while self._in_flight and self._in_flight[0][2].query():
            self._in_flight.popleft()
        if size > self._ring.numel():
            for _, _, done in self._in_flight:
                done.synchronize()
            self._in_flight.clear()
            self._ring = torch.empty(2 * size, dtype=torch.uint8, pin_memory=True)
            self._offset = 0
        start = self._offset if self._offset + size <= self._ring.numel() else 0
        end = self._offset = start + size
        for first, last, done in self._in_flight:
            if first < end and start < last:
                done.synchronize()
        return start, self._ring[start:end]
