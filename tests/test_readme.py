"""The README's commands and its Python example are the ones that work."""

import re
from pathlib import Path

README = (Path(__file__).parent.parent / "README.md").read_text()


def code_blocks(language):
    return re.findall(rf"```{language}\n(.*?)```", README, flags=re.S)


def test_first_two_commands():
    first, second = code_blocks("bash")[:2]
    assert first.strip().startswith("pip install torch==2.13.0 && pip install -e . && ptq quantize --recipe recipes/")
    assert second.strip() == "pip install torch==2.13.0 && pip install -e '.[test]' && python -m pytest tests"
    ci = (Path(__file__).parent.parent / ".ci" / "run").read_text()
    assert second.strip() in ci
    recipe = re.search(r"--recipe (\S+)", first).group(1)
    assert (Path(__file__).parent.parent / recipe).is_file()


def test_python_example_runs(tmp_path, monkeypatch, capsys):
    (example,) = code_blocks("python")
    monkeypatch.chdir(tmp_path)
    exec(compile(example, "README.md", "exec"), {})
    out = capsys.readouterr().out
    before, after, kl = map(float, re.search(r"perplexity ([\d.]+) -> ([\d.]+), KL ([\d.]+)", out).groups())
    assert after >= before * 0.97 and kl > 0  # quantization costs something, and is measured
    assert (tmp_path / "tiny-w4a16" / "config.json").exists()
