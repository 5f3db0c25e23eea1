"""The kernel developer's workflow, end to end, on a copy of the repository: tools/new_op.py writes a
toy op that builds and whose parity test fails saying what to implement; implementing it in C++
turns the same parity test green. (Bazel is the same sources and module list: build_ext.py
reads cc/ops.bzl as the BUILD files do.)"""

import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(cmd, cwd, **kw):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(["py", "build", "."]))
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=900, **kw)


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    """The parts of the repository an op touches, copied (runfiles are symlinks: copy the files)."""
    dst = tmp_path_factory.mktemp("repo")
    for part in ("cc", "parity", os.path.join("py", "v4train")):
        shutil.copytree(os.path.join(ROOT, part), dst / part, ignore=shutil.ignore_patterns("__pycache__", "BUILD"))
    (dst / "tools").mkdir()
    for tool in ("new_op.py", "build_ext.py", "python_env_probe.py"):
        shutil.copy(os.path.join(ROOT, "tools", tool), dst / "tools" / tool)
    return dst


def test_scaffold_fails_saying_what_to_implement_then_passes_once_implemented(repo):
    made = _run([sys.executable, "tools/new_op.py", "--name=toy_scale", "--doc=x times a per-channel weight"], repo)
    assert made.returncode == 0, made.stderr
    for path in ("cc/ops/toy_scale.h", "cc/ops/toy_scale.cc", "cc/ops/bind/toy_scale.cc", "py/v4train/reference/toy_scale.py",
                 "py/v4train/testing/cases/toy_scale.py"):
        assert (repo / path).exists(), path
    assert '"v4_toy_scale": ("ops", []),' in (repo / "cc" / "ops.bzl").read_text()
    assert 'Op("v4_toy_scale", toy_scale.v4_toy_scale),' in (repo / "py" / "v4train" / "ops" / "__init__.py").read_text()
    assert "    toy_scale," in (repo / "py" / "v4train" / "testing" / "cases" / "__init__.py").read_text()
    again = _run([sys.executable, "tools/new_op.py", "--name=toy_scale"], repo)
    assert again.returncode != 0 and "already exist" in again.stderr

    build = [sys.executable, "tools/build_ext.py", "--only=v4_toy_scale", "--out=build"]
    parity = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "parity/test_ops.py", "--op=v4_toy_scale"]
    built = _run(build, repo)
    assert built.returncode == 0, built.stdout + built.stderr
    failing = _run(parity, repo)
    assert failing.returncode != 0
    assert ("NotImplementedError: v4_toy_scale: not implemented yet: write in cc/ops/toy_scale.cc what "
            "py/v4train/reference/toy_scale.py computes") in failing.stdout
    assert "2 passed" in failing.stdout, "the error case and the sample check pass already"

    cc = repo / "cc" / "ops" / "toy_scale.cc"
    text = cc.read_text()
    start = text.index("  // Replace this line")
    end = text.index("computes\");", start) + len("computes\");")
    cc.write_text(text[:start] + "  return (x.to(at::kFloat) * weight.to(at::kFloat)).to(x.scalar_type());" + text[end:])
    rebuilt = _run(build, repo)
    assert rebuilt.returncode == 0, rebuilt.stdout + rebuilt.stderr
    passing = _run(parity, repo)
    assert passing.returncode == 0, passing.stdout[-3000:]
    assert "4 passed" in passing.stdout
