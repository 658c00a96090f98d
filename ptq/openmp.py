"""How long torch's idle OpenMP threads spin before they sleep, set before torch loads.

torch's CPU ops run on an OpenMP thread pool: libgomp in the Linux wheels. Between two
parallel ops an idle libgomp thread spins GOMP_SPINCOUNT times (300,000 by default, about
3 ms) before it sleeps. On a quiet machine that saves a wake-up per op; on a busy one a
spinning thread holds a core that its partner thread, descheduled by another process,
waits for, and every op costs a scheduler time slice. The bundled model's GPTQ took 3.8 s
quiet and over a minute with two busy processes on the two cores (RTN: 0.05 s and 5 s).
Sleeping at once (OMP_WAIT_POLICY=PASSIVE) undoes the collapse but pays a wake-up on
every op (GPTQ 7 s quiet). A short spin costs little quiet (GPTQ 4.1-4.6 s, within this
machine's noise of 3.8) and ends long before the other processes' time slices come round
(loaded: about 20 s; scripts/bench_under_load.py measures old, new, passive and 1 thread).

The runtime reads its environment once, when torch's library is loaded: this module does
not import torch, and ptq/__init__.py calls default_spin_count() before anything imports
it. A wait setting the user chose is kept, and nothing is set when torch is already loaded
(too late to matter in this process). The setting changes no result: the thread count and
how each op splits its work stay the same.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping

SPIN_COUNT = 2000  # spins before sleeping: ~20 µs by libgomp's estimate of 100,000 per ms
WAIT_VARIABLES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")  # the user's choice wins


def spin_count_to_set(environ: Mapping[str, str], torch_loaded: bool) -> str | None:
    """The GOMP_SPINCOUNT to set: SPIN_COUNT, or None when the user set a wait variable or
    torch (and with it the OpenMP runtime) is already loaded."""
    if torch_loaded or any(name in environ for name in WAIT_VARIABLES):
        return None
    return str(SPIN_COUNT)


def default_spin_count() -> None:
    """Set GOMP_SPINCOUNT in this process's environment, where spin_count_to_set says so."""
    value = spin_count_to_set(os.environ, torch_loaded="torch" in sys.modules)
    if value is not None:
        os.environ["GOMP_SPINCOUNT"] = value
