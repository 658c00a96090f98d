"""ptq eval --slices: the bundled held-out slices, files as slices, and the per-slice table."""

from importlib import resources

import pytest

from ptq.cli import main
from ptq.models import load_tokenizer
from ptq.slices import BUNDLED, slice_texts


@pytest.mark.parametrize("name", sorted(BUNDLED))
def test_bundled_slices_hold_20k_tokens_and_are_documented(name):
    tokenizer = load_tokenizer()
    tokens = sum(len(tokenizer(t)["input_ids"]) for t in slice_texts(name))
    assert tokens >= 20_000
    sources = resources.files("ptq.calib_data").joinpath("SOURCES.md").read_text()
    assert (BUNDLED[name] or "eval.txt") in sources


def test_eval_slices_table(tmp_path, capsys):
    mine = tmp_path / "mine.txt"
    mine.write_text("\n\n".join(f"Paragraph {i}: the quick brown fox jumps over the lazy dog." for i in range(300)))
    code = main(["eval", "builtin", "--reference", "builtin", "--slices", "code", "json", "long", str(mine),
                 "--eval-windows", "2", "--eval-seq-len", "64", "--device", "cpu"])
    out = capsys.readouterr().out.splitlines()
    assert code == 0
    table = out[out.index(next(line for line in out if line.startswith("slice"))):]
    assert [line.split()[0] for line in table[2:]] == ["code", "json", "long", str(mine)]
    for line in table[2:]:
        assert line.split()[-2] == "0.00000" and line.split()[-1] == "100.00%"  # the model against itself
    assert table[4].split()[2] == "2048"  # long: the model's whole context


def test_unknown_slice_is_one_line(tmp_path, capsys):
    code = main(["eval", "builtin", "--slices", str(tmp_path / "missing.txt")])
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert code == 2 and len(err) == 1 and err[0].startswith("ptq: error: ")
