"""Builds the op modules without Bazel, against the torch of the Python running this script.

For machines that have torch but no Bazel (the H200 GPU machine). The list of modules and the
compiler flags come from cc/ops.bzl, the file cc/BUILD and @v4_python read too; sources follow
the op names as in tools/v4.bzl. Usage:

    python3 tools/build_ext.py [--out build/ext] [--jobs N] [--clean] [--only v4_a,v4_b]
    PYTHONPATH=py:build/ext:. python3 -m pytest parity py/tests
"""

from __future__ import annotations

import argparse
import ast
import concurrent.futures
import os
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))

from python_env_probe import probe  # noqa: E402

NANOBIND_EXCLUDE = {"nb_combined.cpp", "nb_backend.cpp"}
TORCH_LIBS = ["c10", "torch", "torch_cpu", "torch_python"]


def read_bzl(path: str = os.path.join(ROOT, "cc", "ops.bzl")) -> dict:
    """The assignments of cc/ops.bzl (a Starlark file whose assignments are Python literals)."""
    env = {}
    for node in ast.parse(open(path).read(), path).body:
        if isinstance(node, ast.Assign):
            env[node.targets[0].id] = ast.literal_eval(node.value)
    return env


def read_modules() -> dict[str, tuple[str, list[str]]]:
    """module name -> (its folder under cc/, the ops it calls): V4_OPS and V4_TEST_MODULES of cc/ops.bzl."""
    bzl = read_bzl()
    return {**bzl["V4_OPS"], **bzl["V4_TEST_MODULES"]}


def sources(name: str, cuda: bool = False) -> tuple[str, list[str]]:
    """(the binding, the op's own sources: ATen, and its CUDA kernels where `cuda`) of module
    `name`, by the naming rule of cc/ops.bzl."""
    op, folder = name.removeprefix("v4_"), os.path.join(ROOT, "cc", read_modules()[name][0])
    own = [os.path.join(folder, op + ext) for ext in ([".cc", ".cu"] if cuda else [".cc"])]
    return os.path.join(folder, "bind", op + ".cc"), [f for f in own if os.path.exists(f)]


def closure(name: str, modules: dict[str, list[str]]) -> list[str]:
    """`name` and every op it calls, directly or not."""
    out, todo = [], [name]
    while todo:
        n = todo.pop()
        if n not in out:
            out.append(n)
            todo += modules[n][1]
    return out


def run(cmd: list[str]) -> None:
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"command failed ({result.returncode}): {' '.join(cmd)}\n{result.stderr}")


def _newest_header() -> float:
    return max(os.path.getmtime(os.path.join(d, f)) for d, _, files in os.walk(os.path.join(ROOT, "cc"))
               for f in files if f.endswith((".h", ".cuh")))


def compile_one(src: str, obj: str, flags: list[str], newest_header: float = 0.0, compiler: str = "g++") -> str:
    # Rebuild when the source or any of the project's headers is newer than the object.
    if not (os.path.exists(obj) and os.path.getmtime(obj) >= max(os.path.getmtime(src), newest_header)):
        os.makedirs(os.path.dirname(obj), exist_ok=True)
        run([compiler, *flags, "-c", src, "-o", obj])
    return obj


def cuda_toolkit(env: dict) -> str:
    """The CUDA toolkit's root where nvcc and a CUDA build of torch are both here, else ''."""
    nvcc = shutil.which("nvcc")
    if not env["torch_cuda"] or not nvcc:
        return ""
    return os.path.dirname(os.path.dirname(os.path.realpath(nvcc)))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=os.path.join(ROOT, "build", "ext"), help="where the modules go")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="parallel compilations")
    parser.add_argument("--clean", action="store_true", help="recompile every object")
    parser.add_argument("--only", default="", help="comma list of modules to build (default: all)")
    parser.add_argument("--no-cuda", action="store_true", help="leave the CUDA kernels out (the ATen path only)")
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
    bzl = read_bzl()
    flags = bzl["V4_COPTS"] + ["-fPIC", f"-D_GLIBCXX_USE_CXX11_ABI={env['torch_cxx11_abi']}"] + includes
    nb_flags = flags + bzl["V4_NANOBIND_EXTRA_COPTS"]
    toolkit = "" if args.no_cuda else cuda_toolkit(env)
    cuda_libs = []
    if toolkit:
        nvcc_flags = bzl["V4_NVCC_FLAGS"] + [f"-D_GLIBCXX_USE_CXX11_ABI={env['torch_cxx11_abi']}"] + includes
        cuda_lib = os.path.join(toolkit, "lib64")
        cuda_libs = ["-L" + cuda_lib, "-Wl,-rpath," + cuda_lib, "-lc10_cuda", "-ltorch_cuda", "-lcudart"]
    objdir = os.path.join(args.out, "obj-cuda" if toolkit else "obj")  # the CUDA torch's headers differ
    if args.clean:
        subprocess.run(["rm", "-rf", objdir], check=True)
    modules = read_modules()
    wanted = args.only.split(",") if args.only else list(modules)
    unknown = sorted(set(wanted) - set(modules))
    if unknown:
        sys.exit(f"build_ext: --only: unknown module(s) {', '.join(unknown)}; known: {', '.join(modules)}")
    print(f"build_ext: {len(modules)} modules against torch {env['torch_version']} "
          f"(CUDA {env['torch_cuda'] or 'none'}; kernels {'with nvcc of ' + toolkit if toolkit else 'not built'}), "
          f"Python {env['python_version']}, into {args.out}", flush=True)

    start = time.time()
    with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
        def obj_of(src):
            return os.path.join(objdir, os.path.relpath(src, "/").replace("/", "_") + ".o")

        nb_srcs = sorted(os.path.join(nb, "src", f) for f in os.listdir(os.path.join(nb, "src"))
                         if f.endswith(".cpp") and f not in NANOBIND_EXCLUDE)
        shared = [pool.submit(compile_one, s, obj_of(s), nb_flags) for s in nb_srcs]
        common = os.path.join(ROOT, "cc", "common")  # the bridge and the shared compute, in every module
        shared += [pool.submit(compile_one, os.path.join(common, f), obj_of(os.path.join(common, f)), flags,
                               _newest_header()) for f in sorted(os.listdir(common)) if f.endswith(".cc")]
        if toolkit:  # the shared kernels (fp8.cu)
            shared += [pool.submit(compile_one, os.path.join(common, f), obj_of(os.path.join(common, f)), nvcc_flags,
                                   _newest_header(), "nvcc") for f in sorted(os.listdir(common)) if f.endswith(".cu")]
        objects = {}  # source -> future object, each source compiled once

        newest_header = _newest_header()

        def obj(src):
            if src not in objects:
                nvcc = src.endswith(".cu")
                objects[src] = pool.submit(compile_one, src, obj_of(src), nvcc_flags if nvcc else flags,
                                           newest_header, "nvcc" if nvcc else "g++")
            return objects[src]

        per_module = {}
        for name in wanted:
            bind, _ = sources(name)
            per_module[name] = [obj(bind)] + [obj(s) for dep in closure(name, modules)
                                              for s in sources(dep, bool(toolkit))[1]]
        shared_objs = [f.result() for f in shared]
        for name, futures in per_module.items():
            out = os.path.join(args.out, name + ".so")
            run(["g++", "-shared", "-o", out, *[f.result() for f in futures], *shared_objs,
                 "-L" + env["torch_lib"], *["-l" + lib for lib in TORCH_LIBS], *cuda_libs,
                 "-Wl,-rpath," + env["torch_lib"]])
            print(f"build_ext: {out}", flush=True)
    print(f"build_ext: done in {time.time() - start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
