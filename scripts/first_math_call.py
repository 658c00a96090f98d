"""How often a fresh process's first parallel cos (or sin) differs from the same call made again.

    python scripts/first_math_call.py --runs 100 [--function sin] [--settle]

Each run is a fresh Python process: it builds transformers' rotary angles for 512
positions ([1, 512, 32] float32), calls the function on torch's default threads (2 here),
calls it 3 times more and compares the first result with the last. --settle first imports
ptq (whose import makes one single-threaded call: ptq/first_math_call.py). Prints how many
runs differed and where (the positions each thread's chunk holds).
"""

from __future__ import annotations

import argparse
import subprocess
import sys

CHILD = """
import sys, torch
if {settle}:
    import ptq
inv = 1.0 / (10000 ** (torch.arange(0, 32, 2).float() / 32))
angles = torch.cat([torch.arange(512)[None, :, None].float() * inv] * 2, dim=-1)  # [1, 512, 32]
first = getattr(angles, "{function}")()
for _ in range(3):
    again = getattr(angles, "{function}")()
differ = (first != again).nonzero()[:, 1]
print(f"{{len(differ)}} {{int(differ.min()) if len(differ) else -1}} {{int(differ.max()) if len(differ) else -1}}")
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=100)
    parser.add_argument("--function", choices=["cos", "sin"], default="cos")
    parser.add_argument("--settle", action="store_true", help="import ptq first")
    args = parser.parse_args()
    code = CHILD.format(settle=args.settle, function=args.function)
    differed = []
    for _ in range(args.runs):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
        count, low, high = map(int, out)
        if count:
            differed.append((count, low, high))
    print(f"{args.function}, {'after importing ptq' if args.settle else 'torch alone'}: the first call differed from "
          f"the next ones in {len(differed)} of {args.runs} fresh processes")
    for count, low, high in differed:
        print(f"  {count} values, positions {low}-{high}")


if __name__ == "__main__":
    main()
