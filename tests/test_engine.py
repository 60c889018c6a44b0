"""The decode loop: greedy losslessness for every drafter, batching, KV rollback, tree verification."""

from __future__ import annotations

import pytest
import torch
from conftest import ByteTokenizer, make_prompts, tiny_llama

from specdec.decode.engine.cache import KVState
from specdec.decode.drafters.base import Drafter, NoDrafter, Proposal, tree_attention_from_parents
from specdec.decode.drafters.draft_model import ModelDrafter
from specdec.decode.drafters.model_free import NgramDrafter, RecycleDrafter
from specdec.decode.drafters.self_speculation import layer_skip_view
from specdec.decode.engine.loop import SpecEngine
from specdec.decode.engine.types import GenRequest
from specdec.decode.engine.verify import Sampling, verify_tree


def requests(prompts, budgets):
    return [GenRequest(p, n) for p, n in zip(prompts, budgets)]


def drafters(target, draft_model):
    return {
        "ngram": lambda: NgramDrafter(),
        "recycle": lambda: RecycleDrafter(),
        "draft": lambda: ModelDrafter(draft_model),
        "self-draft": lambda: ModelDrafter(target),  # always right: exercises full acceptance
        "layerskip": lambda: ModelDrafter(layer_skip_view(target, [1])),
    }


def test_ar_equals_transformers_generate(target):
    prompts = make_prompts(3, seed=3)
    budgets = [17, 25, 9]
    results = SpecEngine(target, ByteTokenizer()).generate(requests(prompts, budgets))
    for p, n, r in zip(prompts, budgets, results):
        ref = target.generate(torch.tensor([p]), max_new_tokens=n, do_sample=False, eos_token_id=2, pad_token_id=0)
        assert r.token_ids == ref[0, len(p) :].tolist()
        assert r.stats["target_calls"] == len(r.token_ids)  # one forward per token, prefill included


def test_ar_batched_left_padding_equals_unbatched(target):
    prompts = make_prompts(4, seed=5)
    budgets = [30, 12, 22, 5]
    engine = SpecEngine(target, ByteTokenizer())
    batched = engine.generate(requests(prompts, budgets))
    single = [engine.generate(requests([p], [n]))[0] for p, n in zip(prompts, budgets)]
    assert [r.token_ids for r in batched] == [r.token_ids for r in single]


@pytest.mark.parametrize("name", ["ngram", "recycle", "draft", "self-draft", "layerskip"])
@pytest.mark.parametrize("bsz", [1, 3])
def test_greedy_speculative_is_lossless(target, draft_model, name, bsz):
    prompts = make_prompts(bsz, seed=11 + bsz)
    budgets = [40, 23, 31][:bsz]  # rows finish at different times
    ar = SpecEngine(target, ByteTokenizer()).generate(requests(prompts, budgets))
    # the perfect drafter drafts a fixed 4 a round: drafted lengths that follow measured costs would draft
    # little where the draft costs what the target does (it is the target), and timing decides how little
    k = {"num_draft": 4} if name == "self-draft" else {}
    spec = SpecEngine(target, ByteTokenizer(), drafters(target, draft_model)[name](), **k).generate(requests(prompts, budgets))
    assert [r.token_ids for r in spec] == [r.token_ids for r in ar]
    assert [r.finish_reason for r in spec] == [r.finish_reason for r in ar]
    if name == "self-draft":
        # a perfect drafter: every draft accepted, so far fewer target calls than tokens
        assert sum(r.stats["target_calls"] for r in spec) < 0.5 * sum(len(r.token_ids) for r in spec)


def test_eos_stops_rows_independently(target):
    prompts = make_prompts(3, seed=21)
    ar = SpecEngine(target, ByteTokenizer()).generate(requests(prompts, [30] * 3))
    # make the 5th generated token of row 0 an end-of-sequence token
    eos = ar[0].token_ids[4]
    engine = SpecEngine(target, ByteTokenizer(), ModelDrafter(target), eos_ids=[eos])
    res = engine.generate(requests(prompts, [30] * 3))
    assert res[0].finish_reason == "stop" and res[0].token_ids[-1] == eos
    for r, ref in zip(res, ar):
        cut = ref.token_ids.index(eos) + 1 if eos in ref.token_ids else len(ref.token_ids)
        assert r.token_ids == ref.token_ids[:cut]


def test_kv_rollback_equals_fresh_prefill(target, draft_model):
    """After rounds with rejections, every row's valid cache slots equal a fresh prefill of its text."""
    prompts = make_prompts(3, seed=7)
    engine = SpecEngine(target, ByteTokenizer(), ModelDrafter(draft_model))
    captured = {}
    original = engine._verify

    def spy(state, batch, proposal, *joining):
        seg, verdict = original(state, batch, proposal, *joining)
        captured["state"], captured["seqs"] = state, [list(s) for s in batch.seqs]
        return seg, verdict

    engine._verify = spy
    engine.generate(requests(prompts, [12] * 3))
    state, seqs = captured["state"], captured["seqs"]
    for row, seq in enumerate(seqs):
        # the verified text of this row, minus the root (which is not yet in the cache)
        text = seq[: int(state.pos[row])]
        fresh = KVState(target, 1, torch.device("cpu"))
        with torch.inference_mode():
            fresh.forward(torch.tensor([text]))
        fresh.commit_prefix(len(text), torch.ones(1, len(text), dtype=torch.bool))
        keep = state.valid[row]
        for (got_k, got_v), (ref_k, ref_v) in zip(state._committed(), fresh._committed()):
            torch.testing.assert_close(got_k[row][:, keep], ref_k[0], rtol=1e-9, atol=1e-9)
            torch.testing.assert_close(got_v[row][:, keep], ref_v[0], rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("vectorised", [False, True])
def test_tree_verification_hand_built(vectorised):
    """root -> a (-> c, -> d), root -> b. Target argmax: after root 'b', after b 'x'."""
    vocab = 10
    a, b, c, d, x = 3, 4, 5, 6, 7
    tokens = torch.tensor([[a, b, c, d]])
    parents = torch.tensor([[-1, -1, 0, 0]])
    logits = torch.full((1, 5, vocab), -5.0)
    logits[0, 0, b] = 5.0  # root predicts b: node 1 accepted, a rejected
    logits[0, 2, x] = 5.0  # after b the target says x (b has no children): bonus x
    logits[0, 1, c] = 5.0  # after a it would say c, but a was rejected
    anc, depth = tree_attention_from_parents(parents) if vectorised else (None, None)
    verdict = verify_tree(logits, tokens, parents, Sampling(), None, 2, anc, depth)
    assert verdict.accepted.tolist() == [1]
    assert verdict.path[0, 0].item() == 1
    assert verdict.next_token.tolist() == [x]
    # now root predicts a, and after a the target predicts d: path a -> d, bonus from d's slot
    logits = torch.full((1, 5, vocab), -5.0)
    logits[0, 0, a] = 5.0
    logits[0, 1, d] = 5.0
    logits[0, 4, x] = 5.0
    verdict = verify_tree(logits, tokens, parents, Sampling(), None, 2, anc, depth)
    assert verdict.accepted.tolist() == [2]
    assert verdict.path[0].tolist() == [0, 3]
    assert verdict.next_token.tolist() == [x]


def test_tree_attention_matrix():
    parents = torch.tensor([[-1, -1, 0, 2]])
    anc, depth = tree_attention_from_parents(parents)
    assert depth[0].tolist() == [0, 1, 1, 2, 3]
    assert anc[0, 4].tolist() == [True, True, False, True, True]
    assert anc[0, 2].tolist() == [True, False, True, False, False]


class _OracleTree(Drafter):
    """A tree drafter whose first branch is wrong and second right: tests non-prefix KV gathers."""

    default_k = 4

    def __init__(self, target):
        self.target = target

    def begin(self, batch, seg):
        pass

    def propose(self, batch):
        # branch 1: two wrong tokens; branch 2: the true next 2 tokens (computed by plain greedy)
        truth = []
        for seq in batch.seqs:
            ids = torch.tensor([seq])
            out = self.target.generate(ids, max_new_tokens=2, do_sample=False, eos_token_id=-1, pad_token_id=0)
            truth.append(out[0, len(seq) :].tolist())
        truth = torch.tensor(truth)
        wrong = (truth + 1) % 90 + 3
        tokens = torch.stack([wrong[:, 0], wrong[:, 1], truth[:, 0], truth[:, 1]], dim=1)
        parents = torch.tensor([[-1, 0, -1, 2]]).expand(len(batch.seqs), -1)
        return Proposal(tokens=tokens, parents=parents, max_depth=2)

    def observe(self, batch, seg):
        pass

    def select_rows(self, rows):
        pass


def test_tree_decoding_gathers_the_accepted_branch(target):
    prompts = make_prompts(2, seed=31)
    ar = SpecEngine(target, ByteTokenizer()).generate(requests(prompts, [15, 15]))
    res = SpecEngine(target, ByteTokenizer(), _OracleTree(target)).generate(requests(prompts, [15, 15]))
    assert [r.token_ids for r in res] == [r.token_ids for r in ar]
    # two accepted per round plus the bonus: about a third of the calls
    assert all(r.stats["target_calls"] <= 7 for r in res)


def test_no_drafter_counts():
    model = tiny_llama(layers=1, hidden=32)
    res = SpecEngine(model, ByteTokenizer(), NoDrafter()).generate([GenRequest([5, 6, 7], 6)])[0]
    assert res.stats["drafted_tokens"] == 0 and res.stats["target_calls"] == len(res.token_ids)


def test_ngram_lookup_prefers_recent_matches_and_extends_periodically():
    d = NgramDrafter(max_ngram=3)
    # the most recent match of (5, 1, 2) leaves 5 tokens before the end; the draft repeats them
    assert d._lookup([1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2], 8) == ([3, 4, 5, 1, 2, 3, 4, 5], 3)
    assert d._lookup([9, 1, 2, 6, 1, 2, 7, 8, 1, 2], 3) == ([7, 8, 1], 2)  # most recent (1, 2), not the first
    assert d._lookup([5, 5, 5], 4) == ([5, 5, 5, 5], 2)
    assert d._lookup([1, 2, 3], 4) == ([], 0)  # nothing repeats: no draft


def test_one_row_runs_without_a_mask_and_matches_generate(target, draft_model, monkeypatch):
    """bs=1 with a chain drafter: every target forward gets no attention mask (the attention
    implementation's own causal path, flash attention's on a GPU), and output is still generate's."""
    from specdec.decode.engine.cache import KVState

    masks = []
    call = KVState._call

    def spy(self, forward, input_ids, mask, *args):
        if self.model is target:  # not the draft (same class); transformers' forward or the direct step
            masks.append(mask)
        return call(self, forward, input_ids, mask, *args)

    prompt = make_prompts(1, seed=9)[0]
    ref = target.generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False, eos_token_id=2, pad_token_id=0)
    monkeypatch.setattr(KVState, "_call", spy)
    for drafter in (NoDrafter(), ModelDrafter(draft_model)):
        masks.clear()
        res = SpecEngine(target, ByteTokenizer(), drafter).generate([GenRequest(prompt, 20)])[0]
        assert res.token_ids == ref[0, len(prompt) :].tolist()
        assert len(masks) >= 2 and all(m is None for m in masks)
