"""The data folders ship with the package: an installed attngen finds templates, search spaces, registry."""

import os
from pathlib import Path

import pytest

import attngen
from attngen.paths import data_dir


def test_data_folders_are_found():
    for name in ("templates", "search_spaces", "tuned"):
        assert data_dir(name).is_dir()
    assert (data_dir("templates") / "attention_fwd.py.jinja").is_file()
    assert (data_dir("templates") / "masks" / "causal.yaml").is_file()


def test_imported_from_an_installed_copy():
    """`make test` installs attngen non-editably and sets ATTNGEN_TEST_INSTALLED=1."""
    if os.environ.get("ATTNGEN_TEST_INSTALLED") != "1":
        pytest.skip("run by `make test`, which installs attngen first")
    source_tree = Path(__file__).resolve().parent.parent
    package = Path(attngen.__file__).resolve()
    assert package.parent != source_tree / "attngen", f"attngen was imported from the source tree: {package}"
    assert data_dir("templates").parent == package.parent  # attngen/templates inside the installation
