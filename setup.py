"""The compiled GPTQ column loop (ptq/algorithms/gptq_loop.c), built when a C compiler is
there; without one ptq installs all the same and runs the torch loop (the report says so).
Everything else about the package is in pyproject.toml."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "ptq.algorithms._gptq_loop",
            sources=["ptq/algorithms/gptq_loop.c"],
            # no fused multiply-adds: the same bits on every CPU (see the file's header)
            extra_compile_args=["-O3", "-ffp-contract=off", "-std=gnu11"],
            optional=True,
        )
    ]
)
