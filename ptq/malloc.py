"""glibc's malloc told to keep freed memory for reuse, in ptq's own processes (the CLI).

A calibration pass allocates and frees the same few sizes over and over: activations of a
batch (SmolLM2's 2048 x 1536 bf16: 6 MB), their float32 copies in the norms, GPTQ's
matrices. glibc serves requests above its mmap threshold with fresh mappings, and gives
the top of a heap back to the kernel once more than its trim threshold is free; both start
at 128 KiB and grow with the largest block freed so far. So the pages of one batch's
activations go back to the kernel and the next batch's fault in new ones, each zeroed by
the kernel: on SmolLM2's GPTQ (issue 15) 570-730K minor faults and 1.3-1.7 s of system
time in an 11 s job, and element-wise ops ran 3-6 times slower in place than alone.

With the trim threshold at TRIM_THRESHOLD and the mmap threshold at glibc's largest
(MMAP_THRESHOLD), freed blocks stay in the heap and the next batch reuses them: 87-100K
faults, 0.4 s of system time, and the job 4-6% faster (SmolLM2-shaped: 11.1-11.4 ->
10.7-10.8 s; random 1024 x 4: 6.0 -> 5.7-5.8 s), peak RSS within its run-to-run spread.
Blocks of more than 32 MiB are still mapped and unmapped each time.

It is process-wide and, once set, glibc's thresholds no longer adapt: right for a process
that runs ptq and exits (`ptq` commands, the benchmarks' workers), not for a library call
inside someone else's process, so ptq.quantize does not set it; a pipeline that wants it
calls keep_freed_memory() itself. Settings the user made (GLIBC_TUNABLES' malloc entries,
MALLOC_*_ variables, or another allocator in LD_PRELOAD) are kept. No result changes.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Mapping

TRIM_THRESHOLD = 1 << 30  # bytes free at a heap's top before glibc gives them back
MMAP_THRESHOLD = 32 << 20  # glibc's largest (HEAP_MAX_SIZE / 2 on 64-bit): larger blocks are mapped
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # mallopt's parameter numbers (malloc.h)
USER_VARIABLES = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_ARENA_MAX")


def user_allocator_choice(environ: Mapping[str, str]) -> str | None:
    """What the user set about the allocator (then ptq sets nothing), or None."""
    if "glibc.malloc." in environ.get("GLIBC_TUNABLES", ""):
        return "GLIBC_TUNABLES"
    if "malloc" in environ.get("LD_PRELOAD", ""):  # jemalloc, tcmalloc, mimalloc
        return "LD_PRELOAD"
    return next((name for name in USER_VARIABLES if name in environ), None)


def keep_freed_memory(environ: Mapping[str, str] = os.environ) -> str | None:
    """Set glibc's trim and mmap thresholds (see above) in this process; what was set, or
    None where nothing was (not glibc, or the user's own choice)."""
    if user_allocator_choice(environ) is not None:
        return None
    libc = ctypes.CDLL(None)
    if not hasattr(libc, "gnu_get_libc_version") or not hasattr(libc, "mallopt"):
        return None  # musl, macOS: their allocators are not glibc's
    if not (libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) and libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)):
        return None
    return (f"glibc malloc keeps freed memory: trim threshold {TRIM_THRESHOLD >> 20} MiB, "
            f"mmap threshold {MMAP_THRESHOLD >> 20} MiB")
