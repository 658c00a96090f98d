"""Peak resident memory (VmHWM) of `ptq quantize` and `ptq.load`, each run in a fresh process.

    python scripts/bench_memory.py [--scratch /tmp/ptq-bench-memory] [--runs 2] [--tree DIR]

Cases: the README's main command (the bundled model, recipes/w4a16-gptq.yaml, with its
evaluation) and ptq.load of its checkpoint; then a random-initialised Llama generated into
the scratch folder (hidden 1024, 12 layers, bf16, the bundled tokenizer; about 325 MB),
quantized with RTN W4A16 without and with evaluation, and ptq.load of that checkpoint
(in its stored bf16, and with dtype=float32 as on CPUs without fast bf16).
--tree runs another copy of ptq (put first on PYTHONPATH), e.g. a copy of an earlier
version, for before/after figures. Prints one row per case: the model's bytes and the
peak RSS of each run. Nothing here is imported by ptq; the scratch folder is not removed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "ptq" / "assets" / "tiny-llama"
_CWD = "/"  # not the repository: `python -m`/`-c` put the working folder before PYTHONPATH (--tree)
LOAD = """
import re, sys, torch, ptq
from ptq.report import peak_rss_bytes
imported = int(re.search(r"VmRSS:\\s+(\\d+) kB", open("/proc/self/status").read()).group(1)) * 1024  # now, not peak
model = ptq.load(sys.argv[1], dtype=getattr(torch, sys.argv[2]) if len(sys.argv) > 2 else None)
print(imported, peak_rss_bytes())
"""


def make_llama(folder: Path, *, hidden: int = 1024, layers: int = 12, intermediate: int = 2816) -> None:
    """A random Llama in bf16 with the bundled model's tokenizer (made once, in a child process)."""
    if (folder / "model.safetensors").is_file() or (folder / "model.safetensors.index.json").is_file():
        return
    code = f"""
import torch
from transformers import LlamaConfig, LlamaForCausalLM
torch.manual_seed(0)
config = LlamaConfig(vocab_size=4096, hidden_size={hidden}, intermediate_size={intermediate},
                     num_hidden_layers={layers}, num_attention_heads=16, num_key_value_heads=16,
                     max_position_embeddings=2048, bos_token_id=0, eos_token_id=1, pad_token_id=3)
LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained({str(folder)!r})
"""
    folder.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-c", code], check=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TINY / name, folder / name)


def weight_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.glob("*.safetensors"))


def quantize_peak(env: dict, model: Path, recipe: str, output: Path, extra: list[str]) -> int:
    """Peak RSS of one `ptq quantize` (its --report-json's peak_memory_bytes: VmHWM at the end)."""
    report = output.with_suffix(".json")
    command = [sys.executable, "-m", "ptq", "quantize", "--model", str(model), "--recipe", recipe,
               "--output", str(output), "--overwrite", "--report-json", str(report), *extra]
    subprocess.run(command, check=True, env=env, cwd=_CWD, stdout=subprocess.DEVNULL)
    return json.loads(report.read_text())["peak_memory_bytes"]["rss"]


def load_peak(env: dict, checkpoint: Path, *dtype: str) -> tuple[int, int]:
    """(RSS after the imports, peak RSS after ptq.load) of one fresh process."""
    out = subprocess.run([sys.executable, "-c", LOAD, str(checkpoint), *dtype], check=True, env=env, cwd=_CWD,
                         capture_output=True, text=True).stdout
    imported, loaded = out.split()[-2:]
    return int(imported), int(loaded)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scratch", default="/tmp/ptq-bench-memory", help="where models and checkpoints go")
    parser.add_argument("--runs", type=int, default=2, help="runs of each case")
    parser.add_argument("--tree", default=None, help="a folder holding another copy of the ptq package")
    parser.add_argument("--only", default=None, help="run only the cases whose name holds this text")
    parser.add_argument("--eval-windows", type=int, default=8, help="evaluation windows for the random Llama")
    args = parser.parse_args()
    scratch = Path(args.scratch)
    scratch.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    if args.tree:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(args.tree).resolve()), env.get("PYTHONPATH")]))
    big = scratch / "random-llama"
    make_llama(big)
    rows = []

    def case(name: str, model_bytes: int, measure) -> None:
        if args.only and args.only not in name:
            return
        peaks = [measure() for _ in range(args.runs)]
        rows.append((name, model_bytes, peaks))
        print(f"  {name}: {', '.join(_mb(p if isinstance(p, int) else p[1]) for p in peaks)}", file=sys.stderr)

    tiny_out, big_rtn = scratch / "tiny-w4a16-gptq", scratch / "big-w4a16-rtn"
    recipes = ROOT / "recipes"
    case("tiny: quantize w4a16-gptq, eval (README)", weight_bytes(TINY),
         lambda: quantize_peak(env, TINY, str(recipes / "w4a16-gptq.yaml"), tiny_out, []))
    case("tiny: ptq.load of that checkpoint", weight_bytes(tiny_out), lambda: load_peak(env, tiny_out))
    case("random Llama: quantize w4a16-rtn, --no-eval", weight_bytes(big),
         lambda: quantize_peak(env, big, str(recipes / "w4a16-rtn.yaml"), big_rtn, ["--no-eval"]))
    case(f"random Llama: quantize w4a16-rtn, eval ({args.eval_windows} windows)", weight_bytes(big),
         lambda: quantize_peak(env, big, str(recipes / "w4a16-rtn.yaml"), big_rtn,
                               ["--eval-windows", str(args.eval_windows)]))
    case("random Llama: ptq.load of the RTN checkpoint", weight_bytes(big_rtn), lambda: load_peak(env, big_rtn))
    case("random Llama: ptq.load of it, dtype float32", weight_bytes(big_rtn),
         lambda: load_peak(env, big_rtn, "float32"))
    print(_table(rows, args.tree))


def _mb(n: int) -> str:
    return f"{n / 1e6:,.0f} MB"


def _table(rows, tree) -> str:
    head = f"peak RSS (VmHWM), ptq from {tree or ROOT}"
    lines = [head, f"{'case':<52} {'weights':>10} {'runs':>22} {'load: RSS before':>18}", "-" * 106]
    for name, model_bytes, peaks in rows:
        loaded = [p[1] if isinstance(p, tuple) else p for p in peaks]
        imports = ", ".join(_mb(p[0]) for p in peaks if isinstance(p, tuple))
        lines.append(f"{name:<52} {_mb(model_bytes):>10} {', '.join(_mb(p) for p in loaded):>22} {imports:>18}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
