"""Medusa / Clover / EAGLE heads: training reduces the loss, tree decoding is exactly AR greedy."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from specdec.decode.engine.loop import SpecEngine
from specdec.decode.drafters.heads import DRAFTERS
from specdec.decode.drafters.heads import build_head_drafter as build_drafter
from specdec.decode.engine.types import GenRequest
from specdec.decode.engine.verify import Sampling, verify_tree
from conftest import ByteTokenizer, make_prompts
from specdec.tests.test_train import make_target_dir, make_tokenizer, tiny_cfg, write_decode_output
from specdec.models.heads import KINDS
from specdec.models.head_artifacts import build_heads
from specdec.train.trainers.heads import export_artifact, train_heads


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    root = tmp_path_factory.mktemp("heads")
    make_target_dir(root / "target", layers=3)
    write_decode_output(root / "data.jsonl", n=150)
    return root


def _generate(target, drafter, prompts, max_new=20, sampling=None):
    reqs = [GenRequest(prompt_ids=p, max_new_tokens=max_new) for p in prompts]
    return SpecEngine(target, ByteTokenizer(), drafter, sampling=sampling).generate(reqs)


def _heads(kind, target, **hp):
    torch.manual_seed(0)
    return build_heads(kind, target, {"window": 16, **hp}).attach(target, init_from_lm_head=True).double().eval()


# ---------------------------------------------------------------------------------------------


def test_verify_hand_built_tree():
    # root -> {5, 7}; 5 -> {8}; 7 -> {9, 4}. Target argmax: root 7, node(7) 4, node(4) 6.
    tokens = torch.tensor([[5, 7, 8, 9, 4]])
    parents = torch.tensor([[-1, -1, 0, 1, 1]])
    logits = torch.full((1, 6, 10), -5.0)
    best = {0: 7, 1: 1, 2: 4, 3: 0, 4: 0, 5: 6}  # slot -> argmax (slot = node + 1, root = 0)
    for slot, tok in best.items():
        logits[0, slot, tok] = 5.0
    v = verify_tree(logits, tokens, parents, Sampling(), None, max_depth=2)
    assert v.accepted.tolist() == [2]
    assert v.path.tolist() == [[1, 4]]
    assert v.next_token.tolist() == [6]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("tree", ["static", "dynamic"])
@pytest.mark.parametrize("bs", [1, 3])
def test_tree_decoding_equals_ar(target, kind, tree, bs):
    prompts = make_prompts(bs, seed=10 + bs)
    ar = _generate(target, None, prompts)
    drafter = DRAFTERS[kind](_heads(kind, target), target, tree=tree, tree_tokens=12, top_k=3)
    out = _generate(target, drafter, prompts)
    assert [r.token_ids for r in out] == [r.token_ids for r in ar]
    assert all(r.stats["drafted_tokens"] > 0 for r in out)


@pytest.mark.parametrize("kind", KINDS)
def test_tree_sampling_runs(target, kind):
    drafter = DRAFTERS[kind](_heads(kind, target), target, tree="dynamic", tree_tokens=8, top_k=2)
    out = _generate(target, drafter, make_prompts(2, seed=3), max_new=12, sampling=Sampling(temperature=0.9))
    assert all(len(r.token_ids) == 12 or r.finish_reason == "stop" for r in out)


def test_eagle_unrolled_matches_decode_tree(target):
    """The training-time unrolled chain equals what the drafter computes on a chain-shaped tree."""
    from specdec.decode.drafters.base import Segment
    from specdec.decode.drafters.heads import EagleDrafter, Tree

    heads = _heads("eagle", target)
    ids = torch.tensor([make_prompts(1, seed=4)[0][:12]])
    s = 5
    with torch.no_grad():
        hs = target(input_ids=ids, output_hidden_states=True).hidden_states
        chain = heads.unrolled(hs, ids, 3)  # [3, 1, T-1, H]
        # decode side: the prefill commits entries 0..s, then the data tokens grow as a chain-shaped tree
        drafter = EagleDrafter(heads, target, tree="static")
        batch = SimpleNamespace(seqs=[ids[0, : s + 1].tolist()], device=ids.device, root=ids[:, s + 1])
        valid = torch.ones(1, s + 1, dtype=torch.bool)
        drafter.begin(batch, Segment(ids[:, : s + 1], valid, None, hs[-1][:, : s + 1]))
        assert torch.allclose(drafter.f_root, chain[0, :, s], atol=1e-9)
        drafter._reset_tree(batch)
        tree = Tree.empty(1, ids.device)
        tree.add(ids[:, s + 2 : s + 3], torch.tensor([[-1]]), torch.tensor([[1]]), torch.zeros(1, 1))
        drafter._child_logprobs(tree, torch.tensor([[0]]), 1, batch)
        assert torch.allclose(drafter._fh[:, 0], chain[1, :, s], atol=1e-9)
        # a sibling the chain never sees must not disturb it (tree attention over scratch slots)
        tree.add(ids[:, 3:4], torch.tensor([[-1]]), torch.tensor([[1]]), torch.zeros(1, 1))
        tree.add(ids[:, s + 3 : s + 4], torch.tensor([[0]]), torch.tensor([[2]]), torch.zeros(1, 1))
        drafter._child_logprobs(tree, torch.tensor([[1]]), 1, batch)
        drafter._child_logprobs(tree, torch.tensor([[2]]), 2, batch)
        assert torch.allclose(drafter._fh[:, 2], chain[2, :, s], atol=1e-9)
        assert not torch.allclose(drafter._fh[:, 1], drafter._fh[:, 0])


def test_tree_ancestors_track_parents():
    from specdec.decode.drafters.base import tree_attention_from_parents
    from specdec.decode.drafters.heads import Tree

    tree = Tree.empty(2, torch.device("cpu"))
    tree.add(torch.tensor([[4, 5], [6, 7]]), torch.tensor([[-1, -1], [-1, -1]]), torch.ones(2, 2, dtype=torch.long), torch.zeros(2, 2))
    tree.add(torch.tensor([[8, 9], [1, 2]]), torch.tensor([[1, 1], [0, 1]]), torch.full((2, 2), 2), torch.zeros(2, 2))
    tree.add(torch.tensor([[3], [3]]), torch.tensor([[3], [2]]), torch.full((2, 1), 3), torch.zeros(2, 1))
    expected, depth = tree_attention_from_parents(tree.parents)
    prop = tree.proposal(3)
    assert torch.equal(prop.tree_attn, expected)
    assert torch.equal(prop.depth, depth)


# ---------------------------------------------------------------------------------------------
# training (float32 target on disk, a few steps)


@pytest.mark.parametrize("kind", KINDS)
def test_heads_train_loss_falls_and_artifact_loads(workdir, kind):
    from specdec.models.loading import load_target

    out = workdir / kind
    extra = {"window": 16} if kind == "clover" else {}
    m = train_heads(kind, workdir / "target", [workdir / "data.jsonl"], out, tiny_cfg(steps=12, lr=1e-2 if kind != "eagle" else 3e-3), **extra)
    curve = m["loss_curve"]
    assert sum(curve[-3:]) / 3 < sum(curve[:3]) / 3
    for f in ("config.json", "model.safetensors", "metrics.json", "training_config.yaml"):
        assert (out / f).exists()
    assert len(m["top1_accuracy"]) >= 4 and "1" in m["expected_tau"]
    target, tok, _ = load_target(workdir / "target")
    drafter = build_drafter(out, target, tok, SimpleNamespace(num_draft=None, tree="static", tree_tokens=10))
    res = SpecEngine(target, tok, drafter).generate([GenRequest(prompt_ids=tok("the cat sat")["input_ids"], max_new_tokens=10)])
    ar = SpecEngine(target, tok, None).generate([GenRequest(prompt_ids=tok("the cat sat")["input_ids"], max_new_tokens=10)])
    assert res[0].token_ids == ar[0].token_ids
    # a tokenizer with another vocabulary is refused before any work
    from specdec.models.artifacts import SpecdecError

    with pytest.raises(SpecdecError, match="another tokenizer"):
        build_drafter(out, target, make_tokenizer(80, seed=1), SimpleNamespace(num_draft=None, tree="static", tree_tokens=None))
    if kind in ("medusa", "eagle"):
        for to in ("hf", "vllm"):
            dst = export_artifact(out, workdir / f"{kind}-{to}", to)
            assert (dst / "config.json").exists()


def test_best_subtree_keeps_best_nodes_in_topological_order_and_drops_orphans():
    from specdec.decode.drafters.heads import Tree, _best_subtree

    # root children a(0) b(1); a's children c(2) d(3); c's child e(4). Scores are cumulative log-probs;
    # e is artificially better than its parent c so that keeping 3 nodes orphans it.
    tree = Tree.empty(1, torch.device("cpu"))
    tree.add(torch.tensor([[10, 11]]), torch.tensor([[-1, -1]]), torch.tensor([[1, 1]]), torch.tensor([[-0.1, -3.0]]))
    tree.add(torch.tensor([[12, 13]]), torch.tensor([[0, 0]]), torch.tensor([[2, 2]]), torch.tensor([[-2.0, -0.5]]))
    tree.add(torch.tensor([[14]]), torch.tensor([[2]]), torch.tensor([[3]]), torch.tensor([[-0.2]]))
    best = _best_subtree(tree, 3, depth=3)
    assert best.tokens.tolist() == [[10, 13, 14]]  # a, d, e by (depth, index)
    assert best.parents.tolist() == [[-1, 0, -2]]  # e's parent c was not kept: padding
    assert best.anc[0].tolist() == [[True, False, False], [True, True, False], [True, False, True]]  # e: a and itself
    full = _best_subtree(tree, 5, depth=3)
    assert full.tokens.tolist() == [[10, 11, 12, 13, 14]] and full.parents.tolist() == [[-1, -1, 0, 0, 2]]
    assert torch.equal(full.anc, tree.anc)


def test_acceptance_calibration_counts_the_children_of_accepted_nodes():
    from specdec.decode.drafters.base import Segment
    from specdec.decode.drafters.heads import AcceptanceCalibration, Tree

    cal = AcceptanceCalibration(bins=10, ranks=2, depths=2, prior=1.0)
    # root -> a(0, q .55, rank 0), b(1, q .25, rank 1); a -> c(2, q .35, rank 0), d(3, q .15, rank 1); b -> e(4)
    tree = Tree.empty(1, torch.device("cpu"))
    lp1 = torch.tensor([[[0.55, 0.25]]]).log()
    lp2 = torch.tensor([[[0.35, 0.15]]]).log()
    for lp, depth, parents in ((lp1, 1, [[-1, -1]]), (lp2, 2, [[0, 0]]), (lp2[..., :1], 2, [[1]])):
        key = cal.key(lp, depth)
        n = key.shape[-1]
        tree.add(torch.arange(n)[None], torch.tensor(parents), torch.full((1, n), depth), cal.log_accept(key)[0], key[0])
    before = cal.rate().clone()
    # the verdict accepted a then d: slots are node + 1, slot 0 the root
    seg = Segment(None, None, None, None, keep_index=torch.tensor([[0, 1, 4]]), keep_valid=torch.ones(1, 3, dtype=torch.bool))
    cal.update(tree, seg)
    at_stake = cal.seen - 1.0  # every cell started at prior 1
    won = (cal.hits - before * 1.0).round(decimals=9)  # rates before the update: the bins' centres
    assert at_stake.sum() == 4  # a, b, c, d; e's parent b was rejected
    assert at_stake[0, 0, 5] == 1 and at_stake[0, 1, 2] == 1 and at_stake[1, 0, 3] == 1 and at_stake[1, 1, 1] == 1
    assert won.sum() == 2 and won[0, 0, 5] == 1 and won[1, 1, 1] == 1  # a and d were accepted
    assert cal.rate()[1, 1, 1] > before[1, 1, 1] and cal.rate()[1, 0, 3] < before[1, 0, 3]


def test_dynamic_tree_deepens_once_calibration_sees_an_underconfident_drafter():
    """Rank-0 children get q = .2 yet are always accepted: the uncalibrated estimate grows a wide,
    shallow tree; after the verdicts are counted the same budget goes to the deep chain."""
    from specdec.decode.drafters.base import Segment
    from specdec.decode.drafters.heads import HeadTreeDrafter

    class Fixed(HeadTreeDrafter):
        def _child_logprobs(self, tree, nodes, level, batch):
            q = torch.full((16,), 0.8 / 15).index_fill_(0, torch.tensor([1]), 0.2)
            return q.log().expand(nodes.shape[0], nodes.shape[1], -1)

    drafter = Fixed(SimpleNamespace(kind="eagle", num_heads=0, to_target=lambda idx: idx), None, tree="dynamic", tree_tokens=8, depth=6, top_k=4)
    batch = SimpleNamespace(seqs=[[0]], num_draft=6, device=torch.device("cpu"))
    depths = []
    for _ in range(12):
        tree = drafter._last_tree = drafter._grow_dynamic(batch, 6)
        depths.append(int(tree.depth.max()))
        chain = [-1]  # the accepted path: token 1 all the way down
        for i in range(tree.size):
            if tree.tokens[0, i] == 1 and tree.parents[0, i] == chain[-1]:
                chain.append(i)
        path = torch.tensor([[0] + [i + 1 for i in chain[1:]]])
        drafter.calibration.update(tree, Segment(None, None, None, None, keep_index=path, keep_valid=torch.ones_like(path, dtype=torch.bool)))
    assert depths[0] <= 2 and depths[-1] == 6


@pytest.mark.parametrize("bs", [1, 3])
def test_eagle3_drafter_reads_fused_layers_and_stays_lossless(target, bs):
    """EAGLE-3 artifacts: the engine hands the drafter the chosen layers; its root feature equals
    the training-time chain's first step, and greedy decoding equals ar."""
    from specdec.decode.drafters.heads import EagleDrafter

    heads = _heads("eagle", target, feature_layers=[1, 2])
    roots = []

    class Spy(EagleDrafter):
        def begin(self, batch, seg):
            super().begin(batch, seg)
            roots.append((batch.root.clone(), self.f_root.clone()))

    drafter = Spy(heads, target, tree="static", tree_tokens=8, top_k=2)
    assert drafter.hidden_layers == (1, 2)
    prompts = make_prompts(bs, seed=21)
    out = _generate(target, drafter, prompts)
    assert [r.token_ids for r in out] == [r.token_ids for r in _generate(target, None, prompts)]
    root, f_root = roots[0]
    for row, prompt in enumerate(prompts):
        ids = torch.tensor([prompt + [int(root[row])]])
        with torch.no_grad():
            chain = heads.unrolled(target(input_ids=ids, output_hidden_states=True).hidden_states, ids, 1)
        assert torch.allclose(f_root[row], chain[0, 0, len(prompt) - 1], atol=1e-7)


def test_eagle_rounds_without_a_tree_are_committed_before_its_next_one(target, monkeypatch):
    """Beside a lookup the EAGLE-3 head grows trees only in some rounds; the entries of the rounds between wait
    and are committed in one layer call before its next tree, after which its root feature is still the
    training-time chain's at each row's last committed position (rows finishing and joining a running batch)."""
    from specdec.decode.drafters.heads import EagleDrafter
    from specdec.decode.drafters.hybrid import HeadGate, LookupTree
    from specdec.decode.drafters.model_free import NgramDrafter

    count = iter(range(10**6))
    monkeypatch.setattr(HeadGate, "choose", lambda self: next(count) % 3 == 0)  # one round in three without a long match grows a tree
    heads = _heads("eagle", target, feature_layers=[1, 2])
    seen, waited = [], []

    class Spy(EagleDrafter):
        def _catch_up(self):
            waited.append(len(self._waiting))
            super()._catch_up()

        def _reset_tree(self, batch):
            super()._reset_tree(batch)
            seen.append(([list(q) for q in batch.seqs], self.f_root.clone()))

    drafter = LookupTree(Spy(heads, target, tree="static", tree_tokens=6, top_k=2), NgramDrafter())
    prompts = [p * 2 for p in make_prompts(5, seed=7, lo=3, hi=8)]
    reqs = [GenRequest(p, n) for p, n in zip(prompts, [20, 5, 14, 3, 16])]
    got = [r for _, r in sorted(SpecEngine(target, ByteTokenizer(), drafter, eos_ids=[]).stream(reqs, batch_size=3))]
    ar = SpecEngine(target, ByteTokenizer(), None, eos_ids=[]).generate(reqs)
    assert [r.token_ids for r in got] == [r.token_ids for r in ar]
    assert max(waited) > 1  # some tree caught up on several rounds
    checked = 0
    with torch.no_grad():
        for seqs, f_root in seen:
            for row, seq in enumerate(seqs):
                ids = torch.tensor([seq])
                chain = heads.unrolled(target(input_ids=ids, output_hidden_states=True).hidden_states, ids, 1)
                assert torch.allclose(f_root[row], chain[0, 0, len(seq) - 2], atol=1e-7)  # the root is seq's last token
                checked += 1
    assert checked > 5


@pytest.mark.parametrize("rope", [
    {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 64},
    {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
    {"rope_type": "default", "rope_theta": 1000.0},
])
def test_eagle_takes_the_targets_rope_scaling(rope):
    """An EAGLE head of a Llama-3 (or linearly scaled) target rotates positions as the target does."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    from specdec.models.heads import EagleHead

    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      max_position_embeddings=256, rope_parameters=rope)
    head = EagleHead(cfg)
    ref = LlamaRotaryEmbedding(cfg)
    x = torch.zeros(1, 5, 32)
    pos = torch.tensor([[0, 3, 70, 150, 255]])
    cos, sin = ref(x, pos)
    got_cos, got_sin = head.rope(pos)
    assert torch.allclose(got_cos, cos, atol=1e-5) and torch.allclose(got_sin, sin, atol=1e-5)


@pytest.mark.parametrize("kind", KINDS)
def test_heads_with_a_reduced_draft_vocabulary(workdir, kind):
    """--draft-vocab N: heads read the target's output layer at the N - 1 most frequent training tokens
    only (a map in the artifact), learn from the cached teacher (features and top-k over those tokens),
    propose target ids, and decode exactly as ar."""
    from specdec.models import vocab as draft_vocab
    from specdec.models.loading import load_target

    out = workdir / f"{kind}-vocab"
    extra = {"window": 16} if kind == "clover" else ({"eagle3": True, "feature_layers": "eagle3", "unroll": 2} if kind == "eagle" else {})
    m = train_heads(kind, workdir / "target", [workdir / "data.jsonl"], out, tiny_cfg(steps=12, lr=1e-2 if kind != "eagle" else 3e-3),
                    draft_vocab=40, teacher_topk=8, **extra)
    curve = m["loss_curve"]
    assert sum(curve[-3:]) / 3 < sum(curve[:3]) / 3
    assert m["draft_vocab"] == 40 and 0 < m["vocab_coverage_heldout"] <= 1 and m["teacher_s"] >= 0
    vocab = draft_vocab.load(out)
    assert vocab.size == 40 and (out / "teacher_cache.safetensors").exists()
    target, tok, _ = load_target(workdir / "target")
    drafter = build_drafter(out, target, tok, SimpleNamespace(num_draft=None, tree="static", tree_tokens=10))
    assert drafter.heads.d2t is not None
    prompt = tok("the cat sat on the mat and the dog")["input_ids"]
    res = SpecEngine(target, tok, drafter).generate([GenRequest(prompt_ids=prompt, max_new_tokens=16)])
    ar = SpecEngine(target, tok, None).generate([GenRequest(prompt_ids=prompt, max_new_tokens=16)])
    assert res[0].token_ids == ar[0].token_ids
    assert res[0].stats["drafted_tokens"] > 0
    # every proposed token is one of the draft vocabulary's
    allowed = set(vocab.d2t[:-1].tolist())
    seen = []
    orig = drafter._grow_static

    def spy(batch, depth):
        tree = orig(batch, depth)
        seen.extend(tree.tokens.flatten().tolist())
        return tree

    drafter._grow_static = spy
    SpecEngine(target, tok, drafter).generate([GenRequest(prompt_ids=prompt, max_new_tokens=8)])
    assert seen and set(seen) <= allowed


def test_published_eagle3_with_a_reduced_vocabulary_trains_on_the_teacher_cache(workdir):
    """The published EAGLE-3 (models.interop) with --draft-vocab: its own output layer over the draft's
    tokens, learned from the cached teacher's top-k; decodes exactly as ar."""
    from specdec.models.loading import load_target

    out = workdir / "eagle3-published-vocab"
    m = train_heads("eagle", workdir / "target", [workdir / "data.jsonl"], out, tiny_cfg(steps=12, lr=3e-3),
                    draft_vocab=40, teacher_topk=8, eagle3=True, feature_layers="eagle3", unroll=2, layout="published")
    curve = m["loss_curve"]
    assert sum(curve[-3:]) / 3 < sum(curve[:3]) / 3
    target, tok, _ = load_target(workdir / "target")
    drafter = build_drafter(out, target, tok, SimpleNamespace(num_draft=None, tree="static", tree_tokens=10))
    assert drafter.heads.draft_ids is not None and drafter.heads.lm_head.out_features == 39
    prompt = tok("the cat sat on the mat and the dog")["input_ids"]
    res = SpecEngine(target, tok, drafter).generate([GenRequest(prompt_ids=prompt, max_new_tokens=16)])
    ar = SpecEngine(target, tok, None).generate([GenRequest(prompt_ids=prompt, max_new_tokens=16)])
    assert res[0].token_ids == ar[0].token_ids and res[0].stats["drafted_tokens"] > 0
