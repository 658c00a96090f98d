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
import torch

from ptq.cli import main

RECIPE = "calibration: {samples: 16, seq_len: 128}\nsteps:\n  - gptq: {scheme: W4A16}\n"
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


ARGV = ["quantize", "--recipe", "r.yaml", "--output", "out", "--no-eval"]


def main_on_one_thread(argv: list[str]) -> int:
    """`ptq quantize` in this process, on the killed run's one thread (--resume refuses a run
    set up otherwise): only the run that is killed needs a process of its own."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return main(argv)
    finally:
        torch.set_num_threads(threads)


def run_here(folder: Path, monkeypatch, capsys, *extra: str) -> tuple[int, str, str]:
    monkeypatch.chdir(folder)
    code = main_on_one_thread([*ARGV, *extra])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


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
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(folder)
        assert main_on_one_thread(ARGV) == 0
    return hashes(folder / "out")


@pytest.mark.parametrize("point", KILL_POINTS)
def test_resume_after_sigkill_is_bit_identical(tmp_path, monkeypatch, capsys, uninterrupted, point):
    (tmp_path / "r.yaml").write_text(RECIPE)
    work = tmp_path / ".out.ptq-partial"
    run = subprocess.Popen([sys.executable, "-m", "ptq", *ARGV], cwd=tmp_path, env=ENV, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while run.poll() is None and not KILL_POINTS[point](work) and time.monotonic() < deadline:
        time.sleep(0.002)
    run.send_signal(signal.SIGKILL)
    killed = run.wait() == -signal.SIGKILL
    if killed:
        assert work.is_dir() and not (tmp_path / "out").exists()
        if point == "after block 2":  # the refusals, at one kill point
            code, _, err = run_here(tmp_path, monkeypatch, capsys)
            assert code == 2 and "--resume" in err and "an interrupted run left" in err
            (tmp_path / "r.yaml").write_text(RECIPE.replace("W4A16", "W3A16"))
            code, _, err = run_here(tmp_path, monkeypatch, capsys, "--resume")
            last = err.strip().splitlines()[-1]
            assert code == 2 and last.startswith("ptq: error: cannot resume") and "different recipe" in last
            assert finished_blocks(work) >= 2  # the interrupted run's work is kept, not deleted
            (tmp_path / "r.yaml").write_text(RECIPE)
        code, out, err = run_here(tmp_path, monkeypatch, capsys, "--resume")
        assert code == 0, err
        if point.startswith("after block"):
            assert "note: resumed: blocks 0 to" in out
    assert hashes(tmp_path / "out") == uninterrupted
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "r.yaml"]  # the work folder is gone
