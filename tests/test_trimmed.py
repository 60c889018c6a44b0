"""The target drafting for itself over a token set (decode.drafters.trimmed): the set's output layer, greedy
output identical to plain decoding and to transformers' generate (drafts rejected where the set misses the
target's token), the lookup's long matches, the exact two-token distribution at T > 0, and the spec."""

from __future__ import annotations

import pytest
import torch

from conftest import ByteTokenizer, make_prompts, tiny_llama
from specdec.decode.drafters import trimmed
from specdec.decode.drafters.model_free import NgramDrafter
from specdec.decode.drafters.trimmed import TrimmedDrafter, TrimmedHead
from specdec.decode.engine.loop import SpecEngine
from specdec.decode.engine.types import GenRequest
from specdec.decode.engine.verify import Sampling
from test_sampling import P_FLOOR, two_token_pvalue


def _generate(target, drafter, prompts, max_new=24, sampling=None, **kw):
    reqs = [GenRequest(prompt_ids=p, max_new_tokens=max_new) for p in prompts]
    return SpecEngine(target, ByteTokenizer(), drafter, sampling=sampling, eos_ids=[], **kw).generate(reqs)


def test_the_sets_layer_is_the_targets_rows_and_minus_infinity_elsewhere(target):
    head = TrimmedHead(target.lm_head, None, torch.tensor([3, 9, 9, 40]))
    assert head.ids.tolist() == [3, 9, 40] and head.add([9, 50, 3, 200]) == 1  # 200 is past the vocabulary
    h = torch.randn(2, 5, target.config.hidden_size, dtype=target.lm_head.weight.dtype)
    out = head(h)
    full = target.lm_head(h)
    inside = torch.tensor([3, 9, 40, 50])
    torch.testing.assert_close(out[..., inside], full[..., inside].detach(), rtol=1e-12, atol=1e-12)  # a draft: not bit for bit
    rest = torch.ones(full.shape[-1], dtype=torch.bool)
    rest[inside] = False
    assert torch.isinf(out[..., rest]).all() and (out[..., rest] < 0).all()


@pytest.mark.parametrize("lookup", [False, True])
@pytest.mark.parametrize("bs", [1, 3])
def test_greedy_output_is_plain_decodings_and_generates(target, bs, lookup):
    """A set of half the vocabulary: most drafts are accepted, the ones the set misses are rejected, and the
    text is plain decoding's and transformers' generate's, token for token."""
    prompts = make_prompts(bs, seed=40 + bs)
    ar = _generate(target, None, prompts, max_new=32)
    drafter = TrimmedDrafter(target, torch.arange(0, 96, 2), NgramDrafter() if lookup else None)
    out = _generate(target, drafter, prompts, max_new=32)
    assert [r.token_ids for r in out] == [r.token_ids for r in ar]
    for p, r in zip(prompts, out):
        ref = target.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long), max_new_tokens=32,
                              do_sample=False, pad_token_id=0, eos_token_id=None)[0, len(p):].tolist()
        assert r.token_ids == ref
    drafted = sum(r.stats["drafted_tokens"] for r in out)
    accepted = sum(r.stats["accepted_tokens"] for r in out)
    assert 0 < accepted < drafted


def test_the_set_grows_with_the_text_so_a_row_drafts_its_own_tokens(target):
    """An empty set still drafts: every token of the prompt and of what the target wrote joins it."""
    prompt = make_prompts(1, seed=7)[0]
    drafter = TrimmedDrafter(target, torch.tensor([], dtype=torch.long))
    out = _generate(target, drafter, [prompt], max_new=40)
    assert out[0].token_ids == _generate(target, None, [prompt], max_new=40)[0].token_ids
    assert set(prompt) | set(out[0].token_ids) <= set(drafter.head.ids.tolist())


def test_the_lookups_guesses_are_fed_with_the_drafts_and_change_nothing_drafted(target):
    """One row with n-gram lookup: a repeating prompt's drafts are partly fed as guesses, several a forward;
    the chain drafted is the one the set's argmax draws alone, and the text is plain decoding's."""
    prompt = list(range(10, 30)) * 3
    plain = _generate(target, None, [prompt], max_new=40)[0].token_ids
    alone = TrimmedDrafter(target, torch.arange(0, 96, 2))
    guessed = TrimmedDrafter(target, torch.arange(0, 96, 2), NgramDrafter())
    outs = [_generate(target, d, [prompt], max_new=40)[0] for d in (alone, guessed)]
    assert [r.token_ids for r in outs] == [plain, plain]
    assert [r.stats["accepted_tokens"] for r in outs][0] == outs[1].stats["accepted_tokens"]
    assert guessed.fed["guessed"] > 0 and alone.fed["guessed"] == 0


@pytest.mark.parametrize("broken,lookup", [(None, False), (None, True), ("states", False), ("states", True)])
def test_sampling_keeps_the_targets_two_token_distribution(monkeypatch, broken, lookup):
    """At T = 0.8 the first two tokens follow the target's exact joint distribution, drafts drawn from the
    target's softmax over half the vocabulary, one a round (a rejected draft's second token comes from
    the next round, after the cache kept the accepted slots only). A verification that reads each position's
    output from the wrong state fails the test. With the lookup's guesses fed (the prompt repeats), alike."""
    vocab = 12
    target = tiny_llama(vocab=vocab, hidden=32, layers=2, seed=3)
    with torch.no_grad():
        target.lm_head.weight.mul_(0.25)  # many tokens matter
    if broken == "states":
        real_propose = TrimmedDrafter.propose

        def shifted(self, batch):
            proposal = real_propose(self, batch)
            proposal.states = proposal.states.roll(1, dims=1)  # the root verified by the last draft's state
            return proposal

        monkeypatch.setattr(TrimmedDrafter, "propose", shifted)
    prompt = [5, 7, 5, 7, 5]
    drafter = TrimmedDrafter(target, torch.tensor([0, 1, 2, 3, 5, 7]), NgramDrafter() if lookup else None)
    # the set stays these 6 tokens (6000 rows' text would bring every token of the vocabulary into it): q is not p
    monkeypatch.setattr(drafter.head, "add", lambda tokens: 0)
    sampling = Sampling(temperature=0.8)
    engine = SpecEngine(target, ByteTokenizer(), drafter, sampling, num_draft=1, seed=123, eos_ids=[])
    res = engine.generate([GenRequest(prompt, 2) for _ in range(6000)])
    assert 0 < sum(r.stats["accepted_tokens"] for r in res) < sum(r.stats["drafted_tokens"] for r in res)
    p = two_token_pvalue(res, target, prompt, sampling)
    assert (p < P_FLOOR) if broken else (p > P_FLOOR)


def test_a_spec_names_a_draft_vocabulary_or_is_refused(tmp_path):
    from specdec.models.errors import UsageError
    from specdec.models.vocab import DraftVocab

    trimmed.check_trimmed_spec("trimmed")
    with pytest.raises(UsageError, match="trimmed:PATH names a draft vocabulary"):
        trimmed.check_trimmed_spec(f"trimmed:{tmp_path / 'none'}")
    DraftVocab(torch.tensor([4, 8, 15, 0]), 96).save(tmp_path)
    trimmed.check_trimmed_spec(f"trimmed:{tmp_path}")
    drafter = trimmed.build_trimmed(f"trimmed:{tmp_path}", tiny_llama(seed=0), None)
    assert sorted(drafter.head.ids.tolist()) == [0, 4, 8, 15]


def test_the_factory_refuses_a_lookup_it_cannot_feed_and_a_target_off_the_cpu():
    from specdec.decode.drafters.registry import NAMED_DRAFTERS
    from specdec.decode.options import DecodeOptions
    from specdec.models.errors import UsageError

    model = tiny_llama(seed=0)
    with pytest.raises(UsageError, match="--lookup ngram, not suffix"):
        NAMED_DRAFTERS["trimmed"]("trimmed", model, None, DecodeOptions(lookup="suffix"))
    with pytest.raises(UsageError, match="drafts on a CPU"):
        NAMED_DRAFTERS["trimmed"]("trimmed", model.to("meta"), None, DecodeOptions())
    assert NAMED_DRAFTERS["trimmed"]("trimmed", tiny_llama(seed=0), None, DecodeOptions(lookup="ngram")).lookup is not None


def test_on_a_gguf_targets_blocks_the_sets_layer_is_the_kernels_rows_at_any_width():
    """A Q8_0 output layer: the set's logits are the blocks kernel's own for those rows, for a few positions and
    for more than one kernel call takes (``blocks.MAX_ROWS``)."""
    from test_blocks import _q8_0_output_layer

    from gguf_files import random_blocks
    from specdec.models import blocks

    vocab, hidden = 16384, 64
    raw = random_blocks("Q8_0", vocab, hidden, seed=4, scale=0.5)
    _, linear, fast = _q8_0_output_layer(raw, hidden)
    head = TrimmedHead(linear, fast, torch.tensor([5, 700, 16000]))
    for rows in (3, blocks.MAX_ROWS + 5):
        h = torch.randn(rows, hidden)
        exact = blocks.matmul(h, fast.blocks)[:, [5, 700, 16000]]
        out = head(h)
        assert torch.equal(out[:, [5, 700, 16000]], exact)
        assert torch.isinf(out).sum() == rows * (vocab - 3)
