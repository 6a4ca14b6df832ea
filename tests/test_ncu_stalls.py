"""benchmarks/ncu_stalls.py: Nsight Compute's per-instruction stall samples summed (no GPU needed)."""

import csv
import gzip
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "ncu_stalls.py"
REASONS = ["stall_barrier", "stall_long_sb", "stall_selected", "stall_wait"]


def _write(path, rows):
    """A source-page CSV as `ncu --page source --csv --print-source sass` writes it: the kernel's name on the first
    line, then the header and one row per instruction (only the columns the script reads, plus a not-issued one)."""
    header = ["Address", "Source", "Warp Stall Sampling (All Samples)", "Instructions Executed", *REASONS,
              "stall_wait (Not Issued)"]
    with gzip.open(path, "wt", newline="") as f:
        w = csv.writer(f, quoting=csv.QUOTE_ALL)
        w.writerow(["Kernel Name", "_bwd_dq_hopper_kernel", ""])
        w.writerow(header)
        for addr, sass, executed, stalls in rows:
            w.writerow([hex(0x7f0000000000 + addr), "      " + sass, sum(stalls), executed, *stalls, 999])


def test_busy_samples_leave_out_idle_warps(tmp_path):
    f = tmp_path / "ncu-x-source-k.csv.gz"
    _write(f, [
        (0x00, "NOP", 0, [60, 0, 0, 0]),  # an idle warp at a barrier
        (0x10, "@!P0  BRA 0x7f0000000000", 0, [0, 20, 0, 0]),  # an mbarrier wait loop
        (0x20, "MUFU.EX2 R1, R2", 10, [0, 0, 2, 6]),
        (0x30, "FFMA R3, R1, R4, -R5", 30, [0, 2, 8, 2]),
    ])
    out = subprocess.run([sys.executable, str(SCRIPT), str(f), "--top", "2"], capture_output=True, text=True,
                         check=True).stdout
    assert "100 samples, 20 outside NOP/BRA" in out
    lines = {line.split()[0]: line.split()[1:] for line in out.splitlines() if line.startswith("  ")}
    assert lines["wait"] == ["8.0%", "40.0%"]  # 8 of all 100 samples, 8 of the 20 busy ones
    assert lines["barrier"] == ["60.0%", "0.0%"]
    assert lines["MUFU"] == ["40.0%", "25.0%"]  # 8 of 20 busy samples; 10 of 40 executed instructions
    assert "0x00000  60.0%  NOP" in out  # the top instruction, offset from the kernel's first
