"""How rank 0 tells the other ranks of a tensor-parallel engine what to run: pickled messages broadcast over gloo.

Every rank runs the same model calls in the same order (the collectives inside them pair up); only rank 0
schedules and samples. Before each mirrored call rank 0 broadcasts its arguments (ds4.engine.model_runner's
`Step`, then `DraftInputs`) and the other ranks replay it. The messages are host data of a few KB (a decode
step of 64 requests: ~3 KB), so they go through a gloo group of their own even when the model's collectives
run on NCCL: gloo works on host memory over TCP, joins through the same rendezvous as the model's group
(one host or several), needs no device copy or sync before a worker knows the step's shapes, and a rank whose
peer process died gets an error instead of a hang. A pipe would serve one host only; NCCL would hold the
workers' GPUs in a kernel while idle and abort them after its watchdog timeout.

A message fits one broadcast of a fixed buffer when small (the step of a decode batch); a larger one (a long
prefill chunk's token ids) takes a second broadcast of its exact size. Rank 0 does not wait for a broadcast to
finish: it goes on with its own model call and waits only before it reuses the buffer for the next message
(then that message was long received: the model call's collectives needed every rank). The group's timeout is
long: idle workers wait in `recv` for as long as the server has no request.
"""

from __future__ import annotations

import pickle
from datetime import timedelta

import torch
import torch.distributed as dist

INLINE_BYTES = 16 << 10
_LENGTH_BYTES = 8
# Idle workers wait for the next step this long; a dead rank 0 ends the wait earlier (gloo's closed connection).
IDLE_TIMEOUT = timedelta(days=365)


class RanksOutOfStep(RuntimeError):
    """A mirrored model call failed on rank 0 (a rank died or hung, a collective failed): the ranks' collectives
    no longer pair up, so the engine cannot run another step."""


class StepChannel:
    """Rank 0 `send`s, every other rank `recv`s the same messages in the same order."""

    def __init__(self, rank: int, world_size: int):
        """Collective: every rank of the default process group builds its channel at the same point."""
        self.rank, self.world_size = rank, world_size
        self.group = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
        self._buffer = torch.empty(INLINE_BYTES, dtype=torch.uint8)
        self.bytes_sent = 0
        self._pending: list = []

    def send(self, message) -> None:
        self.flush()
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        n = len(data)
        inline = n <= INLINE_BYTES - _LENGTH_BYTES
        head = n.to_bytes(_LENGTH_BYTES, "little") + (data if inline else b"")
        self._buffer[: len(head)] = torch.frombuffer(bytearray(head), dtype=torch.uint8)
        self._pending = [(dist.broadcast(self._buffer, src=0, group=self.group, async_op=True), None)]
        if not inline:
            payload = torch.frombuffer(bytearray(data), dtype=torch.uint8)
            # The payload travels with its work, so it lives until the broadcast is done.
            self._pending.append((dist.broadcast(payload, src=0, group=self.group, async_op=True), payload))
        self.bytes_sent += n

    def flush(self) -> None:
        """Wait until the messages sent so far have left (raises if a rank is gone)."""
        for work, _ in self._pending:
            work.wait()
        self._pending = []

    def recv(self):
        dist.broadcast(self._buffer, src=0, group=self.group)
        n = int.from_bytes(self._buffer[:_LENGTH_BYTES].numpy().tobytes(), "little")
        if n <= INLINE_BYTES - _LENGTH_BYTES:
            data = self._buffer[_LENGTH_BYTES : _LENGTH_BYTES + n].numpy().tobytes()
        else:
            payload = torch.empty(n, dtype=torch.uint8)
            dist.broadcast(payload, src=0, group=self.group)
            data = payload.numpy().tobytes()
        return pickle.loads(data)

    def all_gather(self, obj) -> list:
        """Every rank's `obj`, in rank order, on every rank (start-up agreements such as the cache plan)."""
        gathered = [None] * self.world_size
        dist.all_gather_object(gathered, obj, group=self.group)
        return gathered
