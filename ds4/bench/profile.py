"""A torch.profiler run of the model summarised by kernel family (GEMMs, MoE, attention, indexer, ...).

While profiling, every module and model function of a family runs inside a `ds4::<family>` profiler range
(forward hooks on the modules, wrappers on the functions, both removed afterwards). Each op's own time (on
CUDA the kernels it launched, on a CPU its self time) goes to the innermost family range around it, so a
Linear inside the MoE's shared expert counts as GEMMs, as does the router's product (dense weights, whose bytes
the GEMMs' roofline counts), and the rest of the MoE as MoE (the routed experts). The profiler ties no op
to kernels launched through the driver API (Triton's launches): those go to the family of the ds4.kernels
module that defines a Triton kernel of that name. The collectives of ds4.distributed (all-reduce, all-gather,
reduce-scatter) are "communication", wherever they are called. Time nothing claims (embedding, sampling, host
work) is "other". Run eagerly: kernels replayed from a CUDA graph have no ranges.
"""

from __future__ import annotations

import contextlib
import importlib
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator

import torch
from torch.autograd.profiler import record_function
from torch.profiler import ProfilerActivity, profile

from ds4.kernels import _device as device_facts

FAMILIES = ("GEMMs", "MoE", "attention", "indexer", "top-k", "mHC", "compressor", "norms", "communication", "other")
_PREFIX = "ds4::"

# (module class, family): the innermost wins, so Linear sits inside the others.
_MODULES = (
    ("ds4.model.block", "Block", "mHC"),
    ("ds4.model.attention", "Attention", "attention"),
    ("ds4.model.indexer", "Indexer", "indexer"),
    ("ds4.model.compressor", "Compressor", "compressor"),
    ("ds4.model.moe", "MoE", "MoE"),
    ("ds4.model.linear", "Linear", "GEMMs"),
    ("ds4.model.linear", "StackedLinears", "GEMMs"),
)
# (kernels module, family) of the Triton kernels whose launches no op claims.
_KERNEL_MODULES = (
    ("ds4.kernels.fp8_linear", "GEMMs"),
    ("ds4.kernels.fp32_product", "GEMMs"),  # decode-sized fp32 products: the router's, the compressors'
    ("ds4.kernels.moe", "MoE"),
    ("ds4.kernels.indexer", "indexer"),
    ("ds4.kernels.fp4_act", "indexer"),  # the rounding of the indexer's keys (its queries' is in ds4.kernels.indexer)
    ("ds4.kernels.topk_triton", "top-k"),
    ("ds4.kernels.hyper_connections", "mHC"),
    ("ds4.kernels.rmsnorm", "norms"),
    ("ds4.kernels.rope", "attention"),
    ("ds4.kernels.norm_rope", "attention"),
    ("ds4.kernels.ring_write", "attention"),  # the window rings' writes, and the compressors' (one name for both)
    ("ds4.kernels.sparse_attention", "attention"),
    ("ds4.kernels.gated_pool", "compressor"),  # most rotations are attention's (q, kv, inverse on o)
)
# (module, function it calls by its global name, family).
_FUNCTIONS = (
    ("ds4.model.block", "hc_pre", "mHC"),
    ("ds4.model.block", "hc_post", "mHC"),
    ("ds4.model.block", "hc_post_pre", "mHC"),
    ("ds4.model.deepseek_v4", "hc_head", "mHC"),
    ("ds4.model.block", "rms_norm", "norms"),
    ("ds4.model.compressor", "rms_norm", "norms"),
    ("ds4.model.deepseek_v4", "rms_norm", "norms"),
    ("ds4.model.indexer", "topk_indices", "top-k"),
    ("ds4.model.indexer", "top_entries", "top-k"),
    # The router's product reads a dense weight, counted in the GEMMs' roofline: GEMMs whichever kernel serves it
    # (its Triton GEMV is by module; cuBLAS, at more tokens, would be claimed by the MoE's range).
    ("ds4.model.moe", "fp32_product", "GEMMs"),
)
# (module, class, methods, family): methods wrapped on the class itself, for every instance.
# Linear.gated (the shared expert's down projection) and the linears' `normed` (wq_b with its q_norm) are calls of
# the layers that bypass their forward hooks.
_METHODS = (
    ("ds4.distributed.parallel", "Parallel", ("all_reduce", "all_gather", "reduce_scatter"), "communication"),
    ("ds4.model.linear", "Linear", ("gated", "normed"), "GEMMs"),
    ("ds4.model.linear", "StackedLinears", ("normed",), "GEMMs"),
)


@contextlib.contextmanager
def family_ranges(model: torch.nn.Module) -> Iterator[None]:
    """Profiler ranges named by family around the model's modules and functions (and its head)."""
    classes = {}
    for module_name, class_name, family in _MODULES:
        cls = getattr(importlib.import_module(module_name), class_name, None)
        if cls is not None:
            classes[cls] = family
    handles, open_ranges = [], {}

    def enter(module, _args):
        rng = record_function(_PREFIX + classes[type(module)])
        rng.__enter__()
        open_ranges.setdefault(id(module), []).append(rng)

    def leave(module, _args, _output):
        open_ranges[id(module)].pop().__exit__(None, None, None)

    for module in model.modules():
        if type(module) in classes:
            handles.append(module.register_forward_pre_hook(enter))
            handles.append(module.register_forward_hook(leave))
    patched = []
    for module_name, function, family in _FUNCTIONS:
        module = importlib.import_module(module_name)
        original = getattr(module, function, None)
        if original is not None:
            setattr(module, function, _in_range(original, family))
            patched.append((module, function, original))
    for module_name, class_name, methods, family in _METHODS:
        cls = getattr(importlib.import_module(module_name), class_name)
        for method in methods:
            original = cls.__dict__[method]
            setattr(cls, method, _in_range(original, family))
            patched.append((cls, method, original))
    logits = model.compute_logits
    model.compute_logits = _in_range(logits, "GEMMs")
    try:
        yield
    finally:
        model.compute_logits = logits
        for module, function, original in patched:
            setattr(module, function, original)
        for handle in handles:
            handle.remove()


def _in_range(fn: Callable, family: str) -> Callable:
    def wrapped(*args, **kwargs):
        with record_function(_PREFIX + family):
            return fn(*args, **kwargs)

    return wrapped


def profile_families(
    model: torch.nn.Module,
    run: Callable[[], object],
    device: torch.device,
    by_kernel: defaultdict[str, Counter] | None = None,
    launches: Counter | None = None,
    kernel_launches: defaultdict[str, Counter] | None = None,
) -> dict[str, float]:
    """Milliseconds per family of one call of run (device time on CUDA, CPU time otherwise), plus "total".
    by_kernel, if given, receives each family's milliseconds by kernel (CPU: op) name; launches, the number of
    kernels (CPU: ops) per family: a family of many small kernels is launch-bound at decode sizes; kernel_launches,
    each family's launches by kernel name. Each kernel launches after the one before it ends (no programmatic
    dependent launch): one launched early would count its wait for the one before as its own time."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with family_ranges(model), _launches_in_order(), profile(activities=activities) as prof:
        run()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    return summarise(prof.events(), device.type == "cuda", by_kernel, launches, kernel_launches)


@contextlib.contextmanager
def _launches_in_order() -> Iterator[None]:
    early = device_facts.DEPENDENT_LAUNCH
    device_facts.DEPENDENT_LAUNCH = False
    try:
        yield
    finally:
        device_facts.DEPENDENT_LAUNCH = early


def summarise(
    events,
    on_device: bool,
    by_kernel: defaultdict[str, Counter] | None = None,
    launches: Counter | None = None,
    kernel_launches: defaultdict[str, Counter] | None = None,
) -> dict[str, float]:
    times = dict.fromkeys(FAMILIES, 0.0)
    by_kernel = defaultdict(Counter) if by_kernel is None else by_kernel
    launches = Counter() if launches is None else launches
    kernel_launches = defaultdict(Counter) if kernel_launches is None else kernel_launches
    claimed = Counter()  # kernel name -> microseconds some op's launch accounts for
    for event in events:
        if event.device_type != torch.autograd.DeviceType.CPU:
            continue
        # A kernel's first launch also lists it under the loader's event inside the op: count it once.
        parent_kernels = getattr(event.cpu_parent, "kernels", ()) or ()
        kernels = [k for k in event.kernels if k not in parent_kernels] if on_device else []
        us = sum(k.duration for k in kernels) if on_device else event.self_cpu_time_total
        if us:
            family = _family(event)
            times[family] += us / 1e3
            launches[family] += len(kernels) if on_device else 1
            for kernel in kernels if on_device else (event,):
                by_kernel[family][kernel.name] += (kernel.duration if on_device else us) / 1e3
                kernel_launches[family][kernel.name] += 1
        for kernel in kernels:
            claimed[kernel.name] += kernel.duration
    if on_device:
        families = _triton_kernel_families()
        for event in events:
            # The family ranges themselves also appear on the device's timeline: spans, not kernels.
            if event.device_type != torch.autograd.DeviceType.CUDA or event.name.startswith(_PREFIX):
                continue
            us = event.time_range.elapsed_us()
            taken = min(us, claimed[event.name])
            claimed[event.name] -= taken
            if us > taken:
                family = families.get(event.name, "other")
                times[family] += (us - taken) / 1e3
                launches[family] += 1
                by_kernel[family][event.name] += (us - taken) / 1e3
                kernel_launches[family][event.name] += 1
    times["total"] = sum(times.values())
    return times


def _triton_kernel_families() -> dict[str, str]:
    """Triton kernel name -> family, from the ds4.kernels modules that define them."""
    families = {}
    for module_name, family in _KERNEL_MODULES:
        for name, value in vars(importlib.import_module(module_name)).items():
            # A Triton kernel, compiled or interpreted, wraps the Python function of its name.
            if getattr(getattr(value, "fn", None), "__name__", None) == name:
                families[name] = family
    return families


def _family(event) -> str:
    while event is not None:
        if event.name.startswith(_PREFIX):
            return event.name[len(_PREFIX) :]
        event = event.cpu_parent
    return "other"
