"""Kernel tests run on the GPU when there is one, else on the Triton CPU interpreter.

On a GPU, PTQ_KERNEL_AUTOTUNE defaults to 0: each kernel runs its first (default) Hopper config,
since autotuning every small test shape would compile hundreds of kernel variants. The autotuned
configs are exercised (and checked against the references) by scripts/gpu_check.py.

TRITON_INTERPRET must be in the environment before `triton.jit` decorates the kernels, i.e.
before ptq.kernels is first imported. pytest imports this conftest before the test modules
of this folder, so setting it here is early enough as long as nothing collected earlier
(another folder's conftest or test module) has already imported ptq.kernels.
"""

import os
import sys

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if HAS_CUDA:
    os.environ.setdefault("PTQ_KERNEL_AUTOTUNE", "0")
else:
    os.environ.setdefault("TRITON_INTERPRET", "1")
    _early = sys.modules.get("ptq.kernels.wna16_gemm")
    if _early is not None and not _early._INTERPRET:
        raise RuntimeError(
            "ptq.kernels was imported before tests/kernels/conftest.py could set TRITON_INTERPRET=1, "
            "so its kernels cannot run on this CPU-only machine. Set TRITON_INTERPRET=1 in the "
            "environment, or in tests/conftest.py before anything imports ptq."
        )


@pytest.fixture(scope="session")
def device() -> str:
    """Device the kernel tests run on: "cuda" when available, else "cpu" (interpreter)."""
    return "cuda" if HAS_CUDA else "cpu"
