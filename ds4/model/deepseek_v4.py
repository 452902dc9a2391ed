"""The DeepSeek-V4 model over flat batches: embed -> blocks on hc_mult residual streams -> hc_head, norm, head.

Built with a `Parallel` of world size N, the model is one rank's shard (SPMD: every rank runs the same
forward on the same batch, with its own caches; the collectives are inside): attention heads and o_groups,
the shared expert, the routed experts (inside each, or whole experts per rank) and the vocabulary of the
embedding and head are split; everything else is replicated (see ARCHITECTURE.md).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

import torch
from torch import nn

from ds4.checkpoint.weights_spec import StoredSpec, stored_tensor_specs
from ds4.config import ModelConfig
from ds4.distributed.parallel import Parallel, ParallelConfig
from ds4.kernels._device import has_fp8
from ds4.kernels.hyper_connections import hc_head
from ds4.kernels.rmsnorm import rms_norm
from ds4.model.batch import ForwardBatch, StepLayout
from ds4.model.block import Block
from ds4.model.cache import ModelCache, resolve_kv_cache_dtype
from ds4.model.linear import CHECKPOINT, DEQUANTIZED, WEIGHT_FORMATS, Linear, Norm, fp32_param
from ds4.model.mtp import MTPBlock
from ds4.model.shard import read, region_of, stored_dtype, stored_shape
from ds4.model.vocab import VocabEmbedding, VocabHead

_EXPERT_NAME = re.compile(r"^(.*\.ffn\.experts)\.(\d+)\.(w[123])\.(weight|scale)$")
_QUANTISED_DTYPES = (torch.float8_e4m3fn, torch.float8_e8m0fnu, torch.int8)


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
        weight_format: str = "auto",
        parallel: Parallel | None = None,
    ):
        """weight_format: "checkpoint" keeps FP8 linears and MXFP4 experts as the checkpoint stores them (the
        default on CUDA GPUs with e4m3, sm_89+); "dequantized" holds every weight in `dtype` or fp32 (the default
        elsewhere: the spec).
        kv_cache_dtype: "fp8" (the reference's FP8 cache, stored as such), "bf16" (unquantised, in `dtype`) or
        "auto" (fp8 on CUDA where the dims allow it, else bf16); the model keeps the resolved one.
        parallel: build this rank's shard (default: the whole model, world size 1)."""
        super().__init__()
        if with_mtp and cfg.num_mtp_layers < 1:
            raise ValueError("with_mtp: the config has no MTP layer (num_nextn_predict_layers is 0)")
        device = torch.device(device)
        kv_cache_dtype = resolve_kv_cache_dtype(cfg, kv_cache_dtype, device)
        if weight_format == "auto":
            weight_format = CHECKPOINT if device.type == "cuda" and has_fp8(device) else DEQUANTIZED
        if weight_format == CHECKPOINT and device.type == "cuda" and not has_fp8(device):
            raise ValueError(
                f"weight_format 'checkpoint': the FP8 linears need a GPU with e4m3 support (sm_89 or newer), "
                f"this one is sm_{''.join(map(str, torch.cuda.get_device_capability(device)))}; "
                f"use weight_format='dequantized'"
            )
        if weight_format not in WEIGHT_FORMATS:
            raise ValueError(f"weight_format: {weight_format!r} is not 'auto' or one of {WEIGHT_FORMATS}")
        self.cfg, self.dtype, self.kv_cache_dtype, self.with_mtp = cfg, dtype, kv_cache_dtype, with_mtp
        self.weight_format = weight_format
        self.parallel = parallel = parallel or Parallel.single()
        ParallelConfig(parallel.world_size, parallel.expert_parallel).validate(cfg, None, weight_format)
        d, hc = cfg.hidden_size, cfg.hc_mult
        self.embed = VocabEmbedding(cfg.vocab_size, d, dtype, device, parallel)
        self.layers = nn.ModuleList(
            Block(cfg, i, dtype, device, kv_cache_dtype, weight_format, parallel) for i in range(cfg.num_hidden_layers)
        )
        self.norm = Norm(d, device)
        self.head = VocabHead(d, cfg.vocab_size, dtype, device, parallel)
        self.hc_head_fn = fp32_param(hc, hc * d, device=device)
        self.hc_head_base = fp32_param(hc, device=device)
        self.hc_head_scale = fp32_param(1, device=device)
        mtp = [MTPBlock(cfg, dtype, device, kv_cache_dtype, weight_format, parallel)] if with_mtp else []
        self.mtp = nn.ModuleList(mtp)

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
        batch.derived.clear()
        layout = _layout(batch)
        h = self.embed(batch.input_ids).unsqueeze(1).repeat(1, self.cfg.hc_mult, 1)
        mixed = None
        for i, layer in enumerate(self.layers):
            following = self.layers[i + 1] if i + 1 < len(self.layers) else None
            h, mixed = layer(h, batch, layout, cache.layers[i], mixed, following)
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
        batch.derived.clear()
        mtp = self.mtp[0]
        h = mtp.embed_inputs(self.embed(batch.input_ids), hidden)
        return mtp(h, batch, _layout(batch), cache.layers[self.cfg.num_hidden_layers])[0]

    @torch.inference_mode()
    def compute_mtp_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """MTP streams [N, hc, D] -> fp32 logits [N, vocab] (own hc_head and norm, shared head)."""
        m = self.mtp[0]
        return self._logits(hidden, m.hc_head_fn, m.hc_head_scale, m.hc_head_base, m.norm.weight)

    def _logits(self, hidden, fn, scale, base, norm_weight) -> torch.Tensor:
        eps = self.cfg.rms_norm_eps
        x = rms_norm(hc_head(hidden, fn, scale, base, self.cfg.hc_eps, eps), norm_weight, eps)
        return self.head(x)

    @torch.no_grad()
    def load_weights(self, tensors: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor]) -> None:
        """Place (official name, stored tensor) pairs as they come: the checkpoint's form (stored_tensor_specs),
        FP8 and MXFP4 weights next to their `.scale`, kept or dequantised per weight_format.

        Streaming: each tensor is placed as soon as it (and its scale) has arrived and then dropped, so loading
        never holds a second copy of the weights. Every expected name this shard holds must come exactly once,
        in any order (the others may come, and are skipped).
        A tensor may come as a lazy slice (`[index]` and `.get_shape()`, as safetensors' get_slice): a shard
        then reads only its part of it, and nothing of the tensors it does not hold (`holds`).
        """
        items = tensors.items() if isinstance(tensors, Mapping) else tensors
        specs = stored_tensor_specs(self.cfg, self.with_mtp)
        modules = dict(self.named_modules())
        targets = {**dict(self.named_parameters()), **dict(self.named_buffers())}
        seen: set[str] = set()
        unexpected, duplicated, wrong = [], [], []
        waiting: dict[str, torch.Tensor] = {}  # a quantised weight or scale whose partner has not come yet
        for name, tensor in items:
            spec = specs.get(name)
            if spec is None or name in seen:
                (unexpected if spec is None else duplicated).append(name)
                continue
            seen.add(name)
            if not self.holds(name):
                continue
            problem = _stored_problem(name, tensor, spec)
            if problem:
                wrong.append(problem)
                continue
            base, _, leaf = name.rpartition(".")
            partner = f"{base}.{'scale' if leaf == 'weight' else 'weight'}"
            if leaf not in ("weight", "scale") or partner not in specs:
                self._place(name, tensor, None, modules, targets)
            elif partner in waiting:
                pair = (tensor, waiting.pop(partner))
                self._place(f"{base}.weight", *(pair if leaf == "weight" else pair[::-1]), modules, targets)
                del pair
            else:
                waiting[name] = tensor
        missing = sorted(n for n in set(specs) - seen if self.holds(n))
        if missing or unexpected or duplicated:
            raise ValueError(
                f"load_weights: missing {_few(missing)}; unexpected {_few(unexpected)}; duplicated {_few(duplicated)}"
            )
        if wrong:
            raise ValueError(f"load_weights: wrong shapes or dtypes: {_few(wrong)}")

    def _place(self, name, tensor, scale, modules, targets) -> None:
        expert = _EXPERT_NAME.match(name)
        if expert:
            modules[expert.group(1)].load(int(expert.group(2)), expert.group(3), tensor, scale, self.cfg.fp8_block)
            return
        owner = modules.get(name.removesuffix(".weight"))
        if isinstance(owner, Linear):
            owner.load(tensor, scale, self.cfg.fp8_block)
        elif name in targets:
            targets[name].copy_(read(tensor, region_of(targets[name])))
        else:
            raise ValueError(f"load_weights: {name} has no place in the model")

    def holds(self, name: str) -> bool:
        """Whether this shard holds any of the stored tensor `name` (expert parallel: only its experts')."""
        expert = _EXPERT_NAME.match(name)
        return expert is None or self.get_submodule(expert.group(1)).holds(int(expert.group(2)))


def _stored_problem(name: str, source, spec: StoredSpec) -> str | None:
    """Why `source` (a tensor or a lazy slice) is not `name` as stored: its shape, or its dtype (quantised ones
    exactly; floating ones may come in any floating dtype, integer tables in any integer dtype)."""
    shape, dtype = stored_shape(source), stored_dtype(source)
    if shape != spec.shape:
        return f"{name}: shape {shape} != {spec.shape}"
    if spec.dtype in _QUANTISED_DTYPES:
        ok = dtype == spec.dtype
    elif spec.dtype.is_floating_point:
        ok = dtype.is_floating_point and dtype not in _QUANTISED_DTYPES
    else:
        ok = not dtype.is_floating_point
    if ok:
        return None
    hint = "; dequantise it: the config has no quantization_config" if dtype in _QUANTISED_DTYPES else ""
    return f"{name}: dtype {dtype} where the checkpoint stores {spec.dtype}{hint}"


def _layout(batch: ForwardBatch) -> StepLayout | None:
    """The host-side layout the general path loops over; None selects the decode path."""
    return None if batch.decode_only else StepLayout.of(batch)


def _few(names: list[str], limit: int = 8) -> str:
    more = f" (+{len(names) - limit} more)" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more if names else "none"
