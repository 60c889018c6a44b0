"""decode.engine.length: chain lengths chosen by measured forward costs and acceptance."""

import pytest

from specdec.decode.engine.length import DraftLength


def _costs(length: DraftLength, per_token: float) -> None:
    for w in (1, 2, 4, 8, 13):
        for _ in range(5):
            length.record_forward(1, w, 0.05 * (1 + per_token * (w - 1)))


def _accept(length: DraftLength, cls: int, rate_first: float, rounds: int = 400) -> None:
    """Rows whose first draft is accepted ``rate_first`` of the time, later ones always after that."""
    for i in range(rounds):
        a = 12 if (i % 100) < rate_first * 100 else 0
        length.observe([cls], [12], [a])


def test_costly_verification_and_poor_acceptance_draft_little():
    length = DraftLength(12)
    _costs(length, per_token=0.25)
    _accept(length, cls=1, rate_first=0.2)
    assert max(length.best(1, 1, 12) for _ in range(20)) <= 3  # one at most, and exploration's two more
    cheap = DraftLength(12)
    _costs(cheap, per_token=0.01)
    _accept(cheap, cls=1, rate_first=0.8)
    assert min(cheap.best(1, 1, 12) for _ in range(20)) == 12


def test_classes_are_kept_apart_and_unknown_costs_draft_everything():
    length = DraftLength(8)
    assert length.best(0, 1, 8) == 8  # nothing measured yet: the drafter's own length
    _costs(length, per_token=0.15)
    _accept(length, cls=3, rate_first=0.95)
    _accept(length, cls=1, rate_first=0.05)
    long = min(length.best(3, 1, 8) for _ in range(20))
    short = max(length.best(1, 1, 8) for _ in range(20))
    assert long >= 6 and short <= 2
    assert length.best(3, 1, 2) <= 2  # never past what the row has
    assert length.forward_cost(1, 20) > length.forward_cost(1, 13)  # extrapolated by the last slope


def test_a_wide_batch_measures_a_plain_step_before_it_drafts_by_cost():
    """With 8 rows some row nearly always has drafts, so a plain step of that batch would never be measured and its
    cost would be extrapolated from wide forwards (on a CPU, 8 rows x 3 positions leave the quantised kernel for
    float32 matmuls: far costlier per position). Two rounds without drafts measure it; then lengths follow it."""
    length = DraftLength(8)
    rows = 8
    for w in (3, 5):
        for _ in range(3):
            length.record_forward(rows, w, 0.30 + 0.01 * w)  # wide forwards, nearly flat in the width
    _accept(length, cls=2, rate_first=0.6)
    assert length.lengths([2] * rows, [4] * rows) == [0] * rows  # no plain step of 8 rows measured yet
    for _ in range(2):  # the plain rounds it asked for (the first builds the shape)
        length.record_forward(rows, 1, 0.05)
    chosen = [length.lengths([2] * rows, [4] * rows) for _ in range(20)]
    assert max(max(c) for c in chosen) <= 2 and sum(map(sum, chosen)) <= 2 * rows * 3  # exploration aside: no drafts
    assert length.lengths([2], [4]) == [0]  # one row is another batch width: its plain step is measured too


def test_a_batch_drafts_to_one_width_that_pays_for_all_its_rows():
    """A batch's forward is as wide as its longest row: one row's strong match does not widen the forward of eight
    rows whose other matches are weak (chosen row by row, that row alone would draft 8), while eight strong rows do."""
    length = DraftLength(8)
    rows = 8
    for w in (1, 2, 3, 5, 9):
        for _ in range(3):
            length.record_forward(rows, w, 0.1 * (1 + 0.3 * (w - 1)))
    _accept(length, cls=3, rate_first=0.95)
    _accept(length, cls=1, rate_first=0.05)
    assert length.best(3, rows, 8, explore=False) == 8  # what that row would choose on its own
    mixed = [length.lengths([3] + [1] * 7, [8] * rows) for _ in range(40)]
    assert max(max(c) for c in mixed) <= 2  # no drafts (exploration aside: two positions for one row)
    strong = [length.lengths([3] * rows, [8] * rows) for _ in range(40)]
    assert min(min(c) for c in strong) >= 6
    assert length.lengths([3, 3], [8, 2])[1] <= 2  # never past what a row has


def test_one_measured_width_extrapolates_by_the_priors_slope_per_row():
    """With only a plain step measured, a wider forward costs 1 + SLOPE_PRIOR * rows * (width - 1) of it, as in the
    untimed model: 8 rows pay each extra position 8 times."""
    from specdec.decode.engine.length import SLOPE_PRIOR

    length = DraftLength(8)
    for rows in (1, 8):
        for _ in range(2):
            length.record_forward(rows, 1, 0.1)
        for w in (2, 33):
            assert length.forward_cost(rows, w) == pytest.approx(0.1 * (1 + SLOPE_PRIOR * rows * (w - 1)))
    wide = DraftLength(8)
    for _ in range(2):
        wide.record_forward(8, 33, 0.1 * (1 + SLOPE_PRIOR * 8 * 32))  # only a wide tree measured
    assert wide.forward_cost(8, 1) == pytest.approx(0.1)


def test_a_lookups_drafts_are_not_charged_a_heads_draft_seconds():
    """Beside a head (decode.drafters.hybrid) the measured seconds per drafted position are the head's tree levels;
    the lookup's chains cost nothing to draft, and are sized so."""
    length = DraftLength(8)
    _costs(length, per_token=0.02)
    _accept(length, cls=2, rate_first=0.9)
    length.record_draft(1, 1.0)  # a slow head level
    assert max(length.lengths([2], [8])[0] for _ in range(10)) <= 2
    assert min(length.lengths([2], [8], draft_s=0.0)[0] for _ in range(10)) >= 6


def test_untimed_lengths_follow_acceptance_not_the_clock():
    """Sampling: lengths may not depend on measured seconds (they decide how many random draws a round takes)."""
    fast, slow = DraftLength(12, timed=False), DraftLength(12, timed=False)
    _costs(fast, per_token=0.01)
    _costs(slow, per_token=5.0)
    for length in (fast, slow):
        _accept(length, cls=1, rate_first=0.05)
        _accept(length, cls=2, rate_first=0.95)
    assert [fast.best(c, 1, 12) for c in (1, 2) * 10] == [slow.best(c, 1, 12) for c in (1, 2) * 10]
    assert max(fast.best(1, 1, 12) for _ in range(20)) <= 3 and min(fast.best(2, 1, 12) for _ in range(20)) >= 8


def test_a_seeded_sampled_decode_does_not_depend_on_the_machines_timing(monkeypatch):
    """The same seed gives the same samples whatever the forwards measure (timed lengths broke this)."""
    import random
    import time

    from conftest import ByteTokenizer, tiny_llama

    from specdec.decode.drafters.draft_model import ModelDrafter
    from specdec.decode.engine import loop
    from specdec.decode.engine.types import GenRequest
    from specdec.decode.engine.verify import Sampling

    target, draft = tiny_llama(seed=3), tiny_llama(seed=4, layers=1, hidden=32)
    prompts = [[5, 7, 5, 7, 5, 9], [3, 1, 4, 1, 5], [2, 7, 1, 8, 2, 8, 1]]
    outs = []
    for clock_seed in (0, 1):
        jitter, now = random.Random(clock_seed), [0.0]

        def clock():
            now[0] += jitter.uniform(1e-4, 1.0)  # a machine whose load comes and goes
            return now[0]

        monkeypatch.setattr(loop.time, "perf_counter", clock)
        engine = loop.SpecEngine(target, ByteTokenizer(), ModelDrafter(draft), Sampling(temperature=0.9), seed=7,
                                 eos_ids=[], adaptive_length=True)
        assert engine.length is not None
        outs.append([r.token_ids for r in engine.generate([GenRequest(p, 40) for p in prompts])])
        monkeypatch.setattr(loop.time, "perf_counter", time.perf_counter)
    assert outs[0] == outs[1]


def test_tree_size_and_depth_pay_for_themselves():
    """A dynamic tree verifies the nodes whose chances pay for the wider forward, and stops deepening
    once a level costs more than its best node is worth."""
    import torch

    costly, cheap = DraftLength(8), DraftLength(8)
    _costs(costly, per_token=0.3)
    _costs(cheap, per_token=0.001)
    for length in (costly, cheap):
        length.record_draft(4, 4 * 0.002)
    scores = torch.tensor([[0.9, 0.6, 0.3, 0.05, 0.05, 0.02, 0.01, 0.01, 0.01, 0.01]]).log()
    small, large = costly.tree_size(scores, 16, 4), cheap.tree_size(scores, 16, 4)
    assert 1 <= small <= 3 and large == 10  # every node the tree has
    assert cheap.tree_size(scores, 5, 4) <= 5  # never more than the drafter's own size
    assert costly.keep_growing(0.9, 1) and not costly.keep_growing(0.01, 1)  # a level is 0.002 s, a token 0.05 s
    quiet, loaded = DraftLength(8, timed=False, draft_share=0.05), DraftLength(8, timed=False, draft_share=0.05)
    _costs(loaded, per_token=5.0)
    loaded.record_draft(4, 30.0)
    assert 1 < quiet.tree_size(scores, 16, 4) == loaded.tree_size(scores, 16, 4) < 10  # sampling: never the clock
