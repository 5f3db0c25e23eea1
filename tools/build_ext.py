"""Builds the op modules without Bazel, against the torch of the Python running this script.

For machines that have torch but no Bazel (the H200 GPU machine). The list of modules comes
from cc/ops.bzl, the same dict cc/BUILD reads; the flags mirror tools/v4.bzl and
tools/python_env.bzl. Usage:

    python3 tools/build_ext.py [--out build/ext] [--jobs N] [--tests]
    PYTHONPATH=py:build/ext:. python3 -m pytest parity py/tests
"""

from __future__ import annotations

import argparse
import ast
import concurrent.futures
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))

from python_env_probe import probe  # noqa: E402

# Kept equal to the copts of tools/v4.bzl and the @v4_python//:nanobind rule.
CXXFLAGS = ["-std=c++20", "-O2", "-fPIC", "-fvisibility=hidden"]
NANOBIND_FLAGS = ["-fno-strict-aliasing"]
NANOBIND_EXCLUDE = {"nb_combined.cpp", "nb_backend.cpp"}
TORCH_LIBS = ["c10", "torch", "torch_cpu", "torch_python"]


def read_modules(names=("V4_OPS", "V4_TEST_MODULES")) -> dict[str, dict]:
    """The module dicts of cc/ops.bzl (a Starlark file whose assignments are Python literals)."""
    path = os.path.join(ROOT, "cc", "ops.bzl")
    modules = {}
    for node in ast.parse(open(path).read(), path).body:
        if isinstance(node, ast.Assign) and node.targets[0].id in names:
            modules.update(ast.literal_eval(node.value))
    if not modules:
        sys.exit(f"build_ext: no modules found in {path}")
    return modules


def run(cmd: list[str]) -> None:
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"command failed ({result.returncode}): {' '.join(cmd)}\n{result.stderr}")


def compile_one(src: str, obj: str, flags: list[str]) -> str:
    # Rebuild when the source is newer; headers are few and shared, so --clean covers them.
    if not (os.path.exists(obj) and os.path.getmtime(obj) >= os.path.getmtime(src)):
        os.makedirs(os.path.dirname(obj), exist_ok=True)
        run(["g++", *flags, "-c", src, "-o", obj])
    return obj


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=os.path.join(ROOT, "build", "ext"), help="where the modules go")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="parallel compilations")
    parser.add_argument("--clean", action="store_true", help="recompile every object")
    args = parser.parse_args()

    env = probe()
    nb = env["nanobind"]
    includes = [
        "-I" + ROOT,
        "-isystem", env["torch_include"],
        "-isystem", os.path.join(env["torch_include"], "torch", "csrc", "api", "include"),
        "-isystem", env["python_include"],
        "-isystem", os.path.join(nb, "include"),
        "-isystem", os.path.join(nb, "ext", "robin_map", "include"),
    ]
    flags = CXXFLAGS + [f"-D_GLIBCXX_USE_CXX11_ABI={env['torch_cxx11_abi']}"] + includes
    objdir = os.path.join(args.out, "obj")
    if args.clean:
        subprocess.run(["rm", "-rf", objdir], check=True)
    modules = read_modules()
    print(f"build_ext: {len(modules)} modules against torch {env['torch_version']} "
          f"(CUDA {env['torch_cuda'] or 'none'}), Python {env['python_version']}, into {args.out}", flush=True)

    start = time.time()
    with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
        def obj_of(src):
            return os.path.join(objdir, os.path.relpath(src, "/").replace("/", "_") + ".o")

        nb_srcs = sorted(os.path.join(nb, "src", f) for f in os.listdir(os.path.join(nb, "src"))
                         if f.endswith(".cpp") and f not in NANOBIND_EXCLUDE)
        shared = [pool.submit(compile_one, s, obj_of(s), flags + NANOBIND_FLAGS) for s in nb_srcs]
        bridge = os.path.join(ROOT, "cc", "common", "bridge.cc")
        shared.append(pool.submit(compile_one, bridge, obj_of(bridge), flags))
        per_module = {
            name: [pool.submit(compile_one, src, obj_of(src), flags)
                   for src in [os.path.join(ROOT, "cc", spec["bind"])] +
                   [os.path.join(ROOT, "cc", s) for s in spec["srcs"]]]
            for name, spec in modules.items()
        }
        shared_objs = [f.result() for f in shared]
        for name, futures in per_module.items():
            out = os.path.join(args.out, name + ".so")
            run(["g++", "-shared", "-o", out, *[f.result() for f in futures], *shared_objs,
                 "-L" + env["torch_lib"], *["-l" + lib for lib in TORCH_LIBS],
                 "-Wl,-rpath," + env["torch_lib"]])
            print(f"build_ext: {out}", flush=True)
    print(f"build_ext: done in {time.time() - start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
