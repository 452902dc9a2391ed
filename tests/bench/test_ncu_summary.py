"""tools/ncu_summary.py: a line per launch of an Nsight Compute raw CSV, with the metrics the report has."""

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).parents[2] / "tools"))

import ncu_summary  # noqa: E402


def test_a_line_a_launch_with_its_metrics_and_largest_stalls(tmp_path, capsys):
    stalled = "smsp__average_warps_issue_stalled_{}_per_issue_active.ratio"
    head = ["ID", "Kernel Name", "gpu__time_duration.sum", "launch__registers_per_thread"]
    head += ["l1tex__data_pipe_lsu_wavefronts_mem_shared.sum.pct_of_peak_sustained_elapsed"]
    head += [stalled.format(s) for s in ("barrier", "long_scoreboard", "mio_throttle")]
    rows = [head, ["", "", "us", "register/thread", "%", "", "", ""]]
    rows += [["0", "_sparse_attention_kernel", "4,312.5", "255", "61.2", "1.48", "1.23", "0"]]
    path = tmp_path / "raw.csv"
    path.write_text("\n".join(",".join(f'"{c}"' for c in row) for row in rows))
    assert ncu_summary.main(str(path)) == 0
    line = capsys.readouterr().out.strip()
    assert line.startswith("0 _sparse_attention_kernel: time 4312.5 us, shared-memory pipe 61.2 %, registers 255")
    assert line.endswith("| stalls barrier 1.48, long_scoreboard 1.23")  # a zero stall is left out


def test_an_empty_report_says_so(tmp_path, capsys):
    path = tmp_path / "raw.csv"
    path.write_text('"ID","Kernel Name"\n')
    assert ncu_summary.main(str(path)) == 1
    assert "no kernels profiled" in capsys.readouterr().err
