"""Superposed Decoding (decode.approx.superposed): k drafts from one forward per step, approximate."""

from __future__ import annotations

import json
import math

import pytest
import torch
from conftest import ByteTokenizer, invoke, make_prompts, tiny_llama

from specdec.decode.approx.superposed import DEFAULT_NGRAM_WEIGHT, NGramModel, SuperposedDecoder, build, check_spec
from specdec.decode.engine.types import GenRequest
from specdec.decode.options import DecodeOptions
from specdec.models.errors import UsageError


@pytest.fixture(scope="module")
def model():
    return tiny_llama(seed=0)


def decoder(model, k: int, weight: float | None = 0.0, **extra) -> SuperposedDecoder:
    opts = DecodeOptions(drafter="superposed", num_samples=k, ngram_weight=weight, **extra)
    return build("superposed", model, ByteTokenizer(), opts)


def greedy(model, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def outputs(result) -> list:
    return [result, *result.alternatives]


def test_one_draft_without_ngrams_is_greedy_decoding(model):
    """Superposing one draft is the draft itself: k = 1, w = 0 is the target's greedy decoding."""
    dec = decoder(model, 1, 0.0)
    prompts = make_prompts(4, seed=3)
    results = dec.generate([GenRequest(p, 20) for p in prompts])
    for prompt, res in zip(prompts, results):
        assert res.token_ids == greedy(model, prompt, 20)
        assert res.alternatives == [] and res.stats["approximate"] is True
        assert res.stats["target_calls"] == len(res.token_ids)  # prefill + one per further token


def test_scaled_embeddings_pass_through_inputs_embeds():
    """Gemma scales its embeddings inside its embedding module: the superposed input is that module's
    output, so k = 1 is still exactly greedy decoding."""
    from transformers import GemmaConfig, GemmaForCausalLM

    torch.manual_seed(0)
    cfg = GemmaConfig(vocab_size=96, hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=12, max_position_embeddings=256, bos_token_id=1, eos_token_id=2,
                      pad_token_id=0)
    gemma = GemmaForCausalLM(cfg).double().eval()
    with torch.no_grad():
        gemma.lm_head.weight.mul_(8.0)
    assert float(gemma.get_input_embeddings().embed_scale) != 1.0
    dec = decoder(gemma, 1, 0.0)
    for prompt in make_prompts(2, seed=5):
        assert dec.generate([GenRequest(prompt, 12)])[0].token_ids == greedy(gemma, prompt, 12)


def test_k_drafts_cost_one_forward_per_step(model):
    prompts = make_prompts(3, seed=7)
    one = decoder(model, 1, 0.3).generate([GenRequest(p, 16) for p in prompts])
    three = decoder(model, 3, 0.3).generate([GenRequest(p, 16) for p in prompts])
    for a, res in zip(one, three):
        outs = outputs(res)
        assert len(outs) == 3
        assert len({tuple(o.token_ids) for o in outs}) == 3  # distinct drafts
        scores = [o.score for o in outs]
        assert all(s is not None and s <= 0 for s in scores)
        assert scores == sorted(scores, reverse=True)
        assert all(o.stats["approximate"] is True for o in outs)
        # forwards: the prefill and one per step, the longest draft's length; counted once, in the primary
        longest = max(len(o.token_ids) for o in outs)
        assert res.stats["target_calls"] == longest == 16
        assert a.stats["target_calls"] == len(a.token_ids) == 16
        assert res.stats["drafts"] == 3 and res.stats["new_tokens"] == len(res.token_ids)
        assert all(set(o.stats) == {"new_tokens", "approximate"} for o in res.alternatives)
        # the scores are the drafts' log-probabilities under the interpolated scores: the first token's
        # score is at most log of its model probability mixed with an n-gram probability <= 1
        assert all(math.isfinite(s) for s in scores)


def test_a_finished_draft_keeps_its_slot_and_stops(model):
    prompt = make_prompts(1, seed=9)[0]
    dec = decoder(model, 3, 0.0)
    first = outputs(dec.generate([GenRequest(prompt, 12)])[0])
    # make a token the second draft writes at its fourth position an end-of-sequence token, and decode again
    stop = first[1].token_ids[3]
    dec.eos_ids = dec.eos_ids | {stop}
    res = dec.generate([GenRequest(prompt, 12)])[0]
    outs = outputs(res)
    assert len(outs) == 3 and len({tuple(o.token_ids) for o in outs}) == 3
    ended = [o for o in outs if o.finish_reason == "stop"]
    assert ended and all(o.token_ids[-1] == stop and stop not in o.token_ids[:-1] for o in ended)
    assert all(len(o.token_ids) == 12 for o in outs if o.finish_reason == "length")
    assert res.stats["target_calls"] == max(len(o.token_ids) for o in outs)
    assert [o.score for o in outs] == sorted((o.score for o in outs), reverse=True)


def test_ngram_weight_favours_the_pattern_the_prompts_taught(model):
    """The decoder has seen a prompt repeating "a b c"; a prompt that ends in "a b" then ranks the draft
    that goes on with c first once the n-gram model has weight, where the target alone ranks it lower."""
    k = 4
    prompt = make_prompts(1, seed=14)[0]
    with torch.no_grad():
        top = torch.topk(model(torch.tensor([prompt])).logits[0, -1], k).indices.tolist()
    c = top[2]  # in the model's top-k, but not its first choice
    assert c != 2  # not the end of sequence: a pattern goes on
    a, b = prompt[-2:]
    taught = [a, b, c] * 8
    drafts = {}
    for weight in (0.0, 0.5):
        dec = decoder(model, k, weight)
        dec.generate([GenRequest(taught, 2)])  # an earlier record of the job
        drafts[weight] = [o.token_ids for o in outputs(dec.generate([GenRequest(prompt, 8)])[0])]
    assert drafts[0.0] != drafts[0.5]
    # the best draft at weight 0 begins with the target's first choice; none, or a lower one, with c
    rank = {w: next((i for i, d in enumerate(ds) if d[0] == c), len(ds)) for w, ds in drafts.items()}
    assert rank[0.0] > 0 and rank[0.5] == 0
    assert drafts[0.0][0][0] == top[0]
    assert all(d[0] == c for d in drafts[0.5][:2])


def test_ngram_model_is_a_distribution_with_own_text_and_a_bounded_corpus():
    vocab = 20
    lm = NGramModel(order=3, limit=40)
    lm.add([3, 4, 5] * 6)
    every = list(range(vocab))
    for seq in ([3, 4], [9, 9], [4], []):
        assert sum(lm.prob(seq, len(seq), every, vocab)) == pytest.approx(1.0)
    p = dict(zip(every, lm.prob([3, 4], 2, every, vocab)))
    assert max(p, key=p.get) == 5 and p[5] > 0.8
    # a draft's own text counts beside the corpus: "7 8" followed by 9 in the draft
    seq = [1, 2, 7, 8, 9, 7, 8]
    own = dict(zip(every, lm.prob(seq, 2, every, vocab)))
    assert sum(own.values()) == pytest.approx(1.0) and max(own, key=own.get) == 9
    # the corpus keeps its newest prompts: an old prompt's counts are subtracted again
    lm.add([10, 11, 12] * 10)
    assert lm.tokens == 30 and (3, 4, 5) not in lm.grams and (10, 11, 12) in lm.grams
    fresh = NGramModel(order=3)
    fresh.add([10, 11, 12] * 10)
    assert lm.grams == fresh.grams and lm.contexts == fresh.contexts


def test_spec_and_defaults(model):
    check_spec("superposed")
    with pytest.raises(UsageError):
        check_spec("superposed:x")
    dec = decoder(model, 2, None, max_ngram=4)
    assert dec.ngram_weight == DEFAULT_NGRAM_WEIGHT and dec.ngrams.order == 4
    assert SuperposedDecoder.approximate and SuperposedDecoder.expands_samples


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_cli_job_writes_k_approximate_samples(tiny_family, tmp_path):
    src = _jsonl(tmp_path / "in.jsonl", [{"prompt": f"def f{i}(x):\n    return x + {i}\n"} for i in range(3)])
    out = tmp_path / "out.jsonl"
    base = ["decode", "--target", str(tiny_family / "target"), "--max-new-tokens", "6", "--in", str(src)]
    res = invoke([*base, "--out", str(out), "--drafter", "superposed", "--num-samples", "3"])
    assert res.exit_code == 0, res.output
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(records) == 3
    for rec in records:
        assert rec["approximate"] is True
        samples = rec["samples"]
        assert len(samples) == 3 and samples[0]["completion"] == rec["completion"]
        scores = [s["score"] for s in samples]
        assert scores == sorted(scores, reverse=True)
        assert all(s["stats"]["approximate"] is True for s in samples)
        assert 1 <= rec["stats"]["target_calls"] <= 6 and rec["stats"]["drafts"] == 3
    for args in (["--temperature", "0.7", "--num-samples", "3"], []):
        spec = "superposed" if args else "superposed:x"
        res = invoke([*base, "--out", str(tmp_path / "bad.jsonl"), "--drafter", spec, *args])
        assert res.exit_code == 2, res.output
        lines = res.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: "), res.stderr
