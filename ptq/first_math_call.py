"""The process's first call into torch's vectorized math functions, made on one thread.

In a fresh process with torch 2.13's CPU build (MKL's vector math), the first call to cos,
sin and the like that torch splits across threads can return the other threads' chunks at
a lower accuracy (relative errors up to 1.5e-4 against the 1 ulp of every later call);
the calling thread's chunk, and every later call, are right. Checked without ptq: the
first `cos` of a [1, 512, 32] float32 tensor on 2 threads (transformers' rotary table for
512 positions) gave other bits than the same call made again in 2 of 60 and 1 of 80 fresh
processes, the first `sin` in 8 of 100, always exactly the second thread's half; after one
call on a 64-element tensor (one thread) none did: cos in 150 processes, sin in 100, and
sin in 100 after importing ptq (scripts/first_math_call.py counts it). In ptq's GPTQ job that first call is the rotary
table of the first calibration batch, and a wrong half of it moved the checkpoint's bits
now and then (issue 15's "same bits in every run": 3 of 18 runs in one benchmark), and the
benchmark's perplexity evaluation in its own process (79.915 against 79.91333).

settle() makes that first call on one thread, once, when ptq is imported; a process that
made a parallel call before importing ptq has had its one wrong call already.
"""

from __future__ import annotations

import functools

import torch


@functools.cache
def settle() -> None:
    """One call of cos and one of sin on 64 values (under torch's grain: one thread)."""
    values = torch.linspace(0.0, 1.0, 64)
    values.cos()
    values.sin()
