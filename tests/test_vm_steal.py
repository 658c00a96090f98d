"""The benchmark's record of the CPU time the hypervisor took during a run (scripts/vm_steal.py)."""

import os
from pathlib import Path

import pytest

from tests.conftest import load_script

TICK = os.sysconf("SC_CLK_TCK")


@pytest.fixture
def vm_steal(monkeypatch):
    return load_script("vm_steal", monkeypatch)


def stat(path: Path, steal_ticks: int) -> Path:
    path.write_text(f"cpu  1200269 0 144836 1611744 5108 0 922 {steal_ticks} 0 0\n"
                    "cpu0 600000 0 72000 805000 2500 0 400 9000 0 0\n")
    return path


def test_stolen_seconds_reads_the_steal_of_all_cpus(vm_steal, tmp_path):
    assert vm_steal.stolen_seconds(stat(tmp_path / "stat", 3 * TICK)) == 3.0
    (tmp_path / "old").write_text("cpu 1 2 3 4 5 6 7\n")  # a kernel that counts no steal
    assert vm_steal.stolen_seconds(tmp_path / "old") is None
    assert vm_steal.stolen_seconds(tmp_path / "missing") is None


def test_measured_steal_is_the_share_of_the_machines_cpu_time(vm_steal, tmp_path, monkeypatch):
    path = stat(tmp_path / "stat", 1000)
    clock = iter([10.0, 12.0])  # 2 s of wall time
    monkeypatch.setattr(vm_steal.time, "perf_counter", lambda: next(clock))
    monkeypatch.setattr(vm_steal.os, "cpu_count", lambda: 2)
    with vm_steal.measured_steal(path) as steal:
        stat(path, 1000 + TICK)  # 1 CPU-second stolen of 2 CPUs x 2 s
    assert steal.share == 0.25
    assert steal.shown() == "25%"


def test_measured_steal_without_a_count_is_unknown(vm_steal, tmp_path):
    with vm_steal.measured_steal(tmp_path / "missing") as steal:
        pass
    assert steal.share is None
    assert steal.shown() == "n/a"
    assert vm_steal.largest_share([None, 0.04, 0.2, None]) == "20%"


@pytest.mark.parametrize(("shares", "retries", "kept", "again"), [
    ([0.5, 0.3, 0.05], 2, 0.05, 2),  # run again until the hypervisor took little
    ([0.5, 0.3, 0.05], 1, 0.3, 1),  # no more than `retries` times
    ([0.1, 0.5], 2, 0.1, 0),  # at the limit: kept
    ([None, 0.5], 2, None, 0),  # steal not counted here: nothing to go by
    (["error", 0.05], 2, "RuntimeError", 0),  # a failed run would fail again: not run again
])
def test_little_steal_runs_again_while_too_much_was_stolen(vm_steal, shares, retries, kept, again, capsys):
    runs = iter(shares)

    def run():
        share = next(runs)
        return {"stolen": 0.5, "error": "RuntimeError"} if share == "error" else {"stolen": share, "wall": 1.0}

    result, redone = vm_steal.little_steal(run, 0.1, retries)
    assert (result.get("error", result["stolen"]), redone) == (kept, again)
    assert capsys.readouterr().out.count("run again") == again
