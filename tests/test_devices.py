"""The compute dtype follows the device: the model's on accelerators; on CPUs, decided from
the instruction set and torch's settings (never from a timing)."""

import pytest
import torch

from ptq.devices import bf16_is_fast, compute_dtype_for, cpu_bf16_is_fast, cpu_flags, cpu_threads, cpuinfo_flags

SAPPHIRE_RAPIDS = {"avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile"}
COOPER_LAKE = {"avx2", "avx512f", "avx512_bf16"}
GRANITE_AMX_ONLY = {"avx2", "avx512f", "amx_bf16"}  # hypothetical: AMX-BF16 alone suffices
SKYLAKE_X = {"avx2", "avx512f", "avx512bw"}  # AVX512 without bf16 instructions
ZEN3 = {"avx2", "fma"}


def test_accelerators_keep_the_model_dtype():
    assert compute_dtype_for("cuda", torch.bfloat16) == torch.bfloat16
    assert compute_dtype_for(torch.device("cuda", 0), torch.float16) == torch.float16


@pytest.mark.parametrize("flags", [SAPPHIRE_RAPIDS, COOPER_LAKE, GRANITE_AMX_ONLY])
def test_bf16_is_fast_with_bf16_instructions_avx512_kernels_and_onednn(flags):
    assert bf16_is_fast(flags, "AVX512", onednn=True)


@pytest.mark.parametrize("flags", [SKYLAKE_X, ZEN3, set()])
def test_bf16_is_slow_without_bf16_instructions(flags):
    assert not bf16_is_fast(flags, "AVX512" if "avx512f" in flags else "AVX2", onednn=True)


@pytest.mark.parametrize("capability", ["AVX2", "DEFAULT", "NO AVX"])
def test_bf16_is_slow_when_torch_dispatches_below_avx512(capability):
    # ATEN_CPU_CAPABILITY=avx2 (scripts/bench_gptq_vs_llmcompressor.py --no-fast-bf16)
    assert not bf16_is_fast(SAPPHIRE_RAPIDS, capability, onednn=True)


def test_bf16_is_slow_without_onednn():
    # torch.backends.mkldnn.enabled = False: bf16 GEMMs fall back to ATen's reference kernels
    assert not bf16_is_fast(SAPPHIRE_RAPIDS, "AVX512", onednn=False)


def test_cpuinfo_flags_reads_the_flags_line():
    cpuinfo = "processor\t: 0\nmodel name\t: Xeon\nflags\t\t: fpu avx2 avx512_bf16 amx_bf16\nbugs\t\t: spectre_v1\n"
    assert cpuinfo_flags(cpuinfo) == {"fpu", "avx2", "avx512_bf16", "amx_bf16"}
    assert cpuinfo_flags("processor\t: 0\n") == frozenset()  # no flags line (not x86)


def test_cpu_choice_is_the_decision_for_this_cpu():
    assert compute_dtype_for("cpu", torch.float32) == torch.float32
    assert compute_dtype_for("cpu", torch.float16) == torch.float32  # no fast fp16 matmul on CPUs
    onednn = torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled
    fast = bf16_is_fast(cpu_flags(), torch.backends.cpu.get_cpu_capability(), onednn)
    assert cpu_bf16_is_fast() == fast
    assert compute_dtype_for("cpu", torch.bfloat16) == (torch.bfloat16 if fast else torch.float32)


def test_turning_onednn_off_at_run_time_picks_float32():
    enabled = torch.backends.mkldnn.enabled
    torch.backends.mkldnn.enabled = False  # as the benchmark's --no-fast-bf16 does
    try:
        assert compute_dtype_for("cpu", torch.bfloat16) == torch.float32
    finally:
        torch.backends.mkldnn.enabled = enabled


def test_cpu_threads_sets_and_restores_the_thread_count():
    before = torch.get_num_threads()
    with cpu_threads(1):
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == before
    with pytest.raises(RuntimeError), cpu_threads(1):
        raise RuntimeError("restored on errors too")
    assert torch.get_num_threads() == before
