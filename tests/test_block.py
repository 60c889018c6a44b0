"""The block drafter (models.block, decode.drafters.heads.BlockDrafter): one draft call proposes a whole
round; the decode-side block equals the training-time one; training lowers the loss (KL and LK); sampling
keeps the target's distribution, and a tree verified under the wrong attention fails the same test.
(Greedy == ar at batch sizes 1 and 3 with static and dynamic trees, training through train-heads and the
reduced-vocabulary path run in tests/test_heads.py, parametrised over models.heads.KINDS.)"""

from __future__ import annotations

import json

import pytest
import torch
from conftest import ByteTokenizer, invoke, make_prompts, tiny_llama
from test_sampling import P_FLOOR, two_token_pvalue

from specdec.decode.drafters.heads import BlockDrafter
from specdec.decode.engine.loop import SpecEngine
from specdec.decode.engine.types import GenRequest
from specdec.decode.engine.verify import Sampling
from specdec.models.head_artifacts import build_heads


LAYOUTS = ["specdec", "published"]
MASK = 5  # a token of the tiny models whose embedding is not zero (the padding index 0's is)


def _block(target, seed=0, layout="specdec", **hp):
    """A block drafter on ``target`` with its zero-initialised and unit parts randomised (so every part matters);
    ``layout`` published: DFlash's, its drafting slots filled with token MASK's embedding."""
    torch.manual_seed(seed)
    if layout == "published":
        hp = {"layout": layout, "mask_token_id": MASK, **hp}
    heads = build_heads("block", target, {"num_heads": 3, **hp}).attach(target).double().eval()
    with torch.no_grad():
        if layout == "published":
            for name, p in heads.named_parameters():
                if "norm" in name:
                    p.add_(torch.randn_like(p) * 0.3)
        else:
            heads.block_position.normal_(0, 0.5)
            heads.mask_embedding.add_(torch.randn_like(heads.mask_embedding) * 0.5)
    return heads


@pytest.mark.parametrize("layout", LAYOUTS)
def test_one_draft_call_per_round(target, layout):
    heads = _block(target, layout=layout)
    calls = []
    orig = heads.run
    heads.run = lambda *a, **k: calls.append(1) or orig(*a, **k)
    drafter = BlockDrafter(heads, target, tree="static", tree_tokens=3, top_k=1)
    req = [GenRequest(make_prompts(1, seed=2)[0], 12)]
    res = SpecEngine(target, ByteTokenizer(), drafter, eos_ids=[]).generate(req)
    rounds = res[0].stats["target_calls"] - 1  # the prefill, then one verify forward a round
    assert rounds == len(calls) > 0
    assert res[0].token_ids == SpecEngine(target, ByteTokenizer(), None, eos_ids=[]).generate(req)[0].token_ids  # batch 1


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_decode_block_is_the_training_time_block(target, layout):
    """Every round, each row's K log-prob vectors equal chain_logits on the row's whole text at its last committed
    position: through left-padded prompts, rows finishing at different times and rows joining a running batch."""
    heads = _block(target, num_layers=2, layout=layout)
    seen = []

    class Spy(BlockDrafter):
        def _reset_tree(self, batch):
            super()._reset_tree(batch)
            seen.append(([list(s) for s in batch.seqs], self._logp.clone()))

    drafter = Spy(heads, target, tree="static", tree_tokens=6, top_k=2)
    prompts = make_prompts(5, seed=7, lo=3, hi=14)
    reqs = [GenRequest(p, n) for p, n in zip(prompts, [14, 5, 10, 3, 12])]
    got = [r for _, r in sorted(SpecEngine(target, ByteTokenizer(), drafter, eos_ids=[]).stream(reqs, batch_size=3))]
    ar = SpecEngine(target, ByteTokenizer(), None, eos_ids=[]).generate(reqs)
    assert [r.token_ids for r in got] == [r.token_ids for r in ar]
    assert _checked_against_training(heads, target, seen) > 20


def _checked_against_training(heads, target, seen) -> int:
    """How many (round, row) log-prob vectors were held against chain_logits on the row's whole text (all equal)."""
    checked = 0
    with torch.no_grad():
        for seqs, logp in seen:
            for row, seq in enumerate(seqs):
                ids = torch.tensor([seq])
                chain = heads.chain_logits(target(input_ids=ids, output_hidden_states=True).hidden_states, ids, 3)
                ref = torch.log_softmax(chain[:, 0, len(seq) - 2].float(), -1)  # the root is the last token of seq
                assert torch.allclose(logp[row], ref, atol=1e-5), (len(seq), (logp[row] - ref).abs().max())
                checked += 1
    return checked


def test_rounds_the_block_sits_out_are_committed_before_its_next_call(target, monkeypatch):
    """Beside a lookup the block drafts only in the rounds without a long match; the kept states of the rounds
    between wait and are committed in one pass before its next call, whose log-probs are still chain_logits' on
    the whole text (rows finishing and joining as above)."""
    from specdec.decode.drafters.hybrid import HeadGate, LookupTree
    from specdec.decode.drafters.model_free import NgramDrafter

    monkeypatch.setattr(HeadGate, "choose", lambda self: True)  # every round without a long match runs the block
    heads = _block(target, num_layers=2)
    seen, waited = [], []

    class Spy(BlockDrafter):
        def _catch_up(self):
            waited.append(len(self._waiting))
            super()._catch_up()

        def _reset_tree(self, batch):
            super()._reset_tree(batch)
            seen.append(([list(s) for s in batch.seqs], self._logp.clone()))

    drafter = LookupTree(Spy(heads, target, tree="static", tree_tokens=6, top_k=2), NgramDrafter())
    prompts = [p * 3 for p in make_prompts(5, seed=7, lo=3, hi=8)]  # repeats: rounds of long matches
    reqs = [GenRequest(p, n) for p, n in zip(prompts, [24, 5, 16, 3, 20])]
    got = [r for _, r in sorted(SpecEngine(target, ByteTokenizer(), drafter, eos_ids=[]).stream(reqs, batch_size=3))]
    ar = SpecEngine(target, ByteTokenizer(), None, eos_ids=[]).generate(reqs)
    assert [r.token_ids for r in got] == [r.token_ids for r in ar]
    # rounds the block sat out: long matches, and the first rounds, which measure a plain step before any tree
    assert drafter.sources["lookup"] + drafter.sources["idle"] > 0 and max(waited) > 1  # some call caught up on several rounds
    assert _checked_against_training(heads, target, seen) > 5


@pytest.mark.parametrize("loss,layout", [("kl", "specdec"), ("lk", "specdec"), ("kl", "published")])
def test_a_few_steps_reduce_the_loss_and_raise_the_expected_accepted_length(target, loss, layout):
    published = {"layout": layout, "mask_token_id": MASK} if layout == "published" else {}
    heads = build_heads("block", target, {"num_heads": 3, "anchors": 8, "loss": loss, **published}).attach(target).double()
    before = {k: v.clone() for k, v in heads.state_dict().items()}
    ids = torch.tensor([p[:20] for p in make_prompts(4, seed=5, lo=20, hi=24)])
    with torch.no_grad():
        out = target(input_ids=ids, output_hidden_states=True)
    opt = torch.optim.Adam(heads.parameters(), lr=1e-2)
    losses, expected = [], []
    torch.manual_seed(0)
    for _ in range(15):
        l, parts = heads(out.hidden_states, ids, out.logits)
        opt.zero_grad()
        l.backward()
        opt.step()
        losses.append(float(l.detach()))
        expected.append(parts["expected_accepted"])
    assert {"ce0", "ce1", "ce2", "expected_accepted"} <= set(parts)
    assert sum(losses[-3:]) < 0.95 * sum(losses[:3]), losses  # soft cross-entropy: the teacher's entropy is a floor
    assert sum(expected[-3:]) > sum(expected[:3]), expected
    after = heads.state_dict()
    names = ("fuse.weight", "layers.0.self_attn.k_proj.weight", "norm.weight")
    names += ("layers.0.self_attn.q_norm.weight", "layers.0.self_attn.k_norm.weight") if published else ("fc.weight", "mask_embedding", "block_position")
    for name in names:
        assert not torch.equal(before[name], after[name]), name
    assert set(before) == set(after) and not ({"fc.weight", "mask_embedding", "block_position"} & set(after) if published else False)


def test_the_lk_term_is_the_expected_accepted_length():
    """alpha = sum_x min(p, q) per position, the chain's expected length sum_j prod_{i<=j} alpha_i: checked by hand
    on a case where the head's distribution equals the teacher's at position 0 and differs at 1."""
    target = tiny_llama(vocab=12, hidden=32, layers=2, seed=3)
    heads = build_heads("block", target, {"num_heads": 2, "anchors": 64, "loss": "lk", "feature_layers": "last"}).attach(target).double()
    ids = torch.tensor([[1, 2, 3, 4, 5, 6]])
    with torch.no_grad():
        hs = target(input_ids=ids, output_hidden_states=True).hidden_states
        q = torch.softmax(heads.chain_logits(hs, ids, 2).float(), -1)  # [2, 1, T, V]
        teacher = torch.log(q[0, 0]).clone()  # position p's teacher predicts token p + 1; chain j=0 at t predicts t + 2
        teacher = torch.cat([teacher[:1], teacher[:-1]])[None]  # position t + 1 gets chain 0's q at t
        torch.manual_seed(0)
        loss, parts = heads(hs, ids, teacher.double())
    t = ids.shape[1]
    a0 = torch.ones(t - 2)  # position 0 of each cut matches the teacher exactly
    a1 = torch.minimum(q[0, 0, 1 : t - 1], q[1, 0, : t - 2]).sum(-1)  # cut c's position 1 against the teacher at c + 2
    valid1 = torch.arange(t - 2) + 2 <= t - 1
    expected = (a0 + a0 * a1 * valid1).mean()
    assert abs(parts["expected_accepted"] - float(expected)) < 1e-4


@pytest.mark.parametrize("layout", LAYOUTS)
def test_sampling_keeps_the_target_joint_distribution_and_a_tree_without_context_breaks_it(layout):
    vocab = 12
    target = tiny_llama(vocab=vocab, hidden=32, layers=2, seed=3)
    with torch.no_grad():
        target.lm_head.weight.mul_(0.25)  # many tokens matter
    prompt = [5, 7, 5, 7, 5]
    sampling = Sampling(temperature=0.8)

    def run(drafter_cls):
        layers = {"layout": layout} if layout == "published" else {"feature_layers": "last"}  # DFlash's always fuses layers
        drafter = drafter_cls(_block(target, seed=1, **layers), target, tree="static", tree_tokens=6, top_k=3)
        engine = SpecEngine(target, ByteTokenizer(), drafter, sampling, num_draft=3, seed=123, eos_ids=[])
        return engine.generate([GenRequest(prompt, 2) for _ in range(6000)])

    res = run(BlockDrafter)
    assert two_token_pvalue(res, target, prompt, sampling) > P_FLOOR
    assert sum(r.stats["accepted_tokens"] for r in res) > 0  # drafts were actually tested

    class NodesSeeOnlyThemselves(BlockDrafter):
        def propose(self, batch):
            prop = super().propose(batch)
            n = prop.tree_attn.shape[1]
            # the bug: a node's row loses the root and its ancestors, so its logits are the target's for another context
            prop.tree_attn = prop.tree_attn & torch.eye(n, dtype=torch.bool)
            prop.tree_attn[:, 0, 0] = True
            return prop

    assert two_token_pvalue(run(NodesSeeOnlyThemselves), target, prompt, sampling) < P_FLOOR


def test_cli_trains_a_block_drafter_that_decode_uses(tiny_family, tmp_path):
    from specdec.tests.test_train import write_decode_output

    data = write_decode_output(tmp_path / "data.jsonl", n=60)
    out = tmp_path / "block"
    res = invoke(["train-heads", "--kind", "block", "--target", tiny_family / "target", "--data", data, "--out", out,
                  "--max-steps", "4", "--batch-size", "4", "--seq-len", "32", "--num-heads", "3", "--anchors", "8", "--loss", "lk"])
    assert res.exit_code == 0, res.output
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["kind"] == "block" and cfg["num_heads"] == 3 and cfg["anchors"] == 8 and cfg["loss"] == "lk"
    assert cfg["layout"] == "published" and cfg["mask_token_id"] is not None  # DFlash's layout, without a flag
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ("the cat sat", "a dog ran far")))
    outs = {}
    for drafter in ("ar", str(out)):
        res = invoke(["decode", "--target", tiny_family / "target", "--in", prompts, "--out", tmp_path / f"{len(outs)}.jsonl",
                      "--drafter", drafter, "--max-new-tokens", "12"])
        assert res.exit_code == 0, res.output
        outs[drafter] = [json.loads(line)["completion"] for line in (tmp_path / f"{len(outs)}.jsonl").read_text().splitlines()]
    assert outs["ar"] == outs[str(out)]
    res = invoke(["export", out, "--to", "vllm", "--out", tmp_path / "exported"])
    assert res.exit_code == 2 and "export it --to speculators" in res.output and not (tmp_path / "exported").exists()
    res = invoke(["export", out, "--to", "speculators", "--out", tmp_path / "exported"])
    assert res.exit_code == 0, res.output
    assert json.loads((tmp_path / "exported" / "config.json").read_text())["speculators_model_type"] == "dflash"
    # specdec's own layout: trained on request, decoded, and refused by the exporters with the reason
    own = tmp_path / "block-own"
    res = invoke(["train-heads", "--kind", "block", "--target", tiny_family / "target", "--data", data, "--out", own,
                  "--max-steps", "2", "--batch-size", "4", "--seq-len", "32", "--num-heads", "3", "--anchors", "8",
                  "--layout", "specdec"])
    assert res.exit_code == 0, res.output
    res = invoke(["export", own, "--to", "speculators", "--out", tmp_path / "own-exported"])
    assert res.exit_code == 2 and "specdec's layout" in res.output and not (tmp_path / "own-exported").exists()
    res = invoke(["train-heads", "--kind", "block", "--target", tiny_family / "target", "--data", data, "--out", tmp_path / "y",
                  "--layout", "specdec", "--mask-token-id", "5"])
    assert res.exit_code == 2 and "--mask-token-id" in res.output
    # a setting of another kind is refused before anything loads
    res = invoke(["train-heads", "--kind", "eagle", "--target", tiny_family / "target", "--data", data, "--out", tmp_path / "x",
                  "--anchors", "8"])
    assert res.exit_code == 2 and "--anchors applies to --kind block" in res.output
