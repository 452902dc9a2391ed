"""The built-in tiny checkpoint loaded in fp32: the model the engine tests drive; and the engine's CUDA-graph decode
path run eagerly, for the CPU."""

import torch

from ds4.checkpoint.reader import load_checkpoint
from ds4.checkpoint.tiny import default_model_dir
from ds4.config import load_config
from ds4.engine.cuda_graphs import DecodeGraphs
from ds4.model.deepseek_v4 import DeepseekV4Model


def load_tiny_model(device: str = "cpu", with_mtp: bool = False) -> DeepseekV4Model:
    model_dir = default_model_dir()
    cfg = load_config(model_dir)
    model = DeepseekV4Model(cfg, dtype=torch.float32, device=device, with_mtp=with_mtp)
    model.load_weights(load_checkpoint(model_dir, cfg, with_mtp=with_mtp, progress=False))
    return model


class EagerDecodeGraphs(DecodeGraphs):
    """DecodeGraphs that run the same padded batches eagerly, recording the graph key of every step."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, capture=False, **kwargs)
        self.runs = []

    def run(self, batch, key):
        self.runs.append(key)
        return super().run(batch, key)


def use_eager_graphs(eng, model, max_batch_size):
    """Give an engine the CUDA-graph path run eagerly: as the engine does with graphs on, one more cache slot
    (the scratch slot padding rows write to), and its drafter (with speculative decoding) drafts on that cache."""
    plan, k = eng.plan, eng.config.num_speculative_tokens
    cache = model.new_cache(plan.num_slots + 1, plan.num_pages, plan.page_size, plan.num_snapshots, spare=k)
    eng.cache = eng.runner.cache = cache
    if eng.runner.drafter is not None:
        eng.runner.drafter.cache = cache
    pages = eng.allocator.pages_for(plan.max_model_len)
    graphs = EagerDecodeGraphs(
        model, cache, max_batch_size, pages, plan.num_slots, torch.device("cpu"), drafter=eng.runner.drafter
    )
    eng.runner.graphs = graphs
    return graphs
