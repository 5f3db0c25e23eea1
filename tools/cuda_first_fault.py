"""Runs an op's parity samples one by one (seeded draws, not hypothesis) and prints the first
sample whose C++ call faults or differs, with the full traceback: with CUDA_LAUNCH_BLOCKING=1 the
faulting kernel's call is the one on the stack (hypothesis reports a later replay instead).

    CUDA_LAUNCH_BLOCKING=1 PYTHONPATH=py:build/ext:. python3 tools/cuda_first_fault.py v4_mla_dsa_attention bfloat16 [N]
"""

import sys
import traceback

import torch

from v4train.ops import REFERENCE
from v4train.testing.cases import CASES
from v4train.testing.check import check_parity
from v4train.testing.samples import RandomDraw


def main() -> int:
    name, dtype, count = sys.argv[1], getattr(torch, sys.argv[2]), int(sys.argv[3]) if len(sys.argv) > 3 else 200
    faults_only = "--faults-only" in sys.argv  # go on past samples that differ, stop at a fault
    op = CASES[name]
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
            message = str(e)  # the tensor's name first, the numbers last
            print(f"sample {i} differs: {message[:120]} ... {message[-300:]}")
        except Exception:
            print(f"sample {i}: {sample!r}")
            traceback.print_exc()
            return 1
    print(f"{count} samples: {len(differed)} differed {differed}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
