"""Write the bundled evaluation slices (calib_data/slice-*.txt) from this machine's Python install.

    python scripts/make_eval_slices.py [--stdlib DIR] [--tokens 24000] [--edu-doc DIR] [--only SLICE ...]

The code, json and math sources are files of CPython's standard library or its test suite,
under the PSF License Agreement (see calib_data/SOURCES.md); nothing is downloaded. Each slice is cut at
--tokens tokens of the bundled tokenizer (at a line end); documents are separated by a line
holding a form feed. Reruns on the same Python version give the same files.

- code: Python source of a fixed list of standard-library modules.
- json: JSON lines, one per function or class of another fixed list of modules: its name,
  arguments, defaults and docstring (read with `ast`, so the module is not imported).
- math: the numeric test vectors of `math` and `cmath` (Lib/test/math_testcases.txt,
  cmath_testcases.txt): function, argument, expected value and flags, one per line.

- multilingual (with --edu-doc): German, Spanish, French and Japanese prose, a quarter of the
  tokens each, from the Debian Edu 12 manual's translations (Debian packages
  debian-edu-doc-{de,es,fr,ja}, GPL-2+; see calib_data/SOURCES.md for the commands). The
  standard library's only non-English prose, Lib/test/cjkencodings, holds about 6,700 tokens.
"""

from __future__ import annotations

import argparse
import ast
import json
import sysconfig
from html.parser import HTMLParser
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "calib_data"
SEPARATOR = "\n\f\n"
CODE_MODULES = ("textwrap.py", "fractions.py", "heapq.py", "bisect.py", "graphlib.py", "shlex.py", "statistics.py",
                "colorsys.py", "difflib.py")
JSON_MODULES = ("string.py", "csv.py", "calendar.py", "ipaddress.py", "datetime.py", "inspect.py", "pathlib.py",
                "typing.py")
MATH_FILES = ("test/math_testcases.txt", "test/cmath_testcases.txt")
EDU_LANGUAGES = ("de", "es", "fr", "ja")  # the Debian Edu bookworm manual's translations (GPL-2+)
EDU_MANUAL = "usr/share/doc/debian-edu-doc-{lang}/debian-edu-bookworm-manual.html"


class _Paragraphs(HTMLParser):
    """The text of every <p> element, whitespace collapsed."""

    def __init__(self):
        super().__init__()
        self.paragraphs: list[str] = []
        self._open: list[str] | None = None

    def handle_starttag(self, tag, attrs):
        if tag == "p":
            self._open = []

    def handle_endtag(self, tag):
        if tag == "p" and self._open is not None:
            text = " ".join("".join(self._open).split())
            if len(text) >= 40:  # prose, not captions and menu paths
                self.paragraphs.append(text)
            self._open = None

    def handle_data(self, data):
        if self._open is not None:
            self._open.append(data)


def _manual_paragraphs(path: Path) -> str:
    parser = _Paragraphs()
    parser.feed(path.read_text(encoding="utf-8"))
    return "\n".join(parser.paragraphs)


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
    parser.add_argument("--edu-doc", type=Path, default=None,
                        help="a folder holding the extracted debian-edu-doc-{de,es,fr,ja} packages (apt-get download "
                             "debian-edu-doc-de ...; dpkg-deb -x each into it): writes the multilingual slice")
    parser.add_argument("--only", nargs="*", default=None, help="write only these slices")
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
        if args.only is not None and name not in args.only:
            continue
        path = OUT / f"slice-{name}.txt"
        path.write_text(_cut(documents, tokenizer, args.tokens), encoding="utf-8")
        print(f"wrote {path.relative_to(REPO)} ({path.stat().st_size:,} bytes)")
    if args.edu_doc is not None:  # a quarter of the tokens from each language
        parts = [_cut([_manual_paragraphs(args.edu_doc / EDU_MANUAL.format(lang=lang))], tokenizer, args.tokens // 4)
                 for lang in EDU_LANGUAGES]
        path = OUT / "slice-multilingual.txt"
        path.write_text(SEPARATOR.join(part.rstrip("\n") for part in parts) + "\n", encoding="utf-8")
        print(f"wrote {path.relative_to(REPO)} ({path.stat().st_size:,} bytes)")


if __name__ == "__main__":
    main()
