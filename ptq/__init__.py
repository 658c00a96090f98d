"""ptq: post-training quantization for large language models.

    import ptq
    model, tokenizer = ptq.load_model()                  # the bundled tiny Llama
    ptq.quantize(model, "recipes/w4a16-gptq.yaml", tokenizer=tokenizer)   # in place
    ptq.save(model, "out/tiny-w4a16", tokenizer=tokenizer)   # format="gptq" or "awq" too
    quantized = ptq.load("out/tiny-w4a16")
    print(ptq.evaluate(quantized, ptq.eval_windows(tokenizer)).perplexity)
    ptq.push_to_hub("out/tiny-w4a16", "me/tiny-w4a16")   # with its model card, README.md
"""

from ptq.openmp import default_spin_count

default_spin_count()  # before torch loads its OpenMP runtime: see ptq/openmp.py

from ptq.source_checkout import hub_kernels_first

hub_kernels_first()  # before transformers imports it: see ptq/source_checkout.py

from ptq.first_math_call import settle

settle()  # torch's first parallel cos or sin may be computed wrong: see ptq/first_math_call.py

from ptq.checkpoint.reader import load
from ptq.checkpoint.writer import save
from ptq.errors import PtqError
from ptq.evaluate import EvalResult, eval_windows, evaluate
from ptq.export.checkpoint import convert
from ptq.export.hub import push_to_hub
from ptq.kv import kv_cache
from ptq.models import load_model
from ptq.pipeline import quantize
from ptq.recipe import Recipe, load_recipe
from ptq.schemes import PRESETS, QuantArgs, Scheme

__all__ = [
    "PRESETS",
    "EvalResult",
    "PtqError",
    "QuantArgs",
    "Recipe",
    "Scheme",
    "convert",
    "eval_windows",
    "evaluate",
    "kv_cache",
    "load",
    "load_model",
    "load_recipe",
    "push_to_hub",
    "quantize",
    "save",
]
__version__ = "0.1.0"
