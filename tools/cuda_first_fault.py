"""Runs an op's parity samples one by one (seeded draws, not hypothesis) and prints the first
sample whose C++ call faults or differs, with the full traceback: with CUDA_LAUNCH_BLOCKING=1 the
faulting kernel's call is the one on the stack (hypothesis reports a later replay instead).

    CUDA_LAUNCH_BLOCKING=1 PYTHONPATH=py:build/ext:. python3 tools/cuda_first_fault.py v4_mla_dsa_attention bfloat16 [N]
"""

import sys
import traceback

import torch

from v4train.ops import OPS, REFERENCE
from v4train.ops.check import check_parity
from v4train.ops.samples import RandomDraw


def main() -> int:
    name, dtype, count = sys.argv[1], getattr(torch, sys.argv[2]), int(sys.argv[3]) if len(sys.argv) > 3 else 200
    faults_only = "--faults-only" in sys.argv  # go on past samples that differ, stop at a fault
    if "--old-judge" in sys.argv:  # diagnosis: the judge as it was, with its exit for an inexact reference
        _use_old_judge()
    op = OPS[name]
    differed = []
    for i in range(count):
        sample = op.samples(RandomDraw(i), dtype, "cuda")
        try:
            check_parity(op, op.cpp(), REFERENCE[name], sample, i)
        except AssertionError as e:
            differed.append(i)
            if not faults_only:
                print(f"sample {i}: {sample!r}")
                traceback.print_exc()
                return 1
            print(f"sample {i} differs: {str(e)[-300:]}")
        except Exception:
            print(f"sample {i}: {sample!r}")
            traceback.print_exc()
            return 1
    print(f"{count} samples: {len(differed)} differed {differed}")
    return 0


def _use_old_judge():
    from v4train.ops import check
    from v4train.ops.compare import assert_close
    from v4train.ops.tolerances import TOLERANCES

    def judge(op, actual, expected, truth, name):
        try:
            assert_close(actual, expected, name, truth=truth)
        except AssertionError:
            if expected.dtype == torch.float64 or torch.float64 not in op.dtypes or truth is None:
                raise
            a, e, t = actual.double().cpu(), expected.double().cpu(), truth.double().cpu()
            finite = e.isfinite()
            a, e, t = a[finite], e[finite], t[finite]
            tol = TOLERANCES[expected.dtype]
            floor = tol.rtol * t.norm() + tol.atol * t.numel() ** 0.5
            if (e - t).norm() > floor or (a - t).norm() <= check.LOW_PRECISION_FACTOR * max((e - t).norm(), floor):
                return
            raise
    check.judge = judge


if __name__ == "__main__":
    sys.exit(main())
