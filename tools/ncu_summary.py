"""A line per kernel launch of an Nsight Compute raw CSV (`ncu --import REPORT --csv --page raw`): duration, DRAM,
issue-slot, shared-memory pipe and tensor pipe use, registers, occupancy, and the largest warp-stall reasons per
issued instruction (metrics the report lacks are left out).

    python3 tools/ncu_summary.py ncu_raw.csv
"""

import csv
import re
import sys

SHOWN = {
    "gpu__time_duration.sum": "time",
    "dram__throughput.avg.pct_of_peak_sustained_elapsed": "DRAM",
    "sm__inst_issued.avg.pct_of_peak_sustained_active": "issue slots",
    "l1tex__data_pipe_lsu_wavefronts_mem_shared.sum.pct_of_peak_sustained_elapsed": "shared-memory pipe",
    "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active": "tensor pipe",
    "launch__registers_per_thread": "registers",
    "sm__warps_active.avg.pct_of_peak_sustained_active": "occupancy",
}
STALL = re.compile(r"smsp__average_warps_issue_stalled_(\w+)_per_issue_active\.ratio$")


def main(path: str) -> int:
    table = list(csv.reader(open(path)))
    if len(table) < 3:
        print("no kernels profiled: see the ncu log", file=sys.stderr)
        return 1
    head, units, launches = table[0], table[1], table[2:]
    col = {name: i for i, name in enumerate(head)}
    for row in launches:

        def value(name):
            try:
                return float(row[col[name]].replace(",", ""))
            except (KeyError, ValueError):
                return None

        cells = [f"{label} {value(m):g} {units[col[m]]}".rstrip() for m, label in SHOWN.items() if value(m) is not None]
        stalls = sorted(((value(m), STALL.match(m).group(1)) for m in col if STALL.match(m) and value(m)), reverse=True)
        print(
            f"{row[col['ID']]} {row[col['Kernel Name']]}: "
            + ", ".join(cells)
            + " | stalls "
            + ", ".join(f"{name} {v:.2f}" for v, name in stalls[:5])
        )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
