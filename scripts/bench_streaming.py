"""Peak memory of streamed quantization (ptq.streaming) against the model's size.

Not run in CI. For each size it writes a random-initialised Llama in bf16 into a scratch
folder (shard by shard: the whole model is never in memory here either), then quantizes
it, streamed, in a child process whose address space is capped by the OS (RLIMIT_AS, as
`prlimit --as` sets it), so that a memory regression fails loudly instead of passing
slowly. It prints the child's peak RSS (VmHWM, which the child reads from /proc/self/status
as it ends), the import-only baseline and the ratio to the model's bf16 bytes. Not wait4's
ru_maxrss: Linux carries a process's peak across exec, so a child forked from this script
after it generated a 3 GB model would report this script's peak (2.4 GB) as its own.

    python scripts/bench_streaming.py --sizes-gb 1 3 --scratch /tmp/ptq-bench-streaming
    python scripts/bench_streaming.py --sizes-gb 1 --recipe recipes/w4a16-gptq.yaml --samples 8

The goal (issue 14): peak RSS <= 0.35x the bf16 model bytes at 3 GB, falling as models grow.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # this ptq, also when the installed one is not importable from here
GB = 1024**3
# virtual memory, not RSS: torch's import alone reserves about 6 GB of address space and each
# shard open is mapped whole; the RSS ratio below is the measure, this only stops a runaway
DEFAULT_ADDRESS_SPACE_GB = 12
SHARD_BYTES = 1 * GB  # the generated model's shards (Hub models use 2 to 5 GB)
LLAMA = dict(hidden_size=2048, intermediate_size=5632, num_attention_heads=16, num_key_value_heads=4,
             vocab_size=32000, max_position_embeddings=2048, tie_word_embeddings=False)  # TinyLlama-1.1B's shape

# no MALLOC_MMAP_THRESHOLD_: ptq.streaming sets glibc's threshold itself (return_freed_memory),
# and the figures are those of a plain `ptq quantize --stream`
CHILD_ENV = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")}

CHILD = r"""
import json, sys, time
from pathlib import Path
recipe_path, folder, out, samples, seq_len = sys.argv[1:6]
import ptq  # noqa: F401  (imports counted in the baseline)
from ptq.checkpoint.writer import write_checkpoint
from ptq.recipe import load_recipe
from ptq.streaming import quantize_streamed
def peak_rss():  # this process's high-water mark since exec, bytes
    line = next(l for l in open("/proc/self/status") if l.startswith("VmHWM:"))
    return int(line.split()[1]) * 1024
if folder == "--imports-only":
    print(json.dumps({"peak_rss": peak_rss()}))
    sys.exit(0)
recipe = load_recipe(recipe_path)
cal = recipe.calibration.model_copy(update={"samples": int(samples), "seq_len": int(seq_len)})
recipe = recipe.model_copy(update={"calibration": cal})
from ptq.models import load_tokenizer
tokenizer = load_tokenizer(folder)
start = time.perf_counter()
Path(out).mkdir()
model, shards = quantize_streamed(folder, recipe, Path(out), tokenizer=tokenizer, show_progress=False)
write_checkpoint(model, Path(out), tokenizer=tokenizer, shards=shards)
print(json.dumps({"seconds": time.perf_counter() - start, "peak_rss": peak_rss()}))
"""


def llama_config(size_bytes: int):
    """A Llama of TinyLlama's width with as many blocks as make at least size_bytes in bf16."""
    import transformers

    h, i, heads, kv = (LLAMA[k] for k in ("hidden_size", "intermediate_size", "num_attention_heads",
                                         "num_key_value_heads"))
    kv_width = h // heads * kv
    block = 2 * (2 * h * h + 2 * h * kv_width + 3 * h * i + 2 * h)  # bf16 bytes of one block
    outside = 2 * (2 * LLAMA["vocab_size"] * h + h)
    layers = max(1, -(-(size_bytes - outside) // block))
    return transformers.LlamaConfig(num_hidden_layers=layers, dtype="bfloat16", **LLAMA)


def write_random_llama(folder: Path, size_bytes: int, seed: int = 0) -> int:
    """A random Llama of at least size_bytes (bf16) in folder, one shard in memory at a time.
    Returns its bytes."""
    import torch
    from accelerate import init_empty_weights
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    from ptq.models import bundled_model_path

    config = llama_config(size_bytes)
    with init_empty_weights():
        skeleton = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    folder.mkdir(parents=True)
    config.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):  # text for GPTQ's calibration (ids < 4096)
        shutil.copy(bundled_model_path() / name, folder / name)
    generator = torch.Generator().manual_seed(seed)
    shards, shard, shard_bytes, total = [], {}, 0, 0
    for name, param in skeleton.named_parameters():
        if name.endswith("norm.weight"):
            tensor = torch.ones(param.shape, dtype=torch.bfloat16)
        else:
            tensor = (torch.randn(param.shape, generator=generator) * 0.02).to(torch.bfloat16)
        nbytes = tensor.numel() * 2
        if shard and shard_bytes + nbytes > SHARD_BYTES:
            shards.append(shard)
            _save_shard(folder, shard, len(shards), save_file)
            shard, shard_bytes = {}, 0
        shard[name] = tensor
        shard_bytes += nbytes
        total += nbytes
    shards.append(shard)
    _save_shard(folder, shard, len(shards), save_file)
    weight_map = {}
    for i in range(1, len(shards) + 1):
        old = folder / f"shard-{i}.safetensors"
        new = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        old.rename(folder / new)
        weight_map.update(dict.fromkeys(shards[i - 1], new))
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return total


def _save_shard(folder: Path, shard: dict, number: int, save_file) -> None:
    save_file(shard, folder / f"shard-{number}.safetensors", metadata={"format": "pt"})
    for name in shard:  # keep the names for the index, drop the data
        shard[name] = None


def run_child(args: list[str], address_space_bytes: int) -> tuple[int, dict, str]:
    """(exit status, the JSON line it printed last or {}, stdout+stderr) of the child under RLIMIT_AS."""

    def limit():
        resource.setrlimit(resource.RLIMIT_AS, (address_space_bytes, address_space_bytes))

    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    process = subprocess.Popen([sys.executable, "-c", CHILD, *args], preexec_fn=limit,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               env={**os.environ, **CHILD_ENV, "PYTHONPATH": path})
    output = process.stdout.read()
    status = process.wait()
    lines = output.strip().splitlines()
    result = json.loads(lines[-1]) if status == 0 and lines and lines[-1].startswith("{") else {}
    return status, result, output


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes-gb", type=float, nargs="+", default=[1.0, 3.0])
    parser.add_argument("--scratch", type=Path, default=Path("/tmp/ptq-bench-streaming"))
    parser.add_argument("--recipe", default="recipes/w4a16-rtn.yaml")
    parser.add_argument("--samples", type=int, default=8, help="calibration samples (GPTQ and smoothing)")
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--ratio-ceiling", type=float, default=0.35,
                        help="fail when peak RSS exceeds this share of the model's bytes at the largest size")
    parser.add_argument("--address-space-gb", type=float, default=None,
                        help=f"the child's RLIMIT_AS, virtual memory (default {DEFAULT_ADDRESS_SPACE_GB})")
    parser.add_argument("--keep", action="store_true", help="keep the generated models for another run")
    args = parser.parse_args()
    args.scratch.mkdir(parents=True, exist_ok=True)
    base_status, base, output = run_child([args.recipe, "--imports-only", "-", "0", "0"], 64 * GB)
    assert base_status == 0, output
    base_rss = base["peak_rss"]
    print(f"imports alone: peak RSS {base_rss / 2**20:,.0f} MiB")
    print(f"{'model':>10} {'blocks':>6} {'peak RSS':>10} {'ratio':>6} {'above imports':>14} {'time':>7}  recipe")
    failed = False
    for size in sorted(args.sizes_gb):
        folder = args.scratch / f"llama-{size:g}gb"
        if not folder.exists():
            model_bytes = write_random_llama(folder, int(size * GB))
        else:
            model_bytes = json.loads((folder / "model.safetensors.index.json").read_text())["metadata"]["total_size"]
        blocks = json.loads((folder / "config.json").read_text())["num_hidden_layers"]
        out = args.scratch / f"out-{size:g}gb"
        shutil.rmtree(out, ignore_errors=True)
        ceiling = int((args.address_space_gb or DEFAULT_ADDRESS_SPACE_GB) * GB)
        child_args = [args.recipe, str(folder), str(out), str(args.samples), str(args.seq_len)]
        status, result, output = run_child(child_args, ceiling)
        if status != 0:
            print(output[-3000:])
            print(f"{model_bytes / GB:>8.2f}GB: the streamed run failed (exit {status}) under RLIMIT_AS "
                  f"{ceiling / GB:.1f} GB")
            failed = True
            continue
        seconds, rss = result["seconds"], result["peak_rss"]
        ratio = rss / model_bytes
        print(f"{model_bytes / GB:>8.2f}GB {blocks:>6} {rss / 2**20:>7,.0f}MiB {ratio:>6.3f} "
              f"{(rss - base_rss) / 2**20:>11,.0f}MiB {seconds:>6.1f}s  {args.recipe} (samples {args.samples})")
        if size == max(args.sizes_gb) and ratio > args.ratio_ceiling:
            print(f"FAIL: peak RSS is {ratio:.3f}x the model's bytes, above {args.ratio_ceiling}")
            failed = True
        shutil.rmtree(out, ignore_errors=True)
        if not args.keep:
            shutil.rmtree(folder)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
