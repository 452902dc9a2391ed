"""AsyncEngine: the LLMEngine behind an asyncio front, for the server.

The engine steps in its own thread; the event loop only queues commands (add, abort) and receives
each step's outputs through `call_soon_threadsafe`, so it never waits on the model. Each request's
outputs arrive on its own async iterator, which ends with the finished output; leaving the iteration
early (a client that disconnects) aborts the request.

The engine dies when its thread stops on an error or, with tensor parallelism, when a rank fails (its monitor
reports at once, even while the thread is blocked in a collective): every waiting request gets the error, later
ones are refused, and the `on_dead` listeners (the server: 503 on /health, then exit) are called once.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator

from ds4.engine.engine import EngineStats, LLMEngine, RequestOutput
from ds4.engine.sampling_params import SamplingParams
from ds4.engine.step_channel import RanksOutOfStep

logger = logging.getLogger(__name__)

_ADD, _ABORT, _STOP = "add", "abort", "stop"


class EngineDeadError(RuntimeError):
    """The engine thread stopped on an unexpected error; no request can run any more."""


class AsyncEngine:
    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self._commands: queue.Queue = queue.Queue()
        self._streams: dict[str, asyncio.Queue] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stats = engine.stats()
        self.error: BaseException | None = None
        self._dead_listeners: list = []
        self._death = threading.Lock()
        if engine.workers is not None:
            engine.workers.on_fault(lambda reason: self._die(RanksOutOfStep(reason)))

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def stats(self) -> EngineStats:
        """The statistics after the latest step (a snapshot; never waits for the engine)."""
        return self._stats

    async def add_request(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams | None = None
    ) -> AsyncIterator[RequestOutput]:
        """Check and queue a request; returns the iterator of its outputs. Raises ValueError at once for a
        request the engine would refuse (RequestRejected if it can never run)."""
        if self.error is not None:
            raise EngineDeadError(f"the engine stopped: {self.error!r}")
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        params = params or SamplingParams()
        self.engine.check_request(request_id, prompt_token_ids, params)
        self._ensure_started()
        stream: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = stream
        self._commands.put((_ADD, request_id, list(prompt_token_ids), params))
        return self._iterate(request_id, stream)

    def abort(self, request_id: str) -> None:
        if request_id in self._streams:
            self._commands.put((_ABORT, request_id))

    def on_dead(self, listener) -> None:
        """Call listener(error) once, from whichever thread finds out, when the engine dies."""
        self._dead_listeners.append(listener)

    async def shutdown(self) -> None:
        """Stop the engine thread, then the engine's other ranks."""
        if self._thread is not None:
            self._commands.put((_STOP,))
            await asyncio.to_thread(self._thread.join)
            self._thread = None
        await asyncio.to_thread(self.engine.close)

    async def _iterate(self, request_id: str, stream: asyncio.Queue) -> AsyncIterator[RequestOutput]:
        finished = False
        try:
            while not finished:
                out = await stream.get()
                if isinstance(out, BaseException):
                    raise EngineDeadError(f"the engine stopped: {out!r}") from out
                finished = out.finished
                yield out
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self._commands.put((_ABORT, request_id))

    def _ensure_started(self) -> None:
        if self._thread is None:
            self._loop = asyncio.get_running_loop()
            self._thread = threading.Thread(target=self._run, name="ds4-engine", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        try:
            while self._apply(self._commands.get()):  # idle: block until there is work
                while self.engine.has_unfinished_requests():
                    if not self._drain():
                        return
                    outputs = self.engine.step()
                    self._stats = self.engine.stats()
                    if outputs:
                        self._loop.call_soon_threadsafe(self._deliver, outputs)
                    if not self._drain():
                        return
        except BaseException as e:  # noqa: BLE001 - every waiting request must learn that the engine died
            logger.exception("the engine thread stopped")
            self._die(e)

    def _die(self, error: BaseException) -> None:
        with self._death:
            if self.error is not None:
                return
            self.error = error
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._fail_all, error)
        for listener in self._dead_listeners:
            listener(error)

    def _drain(self) -> bool:
        """Apply every queued command; False once asked to stop."""
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return True
            if not self._apply(command):
                return False

    def _apply(self, command: tuple) -> bool:
        kind = command[0]
        if kind == _STOP:
            return False
        if kind == _ADD:
            _, request_id, prompt, params = command
            try:
                self.engine.add_request(request_id, prompt, params)
            except ValueError as e:
                self._loop.call_soon_threadsafe(self._deliver, [_refused(request_id, prompt, e)])
        elif kind == _ABORT:
            self.engine.abort(command[1])
        return True

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            # A finished request's stream is dropped here too, in case its iterator is never run to the end.
            stream = self._streams.pop(out.request_id, None) if out.finished else self._streams.get(out.request_id)
            if stream is not None:
                stream.put_nowait(out)

    def _fail_all(self, error: BaseException) -> None:
        for stream in self._streams.values():
            stream.put_nowait(error)


def _refused(request_id: str, prompt: list[int], error: Exception) -> RequestOutput:
    return RequestOutput(
        request_id=request_id,
        new_token_ids=[],
        new_text="",
        finished=True,
        finish_reason="error",
        num_prompt_tokens=len(prompt),
        error=str(error),
    )
