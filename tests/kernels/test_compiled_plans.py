"""Plans compiled for GPUs this machine does not have, by the ptxas that ships with triton (tools/offline_compile.py):
what the compiler reports is the oracle (registers, the spill stack, shared memory), no GPU needed."""

import json
import os
import pathlib
import subprocess
import sys

import pytest
import triton

ROOT = pathlib.Path(__file__).parents[2]
_PTXAS = pathlib.Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
pytestmark = pytest.mark.skipif(not _PTXAS.exists(), reason="this triton wheel ships no ptxas")

# Compiled in a process of its own: this one runs Triton's interpreter (conftest), which compiles nothing.
_MOE_PLANS = """
import json, sys
import torch
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor
from tools.offline_compile import compile_kernel, report
from ds4.kernels import moe

arch, sms, smem, tma, registers = json.loads(sys.argv[1])
results = []
# 100 rows an expert (the 128-row tier), an 8K prefill (the 256-row tier); one token (the e4m3 MMA's one-row tiles)
# where the device multiplies e4m3
for rows in (256 * 100, 8192 * 6) + ((6,) if arch >= 89 else ()):
    for gated, n, k in ((True, 2048, 4096), (False, 4096, 2048)):
        plan = moe.gemm_plan(
            rows, 256, n, k, gated, True, 2, sms, smem, tma, registers_hold_operands=registers, e4m3_mma=arch >= 89
        )
        wide, rest = moe._split(plan)
        for launch, part in moe._launches(plan):  # a prefill pass: the wide tiles' launch and the rest's
            def t(dtype):
                return torch.empty(1, dtype=dtype)
            a = t(torch.float8_e4m3fn if launch.column_groups else torch.bfloat16)
            if launch.tma:
                a = TensorDescriptor.from_tensor(torch.empty(64, k, dtype=torch.bfloat16), [launch.bm, launch.bk])
            code = torch.uint8 if launch.column_groups else torch.int32  # bytes, or words of eight codes
            per_word = 2 if launch.column_groups else 8
            args = dict(
                a_ptr=a, stride_a=k, xs_ptr=t(torch.float32), stride_xs=k // 128, order_ptr=t(torch.int32),
                bounds_ptr=t(torch.int32), gate_ptr=t(code), up_ptr=t(code), gate_scale_ptr=t(torch.uint8),
                up_scale_ptr=t(torch.uint8), stride_we=n * k // per_word, stride_wn=k // per_word,
                stride_se=n * k // 32, stride_sn=k // 32, route_w_ptr=t(torch.float32), out_ptr=t(torch.bfloat16),
                stride_out=n, n_experts=256, k_slots=6, K=k, N=n, limit=7.0, early_steps=2,
            )
            bn = launch.weight_rows // 2 if gated else launch.weight_rows
            constexprs = dict(
                E_PAD=256, BM=launch.bm, BN=bn, BK=launch.bk, MXFP4=True, COLUMN_GROUPS=launch.column_groups,
                GATED=gated, ROUND_BF16=True, DOT=tl.bfloat16, PRECISION="tf32", PTX=True, TMA_A=launch.tma,
                PDL=arch >= 90, PART=part, WIDE_ROWS=wide, REST_ROWS=rest,
            )
            compiled = compile_kernel(moe._grouped_gemm_kernel, args, constexprs, arch, launch.warps, launch.stages)
            results.append(dict(rows=rows, gated=gated, part=part, plan=repr(launch), **report(compiled)))
print(json.dumps(results))
"""


_MHC_PROJECTION = """
import json, sys
import torch
from tools.offline_compile import compile_kernel, report
from ds4.kernels import hyper_connections as mhc

arch, sms, smem = json.loads(sys.argv[1])
results = []
for dtype in (torch.bfloat16, torch.float16, torch.float32):
    precision = mhc.PROJECTION_PRECISION.get(dtype, "ieee")
    for tokens in (64, 8192):
        plan = mhc.plan(tokens, 4 * 4096, 4096, 32, dtype.itemsize, sms, smem)
        args = dict(
            h_ptr=torch.empty(1, dtype=dtype), h_stride=4 * 4096, fn_ptr=torch.empty(1), part_ptr=torch.empty(1),
            T=tokens, K=4 * 4096, k_blocks_per_split=plan.k_blocks_per_split,
        )
        constexprs = dict(
            MIX=24, MIX_PAD=32, BLOCK_T=plan.block_t, BLOCK_K=plan.block_k, PRECISION=precision, PARTS_F32=False,
            PDL=arch >= 90,
        )
        compiled = compile_kernel(mhc._projection_kernel, args, constexprs, arch, mhc.WARPS, plan.stages)
        results.append(dict(dtype=str(dtype), tokens=tokens, stages=plan.stages, **report(compiled)))
print(json.dumps(results))
"""


_INDEXER = """
import json, sys
import torch
import triton
from tools.offline_compile import compile_kernel, report
from ds4.kernels import indexer

arch = json.loads(sys.argv[1])
indexer.has_fp8 = lambda device: arch >= 89  # what the device would say
operand = torch.float8_e4m3fn if arch >= 89 else torch.uint8
results = []
for rows in (0, 1, 2, 4):  # a prefill chunk, then decode requests of 1 to 4 rows (MTP drafts)
    block_s, block_q, warps, stages = indexer._PREFILL_TILE if rows == 0 else indexer._DECODE_TILE
    block_q = block_q if rows == 0 else triton.next_power_of_2(rows)
    n = 64 if rows == 0 else block_q * 64
    warps = indexer._warps(warps, block_s, n, torch.device("cuda"))
    args = dict(
        q_ptr=torch.empty(1, dtype=operand), q_row16=512, q_head16=8, w_ptr=torch.empty(1), w_row4=16,
        vec_ptr=torch.empty(1, dtype=operand), scale_ptr=torch.empty(1), bt_ptr=torch.empty(1, dtype=torch.int32),
        stride_bt=64, key_end_ptr=torch.empty(1, dtype=torch.int32), rows_per_request=max(rows, 8192), n_heads=64,
        max_keys=2048, out_ptr=torch.empty(1), stride_out=2048,
    )
    if rows:
        args.update(tiles_per_program=16, chunks=1)
    else:
        args.update(query_blocks=128, key_tiles=8)
    kernel = indexer._indexer_decode_kernel if rows else indexer._indexer_logits_kernel
    constexprs = dict(H=64, BLOCK_Q=block_q, BLOCK_S=block_s, PAGE_=64, D=128, FP8_CVT=arch >= 89, DOT_F32=False)
    if rows:
        constexprs["PDL"] = arch >= 90
    compiled = compile_kernel(kernel, args, constexprs, arch, warps, stages)
    results.append(dict(rows=rows, warps=warps, **report(compiled)))
print(json.dumps(results))
"""


_ATTENTION = """
import json, sys
import torch
import triton.language as tl
from tools.offline_compile import compile_kernel, report
from ds4.kernels import sparse_attention as sa

arch, sms, smem = json.loads(sys.argv[1])
sa.mma_operands_in_registers = lambda device: arch in (80, 86, 89, 120)  # what the device would say
sa.mma_is_warpgroup = lambda device: arch == 90
sa.num_sms = lambda device: sms
sa.shared_memory_per_block = lambda device: smem
results = []
for tokens, split in ((1, True), (8192, False)):  # a decode step of one token, its keys split; an 8K prefill chunk
    plan = sa.attention_plan(torch.device("cuda"), 64, 512, tokens)
    def t(dtype):
        return torch.empty(1, dtype=dtype)
    sets = {}
    for i, width in enumerate((128, 512, 0)):
        sets.update({f"pool{i}": t(torch.uint8), f"stride_p{i}": 584, f"idx{i}": t(torch.int32), f"stride_i{i}": 512})
        sets[f"width{i}"] = width
    args = dict(
        q_ptr=t(torch.bfloat16), stride_qt=64 * 512, stride_qh=512, out_ptr=t(torch.bfloat16), stride_ot=64 * 512,
        stride_oh=512, part_ptr=t(torch.float32), exchange_ptr=t(torch.uint8), sink_ptr=t(torch.float32),
        pos_ptr=t(torch.int64), freq_ptr=t(torch.float32), eps=1e-6, n_heads=64, scale_log2=0.06, **sets,
        tiles_per_split=4,
    )
    constexprs = dict(
        D=512, DP=512, NOPE=448, ROPE=64, FP8=True, FP8_CVT=arch >= 89, ROW_ALIGN=8, DOT=tl.bfloat16, IEEE=False,
        SPLIT=split, ROTARY=True, HALF=32, BLOCK_H=plan.block_h, BLOCK_N=plan.block_n, STAGES=plan.stages,
        EXCHANGE=plan.exchange, PDL=arch >= 90,
    )
    compiled = compile_kernel(sa._sparse_attention_kernel, args, constexprs, arch, plan.num_warps, plan.stages)
    results.append(dict(tokens=tokens, plan=repr(plan), **report(compiled)))
print(json.dumps(results))
"""


_FP8_LINEAR = """
import json, sys
import torch
from tools.offline_compile import compile_kernel, report
from ds4.kernels import fp8_linear as fl

arch, sms, smem = json.loads(sys.argv[1])
results = []
for m in (1, 4, 16):  # decode rows (the Triton kernel's: cuBLAS takes larger calls)
    for n, k, groups in ((32768, 1024, 1), (4096, 8192, 1), (8192, 4096, 8)):  # wq_b, wo_b, the grouped wo_a
        plan = fl.linear_plan(m, n // groups, groups, k, 2, sms, smem)
        def t(dtype):
            return torch.empty(1, dtype=dtype)
        args = dict(
            x_ptr=t(torch.bfloat16), x_stride=groups * k, up_ptr=t(torch.bfloat16), up_stride=k, limit=0.0,
            w_ptr=t(torch.float8_e4m3fn), w_stride=k, ws_ptr=t(torch.float32), ws_stride=-(-k // 128),
            out_ptr=t(torch.bfloat16), out_stride=n, part_ptr=t(torch.float32), part_split_stride=n, part_stride=n,
            arrivals_ptr=t(torch.int32), M=m, rows_per_group=n // groups, K=k, chunks_per_split=plan.chunks_per_split,
            splits=plan.splits, early_chunks=2, norm_ptr=t(torch.float32), norm_eps=1e-6,
        )
        constexprs = dict(QUANTIZE_X=groups == 1, SWIGLU=False, ROW_SCALES=False, SPLIT=plan.splits > 1)
        if plan.use_dot:
            kernel = fl._fp8_linear_kernel
            constexprs.update(
                DOT_F32=False, BLOCK_M=plan.block_m, BLOCK_N=plan.block_n, BLOCK_K=plan.block_k, PDL=arch >= 90
            )
        else:
            kernel = fl._fp8_gemv_kernel
            constexprs.update(
                BLOCK_N=plan.block_n, BLOCK_K=plan.block_k, WARPS=plan.num_warps, RUN=fl.fma_weight_run(plan, 2),
                STAGES=plan.num_stages, PREFETCH=plan.prefetch, PDL=True,  # these parts launch it early
                NORM=n == 32768,  # wq_b takes q_a, its q_norm fused in
            )
        args = {name: value for name, value in args.items() if name in kernel.arg_names}
        compiled = compile_kernel(kernel, args, constexprs, arch, plan.num_warps, plan.num_stages)
        results.append(dict(m=m, n=n, plan=repr(plan), **report(compiled)))
print(json.dumps(results))
"""


def _compiled(script: str, *args) -> list[dict]:
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT)
    done = subprocess.run(
        [sys.executable, "-c", script, *map(json.dumps, args)], env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


@pytest.mark.parametrize(
    "arch,sms,smem,tma,registers",
    [(120, 188, 101376, True, True), (80, 108, 166912, False, True), (90, 132, 232448, True, False)],
    ids=["sm_120", "sm_80", "sm_90"],
)
def test_moe_prefill_plans_do_not_spill(arch, sms, smem, tma, registers):
    """The routed experts' wide tiles (and a prefill pass's rest launch, and one token's e4m3 tiles where the device
    multiplies e4m3) as each device gets them (RTX PRO 6000 / GB10, A100: mma.sync, both operands in registers;
    H200: wgmma): within the registers (a spill stack of at most 8 bytes, ptxas's own frame on sm_120) and the
    device's shared memory."""
    results = _compiled(_MOE_PLANS, [arch, sms, smem, tma, registers])
    assert {r["part"] for r in results if r["rows"] == 8192 * 6} == {"wide", "rest"}  # the prefill's two launches
    assert all("column_groups=16" in r["plan"] for r in results if r["rows"] == 6)
    for result in results:
        assert result["stack"] <= 8 and result["shared"] <= smem, result


@pytest.mark.parametrize("arch,sms,smem", [(120, 188, 101376), (90, 132, 232448)], ids=["sm_120", "sm_90"])
def test_mhc_projection_pipelines_within_half_the_shared_memory(arch, sms, smem):
    """hc_pre's projection at Flash's streams reads its tiles ahead (2 or more stages) on a ~99 KB part as on the
    H200, and its compiled kernel takes at most half the device's shared memory (two programs an SM)."""
    for result in _compiled(_MHC_PROJECTION, [arch, sms, smem]):
        assert result["stages"] >= 2 and result["shared"] <= smem // 2 and result["stack"] == 0, result


@pytest.mark.parametrize("arch", [80, 90, 120], ids=["sm_80", "sm_90", "sm_120"])
def test_indexer_kernels_compile_within_the_registers(arch):
    """The lightning indexer's scoring kernels as each device launches them (sm_80: the e4m3 operands read as bytes,
    which that part has no type for): a prefill chunk and decode requests of 1, 2 and 4 rows (the 4-row tile: a
    [128, 256] product), spilling at most 16 bytes a thread."""
    for result in _compiled(_INDEXER, arch):
        assert result["stack"] <= 16, result


@pytest.mark.parametrize(
    "arch,sms,smem",
    [(80, 108, 166912), (90, 132, 232448), (100, 148, 232448), (120, 188, 101376)],
    ids=["sm_80", "sm_90", "sm_100", "sm_120"],
)
def test_attention_plans_compile_within_the_device(arch, sms, smem):
    """The sparse attention's plans for Flash (64 heads x 512, the FP8 cache, the model's rotary queries) as each
    device gets them, a decode token and an 8K prefill: within its shared memory, the spill stack at most 64 bytes
    a thread (the [heads, 512] fp32 accumulator takes 128 registers of 255); at most 320 for sm_90's prefill plan
    with the exchange through memory (296 there: 64-key tiles, measured the fastest on the H200 all the same)."""
    for result in _compiled(_ATTENTION, [arch, sms, smem]):
        stack = 320 if "exchange=True" in result["plan"] else 64
        assert result["stack"] <= stack and result["shared"] <= smem, result


@pytest.mark.parametrize(
    "arch,sms,smem", [(90, 132, 232448), (100, 148, 232448), (120, 188, 101376)], ids=["sm_90", "sm_100", "sm_120"]
)
def test_fp8_linear_decode_plans_do_not_spill(arch, sms, smem):
    """The FP8 linear's decode plans (M = 1 by FMA, launched early with its weights asked into L2 as these parts
    launch it, wq_b's with its q_norm fused in; 4 and 16 by tl.dot) on the parts with e4m3, at Flash's wq_b, wo_b
    and grouped wo_a: no spill stack, within the shared memory."""
    for result in _compiled(_FP8_LINEAR, [arch, sms, smem]):
        assert result["stack"] == 0 and result["shared"] <= smem, result
