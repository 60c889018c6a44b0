"""The copying drafters (CopySpec's ``copy``, input-guided ``input-copy``): what they propose, how far
they copy, and that decoding with them is greedy-identical to plain decoding at batch 1 and 3."""

import pytest
import torch
from conftest import ByteTokenizer, make_prompts

from specdec.decode.drafters.copying import CopyDrafter, InputCopyDrafter
from specdec.decode.drafters.base import Segment
from specdec.decode.engine.loop import SpecEngine
from specdec.decode.engine.types import GenRequest
from specdec.decode.engine.verify import Sampling


class _Batch:
    def __init__(self, seqs, k=32):
        self.seqs, self.num_draft, self.device = seqs, k, torch.device("cpu")
        self.sampling = Sampling()
        self.references = []


def _seg(accepted):
    return Segment(None, None, None, None, accepted=accepted)


def _tokens(p):
    return [] if p is None else p.tokens[0, : int(p.lengths[0])].tolist()


def test_copy_proposes_what_followed_the_last_gamma_tokens_and_adapts_its_length():
    d = CopyDrafter(gamma=3, start_copy=4, max_copy=16, min_copy=2)
    text = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 1, 2, 5, 6, 7]
    d.begin(_Batch([text]), None)
    assert _tokens(d.propose(_Batch([text]))) == [8, 9, 10, 11]  # after the earlier 5 6 7, start_copy long
    d.observe(None, _seg([4]))  # kept whole: the next copy doubles
    assert _tokens(d.propose(_Batch([text]))) == [8, 9, 10, 11, 12, 13, 14, 15]
    d.observe(None, _seg([1]))  # cut after one: the next is what was kept plus min_copy
    assert d.length == [3]
    assert d.propose(_Batch([[1, 2, 3]])) is None  # nothing repeats: no draft


def test_copy_remembers_the_jobs_earlier_outputs():
    d = CopyDrafter(gamma=3, start_copy=6)
    first = [[40, 41, 42, 43, 44, 45, 46, 47]]
    d.begin(_Batch(first), None)
    d.propose(_Batch(first))
    later = [[9, 41, 42, 43]]  # a new batch of the job: the finished row is memory now
    d.begin(_Batch(later), None)
    assert _tokens(d.propose(_Batch(later))) == [44, 45, 46, 47]


def test_input_copy_follows_the_input_and_realigns_after_a_mismatch():
    d = InputCopyDrafter(align=2, start_copy=4)
    prompt = [10, 11, 12, 13, 14, 15, 16, 17, 18, 19]
    seqs = [prompt + [10]]  # the target's first token starts copying the input
    d.begin(_Batch(seqs, k=4), None)
    assert _tokens(d.propose(_Batch(seqs, k=4))) == [11, 12, 13, 14]
    d.observe(None, _seg([4]))
    seqs[0] += [11, 12, 13, 14, 15]  # all kept, and the bonus token is the input's next one
    assert _tokens(d.propose(_Batch(seqs, k=4))) == [16, 17, 18, 19]
    d.observe(None, _seg([1]))
    seqs[0] += [16, 99, 13, 14]  # an edit: the output resumes at 13 14, so does the copy
    assert _tokens(d.propose(_Batch(seqs, k=4))) == [15]  # a copy cut after one token: the next is one long
    d.observe(None, _seg([1]))
    seqs[0] += [15, 16]
    assert _tokens(d.propose(_Batch(seqs, k=4))) == [17, 18]  # kept whole: it doubles again


def _edit_prompts(n, seed):
    """Prompts whose second half repeats their first (what a rewrite job looks like)."""
    return [p + p[: len(p) // 2] for p in make_prompts(n, seed=seed)]


@pytest.mark.parametrize("drafter", [CopyDrafter, InputCopyDrafter])
@pytest.mark.parametrize("bsz", [1, 3])
def test_copying_drafters_are_lossless(target, drafter, bsz):
    prompts = _edit_prompts(6, seed=11)
    budgets = [24, 7, 31, 12, 18, 3]  # rows finish at different times
    reqs = [GenRequest(p, n) for p, n in zip(prompts, budgets)]
    plain = SpecEngine(target, ByteTokenizer()).generate(reqs)
    engine = SpecEngine(target, ByteTokenizer(), drafter())
    got = []
    for i in range(0, len(reqs), bsz):
        got += engine.generate(reqs[i : i + bsz])
    assert [r.token_ids for r in got] == [r.token_ids for r in plain]
    assert sum(r.stats["drafted_tokens"] for r in got) > 0  # the drafter did draft


def test_self_copying_target_is_drafted_in_long_runs(target):
    """On text the target repeats (its own greedy loop), copy drafts long runs and saves forwards."""
    prompt = make_prompts(1, seed=2)[0]
    loop = SpecEngine(target, ByteTokenizer()).generate([GenRequest(prompt, 80)])[0].token_ids
    req = [GenRequest(prompt + loop, 40)]
    plain = SpecEngine(target, ByteTokenizer()).generate(req)[0]
    copied = SpecEngine(target, ByteTokenizer(), CopyDrafter()).generate(req)[0]
    assert copied.token_ids == plain.token_ids
    assert copied.stats["target_calls"] < plain.stats["target_calls"]


def test_input_copy_follows_a_reference_when_the_request_has_one(target):
    """A request's ``reference`` (a record's ``source``) is what input-copy copies from: a reference
    holding the target's own continuation is drafted in long accepted runs, rows with and without one
    share a batch, rows join a running batch, and output stays plain greedy."""
    prompts = make_prompts(4, seed=13, lo=4, hi=20)
    plain = SpecEngine(target, ByteTokenizer()).generate([GenRequest(p, 40) for p in prompts])
    with_ref = [GenRequest(p, 40, reference=r.token_ids if i % 2 == 0 else None) for i, (p, r) in enumerate(zip(prompts, plain))]
    got = dict(SpecEngine(target, ByteTokenizer(), InputCopyDrafter()).stream(iter(with_ref), 2))
    assert [got[i].token_ids for i in range(4)] == [r.token_ids for r in plain]
    without = SpecEngine(target, ByteTokenizer(), InputCopyDrafter()).generate([GenRequest(prompts[0], 40)])[0]
    assert got[0].stats["target_calls"] <= 4 < without.stats["target_calls"]


def test_decode_reads_a_records_source_field(tmp_path, tiny_family):
    import json

    from conftest import invoke

    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"id": "a", "prompt": "Rewrite: x = 1", "source": "x = 1\ny = 2\n"}) + "\n"
                   + json.dumps({"id": "b", "prompt": "Rewrite: y", "source": 7}) + "\n")
    out = tmp_path / "out.jsonl"
    res = invoke(["decode", "--in", str(src), "--out", str(out), "--target", str(tiny_family / "target"),
                  "--drafter", "input-copy", "--max-new-tokens", "8"])
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert res.exit_code == 3  # one record is an error record; the job went on
    assert "completion" in rows[0] and rows[1] == {"id": "b", "line": 2, "error": "source must be a string"}
