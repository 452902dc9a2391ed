"""A real uvicorn server on 127.0.0.1 (ephemeral port) in a background thread, for tests."""

from __future__ import annotations

import threading
import time

import uvicorn


class LiveServer:
    def __init__(self, app, start_timeout_s: float = 20.0):
        config = uvicorn.Config(
            app, host="127.0.0.1", port=0, log_level="warning", lifespan="on", timeout_graceful_shutdown=5
        )
        self.server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self.server.run, name="test-uvicorn", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + start_timeout_s
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the test server did not start")
            time.sleep(0.02)
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"

    def stop(self, timeout_s: float = 20.0) -> None:
        self.server.should_exit = True
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            raise RuntimeError("the test server did not stop")
