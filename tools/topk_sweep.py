"""Graph-replay time of the Triton top-k path under chosen variants of its settings on one shape, each checked
exact, with the scan kernel's registers and spills so far (a quick tuning round; `ds4 bench kernels
--all-tiles` sweeps ds4.bench.kernels.TOPK_VARIANTS over several shapes).

Run on the GPU from the repo root: python tools/topk_sweep.py ROWSxCOLS[xK] "field=value ..." ...
Fields are those of ds4.kernels.topk_triton.Settings, or LAYOUT.field for a row layout's (split.tile=8192,
one_program.warps=4); "" is the chosen settings. Values parse as True/False/None, int or float."""

import sys

import torch

from ds4.bench.ceilings import graph_ms
from ds4.bench.kernels import ROTATE_BYTES, vary
from ds4.kernels import topk as tk
from ds4.kernels import topk_triton


def parse_value(text: str):
    if text in ("True", "False", "None"):
        return {"True": True, "False": False, "None": None}[text]
    return float(text) if "." in text or "e" in text else int(text)


def parse_changes(text: str) -> dict:
    changes: dict = {}
    for item in text.split():
        name, value = item.split("=")
        if "." in name:
            layout, field = name.split(".")
            changes.setdefault(layout, {})[field] = parse_value(value)
        else:
            changes[name] = parse_value(value)
    return changes


def scan_registers() -> list:
    caches = topk_triton._scan_kernel.device_caches.values()
    return sorted({(c.n_regs, c.n_spills) for cache in caches for c in cache[0].values()})


def main(argv):
    shape = [int(v) for v in argv[0].split("x")]
    rows, cols, k = (shape + [512])[:3]
    sets = max(1, ROTATE_BYTES // (rows * cols * 4))
    inputs = [torch.randn(rows, cols, device="cuda") for _ in range(sets)]
    lengths = torch.full((rows,), cols, device="cuda", dtype=torch.int32)
    want = tk.topk_indices_reference(inputs[0], lengths, k)
    chosen = topk_triton.settings_for(inputs[0].device)
    for text in argv[1:]:
        settings = vary(chosen, parse_changes(text))
        exact = bool(torch.equal(topk_triton.launch(inputs[0], lengths, k, settings), want))

        def ours():
            for x in inputs:
                topk_triton.launch(x, lengths, k, settings)

        ms = graph_ms(ours) / sets
        print(
            f"{rows} x {cols}, {k} [{text}]: {ms:.4f} ms exact={exact} scan regs/spills so far {scan_registers()}",
            flush=True,
        )


if __name__ == "__main__":
    main(sys.argv[1:])
