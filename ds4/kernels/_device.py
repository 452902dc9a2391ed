"""Facts about the device a kernel launches on, read once per device (block sizes and grids derive from them)."""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

# The interpreter runs programs one after another on the CPU: few, large programs are fastest there.
_INTERPRETER_SMS = 4


def interpreting() -> bool:
    """True when Triton kernels run through the CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def cuda_index(device: torch.device) -> int:
    """The index of a CUDA device (the current one where it names none)."""
    return device.index if device.index is not None else torch.cuda.current_device()


@functools.cache
def _cuda_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of `device` (a small fixed number for the CPU interpreter)."""
    if device.type != "cuda":
        return _INTERPRETER_SMS
    return _cuda_sms(cuda_index(device))


@functools.cache
def _cuda_shared_memory(index: int) -> int:
    return torch.cuda.get_device_properties(index).shared_memory_per_block_optin


def shared_memory_per_block(device: torch.device) -> int:
    """Bytes of shared memory one program may use on `device` (the interpreter has no such limit)."""
    if device.type != "cuda":
        return 1 << 20
    return _cuda_shared_memory(cuda_index(device))


@functools.cache
def _cuda_capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def _capability(device: torch.device) -> tuple[int, int]:
    """The compute capability of a CUDA device (its index, or the current one)."""
    return _cuda_capability(cuda_index(device))


def has_fp8(device: torch.device) -> bool:
    """True when Triton can convert to and from e4m3 on `device` (sm_89+; the interpreter too): the FP8 linears'
    act_quant needs it; the FP8 cache's readers (attention, indexer) decode the bytes themselves without it."""
    if device.type != "cuda":
        return True
    return _capability(device) >= (8, 9)


def has_blockwise_fp8_gemm(device: torch.device) -> bool:
    """True when torch._scaled_mm takes the DeepSeek-style blockwise FP8 recipe (1x128 activation blocks x 128x128
    weight blocks) on `device`: torch runs it on sm_90 only (elsewhere, sm_89 and sm_100 / sm_120 among them, it
    raises)."""
    if device.type != "cuda":
        return False
    return _capability(device) == (9, 0)


ARRIVAL_COUNTERS = 1 << 14  # int32 counters a launch may use (per device)


@functools.cache
def arrival_counters(device: torch.device) -> torch.Tensor:
    """Zeroed int32 counters for kernels whose last program to arrive at a tile finishes it (split-K sums, the
    fused mHC collapse): each launch leaves the ones it used zero again. Launches on one device share them, so
    they must run one after another (one stream at a time)."""
    if torch.cuda.is_available() and device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            "arrival counters: run the kernel once outside CUDA-graph capture first (they are made then)"
        )
    return torch.zeros(ARRIVAL_COUNTERS, dtype=torch.int32, device=device)


def has_tma(device: torch.device) -> bool:
    """True when `device` copies tiles by TMA descriptors (sm_90+; the interpreter reads them too). Triton lowers
    descriptors to plain loads on older parts, without its pipelining: there the kernels keep pointer loads."""
    if device.type != "cuda":
        return True
    return _capability(device)[0] >= 9


def mma_operands_in_registers(device: torch.device) -> bool:
    """True when the device's tensor-core MMA takes its operands from registers (mma.sync: sm_80 to sm_89, sm_120),
    False where it reads them from shared memory (wgmma on sm_90, tcgen05 on sm_100; the interpreter)."""
    if device.type != "cuda":
        return False
    return _capability(device)[0] not in (9, 10)


def mma_is_warpgroup(device: torch.device) -> bool:
    """True when the tensor-core MMA is issued by a warpgroup of 4 warps over a tile in shared memory (wgmma, sm_90)."""
    if device.type != "cuda":
        return False
    return _capability(device)[0] == 9


# False: every kernel starts after the one before it ends (DS4_PDL=0, `ds4 bench model --no-pdl`), to time a step
# without programmatic dependent launch or rule it out.
DEPENDENT_LAUNCH = os.environ.get("DS4_PDL", "1") != "0"


def launches_dependents_early(device: torch.device) -> bool:
    """True when a kernel may start before the one it depends on ends (programmatic dependent launch, sm_90+)."""
    if device.type != "cuda" or not DEPENDENT_LAUNCH:
        return False
    return _capability(device)[0] >= 9


@triton.jit
def dependent_launch_start(PDL: tl.constexpr):
    """First thing a kernel launched early (PDL: `launch_pdl=True`, where launches_dependents_early) does: let the
    launch after it start too, then wait until the launch before it has ended and its writes are visible. Nothing
    the kernel reads or writes comes before, so an early start only overlaps its launch with the one before."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()


@functools.cache
def _cuda_l2_bytes(index: int) -> int:
    return torch.cuda.get_device_properties(index).L2_cache_size


# A launch started early (programmatic dependent launch) asks at most this share of the L2 cache for the weights it
# will read: decode's latency-bound launches leave the memory idle, and more would evict what it asked for first.
EARLY_L2_SHARE = 0.5


def early_prefetch_bytes(device: torch.device) -> int:
    """Bytes of weights a launch started early may ask into L2 while the launch before it ends (0 for the
    interpreter: no cache to ask)."""
    if device.type != "cuda":
        return 0
    return int(_cuda_l2_bytes(cuda_index(device)) * EARLY_L2_SHARE)


@triton.jit
def prefetch_to_l2(pointers):
    """Asks the L2 cache for the lines holding `pointers` (valid addresses): a hint nothing waits for, so that
    loads issued later find them there. CUDA only: the interpreter has no PTX."""
    tl.inline_asm_elementwise(
        "prefetch.global.L2 [$1]; mov.u32 $0, 0;",
        "=r,l",
        [pointers.to(tl.int64)],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )


def _patch_interpreter_scalars() -> None:
    """Lets the Triton 3.6 interpreter use tensor scalars as loop bounds under numpy >= 2.4.

    The interpreter keeps scalars as 1-element arrays and converts them with int(array), which
    numpy 2.4 rejects, so every `range(start, n, STEP)` with runtime bounds fails on the CPU.
    """
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor
    if getattr(original, "_ds4_scalar_fix", False):
        return

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched._ds4_scalar_fix = True
    interpreter._patch_lang_tensor = patched


if interpreting():
    _patch_interpreter_scalars()
