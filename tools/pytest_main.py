"""Runs the pytest files given as arguments; the `main` of every v4_py_test."""

import sys

import pytest

if __name__ == "__main__":
    # No cache folder: Bazel's runfiles are not ours to write.
    sys.exit(pytest.main(["-q", "-p", "no:cacheprovider", *sys.argv[1:]]))
