"""ptq.push_to_hub and `ptq push`: huggingface_hub's real client against a local endpoint
(tests/export/local_hub.py). What arrives is the checkpoint's files, byte for byte, with
the commit message, visibility and branch asked for; what cannot work fails in one line."""

import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from huggingface_hub import constants

import ptq
from ptq.cli import main
from ptq.errors import PtqError
from ptq.export.hub import OFFLINE
from tests.conftest import tiny_model
from tests.export.local_hub import LocalHub

TOKEN = "hf_local_test_token"
REPO = "me/tiny-w8a16"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, tokenizer):
    """A small ptq checkpoint (1.6 MB: no LFS needed), written once."""
    model = ptq.quantize(tiny_model(), "W8A16", show_progress=False)
    return ptq.save(model, tmp_path_factory.mktemp("ckpt") / "tiny-w8a16", tokenizer=tokenizer)


@pytest.fixture
def hub(monkeypatch, tmp_path_factory):
    """The local endpoint, set where huggingface_hub reads it, the token in HF_TOKEN, and
    huggingface_hub's files (Xet logs, the agent registry) in a temporary HF_HOME."""
    home = tmp_path_factory.mktemp("hf_home")
    monkeypatch.setenv("HF_HOME", str(home))  # read by hf_xet when its session starts, and by subprocesses
    monkeypatch.setattr(constants, "AGENT_HARNESSES_PATH", str(home / ".agent_harnesses.json"))
    with LocalHub(TOKEN) as local:
        monkeypatch.setenv("HF_ENDPOINT", local.url)  # for subprocesses: huggingface_hub reads it on import
        monkeypatch.setattr(constants, "ENDPOINT", local.url)  # this process imported it already
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
        monkeypatch.setenv("HF_TOKEN", TOKEN)
        yield local
        assert local.errors == [] and local.unknown == []


def folder_files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def one_error_line(capsys, argv) -> str:
    code = main([str(a) for a in argv])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip() and "it/s]" not in line]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("ptq: error: ") and "Traceback" not in err, err
    return lines[0]


def free_port() -> int:
    """A port nobody listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_push_uploads_the_checkpoint_byte_for_byte(hub, checkpoint):
    url = ptq.push_to_hub(checkpoint, REPO, private=True, commit_message="W8A16 of the tiny Llama")
    (commit,) = hub.commits
    assert url == f"{hub.url}/{REPO}/commit/{commit.oid}"
    assert commit.files == folder_files(checkpoint)
    assert sorted(commit.files) == sorted(["README.md", "config.json", "generation_config.json", "model.safetensors",
                                           "ptq.json", "recipe.yaml", "tokenizer.json", "tokenizer_config.json"])
    assert (commit.repo, commit.branch, commit.summary) == (REPO, "main", "W8A16 of the tiny Llama")
    assert hub.created == [{"name": "tiny-w8a16", "organization": "me", "visibility": "private"}]
    assert hub.repos[REPO].private
    assert hub.validated == [(checkpoint / "README.md").read_text()]  # the card's front matter, checked first
    assert hub.branches_created == []


def test_push_to_a_branch_creates_it_once(hub, checkpoint):
    first = ptq.push_to_hub(checkpoint, REPO, revision="w8a16")
    second = ptq.push_to_hub(checkpoint, REPO, revision="w8a16", commit_message="again")
    assert hub.branches_created == [(REPO, "w8a16", None)]  # from main, and only when missing
    assert [c.branch for c in hub.commits] == ["w8a16", "w8a16"]
    assert hub.commits[0].summary == "Upload tiny-w8a16 (quantized with ptq)"  # the default message
    assert hub.commits[1].summary == "again" and first != second
    assert hub.files(REPO, "w8a16") == folder_files(checkpoint) and hub.files(REPO, "main") == {}
    # without private, visibility is the Hub's default for the namespace; the second create is a 409, accepted
    assert hub.created == [{"name": "tiny-w8a16", "organization": "me"}] * 2 and not hub.repos[REPO].private


def test_cli_push(hub, checkpoint, capsys):
    code = main(["push", str(checkpoint), "--repo-id", REPO, "--private", "--revision", "int8",
                 "--commit-message", "from the CLI"])
    out = capsys.readouterr().out
    (commit,) = hub.commits
    assert code == 0 and out.strip() == f"pushed {checkpoint} to {hub.url}/{REPO}/commit/{commit.oid}"
    assert (commit.branch, commit.summary) == ("int8", "from the CLI") and hub.repos[REPO].private
    assert commit.files == folder_files(checkpoint)


def test_quantize_then_push(hub, user_model_dir, tmp_path, capsys):
    out = tmp_path / "q"
    code = main(["quantize", "--recipe", "W4A16", "--model", user_model_dir, "--output", out, "--no-eval",
                 "--push-to-hub", "me/q"])
    stdout = capsys.readouterr().out
    (commit,) = hub.commits
    assert code == 0 and f"pushed {out} to {hub.url}/me/q/commit/{commit.oid}" in stdout
    assert commit.files == folder_files(out) and "README.md" in commit.files


def test_cli_push_in_a_fresh_process_reads_hf_endpoint_and_hf_token(hub, checkpoint):
    """huggingface_hub reads HF_ENDPOINT when imported: a new process sees the variables as users set them."""
    env = {**os.environ, "HF_ENDPOINT": hub.url, "HF_TOKEN": TOKEN, "HF_HUB_OFFLINE": "0"}
    run = subprocess.run([sys.executable, "-m", "ptq", "push", str(checkpoint), "--repo-id", REPO],
                         env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    (commit,) = hub.commits
    assert commit.files == folder_files(checkpoint)


def test_hf_hub_offline_in_a_fresh_process(hub, checkpoint):
    env = {**os.environ, "HF_ENDPOINT": hub.url, "HF_TOKEN": TOKEN, "HF_HUB_OFFLINE": "1"}
    run = subprocess.run([sys.executable, "-m", "ptq", "push", str(checkpoint), "--repo-id", REPO],
                         env=env, capture_output=True, text=True, timeout=300)
    lines = [line for line in run.stderr.splitlines() if line.strip()]
    assert run.returncode == 2 and len(lines) == 1, run.stderr
    assert lines[0] == f"ptq: error: {OFFLINE}"
    assert hub.requests == []


def test_an_endpoint_nobody_listens_on(hub, checkpoint, monkeypatch, capsys):
    endpoint = f"http://127.0.0.1:{free_port()}"
    monkeypatch.setattr(constants, "ENDPOINT", endpoint)
    with pytest.raises(PtqError, match=rf"^cannot reach the Hugging Face Hub at {endpoint}: .+; check the network, "
                                       r"HF_ENDPOINT or HF_HUB_OFFLINE$"):
        ptq.push_to_hub(checkpoint, REPO)
    line = one_error_line(capsys, ["push", checkpoint, "--repo-id", REPO])
    assert line.startswith(f"ptq: error: cannot reach the Hugging Face Hub at {endpoint}: ")


def test_a_failed_push_after_quantize_keeps_the_checkpoint(hub, user_model_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{free_port()}")
    out = tmp_path / "q"
    line = one_error_line(capsys, ["quantize", "--recipe", "W4A16", "--model", user_model_dir, "--output", out,
                                   "--no-eval", "--push-to-hub", "me/q"])
    assert "cannot reach the Hugging Face Hub" in line
    assert line.endswith(f"(the checkpoint is written in '{out}': push it with ptq push {out} --repo-id me/q)")
    assert (out / "ptq.json").is_file() and (out / "README.md").is_file()


def test_a_refused_token_says_how_to_log_in(hub, checkpoint, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_wrong")
    with pytest.raises(PtqError, match=r"did not accept the token \(Invalid credentials in Authorization header\): "
                                       r"set HF_TOKEN to a token with write access, or run `hf auth login`$"):
        ptq.push_to_hub(checkpoint, REPO)
    assert hub.commits == []


def test_offline_mode_and_no_token_are_refused_before_any_request(hub, checkpoint, monkeypatch, tmp_path):
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(PtqError, match="^HF_HUB_OFFLINE is set"):
        ptq.push_to_hub(checkpoint, REPO)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.delenv("HF_TOKEN")
    monkeypatch.delenv("HUGGING_FACE_HUB_TOKEN", raising=False)
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "no-token"))  # no stored login either
    with pytest.raises(PtqError, match=r"^no Hugging Face token found to push to 'me/tiny-w8a16': set HF_TOKEN"):
        ptq.push_to_hub(checkpoint, REPO)
    assert hub.requests == []


def _extra_file(folder: Path) -> Path:
    (folder / "notes.txt").write_text("mine")
    return folder


def _no_manifest(folder: Path) -> Path:
    (folder / "ptq.json").unlink()
    return folder


def _missing_weights(folder: Path) -> Path:
    (folder / "model.safetensors").unlink()
    return folder


@pytest.mark.parametrize("make,repo_id,message", [
    (lambda f: f / "nope", REPO, "checkpoint '{f}/nope' does not exist; give the folder ptq quantize or ptq.save"),
    (lambda f: f / "config.json", REPO, "checkpoint '{f}/config.json' is not a folder"),
    (_no_manifest, REPO, "'{f}' is not a ptq checkpoint (it has no ptq.json)"),
    (_extra_file, REPO, "checkpoint '{f}' holds files ptq did not write (e.g. notes.txt)"),
    (_missing_weights, REPO, "checkpoint '{f}' is incomplete: model.safetensors (listed in ptq.json) is missing"),
    (lambda f: f, "tiny-w8a16", "repo id 'tiny-w8a16' is not OWNER/NAME"),
    (lambda f: f, "me/tiny/w8a16", "repo id 'me/tiny/w8a16' is not OWNER/NAME"),
    (lambda f: f, "me/bad name", "repo id 'me/bad name' is not valid on the Hub"),
])
def test_bad_input_is_refused_before_any_request(hub, checkpoint, tmp_path, capsys, make, repo_id, message):
    folder = Path(shutil.copytree(checkpoint, tmp_path / "ckpt"))
    target = make(folder)
    expected = message.format(f=folder)
    with pytest.raises(PtqError) as raised:
        ptq.push_to_hub(target, repo_id)
    assert expected in str(raised.value) and "\n" not in str(raised.value)
    assert expected in one_error_line(capsys, ["push", target, "--repo-id", repo_id])
    assert hub.requests == []


def test_quantize_checks_the_repo_id_before_the_work(hub, tmp_path, capsys):
    out = tmp_path / "q"
    line = one_error_line(capsys, ["quantize", "--recipe", "W4A16", "--output", out, "--push-to-hub", "no-owner"])
    assert "repo id 'no-owner' is not OWNER/NAME" in line
    assert not out.exists() and list(tmp_path.iterdir()) == [] and hub.requests == []
