"""Where a top-k call's time goes, program by program: runs a copy of ds4/kernels/topk_triton.py with
globaltimer stamps at each step (written to a trace buffer) and prints each step's median and worst duration.

Run on the GPU from the repo root: python tools/topk_trace.py [ROWSxCOLS ...] ["field=value ..."]
(the shapes default to 1x1048576 64x131072 2048x65536; k is 512; the settings' changes read as in
tools/topk_sweep.py)."""

import importlib.util
import pathlib
import re
import sys
import tempfile

import torch
from topk_sweep import parse_changes

from ds4.bench.kernels import vary
from ds4.kernels.topk import topk_indices_reference

STEPS = {
    0: "scan start",
    1: "scan end",
    8: "count start",
    2: "tau",
    3: "hot list",
    4: "gather",
    5: "arrival",
    6: "finish loads",
    7: "select",
}


def mark(i: int, indent: str) -> str:
    return f"{indent}tl.debug_barrier()\n{indent}tl.store(trace + {i}, tl.extra.cuda.globaltimer())\n"


def insert(src: str, anchor: str, text: str, after: bool = True) -> str:
    assert src.count(anchor) == 1, anchor
    return src.replace(anchor, anchor + text if after else text + anchor)


def traced_module():
    """ds4/kernels/topk_triton.py with a trace pointer passed down to every step and a stamp after each; the
    module's TRACE tensor (16 stamps a program) is where they go."""
    src = (pathlib.Path(__file__).parents[1] / "ds4/kernels/topk_triton.py").read_text()
    for helper in ("_count_split(", "_finish(", "_row_tau_and_hot_groups("):
        src = src.replace(helper, helper + "trace, ")
    for kernel in ("def _scan_kernel(", "def _count_kernel("):
        src = src.replace(kernel, kernel + "trace_ptr, ")
    src, launches = re.subn(r"\]\(\n( +)\*head,", r"](\n\1TRACE,\n\1*head,", src)
    assert launches == 2
    program = "    trace = trace_ptr + (tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)) * 16\n"
    src = insert(
        src, "    row_scores = _row_scores(scores_ptr, row, stride_row, VEC)\n", program + mark(0, "    "), False
    )
    src = insert(src, "        PREFETCH,\n    )\n", mark(1, "    "))
    src = insert(src, "    if PDL:\n        tl.extra.cuda.gdc_wait()\n", program + mark(8, "    "))
    src = insert(src, "        hot = real & (unit_keys >= tau)\n", mark(2, "        "), False)
    src, taus = re.subn(r"^( +)(tau = _row_tau\(.*\)\n)", lambda m: m.group(0) + mark(2, m.group(1)), src, flags=re.M)
    assert taus == 3
    src = insert(src, "    split_cand = cand_row", mark(3, "    "), False)
    src = insert(src, "    tl.store(counts_row + split, found)\n", mark(4, "    "))
    src = insert(src, "    if last:\n        _finish(", mark(5, "    "), False)
    src = insert(src, "    if total <= CAP:\n        _select_candidates", mark(6, "    "), False)
    src = insert(src, "            K_PAD,\n            SINGLE,\n        )\n", mark(7, "        "))
    path = pathlib.Path(tempfile.mkdtemp()) / "topk_traced.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location("topk_traced", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def report(trace: torch.Tensor, label: str):
    t = trace.cpu().double() / 1e3  # us
    t0 = t[:, 0][t[:, 0] > 0].min()
    fused = bool((t[:, 8] == 0).all())
    before_tau = t[:, 1] if fused else t[:, 8]
    spans = {
        "scan": (t[:, 0], t[:, 1]),
        "count launch gap": (t[:, 1].max().expand_as(t[:, 8]), t[:, 8]),
        "tau": (before_tau, t[:, 2]),
        "hot list": (t[:, 2], t[:, 3]),
        "gather": (t[:, 3], t[:, 4]),
        "arrival": (t[:, 4], t[:, 5]),
        "finish loads": (t[:, 5], t[:, 6]),
        "select": (t[:, 6], t[:, 7]),
    }
    print(f"{label}: {t.shape[0]} programs, end {float(t[:, 7].max() - t0):.1f} us after the first scan start")
    for name, (a, b) in spans.items():
        ok = (a > 0) & (b > 0)
        if fused and name == "count launch gap" or not ok.any():
            continue
        d = (b - a)[ok]
        print(f"  {name:17s} median {float(d.median()):7.2f}  max {float(d.max()):7.2f}  (n={int(ok.sum())})")


def main(argv):
    changes = parse_changes(" ".join(a for a in argv if "=" in a))
    shapes = [tuple(int(v) for v in a.split("x")) for a in argv if "=" not in a]
    tk = traced_module()
    settings = vary(tk.settings_for(torch.device("cuda")), changes)
    for rows, cols in shapes or ((1, 1048576), (64, 131072), (2048, 65536)):
        x = torch.randn(rows, cols, device="cuda")
        lengths = torch.full((rows,), cols, device="cuda", dtype=torch.int32)
        tk.TRACE = torch.zeros(rows * 1024 * 16, dtype=torch.int64, device="cuda")
        tk.launch(x, lengths, 512, settings)
        for _ in range(3):
            tk.TRACE.zero_()
            got = tk.launch(x, lengths, 512, settings)
        torch.cuda.synchronize()
        assert torch.equal(got, topk_indices_reference(x, lengths, 512))
        used = tk.TRACE.view(-1, 16)
        used = used[(used[:, 0] > 0) | (used[:, 8] > 0)]
        report(used, f"{rows} x {cols} {changes}")


if __name__ == "__main__":
    main(sys.argv[1:])
