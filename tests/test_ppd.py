"""Positions that ride the verify forward (``decode.drafters.base.Riding``) and the two drafters built on them,
PPD (trained prompt embeddings) and Hidden Transfer (linear maps of an intermediate layer's states):
the riding positions never reach the cache, decoding stays exactly the target's (greedy and sampled),
training lowers the loss, and ``train-heads --kind ppd`` writes an artifact ``decode --drafter`` takes."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from conftest import ByteTokenizer, invoke, make_prompts, tiny_llama

from specdec.decode.drafters.base import Riding, chain_proposal
from specdec.decode.drafters.parallel_prompts import RidingDrafter, build_riding_drafter
from specdec.decode.engine import loop
from specdec.decode.engine.loop import SpecEngine
from specdec.decode.engine.types import GenRequest
from specdec.decode.engine.verify import Sampling
from specdec.models.head_artifacts import build_heads
from specdec.tests.test_sampling import P_FLOOR, two_token_pvalue
from specdec.tests.test_train import make_target_dir, tiny_cfg, write_decode_output
from specdec.train.trainers.heads import train_heads


def _generate(target, drafter, prompts, max_new=16, sampling=None, **kw):
    reqs = [GenRequest(prompt_ids=p, max_new_tokens=max_new) for p in prompts]
    return SpecEngine(target, ByteTokenizer(), drafter, sampling=sampling, eos_ids=[], **kw).generate(reqs)


def _decodes_as_ar(target, tok, drafter, before_each=None):
    """Greedy decoding with ``drafter`` at bs 1 and 3 is the target's own, and every row drafted."""
    texts = ["the cat sat on the", "a dog and a", "once upon a time there was"]
    for bs in (1, 3):
        if before_each is not None:
            before_each()
        reqs = [GenRequest(prompt_ids=tok(t)["input_ids"], max_new_tokens=16) for t in texts[:bs]]
        res = SpecEngine(target, tok, drafter, eos_ids=[]).generate(reqs)
        ar = SpecEngine(target, tok, None, eos_ids=[]).generate(reqs)
        assert [r.token_ids for r in res] == [r.token_ids for r in ar]
        assert all(r.stats["drafted_tokens"] > 0 for r in res)


class GarbageRider(Riding):
    """Random chains of random lengths, and 3 riding positions whose input embeddings are noise; checks after
    every round that the target's cache holds exactly each row's committed text (no riding slot)."""

    ride_positions = 3

    def __init__(self, target, prompts, max_new, states):
        self.target, self.prompts, self.max_new, self.states = target, prompts, max_new, states
        self.g = torch.Generator().manual_seed(7)
        self.hooked = self.checked = 0
        self.ride_shapes = []

    def propose(self, batch):
        vocab = self.target.config.vocab_size
        drafts = [torch.randint(vocab, (int(torch.randint(0, 4, (1,), generator=self.g)),), generator=self.g).tolist() for _ in batch.seqs]
        return chain_proposal([d[: batch.num_draft] for d in drafts], batch.device)

    def ride_ids(self, bsz, device, count=None):
        return torch.randint(self.target.config.vocab_size, (bsz, count or self.ride_positions), generator=self.g).to(device)

    def riding(self, start, last):
        import contextlib

        m, g = self.ride_positions, self.g
        cols = torch.arange(start, start + m)

        def hook(module, args, out):
            self.hooked += 1
            out = out.clone()
            out[:, cols] = 50 * torch.randn(out.shape[0], m, out.shape[-1], generator=g, dtype=out.dtype)
            return out

        @contextlib.contextmanager
        def scope():
            handle = self.target.get_input_embeddings().register_forward_hook(hook)
            try:
                yield
            finally:
                handle.remove()

        return scope()

    def observe(self, batch, seg):
        self.ride_shapes.append(tuple(seg.ride_logits.shape))
        assert seg.logits.shape[1] == seg.input_ids.shape[1]  # the verified segment: [root, drafts...] only
        state = self.states[-1]
        for r, seq in enumerate(batch.seqs):
            if len(seq) < len(self.prompts[batch.rows[r]]) + self.max_new:  # not cut at max_new this round
                # the root is not in the cache yet: every other committed token is, and nothing else
                assert int(state.valid[r].sum()) == int(state.pos[r]) == len(seq) - 1
                self.checked += 1

    def admit(self, batch, seg):
        pass


@pytest.mark.parametrize("bs", [1, 3])
def test_riding_positions_leave_no_trace(target, monkeypatch, bs):
    states = []

    class Recorded(loop.KVState):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            states.append(self)

    monkeypatch.setattr(loop, "KVState", Recorded)
    prompts = make_prompts(bs, seed=30 + bs)
    ar = _generate(target, None, prompts)
    drafter = GarbageRider(target, prompts, 16, states)
    out = _generate(target, drafter, prompts, num_draft=3)
    assert [r.token_ids for r in out] == [r.token_ids for r in ar]
    assert drafter.hooked > 0 and drafter.checked > 0
    assert all(s[1] == 3 and s[2] == target.config.vocab_size for s in drafter.ride_shapes)
    assert sum(r.stats["drafted_tokens"] for r in out) > 0


def test_with_prefill_chunk_new_rows_are_prefilled_on_their_own(target):
    """Continuous batching with --prefill-chunk: new rows are prefilled on their own (one thing rides at a time)."""
    heads = build_heads("ppd", target, {"num_heads": 2}).attach(target, init_from_lm_head=True).double().eval()
    prompts = make_prompts(4, seed=5)
    engine = SpecEngine(target, ByteTokenizer(), RidingDrafter(heads, target), eos_ids=[], prefill_chunk=4)
    reqs = [GenRequest(prompt_ids=p, max_new_tokens=8 + 3 * i) for i, p in enumerate(prompts)]
    got = {i: r.token_ids for i, r in engine.stream(iter(reqs), 2)}
    ar = _generate(target, None, prompts, max_new=8)
    assert [got[i][:8] for i in range(4)] == [r.token_ids for r in ar]


# ---------------------------------------------------------------------------------------------
# training on a tiny target, then decoding with the artifacts


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    root = tmp_path_factory.mktemp("ppd")
    make_target_dir(root / "target", layers=3)
    write_decode_output(root / "data.jsonl", n=150)
    return root


@pytest.fixture(scope="module")
def trained(workdir):
    out = {}
    for kind, lr in (("ppd", 3e-2), ("hidden-transfer", 1e-2)):
        path = workdir / kind
        out[kind] = (path, train_heads(kind, workdir / "target", [workdir / "data.jsonl"], path, tiny_cfg(steps=12, lr=lr),
                                       num_heads=3, cuts=8))
    return out


@pytest.mark.parametrize("kind", ["ppd", "hidden-transfer"])
def test_training_lowers_the_loss_and_the_artifact_decodes_as_ar(workdir, trained, kind):
    from specdec.models.loading import load_target

    path, m = trained[kind]
    curve = m["loss_curve"]
    assert sum(curve[-3:]) / 3 < sum(curve[:3]) / 3
    assert len(m["top1_accuracy"]) == 3
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["kind"] == kind and cfg["num_heads"] == 3 and "placeholder" in cfg
    if kind == "hidden-transfer":
        assert cfg["layer"] == 1  # round(2 * 3 / 3) - 1: the output of the second of three layers
    target, tok, _ = load_target(workdir / "target")
    drafter = build_riding_drafter(path, target, tok, SimpleNamespace(num_draft=None))
    _decodes_as_ar(target, tok, drafter)


def test_ensemble_chains_do_not_see_each_other(target):
    """PPD's ensemble: e chains of m positions ride each forward, blind to each other. With both members' prompts
    equal, each member's riding logits equal the other's and those of a single chain with the same prompts,
    round after round (a member that saw the other's positions would differ); decoding stays the target's."""
    torch.manual_seed(0)
    one = build_heads("ppd", target, {"num_heads": 2}).attach(target, init_from_lm_head=True).double().eval()
    two = build_heads("ppd", target, {"num_heads": 2, "ensemble": 2}).attach(target).double().eval()
    with torch.no_grad():
        one.prompts.normal_(0, 0.5)
        two.prompts.copy_(one.prompts.repeat(2, 1))
    seen = {}
    for name, heads in (("one", one), ("two", two)):
        drafter = RidingDrafter(heads, target)
        observe, seen[name] = drafter.observe, []

        def spy(batch, seg, observe=observe, log=seen[name]):
            log.append(seg.ride_logits.clone())
            observe(batch, seg)

        drafter.observe = spy
        prompts = make_prompts(3, seed=9)
        out = _generate(target, drafter, prompts, num_draft=2)
        assert [r.token_ids for r in out] == [r.token_ids for r in _generate(target, None, prompts)]
    assert len(seen["one"]) == len(seen["two"]) > 1
    for a, b in zip(seen["one"], seen["two"]):
        assert b.shape[1] == 2 * a.shape[1] == 4
        torch.testing.assert_close(b[:, :2], a, rtol=1e-9, atol=1e-9)
        torch.testing.assert_close(b[:, 2:], a, rtol=1e-9, atol=1e-9)


def test_ensemble_trains_and_decodes_as_ar(workdir):
    """A PPD ensemble of 2: the loss falls, the artifact keeps e and its 2 x 3 prompts, greedy decoding at bs 1
    and 3 is the target's, and the members were pulled apart (they start apart: equal members stay equal)."""
    from specdec.models.loading import load_target

    path = workdir / "ppd-ensemble"
    m = train_heads("ppd", workdir / "target", [workdir / "data.jsonl"], path, tiny_cfg(steps=12, lr=3e-2),
                    num_heads=3, cuts=8, ensemble=2)
    assert sum(m["loss_curve"][-3:]) / 3 < sum(m["loss_curve"][:3]) / 3
    assert len(m["top1_accuracy"]) == 3
    assert json.loads((path / "config.json").read_text())["ensemble"] == 2
    target, tok, _ = load_target(workdir / "target")
    drafter = build_riding_drafter(path, target, tok, SimpleNamespace(num_draft=None))
    assert drafter.ride_positions == 6 and drafter.heads.prompts.shape[0] == 6
    assert not torch.allclose(drafter.heads.prompts[:3], drafter.heads.prompts[3:])
    _decodes_as_ar(target, tok, drafter)


@pytest.mark.parametrize("kind,tree", [("ppd", "static"), ("ppd", "dynamic"), ("hidden-transfer", "static")])
def test_sparse_tree_decodes_as_ar_and_always_has_candidates(workdir, trained, kind, tree):
    """A sparse tree of the riding predictions' top candidates, a riding chain on every node: greedy output is the
    target's at bs 1 and 3, and every round after a row's first proposes (whichever node the row stopped at)."""
    from specdec.models.loading import load_target

    path, _ = trained[kind]
    target, tok, _ = load_target(workdir / "target")
    drafter = build_riding_drafter(path, target, tok, SimpleNamespace(num_draft=None, tree=tree, tree_tokens=6, top_k=2))
    assert drafter.proposes_trees
    proposed = []
    propose = drafter.propose

    def spy(batch):
        out = propose(batch)
        proposed.append(out is not None)
        return out

    drafter.propose = spy
    runs = []

    def next_run():
        if runs:
            runs[-1] = list(proposed)
        proposed.clear()
        runs.append(None)

    _decodes_as_ar(target, tok, drafter, before_each=next_run)
    runs[-1] = list(proposed)
    for seen in runs:
        assert seen[0] is False and all(seen[1:]) and len(seen) > 2


def test_sparse_tree_riding_chains_see_their_node_only():
    """Each node's riding chain gives the logits a plain forward of the committed text, the node's path and the
    prompt embeddings gives (a chain that saw another branch, or sat at another position, would differ)."""
    target = tiny_llama(seed=0).double()
    torch.manual_seed(1)
    heads = build_heads("ppd", target, {"num_heads": 2}).attach(target, init_from_lm_head=True).double().eval()
    with torch.no_grad():
        heads.prompts.normal_(0, 0.5)
    drafter = RidingDrafter(heads, target, tree="static", nodes=5, top_k=2)
    rounds, propose, observe = [], drafter.propose, drafter.observe

    def spy_propose(batch):
        out = propose(batch)
        rounds.append([list(batch.seqs[0]), out])
        return out

    def spy_observe(batch, seg):
        rounds[-1].append(seg.ride_logits.clone())
        observe(batch, seg)

    drafter.propose, drafter.observe = spy_propose, spy_observe
    prompt = make_prompts(1, seed=4)[0]
    _generate(target, drafter, [prompt], max_new=10)
    checked = 0
    for seq, proposal, ride in rounds:
        if proposal is None:
            continue
        toks, parents = proposal.tokens[0].tolist(), proposal.parents[0].tolist()
        for slot in range(len(toks) + 1):
            path, node = [], slot - 1
            while node >= 0:
                path.insert(0, toks[node])
                node = parents[node]
            ids = torch.tensor([seq + path + [0, 0]])
            cols = torch.tensor([[ids.shape[1] - 2, ids.shape[1] - 1]])
            with torch.no_grad(), heads.injecting(cols, cols - 1):
                ref = target(input_ids=ids).logits[0, -2:]
            torch.testing.assert_close(ride[0, 2 * slot : 2 * slot + 2], ref, rtol=1e-9, atol=1e-9)
            checked += 1
    assert checked > 5


def test_ensemble_is_ppds_only(workdir, tmp_path):
    from specdec.models.errors import UsageError

    with pytest.raises(UsageError, match="--ensemble"):
        train_heads("hidden-transfer", workdir / "target", [workdir / "data.jsonl"], tmp_path / "x", tiny_cfg(steps=1), ensemble=2)


@pytest.mark.parametrize("kind,ensemble,tree", [("ppd", 1, None), ("ppd", 2, None), ("hidden-transfer", 1, None), ("ppd", 1, "static")])
def test_sampling_keeps_the_target_distribution(kind, ensemble, tree):
    """At T = 0.8 the second and third tokens (the third drafted: the riding positions of the round that drew
    the second, which followed the root alone) follow the target's exact joint distribution given the first."""
    vocab = 12
    target = tiny_llama(vocab=vocab, hidden=32, layers=2, seed=3)
    with torch.no_grad():
        target.lm_head.weight.mul_(0.25)
    torch.manual_seed(0)
    heads = build_heads(kind, target, {"num_heads": 2, "ensemble": ensemble}).attach(target, init_from_lm_head=True).double().eval()
    prompt = [5, 7, 5, 7, 5]
    sampling = Sampling(temperature=0.8)
    engine = SpecEngine(target, ByteTokenizer(), RidingDrafter(heads, target, tree=tree, nodes=4, top_k=2), sampling, num_draft=2,
                        seed=123, eos_ids=[])
    res = engine.generate([GenRequest(prompt, 3) for _ in range(6000)])
    assert sum(r.stats["accepted_tokens"] for r in res) > 0  # drafts were tested
    by_first = {}
    for r in res:
        by_first.setdefault(r.token_ids[0], []).append(r)
    first, rows = max(by_first.items(), key=lambda kv: len(kv[1]))
    later = [SimpleNamespace(token_ids=r.token_ids[1:]) for r in rows]
    assert len(later) > 600
    assert two_token_pvalue(later, target, prompt + [first], sampling) > P_FLOOR


def test_cli_trains_ppd_and_decode_uses_it(tiny_family, tmp_path):
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"text": "def f%d(x):\n    return x * %d + %d\n" % (i, i, i * i)}) + "\n" for i in range(80)))
    out = tmp_path / "ppd"
    res = invoke(["train-heads", "--kind", "ppd", "--target", tiny_family / "target", "--data", data, "--out", out,
                  "--max-steps", "3", "--batch-size", "8", "--seq-len", "32", "--num-heads", "2"])
    assert res.exit_code == 0, res.output
    assert json.loads((out / "config.json").read_text())["kind"] == "ppd" and (out / "model.safetensors").exists()
    prompts = tmp_path / "in.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"def g{i}(y):\n    return y +"}) + "\n" for i in range(2)))
    records = {}
    for name, drafter in (("ar", "ar"), ("ppd", str(out))):
        dst = tmp_path / f"{name}.jsonl"
        res = invoke(["decode", "--in", prompts, "--out", dst, "--target", tiny_family / "target", "--drafter", drafter,
                      "--max-new-tokens", "12"])
        assert res.exit_code == 0, res.output
        records[name] = [json.loads(line) for line in dst.read_text().splitlines()]
    assert [r["completion"] for r in records["ppd"]] == [r["completion"] for r in records["ar"]]
    assert sum(r["stats"]["drafted_tokens"] for r in records["ppd"]) > 0


def test_cli_refuses_an_ensemble_for_other_kinds(tiny_family, tmp_path):
    data = tmp_path / "data.jsonl"
    data.write_text(json.dumps({"text": "def f(x):\n    return x\n"}) + "\n")
    res = invoke(["train-heads", "--kind", "medusa", "--ensemble", "2", "--target", tiny_family / "target", "--data", data,
                  "--out", tmp_path / "m", "--max-steps", "1"])
    assert res.exit_code == 2 and "error:" in res.output and "--ensemble" in res.output and "Traceback" not in res.output
