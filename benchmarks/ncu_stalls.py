#!/usr/bin/env python
"""Where a kernel's warps stall, from Nsight Compute's per-instruction source page (benchmarks/ncu_profile.sh).

  python benchmarks/ncu_stalls.py ncu-SHAPE-source-KERNEL.csv[.gz] [--top 20]

Prints the warp-state samples by stall reason and by opcode, and the instructions with the most samples. The
Gluon kernels run idle warps (the warp-specialized partitions are padded to whole warpgroups, and the loader warp
mostly waits on an mbarrier): their samples sit on NOPs at a barrier and on the branch of an mbarrier wait loop,
so the "busy" figures leave out NOP and BRA samples to show what the MMA warpgroups do.
"""

import argparse
import collections
import csv
import gzip


def read(path):
    """(header, rows) of the source page's CSV (its first line names the kernel)."""
    with (gzip.open(path, "rt") if path.endswith(".gz") else open(path)) as f:
        lines = list(csv.reader(f))
    return lines[1], lines[2:]


def opcode(sass):
    words = sass.split()
    word = words[1] if words[0].startswith("@") else words[0]  # past a predicate
    return word.split(".")[0]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("csv")
    p.add_argument("--top", type=int, default=20)
    args = p.parse_args()
    header, rows = read(args.csv)
    col = {h: i for i, h in enumerate(header)}
    reasons = [h for h in header if h.startswith("stall_") and "Not Issued" not in h]
    base = int(rows[0][col["Address"]], 16)
    by_reason, by_op, executed = collections.Counter(), collections.Counter(), collections.Counter()
    busy_reason, insts = collections.Counter(), []
    for r in rows:
        samples = int(r[col["Warp Stall Sampling (All Samples)"]] or 0)
        sass = r[col["Source"]].strip()
        op = opcode(sass)
        stalls = {h[6:]: int(r[col[h]] or 0) for h in reasons}
        by_reason.update(stalls)
        if op not in ("NOP", "BRA"):
            busy_reason.update(stalls)
            by_op[op] += samples
            executed[op] += int(r[col["Instructions Executed"]] or 0)
        insts.append((samples, int(r[col["Address"]], 16) - base, sass, stalls))
    total, busy = sum(by_reason.values()), sum(busy_reason.values())
    print(f"{args.csv}: {total} samples, {busy} outside NOP/BRA (idle warps and mbarrier waits)")
    print("stall reason          all   busy")
    for reason, n in busy_reason.most_common(12):
        print(f"  {reason:18s} {100 * by_reason[reason] / total:5.1f}% {100 * n / busy:5.1f}%")
    n_exec = sum(executed.values())
    print("opcode   samples (busy)  instructions executed")
    for op, n in by_op.most_common(12):
        print(f"  {op:10s} {100 * n / busy:5.1f}%  {100 * executed[op] / n_exec:5.1f}%")
    print(f"top {args.top} instructions (offset, samples, top reasons):")
    for samples, off, sass, stalls in sorted(insts, key=lambda x: -x[0])[:args.top]:
        top = ", ".join(f"{k} {v}" for k, v in sorted(stalls.items(), key=lambda x: -x[1])[:2] if v)
        print(f"  {off:#07x} {100 * samples / total:5.1f}%  {sass[:58]:58s} {top}")


if __name__ == "__main__":
    main()
