"""Graph-replay time of the Triton top-k path for chosen knob sets on one shape, each checked exact, with the
scan kernel's registers after each (a quick tuning round; `ds4 bench kernels --all-tiles` is the full sweep).

Run on the GPU from the repo root: python tools/topk_sweep.py ROWSxCOLS[xK] "knob=value ..." ...
("" is the defaults; values parse as True/False, int or float)."""

import sys

import torch

from ds4.bench.kernels import ROTATE_BYTES, _graph_ms
from ds4.kernels import topk as tk


def parse_knobs(text: str) -> dict:
    knobs = {}
    for item in text.split():
        name, value = item.split("=")
        if value in ("True", "False"):
            knobs[name] = value == "True"
        else:
            knobs[name] = float(value) if "." in value else int(value)
    return knobs


def scan_registers() -> list:
    return sorted(
        {(c.n_regs, c.n_spills) for cache in tk._scan_kernel.device_caches.values() for c in cache[0].values()}
    )


def main(argv):
    shape = [int(v) for v in argv[0].split("x")]
    rows, cols, k = (shape + [512])[:3]
    sets = max(1, ROTATE_BYTES // (rows * cols * 4))
    inputs = [torch.randn(rows, cols, device="cuda") for _ in range(sets)]
    lengths = torch.full((rows,), cols, device="cuda", dtype=torch.int32)
    want = tk.topk_indices_reference(inputs[0], lengths, k)
    for text in argv[1:]:
        knobs = parse_knobs(text)
        exact = bool(torch.equal(tk._topk_triton(inputs[0], lengths, k, **knobs), want))

        def ours():
            for x in inputs:
                tk._topk_triton(x, lengths, k, **knobs)

        ms = _graph_ms(ours) / sets
        print(
            f"{rows} x {cols}, {k} {knobs}: {ms:.4f} ms exact={exact} scan regs/spills so far {scan_registers()}",
            flush=True,
        )


if __name__ == "__main__":
    main(sys.argv[1:])
