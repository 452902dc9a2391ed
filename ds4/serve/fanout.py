"""One HTTP request, several engine requests: every prompt of a request times its n choices.

The engine knows nothing of choices: each choice is an ordinary engine request. `ChoiceStreams` reads
them as one async iterator of (choice index, RequestOutput) in the order the outputs arrive, so a stream
interleaves its choices. Closing it aborts every choice still running, whether or not it was ever read.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable


class ChoiceStreams:
    def __init__(self, streams: list[AsyncIterator], abort_all: Callable[[], None]):
        self._streams = streams
        self._abort_all = abort_all
        self._merged = self._merge()

    def __aiter__(self):
        return self._merged

    async def aclose(self) -> None:
        await self._merged.aclose()
        for stream in self._streams:
            await stream.aclose()
        self._abort_all()

    async def _merge(self):
        if len(self._streams) == 1:  # the common case needs no tasks
            async for out in self._streams[0]:
                yield 0, out
            return
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(index: int, stream: AsyncIterator) -> None:
            try:
                async for out in stream:
                    queue.put_nowait((index, out, None))
            except Exception as e:  # noqa: BLE001 - handed to the reader, which raises it
                queue.put_nowait((index, None, e))
            else:
                queue.put_nowait((index, None, None))

        pumps = [asyncio.ensure_future(pump(i, stream)) for i, stream in enumerate(self._streams)]
        try:
            running = len(pumps)
            while running:
                index, out, error = await queue.get()
                if error is not None:
                    raise error
                if out is None:
                    running -= 1
                else:
                    yield index, out
        finally:
            for task in pumps:
                task.cancel()
            await asyncio.gather(*pumps, return_exceptions=True)
