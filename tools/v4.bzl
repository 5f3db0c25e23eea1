"""Every Bazel macro of the project."""

load("@rules_cc//cc:defs.bzl", "cc_binary", "cc_library")
load("//cc:ops.bzl", "V4_COPTS")

def v4_op_module(name, folder, deps = []):
    """The op `name` (v4_<op>) as an importable nanobind module `name.so`.

    Sources follow the name in `folder` (under cc/: "ops" for shared blocks, "models/<family>"):
    FOLDER/<op>.{h,cc} become the cc_library `<op>` (absent for test modules), with the folder's
    other headers (a family's config.h); FOLDER/bind/<op>.cc holds NB_MODULE(name, m), with the
    folder's bind headers (a family's config caster). `deps` are the op names whose libraries
    this op's code calls.

    Args:
      name: the module name, e.g. "v4_rms_norm" (also the name of the Python function).
      folder: where its sources are, under cc/.
      deps: op names whose C++ this op calls.
    """
    op = name[len("v4_"):]
    srcs = native.glob(["%s/%s.cc" % (folder, op)])
    lib_deps = [":" + d[len("v4_"):] for d in deps]
    if srcs:
        cc_library(
            name = op,
            srcs = srcs,
            hdrs = native.glob(["%s/*.h" % folder]),
            copts = V4_COPTS,
            linkstatic = 1,
            deps = ["//cc/common:checks", "//cc/common:compute", "@v4_python//:torch"] + lib_deps,
        )
        lib_deps = [":" + op]
    cc_binary(
        name = name + ".so",
        srcs = ["%s/bind/%s.cc" % (folder, op)] + native.glob(["%s/bind/*.h" % folder]),
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
