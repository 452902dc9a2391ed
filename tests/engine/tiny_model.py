"""The built-in tiny checkpoint loaded in fp32: the model the engine tests drive."""

import torch

from ds4.checkpoint.reader import load_checkpoint
from ds4.checkpoint.tiny import default_model_dir
from ds4.config import load_config
from ds4.model.deepseek_v4 import DeepseekV4Model


def load_tiny_model(device: str = "cpu", with_mtp: bool = False) -> DeepseekV4Model:
    model_dir = default_model_dir()
    cfg = load_config(model_dir)
    model = DeepseekV4Model(cfg, dtype=torch.float32, device=device, with_mtp=with_mtp)
    model.load_weights(load_checkpoint(model_dir, cfg, with_mtp=with_mtp, progress=False))
    return model
