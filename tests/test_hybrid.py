"""A lookup's chains and a head's tree in one verified tree (decode.drafters.hybrid): the merge, greedy
output identical to plain decoding, the exact distribution at T > 0, and the options."""

from __future__ import annotations

import pytest
import torch

from conftest import ByteTokenizer, make_prompts, tiny_llama
from specdec.decode.drafters import hybrid
from specdec.decode.drafters.base import tree_attention_from_parents
from specdec.decode.drafters.heads import DRAFTERS
from specdec.decode.drafters.hybrid import LookupTree, merge_chains
from specdec.decode.drafters.model_free import NgramDrafter
from specdec.decode.engine.loop import SpecEngine
from specdec.decode.engine.types import GenRequest
from specdec.decode.engine.verify import Sampling
from specdec.models.head_artifacts import build_heads
from test_sampling import P_FLOOR, two_token_pvalue


def _heads(kind, target, dtype=torch.float64):
    torch.manual_seed(0)
    return build_heads(kind, target, {"window": 16}).attach(target, init_from_lm_head=True).to(dtype).eval()


def _generate(target, drafter, prompts, max_new=24, sampling=None, **kw):
    reqs = [GenRequest(prompt_ids=p, max_new_tokens=max_new) for p in prompts]
    return SpecEngine(target, ByteTokenizer(), drafter, sampling=sampling, **kw).generate(reqs)


def _tree(tokens, parents):
    from specdec.decode.drafters.base import Proposal

    t, p = torch.tensor([tokens]), torch.tensor([parents])
    attn, depth = tree_attention_from_parents(p)
    return Proposal(tokens=t, parents=p, tree_attn=attn, depth=depth, max_depth=int(depth.max()))


def test_a_chain_shares_the_trees_prefix_and_hangs_the_rest_below_it():
    # root -> 5 -> 6, root -> 7, and a padding node (parent -2) that no chain may extend
    tree = _tree([5, 7, 6, 9], [-1, -1, 0, -2])
    out = merge_chains(tree, [[5, 6, 8, 9]], "cpu")
    assert out.tokens[0].tolist() == [5, 7, 6, 9, 8, 9]
    # the tree's own nodes keep their indices; 8 hangs below 6 (node 2), 9 below 8; the padding stays padding
    assert out.parents[0].tolist() == [-1, -1, 0, -2, 2, 4]
    assert out.depth[0].tolist() == [0, 1, 1, 2, 1, 3, 4]  # root, then per node (padding counts as depth 1)
    # a chain the tree already holds adds nothing; no tree at all makes the chain a path from the root
    assert merge_chains(tree, [[7]], "cpu").tokens.shape[1] == 4
    alone = merge_chains(None, [[3, 4], []], "cpu")
    assert alone.parents.tolist() == [[-1, 0], [-2, -2]]


@pytest.mark.parametrize("kind,tree", [("eagle", "dynamic"), ("eagle", "static"), ("medusa", "static")])
@pytest.mark.parametrize("bs", [1, 3])
def test_greedy_output_is_plain_decodings_and_both_sources_draft(target, kind, tree, bs):
    prompts = [p + p[:6] + p[:6] for p in make_prompts(bs, seed=30 + bs)]  # repeats, so the lookup finds matches
    ar = _generate(target, None, prompts, max_new=32)
    drafter = LookupTree(DRAFTERS[kind](_heads(kind, target), target, tree=tree, tree_tokens=8, top_k=2), NgramDrafter())
    out = _generate(target, drafter, prompts, max_new=32)
    assert [r.token_ids for r in out] == [r.token_ids for r in ar]
    assert drafter.sources["tree"] > 0 and sum(r.stats["drafted_tokens"] for r in out) > 0


def test_long_matches_draft_the_lookups_chain_alone(target, monkeypatch):
    """Every round whose rows all match long drafts the lookup's chain and leaves the head idle; with no
    round long enough, the head drafts in the rounds its gate gives it."""
    prompts = [list(range(10, 30)) * 3]
    heads = DRAFTERS["eagle"](_heads("eagle", target), target, tree="dynamic", tree_tokens=8, top_k=2)
    drafter = LookupTree(heads, NgramDrafter())
    grown = []
    real = heads.propose
    monkeypatch.setattr(heads, "propose", lambda batch: grown.append(1) or real(batch))
    out = _generate(target, drafter, prompts, max_new=32)
    assert out[0].token_ids == _generate(target, None, prompts, max_new=32)[0].token_ids
    assert drafter.sources["lookup"] > 0 and len(grown) == drafter.sources["tree"]
    monkeypatch.setattr(hybrid, "STRONG_MATCH", 99)
    drafter = LookupTree(DRAFTERS["eagle"](_heads("eagle", target), target, tree="dynamic", tree_tokens=8, top_k=2), NgramDrafter())
    _generate(target, drafter, prompts, max_new=32)
    assert drafter.sources["lookup"] == 0 and drafter.sources["tree"] > 0


def _stale_attention_merge(tree, chains, device):
    """A broken merge: the chains' nodes join the tree, but the tree's ancestor matrix is the head's own,
    padded, so a chain's node sees itself only (not the root, not its parent): its logits are the
    target's for another context."""
    merged = merge_chains(tree, chains, device)
    n_old = tree.tokens.shape[1]
    attn = merged.tree_attn.clone()
    attn[:, n_old + 1 :, :] = False
    idx = torch.arange(n_old + 1, attn.shape[1])
    attn[:, idx, idx] = True
    merged.tree_attn = attn
    return merged


@pytest.mark.parametrize("broken", [False, True])
def test_sampling_keeps_the_targets_two_token_distribution(monkeypatch, broken):
    """At T = 0.8 the first two tokens follow the target's exact joint distribution with the lookup's
    chains merged into every tree (the verification draws each token by the race, whatever the candidates); a
    merge whose chain nodes do not see their context fails the test."""
    vocab = 12
    target = tiny_llama(vocab=vocab, hidden=32, layers=2, seed=3)
    with torch.no_grad():
        target.lm_head.weight.mul_(0.25)  # many tokens matter
    monkeypatch.setattr(hybrid, "STRONG_MATCH", 99)  # every round merges
    monkeypatch.setattr(hybrid.HeadGate, "choose", lambda self: True)  # with the head, whatever its measured rate
    if broken:
        monkeypatch.setattr(hybrid, "merge_chains", _stale_attention_merge)
    heads = DRAFTERS["eagle"](_heads("eagle", target), target, tree="static", tree_tokens=4, top_k=2)
    drafter = LookupTree(heads, NgramDrafter())
    prompt = [5, 7, 5, 7, 5]  # repeats, so the lookup proposes 7, 5, ...
    sampling = Sampling(temperature=0.8)
    engine = SpecEngine(target, ByteTokenizer(), drafter, sampling, num_draft=3, seed=123, eos_ids=[])
    res = engine.generate([GenRequest(prompt, 2) for _ in range(6000)])
    assert sum(r.stats["accepted_tokens"] for r in res) > 0
    p = two_token_pvalue(res, target, prompt, sampling)
    assert (p < P_FLOOR) if broken else (p > P_FLOOR)


def test_lookup_options_are_checked_before_anything_loads():
    from specdec.decode.drafters.registry import DRAFTER_KINDS, DrafterChoice, check_drafter_options
    from specdec.decode.jobs.validate import check_drafter_traits, validate_options
    from specdec.decode.options import DecodeOptions
    from specdec.models.errors import UsageError

    with pytest.raises(UsageError, match="--lookup must be one of ngram, suffix"):
        validate_options(DecodeOptions(drafter="ngram", lookup="recycle"))
    with pytest.raises(UsageError, match="--lookup applies to"):
        check_drafter_options("ngram", DecodeOptions(drafter="ngram", lookup="ngram"))
    eagle = DrafterChoice("heads", "eagle", "heads", DRAFTER_KINDS["eagle"])
    check_drafter_traits(eagle, DecodeOptions(drafter="heads", lookup="ngram", max_ngram=4))
    check_drafter_traits(eagle, DecodeOptions(drafter="heads", lookup="suffix", suffix_cache="cache"))
    with pytest.raises(UsageError, match="--suffix-cache applies to eagle heads only with --lookup suffix"):
        check_drafter_traits(eagle, DecodeOptions(drafter="heads", lookup="ngram", suffix_cache="cache"))
    with pytest.raises(UsageError, match="max-ngram=N applies to eagle heads only with --lookup ngram"):
        check_drafter_traits(eagle, DecodeOptions(drafter="heads", max_ngram=4))


class _Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_the_gate_keeps_to_the_faster_choice_and_tries_the_other_less_often_the_slower_it_is():
    clock = _Clock()
    gate = hybrid.HeadGate(clock)
    gate.record(5)  # nothing open: nothing measured
    assert gate.rate(True) is None and gate.rate(False) is None

    def round_(tokens, seconds):
        choice = gate.choose()
        clock.now += seconds[choice]
        gate.record(tokens[choice])
        return choice

    # with the head: 3 tokens in 2 s; without: 2 tokens in 1 s. Both measured first, the head first.
    tokens, seconds = {True: 3, False: 2}, {True: 2.0, False: 1.0}
    choices = [round_(tokens, seconds) for _ in range(24)]
    assert choices[:2] == [True, False]
    assert gate.rate(True) == pytest.approx(1.5) and gate.rate(False) == pytest.approx(2.0)
    # the head measured 2.0 / 1.5 times slower: tried once in 8 * 4/3 = 10.7 rounds, every 11th
    assert gate.interval() == pytest.approx(hybrid.EXPLORE_EVERY * 4 / 3)
    assert [i + 1 for i, c in enumerate(choices[2:], start=2) if c] == [13, 24]
    # the head turns faster (3 tokens in 0.5 s): it takes over once its tried rounds outweigh its slow history
    # (the second try here), and the choice without it, now 3 times slower, is tried once in 24 rounds
    seconds[True] = 0.5
    choices = [round_(tokens, seconds) for _ in range(60)]
    assert [i for i, c in enumerate(choices[:20]) if c] == [10, 19]
    assert all(choices[19:42]) and not choices[42] and all(choices[43:])
    assert gate.rate(True) > gate.rate(False)
    assert gate.interval() == pytest.approx(hybrid.EXPLORE_EVERY * gate.rate(True) / gate.rate(False))
    assert gate.interval() > 20
    # however slow a choice measured, it is tried again within EXPLORE_AT_MOST_EVERY rounds
    seconds[False] = 1000.0
    choices = [round_(tokens, seconds) for _ in range(3 * hybrid.EXPLORE_AT_MOST_EVERY)]
    assert gate.interval() == hybrid.EXPLORE_AT_MOST_EVERY and 1 <= choices.count(False) <= 4


def test_a_head_that_does_not_pay_is_left_idle_and_the_output_stays_plain_decodings(target, monkeypatch):
    import time

    prompts = make_prompts(2, seed=41)
    heads = DRAFTERS["eagle"](_heads("eagle", target), target, tree="dynamic", tree_tokens=8, top_k=2)
    real = heads.propose
    monkeypatch.setattr(heads, "propose", lambda batch: time.sleep(0.05) or real(batch))  # a slow head
    drafter = LookupTree(heads, NgramDrafter())
    out = _generate(target, drafter, prompts, max_new=48)
    assert [r.token_ids for r in out] == [r.token_ids for r in _generate(target, None, prompts, max_new=48)]
    assert drafter.sources["tree"] >= 1 and drafter.sources["idle"] > 2 * drafter.sources["tree"]


def test_under_a_static_head_the_lookups_chains_are_sized_by_the_cost_model_not_the_trees_depth(target):
    """A static-tree head decides nothing about lengths, but the lookup's chains beside it are still sized by the
    engine's cost model per match class (as ngram's alone are): on a CPU the engine hands the hybrid its
    DraftLength (before, such a hybrid had none: its chains ran to --num-draft whatever they cost), and a long
    repeat drafts chains longer than the head's tree is deep."""
    prompts = [list(range(10, 40)) * 3]
    heads = DRAFTERS["medusa"](_heads("medusa", target), target, tree="static", tree_tokens=4, top_k=1)
    drafter = LookupTree(heads, NgramDrafter())
    widths = []
    real = drafter.propose

    def spy(batch):
        proposal = real(batch)
        if proposal is not None and not proposal.is_tree:
            widths.append(proposal.tokens.shape[1])
        return proposal

    drafter.propose = spy
    engine = SpecEngine(target, ByteTokenizer(), drafter)
    assert engine.length is not None and drafter.length is engine.length
    for width in range(1, 18):  # a machine where width costs nothing, whatever this one measures: the longest chains pay
        for _ in range(2):
            engine.length.record_forward(1, width, 1e-3)
    engine.length.record_forward = lambda *a: None
    out = engine.generate([GenRequest(prompt_ids=prompts[0], max_new_tokens=48)])
    assert out[0].token_ids == _generate(target, None, prompts, max_new=48)[0].token_ids
    assert widths and max(widths) > heads.depth


def test_the_heads_first_tree_waits_for_a_measured_plain_step(target):
    """Until a plain step of the batch is measured (the first rounds ask for one), the head grows no tree: sized by
    costs known only by their prior, a first tree over 8 rows could cost tens of plain steps."""
    from types import SimpleNamespace

    from specdec.decode.engine.length import DraftLength

    heads = DRAFTERS["eagle"](_heads("eagle", target), target, tree="dynamic", tree_tokens=8, top_k=2)
    grown = []
    heads.propose = lambda batch: grown.append(1)
    drafter = LookupTree(heads, NgramDrafter())
    drafter.length = DraftLength(8)
    batch = SimpleNamespace(seqs=[[1, 2, 3, 4]] * 8, device="cpu", num_draft=8)
    for _ in range(3):
        drafter.propose(batch)
    assert not grown and drafter.sources["idle"] == 3 and drafter.gate.rounds == 0
    for width in (1, 1):  # the plain step asked for: the first run of a width is not timed
        drafter.length.record_forward(8, width, 0.1)
    drafter.propose(batch)
    assert grown == [1] and drafter.sources["tree"] == 1  # the gate measures the head first
