"""Build the model the engine serves: a checkpoint directory (`--load-format auto`), or a config alone with
dummy weights made on the device (`--load-format dummy`: `--config flash|pro|DIR`, or `--model DIR` holding
only a config.json; with neither, the built-in tiny model's config).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from ds4.config import ModelConfig
from ds4.distributed.parallel import Parallel

LOAD_FORMATS = ("auto", "dummy")


def checkpoint_dir(model_dir: str | Path | None, load_format: str) -> Path | None:
    """The directory weights (and a tokenizer) come from: the given one, the built-in tiny model's when reading
    a checkpoint without one, none when dummy weights come from a config alone."""
    from ds4.checkpoint.tiny import default_model_dir

    if model_dir is not None:
        return Path(model_dir)
    return default_model_dir() if load_format == "auto" else None


def model_config(
    model_dir: str | Path | None, config: str | Path | None, load_format: str, num_layers: int | None
) -> ModelConfig:
    """The config the model is built from, checking that the load format, config and layer count go together."""
    from ds4.checkpoint.tiny import TINY_CONFIG
    from ds4.config import load_config
    from ds4.configs import config_dict, with_layers

    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format: {load_format!r} is not one of {LOAD_FORMATS}")
    if load_format == "auto":
        if config is not None or num_layers is not None:
            raise ValueError("a config or a layer count builds a model without its checkpoint: use load_format dummy")
        return load_config(model_dir)
    if config is not None and model_dir is not None:
        raise ValueError("give the model's config (config=) or a directory holding it (model=), not both")
    source = config if config is not None else model_dir
    raw = dict(TINY_CONFIG) if source is None else config_dict(source)
    return load_config(raw if num_layers is None else with_layers(raw, num_layers))


@dataclass(frozen=True)
class ModelSource:
    """What builds the served model: pickled to the other ranks of a tensor-parallel engine, which each build
    their own shard from it."""

    cfg: ModelConfig
    model_dir: Path | None
    load_format: str
    dtype: torch.dtype
    kv_cache_dtype: str = "auto"
    weight_format: str = "auto"
    seed: int = 0
    with_mtp: bool = False

    def load(self, device: torch.device, parallel: Parallel | None = None):
        """The model on `device`; with `parallel` this rank's shard of it."""
        return load_model(
            self.cfg,
            self.model_dir,
            self.load_format,
            device=device,
            dtype=self.dtype,
            kv_cache_dtype=self.kv_cache_dtype,
            weight_format=self.weight_format,
            seed=self.seed,
            with_mtp=self.with_mtp,
            parallel=parallel,
        )


def load_model(
    cfg: ModelConfig,
    model_dir: Path | None,
    load_format: str,
    *,
    device: torch.device,
    dtype: torch.dtype,
    kv_cache_dtype: str = "auto",
    weight_format: str = "auto",
    seed: int = 0,
    with_mtp: bool = False,
    parallel: Parallel | None = None,
):
    """A DeepseekV4Model with its weights, streamed in stored form: read from model_dir, or (dummy) generated on
    the device; with_mtp adds the MTP layer (speculative decoding). parallel: this rank's shard, which reads
    (or makes) only its part of the weights."""
    from ds4.checkpoint.dummy import dummy_weights
    from ds4.checkpoint.reader import load_checkpoint
    from ds4.model.deepseek_v4 import DeepseekV4Model

    model = DeepseekV4Model(
        cfg,
        dtype=dtype,
        device=device,
        kv_cache_dtype=kv_cache_dtype,
        weight_format=weight_format,
        with_mtp=with_mtp,
        parallel=parallel,
    )
    if load_format == "dummy":
        model.load_weights(dummy_weights(cfg, device, seed, with_mtp, holds=model.holds))
    else:
        progress = parallel is None or parallel.rank == 0
        model.load_weights(load_checkpoint(model_dir, cfg, with_mtp=with_mtp, lazy=True, progress=progress))
    return model
