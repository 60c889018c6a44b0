"""Beam search and Diverse Beam Search (``decode.engine.beams``): transformers' beam search to the token
and the score, the groups' diversity, and ``specdec decode --beams`` end to end."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import ByteTokenizer, invoke, make_prompts, tiny_llama

from specdec.decode.engine.beams import BeamSearch
from specdec.decode.engine.types import GenRequest
from specdec.decode.options import DecodeOptions

PROMPTS = make_prompts(4, seed=3)


@pytest.fixture(scope="module")
def model():
    """A tiny Llama of this module's own, whose eos id the tests change and put back."""
    return tiny_llama(seed=0)


@pytest.fixture()
def eos(model):
    """Set the model's EOS token id for one test (both transformers and BeamSearch read it)."""
    before = model.generation_config.eos_token_id

    def use(token: int):
        model.generation_config.eos_token_id = token

    yield use
    model.generation_config.eos_token_id = before


def beam_search(model, prompt, max_new, beams, groups=1, penalty=0.0):
    search = BeamSearch(model, ByteTokenizer(), DecodeOptions(beams=beams, beam_groups=groups, diversity_penalty=penalty))
    return search.decode(GenRequest(list(prompt), max_new))


def outputs(result):
    return [result, *result.alternatives]


def hf_beams(model, prompt, max_new, beams):
    """transformers' beam search: each returned sequence's new tokens (up to its own length) and score."""
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), num_beams=beams, num_return_sequences=beams,
                         do_sample=False, max_new_tokens=max_new, early_stopping=False, length_penalty=1.0,
                         output_scores=True, return_dict_in_generate=True)
    lengths = (out.beam_indices != -1).sum(dim=1).tolist()  # the sequences are padded past their own end
    n = len(prompt)
    return [(out.sequences[i, n:n + lengths[i]].tolist(), float(out.sequences_scores[i])) for i in range(beams)]


def assert_same_as_transformers(model, prompt, max_new, beams):
    ref = hf_beams(model, prompt, max_new, beams)
    result = beam_search(model, prompt, max_new, beams)
    mine = outputs(result)
    assert [r.token_ids for r in mine] == [toks for toks, _ in ref]
    for r, (_, score) in zip(mine, ref):
        assert r.score == pytest.approx(score, rel=1e-6)
    scores = [r.score for r in mine]
    assert scores == sorted(scores, reverse=True)
    return result


@pytest.mark.parametrize("beams", [2, 4])
@pytest.mark.parametrize("prompt", PROMPTS[:2])
def test_plain_beam_search_is_transformers_without_eos(model, prompt, beams):
    result = assert_same_as_transformers(model, prompt, 12, beams)
    eos_id = model.generation_config.eos_token_id
    assert all(eos_id not in r.token_ids and len(r.token_ids) == 12 and r.finish_reason == "length" for r in outputs(result))
    assert result.stats == {"new_tokens": 12, "target_calls": 12, "beams": beams, "beam_groups": 1}
    assert all(r.stats == {"new_tokens": 12} for r in result.alternatives)


@pytest.mark.parametrize("beams", [2, 4])
def test_plain_beam_search_is_transformers_where_beams_end(model, eos, beams):
    """Token 7 as EOS: every hypothesis ends with it before the budget, at different lengths, and the
    search stops early (transformers' heuristic), with fewer forwards than the budget."""
    eos(7)
    result = assert_same_as_transformers(model, PROMPTS[0], 16, beams)
    outs = outputs(result)
    assert all(r.token_ids[-1] == 7 and r.finish_reason == "stop" for r in outs)
    assert len({len(r.token_ids) for r in outs}) == beams  # they ended at different steps
    assert result.stats["target_calls"] < 16
    assert [r.stats["new_tokens"] for r in outs] == [len(r.token_ids) for r in outs]


@pytest.mark.parametrize("beams", [2, 4])
def test_plain_beam_search_is_transformers_where_some_beams_end(model, eos, beams):
    """Token 63 as EOS: ended and budget-cut hypotheses side by side."""
    eos(63)
    result = assert_same_as_transformers(model, PROMPTS[0], 16, beams)
    reasons = {r.finish_reason for r in outputs(result)}
    assert reasons == {"stop", "length"}


def test_stop_strings_end_beams(model):
    """A stop string ends a beam as EOS does (in the finished set, finish reason "stop")."""
    plain = outputs(beam_search(model, PROMPTS[1], 10, 2))
    token = plain[0].token_ids[3]
    opts = DecodeOptions(beams=2, stop=[f" {token} "])
    result = BeamSearch(model, ByteTokenizer(), opts).decode(GenRequest(PROMPTS[1], 10))
    stopped = [r for r in outputs(result) if r.finish_reason == "stop"]
    assert stopped and all(f" {token} " in ByteTokenizer().decode(r.token_ids[-32:]) for r in stopped)


def test_groups_without_penalty_are_independent_beam_searches(model):
    """λ = 0: each of the G groups is a beam search of B/G beams, so B=4 in 2 groups returns plain
    2-beam search's outputs, each twice (best first)."""
    two = outputs(beam_search(model, PROMPTS[2], 10, 2))
    grouped = beam_search(model, PROMPTS[2], 10, 4, groups=2, penalty=0.0)
    assert grouped.token_ids == two[0].token_ids
    assert [r.token_ids for r in outputs(grouped)] == [two[0].token_ids] * 2 + [two[1].token_ids] * 2
    for r, s in zip(outputs(grouped), [two[0], two[0], two[1], two[1]]):
        assert r.score == pytest.approx(s.score, rel=1e-6)
    assert grouped.stats["beams"] == 4 and grouped.stats["beam_groups"] == 2


@pytest.mark.parametrize("prompt", PROMPTS[:3])
def test_diversity_penalty_separates_the_groups(model, prompt):
    """A large λ: group 1 never takes a token group 0's beams chose at the same step, so its hypotheses
    start with other tokens; group 0, decoded first, is plain beam search of B/G beams; and the B
    outputs differ from λ = 0's."""
    search = BeamSearch(model, ByteTokenizer(), DecodeOptions(beams=4, beam_groups=2, diversity_penalty=100.0))
    groups, _ = search.search(list(prompt), 10)
    assert [len(g) for g in groups] == [2, 2]
    first = [{h.tokens[0] for h in g} for g in groups]
    assert not first[0] & first[1], first
    plain = outputs(beam_search(model, prompt, 10, 2))
    assert [h.tokens for h in groups[0]] == [r.token_ids for r in plain]
    # group 1's scores carry the penalties it could not avoid, none here: it paid nothing more than its log-probs
    assert all(h.score > -100.0 for h in groups[1])
    diverse = outputs(search.decode(GenRequest(list(prompt), 10)))
    same = outputs(beam_search(model, prompt, 10, 4, groups=2, penalty=0.0))
    assert [r.token_ids for r in diverse] != [r.token_ids for r in same]
    assert len({tuple(r.token_ids) for r in diverse}) == 4
    scores = [r.score for r in diverse]
    assert scores == sorted(scores, reverse=True)


def test_a_small_penalty_lowers_the_later_groups_scores(model):
    """λ accumulates in a group's beam scores: where group 1 takes a token group 0 took, its score is
    lower than the log-probability alone."""
    prompt = PROMPTS[0]
    loose = BeamSearch(model, ByteTokenizer(), DecodeOptions(beams=4, beam_groups=2, diversity_penalty=1e-3))
    groups, _ = loose.search(list(prompt), 8)
    free = BeamSearch(model, ByteTokenizer(), DecodeOptions(beams=4, beam_groups=2, diversity_penalty=0.0))
    base, _ = free.search(list(prompt), 8)
    # the penalty is too small to change any choice here: the same hypotheses, group 1's scores lowered
    assert [[h.tokens for h in g] for g in groups] == [[h.tokens for h in g] for g in base]
    assert [h.score for h in groups[0]] == pytest.approx([h.score for h in base[0]], rel=1e-6)
    for h, b in zip(groups[1], base[1]):
        # each of its steps took a token one or both of group 0's beams took (the last step's too): λ to 2λ
        # lower per step (float32 scores)
        drop = (b.score - h.score) * len(h.tokens)  # the scores are divided by the length
        assert 1e-3 * len(h.tokens) - 1e-4 <= drop <= 2e-3 * len(h.tokens) + 1e-4, drop


def read_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_decode_job_writes_the_beams(tiny_family, tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"prompt": f"def f{i}(x):\n    return x + {i}\n"}) + "\n" for i in range(2)))
    out = tmp_path / "out.jsonl"
    res = invoke(["decode", "--target", tiny_family / "target", "--in", src, "--out", out, "--max-new-tokens", "8",
                  "--beams", "4", "--beam-groups", "2", "--diversity-penalty", "1.0"])
    assert res.exit_code == 0, res.output
    records = read_jsonl(out)
    assert len(records) == 2
    for rec in records:
        samples = rec["samples"]
        assert len(samples) == 4
        assert all(isinstance(s["score"], float) and s["finish_reason"] in ("stop", "length") for s in samples)
        scores = [s["score"] for s in samples]
        assert scores == sorted(scores, reverse=True)
        assert rec["completion"] == samples[0]["completion"] and rec["score"] == samples[0]["score"]
        assert rec["finish_reason"] == samples[0]["finish_reason"]
        stats = rec["stats"]
        assert stats["beams"] == 4 and stats["beam_groups"] == 2 and 1 <= stats["target_calls"] <= 8
        assert all("target_calls" not in s["stats"] for s in samples[1:])
        assert all(1 <= s["stats"]["new_tokens"] <= 8 for s in samples)


def test_beams_refuse_a_drafter(tiny_family, tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"prompt": "def f(x):\n"}) + "\n")
    res = invoke(["decode", "--target", tiny_family / "target", "--in", src, "--out", tmp_path / "out.jsonl",
                  "--beams", "2", "--drafter", "ngram"])
    assert res.exit_code == 2, res.output
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "--beams" in lines[0], res.stderr
    assert not (tmp_path / "out.jsonl").exists() or not (tmp_path / "out.jsonl").read_text()
