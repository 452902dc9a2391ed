"""The DeepSeek-V4 model over flat batches: embed -> blocks on hc_mult residual streams -> hc_head, norm, head."""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn

from ds4.checkpoint.weights_spec import expected_parameter_shapes
from ds4.config import ModelConfig
from ds4.kernels.rmsnorm import rms_norm
from ds4.model.batch import ForwardBatch, StepLayout
from ds4.model.block import Block
from ds4.model.cache import ModelCache, check_kv_cache_dtype
from ds4.model.hyper_connection import hc_head
from ds4.model.linear import Norm, fp32_param
from ds4.model.mtp import MTPBlock

_EXPERT_NAME = re.compile(r"^(.*\.ffn)\.experts\.(\d+)\.(w[123])\.weight$")


class DeepseekV4Model(nn.Module):
    # A decode_only batch runs without host syncs and with shapes fixed by its tensors' shapes.
    cuda_graph_safe = True

    def __init__(
        self,
        cfg: ModelConfig,
        dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str = "cpu",
        kv_cache_dtype: str = "auto",
        with_mtp: bool = False,
    ):
        super().__init__()
        check_kv_cache_dtype(cfg, kv_cache_dtype)
        if with_mtp and cfg.num_mtp_layers < 1:
            raise ValueError("with_mtp: the config has no MTP layer (num_nextn_predict_layers is 0)")
        device = torch.device(device)
        self.cfg, self.dtype, self.kv_cache_dtype, self.with_mtp = cfg, dtype, kv_cache_dtype, with_mtp
        d, hc = cfg.hidden_size, cfg.hc_mult
        self.embed = nn.Embedding(cfg.vocab_size, d, dtype=dtype, device=device).requires_grad_(False)
        self.layers = nn.ModuleList(Block(cfg, i, dtype, device, kv_cache_dtype) for i in range(cfg.num_hidden_layers))
        self.norm = Norm(d, device)
        # The reference computes logits in fp32.
        self.head = nn.Linear(d, cfg.vocab_size, bias=False, dtype=torch.float32, device=device).requires_grad_(False)
        self.hc_head_fn = fp32_param(hc, hc * d, device=device)
        self.hc_head_base = fp32_param(hc, device=device)
        self.hc_head_scale = fp32_param(1, device=device)
        self.mtp = nn.ModuleList([MTPBlock(cfg, dtype, device, kv_cache_dtype)] if with_mtp else [])

    def new_cache(
        self, num_slots: int, num_pages: int, page_size: int, num_snapshots: int = 0, spare: int = 0
    ) -> ModelCache:
        """`spare`: positions a step may write past what a request keeps (speculative tokens; see ModelCache)."""
        device = self.embed.weight.device
        return ModelCache(
            self.cfg,
            num_slots,
            num_pages,
            page_size,
            self.dtype,
            device,
            self.kv_cache_dtype,
            self.with_mtp,
            spare,
            num_snapshots,
        )

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, cache: ModelCache) -> torch.Tensor:
        """The hc_mult residual streams [T, hc, D] of every token after the last block; updates the caches.

        A decode_only batch takes the decode path, which is CUDA-graph capturable (see ForwardBatch)."""
        layout = _layout(batch)
        h = self.embed(batch.input_ids).unsqueeze(1).repeat(1, self.cfg.hc_mult, 1)
        for i, layer in enumerate(self.layers):
            h = layer(h, batch, layout, cache.layers[i])
        return h

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Streams [N, hc, D] -> fp32 logits [N, vocab]."""
        return self._logits(hidden, self.hc_head_fn, self.hc_head_scale, self.hc_head_base, self.norm.weight)

    @torch.inference_mode()
    def mtp_forward(self, batch: ForwardBatch, hidden: torch.Tensor, cache: ModelCache) -> torch.Tensor:
        """MTP block streams [T, hc, D]. batch.input_ids hold the token after each position; hidden the main
        model's streams at batch.positions (or the previous MTP output when drafting further)."""
        if not self.with_mtp:
            raise RuntimeError("mtp_forward: the model was built without the MTP layer (with_mtp=False)")
        mtp = self.mtp[0]
        h = mtp.embed_inputs(self.embed(batch.input_ids), hidden)
        return mtp(h, batch, _layout(batch), cache.layers[self.cfg.num_hidden_layers])

    @torch.inference_mode()
    def compute_mtp_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """MTP streams [N, hc, D] -> fp32 logits [N, vocab] (own hc_head and norm, shared head)."""
        m = self.mtp[0]
        return self._logits(hidden, m.hc_head_fn, m.hc_head_scale, m.hc_head_base, m.norm.weight)

    def _logits(self, hidden, fn, scale, base, norm_weight) -> torch.Tensor:
        eps = self.cfg.rms_norm_eps
        x = rms_norm(hc_head(hidden, fn, scale, base, self.cfg.hc_eps, eps), norm_weight, eps)
        return F.linear(x.float(), self.head.weight)

    @torch.no_grad()
    def load_weights(self, tensors: dict[str, torch.Tensor]) -> None:
        """Copy official-name tensors (already dequantised) into the model; every expected name exactly once."""
        spec = expected_parameter_shapes(self.cfg, self.with_mtp)
        missing = sorted(set(spec) - set(tensors))
        unexpected = sorted(set(tensors) - set(spec))
        if missing or unexpected:
            raise ValueError(f"load_weights: missing {_few(missing)}; unexpected {_few(unexpected)}")
        wrong = [
            f"{n}: {tuple(t.shape)} != {spec[n].shape}" for n, t in tensors.items() if tuple(t.shape) != spec[n].shape
        ]
        if wrong:
            raise ValueError(f"load_weights: wrong shapes: {_few(wrong)}")
        targets = {**dict(self.named_parameters()), **dict(self.named_buffers())}
        for name, tensor in tensors.items():
            if tensor.dtype.is_floating_point and tensor.element_size() == 1:
                raise ValueError(f"load_weights: {name} is {tensor.dtype}; dequantise before loading")
            self._target(name, targets).copy_(tensor)

    def _target(self, name: str, targets: dict[str, torch.Tensor]) -> torch.Tensor:
        expert = _EXPERT_NAME.match(name)
        if expert:
            return targets[f"{expert.group(1)}.experts.{expert.group(3)}"][int(expert.group(2))]
        if name not in targets:
            raise ValueError(f"load_weights: {name} has no place in the model")
        return targets[name]


def _layout(batch: ForwardBatch) -> StepLayout | None:
    """The host-side layout the general path loops over; None selects the decode path."""
    return None if batch.decode_only else StepLayout.of(batch)


def _few(names: list[str], limit: int = 8) -> str:
    more = f" (+{len(names) - limit} more)" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more if names else "none"
