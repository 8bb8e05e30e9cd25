"""Test setup shared by every folder: Triton's interpreter without CUDA, the gpu marker, and
template folders isolated between tests. The helpers tests import are in helpers.py.

Without CUDA every kernel runs under Triton's interpreter on CPU tensors; with CUDA the same
tests run the compiled kernels on the GPU, and the tests marked `gpu` run too.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # read when the kernels are first loaded

import pytest  # noqa: E402


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (runs on the GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


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
