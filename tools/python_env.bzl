"""The repository rule that turns the chosen Python environment into Bazel targets.

tools/bazel sets V4TRAIN_PYTHON to the interpreter of the project's environment (or of the
user's own, e.g. one with a CUDA build of torch). This rule asks that interpreter where its
headers, torch and nanobind are, links those folders into @v4_python, and generates:
  :python_headers  Python.h and friends
  :torch           ATen/c10/autograd headers and the torch shared libraries
  :nanobind        nanobind's runtime, compiled from the sources its pip package ships
  :py_toolchain    a Python toolchain whose interpreter is that same Python
"""

_TORCH_LIBS = ["libc10.so", "libtorch.so", "libtorch_cpu.so", "libtorch_python.so"]

# nb_combined.cpp includes all the others; nb_backend.cpp needs a define set only by CMake.
_NANOBIND_EXCLUDE = ["nb_combined.cpp", "nb_backend.cpp"]

_BUILD = """\
load("@bazel_tools//tools/python:toolchain.bzl", "py_runtime_pair")
load("@//cc:ops.bzl", "V4_COPTS", "V4_NANOBIND_EXTRA_COPTS")

package(default_visibility = ["//visibility:public"])

# Probed from {python}: torch {torch_version} (CUDA: {torch_cuda}), Python {python_version}.

cc_library(
    name = "python_headers",
    hdrs = glob(["python_include/**/*.h"]),
    includes = ["python_include"],
)

cc_library(
    name = "torch",
    hdrs = glob(["torch_include/**/*.h", "torch_include/**/*.hpp", "torch_include/**/*.cuh"]),
    includes = ["torch_include", "torch_include/torch/csrc/api/include"],
    srcs = {torch_libs},
    defines = ["_GLIBCXX_USE_CXX11_ABI={torch_cxx11_abi}"],
    linkopts = ["-Wl,-rpath,{torch_lib}"],
    deps = [":python_headers"],
)

cc_library(
    name = "nanobind",
    srcs = glob(["nanobind/src/*.cpp", "nanobind/src/*.h"], exclude = {nanobind_exclude}),
    hdrs = glob(["nanobind/include/**/*.h", "nanobind/ext/robin_map/include/**/*.h"]),
    includes = ["nanobind/include", "nanobind/ext/robin_map/include"],
    copts = V4_COPTS + V4_NANOBIND_EXTRA_COPTS,
    # Hidden symbols: only ever linked statically into each op module.
    linkstatic = 1,
    deps = [":python_headers"],
)

py_runtime(
    name = "py3_runtime",
    interpreter_path = "{python}",
    python_version = "PY3",
)

py_runtime_pair(
    name = "runtime_pair",
    py3_runtime = ":py3_runtime",
)

toolchain(
    name = "py_toolchain",
    toolchain = ":runtime_pair",
    toolchain_type = "@bazel_tools//tools/python:toolchain_type",
)
"""

def _v4_python_env_impl(rctx):
    python = rctx.os.environ.get("V4TRAIN_PYTHON", "")
    if not python:
        fail("V4TRAIN_PYTHON is not set. Run Bazel through tools/bazel, which creates the " +
             "Python environment and sets it (or set it to a Python that has torch and nanobind).")
    result = rctx.execute([python, rctx.path(rctx.attr._probe)])
    if result.return_code != 0:
        fail("probing the Python environment %s failed:\n%s%s" % (python, result.stdout, result.stderr))
    info = {}
    for line in result.stdout.strip().split("\n"):
        key, _, value = line.partition("=")
        info[key] = value
    for name in ["python_include", "torch_include", "torch_lib", "nanobind"]:
        rctx.symlink(info[name], name)
    rctx.file("BUILD", _BUILD.format(
        torch_libs = repr(["torch_lib/" + lib for lib in _TORCH_LIBS]),
        nanobind_exclude = repr(["nanobind/src/" + f for f in _NANOBIND_EXCLUDE]),
        **info
    ))
    rctx.file("WORKSPACE", "workspace(name = \"%s\")\n" % rctx.name)

v4_python_env = repository_rule(
    implementation = _v4_python_env_impl,
    environ = ["V4TRAIN_PYTHON"],
    attrs = {"_probe": attr.label(default = "//tools:python_env_probe.py")},
)
