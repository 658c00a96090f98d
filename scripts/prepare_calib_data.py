"""Build calib_data/ from the reStructuredText sources of the Python documentation.

Source: Debian's ``python3.11-doc`` package (PSF licence), which ships the documentation's
reStructuredText sources under ``/usr/share/doc/python3.11/html/_sources``.

    apt-get download python3.11-doc && dpkg-deb -x python3.11-doc_*.deb /tmp/pydoc
    python scripts/prepare_calib_data.py /tmp/pydoc/usr/share/doc/python3.11/html/_sources

Only prose paragraphs are kept (directives, code blocks, tables and headings are dropped,
inline roles are reduced to their text). Whole source files go either to the calibration
part or to the held-out evaluation part, chosen by a hash of the file's relative path. The
documentation repeats some paragraphs across files, so held-out paragraphs that also occur
in the calibration part are dropped: the two parts never share a paragraph.
"""

from __future__ import annotations

import argparse
import hashlib
import re
from pathlib import Path

EVAL_PERCENT = 10  # share of source files held out for evaluation
ROLE = re.compile(r":[a-zA-Z:+-]+:`!?~?([^`<]*?)(?:\s*<[^`]*>)?`")
LINK = re.compile(r"`([^`<]+?)\s*<[^`]*>`_+")
LITERAL = re.compile(r"``([^`]+)``")
REFERENCE = re.compile(r"`([^`]+)`_*")
EMPHASIS = re.compile(r"\*{1,2}([^*\s][^*]*?)\*{1,2}")


def clean_inline(text: str) -> str:
    text = ROLE.sub(r"\1", text)
    text = LINK.sub(r"\1", text)
    text = LITERAL.sub(r"\1", text)
    text = REFERENCE.sub(r"\1", text)
    text = EMPHASIS.sub(r"\1", text)
    return re.sub(r"\s+", " ", text).strip()


def is_prose(paragraph: list[str]) -> bool:
    first = paragraph[0]
    if first.startswith((" ", "\t", "..", "|", "+-", "=", "-", "*", ">>>", ":")):
        return False
    if len(paragraph) >= 2 and set(paragraph[1].strip()) <= set("=-~^*#\"'`+"):
        return False  # a heading
    text = " ".join(paragraph)
    return len(text) >= 80 and sum(c.isalpha() for c in text) / len(text) > 0.6


def prose_paragraphs(source: str) -> list[str]:
    paragraphs, current = [], []
    for line in source.splitlines() + [""]:
        if line.strip():
            current.append(line.rstrip())
            continue
        if current and is_prose(current):
            text = clean_inline(" ".join(current))
            if text.endswith("::"):
                text = text[:-1]
            paragraphs.append(text)
        current = []
    return paragraphs


def is_held_out(relative_path: str) -> bool:
    digest = hashlib.sha256(relative_path.encode()).digest()
    return digest[0] * 100 // 256 < EVAL_PERCENT


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sources", type=Path, help="the html/_sources folder of python3.11-doc")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent.parent / "calib_data")
    args = parser.parse_args()

    parts: dict[str, list[str]] = {"calib": [], "eval": []}
    for path in sorted(args.sources.rglob("*.rst.txt")):
        relative = path.relative_to(args.sources).as_posix()
        part = "eval" if is_held_out(relative) else "calib"
        parts[part].extend(prose_paragraphs(path.read_text(encoding="utf-8")))
    seen = set(parts["calib"])
    parts["eval"] = [p for p in parts["eval"] if p not in seen]
    args.out.mkdir(parents=True, exist_ok=True)
    for part, paragraphs in parts.items():
        text = "\n\n".join(paragraphs) + "\n"
        (args.out / f"{part}.txt").write_text(text, encoding="utf-8")
        print(f"{part}.txt: {len(paragraphs)} paragraphs, {len(text.encode()) / 1e6:.2f} MB")


if __name__ == "__main__":
    main()
