"""What every benchmark command shares around its measurement: list arguments, progress lines, the run's
environment (device, versions, commit) and writing its JSON. torch is imported only where a device is named:
the HTTP clients (`ds4 bench serve`, `needle`) run without it."""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
from pathlib import Path


def int_list(text: str) -> list[int]:
    """argparse type of "1,8,64"."""
    try:
        return [int(x) for x in text.split(",") if x]
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from e


def float_list(text: str) -> list[float]:
    """argparse type of "1.5,2,2.5"."""
    try:
        return [float(x) for x in text.split(",") if x]
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from e


def progress(message: str) -> None:
    """A line on stderr about long work ahead (stdout keeps the tables)."""
    print(message, file=sys.stderr, flush=True)


def sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def device_name(device) -> str:
    import torch

    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


def commit() -> str | None:
    """The git commit of the code being measured (None outside a checkout)."""
    try:
        return subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True, cwd=Path(__file__).parent
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def environment(device) -> dict:
    """The facts a recorded figure needs beside it."""
    import torch

    return {
        "device": device_name(device),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "commit": commit(),
    }


def write_json(path: Path | None, result: dict) -> None:
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {path}")
