"""ptq sets libgomp's spin count before torch loads, unless the user chose a wait setting
or torch was loaded first; the setting changes no result (tests/test_devices.py runs the
same work at several thread counts under it)."""

import os
import subprocess
import sys

import pytest

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
    for name in WAIT_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    assert "torch" in sys.modules
    default_spin_count()
    assert "GOMP_SPINCOUNT" not in os.environ
