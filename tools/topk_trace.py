"""Where a top-k call's time goes, program by program: runs a copy of ds4/kernels/topk.py with globaltimer
stamps at each step (written to a trace buffer) and prints each step's median and worst duration.

Run on the GPU from the repo root: python tools/topk_trace.py [ROWSxCOLS ...] [knob=value ...]
(the shapes default to 1x1048576 64x131072 2048x65536; k is 512)."""

import importlib.util
import pathlib
import re
import sys
import tempfile

import torch

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


def traced_module():
    src = pathlib.Path("ds4/kernels/topk.py").read_text()
    edits = [
        ("def _count_split(row_scores,", "def _count_split(trace, row_scores,"),
        ("_count_split(row_scores, row_gm,", "_count_split(trace, row_scores, row_gm,"),
        ("_count_split(_row_scores(", "_count_split(trace, _row_scores("),
        ("def _finish(row_scores,", "def _finish(trace, row_scores,"),
        ("        _finish(row_scores,", "        _finish(trace, row_scores,"),
        ("def _scan_kernel(scores_ptr,", "def _scan_kernel(trace_ptr, scores_ptr,"),
        ("def _count_kernel(scores_ptr,", "def _count_kernel(trace_ptr, scores_ptr,"),
        ("](*head, tiles_per_split", "](TRACE, *head, tiles_per_split"),
        ("](*head, count_tiles", "](TRACE, *head, count_tiles"),
        ("def _row_tau_and_hot_groups(row_gm,", "def _row_tau_and_hot_groups(trace, row_gm,"),
        ("_row_tau_and_hot_groups(row_gm, cm_offset,", "_row_tau_and_hot_groups(trace, row_gm, cm_offset,"),
        (
            "        hot = real & (unit_keys >= tau)\n",
            mark(2, "        ") + "        hot = real & (unit_keys >= tau)\n",
        ),
        ("    tl.debug_barrier()\n    split_cand", mark(3, "    ") + "    split_cand"),
        (
            "    tl.store(counts_row + split, found)\n    tl.debug_barrier()\n",
            "    tl.store(counts_row + split, found)\n" + mark(4, "    "),
        ),
        ("    if last:\n        _finish(", mark(5, "    ") + "    if last:\n        _finish("),
        (
            "    if total <= CAP:\n        _select_candidates",
            mark(6, "    ") + "    if total <= CAP:\n        _select_candidates",
        ),
        (
            "                SPLIT_BLOCK, SINGLE, SELECT_BITS)\n",
            "                SPLIT_BLOCK, SINGLE, SELECT_BITS)\n" + mark(7, "        "),
        ),
    ]
    for old, new in edits:
        assert old in src, old
        src = src.replace(old, new)
    tau_line = re.compile(r"^( +)(tau = _row_tau\(row_gm, cm_offset, .*\)\n)", re.M)
    assert tau_line.search(src)
    src = tau_line.sub(lambda m: m.group(0) + mark(2, m.group(1)), src)
    program = "    trace = trace_ptr + (tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)) * 16\n"
    scan_head = "        _stagger_start(row, length, stagger_rows, stagger_sms, stagger_ns_per_entry)\n"
    assert src.count(scan_head) == 1
    src = src.replace(scan_head, scan_head + program + mark(0, "    "))  # the scan starts after the stagger
    src = src.replace(
        "                G, C, TILE, PREFETCH)\n", "                G, C, TILE, PREFETCH)\n" + mark(1, "    ")
    )
    count_head = "    if PDL:\n        tl.extra.cuda.gdc_wait()\n"
    assert src.count(count_head) == 1
    src = src.replace(count_head, count_head + program + mark(8, "    "))
    path = pathlib.Path(tempfile.mkdtemp()) / "topk_traced.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location("topk_traced", path)
    module = importlib.util.module_from_spec(spec)
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
    knobs = {
        k: (v == "True" if v in ("True", "False") else int(v)) for k, v in (a.split("=") for a in argv if "=" in a)
    }
    shapes = [tuple(int(v) for v in a.split("x")) for a in argv if "=" not in a]
    tk = traced_module()
    for rows, cols in shapes or ((1, 1048576), (64, 131072), (2048, 65536)):
        x = torch.randn(rows, cols, device="cuda")
        lengths = torch.full((rows,), cols, device="cuda", dtype=torch.int32)
        tk.TRACE = torch.zeros(rows * 1024 * 16, dtype=torch.int64, device="cuda")
        tk._topk_triton(x, lengths, 512, **knobs)
        for _ in range(3):
            tk.TRACE.zero_()
            got = tk._topk_triton(x, lengths, 512, **knobs)
        torch.cuda.synchronize()
        assert torch.equal(got, tk.topk_indices_reference(x, lengths, 512))
        used = tk.TRACE.view(-1, 16)
        used = used[(used[:, 0] > 0) | (used[:, 8] > 0)]
        report(used, f"{rows} x {cols} {knobs}")


if __name__ == "__main__":
    main(sys.argv[1:])
