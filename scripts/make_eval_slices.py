"""Write the bundled evaluation slices (calib_data/slice-*.txt) from this machine's Python install.

    python scripts/make_eval_slices.py [--stdlib DIR] [--tokens 24000]

Every source is a file of CPython's standard library or its test suite, under the PSF
License Agreement (see calib_data/SOURCES.md); nothing is downloaded. Each slice is cut at
--tokens tokens of the bundled tokenizer (at a line end); documents are separated by a line
holding a form feed. Reruns on the same Python version give the same files.

- code: Python source of a fixed list of standard-library modules.
- json: JSON lines, one per function or class of another fixed list of modules: its name,
  arguments, defaults and docstring (read with `ast`, so the module is not imported).
- math: the numeric test vectors of `math` and `cmath` (Lib/test/math_testcases.txt,
  cmath_testcases.txt): function, argument, expected value and flags, one per line.

Not made here: a multilingual slice. The only non-English prose in the install is
Lib/test/cjkencodings (11 texts, 3,097 characters, about 6,700 tokens once deduplicated), under
the 20,000 tokens a slice needs; give a local file or a `datasets` name to `ptq eval --slices`.
"""

from __future__ import annotations

import argparse
import ast
import json
import sysconfig
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "calib_data"
SEPARATOR = "\n\f\n"
CODE_MODULES = ("textwrap.py", "fractions.py", "heapq.py", "bisect.py", "graphlib.py", "shlex.py", "statistics.py",
                "colorsys.py", "difflib.py")
JSON_MODULES = ("string.py", "csv.py", "calendar.py", "ipaddress.py", "datetime.py", "inspect.py", "pathlib.py",
                "typing.py")
MATH_FILES = ("test/math_testcases.txt", "test/cmath_testcases.txt")


def _cut(documents: list[str], tokenizer, limit: int) -> str:
    """The documents joined, up to the line where the bundled tokenizer reaches `limit` tokens."""
    kept, total = [], 0
    for document in documents:
        lines = []
        for line in document.splitlines(keepends=True):
            lines.append(line)
            total += len(tokenizer(line, add_special_tokens=False)["input_ids"])
            if total >= limit:
                break
        kept.append("".join(lines).rstrip("\n"))
        if total >= limit:
            return SEPARATOR.join(kept) + "\n"
    raise SystemExit(f"make_eval_slices: only {total} tokens, fewer than {limit}; add sources")


def _json_records(path: Path) -> str:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    lines = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        record = {"module": path.stem, "kind": "class" if isinstance(node, ast.ClassDef) else "function",
                  "name": node.name, "line": node.lineno}
        if isinstance(node, ast.ClassDef):
            record["bases"] = [ast.unparse(b) for b in node.bases]
        else:
            args = node.args
            record["args"] = [a.arg for a in args.posonlyargs + args.args + args.kwonlyargs]
            record["defaults"] = [ast.unparse(d) for d in args.defaults]
            record["returns"] = ast.unparse(node.returns) if node.returns else None
        doc = ast.get_docstring(node)
        record["doc"] = doc.split("\n\n")[0] if doc else None
        lines.append(json.dumps(record, ensure_ascii=False))
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stdlib", default=sysconfig.get_paths()["stdlib"], help="the standard library folder")
    parser.add_argument("--tokens", type=int, default=24_000, help="tokens per slice (bundled tokenizer)")
    args = parser.parse_args()
    from ptq.models import load_tokenizer

    tokenizer = load_tokenizer()
    stdlib = Path(args.stdlib)
    slices = {
        "code": [(stdlib / m).read_text(encoding="utf-8") for m in CODE_MODULES],
        "json": [_json_records(stdlib / m) for m in JSON_MODULES],
        "math": [(stdlib / f).read_text(encoding="utf-8") for f in MATH_FILES],
    }
    for name, documents in slices.items():
        path = OUT / f"slice-{name}.txt"
        path.write_text(_cut(documents, tokenizer, args.tokens), encoding="utf-8")
        print(f"wrote {path.relative_to(REPO)} ({path.stat().st_size:,} bytes)")


if __name__ == "__main__":
    main()
