"""ptq's kernels/ folder must not stand in for the Hugging Face `kernels` package.

In a source checkout the repository root holds kernels/ (installed as ptq.kernels). Python
started there with `-m` or `-c` (`python -m pytest tests`, the README's test command) has
the root on sys.path, so `import kernels` finds that folder first. transformers 5.25 and
later require the Hugging Face package of that name and import it with modeling_utils
(integrations/hub_kernels.py), which then failed in ptq's first import: "ImportError:
cannot import name 'CUDAProperties' from 'kernels' (.../kernels/__init__.py)".
hub_kernels_first() imports the installed package, if there is one, with the repository
root left out of the search, before anything imports transformers' models; installed
copies of ptq (no pyproject.toml beside the package) are left alone.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent  # the repository root in a source checkout


def shadowing(root: Path = ROOT) -> bool:
    """Whether `import kernels` would find root/kernels, ptq's own folder of a source checkout."""
    if "kernels" in sys.modules or not (root / "pyproject.toml").is_file():
        return False
    spec = importlib.util.find_spec("kernels")
    return spec is not None and spec.origin is not None and Path(spec.origin).resolve().parent == root / "kernels"


def hub_kernels_first(root: Path = ROOT) -> None:
    """Import the Hugging Face `kernels` package where root/kernels would shadow it (nothing
    where it is not installed: transformers then does not import it either)."""
    if not shadowing(root):
        return
    saved = sys.path[:]
    sys.path[:] = [entry for entry in saved if Path(entry or ".").resolve() != root]
    try:
        importlib.import_module("kernels")
    except ImportError:
        pass
    finally:
        sys.path[:] = saved
