"""Where a kernel's time goes, phase by phase: reads Nsight Compute's per-instruction SASS table
(`ncu -i REPORT --page source --csv --print-source sass`, from a report taken with the
SourceCounters section) and splits each kernel's SASS at its block barriers (BAR.SYNC): a
kernel whose block loads, multiplies and writes in turns, a barrier between each, shows which
turn its instructions and its warps' stall samples fall in. The opcodes that name a phase (HMMA:
a tensor-core product; LDSM: ldmatrix; LDG / STG / LDGSTS: global loads, stores, cp.async; MUFU:
exp; DADD / DFMA: float64) are counted in each.

    python3 tools/ncu_phases.py build/gpu_check/ncu_sass.csv.gz [--min-share 0.5]

(The kernels are built without -lineinfo, so there is no CUDA line to name: the phases are read
against the kernel's source by their order and their opcodes.)
"""

from __future__ import annotations

import argparse
import collections
import csv
import gzip
import io
import re
import sys

LANDMARKS = ("HMMA", "LDSM", "LDG", "STG", "LDGSTS", "MUFU", "DADD", "DFMA", "SHFL")


def opcode(source: str) -> str:
    """'@!P0 BRA `(.L_x_1)' -> 'BRA'; '      HMMA.16816.F32.BF16 R4, ...' -> 'HMMA'."""
    words = source.split()
    if words and words[0].startswith("@"):
        words = words[1:]
    return words[0].split(".")[0] if words else "?"


def kernels(text: str) -> list[tuple[str, list[tuple[str, float, float]]]]:
    """[(kernel name, [(opcode, instructions executed, stall samples)])] in the table's order; a
    kernel listed twice with the same rows (ncu prints some twice) once."""
    out, seen, name, header, body = [], set(), None, None, []

    def close():
        if name is not None and header is not None:
            key = (name, tuple(body))
            if key not in seen:
                seen.add(key)
                out.append((name, body))

    for row in csv.reader(io.StringIO(text)):
        if row and row[0] == "Kernel Name":
            close()
            name, header, body = row[1], None, []
        elif row and row[0] == "Address":
            header = {h: i for i, h in enumerate(row)}
        elif header is not None and len(row) == len(header):
            executed = float(row[header["Instructions Executed"]] or 0)
            samples = float(row[header["Warp Stall Sampling (All Samples)"]] or 0)
            body.append((opcode(row[header["Source"]]), executed, samples))
    close()
    return out


def phases(body: list[tuple[str, float, float]]) -> list[dict]:
    """The SASS split after each BAR.SYNC: each phase's first and last instruction index, its shares of
    the kernel's instructions and samples (percent), its top opcodes and its landmark counts."""
    total_i = sum(b[1] for b in body) or 1.0
    total_s = sum(b[2] for b in body) or 1.0
    out, start, ops, samples = [], 0, collections.Counter(), 0.0
    for n, (op, i, s) in enumerate(body):
        ops[op] += i
        samples += s
        if op == "BAR" or n == len(body) - 1:
            executed = sum(ops.values())
            share = lambda c: 100 * c / executed  # noqa: E731 (called only where executed > 0)
            out.append({"first": start, "last": n, "instructions": 100 * executed / total_i,
                        "samples": 100 * samples / total_s,
                        "top": [(o, share(c)) for o, c in ops.most_common(4)] if executed else [],
                        "landmarks": {o: share(ops[o]) for o in LANDMARKS if o in ops} if executed else {}})
            start, ops, samples = n + 1, collections.Counter(), 0.0
    return out


def report(text: str, min_share: float = 0.5) -> str:
    lines = []
    for name, body in kernels(text):
        short = re.sub(r"<unnamed>::|\b\w+::", "", name.removeprefix("void "))  # without namespaces
        lines.append(f"{short}: {sum(b[1] for b in body) / 1e6:.1f}M instructions, "
                     f"{sum(b[2] for b in body):.0f} stall samples, {len(body)} SASS instructions")
        lines.append("| SASS | instructions % | samples % | top opcodes (% of the phase) | landmarks (% of the phase) |")
        lines.append("|---|---|---|---|---|")
        for p in phases(body):
            if max(p["instructions"], p["samples"]) < min_share:
                continue
            top = ", ".join(f"{o} {v:.0f}" for o, v in p["top"])
            marks = ", ".join(f"{o} {v:.1f}" for o, v in sorted(p["landmarks"].items()))
            lines.append(f"| {p['first']}-{p['last']} | {p['instructions']:.1f} | {p['samples']:.1f} | {top} | {marks} |")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("csv", help="ncu's --page source --csv --print-source sass output (.gz allowed)")
    parser.add_argument("--min-share", type=float, default=0.5,
                        help="leave out phases under this percent of both instructions and samples")
    args = parser.parse_args(argv)
    opener = gzip.open if args.csv.endswith(".gz") else open
    with opener(args.csv, "rt") as f:
        text = f.read()
    out = report(text, args.min_share)
    if not out:
        sys.exit(f"ncu_phases: no kernel's SASS table in {args.csv} (was the report taken with --section "
                 "SourceCounters, and printed with --page source --csv --print-source sass?)")
    print(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
