"""scripts/profile_gptq_job.py: the GPTQ job's parts, by stage, on the bundled model."""

import torch

from ptq import pipeline
from ptq.models import bundled_model_path
from tests.conftest import REPO, load_script


def test_each_stage_of_each_block_is_timed_and_the_pipeline_put_back(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO / "scripts"))
    profile = load_script("profile_gptq_job", monkeypatch)
    calls = {"solves": 0, "blocks": 0}
    solve, block = pipeline.solve_shared_input, pipeline.quantize_block_sequentially

    def counted(part, fn):
        def wrapper(*args, **kwargs):
            calls[part] += 1
            return fn(*args, **kwargs)
        return wrapper

    monkeypatch.setattr(pipeline, "solve_shared_input", counted("solves", solve))
    monkeypatch.setattr(pipeline, "quantize_block_sequentially", counted("blocks", block))
    before = [getattr(module, name) for module, name in profile.PATCHED]
    ids = torch.randint(0, 2000, (4, 64), generator=torch.Generator().manual_seed(0))
    total, timings = profile.one_job(str(bundled_model_path()), ids, group_size=128)
    assert [getattr(module, name) for module, name in profile.PATCHED] == before
    assert calls == {"solves": 4 * 4, "blocks": 4}  # the bundled Llama: 4 blocks of 4 stages
    assert timings.names == {0: "q/k/v", 1: "o", 2: "gate/up", 3: "down"}
    assert {key for key in timings.seconds} == {(part, stage) for part in profile.PARTS for stage in range(4)} | {
        ("blocks", -1), ("check_finite", -1)}
    assert all(seconds > 0 for seconds in timings.seconds.values())
    in_blocks = sum(seconds for (part, _), seconds in timings.seconds.items() if part in profile.PARTS)
    assert in_blocks < timings.seconds["blocks", -1] < total
    table = profile.report([(total, timings), (total, timings)]).splitlines()
    assert table[1].split() == ["part", "q/k/v", "o", "gate/up", "down", "all"]
    assert [line.split()[0] for line in table[2:]] == ["stage", "solves", "install", "replays", "final", "check_finite",
                                                       "outside", "ptq.quantize"]
    assert float(table[-1].split()[-1]) == round(total, 3)
