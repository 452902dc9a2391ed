"""Driving an engine through a benchmark: the model its flags name, steps that fail the benchmark on a request's
error, steps timed as a server runs them, and a running batch shrunk between measurements."""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from ds4.config import ModelConfig


@dataclass(frozen=True)
class ModelChoice:
    """What --model / --config / --load-format / --layers / --device / --dtype resolve to."""

    device: torch.device
    dtype: torch.dtype
    model_dir: Path | None
    cfg: ModelConfig  # cut to --layers
    full_cfg: ModelConfig  # every layer: what the figures are extrapolated to


def choose_model(args: argparse.Namespace) -> ModelChoice:
    from ds4.engine.engine import _resolve_dtype
    from ds4.engine.loader import checkpoint_dir, model_config

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    model_dir = checkpoint_dir(args.model, args.load_format)
    return ModelChoice(
        device,
        _resolve_dtype(args.dtype, device),
        model_dir,
        model_config(model_dir, args.config, args.load_format, args.layers),
        model_config(model_dir, args.config, args.load_format, None),
    )


def step(engine) -> list:
    """One engine step; a failed step fails the benchmark (the engine itself would only fail its requests)."""
    outputs = engine.step()
    for out in outputs:
        if out.error is not None:
            raise SystemExit(f"engine step failed for {out.request_id}: {out.error}")
    return outputs


def timed_steps(engine, steps: int, after_step: Callable[[], None] | None = None) -> list[float]:
    """The wall ms of each of `steps` engine steps run back to back, the device synchronised before the first only.
    With async decode a step launches the next before it waits for its own tokens: a sync between steps would let
    the device finish that next step outside the timing. after_step, if given, runs untimed after each step."""
    if engine.device.type == "cuda":
        torch.cuda.synchronize(engine.device)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step(engine)
        times.append((time.perf_counter() - start) * 1e3)
        if after_step is not None:
            after_step()
    return times


def shrink(engine, request_ids: list[str], batch: int) -> list[str]:
    """Abort all but the first `batch` running requests and step thrice: the aborted ones leave, and the new
    batch size's first steps (a graph's first replay, new kernel shapes) stay out of the timing."""
    for request_id in request_ids[batch:]:
        engine.abort(request_id)
    for _ in range(3):
        step(engine)
    return request_ids[:batch]
