"""ptq sets libgomp's spin count before torch loads, unless the user chose a wait setting
or torch was loaded first; the setting changes no result (tests/test_devices.py runs the
same work at several thread counts under it)."""

import os
import subprocess
import sys

import pytest

from ptq import openmp
from ptq.openmp import SPIN_COUNT, WAIT_VARIABLES, default_spin_count, spin_count_to_set


def test_spin_count_is_set_when_nothing_chose_one():
    assert spin_count_to_set({"PATH": "/usr/bin"}, torch_loaded=False) == str(SPIN_COUNT)


@pytest.mark.parametrize("name", WAIT_VARIABLES)
def test_a_wait_setting_the_user_chose_is_kept(name):
    assert spin_count_to_set({name: "PASSIVE"}, torch_loaded=False) is None


def test_nothing_is_set_once_torch_is_loaded():
    # the OpenMP runtime read its environment when torch loaded it: too late for this process
    assert spin_count_to_set({}, torch_loaded=True) is None


def _spin_count_seen(code: str) -> str:
    env = {k: v for k, v in os.environ.items() if k not in WAIT_VARIABLES}
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    return result.stdout.strip()


def test_importing_ptq_sets_it_before_torch_loads():
    code = "import os, ptq, torch; print(os.environ.get('GOMP_SPINCOUNT'))"
    assert _spin_count_seen(code) == str(SPIN_COUNT)


def test_what_ptq_runs_on_import_sets_nothing_once_torch_is_loaded(monkeypatch):
    # this process loaded torch before ptq, as `import torch, ptq` does
    monkeypatch.setattr(openmp, "_long_spin", openmp._long_spin)  # restored after the test
    for name in WAIT_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    assert "torch" in sys.modules
    default_spin_count()
    assert "GOMP_SPINCOUNT" not in os.environ and openmp.spins_long()
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")  # a wait setting the user chose: theirs
    default_spin_count()
    assert not openmp.spins_long()


def test_with_torch_first_torch_runs_on_one_thread_and_ptq_keeps_its_threads(monkeypatch):
    """quantize where the runtime spins long: the same bits as where it does not, torch's
    ops on one thread meanwhile, ptq's own work on torch's thread count, and the report says so."""
    import torch

    import ptq
    import ptq.pipeline
    from ptq.devices import cpu_budget

    seen = []
    real_parallel = ptq.devices.cpu_parallel

    def watching(tasks, threads, threads_per_task=1):
        seen.append((torch.get_num_threads(), cpu_budget(), threads))
        return real_parallel(tasks, threads, threads_per_task)

    recipe = {"calibration": {"samples": 8, "seq_len": 128}, "steps": [{"gptq": {"scheme": "W4A16"}}]}
    results = {}
    threads = max(2, torch.get_num_threads())
    for long_spin in (False, True):
        monkeypatch.setattr(ptq.pipeline, "spins_long", lambda long_spin=long_spin: long_spin)
        monkeypatch.setattr(ptq.algorithms.gptq, "cpu_parallel", watching)
        model, tokenizer = ptq.load_model()
        seen.clear()
        with ptq.devices.cpu_threads(threads):
            ptq.quantize(model, ptq.recipe.parse_recipe(recipe), tokenizer=tokenizer, show_progress=False)
            assert torch.get_num_threads() == threads  # restored
        results[long_spin] = model.state_dict(), model.ptq_report
        # GPTQ's row slices: started from a thread whose torch ops ran on 1 thread or on all, on all threads
        assert seen and all(t == (1 if long_spin else threads) and b == threads >= n for t, b, n in seen), seen
        assert any(n == threads for _, _, n in seen), seen
    (plain, plain_report), (one, one_report) = results[False], results[True]
    assert plain.keys() == one.keys() and all(torch.equal(plain[k], one[k]) for k in plain)
    assert openmp.LONG_SPIN_NOTE not in plain_report.notes and openmp.LONG_SPIN_NOTE in one_report.notes
    assert one_report.settings() == plain_report.settings()  # what --resume checks: the threads too
    assert plain_report.cpu["threads"] == threads
