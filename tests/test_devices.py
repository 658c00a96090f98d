"""The compute dtype follows the device: the model's on accelerators, measured on CPUs."""

import torch

from ptq.devices import compute_dtype_for, cpu_bf16_is_fast


def test_accelerators_keep_the_model_dtype():
    assert compute_dtype_for("cuda", torch.bfloat16) == torch.bfloat16
    assert compute_dtype_for(torch.device("cuda", 0), torch.float16) == torch.float16


def test_cpu_choice():
    assert compute_dtype_for("cpu", torch.float32) == torch.float32
    assert compute_dtype_for("cpu", torch.float16) == torch.float32  # no fast fp16 matmul on CPUs
    expected = torch.bfloat16 if cpu_bf16_is_fast() else torch.float32
    assert compute_dtype_for("cpu", torch.bfloat16) == expected
    assert cpu_bf16_is_fast() is cpu_bf16_is_fast()  # measured once per process
