"""The benchmarks' busy processes (scripts/bench_under_load.busy_cores) end with the process
that started them, however it ends: a killed benchmark must not leave cores busy behind it
(a later "quiet" timing would run under load)."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import load_script


def _busy_program(monkeypatch) -> str:
    return load_script("bench_under_load", monkeypatch).BUSY  # in sys.modules: its dataclass looks it up


def _running(pid: int) -> bool:
    """Whether pid runs (a zombie waiting for its reaper counts as ended)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads process states from /proc")
def test_a_busy_process_ends_when_its_parent_is_killed(monkeypatch):
    parent = subprocess.Popen(
        [sys.executable, "-c", "import os, subprocess, sys, time\n"
         "child = subprocess.Popen([sys.executable, '-c', sys.argv[1], str(os.getpid())])\n"
         "print(child.pid, flush=True)\n"
         "time.sleep(120)", _busy_program(monkeypatch)],
        stdout=subprocess.PIPE, text=True)
    child = int(parent.stdout.readline())
    try:
        time.sleep(0.3)
        assert _running(child)  # it spins while its parent lives
        parent.send_signal(signal.SIGKILL)  # no cleanup of the parent's runs
        parent.wait()
        deadline = time.monotonic() + 10
        while _running(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _running(child)
    finally:
        parent.kill()
        if _running(child):
            os.kill(child, signal.SIGKILL)
