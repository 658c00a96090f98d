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

torch imported first (as a training pipeline does) leaves the long spin, and it costs on a
quiet machine too: ptq's own threads (devices.cpu_parallel: Hessians, GPTQ's rows, passes
side by side) start right after torch's ops, whose spinning helpers hold the cores they
need (SmolLM2-shaped GPTQ on 2 cores: 6.2-6.5 s with ptq imported first, 8.9-9.3 s with
torch first). spins_long() says when; ptq.quantize's calibration passes then run torch's
ops on one thread each (devices.torch_ops_on_one_thread: an op on one thread wakes no
helper; a lone forward pass keeps all threads) and ptq's own work on its threads, and the
report says so. Elsewhere (RTN, evaluation) no thread of ptq's competes: left as it is.
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


LONG_SPIN_NOTE = ("torch was imported before ptq, so its OpenMP threads spin long after each op: in the calibration "
                  "passes torch's ops ran on one thread each, ptq's own work on its threads (import ptq first to let "
                  "it shorten the spin)")
_long_spin = False


def default_spin_count() -> None:
    """Set GOMP_SPINCOUNT in this process's environment, where spin_count_to_set says so;
    remember whether the runtime keeps its long default (spins_long)."""
    global _long_spin
    torch_loaded = "torch" in sys.modules
    value = spin_count_to_set(os.environ, torch_loaded=torch_loaded)
    if value is not None:
        os.environ["GOMP_SPINCOUNT"] = value
    _long_spin = torch_loaded and not any(name in os.environ for name in WAIT_VARIABLES)


def spins_long() -> bool:
    """Whether torch's OpenMP threads spin libgomp's default 300,000 times here: torch was
    loaded before ptq, and nobody chose a wait setting."""
    return _long_spin
