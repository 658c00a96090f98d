"""Check ptq's GPTQ and AWQ checkpoints in the real readers (not a CI test: it needs them).

In a separate environment (the readers pin their own versions):

    python -m venv /tmp/venv-gptq && /tmp/venv-gptq/bin/pip install torch==2.13.0
    /tmp/venv-gptq/bin/pip install transformers==5.24.0 gptqmodel==7.5.0 optimum==2.3.0 \
        compressed-tensors==0.18.0 requests pydantic pyyaml tqdm
    /tmp/venv-gptq/bin/pip install --no-deps autoawq==0.2.9 zstandard     # optional
    PYTHONPATH=. /tmp/venv-gptq/bin/python scripts/verify_formats.py

For each case the bundled tiny Llama is quantized by ptq, saved as gptq or awq, and read by

- ptq.load (the reference: its QuantLinears, bit-exact with what was saved);
- transformers' AutoModelForCausalLM.from_pretrained: optimum + gptqmodel for "gptq",
  gptqmodel's AWQ kernels for "awq" (transformers 5 reads AWQ through gptqmodel);
- AutoAWQ's WQLinear_GEMM, when autoawq is installed ("awq" cases), and AutoGPTQ's cuda-old
  QuantLinear (its CPU path; "gptq" cases without act-order), when auto-gptq is installed
  (`pip install --no-deps auto-gptq==0.7.1`), Linear by Linear.

It prints, per case: whether each quantized Linear's weight as the reader dequantizes it is
bit-equal to ptq's integers and scales dequantized the same way ((q - zero) * scale in the
reader's dtype), and the logits' largest difference and top-1 agreement on held-out text
(both models in bfloat16, the checkpoint's dtype; they sum in different orders). Exits 1
when a weight differs or a tolerance is exceeded.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

import ptq
from ptq.modules import QuantLinear

LOGIT_ATOL = 0.25  # bf16 logits of ~|10|: a few bf16 ulps after 4 blocks summed in another order
TOP1_FLOOR = 0.97  # bf16 logits of near-tied tokens flip with one ulp

CASES = {  # name: (recipe steps, format)
    "w4a16-g128-sym gptq": ([{"rtn": {"scheme": "W4A16"}}], "gptq"),
    "w4a16-g128-asym gptq": ([{"rtn": {"scheme": "W4A16_ASYM"}}], "gptq"),
    "w4a16-channel-sym gptq": ([{"rtn": {"scheme": {"weights": {"num_bits": 4, "strategy": "channel"}}}}], "gptq"),
    "w8a16-channel gptq": ([{"rtn": {"scheme": "W8A16"}}], "gptq"),
    "w3a16-g128 gptq": ([{"rtn": {"scheme": "W3A16"}}], "gptq"),
    "w4a16-actorder-group gptq": ([{"gptq": {"scheme": "W4A16", "actorder": "group", "observer": "minmax"}}], "gptq"),
    "w4a16-g128-sym awq": ([{"rtn": {"scheme": "W4A16"}}], "awq"),
    "w4a16-g128-asym awq": ([{"rtn": {"scheme": "W4A16_ASYM"}}], "awq"),
}
CALIBRATION = {"dataset": "builtin", "samples": 16, "seq_len": 256, "seed": 0}


def reader_weight(module: torch.nn.Module, fmt: str) -> torch.Tensor:
    """The [out, in] weight as the loaded reader module dequantizes it."""
    if fmt == "awq":
        from gptqmodel.quantization.awq.utils.packing_utils import dequantize_gemm

        return dequantize_gemm(module.qweight, module.qzeros, module.scales, module.bits, module.group_size).t()
    return module.dequantize_weight().t()


def ptq_weight(module: QuantLinear, dtype: torch.dtype) -> torch.Tensor:
    """ptq's integers and scales dequantized as the readers do, in their dtype."""
    qw = module.quantized_weight()
    values = qw.q.to(torch.int32) - (0 if qw.zero is None else _expand(qw.zero, qw).to(torch.int32))
    return values.to(dtype) * _expand(qw.scale, qw).to(dtype)


def _expand(t: torch.Tensor, qw) -> torch.Tensor:
    from ptq.primitives import expand_groups

    return expand_groups(t, qw.q.shape[1], qw.g_idx)


def _stored_layers(reference: torch.nn.Module, folder: Path):
    """(name, ptq's QuantLinear, the stored tensors of that Linear, group_size) per quantized Linear."""
    import json

    from safetensors.torch import load_file

    stored = load_file(folder / "model.safetensors")
    group = json.loads((folder / "config.json").read_text())["quantization_config"]["group_size"]
    for name, module in reference.named_modules():
        if isinstance(module, QuantLinear):
            yield name, module, {k.rpartition(".")[2]: v for k, v in stored.items() if k.startswith(name + ".")}, group


def _module_check(reference: torch.nn.Module, folder: Path, make, label: str) -> str:
    """Each Linear through the reader's own module (fp16, its torch fallback): the weight it
    dequantizes against ptq's, and its output against ptq's float32 one."""
    equal = total = 0
    worst = 0.0
    for name, module, tensors, group in _stored_layers(reference, folder):
        layer, weight = make(module, tensors, group)
        x = torch.randn(3, module.in_features, generator=torch.Generator().manual_seed(0)).half()
        with torch.no_grad():
            theirs = layer(x).float().reshape(3, -1)
        ours = torch.nn.functional.linear(x.float(), module.dequantized_weight().float())
        worst = max(worst, float((theirs - ours).abs().max() / ours.abs().max()))
        total += 1
        equal += bool(torch.equal(weight, ptq_weight(module, weight.dtype)))
    return f"{label}: weights equal {equal}/{total}, largest output difference {worst:.1e} of the output's range (fp16)"


def autoawq_check(reference: torch.nn.Module, folder: Path) -> str:
    """AutoAWQ 0.2.9's WQLinear_GEMM and dequantize_gemm (its CPU path) on the stored tensors."""
    try:
        from awq.modules.linear.gemm import WQLinear_GEMM
        from awq.utils.packing_utils import dequantize_gemm
    except ImportError as error:
        return f"AutoAWQ: not importable ({error})"

    def make(module, tensors, group):
        layer = WQLinear_GEMM(4, group, module.in_features, module.out_features, False, "cpu")
        for key in ("qweight", "qzeros", "scales"):
            setattr(layer, key, tensors[key])
        return layer, dequantize_gemm(layer.qweight, layer.qzeros, layer.scales, 4, layer.group_size).t()

    return _module_check(reference, folder, make, "AutoAWQ WQLinear_GEMM")


def autogptq_check(reference: torch.nn.Module, folder: Path) -> str:
    """AutoGPTQ 0.7.1's cuda-old QuantLinear on the CPU (its torch path: v1 zeros read field by
    field, + 1). auto_gptq's package does not import with transformers 5: the module is
    loaded from its file. It ignores g_idx (contiguous groups only)."""
    import importlib.util

    spec = importlib.util.find_spec("auto_gptq")
    if spec is None:
        return "AutoGPTQ: not installed"
    path = Path(spec.origin).parent / "nn_modules" / "qlinear" / "qlinear_cuda_old.py"
    module_spec = importlib.util.spec_from_file_location("autogptq_cuda_old", path)
    cuda_old = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(cuda_old)

    def make(module, tensors, group):
        layer = cuda_old.QuantLinear(module.scheme.weights.num_bits, group, module.in_features, module.out_features, False)
        for key in ("qweight", "qzeros", "scales", "g_idx"):
            setattr(layer, key, tensors[key])
        eye = torch.eye(module.in_features, dtype=torch.float16)
        with torch.no_grad():
            weight = layer(eye).t()  # [out, in]: the weight it computes with
        return layer, weight

    return _module_check(reference, folder, make, "AutoGPTQ cuda-old QuantLinear")


def _reader_model(folder: Path, fmt: str, backend: str | None) -> torch.nn.Module:
    """transformers' model of the checkpoint (backend: None for the kernel gptqmodel picks)."""
    from transformers import AutoModelForCausalLM, AwqConfig, GPTQConfig

    extra = {}
    if backend is not None:
        config = GPTQConfig(bits=4, backend=backend) if fmt == "gptq" else AwqConfig(bits=4, backend=backend)
        extra["quantization_config"] = config
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16, device_map="cpu", **extra).eval()


def _compare(reference: torch.nn.Module, theirs: torch.nn.Module, fmt: str, windows: torch.Tensor) -> tuple:
    """(reader classes, weights equal, total, logits max|diff|, mean|diff|, top-1 agreement, logit scale).
    Weights first: some kernels (TorchAtenLinear) repack theirs at the first forward."""
    kinds, equal, total = set(), 0, 0
    for module_name, module in reference.named_modules():
        if isinstance(module, QuantLinear):
            loaded = theirs.get_submodule(module_name)
            kinds.add(type(loaded).__name__)
            got = reader_weight(loaded, fmt)
            total += 1
            equal += bool(torch.equal(got, ptq_weight(module, got.dtype)))
    with torch.no_grad():
        ours_logits = reference(windows).logits.float()
        their_logits = theirs(windows).logits.float()
    diff = (ours_logits - their_logits).abs()
    top1 = float((ours_logits.argmax(-1) == their_logits.argmax(-1)).float().mean())
    return kinds, equal, total, float(diff.max()), float(diff.mean()), top1, float(ours_logits.abs().max())


def run_case(name: str, steps: list, fmt: str, work: Path, windows: torch.Tensor) -> bool:
    model, tokenizer = ptq.load_model()
    recipe = ptq.Recipe.model_validate({"calibration": CALIBRATION, "steps": steps})
    ptq.quantize(model, recipe, tokenizer=tokenizer, show_progress=False)
    folder = work / name.replace(" ", "-")
    ptq.save(model, folder, tokenizer=tokenizer, format=fmt)
    reference = ptq.load(folder, dtype=torch.bfloat16, backend="torch")
    try:
        result = _compare(reference, _reader_model(folder, fmt, backend=None), fmt, windows)
    except Exception as error:  # a reader's kernel refusing the case: say so, then try its torch kernel
        print(f"{name:28s} transformers (kernel chosen by gptqmodel) failed: {str(error).splitlines()[0][:150]}")
        result = _compare(reference, _reader_model(folder, fmt, backend="torch"), fmt, windows)
    kinds, equal, total, diff, mean, top1, scale = result
    ok = equal == total and diff <= LOGIT_ATOL and top1 >= TOP1_FLOOR
    print(f"{name:28s} {'/'.join(sorted(kinds)):18s} weights equal {equal}/{total}  logits max|diff| {diff:.4f} "
          f"mean {mean:.5f} (|logits| up to {scale:.1f})  top-1 {100 * top1:.2f}%  {'ok' if ok else 'FAILED'}")
    if fmt == "awq":
        print(f"{'':28s} {autoawq_check(reference, folder)}")
    elif "actorder" not in name:
        print(f"{'':28s} {autogptq_check(reference, folder)}")
    return ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="*", default=list(CASES), help="which cases (default: all)")
    args = parser.parse_args()
    import gptqmodel
    import optimum
    import transformers

    print(f"torch {torch.__version__}, transformers {transformers.__version__}, gptqmodel {gptqmodel.__version__}, "
          f"optimum {optimum.__version__ if hasattr(optimum, '__version__') else '?'}")
    _, tokenizer = ptq.load_model()
    windows = ptq.eval_windows(tokenizer, seq_len=128, max_windows=4)
    results = []
    with tempfile.TemporaryDirectory() as work:
        for name in args.cases:
            steps, fmt = CASES[name]
            results.append(run_case(name, steps, fmt, Path(work), windows))
    print(f"{sum(results)} of {len(results)} cases ok (weights bit-equal, logits within {LOGIT_ATOL}, "
          f"top-1 agreement >= {TOP1_FLOOR:.0%})")
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
