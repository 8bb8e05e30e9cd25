"""The data folders ship with the package: an installed attngen finds templates, search spaces, registry."""

import importlib.metadata
import os
from pathlib import Path

import pytest

import attngen
from attngen import cli
from attngen.families import FAMILIES
from attngen.paths import data_dir


def test_data_folders_are_found():
    for name in ("templates", "search_spaces", "tuned"):
        assert data_dir(name).is_dir()
    templates = data_dir("templates")
    for family in FAMILIES.values():
        for template in family.templates:
            assert (templates / "kernels" / f"{template}.py.jinja").is_file(), template
        assert (data_dir("search_spaces") / f"{family.space}.yaml").is_file(), family.space
    assert (templates / "lib" / "common.py.jinja").is_file()
    assert (templates / "masks" / "causal.yaml").is_file()
    assert (data_dir("tuned") / "h200.yaml").is_file()


installed = pytest.mark.skipif(os.environ.get("ATTNGEN_TEST_INSTALLED") != "1",
                               reason="run by `make test`, which installs attngen first")


@installed
def test_imported_from_an_installed_copy():
    """`make test` installs attngen non-editably and sets ATTNGEN_TEST_INSTALLED=1."""
    source_tree = Path(__file__).resolve().parent.parent
    package = Path(attngen.__file__).resolve()
    assert package.parent != source_tree / "attngen", f"attngen was imported from the source tree: {package}"
    assert data_dir("templates").parent == package.parent  # attngen/templates inside the installation


@installed
def test_the_version_is_written_once():
    """pyproject.toml reads the version from attngen/version.py: the installed metadata agrees."""
    assert importlib.metadata.version("attngen") == attngen.__version__
    from attngen.version import __version__

    assert attngen.__version__ is __version__ and __version__.count(".") == 2


def test_version_option(capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out == f"attngen {attngen.__version__}\n"
