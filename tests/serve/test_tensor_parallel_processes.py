"""`ds4 serve` as a process: a rank that dies turns /health to 503 and the server exits with nothing left behind."""

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from ds4.checkpoint.tiny import make_tiny

SPLITTABLE = {"o_groups": 4}
FLAGS = ["--device", "cpu", "--dtype", "float32", "--kv-cache-memory", str(64 << 20), "--max-model-len", "512"]
# echo + logprobs: the prompt's logprobs and the greedy tokens' in one answer.
COMPLETION = {"model": "tiny", "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}
COMPLETION |= {"echo": True, "logprobs": 1}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return make_tiny(tmp_path_factory.mktemp("tp") / "tiny", format="official", seed=5, config_overrides=SPLITTABLE)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(model_dir: Path, port: int, *flags: str) -> subprocess.Popen:
    command = [sys.executable, "-m", "ds4.cli", "serve", "--model", str(model_dir), "--port", str(port)]
    command += ["--served-model-name", "tiny", "--log-level", "warning", *FLAGS, *flags]
    return subprocess.Popen(
        command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env={**os.environ, "PYTHONUNBUFFERED": "1"}
    )


def _wait_healthy(proc: subprocess.Popen, url: str, timeout_s: float = 180) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"ds4 serve exited early: {proc.stderr.read().decode()[-3000:]}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    proc.kill()
    pytest.fail(f"ds4 serve did not come up within {timeout_s} s")


def _children(pid: int) -> list[int]:
    return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except FileNotFoundError:
        return False


def test_a_killed_rank_turns_health_to_503_and_the_server_exits(model_dir):
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    proc = _serve(model_dir, port, "--tensor-parallel-size", "2")
    try:
        _wait_healthy(proc, url)
        assert httpx.post(url + "/v1/completions", json=COMPLETION, timeout=60).status_code == 200
        children = _children(proc.pid)  # rank 1 and multiprocessing's resource tracker
        rank1 = next(c for c in children if b"spawn_main" in Path(f"/proc/{c}/cmdline").read_bytes())
        os.kill(rank1, signal.SIGKILL)
        statuses = []
        deadline = time.monotonic() + 10
        while 503 not in statuses and time.monotonic() < deadline:
            statuses.append(httpx.get(url + "/health", timeout=5).status_code)
            time.sleep(0.05)
        assert statuses[-1] == 503, statuses
        assert proc.wait(timeout=30) == 1
        assert "tensor-parallel rank 1" in proc.stderr.read().decode()
        deadline = time.monotonic() + 10
        while [c for c in children if _alive(c)] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not [c for c in children if _alive(c)]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
