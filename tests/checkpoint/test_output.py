"""The output folder: what may be overwritten, the lock, the work folder, failures mid-write."""

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

import ptq
from ptq.checkpoint import output
from ptq.errors import PtqError
from tests.conftest import tiny_model


def error_lines(stderr: str) -> list[str]:
    """stderr without progress bars (tqdm redraws them with carriage returns)."""
    parts = [part for line in stderr.splitlines() for part in line.split("\r")]
    return [part for part in parts if part.strip() and not re.search(r"\d+%\|", part)]


@pytest.fixture(scope="module")
def quantized():
    return ptq.quantize(tiny_model(), "W8A16", show_progress=False)


def test_overwrite_replaces_a_ptq_checkpoint(tmp_path, quantized):
    target = tmp_path / "q"
    ptq.save(quantized, target)
    manifest = json.loads((target / output.MANIFEST).read_text())
    assert sorted(manifest["files"]) == ["README.md", "config.json", "generation_config.json", "model.safetensors",
                                         "recipe.yaml"]
    assert manifest["compute_dtype"] in ("bfloat16", "float32") and manifest["writer"] == "ptq"
    (target / "model.safetensors").write_bytes(b"stale")
    ptq.save(quantized, target, overwrite=True)
    assert (target / "model.safetensors").stat().st_size == manifest["files"]["model.safetensors"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["q"]  # no work folder or old copy left


def test_a_folder_without_manifest_is_not_overwritten(tmp_path, quantized):
    target = tmp_path / "q"
    ptq.save(quantized, target)
    (target / output.MANIFEST).unlink()  # e.g. written by another tool, or by hand
    with pytest.raises(PtqError, match="holds files ptq did not write"):
        ptq.save(quantized, target, overwrite=True)
    assert (target / "model.safetensors").exists()


def test_read_only_parent(tmp_path, quantized, monkeypatch):
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: False if str(p) == str(tmp_path) else real_access(p, mode))
    with pytest.raises(PtqError, match="permission denied"):
        ptq.save(quantized, tmp_path / "q")
    assert list(tmp_path.iterdir()) == []


def test_lock_is_released_and_work_folder_removed(tmp_path):
    with output.claim_output(tmp_path / "q") as slot:
        assert slot.work == tmp_path / ".q.ptq-partial" and (slot.work / "lock").read_text().strip() == str(os.getpid())
        with pytest.raises(PtqError, match="another ptq run is writing"):
            with output.claim_output(tmp_path / "q"):
                pass
        assert slot.work.exists()  # the refused claim left the holder's folder alone
    assert list(tmp_path.iterdir()) == []


def test_failure_keeps_only_finished_work(tmp_path):
    with pytest.raises(RuntimeError):
        with output.claim_output(tmp_path / "q"):
            raise RuntimeError("boom")
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(RuntimeError):
        with output.claim_output(tmp_path / "q") as slot:
            slot.keep = True
            raise RuntimeError("boom")
    with pytest.raises(PtqError, match=r"an interrupted run left .*--resume"):
        with output.claim_output(tmp_path / "q"):
            pass
    with output.claim_output(tmp_path / "q", resume=True) as slot:
        assert slot.keep  # an earlier run's work is never deleted by a failure of this one


FULL_DISK = """
import resource, sys
from ptq.cli import main
resource.setrlimit(resource.RLIMIT_FSIZE, (200_000, 200_000))  # files of at most 200 kB: as a full disk
sys.exit(main(sys.argv[1:]))
"""


def test_full_disk_is_one_line_and_leaves_nothing(tmp_path):
    result = subprocess.run(
        [sys.executable, "-c", FULL_DISK, "quantize", "--recipe", "W4A16", "--output", "q", "--no-eval"],
        cwd=tmp_path, capture_output=True, text=True,
    )
    assert result.returncode == 2, result.stderr
    lines = error_lines(result.stderr)
    assert len(lines) == 1 and lines[0].startswith("ptq: error: writing the checkpoint failed: File too large")
    assert list(tmp_path.iterdir()) == []


# Ctrl-C as in a terminal, even where the tests run in a background job, whose processes
# inherit SIGINT ignored (Python then installs no handler: the run went on and the test skipped)
WITH_CTRL_C = """
import signal, sys
signal.signal(signal.SIGINT, signal.default_int_handler)
from ptq.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_ctrl_c_is_one_line_and_exit_130(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("calibration: {samples: 16, seq_len: 128}\nsteps:\n  - gptq: {scheme: W4A16}\n")
    run = subprocess.Popen([sys.executable, "-c", WITH_CTRL_C, "quantize", "--recipe", recipe, "--output", "q", "--no-eval"],
                           cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           env={**os.environ, "OMP_NUM_THREADS": "1"})
    progress = tmp_path / ".q.ptq-partial" / "blocks" / "progress.json"
    deadline = time.monotonic() + 120
    while run.poll() is None and not progress.exists() and time.monotonic() < deadline:
        time.sleep(0.002)
    run.send_signal(signal.SIGINT)
    _out, err = run.communicate()
    if run.returncode == 0:
        pytest.skip("the run finished before the interrupt")
    assert run.returncode == 130, err
    lines = error_lines(err)
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith("ptq: interrupted; ") and "--resume" in lines[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == [".q.ptq-partial", "r.yaml"]
