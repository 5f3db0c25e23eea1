"""What the tests need of one op (`OpCase`): its parity samples, the bad calls it must refuse
(`ErrorCase`), the shapes tools/benchmark.py times; beside its runtime record (v4train.op.Op),
whose facts it hands on (name, reference, dtypes, cpp(), ...)."""

from __future__ import annotations

import dataclasses
from typing import Callable

from v4train.op import Op


@dataclasses.dataclass(frozen=True)
class ErrorCase:
    """A bad call of the op and what the C++ entry must say: `exc` whose message starts with
    "<op name>: " and contains `message`. `args()` builds the arguments (on the CPU)."""

    what: str
    args: Callable[[], tuple]
    message: str
    exc: type = ValueError


@dataclasses.dataclass(frozen=True)
class OpCase:
    """op: the runtime record. samples: (draw, dtype, device) -> Sample, the parity inputs (see
    v4train.testing.samples); the parity suite draws them through hypothesis, the trainer's
    self-check from a seeded RNG. errors: bad calls and the messages the C++ entry must give.
    benchmarks: (device, dtype) -> (description, args): the shapes tools/benchmark.py times."""

    op: Op
    samples: Callable | None = None
    errors: tuple[ErrorCase, ...] = ()
    benchmarks: tuple[Callable, ...] = ()

    def __getattr__(self, name):  # the op's own facts: name, reference, dtypes, inplace, cpp, ...
        return getattr(self.op, name)
