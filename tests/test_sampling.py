"""Speculative sampling at T>0 reproduces the target's distribution (chi-square tests, fixed seeds),
and a deliberately broken acceptance rule fails the same test."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import ByteTokenizer, tiny_llama

from specdec.decode.drafters.draft_model import ModelDrafter
from specdec.decode.drafters.model_free import NgramDrafter, RecycleDrafter
from specdec.decode.engine.loop import SpecEngine
from specdec.decode.engine.types import GenRequest
from specdec.decode.engine.verify import Sampling, logits_to_probs, sample_from, verify_chain, verify_tree

P_FLOOR = 1e-3  # a correct sampler fails this by chance once in a thousand seeds; a biased one always


def chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson chi-square, merging cells whose expected count is below 5 into one."""
    n = counts.sum()
    expected = probs * n
    small = expected < 5
    obs = torch.cat([counts[~small], counts[small].sum().reshape(1)]) if small.any() else counts
    exp = torch.cat([expected[~small], expected[small].sum().reshape(1)]) if small.any() else expected
    keep = exp > 0
    stat = ((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum()
    dof = int(keep.sum()) - 1
    return float(1 - torch.distributions.Chi2(torch.tensor(float(dof))).cdf(stat))


def first_token_setup(n=200_000, vocab=6, k=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(k + 1, vocab, generator=g) * 1.5
    q_logits = torch.randn(k, vocab, generator=g) * 1.5
    sampling = Sampling(temperature=0.8, top_p=0.95)
    q = logits_to_probs(q_logits, sampling)
    drafts = torch.multinomial(q, n, replacement=True, generator=g).T  # [n, k], drafts ~ q
    return g, logits.expand(n, -1, -1), q.expand(n, -1, -1), drafts, sampling


@pytest.mark.parametrize("with_q", [True, False])
def test_chain_first_token_matches_target(with_q):
    g, logits, q, drafts, sampling = first_token_setup()
    verdict = verify_chain(logits, drafts, q if with_q else None, sampling, g)
    first = torch.where(verdict.accepted > 0, drafts[:, 0], verdict.next_token)
    p0 = logits_to_probs(logits[0, 0], sampling)
    assert chi2_pvalue(torch.bincount(first, minlength=p0.numel()).double(), p0.double()) > P_FLOOR
    # second emitted token, given the first draft was accepted, follows p at position 1
    acc = verdict.accepted > 0
    second = torch.where(verdict.accepted > 1, drafts[:, 1], verdict.next_token)[acc]
    p1 = logits_to_probs(logits[0, 1], sampling)
    assert chi2_pvalue(torch.bincount(second, minlength=p1.numel()).double(), p1.double()) > P_FLOOR


def test_broken_rule_fails_the_same_test():
    """Resampling from p (instead of the residual max(p - q, 0)) after a rejection is biased."""
    g, logits, q, drafts, sampling = first_token_setup()
    p = logits_to_probs(logits[:, 0], sampling)
    x = drafts[:, 0]
    px, qx = p.gather(1, x[:, None]).squeeze(1), q[:, 0].gather(1, x[:, None]).squeeze(1)
    accept = torch.rand(x.shape, generator=g) * qx < px
    resampled = sample_from(p, torch.rand(x.shape, generator=g))  # the bug: p, not the residual
    first = torch.where(accept, x, resampled)
    p0 = p[0]
    assert chi2_pvalue(torch.bincount(first, minlength=p0.numel()).double(), p0.double()) < 1e-6


def test_tree_sampling_first_token_matches_target():
    """Sibling candidates tried in order with the residual update emit exactly p."""
    n, vocab = 100_000, 6
    g = torch.Generator().manual_seed(1)
    logits = (torch.randn(1, 4, vocab, generator=g) * 1.5).expand(n, -1, -1)
    tokens = torch.tensor([[0, 1, 2]]).expand(n, -1)  # three children of the root
    parents = torch.tensor([[-1, -1, -1]]).expand(n, -1)
    sampling = Sampling(temperature=0.7)
    verdict = verify_tree(logits, tokens, parents, sampling, g, max_depth=1)
    first = torch.where(verdict.accepted > 0, tokens.gather(1, verdict.path[:, :1].clamp(min=0)).squeeze(1), verdict.next_token)
    p0 = logits_to_probs(logits[0, 0], sampling)
    assert chi2_pvalue(torch.bincount(first, minlength=vocab).double(), p0.double()) > P_FLOOR


def exact_two_token_distribution(model, prompt, sampling):
    with torch.no_grad():
        p1 = logits_to_probs(model(torch.tensor([prompt])).logits[0, -1], sampling)
        vocab = p1.numel()
        ids = torch.tensor([prompt + [t] for t in range(vocab)])
        p2 = logits_to_probs(model(ids).logits[:, -1], sampling)
    return (p1[:, None] * p2).reshape(-1)


def two_token_pvalue(results, model, prompt, sampling) -> float:
    """The chi-square p-value of the first two tokens of ``results`` against ``model``'s exact joint
    distribution of the two tokens after ``prompt``."""
    exact = exact_two_token_distribution(model, prompt, sampling)
    vocab = math.isqrt(exact.numel())
    pairs = torch.tensor([r.token_ids[0] * vocab + r.token_ids[1] for r in results])
    return chi2_pvalue(torch.bincount(pairs, minlength=vocab * vocab).double(), exact.double())


@pytest.mark.parametrize("name", ["draft", "ngram", "recycle"])
def test_engine_samples_the_target_joint_distribution(name):
    vocab = 12
    target = tiny_llama(vocab=vocab, hidden=32, layers=2, seed=3)
    with torch.no_grad():
        target.lm_head.weight.mul_(0.25)  # undo most of the sharpening: many tokens matter
    drafter = {
        "draft": lambda: ModelDrafter(tiny_llama(vocab=vocab, hidden=32, layers=1, seed=4)),
        "ngram": lambda: NgramDrafter(),
        "recycle": lambda: RecycleDrafter(top_k=3, max_depth=2),
    }[name]()
    prompt = [5, 7, 5, 7, 5]  # repeats, so the n-gram drafter proposes
    sampling = Sampling(temperature=0.8)
    engine = SpecEngine(target, ByteTokenizer(), drafter, sampling, num_draft=3, seed=123, eos_ids=[])
    rows = 6000
    res = engine.generate([GenRequest(prompt, 2) for _ in range(rows)])
    assert two_token_pvalue(res, target, prompt, sampling) > P_FLOOR
    assert sum(r.stats["accepted_tokens"] for r in res) > 0  # drafts were actually tested


def test_raced_samples_do_not_depend_on_the_drafter_the_draft_length_or_the_batch():
    """At T>0 without a nucleus, each token is drawn by the race (verify.race_noise): noise fixed by
    (seed, request, position), so ar, n-gram, recycle's trees and any draft length or batch size give
    one text per seed, and another seed another text."""
    from conftest import make_prompts

    target = tiny_llama(seed=3)
    prompts = [p + p[:4] for p in make_prompts(5, seed=2)]  # repeats, so the n-gram drafter proposes
    sampling = Sampling(temperature=0.8)

    def run(drafter, num_draft=None, seed=9, batch=5):
        engine = SpecEngine(target, ByteTokenizer(), drafter, sampling, num_draft=num_draft, seed=seed, eos_ids=[])
        out = {}
        for i, res in engine.stream((GenRequest(p, 24) for p in prompts), batch):
            out[i] = res
        return [out[i].token_ids for i in range(len(prompts))], sum(r.stats["accepted_tokens"] for r in out.values())

    ar, _ = run(None)
    for drafter, k, batch in ((NgramDrafter(), 2, 5), (NgramDrafter(), 6, 2), (RecycleDrafter(top_k=3, max_depth=2), None, 3)):
        text, accepted = run(drafter, k, batch=batch)
        assert text == ar and accepted > 0
    assert run(None, seed=10)[0] != ar


def test_a_race_with_wrongly_scaled_noise_fails_the_distribution_test(monkeypatch):
    """The engine's raced draws pass the two-token chi-square test; halving the Gumbel noise (a sharper,
    wrong distribution) fails it."""
    from specdec.decode.engine import loop

    vocab = 12
    target = tiny_llama(vocab=vocab, hidden=32, layers=2, seed=3)
    with torch.no_grad():
        target.lm_head.weight.mul_(0.25)
    prompt = [5, 7, 5, 7, 5]
    sampling = Sampling(temperature=0.8)
    engine = SpecEngine(target, ByteTokenizer(), NgramDrafter(), sampling, num_draft=3, seed=123, eos_ids=[])
    res = engine.generate([GenRequest(prompt, 2) for _ in range(4000)])
    assert two_token_pvalue(res, target, prompt, sampling) > P_FLOOR
    real = loop.race_noise
    monkeypatch.setattr(loop, "race_noise", lambda *a, **k: real(*a, **k) * 0.5)
    res = SpecEngine(target, ByteTokenizer(), NgramDrafter(), sampling, num_draft=3, seed=123, eos_ids=[]).generate(
        [GenRequest(prompt, 2) for _ in range(4000)])
    assert two_token_pvalue(res, target, prompt, sampling) < P_FLOOR
