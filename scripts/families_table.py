"""Print the README's table of supported model families, from what the tests cover.

The rows are `FAMILIES` of tests/test_families.py: a family is listed with the algorithms
it is quantized with there, each checked by saving, loading back with ptq.load (bit-exact)
and loading with transformers through compressed-tensors. Nothing else goes in the table.

    python scripts/families_table.py
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.test_families import ALGORITHMS, FAMILIES  # noqa: E402

NAMES = {"rtn": "RTN", "gptq": "GPTQ", "awq": "AWQ", "smoothquant": "SmoothQuant"}


SAYS = {"yes": "yes", "dequantized": "yes (dequantized on load)", "weights": "same weights (see notes)", "no": "no"}


def _transformers(family) -> str:
    if family.transformers_w8a8 == family.transformers:
        return SAYS[family.transformers]
    return f"{SAYS[family.transformers]}; W8A8: {SAYS[family.transformers_w8a8]}"


def families_table() -> str:
    """The markdown table: one row per family, a column per algorithm (✓ where tested)."""
    header = ["family", "transformers class", *(NAMES[a] for a in ALGORITHMS), "pairs per block",
              "loads in transformers", "notes"]
    rows = [header, ["---"] * len(header)]
    for family in FAMILIES:
        tested = ["✓" if algorithm in family.algorithms else "" for algorithm in ALGORITHMS]
        pairs = str(family.pairs) if {"awq", "smoothquant"} & set(family.algorithms) else ""
        rows.append([family.name, f"`{family.model_class}`", *tested, pairs, _transformers(family), family.note])
    return "\n".join("| " + " | ".join(row) + " |" for row in rows)


if __name__ == "__main__":
    print(families_table())
