"""ptq's compiled loops (ptq/algorithms/gptq_loop.c: GPTQ's column loop; awq_grid.c: AWQ's
candidate grid; ptq/packing.c: int32 packing; ptq/calibration/gram_amx.c: Hessians with
AMX or AVX512-BF16; ptq/algorithms/transpose.c: transposed copies; ptq/cpu_attention.c,
cpu_attention_f32.c and ptq/cpu_norm.c: the calibration passes' causal attention (bf16,
float32) and RMSNorms; ptq/cpu_mlp.c: their SiLU-gated
products; ptq/cpu_rotary.c: their rotary position embeddings; ptq/calibration/channel_stats.c:
their per-channel sums and maxima of |x|; ptq/algorithms/smooth_weights.c: the passes over
bf16 weights around AWQ's grid and SmoothQuant), built when a C compiler is there;
without one ptq installs all the same and runs the torch references (the report says so).
Everything else about the package is in pyproject.toml."""

import importlib.util
from pathlib import Path

from setuptools import Extension, setup

HERE = Path(__file__).parent
_spec = importlib.util.spec_from_file_location("ptq_sources", HERE / "ptq" / "_sources.py")
_sources = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_sources)
DIGEST = _sources.source_digest(HERE / "ptq") or ""

setup(
    ext_modules=[
        Extension(
            "ptq.algorithms._compiled",
            sources=["ptq/algorithms/gptq_loop.c", "ptq/algorithms/awq_grid.c", "ptq/packing.c",
                     "ptq/calibration/gram_amx.c", "ptq/algorithms/transpose.c", "ptq/cpu_attention.c",
                     "ptq/cpu_attention_f32.c",
                     "ptq/algorithms/linalg.c", "ptq/algorithms/linalg_avx2.c", "ptq/cpu_norm.c", "ptq/cpu_mlp.c",
                     "ptq/cpu_rotary.c", "ptq/calibration/channel_stats.c", "ptq/algorithms/smooth_weights.c"],
            depends=["ptq/algorithms/quant_math.h", "ptq/algorithms/linalg.h"],
            define_macros=[("PTQ_SOURCE_DIGEST", f'"{DIGEST}"')],  # checked at load (ptq/_sources.py)
            # no fused multiply-adds: the same bits on every CPU (see the file's header)
            extra_compile_args=["-O3", "-ffp-contract=off", "-std=gnu11"],
            optional=True,
        )
    ]
)
