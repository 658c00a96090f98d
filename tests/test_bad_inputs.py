"""Hostile input, as a new user gives it: every case gets exit status 2 (or ptq.PtqError
from the library), exactly one line `ptq: error: ...` on stderr naming the problem, no
traceback, no new file anywhere under the case's folder, and the source model unchanged.

Each case builds its inputs in its own folder (the working directory of the run) and
returns the command line; `{model}` is a small random Llama saved as a user's model
folder, shared by all cases and hashed before and after each one.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
from dataclasses import dataclass
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import ptq
from ptq.cli import main
from ptq.errors import PtqError
from tests.conftest import tiny_model

GPTQ = "calibration: {samples: 2, seq_len: 64}\nsteps:\n  - gptq: {scheme: W4A16}\n"


@pytest.fixture(scope="module")
def model_dir(user_model_dir):
    return user_model_dir


@pytest.fixture(scope="module")
def checkpoint_dir(tmp_path_factory, model_dir, tokenizer):
    """A valid ptq checkpoint of the random model, for the cases that break one."""
    path = tmp_path_factory.mktemp("ckpt") / "q"
    model, _ = ptq.load_model(model_dir)
    ptq.quantize(model, "W4A16", show_progress=False)
    model.config._name_or_path = ""  # saved from memory, not "from" the model folder
    ptq.save(model, path, tokenizer=tokenizer)
    return path


def tree(folder: Path) -> dict[str, str]:
    """Every file and folder below folder (hidden ones too), with file hashes."""
    found = {}
    for path in sorted(folder.rglob("*")):
        key = str(path.relative_to(folder))
        if path.is_symlink():
            found[key] = "link:" + os.readlink(path)
        elif path.is_file():
            found[key] = hashlib.sha256(path.read_bytes()).hexdigest()
        else:
            found[key] = "dir"
    return found


@dataclass
class Env:
    tmp: Path
    model: Path
    ckpt: Path

    def write(self, name: str, text: str | bytes) -> Path:
        path = self.tmp / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(text) if isinstance(text, bytes) else path.write_text(text)
        return path

    def model_copy(self, name: str = "m") -> Path:
        return Path(shutil.copytree(self.model, self.tmp / name))

    def ckpt_copy(self) -> Path:
        return Path(shutil.copytree(self.ckpt, self.tmp / "ck"))

    def edit_json(self, path: Path, change: Callable[[dict], None]) -> None:
        data = json.loads(path.read_text())
        change(data)
        path.write_text(json.dumps(data))


def quantize(*extra) -> list[str]:
    return ["quantize", *extra]


# -- model folders -------------------------------------------------------------------------

def truncated_weights(e: Env):
    m = e.model_copy()
    data = (m / "model.safetensors").read_bytes()
    (m / "model.safetensors").write_bytes(data[: len(data) // 2])
    return quantize("--recipe", "W4A16", "--model", m, "--output", "o")


def random_weights(e: Env):
    m = e.model_copy()
    (m / "model.safetensors").write_bytes(os.urandom(4096))
    return quantize("--recipe", "W4A16", "--model", m, "--output", "o")


def huge_header(e: Env):
    m = e.model_copy()
    (m / "model.safetensors").write_bytes(struct.pack("<Q", 2**60) + b"{}")
    return quantize("--recipe", "W4A16", "--model", m, "--output", "o")


def index_escaping(path_in_index: str):
    def case(e: Env):
        m = e.model_copy()
        (m / "model.safetensors").rename(m / "model-00001-of-00001.safetensors")  # a sharded model
        index = {"metadata": {}, "weight_map": {"model.embed_tokens.weight": path_in_index}}
        (m / "model.safetensors.index.json").write_text(json.dumps(index))
        return quantize("--recipe", "W4A16", "--model", m, "--output", "o")

    return case


def custom_code(e: Env):
    m = e.model_copy()
    e.edit_json(m / "config.json", lambda c: c.update(auto_map={"AutoConfig": "evil.EvilConfig"}))
    (m / "evil.py").write_text(f"open({str(e.tmp / 'RAN')!r}, 'w').write('ran')\n")
    return quantize("--recipe", "W4A16", "--model", m, "--output", "o")


def config_edit(change: Callable[[dict], None]):
    def case(e: Env):
        m = e.model_copy()
        e.edit_json(m / "config.json", change)
        return quantize("--recipe", "W4A16", "--model", m, "--output", "o")

    return case


def config_text(text: str):
    def case(e: Env):
        m = e.model_copy()
        (m / "config.json").write_text(text)
        return quantize("--recipe", "W4A16", "--model", m, "--output", "o")

    return case


def no_tokenizer(e: Env):
    m = e.model_copy()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (m / name).unlink()
    return quantize("--recipe", "W4A16", "--model", m, "--output", "o")


def nan_weights(e: Env):
    model = tiny_model("llama")
    with torch.no_grad():
        model.model.layers[1].mlp.up_proj.weight[3, 5] = float("inf")
    model.save_pretrained(e.tmp / "nan")
    shutil.copy(e.model / "tokenizer.json", e.tmp / "nan")
    shutil.copy(e.model / "tokenizer_config.json", e.tmp / "nan")
    return quantize("--recipe", "W4A16", "--model", e.tmp / "nan", "--output", "o")


# -- recipes -------------------------------------------------------------------------------

def recipe(text: str | bytes, *extra):
    def case(e: Env):
        path = e.write("r.yaml", text)
        return quantize("--recipe", path, "--model", e.model, "--output", "o", *extra)

    return case


BOMB = "a: &a [x,x,x,x,x,x,x,x,x]\n" + "".join(
    f"{chr(98 + i)}: &{chr(98 + i)} [{','.join([f'*{chr(97 + i)}'] * 9)}]\n" for i in range(8)
) + "steps: [rtn: {scheme: *i}]\n"


# -- calibration data ----------------------------------------------------------------------

def data(name: str, content: str | bytes | None):
    def case(e: Env):
        path = e.write(name, content) if content is not None else e.tmp / name
        return quantize("--recipe", e.write("r.yaml", GPTQ), "--model", e.model, "--data", path, "--output", "o")

    return case


def jsonl(*rows):
    return "".join(json.dumps(r) + "\n" for r in rows)


# -- outputs -------------------------------------------------------------------------------

def output_is(setup: Callable[[Env], Path], *extra):
    def case(e: Env):
        out = setup(e)
        return quantize("--recipe", "W4A16", "--model", e.model, "--output", out, "--overwrite", *extra)

    return case


def holding_model(e: Env) -> Path:
    """A project folder holding the source model and other work: --output . would wipe it."""
    project = e.tmp / "project"
    shutil.copytree(e.model, project / "models" / "tiny")
    (project / "notes.txt").write_text("mine")
    return project


def contains_source(e: Env):
    project = holding_model(e)
    return quantize("--recipe", "W4A16", "--model", project / "models" / "tiny", "--output", project, "--overwrite")


def symlink_to_folder(e: Env) -> Path:
    target = e.tmp / "real"
    target.mkdir()
    (target / "keep.txt").write_text("keep")
    (e.tmp / "link").symlink_to(target)
    return e.tmp / "link"


def with_foreign_file(e: Env) -> Path:
    out = e.tmp / "out"
    shutil.copytree(e.ckpt, out)
    (out / "my-notes.txt").write_text("mine")
    return out


def stale_work_folder(e: Env):
    work = e.tmp / ".o.ptq-partial"
    work.mkdir()
    (work / "lock").write_text("12345\n")
    return quantize("--recipe", "W4A16", "--model", e.model, "--output", "o")


def locked_by_another_run(e: Env):
    from ptq.checkpoint.output import claim_output

    e.held = claim_output(e.tmp / "o")  # held by this process, as another run would hold it
    e.held.__enter__()
    return quantize("--recipe", "W4A16", "--model", e.model, "--output", "o")


# -- checkpoints given to `ptq eval` ---------------------------------------------------------

def ckpt(change: Callable[[Env, Path], None]):
    def case(e: Env):
        path = e.ckpt_copy()
        change(e, path)
        return ["eval", path, "--eval-windows", "1", "--eval-seq-len", "32"]

    return case


def qconfig(change: Callable[[dict], None]):
    return ckpt(lambda e, p: e.edit_json(p / "config.json", lambda c: change(c["quantization_config"])))


def group0(change: Callable[[dict], None]):
    return qconfig(lambda q: change(q["config_groups"]["group_0"]["weights"]))


def replace_tensor(name: str, make: Callable[[torch.Tensor], torch.Tensor]):
    def change(e: Env, path: Path):
        from safetensors.torch import load_file, save_file

        tensors = load_file(path / "model.safetensors")
        tensors[name] = make(tensors[name])
        save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})

    return ckpt(change)


Q = "model.layers.0.self_attn.q_proj"

CLI_CASES: dict[str, tuple[Callable[[Env], list], str]] = {
    # model folders
    "model missing": (lambda e: quantize("--recipe", "W4A16", "--model", e.tmp / "nope", "--output", "o"), "does not exist"),
    "model folder empty": (lambda e: quantize("--recipe", "W4A16", "--model", e.write("d/x", "") .parent, "--output", "o"), "no config.json"),
    "config not JSON": (config_text("{oops"), "config.json"),
    "config a list": (config_text("[1, 2]"), "config.json"),
    "unknown model_type": (config_edit(lambda c: c.update(model_type="nonesuch")), "nonesuch"),
    "weights truncated": (truncated_weights, "model.safetensors"),
    "weights random bytes": (random_weights, "model.safetensors"),
    "weights huge header": (huge_header, "model.safetensors"),
    "index absolute path": (index_escaping("/etc/passwd"), "index.json"),
    "index parent path": (index_escaping("../../outside.safetensors"), "index.json"),
    "custom code without trust": (custom_code, "--trust-remote-code"),
    "no tokenizer": (no_tokenizer, "tokenizer"),
    "inf weights": (nan_weights, "contains NaN or Inf"),
    # recipes
    "recipe missing": (lambda e: quantize("--recipe", e.tmp / "none.yaml", "--model", e.model, "--output", "o"), "not found"),
    "recipe is a folder": (lambda e: quantize("--recipe", e.write("rd/x", "").parent, "--model", e.model, "--output", "o"), "rd"),
    "recipe bad YAML": (recipe("steps: [rtn: {scheme: W4A16}\n"), "not valid YAML"),
    "recipe not UTF-8": (recipe(b"steps:\n  - rtn: {scheme: \xff\xfe}\n"), "r.yaml"),
    "recipe empty": (recipe(""), "r.yaml"),
    "recipe unknown key": (recipe("steps:\n  - rtn: {scheme: W4A16, groupsize: 64}\n"), "unknown key 'groupsize'"),
    "recipe unknown step": (recipe("steps:\n  - magic: {}\n"), "unknown step 'magic'"),
    "recipe 1 bit": (recipe("steps:\n  - rtn: {scheme: {weights: {num_bits: 1, strategy: channel}}}\n"), "num_bits"),
    "recipe 9 bits": (recipe("steps:\n  - rtn: {scheme: {weights: {num_bits: 9, strategy: channel}}}\n"), "num_bits"),
    "recipe bad regex": (recipe("steps:\n  - rtn: {scheme: W4A16, targets: ['re:(']}\n"), "re:("),
    "recipe seed 1e23": (recipe("calibration: {seed: 1e23}\nsteps:\n  - gptq: {scheme: W4A16}\n"), "seed"),
    "recipe huge seed": (recipe("calibration: {seed: 100000000000000000000000}\nsteps:\n  - gptq: {scheme: W4A16}\n"), "seed"),
    "recipe samples 1e9": (recipe("calibration: {samples: 1000000000}\nsteps:\n  - gptq: {scheme: W4A16}\n"), "samples"),
    "recipe seq_len 0": (recipe("calibration: {seq_len: 0}\nsteps:\n  - gptq: {scheme: W4A16}\n"), "seq_len"),
    "recipe alias bomb": (recipe(BOMB), "alias"),
    "recipe a list": (recipe("- rtn: {scheme: W4A16}\n"), "mapping"),
    "recipe two weight steps": (recipe("steps:\n  - rtn: {scheme: W4A16}\n  - rtn: {scheme: W8A16}\n"), "exactly one weight step"),
    "group size does not divide": (recipe("steps:\n  - rtn: {scheme: {weights: {num_bits: 4, group_size: 96}}}\n"), "group_size 96 does not divide"),
    "targets match nothing": (recipe("steps:\n  - rtn: {scheme: W4A16, targets: [Conv2d]}\n"), "no Linear matches"),
    "mapping names a missing module": (recipe(
        "calibration: {samples: 2, seq_len: 64}\nsteps:\n  - smoothquant: {mappings: [{smooth: input_layernorm, "
        "balance: [self_attn.q_prj], inspect: self_attn}]}\n  - rtn: {scheme: W8A8}\n"), "q_prj"),
    "preset unknown": (lambda e: quantize("--recipe", "W5A16", "--model", e.model, "--output", "o"), "W5A16"),
    # calibration data
    "data missing file": (data("none.txt", None), "none.txt"),
    "data empty file": (data("empty.txt", ""), "empty.txt"),
    "data only blank lines": (data("blank.txt", "\n\n   \n\n"), "blank.txt"),
    "data not UTF-8": (data("latin.txt", "caf\xe9 au lait\n".encode("latin-1") * 200), "UTF-8"),
    "data too short": (data("short.txt", "Too short to fill one sample.\n"), "seq_len=64"),
    "data jsonl null text": (data("n.jsonl", jsonl({"text": "fine text"}, {"text": None})), "n.jsonl:2"),
    "data jsonl number text": (data("k.jsonl", jsonl({"text": 12345})), "k.jsonl:1"),
    "data jsonl not JSON": (data("b.jsonl", "{not json}\n"), "b.jsonl:1"),
    "data jsonl no column": (data("c.jsonl", jsonl({"content": "x"})), "text"),
    # outputs
    "output exists": (lambda e: quantize("--recipe", "W4A16", "--model", e.model, "--output", e.write("o/x", "").parent), "already exists"),
    "output is the source": (lambda e: quantize("--recipe", "W4A16", "--model", e.model, "--output", e.model, "--overwrite"), "source model"),
    "output inside the source": (lambda e: quantize("--recipe", "W4A16", "--model", e.model, "--output", e.model / "q", "--overwrite"), "source model"),
    "output contains the source": (contains_source, "contains the source model"),
    "output is a file": (output_is(lambda e: e.write("file.bin", "mine")), "is a file"),
    "output is a symlink": (output_is(symlink_to_folder), "symbolic link"),
    "output holds foreign files": (output_is(with_foreign_file), "my-notes.txt"),
    "output parent missing": (lambda e: quantize("--recipe", "W4A16", "--model", e.model, "--output", e.tmp / "no" / "o"), "does not exist"),
    "stale work folder": (stale_work_folder, "--resume"),
    "another run holds the output": (locked_by_another_run, "another ptq run"),
    "report-json is a folder": (lambda e: quantize("--recipe", "W4A16", "--model", e.model, "--output", "o", "--report-json", e.write("rj/x", "").parent), "is a folder"),
    "report-json parent missing": (lambda e: quantize("--recipe", "W4A16", "--model", e.model, "--output", "o", "--report-json", e.tmp / "no" / "r.json"), "does not exist"),
    # options
    "eval-seq-len 0": (lambda e: quantize("--recipe", "W4A16", "--model", e.model, "--output", "o", "--eval-seq-len", "0"), "--eval-seq-len"),
    "eval-windows -1": (lambda e: quantize("--recipe", "W4A16", "--model", e.model, "--output", "o", "--eval-windows", "-1"), "--eval-windows"),
    "eval-windows not a number": (lambda e: quantize("--recipe", "W4A16", "--model", e.model, "--output", "o", "--eval-windows", "many"), "not a whole number"),
    "eval-seq-len beyond context": (lambda e: quantize("--recipe", "W4A16", "--model", e.model, "--output", "o", "--eval-seq-len", "4096", "--eval-windows", "1"), "positions"),
    "eval-text missing": (lambda e: quantize("--recipe", "W4A16", "--model", e.model, "--output", "o", "--eval-text", e.tmp / "none.txt"), "none.txt"),
    "device foo": (lambda e: quantize("--recipe", "W4A16", "--model", e.model, "--output", "o", "--device", "foo"), "not a device name"),
    "device meta": (lambda e: quantize("--recipe", "W4A16", "--model", e.model, "--output", "o", "--device", "meta"), "meta"),
    "unknown option": (lambda e: quantize("--recipe", "W4A16", "--bogus"), "--bogus"),
    "no recipe": (lambda e: quantize("--model", e.model), "--recipe"),
    "unknown command": (lambda e: ["quantise"], "quantise"),
    # checkpoints given to ptq eval
    "eval path missing": (lambda e: ["eval", e.tmp / "nope"], "does not exist"),
    "ckpt config not JSON": (ckpt(lambda e, p: (p / "config.json").write_text("{oops")), "config.json"),
    "ckpt no config_groups": (qconfig(lambda q: q.pop("config_groups")), "config_groups"),
    "ckpt empty config_groups": (qconfig(lambda q: q.update(config_groups={})), "config_groups"),
    "ckpt num_bits changed": (group0(lambda w: w.update(num_bits=8)), "weight_packed"),
    "ckpt num_bits invalid": (group0(lambda w: w.update(num_bits=99)), "num_bits"),
    "ckpt group_size changed": (group0(lambda w: w.update(group_size=64)), "weight_scale"),
    "ckpt tensor shape changed": (replace_tensor(f"{Q}.weight_packed", lambda t: t[:-1].clone()), "weight_packed"),
    "ckpt NaN scale": (replace_tensor(f"{Q}.weight_scale", lambda t: t.index_fill(0, torch.tensor([0]), float("nan"))), "NaN"),
    "ckpt Inf norm": (replace_tensor("model.norm.weight", lambda t: t.index_fill(0, torch.tensor([0]), float("inf"))), "model.norm.weight"),
    "ckpt truncated weights": (ckpt(lambda e, p: (p / "model.safetensors").write_bytes((p / "model.safetensors").read_bytes()[:1000])), "model.safetensors"),
    "ckpt missing tokenizer": (ckpt(lambda e, p: [(p / n).unlink() for n in ("tokenizer.json", "tokenizer_config.json")]), "tokenizer"),
    "ckpt unknown format": (qconfig(lambda q: q["config_groups"]["group_0"].update(format="marlin-24")), "marlin-24"),
}

if not torch.cuda.is_available():
    CLI_CASES["device cuda without a GPU"] = (
        lambda e: quantize("--recipe", "W4A16", "--model", e.model, "--output", "o", "--device", "cuda"), "no cuda device")


@pytest.fixture
def env(tmp_path, model_dir, checkpoint_dir, monkeypatch):
    folder = tmp_path / "case"
    folder.mkdir()
    monkeypatch.chdir(folder)
    e = Env(folder, model_dir, checkpoint_dir)
    yield e
    if hasattr(e, "held"):
        e.held.__exit__(None, None, None)


def assert_refused(env: Env, run: Callable[[], None], capsys) -> str:
    """Run, and check the promise: nothing new anywhere, the source untouched; stderr."""
    sources = tree(env.model), tree(env.ckpt)
    before = tree(env.tmp)
    capsys.readouterr()  # what the case's setup printed
    run()
    assert tree(env.tmp) == before, "files appeared, changed or disappeared"
    assert (tree(env.model), tree(env.ckpt)) == sources, "the source model changed"
    return capsys.readouterr().err


@pytest.mark.parametrize("case", CLI_CASES)
def test_cli_refuses(case, env, capsys):
    build, message = CLI_CASES[case]
    argv = [str(a) for a in build(env)]
    codes = []
    err = assert_refused(env, lambda: codes.append(main(argv)), capsys)
    assert codes == [2], err
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("ptq: error: "), err
    assert message in lines[0], lines[0]
    assert len(lines[0]) < 400, "echoes too much"
    assert not (env.tmp / "RAN").exists(), "the model folder's own code ran"


# -- the library: each case prepares its files, then returns the call that must refuse -------

def api_quantize(**kwargs):
    def case(e: Env):
        recipe = kwargs.pop("recipe", e.write("r.yaml", GPTQ))
        model, tokenizer = ptq.load_model(e.model)
        kwargs.setdefault("tokenizer", tokenizer)
        return lambda: ptq.quantize(model, recipe, show_progress=False, **kwargs)

    return case


def api_save(where: Callable[[Env], Path], overwrite: bool = True):
    def case(e: Env):
        model, _ = ptq.load_model(e.model)
        ptq.quantize(model, "W8A16", show_progress=False)
        path = where(e)
        return lambda: ptq.save(model, path, overwrite=overwrite)

    return case


def api_load_truncated(e: Env):
    path = e.ckpt_copy()
    (path / "model.safetensors").write_bytes(b"\x08" + bytes(7) + b"{}x")
    return lambda: ptq.load(path)


def api_custom_code(e: Env):
    custom_code(e)
    return lambda: ptq.load_model(e.tmp / "m")


API_CASES: dict[str, tuple[Callable[[Env], Callable[[], object]], str]] = {
    "load_recipe(123)": (lambda e: lambda: ptq.load_recipe(123), "recipe"),
    "quantize recipe=123": (lambda e: lambda: ptq.quantize(tiny_model(), 123), "recipe"),
    "quantize recipe=None": (lambda e: lambda: ptq.quantize(tiny_model(), None), "recipe"),
    "empty data list": (api_quantize(data=[]), "calibration data"),
    "empty token tensor": (api_quantize(data=torch.zeros(0, 64, dtype=torch.long)), "calibration data"),
    "out-of-vocab token ids": (api_quantize(data=torch.full((2, 64), 5000)), "5000"),
    "negative token ids": (api_quantize(data=torch.full((2, 64), -1)), "-1"),
    "float token tensors": (api_quantize(data=torch.rand(2, 64) * 100), "float"),
    "mixed data list": (api_quantize(data=["some text", torch.zeros(64, dtype=torch.long)]), "calibration data"),
    "texts without a tokenizer": (api_quantize(data=["text"] * 3, tokenizer=None), "tokenizer"),
    "save into the source folder": (api_save(lambda e: e.model), "source model"),
    "save over a folder holding the source": (api_save(lambda e: e.model.parent), "source model"),
    "save onto a file": (api_save(lambda e: e.write("f.bin", "mine")), "is a file"),
    "save over foreign files": (api_save(with_foreign_file), "my-notes.txt"),
    "save an unquantized model": (lambda e: lambda: ptq.save(tiny_model(), e.tmp / "o"), "no quantized Linear"),
    "load a missing checkpoint": (lambda e: lambda: ptq.load(e.tmp / "nope"), "nope"),
    "load a truncated checkpoint": (api_load_truncated, "model.safetensors"),
    "load with a bad backend": (lambda e: lambda: ptq.load(e.ckpt, backend="cuda"), "backend"),
    "load_model of a folder with custom code": (api_custom_code, "trust_remote_code"),
    "eval_windows of seq_len 1": (lambda e: lambda: ptq.eval_windows(ptq.load_model(e.model)[1], seq_len=1), "seq_len"),
}


@pytest.mark.parametrize("case", API_CASES)
def test_api_refuses(case, env, capsys):
    prepare, message = API_CASES[case]
    call = prepare(env)
    raised = []

    def run():
        try:
            call()
        except PtqError as error:
            raised.append(str(error))

    assert_refused(env, run, capsys)
    assert raised, "no PtqError"
    assert message in raised[0] and "\n" not in raised[0], raised[0]
    assert not (env.tmp / "RAN").exists(), "the model folder's own code ran"


def test_there_are_at_least_60_cases():
    assert len(CLI_CASES) + len(API_CASES) >= 60
