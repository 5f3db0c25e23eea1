"""Writes the skeleton of a new op: `tools/bazel run //tools:new_op -- --name=foo`.

Creates, by the naming rule every op follows,
  cc/ops/foo.{h,cc}              the ATen compute: argument checks, then "not implemented yet"
  cc/ops/bind/foo.cc             NB_MODULE(v4_foo, m)
  py/v4train/reference/foo.py    the pure-PyTorch reference (a placeholder: y = x * weight)
  py/v4train/testing/cases/foo.py  its test case: samples, an error case, a benchmark shape
and adds v4_foo to the lists of ops (its record in py/v4train/ops/__init__.py, its case in
py/v4train/testing/cases/__init__.py, its module in cc/ops.bzl). The result
builds, and `tools/bazel test //parity:foo` fails saying what to implement. Write the math in
the reference and the same math in cc/ops/foo.cc until that test passes.
"""

from __future__ import annotations

import argparse
import os
import re
import sys

H = '''#pragma once

#include <ATen/core/Tensor.h>

// {doc}
// x: [..., H] float32/bfloat16/float16, any strides; weight: [H]. Returns x's shape and dtype.
at::Tensor {name}(const at::Tensor& x, const at::Tensor& weight);
'''

CC = '''#include "cc/ops/{op}.h"

#include <ATen/ATen.h>

#include <string>

#include "cc/common/checks.h"

at::Tensor {name}(const at::Tensor& x, const at::Tensor& weight) {{
  constexpr const char* op = "{name}";
  v4::check_floating(op, "x", x);
  v4::check_min_dim(op, "x", x, 1);
  v4::check_floating(op, "weight", weight);
  v4::check_dim(op, "weight", weight, 1);
  v4::check_size(op, "weight", weight, 0, x.size(-1), "x.size(-1)");
  v4::check_same_device(op, "weight", weight, "x", x);
  // Replace this line with the ATen compute of py/v4train/reference/{op}.py.
  C10_THROW_ERROR(NotImplementedError, std::string(op) + ": not implemented yet: write in cc/ops/{op}.cc what "
                                       "py/v4train/reference/{op}.py computes");
}}
'''

BIND = '''#include "cc/common/bridge.h"
#include "cc/ops/{op}.h"

namespace nb = nanobind;

NB_MODULE({name}, m) {{
  v4::init_module(m);
  m.def("{name}", &{name}, nb::arg("x"), nb::arg("weight"), nb::call_guard<nb::gil_scoped_release>(),
        "{doc}");
}}
'''

REFERENCE = '''import torch


def {name}(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """{doc}

    y = x * weight (a placeholder: write the op's math here, and its shapes and the Hugging Face
    source it matches). x: [..., H], weight: [H]. Computed in promote_types(x.dtype, float32)
    (float64 for float64 input: the parity suite's exact answer), returned in x's dtype.
    """
    compute = torch.promote_types(x.dtype, torch.float32)
    return (x.to(compute) * weight.to(compute)).to(x.dtype)
'''

CASE = '''"""{name}: {doc}"""

import torch

from v4train.ops import OPS
from v4train.testing.case import ErrorCase, OpCase
from v4train.testing.samples import Sample, layout, make_leaf, seed, shape, size, view_as_layout


def samples(draw, dtype: torch.dtype, device) -> Sample:
    # Every tensor argument in a drawn layout (an op that ignores one's strides must fail here), and
    # widths up to 300: a kernel with another path for wide rows needs samples that reach it.
    lead, hidden, s = shape(draw, 0, 3, 9), size(draw, 300), seed(draw)
    x_layout, w_layout = layout(draw), layout(draw)
    leaves = {{"x": make_leaf(lead + (hidden,), x_layout, dtype, device, s),
              "weight": make_leaf((hidden,), w_layout, dtype, device, s + 1)}}

    def build(lv):
        return (view_as_layout(lv["x"], x_layout), view_as_layout(lv["weight"], w_layout)), {{}}

    return Sample(leaves, build, note=f"x layout {{x_layout}}, weight layout {{w_layout}}")


def _bench(device, dtype):
    x = torch.randn(4096, 6144, device=device, dtype=dtype, requires_grad=True)
    return "x [4096, 6144]", (x, torch.randn(6144, device=device, dtype=dtype, requires_grad=True))


CASE = OpCase(
    OPS["{name}"], samples=samples, benchmarks=(_bench,),
    errors=(
        ErrorCase("integer x", lambda: (torch.zeros(2, 8, dtype=torch.int64), torch.ones(8)),
                  "x must be float32, bfloat16 or float16, got Long"),
    ),
)
'''


def _insert(path: str, line: str, before: str | None = None, after_last: str | None = None) -> None:
    """Adds `line` before the first line equal to `before`, or after the last line that starts
    with `after_last`."""
    lines = open(path).read().split("\n")
    try:
        at = lines.index(before) if before else max(i for i, x in enumerate(lines) if x.startswith(after_last)) + 1
    except ValueError:
        sys.exit(f"new_op: cannot find where to add {line.strip()!r} in {path}")
    lines.insert(at, line)
    with open(path, "w") as f:
        f.write("\n".join(lines))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--name", required=True, help="the op's name, e.g. foo or v4_foo (lowercase, digits, _)")
    parser.add_argument("--doc", default="", help="one line saying what the op computes")
    parser.add_argument("--root", default=os.environ.get("BUILD_WORKSPACE_DIRECTORY") or
                        os.path.dirname(os.path.dirname(os.path.abspath(__file__))), help="the repository")
    args = parser.parse_args(argv)
    op = args.name.removeprefix("v4_")
    if not re.fullmatch(r"[a-z][a-z0-9_]*", op):
        sys.exit(f"new_op: --name={args.name}: use lowercase letters, digits and _, starting with a letter")
    name = "v4_" + op
    doc = args.doc or f"{name} (describe what it computes)"
    files = {
        f"cc/ops/{op}.h": H, f"cc/ops/{op}.cc": CC, f"cc/ops/bind/{op}.cc": BIND,
        f"py/v4train/reference/{op}.py": REFERENCE, f"py/v4train/testing/cases/{op}.py": CASE,
    }
    existing = [p for p in files if os.path.exists(os.path.join(args.root, p))]
    if existing:
        sys.exit(f"new_op: --name={args.name}: {', '.join(existing)} already exist(s)")
    for path, template in files.items():
        with open(os.path.join(args.root, path), "w") as f:
            f.write(template.format(name=name, op=op, doc=doc))
    ops_init = os.path.join(args.root, "py", "v4train", "ops", "__init__.py")
    _insert(ops_init, f"from v4train.reference import {op}", after_last="from v4train.reference import ")
    _insert(ops_init, f'    Op("{name}", {op}.{name}),', before="    # the families' own ops")
    cases_init = os.path.join(args.root, "py", "v4train", "testing", "cases", "__init__.py")
    _insert(cases_init, f"from v4train.testing.cases import {op}", after_last="from v4train.testing.cases import ")
    _insert(cases_init, f"    {op},", before=")")
    _insert(os.path.join(args.root, "cc", "ops.bzl"), f'    "{name}": ("ops", []),', before="}")
    print(f"new_op: wrote {', '.join(files)}; added {name} to py/v4train/ops/__init__.py, "
          f"py/v4train/testing/cases/__init__.py and cc/ops.bzl.\n"
          f"Next: write the math in py/v4train/reference/{op}.py and cc/ops/{op}.cc, then\n"
          f"  tools/bazel test //parity:{op}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
