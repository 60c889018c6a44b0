"""Parity of the Triton kernels with their PyTorch references.

Without a GPU the kernels run in Triton's interpreter on CPU tensors (TRITON_INTERPRET=1 must be
set before the kernel modules are imported, since ``triton.jit`` reads it when it decorates); on a
GPU machine the same tests run the compiled kernels on CUDA tensors.
"""

import os
import subprocess
import sys

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from specdec.decode.engine.verify import Sampling, verify_chain_core  # noqa: E402
from specdec.kernels import backend  # noqa: E402
from specdec.kernels.diffusion_select import CreditState, select_step  # noqa: E402
from specdec.kernels.tree_attention import (  # noqa: E402
    register,
    specdec_tree_attention,
    tree_attention,
    tree_attention_reference,
)
from specdec.decode.engine.verify import verify_chain_accelerated as verify_chain_fused  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(autouse=True)
def _no_backend_override(monkeypatch):
    monkeypatch.delenv("SPECDEC_KERNELS", raising=False)


# --- dispatch -------------------------------------------------------------------------------------


def test_auto_picks_torch_on_cpu():
    assert backend("auto", torch.device("cpu")) == "torch"
    assert backend("torch", DEVICE) == "torch"
    assert backend("triton", "cpu") == "triton"


def test_env_var_overrides_request(monkeypatch):
    monkeypatch.setenv("SPECDEC_KERNELS", "torch")
    assert backend("triton", "cuda") == "torch"
    monkeypatch.setenv("SPECDEC_KERNELS", "fast")
    with pytest.raises(ValueError):
        backend()


def test_importing_the_package_does_not_import_triton():
    code = "import sys, specdec.kernels; assert 'triton' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


# --- verification ---------------------------------------------------------------------------------


def _chain_case(seed, bsz=4, k=4, vocab=300, temperature=0.8, with_q=False):
    """Drafts sampled near the target so that acceptance lengths vary between 0 and K."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(bsz, k + 1, vocab, generator=gen) * 3
    noisy = logits[:, :k] + torch.randn(bsz, k, vocab, generator=gen)
    q_logits = noisy / max(temperature, 1e-5)
    tokens = torch.multinomial(torch.softmax(q_logits, -1).flatten(0, 1), 1, generator=gen).view(bsz, k)
    tokens[0] = logits[0, :k].argmax(-1)  # one row the greedy rule accepts in full
    draft_probs = torch.softmax(q_logits, -1) if with_q else None
    u = torch.rand(bsz, k + 1, generator=gen)
    to = lambda t: None if t is None else t.to(DEVICE)  # noqa: E731
    # u[:, :k] and u[:, k] are strided views, exactly as verify_chain passes them
    return to(logits), to(tokens), to(draft_probs), to(u)[:, :k], to(u)[:, k]


@pytest.mark.parametrize(
    "temperature,top_p,with_q",
    [(0.0, 1.0, False), (0.0, 1.0, True), (0.7, 1.0, False), (1.0, 1.0, True), (0.7, 0.9, True)],
    ids=["greedy", "greedy-q-ignored", "sample-onehot", "sample-q", "top-p-falls-back"],
)
def test_verify_matches_reference(temperature, top_p, with_q):
    sampling = Sampling(temperature=temperature, top_p=top_p)
    seen = set()
    for seed in range(6):
        logits, tokens, q, ua, us = _chain_case(seed, temperature=temperature, with_q=with_q)
        ua, us = (None, None) if sampling.greedy else (ua, us)
        want = verify_chain_core(logits, tokens, q, sampling, ua, us)
        got = verify_chain_fused(logits, tokens, q, sampling, ua, us, backend="triton")
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), seed
        seen.update(want[0].tolist())
    assert len(seen) >= 2, "the cases should exercise several acceptance lengths"


def test_verify_greedy_ties_take_the_first_index():
    logits = torch.zeros(2, 3, 200, device=DEVICE)
    logits[:, :, [7, 150]] = 5.0  # equal maxima in different tiles-to-be and positions
    tokens = torch.full((2, 2), 7, device=DEVICE)
    got = verify_chain_fused(logits, tokens, None, Sampling(), None, None, backend="triton")
    assert got[0].tolist() == [2, 2] and got[1].tolist() == [7, 7]


def test_verify_rejection_under_a_peaked_target():
    # p is one-hot at 3 up to float32 underflow, the draft is sure of 9: reject and emit 3
    logits = torch.full((1, 2, 64), -30.0, device=DEVICE)
    logits[:, :, 3] = 30.0
    tokens = torch.tensor([[9]], device=DEVICE)
    q = torch.zeros(1, 1, 64, device=DEVICE)
    q[..., 9] = 1.0
    args = (logits, tokens, q, Sampling(temperature=1.0), torch.tensor([[0.5]], device=DEVICE), torch.tensor([0.99], device=DEVICE))
    got, want = verify_chain_fused(*args, backend="triton"), verify_chain_core(*args)
    assert got[0].item() == want[0].item() == 0 and got[1].item() == want[1].item() == 3


# --- tree attention -------------------------------------------------------------------------------


def _tree_case(seed, bsz=2, heads=4, kv_heads=2, tree=6, seq=40, dim=16):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(bsz, heads, tree, dim, generator=gen)
    k = torch.randn(bsz, kv_heads, seq, dim, generator=gen)
    v = torch.randn(bsz, kv_heads, seq, dim, generator=gen)
    # cache columns: a random hole per row (padding); tree columns: ancestors plus self
    mask = torch.ones(bsz, 1, tree, seq, dtype=torch.bool)
    mask[1, ..., : seq // 3] = False
    parents = [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, tree)]
    tree_mask = torch.eye(tree, dtype=torch.bool)
    for node in range(tree):
        parent = parents[node]
        while parent >= 0:
            tree_mask[node, parent] = True
            parent = parents[parent]
    mask[..., seq - tree :] = tree_mask
    return [t.to(DEVICE) for t in (q, k, v, mask)]


@pytest.mark.parametrize("seq,num_splits", [(40, 1), (200, 3)], ids=["one-pass", "split-s"])
def test_tree_attention_matches_sdpa(seq, num_splits):
    q, k, v, mask = _tree_case(0, seq=seq)
    got = tree_attention(q, k, v, mask, backend="triton", num_splits=num_splits)
    torch.testing.assert_close(got, tree_attention_reference(q, k, v, mask), atol=1e-5, rtol=1e-5)


def test_tree_attention_broadcast_mask_and_scale():
    q, k, v, mask = _tree_case(1, bsz=3, heads=6, kv_heads=3, tree=5, seq=24)
    mask = mask[:1]  # one mask for every row, as transformers may pass it
    got = tree_attention(q, k, v, mask, scale=0.3, backend="triton")
    torch.testing.assert_close(got, tree_attention_reference(q, k, v, mask, scale=0.3), atol=1e-5, rtol=1e-5)


class _Attention(torch.nn.Module):
    num_key_value_groups = 2
    is_causal = True
    layer_idx = 0


def test_attention_interface_layout(monkeypatch):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    monkeypatch.setenv("SPECDEC_KERNELS", "triton")  # the interface function uses "auto" otherwise
    q, k, v, mask = _tree_case(2)
    got, _ = specdec_tree_attention(_Attention(), q, k, v, mask, scaling=0.25)
    want, _ = sdpa_attention_forward(_Attention(), q, k, v, mask, scaling=0.25)
    assert got.shape == (2, 6, 4, 16)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_registered_attention_runs_a_tiny_llama(monkeypatch):
    from transformers import LlamaConfig, LlamaForCausalLM

    name = register()
    config = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval().to(DEVICE)
    ids = torch.randint(0, 64, (2, 10), device=DEVICE)
    # a 2-D padding mask exercises the mask-builder registration; the kernel needs a 4-D one
    mask2d = torch.ones(2, 10, dtype=torch.long, device=DEVICE)
    mask2d[1, :3] = 0
    mask4d = torch.ones(1, 1, 10, 10, dtype=torch.bool, device=DEVICE).tril()
    mask4d[..., 8, 7] = False  # two siblings at the end of the tree
    monkeypatch.setenv("SPECDEC_KERNELS", "triton")
    with torch.no_grad():
        outs = {}
        for impl in ("sdpa", name):
            model.set_attn_implementation(impl)
            outs[impl] = [model(ids, attention_mask=m).logits for m in (mask2d, mask4d)]
    for want, got in zip(outs["sdpa"], outs[name]):
        torch.testing.assert_close(got[:, 3:], want[:, 3:], atol=1e-4, rtol=1e-4)


# --- diffusion selection --------------------------------------------------------------------------


def _block_case(seed, bsz=3, length=8, vocab=257):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(bsz, length, vocab, generator=gen) * 2
    sure = torch.rand(bsz, length, generator=gen) < 0.4
    bump = 6 + 7 * torch.rand(bsz, length, generator=gen)  # confidences spread over ~(0.2, 1)
    logits[..., 11] += torch.where(sure, bump, 0.0)
    logits[0, 5] = logits[0, 4]  # equal confidences: the earlier position ranks first
    masked = torch.rand(bsz, length, generator=gen) < 0.75
    masked[0, 4:6] = True
    masked[2] = False  # a finished row commits nothing
    return logits.to(DEVICE), masked.to(DEVICE)


def _assert_same_selection(got, want):
    assert torch.equal(got.tokens, want.tokens)
    assert torch.equal(got.commit, want.commit)
    torch.testing.assert_close(got.confidence, want.confidence, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("rule,kwargs", [("threshold", {}), ("threshold", {"threshold": 0.5}), ("factor", {}), ("factor", {"factor": 2.0})])
def test_selection_rules_match_reference(rule, kwargs):
    commits = 0
    for seed in range(3):
        logits, masked = _block_case(seed)
        want = select_step(logits, masked, rule, backend="torch", **kwargs)
        _assert_same_selection(select_step(logits, masked, rule, backend="triton", **kwargs), want)
        assert not want.commit[2].any()
        commits += int(want.commit.sum())
    assert commits > 6, "the cases should commit more than the forced top-1"


def test_credit_rule_matches_reference_over_steps():
    bsz, length = 3, 8
    # 3 slots and 6 steps: the compact state fills up and evicts
    ref = ker = CreditState.empty(bsz, length, slots=3, device=DEVICE)
    tops = []
    for step in range(6):
        logits, masked = _block_case(10 + step, bsz, length)
        tops.append(logits.argmax(-1))
        want = select_step(logits, masked, "credit", credit=ref, backend="torch")
        got = select_step(logits, masked, "credit", credit=ker, backend="triton")
        _assert_same_selection(got, want)
        assert torch.equal(got.credit.tokens, want.credit.tokens)
        torch.testing.assert_close(got.credit.credit, want.credit.credit)
        ref, ker = want.credit, got.credit
    distinct = [len(set(col.tolist())) for col in torch.stack(tops, -1).flatten(0, 1)]
    assert max(distinct) > 3, "some position should have evicted a credited token"


@pytest.mark.parametrize("method", ["threshold+tau=0.5", "factor+f=2.0", "credit+tau=0.5"])
def test_diffusion_decoding_commits_the_same_with_either_backend(method):
    """``--kernels triton`` runs the fused step; every step commits what the reference rules commit."""
    from test_diffusion import spec_for, requests, tiny_dllm

    from specdec.decode.diffusion.generator import build_generator
    from specdec.decode.options import DecodeOptions

    model = tiny_dllm(seed=2, eos_boost=0.5).float().to(DEVICE)
    with torch.no_grad():
        model.lm_head.weight.mul_(30)  # confidences spread over ~(0.4, 0.95): several commits per step
    runs = {}
    for kernels in ("torch", "triton"):
        options = DecodeOptions(strategy=method, kernels=kernels, gen_length=16, block_size=8)
        gen = build_generator(model, None, spec_for("block"), options)
        assert (gen.fused_rule is not None) == (kernels == "triton")
        events = []
        gen.on_step = events.append
        results = gen.generate(requests(3, 16))
        runs[kernels] = ([r.token_ids for r in results], [e.after for e in events])
    (tokens, steps), (fused_tokens, fused_steps) = runs["torch"], runs["triton"]
    assert fused_tokens == tokens and len(fused_steps) == len(steps)
    assert all(torch.equal(a, b) for a, b in zip(fused_steps, steps))
    assert len(steps) < 2 * 8, "some step should commit several tokens"
