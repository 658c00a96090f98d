"""scripts/awq_grid_shortcuts.py: the shortcuts it replays, and its losses against ptq's own search."""

import copy

import pytest
import torch

import ptq
from ptq.evaluate import eval_windows, evaluate
from ptq.recipe import parse_recipe
from ptq.schemes import QuantArgs
from tests.conftest import load_script, tiny_model

GRID = [(None, False)] + [(i / 8, True) for i in range(8)]  # s = 1, then one grid of 8 ratios


@pytest.fixture
def shortcuts(monkeypatch):
    return load_script("awq_grid_shortcuts", monkeypatch)


def rows_of(losses: list[float], rows: int = 8) -> torch.Tensor:
    """[candidates, rows]: each candidate's loss spread evenly over its rows."""
    return torch.tensor(losses, dtype=torch.float64).unsqueeze(1).repeat(1, rows) / rows


def test_choose_takes_the_first_of_equal_losses(shortcuts):
    losses = torch.tensor([3.0, 1.0, 2.0, 1.0])
    assert shortcuts.choose(losses, {0, 1, 2, 3}) == 1
    assert shortcuts.choose(losses, {3, 2}) == 3
    assert shortcuts.choose(losses, {0}) == 0


def test_coarse_search_scores_the_neighbours_of_its_best_coarse_point(shortcuts):
    # grid positions 0..7 are candidates 1..8; the best (candidate 4, position 3) is no coarse point
    rows = rows_of([9, 8, 7, 6, 1, 5, 6, 7, 8])
    scored, cost = shortcuts.coarse_shortcut(2)(rows, GRID)
    assert scored == {0, 1, 3, 5, 7} | {4, 6}  # s = 1, positions 0, 2, 4, 6; then 3 and 5 beside 4's best
    assert cost == 7.0
    assert shortcuts.choose(rows.sum(1), scored) == 4


def test_coarse_search_misses_a_minimum_between_worse_coarse_points(shortcuts):
    rows = rows_of([9, 3, 8, 8, 1, 8, 8, 8, 8])  # best: position 3, between coarse positions 2 and 4 (8 each)
    scored, cost = shortcuts.coarse_shortcut(2)(rows, GRID)
    assert scored == {0, 1, 3, 5, 7} | {2}  # then only position 1, beside the best coarse one (position 0)
    assert cost == 6.0
    assert shortcuts.choose(rows.sum(1), scored) == 1


def test_row_sample_ranks_on_strided_rows_and_rescores_the_best(shortcuts):
    rows = torch.tensor([[1.0] * 4, [0.75] * 4, [0.5] * 4, [1.5, 0, 0, 0]], dtype=torch.float64)
    assert shortcuts.choose(rows.sum(1), {0, 1, 2, 3}) == 3  # 1.5: best over all rows...
    scored, cost = shortcuts.rows_shortcut(2, 2)(rows, GRID[:4])  # ...but on rows 0 and 2 tied with 1
    assert scored == {0, 2, 1} and cost == 4 / 2 + 3  # the best 2 of the sample (a stable ranking), and s = 1
    assert shortcuts.choose(rows.sum(1), scored) == 2


def test_table_counts_changed_choices_and_their_regret(shortcuts):
    pair = shortcuts.Pair("0: pair", rows_of([9, 3, 8, 8, 1, 8, 8, 8, 8]), GRID, searched=4)
    lines = shortcuts.table([pair])
    full = next(line for line in lines if line.startswith("full grid"))
    coarse2 = next(line for line in lines if line.startswith("coarse 2"))
    assert full.split()[2:5] == ["9.0", "0", "of"] and full.split()[-2:] == ["0.000%", "0.0000%"]
    assert coarse2.split()[2:4] == ["6.0", "1"] and coarse2.split()[-2:] == ["200.000%", "200.0000%"]  # 3 against 1


def test_local_minima(shortcuts):
    assert shortcuts.local_minima(torch.tensor([3.0, 2.0, 1.0, 2.0])) == 1
    assert shortcuts.local_minima(torch.tensor([1.0, 2.0, 1.0, 2.0])) == 2
    assert shortcuts.local_minima(torch.tensor([1.0, 1.0, 2.0])) == 0  # a tie is no strict minimum


def test_float64_losses_pick_what_ptqs_search_picks(shortcuts, tokenizer):
    """On a tiny random Llama, the row losses' best is the candidate ptq's awq_search chose
    (from its compiled or GEMM loss) on every pair."""
    from ptq.calibration.data import calibration_batches

    model = tiny_model("llama")
    batches = calibration_batches(tokenizer, "builtin", samples=4, seq_len=64, seed=0)
    args = QuantArgs(num_bits=4, symmetric=True, strategy="group", group_size=32)
    pairs = shortcuts.measure(model, batches, args, n_grid=8)
    assert len(pairs) == 2 * 3  # per block: norm -> q, k, v; norm -> gate, up; up -> down (GQA: no v -> o)
    for pair in pairs:
        assert pair.rows.shape[0] == 9 and (pair.rows >= 0).all()
        assert shortcuts.choose(pair.rows.sum(1), set(range(9))) == pair.searched, pair.name


def test_a_group_size_that_does_not_divide_a_pair_stops_before_the_pass(shortcuts):
    from ptq.errors import PtqError

    args = QuantArgs(num_bits=4, symmetric=True, strategy="group", group_size=96)  # 128 features
    with pytest.raises(PtqError, match="group size 96 does not divide the 128 input features of block 0's"):
        shortcuts.model_pairs(tiny_model("llama"), args)


def test_block_sample_takes_whole_blocks_of_rows(shortcuts):
    rows = torch.zeros(3, 64, dtype=torch.float64)
    rows[0] = 1.0  # 64
    rows[1] = 0.5  # 32
    rows[2, :32] = 0.6  # 19.2: the best, but not on the sampled block (rows 0-31)
    scored, cost = shortcuts.rows_shortcut(2, 1, block=32)(rows, GRID[:3])
    assert scored == {0, 1} and cost == 3 * 0.5 + 2
    assert shortcuts.choose(rows.sum(1), scored) == 1


def test_quality_runs_quantize_with_the_shortcuts_picks(shortcuts, tokenizer):
    """--quality: a shortcut that scores every candidate gives the full grid's model to the
    last bit, and one that scores only s = 1 gives plain RTN's; each run counts the pairs."""
    model = tiny_model("llama").to(torch.bfloat16)
    args = QuantArgs(num_bits=4, symmetric=True, strategy="group", group_size=32)
    every = {"every candidate": lambda rows, labels: (set(range(len(labels))), float(len(labels))),
             "s = 1 alone": lambda rows, labels: ({0}, 1.0)}
    runs, plain = shortcuts.quality_runs(model, tokenizer, args, every, samples=4, seq_len=64, n_grid=8, windows=2)
    (_, none, full), (_, all_picks, same), (_, rtn_picks, rtn) = runs
    assert none is None and all_picks.pairs == rtn_picks.pairs == 6 and all_picks.changed == 0
    assert (same.perplexity, same.kl, same.top1) == (full.perplexity, full.kl, full.top1)
    assert rtn_picks.changed > 0 and full.perplexity != rtn.perplexity  # AWQ scaled some pair on this model

    plain_rtn = copy.deepcopy(model)
    weights = {"num_bits": 4, "symmetric": True, "strategy": "group", "group_size": 32}
    ptq.quantize(plain_rtn, parse_recipe({"steps": [{"rtn": {"scheme": {"weights": weights}, "targets": ["Linear"],
                                                             "ignore": ["lm_head"]}}]}), show_progress=False)
    assert evaluate(plain_rtn, eval_windows(tokenizer, max_windows=2), show_progress=False).perplexity == rtn.perplexity
    lines = shortcuts.quality_table(runs, plain)
    assert len(lines) == 5 and lines[2].split()[2:4] == ["0", "of"] and f"{plain.perplexity:.3f}" in lines[-1]
