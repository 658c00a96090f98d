"""Run llm-compressor's GPTQ (or AWQ) W4A16 on given token ids; print one JSON line of measurements.

Runs in a virtual environment with llmcompressor installed (not ptq's): see
scripts/bench_gptq_vs_llmcompressor.py, which calls it. --method awq runs AWQModifier
(duo scaling, grid 20) then round-to-nearest W4A16 (QuantizationModifier), as
recipes/w4a16-awq.yaml without clipping. A method that raises prints {"error": its last
line} instead (llm-compressor 0.14's AWQ needs an accelerator), and the exit status is 0.
"""

import argparse
import json
import os
import resource
import time

import torch
from datasets import Dataset
from llmcompressor import oneshot
from llmcompressor.modifiers.gptq import GPTQModifier
from llmcompressor.modifiers.quantization import QuantizationModifier
from llmcompressor.modifiers.transform.awq import AWQModifier
from transformers import AutoModelForCausalLM, AutoTokenizer


def peak_rss_mb() -> float:
    """VmHWM: this process's own peak (ru_maxrss would include the launcher's, carried over exec)."""
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--ids", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--method", choices=["gptq", "awq"], default="gptq")
    parser.add_argument("--group-size", type=int, default=128)
    args = parser.parse_args()

    solve = {"seconds": 0.0}
    compress = GPTQModifier.compress_modules

    def timed_compress(self):  # measure the GPTQ solves (the benchmark's instrumentation)
        start = time.perf_counter()
        try:
            return compress(self)
        finally:
            solve["seconds"] += time.perf_counter() - start

    GPTQModifier.compress_modules = timed_compress
    if os.environ.get("PTQ_BENCH_NO_FAST_BF16") == "1":  # the benchmark's --no-fast-bf16
        torch.backends.mkldnn.enabled = False
    start, cpu_start = time.perf_counter(), time.process_time()  # process_time: every thread's CPU
    ids = torch.load(args.ids, weights_only=True)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=getattr(torch, args.dtype))
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    data = Dataset.from_dict({"input_ids": ids.tolist(), "attention_mask": torch.ones_like(ids).tolist()})
    weights = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": args.group_size}
    scheme = {"group_0": {"targets": ["Linear"], "weights": weights}}  # W4A16, any group size
    if args.method == "gptq":
        recipe = GPTQModifier(config_groups=scheme, ignore=["lm_head"], actorder="static")
    else:
        recipe = [AWQModifier(duo_scaling=True, n_grid=20),
                  QuantizationModifier(config_groups=scheme, ignore=["lm_head"])]
    quantize_start = time.perf_counter()
    try:
        oneshot(model=model, tokenizer=tokenizer, dataset=data, recipe=recipe, max_seq_length=ids.shape[1],
                num_calibration_samples=ids.shape[0], shuffle_calibration_samples=False)
    except Exception as error:  # reported as a row of the benchmark's table
        print(json.dumps({"error": f"{type(error).__name__}: {str(error).strip().splitlines()[-1]}",
                          "wall": time.perf_counter() - start}))
        return
    quantize = time.perf_counter() - quantize_start
    model.save_pretrained(args.out, save_compressed=True)
    tokenizer.save_pretrained(args.out)
    print(json.dumps({
        "wall": time.perf_counter() - start,
        "cpu": time.process_time() - cpu_start,
        "quantize": quantize,  # oneshot: calibration and the solves
        "gptq": solve["seconds"],
        "peak_rss_mb": peak_rss_mb(),
    }))


if __name__ == "__main__":
    main()
