"""Choosing the compute dtype for the device the work runs on, and running ops on fixed threads.

On an accelerator, the model's own 16-bit dtype. On a CPU, bf16 only where torch runs bf16
matmuls fast, which is a property of the CPU and of the torch build, read from them and
never timed (a timing flips on a busy machine, and with it every result):

- the CPU has AVX512-BF16 or AMX-BF16 instructions (AVX2-only CPUs run bf16 GEMMs several
  times slower than float32 ones);
- oneDNN, which runs torch's bf16 GEMMs on those instructions, is built in and enabled
  (without it bf16 Linears fall back to ATen's reference kernels: about 3x slower here);
- torch dispatches its own kernels at AVX512 level (ATEN_CPU_CAPABILITY=avx2 lowers it,
  as on an AVX2 CPU; its bf16 elementwise kernels then lose their fast conversions).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Iterator, Sequence, Set
from concurrent.futures import ThreadPoolExecutor
import contextlib
from contextlib import contextmanager
from pathlib import Path
from typing import TypeVar

import torch

T = TypeVar("T")
R = TypeVar("R")
BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})  # /proc/cpuinfo names


def bf16_is_fast(flags: Set[str], capability: str, onednn: bool) -> bool:
    """True when bf16 matmuls beat float32 ones on a CPU with these instruction-set flags
    (/proc/cpuinfo names), torch CPU capability (torch.backends.cpu.get_cpu_capability():
    "AVX512", "AVX2", "DEFAULT", ...) and oneDNN available and enabled."""
    return bool(BF16_FLAGS & flags) and capability.upper().startswith("AVX512") and onednn


def cpuinfo_flags(cpuinfo: str) -> frozenset[str]:
    """The instruction-set flags on the first "flags" line of /proc/cpuinfo's text."""
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            return frozenset(value.split())
    return frozenset()


@functools.cache
def cpu_flags() -> frozenset[str]:
    """This CPU's bf16 instruction sets, of BF16_FLAGS: from torch's CPUID check
    (torch.cpu.get_capabilities in newer torch, the private _is_avx512_bf16_supported in
    some older ones) and /proc/cpuinfo (Linux) where torch has no such check."""
    capabilities = getattr(torch.cpu, "get_capabilities", None)  # name -> bool (or a size)
    if capabilities is not None:
        found = capabilities()
        return frozenset(name for name in BF16_FLAGS if found.get(name) is True)
    flags = set()
    if getattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)():
        flags.add("avx512_bf16")
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        flags |= cpuinfo_flags(cpuinfo.read_text(errors="replace"))
    return frozenset(flags & BF16_FLAGS)


def cpu_bf16_is_fast() -> bool:
    """bf16_is_fast for this CPU and the torch running now (oneDNN may be turned off at run
    time: torch.backends.mkldnn.enabled = False)."""
    onednn = torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled
    return bf16_is_fast(cpu_flags(), torch.backends.cpu.get_cpu_capability(), onednn)


def cpu_settings() -> dict[str, object]:
    """What of this CPU and torch's set-up decides a CPU run's bits, for the checkpoint's
    manifest: what chose the compute dtype, and the thread count (on larger models some
    GEMMs of the forward pass split their sums by it; see cpu_threads)."""
    return {
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cpu_bf16_flags": sorted(cpu_flags()),
        "onednn": torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled,
        "threads": cpu_budget(),
    }


@contextmanager
def float32_gemms(precision: str) -> Iterator[None]:
    """float32 GEMMs on the CPU inside the block at oneDNN's `precision`, then as before.

    "ieee": float32 throughout, whatever the caller set (torch.set_float32_matmul_precision
    ("medium") would otherwise round GPTQ's inputs to bf16). "bf16": multiplied in bf16 (AMX
    or AVX512-BF16), accumulated and returned in float32; for inputs whose values are bf16
    values (a bf16 tensor, converted) nothing is rounded but the float32 sums, so the result
    is as a float32 GEMM's at bf16 speed (2.7x a float32 GEMM on one thread here). Other
    inputs would be rounded to bf16: only GEMMs of bf16 values may run inside "bf16". The
    setting is process-wide while the block runs.
    """
    matmul = torch.backends.mkldnn.matmul
    before = matmul.fp32_precision
    matmul.fp32_precision = precision
    try:
        yield
    finally:
        matmul.fp32_precision = before


@functools.cache
def bf16_valued_gemms_exact() -> bool:
    """Whether float32 GEMMs of bf16 values under float32_gemms("bf16") are float32-accurate
    on this CPU: checked once on a small problem (the error of a float32 GEMM is about
    2^-22 of its largest entry here), so a backend that rounds the products' sums or
    output to bf16 is caught, and plain float32 GEMMs used instead."""
    if not cpu_bf16_is_fast():
        return False
    generator = torch.Generator().manual_seed(0)
    a = torch.randn(512, 64, generator=generator).bfloat16().float()
    b = torch.randn(512, 96, generator=generator).bfloat16().float()
    exact = a.double().t() @ b.double()  # [64, 96]
    with float32_gemms("bf16"):
        product = a.t() @ b
    return bool((product.double() - exact).abs().max() / exact.abs().max() < 2**-18)


def compute_dtype_for(device: torch.device | str, model_dtype: torch.dtype) -> torch.dtype:
    """The dtype to compute in: the model's on an accelerator; on a CPU, bf16 for a bf16
    model when the CPU has fast bf16 matmuls (cpu_bf16_is_fast), else float32."""
    if torch.device(device).type != "cpu":
        return model_dtype
    if model_dtype == torch.bfloat16 and cpu_bf16_is_fast():
        return torch.bfloat16
    return torch.float32


_thread = threading.local()  # .budget: this thread's cpu_budget() where it is not torch's count


def cpu_budget() -> int:
    """How many threads ptq's own CPU work started from this thread may use (cpu_parallel's
    threads, passes side by side): torch's thread count, or inside
    torch_ops_on_one_thread() the count torch had before it."""
    return getattr(_thread, "budget", 0) or torch.get_num_threads()


@contextmanager
def _budget(n: int) -> Iterator[None]:
    before = getattr(_thread, "budget", 0)
    _thread.budget = n
    try:
        yield
    finally:
        _thread.budget = before


@contextmanager
def cpu_threads(n: int) -> Iterator[None]:
    """Run the block with torch's CPU ops on n threads (and n threads for ptq's own work
    started in it, cpu_budget), then restore the thread count.

    For ops whose result depends on how many threads split the work: LAPACK's Cholesky
    (MKL potrf) rounds differently on 1 and 2 threads. Not every op can be pinned so at a
    small cost: the GEMMs of a forward pass (oneDNN bf16, MKL float32) split long sums by
    thread count too, at 3 to 16 threads on Llama-sized layers (on the bundled model: only
    bf16 at 8 threads). The count is process-wide: other Python threads running torch ops
    meanwhile get n threads too.
    """
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        with _budget(n):
            yield
    finally:
        torch.set_num_threads(before)


@contextmanager
def torch_ops_on_one_thread() -> Iterator[None]:
    """torch's ops called from this thread run on one thread; ptq's own threads
    (cpu_parallel, passes side by side) keep the count torch had.

    For a process whose OpenMP runtime spins long (ptq/openmp.py: torch loaded before ptq
    could shorten the spin): after an op on n threads its n - 1 helpers spin for
    milliseconds, on the cores ptq's own threads need next; an op on one thread wakes
    none of them."""
    budget = cpu_budget()
    with cpu_threads(1), _budget(budget):
        yield


@functools.cache
def _pool(workers: int) -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=workers, thread_name_prefix="ptq-cpu")


class _Tasks:
    """Tasks started in order by whichever thread asks next (the caller's among them), none
    more than `ahead` - 1 past the one whose result the caller waits for (all at once by
    default); after a failure no further task starts. The caller takes the results all
    together (all) or one by one in order (in_order)."""

    def __init__(self, tasks: list[Callable], threads_per_task: int = 1, ahead: int | None = None):
        self.tasks, self.threads_per_task = tasks, threads_per_task
        self.ahead = len(tasks) if ahead is None else ahead
        self.outcomes: dict[int, tuple[bool, object]] = {}  # index -> (ok, result or error)
        self.started = self.finished = self.waited_on = self.helpers = 0
        self.stopped = False
        self.changed = threading.Condition()

    def _startable(self) -> bool:
        """Whether the next task may start now (under the lock)."""
        return not self.stopped and self.started < min(len(self.tasks), self.waited_on + self.ahead)

    def _take(self) -> int | None:
        """The index of the next task to run, or None where none may start now (under the lock)."""
        if not self._startable():
            return None
        self.started += 1
        return self.started - 1

    def _run(self, index: int) -> None:
        try:
            outcome = True, self.tasks[index]()
        except BaseException as e:  # handed to the caller, which raises it in the task's turn
            outcome = False, e
        with self.changed:
            self.outcomes[index] = outcome
            self.finished += 1
            self.stopped |= not outcome[0]
            self.changed.notify_all()

    def _call_helpers(self, threads: int) -> None:
        """Up to threads - 1 pool threads (no more than tasks but one) working on the tasks
        that may start (under the lock)."""
        pool = _pool(threads - 1)
        while self.helpers < min(threads, len(self.tasks)) - 1 and self._startable():
            self.helpers += 1
            pool.submit(self.work)

    def work(self, helper: bool = True) -> None:
        """Run tasks until none may start; a pool thread (helper) then goes back to the pool,
        free for other work (a cpu_parallel of the caller's, which meanwhile takes results)."""
        if torch.get_num_threads() != self.threads_per_task:  # a pool thread keeps the count it last set
            torch.set_num_threads(self.threads_per_task)
        while True:
            with self.changed:
                index = self._take()
                if index is None:
                    self.helpers -= helper
                    return
            self._run(index)

    def all(self, threads: int) -> list:
        """The results in order, the tasks run on this thread and up to threads - 1 pool
        threads, once every task that started has finished; the first failed task's error
        (in task order) instead, if any failed."""
        with self.changed:
            self._call_helpers(threads)
        self.work(helper=False)
        with self.changed:
            self.changed.wait_for(lambda: self.finished == self.started)
        failed = [i for i, (ok, _) in self.outcomes.items() if not ok]
        if failed:
            raise self.outcomes[min(failed)][1]
        return [self.outcomes[i][1] for i in range(len(self.tasks))]

    def in_order(self, threads: int) -> Iterator:
        """The results one by one in order, each as soon as it is in; this thread runs tasks
        too while its next result is not, beside up to threads - 1 pool threads. A failure is
        raised in its task's turn; when the caller stops early, the tasks that started finish
        first."""
        try:
            for index in range(len(self.tasks)):
                while True:
                    with self.changed:
                        self.waited_on = index
                        if index in self.outcomes:
                            ok, value = self.outcomes.pop(index)
                            break
                        self._call_helpers(threads)
                        mine = self._take()
                        if mine is None:  # the task waited on runs on a pool thread
                            self.changed.wait_for(lambda: index in self.outcomes)
                            continue
                    with _budget(self.threads_per_task):
                        self._run(mine)
                if not ok:
                    raise value
                yield value
        finally:  # nothing runs on after this returns
            with self.changed:
                self.stopped = True
                self.changed.wait_for(lambda: self.finished == self.started)


def cpu_parallel(tasks: list[Callable], threads: int, threads_per_task: int = 1) -> list:
    """Run independent tasks on `threads` Python threads, each task's torch ops on
    threads_per_task OpenMP threads (one by default); their results in order.

    For work split into pieces whose bits must not depend on the thread count (each piece
    computed by single-threaded ops), and that on a busy CPU should not wait on each
    other: a thread that is descheduled holds up only its own piece, while the others take
    the next ones. torch ops and ctypes calls let go of the GIL, so the threads run at once.

    The calling thread takes tasks too, beside threads - 1 pool threads: a call waits for
    one thread's wake-up fewer (tenths of a millisecond on a VM's idle core, against tasks
    of a few: the Hessians' tile sums, GPTQ's row slices, the blocked Cholesky). A pool
    thread that starts after the tasks are all taken returns at once, so a task may call
    cpu_parallel again without waiting on the pool.
    """
    with cpu_threads(threads_per_task):
        if threads <= 1 or len(tasks) <= 1:
            return [task() for task in tasks]
        return _Tasks(tasks, threads_per_task).all(threads)


MAX_IN_FLIGHT = 8  # on a CPU, forward passes run side by side at most (side_by_side)


def side_by_side(count: int, device: torch.device | str) -> tuple[int, int] | None:
    """How `count` independent forward passes on `device` share the CPU: (passes in flight,
    torch threads each), or None where they run in turn (one thread, one pass, or not on a
    CPU). Up to MAX_IN_FLIGHT run at once, each on its own thread with an equal share of
    torch's threads (one each on up to 8 cores): no op then waits for a partner thread at a
    barrier (on a busy CPU a descheduled thread holds up only its own pass), and there no
    op splits a sum by the thread count."""
    threads = cpu_budget()
    if threads <= 1 or count <= 1 or torch.device(device).type != "cpu":
        return None
    in_flight = min(threads, MAX_IN_FLIGHT)
    return in_flight, threads // in_flight


def map_side_by_side(function: Callable[[T], R], items: Sequence[T], device: torch.device | str,
                     bounded: bool = False, waves: int | None = 1) -> Iterator[R]:
    """function(item) for each item, in order, side by side on a CPU (side_by_side), each
    call under torch.no_grad (grad mode is per thread); elsewhere one call after another,
    each result yielded as it comes.

    All at once, or `bounded`: no more calls ahead of the result the caller takes next
    than `waves` times the passes in flight (None: no bound), which bounds what waits in
    memory. With one torch thread a pass (up to MAX_IN_FLIGHT cores) such a map streams
    (_Tasks.in_order): a thread that is free takes the next call, while the caller works on
    the results in order, its own torch ops on one thread as the passes' (torch's count is
    process-wide; ptq's own threads keep the budget). No call then waits for a partner's at
    a join, which on a busy CPU holds up every thread whenever one is descheduled. With more
    threads a pass, calls run a wave at a time: the caller's work between results
    (cpu_parallel's tasks run on one thread) would change the passes' thread count, and
    with it their sums, while they run.

    With waves=1 a thread that finished its call while the caller works on a result stays
    idle until the caller takes the next one (which also makes the calls wait for the
    caller's work); with 2 it goes on, within twice the memory; with None, for a caller that
    keeps every result anyway but works on each as it comes, it never waits (all at once,
    the caller would start its work only after the last call). Where the caller's work is
    parallel itself, running ahead costs: the GPTQ job's Hessian passes ran ~2% slower with
    one more call ahead, on a Zen 5; AWQ's statistics passes gain."""
    shared = side_by_side(len(items), device)
    if shared is None:
        on_cpu = torch.device(device).type == "cpu"
        for item in items:  # inside torch_ops_on_one_thread: a lone pass still on all threads
            with cpu_threads(cpu_budget()) if on_cpu else contextlib.nullcontext():
                result = function(item)
            yield result
        return
    in_flight, threads_each = shared

    def task(item: T) -> R:
        with torch.no_grad():
            return function(item)

    calls = [functools.partial(task, item) for item in items]
    if bounded and threads_each == 1:
        with torch_ops_on_one_thread():  # the caller's ops too, as the calls'
            yield from _Tasks(calls, ahead=None if waves is None else waves * in_flight).in_order(in_flight)
        return
    step = in_flight if bounded else len(calls)
    for start in range(0, len(calls), step):
        yield from cpu_parallel(calls[start:start + step], in_flight, threads_each)
