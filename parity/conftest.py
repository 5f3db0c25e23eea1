"""`--op=v4_<op>` keeps the registry-driven tests to one op: how `tools/bazel test //parity:<op>`
gives that op's verdict alone."""

import pytest


def pytest_addoption(parser):
    parser.addoption("--op", default="", help="only this op (v4_<op>) in the registry-driven tests")


@pytest.fixture(scope="session")
def only_op(request) -> str:
    return request.config.getoption("--op")


def pytest_collection_modifyitems(config, items):
    op = config.getoption("--op")
    if not op:
        return
    # (a test parametrized otherwise, by device or shape, is not registry-driven: it stays)
    keep = [item for item in items
            if getattr(item, "callspec", None) is None or item.callspec.params.get("name", op) == op]
    config.hook.pytest_deselected(items=[i for i in items if i not in keep])
    items[:] = keep
