"""SpecDec++ adaptive drafting: exactness against AR, independent per-row lengths, the greedy head
(labels, choice by decode mode, artifact formats, default policy) and the per-step fast paths."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from specdec.decode.drafters.adaptive import AdaptiveDrafter, StopPolicy, build_adaptive, resolve_policies
from specdec.decode.engine.loop import SpecEngine
from specdec.decode.engine.types import GenRequest
from specdec.decode.engine.verify import Sampling
from specdec.models.artifacts import UsageError
from conftest import ByteTokenizer, make_prompts, tiny_llama, tiny_tokenizer
from specdec.models.acceptance import FEATURES, N_STATS, AcceptanceHead, acceptance_features, greedy_features


def _head(hidden: int, seed: int = 3):
    torch.manual_seed(seed)
    head = AcceptanceHead(hidden + N_STATS).double()
    with torch.no_grad():
        # a head whose confidence varies with the hidden state, so rows stop at different steps
        head.out.weight.normal_(0, 0.3)
        head.out.weight[:, -N_STATS:] = 0.0  # the q statistics of a random draft say little; keep the spread from h
        head.out.bias.fill_(2.0)
    return head.eval()


class Recording(AdaptiveDrafter):
    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.seen: list[list[int]] = []
        self.calls: list[int] = []  # draft forwards per round, the pending feed included
        self.plain = 0  # rounds where every row skipped drafting (min_draft 0): the proposal is None
        self._forwards = 0
        self.model.register_forward_hook(lambda *_: setattr(self, "_forwards", self._forwards + 1))

    def propose(self, batch):
        before = self._forwards
        prop = super().propose(batch)
        if prop is not None:
            assert prop.lengths is None or prop.lengths.tolist() == self.last_lengths.tolist()
            assert prop.lengths is not None or len(set(self.last_lengths.tolist())) == 1  # None only when all rows agree
            self.seen.append(self.last_lengths.tolist())
            self.calls.append(self._forwards - before)
        else:
            self.plain += 1
        return prop


def _generate(target, drafter, prompts, max_new=24, sampling=None, seed=0):
    reqs = [GenRequest(prompt_ids=p, max_new_tokens=max_new) for p in prompts]
    return SpecEngine(target, ByteTokenizer(), drafter, sampling=sampling, seed=seed).generate(reqs)


@pytest.mark.parametrize("bs", [1, 3])
@pytest.mark.parametrize("greedy_head", [False, True])
def test_adaptive_greedy_equals_ar(target, draft_model, bs, greedy_head):
    prompts = make_prompts(bs, seed=bs)
    ar = _generate(target, None, prompts)
    hidden = draft_model.config.hidden_size
    extra = {"greedy_head": _head(hidden, seed=11), "greedy_policy": StopPolicy(0.7, 2, 8)} if greedy_head else {}
    drafter = Recording(draft_model, _head(hidden), stop_threshold=0.7, min_draft=2, max_draft=8, **extra)
    out = _generate(target, drafter, prompts)
    assert [r.token_ids for r in out] == [r.token_ids for r in ar]
    lengths = [x for round_ in drafter.seen for x in round_]
    assert all(2 <= x <= 8 for x in lengths)
    assert len(set(lengths)) > 1  # the head makes rounds stop at different lengths
    if bs > 1:
        assert any(len(set(r)) > 1 for r in drafter.seen)  # rows stop independently within a round


def test_adaptive_sampling_runs(target, draft_model):
    prompts = make_prompts(2, seed=7)
    drafter = AdaptiveDrafter(draft_model, _head(draft_model.config.hidden_size), max_draft=6)
    out = _generate(target, drafter, prompts, sampling=Sampling(temperature=0.8), max_new=16)
    assert all(len(r.token_ids) == 16 or r.finish_reason == "stop" for r in out)


def test_build_adaptive_checks(tmp_path, draft_model):
    from safetensors.torch import save_file

    from specdec.models.artifacts import SpecdecError, write_json

    head = _head(draft_model.config.hidden_size)
    save_file({f"{m}.{k}": v.float().contiguous() for m in ("sampling", "greedy") for k, v in head.state_dict().items()},
              str(tmp_path / "model.safetensors"))
    fp = {"vocab_size": 5, "tokenizer_hash": "abc"}
    hidden = draft_model.config.hidden_size
    config = {"kind": "acceptance", "target": fp, "hidden_size": hidden, "features": FEATURES, "input_size": hidden + N_STATS,
              "num_layers": 3, "heads": ["sampling", "greedy"]}
    write_json(tmp_path / "config.json", config)
    opts = SimpleNamespace(stop_threshold=0.2, min_draft=3, max_draft=9)
    drafter = build_adaptive(tmp_path, draft_model, opts)
    sampling = drafter.policies["sampling"]
    assert sampling.max_draft == 9 and drafter.default_k == 9 and sampling.stop_threshold == 0.2

    class Tok:
        def get_vocab(self):
            return {"x": 0, "y": 1}

    with pytest.raises(SpecdecError, match="another tokenizer"):
        build_adaptive(tmp_path, draft_model, opts, tokenizer=Tok())
    with pytest.raises(SpecdecError, match="hidden size"):
        build_adaptive(tmp_path, tiny_llama(hidden=64, layers=1), opts)

    write_json(tmp_path / "config.json", {k: v for k, v in config.items() if k not in ("features", "input_size")})
    with pytest.raises(SpecdecError, match="retrain it"):
        build_adaptive(tmp_path, draft_model, opts)


def test_head_judges_each_token_from_the_state_that_proposed_it(target, draft_model):
    """The head's input for draft token i is acceptance_features of the draft's forward over the text
    and drafts 1..i-1 (what training computes from one causal forward), and a stopping round feeds
    no token beyond its last draft."""
    seen = []

    class Spy(torch.nn.Module):
        def __init__(self, head):
            super().__init__()
            self.head = head

        def forward(self, x):
            seen.append(x.clone())
            return self.head(x)

    prompt = make_prompts(1, seed=5)[0]
    drafter = Recording(draft_model, Spy(_head(draft_model.config.hidden_size)), stop_threshold=0.5, min_draft=1, max_draft=6)
    root = _generate(target, None, [prompt], max_new=1)[0].token_ids[0]  # the draft starts after the target's token
    _generate(target, drafter, [prompt], max_new=8)
    k = drafter.seen[0][0]
    assert 1 <= k < 6 and drafter.calls[0] == k  # the pending feed + k-1 drafts fed: none after the stop
    # rebuild the round by hand: the prompt, then greedy drafts of the draft model
    ids = torch.tensor([prompt + [root]])
    with torch.no_grad():
        for i in range(k):
            out = draft_model(input_ids=ids, output_hidden_states=True)
            tok = out.logits[:, -1].argmax(-1)
            ref = acceptance_features(out.hidden_states[-1][:, -1], out.logits[:, -1], tok).double()
            assert torch.allclose(seen[i], ref, atol=1e-6)
            ids = torch.cat([ids, tok[:, None]], 1)


# ---------------------------------------------------------------------------------------------
# the greedy head


def test_greedy_labels_hand_built():
    from specdec.train.trainers.acceptance_labels import greedy_labels

    # three positions, vocabulary 4: the draft's argmax, the target's argmax
    q = torch.tensor([[[0.1, 2.0, 0.3, 0.0], [1.0, 0.0, 0.0, 0.5], [0.0, 0.0, 0.2, 3.0]]])
    p = torch.tensor([[[0.0, 5.0, 1.0, 0.0], [0.0, 2.0, 0.0, 0.5], [0.0, 0.0, 0.2, 0.1]]])
    tokens, labels = greedy_labels(p, q)
    assert tokens.tolist() == [[1, 0, 3]]
    assert labels.tolist() == [[1.0, 0.0, 0.0]]  # agree, 0 vs 1, 3 vs 2


def test_label_blocks_greedy_half_matches_the_models(target, draft_model):
    """The greedy head's data: features of the draft's argmax at every position, label 1[argmax q == argmax p]."""
    from datasets import Dataset

    from specdec.train.trainers.acceptance_labels import label_blocks

    ids = torch.randint(3, 90, (5, 9))
    blocks = Dataset.from_dict({"input_ids": ids.tolist()}).with_format("torch")
    seen = []
    for tgt in (target, draft_model):  # an unrelated target (labels mostly 0) and the draft itself (all 1)
        out = label_blocks(draft_model, tgt, blocks, 1.0, 0.15, seed=0, batch=2)
        feats, labels = out["greedy"]
        with torch.no_grad():
            d = draft_model(input_ids=ids, output_hidden_states=True)
            q_arg = d.logits[:, :-1].argmax(-1)
            p_arg = tgt(input_ids=ids).logits[:, :-1].argmax(-1)
            ref = acceptance_features(d.hidden_states[-1][:, :-1], d.logits[:, :-1], q_arg)
        assert torch.equal(labels, (q_arg == p_arg).float().flatten())
        assert torch.allclose(feats, ref.reshape(-1, ref.shape[-1]).float(), atol=1e-6)
        assert out["sampling"][0].shape == feats.shape  # the sampling half judges the same positions
        seen += labels.tolist()
    assert 0 < sum(seen) < len(seen)  # both outcomes occur, so the label check can fail


def test_label_continuations_sampling_labels_are_the_chance_a_draft_is_kept(target, draft_model):
    """Sampled text: the draft's own sample is judged with min(1, p/q) at the temperature: 1 everywhere when the
    draft is the target, below 1 somewhere for an unrelated draft; greedy labels come from the same text."""
    from specdec.train.trainers.acceptance_labels import label_continuations, target_continuations

    from datasets import Dataset

    blocks = Dataset.from_dict({"input_ids": torch.randint(3, 90, (4, 12)).tolist()}).with_format("torch")
    seqs = target_continuations(target, blocks, prefix_len=6, new_tokens=10, temperature=0.7, seed=1, batch=2)
    again = target_continuations(target, blocks, prefix_len=6, new_tokens=10, temperature=0.7, seed=1, batch=2)
    greedy = target_continuations(target, blocks, prefix_len=6, new_tokens=10, batch=2)
    assert seqs.shape == (4, 16) and torch.equal(seqs, again) and not torch.equal(seqs, greedy)
    feats, same = label_continuations(target, target, seqs, 6, temperature=0.7, seed=0)
    assert same.shape == (4, 10) and feats.shape[:2] == (4, 10) and torch.allclose(same, torch.ones_like(same))
    _, other = label_continuations(draft_model, target, seqs, 6, temperature=0.7, seed=0)
    assert ((other >= 0) & (other <= 1)).all() and other.min() < 0.9
    _, g = label_continuations(draft_model, target, seqs, 6)
    assert set(g.unique().tolist()) <= {0.0, 1.0}


def test_draw_acceptance_keeps_each_draft_with_its_chance():
    from specdec.train.trainers.acceptance_labels import draw_acceptance

    chance = torch.tensor([[0.1, 0.5, 0.9], [1.0, 0.0, 0.3]])
    pred = torch.rand(2, 3)
    p, y = draw_acceptance(pred, chance, 4000, seed=0)
    assert p.shape == y.shape == (8000, 3) and torch.equal(p[2:4], pred)  # rows repeated in order
    freq = torch.stack([y[0::2].mean(0), y[1::2].mean(0)])
    assert torch.allclose(freq, chance, atol=0.03) and freq[1, 0] == 1 and freq[1, 1] == 0


def test_greedy_features_fast_path_equals_acceptance_features(draft_model):
    logits = torch.randn(3, 96, dtype=torch.float64) * 4
    hidden = torch.randn(3, draft_model.config.hidden_size, dtype=torch.float64)
    tokens, feats = greedy_features(hidden, logits)
    assert torch.equal(tokens, logits.argmax(-1))
    assert torch.allclose(feats, acceptance_features(hidden, logits, tokens), atol=1e-5)


def test_fast_head_equals_module():
    head = _head(32)
    x = torch.randn(2, 3, 32 + N_STATS, dtype=torch.float64)
    with torch.no_grad():
        for b in head.blocks:  # non-zero blocks, so the residual path is exercised
            b.linear.weight.normal_(0, 0.2)
        assert torch.allclose(head.fast()(x), head(x))
        assert head.fast()(x[0]).shape == (3,)


class _Counting(torch.nn.Module):
    def __init__(self, head):
        super().__init__()
        self.head = head
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return self.head(x)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_head_is_picked_by_decode_mode(target, draft_model, temperature):
    hidden = draft_model.config.hidden_size
    sampling, greedy = _Counting(_head(hidden)), _Counting(_head(hidden, seed=5))
    drafter = AdaptiveDrafter(draft_model, sampling, stop_threshold=0.5, min_draft=1, max_draft=6, greedy_head=greedy)
    _generate(target, drafter, make_prompts(2, seed=9), max_new=12, sampling=Sampling(temperature=temperature))
    used, unused = (greedy, sampling) if temperature == 0 else (sampling, greedy)
    assert used.calls > 0 and unused.calls == 0


def test_greedy_policy_applies_to_greedy_rounds(target, draft_model):
    hidden = draft_model.config.hidden_size
    sure = _head(hidden)
    with torch.no_grad():
        sure.out.bias.fill_(30.0)  # P(accept) ~ 1: only max_draft stops a round
    drafter = Recording(draft_model, sure, stop_threshold=0.3, min_draft=1, max_draft=3, greedy_head=sure,
                        greedy_policy=StopPolicy(0.3, 1, 5))
    _generate(target, drafter, make_prompts(1, seed=2), max_new=20)
    assert drafter.seen and max(x for r in drafter.seen for x in r) == 5
    drafter = Recording(draft_model, sure, stop_threshold=0.3, min_draft=1, max_draft=3, greedy_head=sure,
                        greedy_policy=StopPolicy(0.3, 1, 5))
    _generate(target, drafter, make_prompts(1, seed=2), max_new=20, sampling=Sampling(temperature=0.9))
    assert max(x for r in drafter.seen for x in r) == 3  # sampling rounds keep the sampling policy


def _save_artifact(path, heads: dict, hidden: int, two_heads: bool, policy: dict | None = None):
    from safetensors.torch import save_file

    from specdec.models.artifacts import write_json

    if two_heads:
        state = {f"{m}.{k}": v.float().contiguous() for m, h in heads.items() for k, v in h.state_dict().items()}
    else:
        state = {k: v.float().contiguous() for k, v in heads["sampling"].state_dict().items()}
    save_file(state, str(path / "model.safetensors"))
    config = {"kind": "acceptance", "target": {"vocab_size": 5, "tokenizer_hash": "abc"}, "hidden_size": hidden,
              "features": FEATURES, "input_size": hidden + N_STATS, "num_layers": 3}
    if two_heads:
        config.update(heads=list(heads), policy=policy or {})
    write_json(path / "config.json", config)


def test_two_head_artifact_loads_both_heads_and_its_policy(tmp_path, draft_model):
    hidden = draft_model.config.hidden_size
    heads = {"sampling": _head(hidden, seed=1), "greedy": _head(hidden, seed=2)}
    with torch.no_grad():
        heads["greedy"].out.bias.fill_(-1.0)
    policy = {"greedy": {"stop_threshold": 0.15, "min_draft": 1, "max_draft": 12}, "sampling": {"stop_threshold": 0.3, "min_draft": 2, "max_draft": 20}}
    _save_artifact(tmp_path, heads, hidden, two_heads=True, policy=policy)
    unset = SimpleNamespace(stop_threshold=None, min_draft=None, max_draft=None)
    drafter = build_adaptive(tmp_path, draft_model, unset)
    x = torch.randn(4, hidden + N_STATS, dtype=torch.float64)
    for mode in ("sampling", "greedy"):
        assert torch.allclose(drafter.heads[mode](x), heads[mode](x), atol=1e-5)
    assert drafter.policies["greedy"] == StopPolicy(0.15, 1, 12)
    assert drafter.policies["sampling"] == StopPolicy(0.3, 2, 20)
    assert drafter.default_k == 20
    # user flags win over the artifact's default, field by field
    drafter = build_adaptive(tmp_path, draft_model, SimpleNamespace(stop_threshold=0.6, min_draft=None, max_draft=None))
    assert drafter.policies["greedy"] == StopPolicy(0.6, 1, 12) and drafter.policies["sampling"] == StopPolicy(0.6, 2, 20)


def test_resolve_policies_defaults():
    none = SimpleNamespace(stop_threshold=None, min_draft=None, max_draft=None)
    assert resolve_policies({}, none) == {"sampling": StopPolicy(), "greedy": StopPolicy()}
    got = resolve_policies({"greedy": {"stop_threshold": 0.1, "min_draft": 1, "max_draft": 20}}, SimpleNamespace(stop_threshold=None, min_draft=3, max_draft=None))
    assert got["greedy"] == StopPolicy(0.1, 3, 20) and got["sampling"] == StopPolicy(0.3, 3, 20)


# ---------------------------------------------------------------------------------------------
# the default policy


def test_simulate_rounds_hand_built():
    from specdec.train.trainers.acceptance_policy import simulate_rounds

    # one row of 7 judged positions; a decode starts at index 1 (index 0 is the prefill's token)
    labels = torch.tensor([[1.0, 1.0, 1.0, 0.0, 1.0, 1.0, 1.0]])
    # fixed k=2: round 1 judges 1,2 (both accepted, +3 tokens, j=4); round 2 judges 4,5 (accepted, +3, j=7): end
    r = simulate_rounds(labels, labels, fixed=1.0, per_draft=0.5, k=2)
    assert r["tau"] == 3.0 and r["speedup"] == pytest.approx(6 / (2 * 1.0 + 4 * 0.5))
    # fixed k=3: judges 1,2,3 (2 accepted, +3, j=4); then 4,5,6 (3 accepted, +4, j=8)
    r = simulate_rounds(labels, labels, fixed=1.0, per_draft=0.5, k=3)
    assert r["tau"] == 3.5 and r["drafts_per_round"] == 3.0
    # adaptive: a round stops after drafting the token that drops P(all accepted) below 1 - 0.3
    pred = torch.tensor([[0.9, 0.95, 0.2, 0.95, 0.95, 0.95, 0.95]])
    r = simulate_rounds(pred, labels, fixed=1.0, per_draft=0.5, policy=StopPolicy(0.3, 1, 20))
    # round 1 (j=1): 0.95, then 0.95*0.2 -> stop at n=2; both accepted: +3, j=4.
    # round 2 (j=4): 0.95, 0.9025, 0.857 and the text ends (room 3) -> n=3, all accepted: +4
    assert r["tau"] == 3.5 and r["drafts_per_round"] == 2.5
    assert r["speedup"] == pytest.approx(7 / (2 * 1.0 + 5 * 0.5))


def test_choose_policy_prefers_long_drafts_when_drafting_is_cheap_and_right():
    from specdec.train.trainers.acceptance_policy import choose_policy

    g = torch.Generator().manual_seed(0)
    labels = (torch.rand(8, 60, generator=g) < 0.9).float()
    pred = torch.full_like(labels, 0.9)
    _, cheap = choose_policy(pred, labels, {"fixed": 1.0, "per_draft": 0.05})
    _, dear = choose_policy(pred, labels, {"fixed": 1.0, "per_draft": 0.9})
    # the best adaptive policy: costly drafts stop sooner
    assert cheap["best_adaptive"]["stop_threshold"] > dear["best_adaptive"]["stop_threshold"]
    assert dear["best_adaptive"]["speedup"] == pytest.approx(max(r["speedup"] for r in dear["grid"]))


def test_choose_policy_takes_a_fixed_length_when_the_head_cannot_pay_for_itself():
    from specdec.decode.drafters.adaptive import StopPolicy
    from specdec.train.trainers.acceptance_policy import choose_policy, simulate_rounds

    g = torch.Generator().manual_seed(0)
    labels = (torch.rand(8, 60, generator=g) < 0.5).float()
    # an uninformative head (constant P) cannot tell rounds apart; its per-draft cost only adds
    flat = torch.full_like(labels, 0.5)
    costs = {"fixed": 1.0, "per_draft": 0.45, "head_per_draft": 0.05}
    policy, sim = choose_policy(flat, labels, costs)
    assert sim["chosen_kind"] == "fixed" and policy.fixed and policy.min_draft == sim["best_fixed"]["k"]
    assert sim["best_fixed"]["speedup"] > sim["best_adaptive"]["speedup"]
    # fixed lengths are charged without the head's share
    assert sim["best_fixed"]["speedup"] == pytest.approx(simulate_rounds(flat, labels, 1.0, 0.40, k=policy.min_draft)["speedup"])
    # a head that knows which drafts the target keeps makes adaptive stopping win (where drafts are cheap
    # enough that knowing when to go on pays)
    policy, sim = choose_policy(labels.clamp(0.02, 0.98), labels, {"fixed": 1.0, "per_draft": 0.2, "head_per_draft": 0.05})
    assert sim["chosen_kind"] == "adaptive" and not policy.fixed
    assert policy == StopPolicy(sim["best_adaptive"]["stop_threshold"], sim["best_adaptive"]["min_draft"], 20)
    # a stop rule that beats the best fixed length by less than the margin is not worth running the head for
    edge = sim["best_adaptive"]["speedup"] / sim["best_fixed"]["speedup"]
    assert edge > 1.0
    policy, sim = choose_policy(labels.clamp(0.02, 0.98), labels, {"fixed": 1.0, "per_draft": 0.2, "head_per_draft": 0.05},
                                margin=edge + 0.01)
    assert sim["chosen_kind"] == "fixed" and policy.min_draft == policy.max_draft == sim["best_fixed"]["k"]


def test_fixed_policy_skips_the_head_and_equals_the_draft_model(target, draft_model):
    """min_draft == max_draft == K: the adaptive drafter proposes exactly what a fixed-K draft model
    proposes (same tokens, same drafts per round) and never calls its head."""
    from specdec.decode.drafters.draft_model import ModelDrafter

    calls = []
    head = _head(draft_model.config.hidden_size)
    head.register_forward_hook(lambda *_: calls.append(1))
    fixed = AdaptiveDrafter(draft_model, head, greedy_head=head, greedy_policy=StopPolicy(0.5, 3, 3))
    fixed._scorers = {m: head for m in fixed._scorers}  # through the module, so the hook sees every call
    prompts = make_prompts(3, seed=5)
    outs = {}
    for name, drafter in (("fixed", fixed), ("draft", ModelDrafter(draft_model))):
        reqs = [GenRequest(prompt_ids=p, max_new_tokens=20) for p in prompts]
        res = SpecEngine(target, ByteTokenizer(), drafter, num_draft=3).generate(reqs)
        outs[name] = [(r.token_ids, r.stats["drafted_tokens"]) for r in res]
    assert outs["fixed"] == outs["draft"] and not calls
    assert fixed.last_lengths.tolist() == [3] * fixed.last_lengths.numel()


def test_train_acceptance_writes_two_heads_calibration_and_policy(tiny_family, tmp_path, target):
    import json

    from specdec.models.acceptance import load_acceptance_heads
    from specdec.train.trainers.acceptance import train_acceptance
    from specdec.train.loop import config_from_dict

    data = tmp_path / "data.jsonl"
    lines = ["def f%d(x):\n    return x * %d + %d\n" % (i, i, i * i) for i in range(80)]
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in lines))
    cfg = config_from_dict(dict(lr=1e-2, steps=5, batch=64, seq_len=32, warmup=1, checkpoint_every=0, progress=False, heldout=0.2))
    out = tmp_path / "acc"
    prompts = tmp_path / "prompts.jsonl"  # like the user's: the greedy policy is re-ranked on real rounds over these
    prompts.write_text("".join(json.dumps({"id": str(i), "prompt": f"def g{i}(y):\n    return y +"}) + "\n" for i in range(3)))
    m = train_acceptance(tiny_family / "target", tiny_family / "draft", [data], out, cfg, greedy_sequences=8, greedy_new_tokens=24,
                         cost_new_tokens=8, cost_reps=1, policy_prompts=prompts)
    for mode in ("sampling", "greedy"):
        cal = m[mode]
        assert 0 <= cal["brier"] <= 1 and cal["brier_constant_baseline"] >= 0 and 0 <= cal["ece"] <= 1 and cal["reliability_bins"]
    assert m["greedy_text"]["train_sequences"] == 8 and m["heldout_positions"]["greedy"] > 0
    cfg_json = json.loads((out / "config.json").read_text())
    assert cfg_json["heads"] == ["sampling", "greedy"]
    for mode in ("greedy", "sampling"):  # each mode's policy: the best of its own simulation, under its own costs
        costs = m["round_costs"][mode]
        assert costs["ar_round_s"] > 0 and costs["per_draft"] == costs["per_draft"]  # not NaN
        # the head's share of a draft is timed alone, never more than the draft step it rides on
        assert costs["head_s"] > 0 and 0 <= costs["head_per_draft"] <= max(costs["per_draft"], 0.0)
        sim = m["policy_simulation"][mode]
        chosen = sim["chosen"]
        if mode == "greedy":  # the simulation's best few, re-ranked on real greedy rounds
            on = sim["onpolicy"]
            assert on["prompts"] == 3 and on["prompts_from"] == str(prompts) and on["ar_tokens_per_s"] > 0
            assert all(r["modelled_speedup"] > 0 for r in on["candidates"])  # the cost model's view, kept beside the timing
            assert {r["kind"] for r in on["candidates"]} == {"adaptive", "fixed"} and on["chosen"] == chosen
            best_a = max((r for r in on["candidates"] if r["kind"] == "adaptive"), key=lambda r: r["speedup"])
            best_f = max((r for r in on["candidates"] if r["kind"] == "fixed"), key=lambda r: r["speedup"])
            pick = best_a if best_a["speedup"] >= sim["adaptive_margin"] * best_f["speedup"] else best_f
            assert (chosen["stop_threshold"], chosen["min_draft"], chosen["max_draft"]) == (
                pick["stop_threshold"], pick["min_draft"], pick["max_draft"]) and sim["chosen_kind"] == pick["kind"]
            for r in on["candidates"]:
                assert r["tau"] >= 1.0 and r["speedup"] > 0 and (r["kind"] == "adaptive" or r["drafts_per_round"] <= r["max_draft"])
            assert cfg_json["policy"][mode] == chosen
            continue
        best = max(sim["grid"] + sim["fixed_k"], key=lambda r: r["speedup"])  # adaptive grid and fixed lengths
        best_fixed = max(sim["fixed_k"], key=lambda r: r["speedup"])
        if sim["chosen_kind"] == "fixed":  # a stop rule must beat the best fixed length by the margin
            assert chosen["min_draft"] == chosen["max_draft"] == best_fixed["k"]
            assert max(r["speedup"] for r in sim["grid"]) < sim["adaptive_margin"] * best_fixed["speedup"]
        else:
            assert (chosen["stop_threshold"], chosen["min_draft"]) == (best["stop_threshold"], best["min_draft"])
            assert best["speedup"] >= sim["adaptive_margin"] * best_fixed["speedup"]
        assert cfg_json["policy"][mode] == chosen
    assert m["round_costs"]["sampling"]["temperature"] == m["policy_simulation"]["sampling"]["temperature"] == 1.0
    chosen = m["policy_simulation"]["greedy"]["chosen"]
    heads, _ = load_acceptance_heads(out)
    assert set(heads) == {"sampling", "greedy"}
    from specdec.models.loading import load_draft

    drafter = build_adaptive(out, load_draft(tiny_family / "draft"), SimpleNamespace(stop_threshold=None, min_draft=None, max_draft=None))
    assert drafter.policies["greedy"] == StopPolicy(**chosen)
    assert drafter.policies["sampling"] == StopPolicy(**m["policy_simulation"]["sampling"]["chosen"])


def test_label_sampling_is_exact():
    """The labeller's inverse-CDF sampler draws from the given distribution; zero-probability tokens never."""
    from specdec.train.trainers.acceptance_labels import _sample

    g = torch.Generator().manual_seed(0)
    p = torch.tensor([[0.5, 0.0, 0.3, 0.2], [0.05, 0.05, 0.0, 0.9]])
    n = 40000
    x = _sample(p[:, None].expand(2, n, 4), g)
    freq = torch.stack([torch.bincount(x[i], minlength=4) / n for i in range(2)])
    assert freq[0, 1] == 0 and freq[1, 2] == 0
    assert torch.allclose(freq, p, atol=0.01)  # 4+ standard errors at n = 40000


@pytest.mark.parametrize("bs", [1, 3])
def test_min_draft_zero_skips_rounds_and_stays_exact(target, draft_model, bs):
    """min_draft 0: a row whose first draft alone fails the rule proposes nothing; greedy output stays AR's."""
    prompts = make_prompts(bs, seed=20 + bs)
    ar = _generate(target, None, prompts)
    hidden = draft_model.config.hidden_size
    head = _head(hidden)
    with torch.no_grad():
        head.out.bias.fill_(0.4)  # P(accept) spread around 0.6: some first drafts pass 1 - P < 0.4, some not
    drafter = Recording(draft_model, head, stop_threshold=0.4, min_draft=0, max_draft=6)
    out = _generate(target, drafter, prompts)
    assert [r.token_ids for r in out] == [r.token_ids for r in ar]
    lengths = [x for round_ in drafter.seen for x in round_]
    assert max(lengths) > 0
    if bs == 1:
        assert drafter.plain > 0  # a row that skips makes the whole round plain: no proposal at all
    else:
        assert 0 in lengths  # rows skip independently within a speculative round


def test_simulate_rounds_plain_rounds():
    from specdec.train.trainers.acceptance_policy import simulate_rounds

    labels = torch.tensor([[1.0, 0.0, 1.0, 1.0, 0.0]])
    pred = torch.tensor([[0.5, 0.1, 0.9, 0.9, 0.1]])
    # min_draft 0, threshold 0.5: j=1 P=0.1 -> plain (+1, j=2); j=2: 0.9, 0.81, 0.081 -> n=3, accepted 2: +3, j=5: end
    r = simulate_rounds(pred, labels, fixed=1.4, per_draft=0.3, policy=StopPolicy(0.5, 0, 20))
    assert r["tau"] == 2.0 and r["plain_rounds"] == 0.5 and r["drafts_per_round"] == 1.5
    assert r["speedup"] == pytest.approx(4 / ((1 + 0.3) + (1.4 + 3 * 0.3)))


def test_policy_prompts_file_errors_name_the_line(tmp_path):
    from specdec.train.trainers.acceptance import read_policy_prompts

    tok = tiny_tokenizer()
    good = tmp_path / "good.jsonl"
    good.write_text("".join(json.dumps({"prompt": f"x{i}"}) + "\n" for i in range(5)))
    ids = read_policy_prompts(good, tok, limit=3)
    assert len(ids) == 3 and ids[1] == tok("x1", add_special_tokens=True)["input_ids"]
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "ok"}) + "\n{not json\n")
    with pytest.raises(UsageError, match="bad.jsonl:2: malformed JSON"):
        read_policy_prompts(bad, tok)
    chat = tmp_path / "chat.jsonl"  # messages go through the chat template
    chat.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    assert read_policy_prompts(chat, tok) == [list(tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=True)["input_ids"])]
    no_template = tiny_tokenizer()
    no_template.chat_template = None
    with pytest.raises(UsageError, match="chat.jsonl:1: cannot tokenize"):
        read_policy_prompts(chat, no_template)
    with pytest.raises(UsageError, match="no such prompts file"):
        read_policy_prompts(tmp_path / "missing.jsonl", tok)
