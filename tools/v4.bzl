"""Every Bazel macro of the project."""

load("@rules_cc//cc:defs.bzl", "cc_binary", "cc_library")
load("//cc:ops.bzl", "V4_COPTS")

def v4_op_module(name, deps = []):
    """The op `name` (v4_<op>) as an importable nanobind module `name.so`.

    Sources follow the name: ops/<op>.{h,cc} become the cc_library `<op>` (absent for test
    modules), bind/<op>.cc holds NB_MODULE(name, m). `deps` are the op names whose libraries
    this op's code calls.

    Args:
      name: the module name, e.g. "v4_rms_norm" (also the name of the Python function).
      deps: op names whose C++ this op calls.
    """
    op = name[len("v4_"):]
    srcs = native.glob(["ops/%s.cc" % op])
    lib_deps = [":" + d[len("v4_"):] for d in deps]
    if srcs:
        cc_library(
            name = op,
            srcs = srcs,
            hdrs = ["ops/%s.h" % op],
            copts = V4_COPTS,
            linkstatic = 1,
            deps = ["//cc/common:checks", "//cc/common:compute", "@v4_python//:torch"] + lib_deps,
        )
        lib_deps = [":" + op]
    cc_binary(
        name = name + ".so",
        srcs = ["bind/%s.cc" % op],
        copts = V4_COPTS,
        linkshared = 1,
        deps = lib_deps + [
            "//cc/common:bridge",
            "//cc/common:checks",
            "@v4_python//:nanobind",
            "@v4_python//:torch",
        ],
    )
    native.py_library(
        name = name,
        data = [":" + name + ".so"],
        imports = ["."],
        visibility = ["//visibility:public"],
    )

def v4_py_test(name, srcs, deps = [], data = [], size = "medium", args = [], **kwargs):
    """A pytest file run as a Bazel test, with the project's Python environment."""
    native.py_test(
        name = name,
        srcs = srcs + ["//tools:pytest_main.py"],
        main = "//tools:pytest_main.py",
        args = ["$(rootpath %s)" % s for s in srcs] + args,
        deps = deps,
        data = data,
        size = size,
        python_version = "PY3",
        **kwargs
    )
