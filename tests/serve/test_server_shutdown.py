"""`ds4 serve` as a real process: SIGTERM lets a running stream finish (drain), then the process exits cleanly."""

import json
import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def serve_process():
    port = _free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "ds4.cli",
            "serve",
            "--port",
            str(port),
            "--device",
            "cpu",
            "--drain-timeout",
            "60",
            "--log-level",
            "warning",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"ds4 serve exited early: {proc.stderr.read().decode()[-2000:]}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                break
        except httpx.TransportError:
            time.sleep(0.2)
    else:
        proc.kill()
        pytest.fail("ds4 serve did not come up within 120 s")
    yield proc, url
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def test_sigterm_drains_the_running_stream_then_exits(serve_process):
    proc, url = serve_process
    body = {
        "model": "ds4-tiny",
        "messages": [{"role": "user", "content": "Count."}],
        "max_tokens": 150,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        "chat_template_kwargs": {"thinking": False},
    }
    usage, done, signalled, late = None, False, False, None
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=120) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if not line.startswith("data: "):
                continue
            if not signalled:
                proc.send_signal(signal.SIGTERM)  # mid-stream: the request must still run to its end
                signalled = True
                time.sleep(0.5)
                late = _late_request(url)
            if line == "data: [DONE]":
                done = True
                break
            chunk = json.loads(line[len("data: ") :])
            usage = chunk.get("usage") or usage
    assert signalled and done
    assert usage is not None and usage["completion_tokens"] == 150
    assert late in ("refused", 503)
    # uvicorn re-raises the signal once it has drained, so the exit status is "terminated by SIGTERM".
    assert proc.wait(timeout=60) in (0, -signal.SIGTERM)


def _late_request(url: str):
    """What a request arriving during the drain gets: the listener is closed, or a 503."""
    try:
        return httpx.get(url + "/v1/models", timeout=5).status_code
    except httpx.TransportError:
        return "refused"
