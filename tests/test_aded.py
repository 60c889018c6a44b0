"""ADED (``aded``): the decayed tri-gram table, the UCB-grown tree, and that decoding with it is greedy-
identical to plain decoding at batch 1 and 3 and under continuous batching."""

import pytest
import torch
from conftest import ByteTokenizer, make_prompts, staggered_requests

from specdec.decode.drafters.aded import AdedDrafter, NgramTable
from specdec.decode.drafters.base import Segment
from specdec.decode.engine.loop import SpecEngine
from specdec.decode.drafters.registry import NAMED_DRAFTERS
from specdec.decode.engine.types import GenRequest
from specdec.decode.engine.verify import Sampling


class _Batch:
    def __init__(self, seqs, k=20):
        self.seqs, self.num_draft, self.device = seqs, k, torch.device("cpu")
        self.sampling = Sampling()


def test_table_counts_verified_text_with_decay():
    t = NgramTable(decay=0.5, min_count=0.2)
    t.add([1, 2, 3])
    assert t.tri == {(1, 2): {3: 1.0}} and t.bi == {1: {2: 1.0}, 2: {3: 1.0}}
    t.add([1, 2, 3, 1, 2, 4])  # only the new tokens count: (1,2)->3 is not counted twice
    assert t.tri[(1, 2)] == {3: 0.5, 4: 1.0}  # the context's old counts decayed when it was seen again
    t.add([1, 2, 3, 1, 2, 4, 1, 2, 4, 1, 2, 4])
    assert 3 not in t.tri[(1, 2)]  # decayed below min_count: dropped, the table follows the current text
    assert t.candidates((1, 2), 2)[0][0] == 4


def test_table_backs_off_to_the_bigram_when_the_context_is_unseen():
    t = NgramTable(decay=1.0, backoff=0.4)
    t.add([7, 5, 6, 8, 5, 9])
    assert t.candidates((0, 5), 4) == [(6, 0.5), (9, 0.5)]  # (0, 5) unseen: the bi-gram of 5
    # a seen context lists its own followers first; the bi-gram's others follow, scaled down
    assert t.candidates((7, 5), 4) == [(6, 1.0), (9, 0.2)]


def test_tree_follows_the_table_and_statistics_follow_the_verdict():
    d = AdedDrafter(max_depth=3, top_k=2)
    seq = [1, 2, 3, 1, 2, 3, 1, 2, 4, 1, 2]
    d.begin(_Batch([seq]), None)
    p = d.propose(_Batch([seq], k=6))
    # after (1, 2) came 3 twice and 4 once (most recently): 3 is likelier, and its certain continuation
    # 3 -> 1 -> 2 (reach 0.63 each) comes before the sibling 4 (0.37); depth stops at 3
    assert p.tokens[0].tolist() == [3, 1, 2, 4, 1, 2]
    assert p.parents[0].tolist() == [-1, 0, 1, -1, 3, 4]
    assert p.max_depth == 3 and p.tree_attn.shape == (1, 7, 7)
    # the verifier kept node 0 (token 3) and the target then emitted 1
    seg = Segment(None, None, None, None, keep_index=torch.tensor([[0, 1]]), accepted=[1])
    seq += [3, 1]
    d.observe(_Batch([seq]), seg)
    stats = d.rows[0].stats
    assert stats.proposed[((1, 2), 3)] == 1 and stats.accepted[((1, 2), 3)] == 1
    assert stats.proposed[((1, 2), 4)] == 1 and ((1, 2), 4) not in stats.accepted
    assert stats.visits == {(1, 2): 2, (2, 3): 1}  # at stake: the root's children and node 0's
    assert d.rows[0].table.indexed == len(seq)


def test_rows_keep_their_own_state_through_select_and_admit():
    d = AdedDrafter()
    d.begin(_Batch([[1, 2, 3], [4, 5, 6]]), None)
    d.admit(_Batch([[7, 8, 9]]), None)
    d.select_rows(torch.tensor([0, 2]))
    assert [r.table.indexed for r in d.rows] == [3, 3]
    assert (8, 9) not in d.rows[0].table.tri and (7, 8) in d.rows[1].table.tri


def test_registered():
    assert isinstance(NAMED_DRAFTERS["aded"]("aded", None, None, None), AdedDrafter)


@pytest.fixture(scope="module")
def plain(target):
    return SpecEngine(target, ByteTokenizer()).generate(staggered_requests())


@pytest.mark.parametrize("bsz", [1, 3])
def test_greedy_aded_is_lossless(target, plain, bsz):
    reqs = staggered_requests()
    engine = SpecEngine(target, ByteTokenizer(), AdedDrafter())
    got = []
    for i in range(0, len(reqs), bsz):
        got += engine.generate(reqs[i : i + bsz])
    assert [r.token_ids for r in got] == [r.token_ids for r in plain]
    assert [r.finish_reason for r in got] == [r.finish_reason for r in plain]
    assert sum(r.stats["drafted_tokens"] for r in got) > 0  # the drafter did draft


def test_greedy_aded_is_lossless_when_streamed(target, plain):
    got = dict(SpecEngine(target, ByteTokenizer(), AdedDrafter()).stream(staggered_requests(), batch_size=2))
    assert [got[i].token_ids for i in range(len(plain))] == [r.token_ids for r in plain]


def test_repetitive_text_is_drafted_and_accepted(target):
    """On text the target repeats (its own greedy loop), the table predicts it: fewer forwards than tokens."""
    prompt = make_prompts(1, seed=2)[0]
    loop = SpecEngine(target, ByteTokenizer()).generate([GenRequest(prompt, 60)])[0].token_ids
    req = [GenRequest(prompt + loop, 40)]
    ref = SpecEngine(target, ByteTokenizer()).generate(req)[0]
    res = SpecEngine(target, ByteTokenizer(), AdedDrafter()).generate(req)[0]
    assert res.token_ids == ref.token_ids
    assert res.stats["accepted_tokens"] > 0
    assert res.stats["target_calls"] < len(res.token_ids)  # tau > 1


def test_sampling_smoke(target):
    reqs = staggered_requests()[:4]
    engine = SpecEngine(target, ByteTokenizer(), AdedDrafter(), sampling=Sampling(temperature=0.8), seed=3, eos_ids=[])
    res = engine.generate(reqs)
    assert [len(r.token_ids) for r in res] == [r.max_new_tokens for r in reqs]
    streamed = dict(engine.stream(reqs, batch_size=2))
    assert [len(streamed[i].token_ids) for i in range(len(reqs))] == [r.max_new_tokens for r in reqs]
