"""The digest of ptq's C sources, computed alike when setup.py builds the compiled library
(which keeps it) and when ptq.algorithms.compiled loads it (which compares): a library built
from other sources than the ones beside it (an editable install whose C code changed, or
whose rebuild failed and left the old library in place) is then refused, not called.
Standard library only: setup.py loads this file by its path, before ptq's dependencies exist."""

from __future__ import annotations

import hashlib
from pathlib import Path


def source_digest(package: Path) -> str | None:
    """sha256 (16 hex digits) of every .c and .h file under the package folder, by relative
    path; None when there is none (an installed wheel carries no C sources)."""
    files = sorted(p for p in package.rglob("*") if p.suffix in (".c", ".h") and p.is_file())
    if not files:
        return None
    digest = hashlib.sha256()
    for path in files:
        digest.update(path.relative_to(package).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]
