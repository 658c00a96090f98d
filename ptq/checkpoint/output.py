"""Where a checkpoint goes: checks on the output folder, a lock on it, and its work folder.

ptq never deletes a file it did not write. So the output is either a new folder or, with
overwrite, a ptq checkpoint: a folder whose files are exactly those its manifest
(MANIFEST) lists. It is never the source model's folder, one inside it or one that holds
it, never a file and never a symbolic link, and its parent must exist and be writable.

Work in progress lives in a hidden folder beside the output, `.NAME.ptq-partial`:

    lock          held (flock) while a run works on this output: a second run stops at once
    run.json      what the run is (recipe, model, data, dtype), to check a resume against
    blocks/       blocks already quantized, and the inputs of the next one (ptq.resume)
    staging/      the checkpoint being written, renamed into place when complete
    old/          the checkpoint being replaced, deleted once the new one is in place

A clean finish removes the work folder. One left behind by a crash is named to the next
run with the commands that resume it or remove it.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from contextlib import contextmanager
from collections.abc import Iterator
from pathlib import Path

from ptq.errors import PtqError

MANIFEST = "ptq.json"  # written last into every checkpoint: the files ptq wrote, the run's settings
PARTIAL_SUFFIX = ".ptq-partial"

try:
    import fcntl
except ImportError:  # not on Windows: runs there are not locked against each other
    fcntl = None


def work_folder(target: Path) -> Path:
    return target.parent / f".{target.name}{PARTIAL_SUFFIX}"


def local_folder(location: str | os.PathLike | None) -> Path | None:
    """The resolved local folder a model came from, or None (a Hub name, nothing known)."""
    if not location:
        return None
    path = Path(location).expanduser()
    return path.resolve() if path.is_dir() else None


def check_output(target: Path, *, overwrite: bool, sources: list[Path] = ()) -> None:
    """Raise PtqError unless `target` can receive a checkpoint without losing anyone's files."""
    shown = str(target)
    if target.is_symlink():
        raise PtqError(f"output '{shown}' is a symbolic link; give a real folder path as --output")
    resolved = target.resolve()
    for source in sources:
        if resolved == source or source in resolved.parents:
            raise PtqError(f"output '{shown}' is the source model's folder or inside it; choose another --output")
        if resolved in source.parents:
            raise PtqError(f"output '{shown}' contains the source model '{source}'; choose another --output")
    parent = resolved.parent
    if not parent.is_dir():
        raise PtqError(f"the folder that would hold output '{shown}' ({parent}) does not exist; create it first")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise PtqError(f"cannot write into '{parent}' (permission denied); choose another --output")
    if not target.exists():
        return
    if not target.is_dir():
        raise PtqError(f"output '{shown}' is a file; ptq writes a folder: choose another --output")
    if not overwrite:
        raise PtqError(f"output '{shown}' already exists; choose another --output or pass --overwrite")
    foreign = foreign_files(target)
    if foreign:
        raise PtqError(
            f"output '{shown}' holds files ptq did not write (e.g. {foreign[0]}); ptq overwrites only its own "
            "checkpoints: choose another --output or empty that folder yourself"
        )


def foreign_files(folder: Path) -> list[str]:
    """Files in folder that its manifest does not list (all of them when it has none)."""
    present = sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if not p.is_dir() or p.is_symlink())
    try:
        listed = set(json.loads((folder / MANIFEST).read_text())["files"]) | {MANIFEST}
    except (OSError, ValueError, KeyError, TypeError):
        return present or []
    return [name for name in present if name not in listed]


def write_manifest(folder: Path, settings: dict) -> None:
    """List every file now in folder (with its size) and the run's settings, as MANIFEST."""
    files = {str(p.relative_to(folder)): p.stat().st_size for p in sorted(folder.rglob("*")) if p.is_file()}
    data = {"writer": "ptq", **settings, "files": files}
    (folder / MANIFEST).write_text(json.dumps(data, indent=2) + "\n")


class OutputSlot:
    """The claim of one run on an output folder: its locked work folder and staging area."""

    def __init__(self, target: Path, work: Path, lock_file):
        self.target, self.work, self._lock_file = target, work, lock_file
        self.keep = False  # it holds finished work: on failure, leave it for a resume

    @property
    def staging(self) -> Path:
        return self.work / "staging"

    def new_staging(self) -> Path:
        """An empty staging folder (what an interrupted save left there is discarded)."""
        shutil.rmtree(self.staging, ignore_errors=True)
        self.staging.mkdir()
        return self.staging

    def publish(self) -> None:
        """Move the complete staging folder into place, replacing a ptq checkpoint there."""
        _publish_permissions(self.staging)
        if self.target.exists():
            foreign = foreign_files(self.target)  # checked again: it may have changed meanwhile
            if foreign:
                raise PtqError(f"output '{self.target}' now holds files ptq did not write (e.g. {foreign[0]}); "
                               f"the new checkpoint is left in '{self.staging}'")
            old = self.work / "old"
            self.target.rename(old)
            self.staging.rename(self.target)
            shutil.rmtree(old)
        else:
            self.staging.rename(self.target)

    def release(self, *, keep: bool) -> None:
        if self._lock_file is not None:
            self._lock_file.close()  # closing drops the flock
            self._lock_file = None
        if not keep:
            shutil.rmtree(self.work, ignore_errors=True)


def _try_lock(lock_path: Path):
    """The open, exclusively locked lock file; None when another live process holds it."""
    handle = open(lock_path, "a+")
    if fcntl is None:
        return handle
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.close()
        return None
    return handle


def _holder(lock_path: Path) -> str:
    try:
        return lock_path.read_text().strip() or "?"
    except OSError:
        return "?"


def _stamp(handle) -> None:
    handle.seek(0)
    handle.truncate()
    handle.write(f"{os.getpid()}\n")
    handle.flush()


@contextmanager
def claim_output(target: str | os.PathLike, *, resume: bool = False, command: str = "") -> Iterator[OutputSlot]:
    """Lock the output for this run and give it a work folder; see the module docstring.

    An existing work folder is either another live run's (PtqError at once) or left by an
    interrupted run: resumed when `resume`, else named in a PtqError with `command`, the
    way to resume it. On success the work folder is removed; on an error or an interrupt it
    is kept when slot.keep says it holds finished work to resume, else removed.
    """
    target = Path(target).absolute()
    work = work_folder(target)
    slot = _open_existing(work, target, resume, command) if work.exists() else _create(work, target)
    try:
        yield slot
    except BaseException:
        slot.release(keep=slot.keep)
        raise
    slot.release(keep=False)


def _create(work: Path, target: Path) -> OutputSlot:
    """Make the work folder with its lock already held, so no other run sees it unlocked."""
    fresh = Path(tempfile.mkdtemp(prefix=work.name + ".", dir=work.parent))
    handle = _try_lock(fresh / "lock")
    _stamp(handle)
    try:
        fresh.rename(work)
    except OSError:  # another run created it first
        handle.close()
        shutil.rmtree(fresh, ignore_errors=True)
        raise PtqError(f"another ptq run is writing '{target}' (pid {_holder(work / 'lock')}); "
                       "wait for it or choose another --output") from None
    return OutputSlot(target, work, handle)


def _open_existing(work: Path, target: Path, resume: bool, command: str) -> OutputSlot:
    lock = work / "lock"
    handle = _try_lock(lock) if work.is_dir() else None
    if handle is None:
        if not work.is_dir():
            raise PtqError(f"'{work}' is in the way of ptq's work folder for '{target}'; move it away")
        raise PtqError(f"another ptq run is writing '{target}' (pid {_holder(lock)}); "
                       "wait for it or choose another --output")
    if not resume:
        handle.close()
        again = f"rerun with --resume ({command} --resume)" if command else "rerun with --resume"
        raise PtqError(f"an interrupted run left '{work}'; {again} to continue it, or remove that folder "
                       f"(rm -r '{work}') to start over")
    _stamp(handle)
    slot = OutputSlot(target, work, handle)
    slot.keep = True  # an earlier run's work: a failure now must not delete it
    return slot


def _publish_permissions(folder: Path) -> None:
    """Give the staged files the modes a plain mkdir/open would (mkdtemp makes them private)."""
    umask = os.umask(0)
    os.umask(umask)
    folder.chmod(0o777 & ~umask)
    for path in folder.rglob("*"):
        path.chmod((0o777 if path.is_dir() else 0o666) & ~umask)
