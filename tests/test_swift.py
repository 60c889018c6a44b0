"""SWIFT: lossless greedy decoding while the skip set is searched, the search itself, early stop."""

from __future__ import annotations

import pytest
from conftest import ByteTokenizer, make_prompts, tiny_llama

from specdec.decode.drafters.draft_model import ModelDrafter
from specdec.decode.drafters.self_speculation import layer_skip_view, middle_layers
from specdec.decode.engine.loop import SpecEngine
from specdec.decode.drafters.self_speculation import ConfidenceDrafter, SwiftDrafter
from specdec.decode.engine.types import GenRequest
from specdec.decode.engine.verify import Sampling


@pytest.fixture(scope="module")
def deep():
    return tiny_llama(layers=6, seed=3)


def requests(prompts, budgets):
    return [GenRequest(p, n) for p, n in zip(prompts, budgets)]


PROMPTS = make_prompts(3, seed=7)
BUDGETS = [40, 17, 29]  # rows finish at different times


@pytest.fixture(scope="module")
def reference(deep):
    return [r.token_ids for r in SpecEngine(deep, ByteTokenizer()).generate(requests(PROMPTS, BUDGETS))]


def swift(target, **kw):
    # short trials so a short job switches sets many times (each switch re-prefills a view's cache);
    # the tiny model's top probabilities are ~0.03-0.16: a bar of 0.08 stops rows at different lengths
    return SwiftDrafter(target, **{"confidence": 0.08, "search_rounds": 12, "trial_rounds": 1, "reeval_every": 5,
                                   "max_live": 2, **kw})


@pytest.mark.parametrize("bsz", [1, 3])
def test_greedy_swift_is_lossless(deep, reference, bsz):
    drafter = swift(deep)
    got = SpecEngine(deep, ByteTokenizer(), drafter).generate(requests(PROMPTS[:bsz], BUDGETS[:bsz]))
    assert [r.token_ids for r in got] == reference[:bsz]
    assert len({s for s, _ in drafter.history}) > 2  # the job drafted with several skip sets


def test_greedy_swift_is_lossless_under_continuous_batching(deep):
    prompts = make_prompts(5, seed=11)
    budgets = [25, 9, 31, 14, 20]
    ref = [r.token_ids for r in SpecEngine(deep, ByteTokenizer()).generate(requests(prompts, budgets))]
    drafter = swift(deep)
    engine = SpecEngine(deep, ByteTokenizer(), drafter, admit_fraction=0.5)
    got = dict(engine.stream(requests(prompts, budgets), batch_size=2))
    assert [got[i].token_ids for i in range(len(prompts))] == ref
    assert len({s for s, _ in drafter.history}) > 2


def test_search_ends_on_the_best_scored_set(deep, monkeypatch):
    """A scripted score (best: skip exactly {2, 3}) replaces the observed one: the search walks there."""
    goal = frozenset({2, 3})

    def scripted(self, skip, accepted, steps):
        return -len(skip ^ goal)

    monkeypatch.setattr(SwiftDrafter, "round_score", scripted)
    drafter = SwiftDrafter(deep, search_rounds=20, trial_rounds=1, reeval_every=10)
    start = drafter.skip
    assert start == frozenset(middle_layers(6))  # the middle half first
    engine = SpecEngine(deep, ByteTokenizer(), drafter, num_draft=1)
    engine.generate(requests(make_prompts(1, seed=5), [60]))
    assert drafter.rounds > 30
    used = [s for s, _ in drafter.history]
    assert used[0] == start and len(set(used)) > 3
    assert drafter.best() == goal
    # the acceleration phase drafts with the best set, apart from the occasional re-evaluation trial
    after = used[20:]
    assert after.count(goal) >= len(after) - len(after) // 10 - 1
    assert all(0 not in s and 5 not in s for s in used)  # first and last layers are never skipped


def test_score_prefers_cheaper_drafts_at_equal_acceptance(deep):
    drafter = SwiftDrafter(deep)
    assert drafter.round_score(frozenset({1, 2, 3, 4}), [2, 2], 3) > drafter.round_score(frozenset({2}), [2, 2], 3)
    assert drafter.round_score(frozenset({2}), [3, 3], 3) > drafter.round_score(frozenset({2}), [1, 1], 3)


def test_early_stop_gives_per_row_lengths(deep):
    """With a confidence bar between the rows' confidences, rows stop after different numbers of drafts
    (the tiny random model's top probabilities are ~0.03-0.16, so the bars are low)."""
    prompts = make_prompts(3, seed=2)
    view = layer_skip_view(deep, [2, 3])
    probe = ConfidenceDrafter(view, confidence=0.0)  # never stops early: reference drafts
    strict = ConfidenceDrafter(view, confidence=1.01)  # stops after every first draft
    for d in (probe, strict):
        engine = SpecEngine(deep, ByteTokenizer(), d, num_draft=5)
        engine.generate(requests(prompts, [6, 6, 6]))
    assert probe.last_steps == 5 and set(probe.last_lengths) == {5}
    assert strict.last_steps == 1 and set(strict.last_lengths) == {1}

    # a bar the rows straddle: some row stops while another drafts on, and decoding stays lossless
    lengths_seen = []

    class Spy(ConfidenceDrafter):
        def propose(self, batch):
            p = super().propose(batch)
            if p is not None and p.lengths is not None:
                lengths_seen.append(p.lengths.tolist())
            return p

    ref = [r.token_ids for r in SpecEngine(deep, ByteTokenizer()).generate(requests(prompts, [30, 30, 30]))]
    got = SpecEngine(deep, ByteTokenizer(), Spy(view, confidence=0.09), num_draft=6).generate(requests(prompts, [30, 30, 30]))
    assert [r.token_ids for r in got] == ref
    assert lengths_seen and any(len(set(x)) > 1 for x in lengths_seen)


def test_sampling_smoke(deep):
    drafter = swift(deep)
    engine = SpecEngine(deep, ByteTokenizer(), drafter, sampling=Sampling(temperature=0.8, top_p=0.95), seed=3)
    out = engine.generate(requests(PROMPTS, BUDGETS))
    assert [len(r.token_ids) for r in out] == BUDGETS or all(r.finish_reason in ("stop", "length") for r in out)
    assert all(0 <= t < 96 for r in out for t in r.token_ids)
    assert drafter.rounds > 0 and sum(r.stats["accepted_tokens"] for r in out) >= 0


def test_registry_builds_swift(deep):
    from specdec.decode.options import DecodeOptions
    from specdec.decode.drafters.registry import build_drafter

    assert isinstance(build_drafter("swift", deep, ByteTokenizer(), DecodeOptions()), SwiftDrafter)


def tau(results):
    return sum(r.stats["new_tokens"] for r in results) / sum(r.stats["target_calls"] for r in results)


def test_tau_swift_vs_layerskip(deep, capsys):
    """Not a pass/fail bar: the mean tokens per target forward of both, printed for the record."""
    prompts = make_prompts(3, seed=21)
    budgets = [48] * 3
    fixed = ModelDrafter(layer_skip_view(deep, middle_layers(6)))
    t_ls = tau(SpecEngine(deep, ByteTokenizer(), fixed).generate(requests(prompts, budgets)))
    line = [f"layerskip {sorted(middle_layers(6))} {t_ls:.3f}"]
    # the default bar (0.6) stops every round after one draft on this model (its top probabilities are
    # ~0.03-0.16); 0 never stops early (fixed K, as layerskip)
    for conf in (0.6, 0.0):
        searched = SwiftDrafter(deep, confidence=conf)
        t_sw = tau(SpecEngine(deep, ByteTokenizer(), searched).generate(requests(prompts, budgets)))
        line.append(f"swift(confidence {conf}) {t_sw:.3f} ending on {sorted(searched.best())}")
        assert t_sw >= 1.0
    with capsys.disabled():
        print("\ntau " + "; ".join(line))
    assert t_ls >= 1.0


def test_the_default_layer_skip_set_is_searched_to_agree_with_its_model(tmp_path, monkeypatch):
    """Bare ``layerskip`` skips the most layers that keep the draft's greedy token the target's on
    calibration text; on other text it still agrees far more often than chance (1 in the vocabulary),
    and the search is remembered under $SPECDEC_HOME."""
    import torch
    from conftest import save_tiny_lm, tiny_tokenizer
    from transformers import AutoModelForCausalLM

    from specdec.decode.drafters import self_speculation as drafters
    from specdec.decode.drafters.registry import build_drafter
    from specdec.decode.options import DecodeOptions

    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path / "home"))
    tok = tiny_tokenizer()
    save_tiny_lm(tmp_path / "t", tok, layers=6, hidden=48)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "t").eval()
    skip = drafters.search_layerskip(model, tok)
    assert skip and 0 not in skip and 5 not in skip
    ids = tok("for i in range(10):\n    print(i * i)\nclass Point:\n    def __init__(self, x, y):\n" * 3, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        ref = model(ids).logits.argmax(-1)
        got = drafters.layer_skip_view(model, skip)(ids).logits.argmax(-1)
    assert (got == ref).float().mean() > 0.2 > 50 / len(tok)  # 60 times chance
    assert (tmp_path / "home" / "layerskip.json").is_file()
    drafters._searched.clear()

    def no_search(*a, **k):
        raise AssertionError("searched again")

    monkeypatch.setattr(drafters, "layer_skip_view", no_search)
    assert drafters.search_layerskip(model, tok) == skip  # from the disk cache
    monkeypatch.undo()
    drafter = build_drafter("layerskip", model, tok, DecodeOptions())
    kept = len(drafters.arch.decoder_layers(drafter.model)[2])
    assert kept == 6 - len(skip)
