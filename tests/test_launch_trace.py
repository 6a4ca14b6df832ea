"""The GPU tests' results tied to the source: today's kernel launches against those of the last GPU-tested tree.

Most kernel tests run only on a GPU (tests/test_kernels_gpu.py and the other `gpu`-marked files), so a change to a
kernel or to the plan that picks it would go unseen on the CPU until the next GPU session. tests/gpu_tested_launches.txt
holds every launch (benchmarks/launch_trace.py: the kernel, a hash of its code and of the JIT functions it calls,
grid, warps, stages, constexprs, and every other argument's dtype, shape and strides) that ops.forward and
ops.backward make for ~80 inputs as on the H200, recorded from the tree whose GPU results
benchmarks/results/current/gpu-tests.md reports. Equal launches compile to the same kernels on the same data
layouts, so those results still hold; a difference means they may not.

When this fails on purpose (a kernel or a default launch changed): run the GPU tests the change touches on the H200,
commit their results to gpu-tests.md, then rewrite the record from that tree:
    python benchmarks/launch_trace.py --write tests/gpu_tested_launches.txt
"""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECORD = ROOT / "tests" / "gpu_tested_launches.txt"


def test_launches_match_the_gpu_tested_record():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the compiled kernels' launches
    env["PYTHONPATH"] = str(ROOT)
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "launch_trace.py"), "--check", str(RECORD)],
                         capture_output=True, text=True, env=env, cwd=ROOT, timeout=900)
    assert res.returncode == 0, (
        f"kernel launches differ from {RECORD.name} ({RECORD.read_text().splitlines()[0][2:]}): the GPU tests have "
        "not run on this source. Run them on the H200, then rewrite the record (this file's docstring says how).\n"
        + res.stdout[-6000:] + res.stderr[-3000:])
