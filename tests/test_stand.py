"""STAND: greedy output is plain greedy output (static and continuous batching, groups or none);
sampled output has the target's joint distribution of two tokens (chi-square), which a deliberately
broken variant fails."""

from __future__ import annotations

import pytest
import torch
from conftest import ByteTokenizer, make_prompts, tiny_llama
from test_sampling import P_FLOOR, chi2_pvalue, exact_two_token_distribution

from specdec.decode import stand
from specdec.decode.drafters import NoDrafter
from specdec.decode.engine import SpecEngine
from specdec.decode.stand import StandDrafter, StandTable
from specdec.decode.types import GenRequest
from specdec.decode.verify import Sampling


def test_table_longest_context_wins_and_averages():
    table = StandTable(top_k=2, max_ngram=3)
    text = [1, 2, 3]
    table.add(text, 2, [7, 8], [0.6, 0.4])  # after (3), (2, 3), (1, 2, 3)
    table.add([9, 3], 1, [8, 5], [0.9, 0.1])  # after (3), (9, 3)
    assert table.lookup([1, 2, 3]) == ([7, 8], pytest.approx([0.6, 0.4]))
    # (3) averaged over both positions: 7: 0.3, 8: 0.65, 5: 0.05 -> cut to its top 2
    tokens, q = table.lookup([4, 3])
    assert tokens == [8, 7] and q == pytest.approx([0.65 / 0.95, 0.3 / 0.95])
    assert table.lookup([4]) is None


def greedy_runs(target, requests, drafter, batch_size=None):
    engine = SpecEngine(target, ByteTokenizer(), drafter, Sampling(), seed=0, eos_ids=[])
    if batch_size is None:
        return [r.token_ids for r in engine.generate(list(requests))]
    return {i: r.token_ids for i, r in engine.stream(iter(requests), batch_size=batch_size)}


@pytest.mark.parametrize("bsz", [1, 3])
def test_greedy_is_plain_greedy(target, bsz):
    # different prompt lengths and budgets: rows finish at different rounds
    requests = [GenRequest(p, 12 + 9 * i) for i, p in enumerate(make_prompts(bsz, seed=bsz))]
    drafter = StandDrafter()
    assert greedy_runs(target, requests, drafter) == greedy_runs(target, requests, NoDrafter())
    assert any(drafter.pred), "the tables never proposed anything"


def test_greedy_with_rows_joining_a_running_batch(target):
    prompts = make_prompts(4, seed=5)
    # two samples of each prompt share a table; budgets differ so rows leave and others join mid-batch
    requests = [GenRequest(p, 5 + 7 * (j % 3), group=i) for i, p in enumerate(prompts) for j in range(2)]
    requests += [GenRequest(p, 20) for p in make_prompts(2, seed=6)]  # rows without a group
    got = greedy_runs(target, requests, StandDrafter(), batch_size=3)
    assert got == greedy_runs(target, requests, NoDrafter(), batch_size=3)


def engine_pairs(rows: int = 4000, batch_size: int = 1000):
    """The first two tokens of ``rows`` samples of one prompt, all of one group, streamed so that rows
    draft from a table the other rows' rounds filled."""
    vocab = 12
    target = tiny_llama(vocab=vocab, hidden=32, layers=2, seed=3)
    with torch.no_grad():
        target.lm_head.weight.mul_(0.25)  # undo most of the sharpening: many tokens matter
    drafter = StandDrafter(top_k=4, min_reach=0.0)
    prompt = [5, 7, 5, 7, 5]
    sampling = Sampling(temperature=0.8)
    engine = SpecEngine(target, ByteTokenizer(), drafter, sampling, num_draft=2, seed=11, eos_ids=[])
    # every other row runs longer, so the batch never empties and the group's table lives on
    requests = [GenRequest(prompt, 2 + 4 * (i % 2), group=0) for i in range(rows)]
    res = [r for _, r in sorted(engine.stream(iter(requests), batch_size), key=lambda ir: ir[0])]
    pairs = torch.tensor([r.token_ids[0] * vocab + r.token_ids[1] for r in res])
    exact = exact_two_token_distribution(target, prompt, sampling)
    return chi2_pvalue(torch.bincount(pairs, minlength=vocab * vocab).double(), exact.double()), res


def test_engine_samples_the_target_joint_distribution():
    pvalue, res = engine_pairs()
    assert pvalue > P_FLOOR
    assert sum(r.stats["accepted_tokens"] for r in res) > len(res) // 4


def test_drafting_the_likeliest_tokens_under_the_rsd_rule_fails(monkeypatch):
    """RSD's ratio test assumes each sibling is a draw from q: top tokens taken in order are not."""
    monkeypatch.setattr(stand.StandDrafter, "_order", lambda self, tokens, probs, u: list(range(len(tokens))))
    pvalue, _ = engine_pairs()
    assert pvalue < 1e-6
