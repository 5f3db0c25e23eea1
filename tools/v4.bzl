"""Every Bazel macro of the project."""

load("@rules_cc//cc:defs.bzl", "cc_binary", "cc_library")

# C++20 as torch's own extensions use; hidden visibility so that only PyInit_* is exported.
V4_COPTS = ["-std=c++20", "-fvisibility=hidden", "-O2", "-Wall", "-Wno-unused-function"]

def v4_op_module(name, bind, srcs):
    """An op's ATen sources plus its binding -> `name.so`, importable as `import name`.

    Args:
      name: the module name, e.g. "v4_rms_norm" (also the name of the Python function).
      bind: the source holding NB_MODULE(name, m).
      srcs: the op's .cc files under cc/ops/; each has a .h beside it.
    """
    cc_library(
        name = name + "_ops",
        srcs = srcs,
        hdrs = [s[:-len(".cc")] + ".h" for s in srcs],
        copts = V4_COPTS,
        linkstatic = 1,
        deps = ["//cc/common:checks", "@v4_python//:torch"],
    )
    cc_binary(
        name = name + ".so",
        srcs = [bind],
        copts = V4_COPTS,
        linkshared = 1,
        deps = [
            ":" + name + "_ops",
            "//cc/common:bridge",
            "@v4_python//:nanobind",
        ],
    )
    native.py_library(
        name = name,
        data = [":" + name + ".so"],
        imports = ["."],
        visibility = ["//visibility:public"],
    )

def v4_py_test(name, srcs, deps = [], data = [], size = "medium", **kwargs):
    """A pytest file run as a Bazel test, with the project's Python environment."""
    native.py_test(
        name = name,
        srcs = srcs + ["//tools:pytest_main.py"],
        main = "//tools:pytest_main.py",
        args = ["$(rootpath %s)" % s for s in srcs],
        deps = deps,
        data = data,
        size = size,
        python_version = "PY3",
        **kwargs
    )
