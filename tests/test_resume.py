"""--resume: a run killed with SIGKILL continues from its last finished block, and the
checkpoint it writes is bit-identical (sha256 of every file) to an uninterrupted run's."""

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

RECIPE = "calibration: {samples: 16, seq_len: 128}\nsteps:\n  - gptq: {scheme: W4A16}\n"
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


def command(folder: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "ptq", "quantize", "--recipe", "r.yaml", "--output", "out", "--no-eval", *extra]


def hashes(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def finished_blocks(work: Path) -> int:
    try:
        return json.loads((work / "blocks" / "progress.json").read_text())["finished_blocks"]
    except (OSError, ValueError):
        return -1


KILL_POINTS = {  # when to kill: a condition on the work folder
    "before any block": lambda work: (work / "lock").exists(),
    "after block 2": lambda work: finished_blocks(work) >= 2,  # a later block adds no new path: one is enough
    "while saving": lambda work: (work / "staging").exists(),
}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    folder = tmp_path_factory.mktemp("base")
    (folder / "r.yaml").write_text(RECIPE)
    subprocess.run(command(folder), cwd=folder, env=ENV, check=True, capture_output=True)
    return hashes(folder / "out")


@pytest.mark.parametrize("point", KILL_POINTS)
def test_resume_after_sigkill_is_bit_identical(tmp_path, uninterrupted, point):
    (tmp_path / "r.yaml").write_text(RECIPE)
    work = tmp_path / ".out.ptq-partial"
    run = subprocess.Popen(command(tmp_path), cwd=tmp_path, env=ENV, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while run.poll() is None and not KILL_POINTS[point](work) and time.monotonic() < deadline:
        time.sleep(0.002)
    run.send_signal(signal.SIGKILL)
    killed = run.wait() == -signal.SIGKILL
    if killed:
        assert work.is_dir() and not (tmp_path / "out").exists()
        if point == "after block 2":  # the refusals at one kill point (each run starts a Python)
            again = subprocess.run(command(tmp_path), cwd=tmp_path, env=ENV, capture_output=True, text=True)
            assert again.returncode == 2 and "--resume" in again.stderr and "an interrupted run left" in again.stderr
            (tmp_path / "r.yaml").write_text(RECIPE.replace("W4A16", "W3A16"))
            other = subprocess.run(command(tmp_path, "--resume"), cwd=tmp_path, env=ENV, capture_output=True,
                                   text=True)
            last = other.stderr.strip().splitlines()[-1]
            assert other.returncode == 2 and last.startswith("ptq: error: cannot resume") and "different recipe" in last
            assert finished_blocks(work) >= 2  # the interrupted run's work is kept, not deleted
            (tmp_path / "r.yaml").write_text(RECIPE)
        resumed = subprocess.run(command(tmp_path, "--resume"), cwd=tmp_path, env=ENV, capture_output=True, text=True)
        assert resumed.returncode == 0, resumed.stderr
        if point.startswith("after block"):
            assert "note: resumed: blocks 0 to" in resumed.stdout
    assert hashes(tmp_path / "out") == uninterrupted
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "r.yaml"]  # the work folder is gone
