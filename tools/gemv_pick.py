"""Reads `ds4 bench linear --sweep --json` output and writes the fastest tile settings per M family into
fp8_linear.py's TILE_TABLE (M = 1: FMA or tl.dot; M <= 16: summed over M = 4 and 16; M <= 64), printing them.
For one GPU run that sweeps, picks, then tests and benchmarks what it picked (tools/gemv_gpu.sh)."""

import json
import re
import sys
from pathlib import Path

from ds4.bench.linear import best_settings

SOURCE = Path(__file__).resolve().parents[1] / "ds4/kernels/fp8_linear.py"


def settings(tiles: dict) -> str:
    return "TileSettings(" + ", ".join(f"{k}={v}" for k, v in tiles.items() if k != "prefetch" or v) + ")"


def main(path: str) -> None:
    sweeps = json.load(open(path))["sweeps"]
    fma, dot = best_settings(sweeps["fma_m1"])[0], best_settings(sweeps["dot_m1"])[0]
    m1 = (False, fma) if fma[0] <= dot[0] else (True, dot)
    m16 = best_settings(sweeps["dot_m4"] + sweeps["dot_m16"])[0]
    m64 = best_settings(sweeps["dot_m64"])[0]
    rows = [(1, m1[0], m1[1]), (16, True, m16), (64, True, m64)]
    table = "TILE_TABLE = (\n" + "".join(f"    ({m}, {d}, {settings(t)}),\n" for m, d, (_, t) in rows) + ")\n"
    text = SOURCE.read_text()
    SOURCE.write_text(re.sub(r"TILE_TABLE = \(\n.*?\n\)\n", table, text, count=1, flags=re.S))
    print(f"M=1 FMA best {fma[0]:.4f} ms, tl.dot best {dot[0]:.4f} ms (summed over the sweep's shapes)")
    for m, d, (total, t) in rows:
        print(f"picked M<={m}: dot={d} {total:.4f} ms {t}")
    print(table)


if __name__ == "__main__":
    main(sys.argv[1])
