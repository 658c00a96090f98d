"""ptq's kernels/ folder at the repository root must not shadow the Hugging Face `kernels`
package, which transformers 5.25 and later import (ptq/source_checkout.py)."""

import subprocess
import sys
from pathlib import Path

import pytest

from ptq import source_checkout

REPO = Path(__file__).resolve().parent.parent


def test_python_started_at_the_repository_root_imports_ptq_and_transformers_models():
    # `python -c` puts the working folder first on sys.path, as `python -m pytest` does
    code = "import ptq, transformers.modeling_utils, sys; print(sys.modules.get('kernels'))"
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-800:]
    assert str(REPO / "kernels") not in done.stdout  # not ptq's folder under the top-level name


@pytest.fixture
def checkout(tmp_path, monkeypatch):
    """A folder shaped as a source checkout, first on sys.path, no `kernels` imported yet."""
    (tmp_path / "pyproject.toml").write_text("")
    (tmp_path / "kernels").mkdir()
    (tmp_path / "kernels" / "__init__.py").write_text("OURS = True\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "kernels", raising=False)
    return tmp_path


def test_the_checkouts_kernels_folder_is_seen_as_shadowing(checkout):
    assert source_checkout.shadowing(checkout)
    (checkout / "pyproject.toml").unlink()  # an installed copy: left alone
    assert not source_checkout.shadowing(checkout)


def test_the_installed_package_is_imported_past_the_checkout(checkout):
    path = sys.path[:]
    source_checkout.hub_kernels_first(checkout)
    assert sys.path == path
    imported = sys.modules.get("kernels")
    assert imported is None or not hasattr(imported, "OURS")
