"""Test setup shared by every folder: Triton's interpreter without CUDA, the gpu marker, and
template folders isolated between tests. The helpers tests import are in helpers.py.

Without CUDA every kernel runs under Triton's interpreter on CPU tensors; with CUDA the same
tests run the compiled kernels on the GPU, and the tests marked `gpu` run too.
"""

import os
import time

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # read when the kernels are first loaded

import pytest  # noqa: E402


def pytest_collection_modifyitems(config, items):
    _FileProgress.expect(config, [item.nodeid for item in items])
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (runs on the GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


class _FileProgress:
    """A line per test file once all its tests ran (with pytest-xdist too, where the dots name no
    file): `tests/kernels/test_forward.py: 85 tests done, 14 s`."""

    totals: dict = {}
    done: dict = {}
    started: dict = {}

    @classmethod
    def expect(cls, config, nodeids):
        if not hasattr(config, "workerinput"):  # the process that reports (not an xdist worker)
            for nodeid in nodeids:
                path = nodeid.split("::")[0]
                cls.totals[path] = cls.totals.get(path, 0) + 1

    @classmethod
    def report(cls, config, report):
        path = report.nodeid.split("::")[0]
        cls.started.setdefault(path, time.monotonic())
        if report.when == "teardown" and path in cls.totals:
            cls.done[path] = cls.done.get(path, 0) + 1
            if cls.done[path] == cls.totals[path]:
                seconds = time.monotonic() - cls.started[path]
                reporter = config.pluginmanager.getplugin("terminalreporter")
                if reporter is not None:  # on a line of its own between the progress dots
                    reporter.write(f"\n{path}: {cls.totals[path]} tests done, {seconds:.0f} s\n")


def pytest_xdist_node_collection_finished(node, ids):
    """pytest-xdist: the controller learns the tests from the first worker's collection."""
    if not _FileProgress.totals:
        _FileProgress.expect(node.config, ids)


def pytest_runtest_logreport(report):
    _FileProgress.report(_CONFIG[0], report)


_CONFIG = []


def pytest_configure(config):
    _CONFIG.append(config)


@pytest.fixture(autouse=True)
def _template_dirs_isolated():
    """Folders registered by one test are gone for the next."""
    from attngen.masks import template_files as templates
    saved = templates.registered_dirs()
    yield
    templates.set_registered_dirs(saved)


@pytest.fixture
def clean_dispatch():
    """The dispatcher back on its default registry after the test (its caches dropped)."""
    from attngen import dispatch

    yield dispatch
    dispatch.use_registry(None)
