"""Prints, one `key=value` per line, what the build needs from a Python environment.

Run by the repository rule in tools/python_env.bzl with the interpreter tools/bazel chose,
and by tools/build_ext.py. Fails with one readable line when something is missing.
"""

import os
import sys
import sysconfig


def _fail(msg):
    sys.stderr.write(f"v4train: {msg}\n")
    sys.exit(1)


def probe():
    include = sysconfig.get_paths()["include"]
    if not os.path.exists(os.path.join(include, "Python.h")):
        _fail(f"{sys.executable} has no Python.h in {include}: install the Python development "
              f"headers (Debian: apt-get install python3-dev)")
    try:
        import torch
    except ImportError as e:
        _fail(f"{sys.executable} cannot import torch ({e})")
    try:
        import nanobind
    except ImportError as e:
        _fail(f"{sys.executable} cannot import nanobind ({e})")
    torch_dir = os.path.dirname(torch.__file__)
    return {
        "python": sys.executable,
        "python_include": include,
        "python_version": "%d.%d" % sys.version_info[:2],
        "torch_version": torch.__version__,
        "torch_include": os.path.join(torch_dir, "include"),
        "torch_lib": os.path.join(torch_dir, "lib"),
        "torch_cxx11_abi": str(int(torch._C._GLIBCXX_USE_CXX11_ABI)),
        "torch_cuda": torch.version.cuda or "",
        "nanobind": os.path.dirname(nanobind.__file__),
        "ext_suffix": sysconfig.get_config_var("EXT_SUFFIX"),
    }


if __name__ == "__main__":
    for key, value in probe().items():
        print(f"{key}={value}")
