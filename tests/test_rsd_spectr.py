"""RSD and SpecTr verification: both emit exactly the target's distribution at T>0 (chi-square of the
first two emitted tokens, fixed seeds), a deliberately broken variant of each fails the same test,
and at T=0 both are plain greedy decoding."""

from __future__ import annotations

import pytest
import torch
from conftest import ByteTokenizer, make_prompts, tiny_llama
from test_sampling import P_FLOOR, chi2_pvalue, exact_two_token_distribution

from specdec.decode.engine import verify
from specdec.decode.drafters.draft_model import ModelDrafter
from specdec.decode.drafters.base import NoDrafter, TreeTemplate
from specdec.decode.engine.loop import SpecEngine
from specdec.decode.options import DecodeOptions, parse_method
from specdec.decode.engine.types import GenRequest
from specdec.decode.engine.verify import Sampling, logits_to_probs, verify_tree_drafted

VOCAB, WIDTH = 6, 3


def draw(q: torch.Tensor, scheme: str, g: torch.Generator) -> torch.Tensor:
    """WIDTH siblings per row of q [n, V], as the drafter draws them."""
    if scheme == "spectr":
        return torch.multinomial(q, WIDTH, replacement=True, generator=g)
    gumbel = -(-torch.rand(q.shape, generator=g).clamp(min=1e-20).log()).log()
    return (q.log() + gumbel).topk(WIDTH, dim=-1).indices


def two_token_trial(scheme: str, n: int = 120_000, seed: int = 0):
    """Rows of a two-level tree (WIDTH siblings at the root, WIDTH under the first); the target's and
    the draft's second-token distributions depend on the first token. (pairs [n], exact joint [V*V])."""
    g = torch.Generator().manual_seed(seed)
    sampling = Sampling(temperature=0.9, top_p=0.95)  # top-p gives q zeros: supports smaller than WIDTH
    p_logits = torch.randn(1 + VOCAB, VOCAB, generator=g) * 1.5  # row 0: root, row 1 + x: after x
    q_logits = torch.randn(1 + VOCAB, VOCAB, generator=g) * 1.5
    q = logits_to_probs(q_logits, sampling)
    level1 = draw(q[0].expand(n, -1), scheme, g)
    level2 = draw(q[1 + level1[:, 0]], scheme, g)
    tokens = torch.cat([level1, level2], 1)  # [n, 2 * WIDTH], level-major like ModelDrafter's trees
    tpl = TreeTemplate([-1] * WIDTH + [0] * WIDTH, list(range(WIDTH)) * 2).tensors("cpu")
    parents = tpl["parents"].expand(n, -1)
    logits = torch.cat([p_logits[0].expand(n, 1, -1), p_logits[1 + tokens]], 1)  # the target after each node
    node_q = torch.cat([q[0].expand(n, WIDTH, -1), q[1 + level1[:, :1]].expand(n, WIDTH, -1)], 1)
    v = verify_tree_drafted(logits, tokens, parents, node_q, scheme, sampling, g, max_depth=2)
    path_tok = tokens.gather(1, v.path.clamp(min=0))
    first = torch.where(v.accepted > 0, path_tok[:, 0], v.next_token)
    second = torch.where(v.accepted > 1, path_tok[:, 1], v.next_token)
    second = torch.where(v.accepted > 0, second, torch.full_like(second, -1))  # rows that emitted one token
    # rows that stopped after one token: the second follows p after it; draw it from the exact table
    p = logits_to_probs(p_logits, sampling)
    need = second < 0
    second[need] = torch.multinomial(p[1 + first[need]], 1, generator=g).squeeze(1)
    exact = (p[0][:, None] * p[1:]).reshape(-1)
    return first * VOCAB + second, exact, v


@pytest.mark.parametrize("scheme", ["rsd", "spectr"])
def test_two_tokens_match_target(scheme):
    pairs, exact, v = two_token_trial(scheme)
    assert chi2_pvalue(torch.bincount(pairs, minlength=VOCAB * VOCAB).double(), exact.double()) > P_FLOOR
    # both levels and later siblings were accepted, not just the first candidate
    assert (v.accepted == 2).any() and (v.path[:, 0] > 0).any()


def test_rsd_without_removing_the_rejected_token_fails(monkeypatch):
    """Testing the next sibling against q, not q without the rejected tokens, is biased."""
    real = verify._rsd_reject
    monkeypatch.setattr(verify, "_rsd_reject", lambda p, q, x: (real(p, q, x)[0], q))
    pairs, exact, _ = two_token_trial("rsd")
    assert chi2_pvalue(torch.bincount(pairs, minlength=VOCAB * VOCAB).double(), exact.double()) < 1e-6


def test_spectr_without_the_rho_search_fails(monkeypatch):
    """rho = 1 with k candidates accepts too often: the residual p - m c goes negative and is clipped."""
    monkeypatch.setattr(verify, "spectr_rho", lambda p, q, k: torch.ones(p.shape[0], dtype=p.dtype))
    pairs, exact, _ = two_token_trial("spectr")
    assert chi2_pvalue(torch.bincount(pairs, minlength=VOCAB * VOCAB).double(), exact.double()) < 1e-6


def test_spectr_rho_makes_the_residual_a_distribution():
    g = torch.Generator().manual_seed(5)
    p = torch.softmax(torch.randn(64, 10, generator=g) * 2, -1)
    q = torch.softmax(torch.randn(64, 10, generator=g) * 2, -1)
    for k in (1, 2, 4):
        rho = verify.spectr_rho(p, q, torch.full((64,), k))
        m = torch.minimum(q, p / rho[:, None])
        c = verify._spectr_c(m.sum(-1), torch.full((64,), k))
        assert (rho >= 1).all() and (rho <= k).all() and (c <= rho + 1e-5).all()
        assert (k == 1) == bool((rho == 1).all())


def engine_pairs(scheme: str, rows: int = 4000):
    vocab = 12
    target = tiny_llama(vocab=vocab, hidden=32, layers=2, seed=3)
    with torch.no_grad():
        target.lm_head.weight.mul_(0.25)  # undo most of the sharpening: many tokens matter
    drafter = ModelDrafter(tiny_llama(vocab=vocab, hidden=32, layers=1, seed=4), scheme=scheme, width=3)
    prompt = [5, 7, 5, 7, 5]
    sampling = Sampling(temperature=0.8)
    engine = SpecEngine(target, ByteTokenizer(), drafter, sampling, num_draft=2, seed=11, eos_ids=[])
    res = engine.generate([GenRequest(prompt, 2) for _ in range(rows)])
    pairs = torch.tensor([r.token_ids[0] * vocab + r.token_ids[1] for r in res])
    exact = exact_two_token_distribution(target, prompt, sampling)
    return pairs, exact, res, vocab


@pytest.mark.parametrize("scheme", ["rsd", "spectr"])
def test_engine_samples_the_target_joint_distribution(scheme):
    pairs, exact, res, vocab = engine_pairs(scheme)
    assert chi2_pvalue(torch.bincount(pairs, minlength=vocab * vocab).double(), exact.double()) > P_FLOOR
    assert sum(r.stats["accepted_tokens"] for r in res) > 0


@pytest.mark.parametrize("scheme", ["rsd", "spectr"])
@pytest.mark.parametrize("bsz", [1, 3])
def test_greedy_is_plain_greedy(target, draft_model, scheme, bsz):
    prompts = make_prompts(bsz, seed=bsz)
    requests = [GenRequest(p, 24) for p in prompts]

    def run(drafter):
        engine = SpecEngine(target, ByteTokenizer(), drafter, Sampling(), num_draft=3, seed=0, eos_ids=[])
        return [r.token_ids for r in engine.generate(list(requests))]

    spec = ModelDrafter(draft_model, scheme=scheme, width=3)
    assert run(spec) == run(NoDrafter())


@pytest.mark.parametrize("scheme", ["rsd", "spectr"])
def test_greedy_with_rows_joining_a_running_batch(target, draft_model, scheme):
    """SpecTr widens the draft's cache to B x width rows for a round: admissions see it collapsed again."""
    requests = [GenRequest(p, 4 + 9 * (i % 3)) for i, p in enumerate(make_prompts(7, seed=3))]

    def run(drafter):
        engine = SpecEngine(target, ByteTokenizer(), drafter, Sampling(), num_draft=3, seed=0, eos_ids=[])
        return {i: r.token_ids for i, r in engine.stream(iter(requests), batch_size=3)}

    assert run(ModelDrafter(draft_model, scheme=scheme, width=2)) == run(NoDrafter())


def test_method_option_selects_the_scheme(tiny_family):
    from specdec.decode.drafters.registry import build_drafter
    from specdec.decode.jobs.build import load_decode_target
    from specdec.models.errors import UsageError

    head, overrides = parse_method("draft+verify=spectr+k=3+top-k=3")
    opts = DecodeOptions(device="cpu").with_overrides(overrides)
    assert (head, opts.drafting.verify, opts.drafting.num_draft) == ("draft", "spectr", 3)
    target, tokenizer, _ = load_decode_target(str(tiny_family / "target"), opts)
    drafter = build_drafter(str(tiny_family / "draft"), target, tokenizer, opts)
    assert isinstance(drafter, ModelDrafter) and (drafter.scheme, drafter.width) == ("spectr", 3)
    with pytest.raises(UsageError, match="verify must be one of"):
        build_drafter(str(tiny_family / "draft"), target, tokenizer, opts.with_overrides({"verify": "typo"}))
    with pytest.raises(UsageError, match="does not combine"):
        build_drafter(str(tiny_family / "draft"), target, tokenizer, opts.with_overrides({"acceptance": "x"}))


def tau(target, draft, scheme, num_draft, width, prompts, new_tokens=48):
    engine = SpecEngine(target, ByteTokenizer(), ModelDrafter(draft, scheme=scheme, width=width),
                        Sampling(temperature=0.7), num_draft=num_draft, seed=0, eos_ids=[])
    res = engine.generate([GenRequest(p, new_tokens) for p in prompts])
    return sum(r.stats["new_tokens"] for r in res) / sum(r.stats["target_calls"] for r in res)


def test_tau_at_temperature(target, capsys):
    """For the lead: tokens per target call at T=0.7, RSD and SpecTr (k draft steps x 3 siblings) against
    the chain with the same draft steps and with as many drafted tokens as the trees."""
    draft = tiny_llama(seed=0, layers=1, hidden=48)  # the target's first layers' weights: a correlated draft
    draft.load_state_dict(target.state_dict(), strict=False)
    prompts = make_prompts(32, seed=7)
    k = 3
    taus = {f"chain k={k}": tau(target, draft, "standard", k, 1, prompts)}
    for width in (2, 3):
        taus[f"chain k={k * width}"] = tau(target, draft, "standard", k * width, 1, prompts)
        taus[f"rsd k={k} x{width}"] = tau(target, draft, "rsd", k, width, prompts)
        taus[f"spectr k={k} x{width}"] = tau(target, draft, "spectr", k, width, prompts)
    with capsys.disabled():
        print("\ntau at T=0.7:", ", ".join(f"{name} {t:.3f}" for name, t in taus.items()))
    assert all(t >= 1.0 for t in taus.values())
