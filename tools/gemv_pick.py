"""Reads `ds4 bench linear --sweep --json` output and writes the fastest tile settings per M family into
fp8_linear.py's TILE_TABLE (M = 1: FMA or tl.dot; M <= 16: summed over M = 4 and 16; M <= 64), printing them;
a row whose families the sweep left out keeps its settings.
For one GPU run that sweeps, picks, then tests and benchmarks what it picked (tools/gemv_gpu.sh)."""

import dataclasses
import json
import re
import sys
from pathlib import Path

from ds4.bench.linear import best_settings
from ds4.kernels.fp8_linear import TILE_TABLE

SOURCE = Path(__file__).resolve().parents[1] / "ds4/kernels/fp8_linear.py"


def settings(tiles: dict) -> str:
    return "TileSettings(" + ", ".join(f"{k}={v}" for k, v in tiles.items() if k != "prefetch" or v) + ")"


def main(path: str) -> None:
    sweeps = json.load(open(path))["sweeps"]

    def best(*families):
        ranked = best_settings([r for f in families for r in sweeps.get(f, [])])
        return ranked[0] if ranked else None

    current = {m: (d, (None, dataclasses.asdict(t))) for m, d, t in TILE_TABLE}
    fma, dot = best("fma_m1"), best("dot_m1")
    m1 = min(((False, fma), (True, dot)), key=lambda c: c[1][0] if c[1] else float("inf"))
    picks = {1: m1 if m1[1] else None, 16: (True, best("dot_m4", "dot_m16")), 64: (True, best("dot_m64"))}
    rows = [(m, *(picks[m] if picks[m] and picks[m][1] else current[m])) for m in (1, 16, 64)]
    table = "TILE_TABLE = (\n" + "".join(f"    ({m}, {d}, {settings(t)}),\n" for m, d, (_, t) in rows) + ")\n"
    text = SOURCE.read_text()
    SOURCE.write_text(re.sub(r"TILE_TABLE = \(\n.*?\n\)\n", table, text, count=1, flags=re.S))
    for m, d, (total, t) in rows:
        print(f"M<={m}: dot={d} " + (f"picked, {total:.4f} ms summed over the sweep's shapes" if total else "kept"), t)
    print(table)


if __name__ == "__main__":
    main(sys.argv[1])
