"""SuffixDecoding (``--drafter suffix``): drafts from finished texts, kept across jobs with
``--suffix-cache DIR``. Greedy output is plain decoding's at batch sizes 1 and 3, on a first pass and on
a second pass that drafts from the first; sampling keeps the target's distribution; the cache survives a
torn last line and a resumed job, and refuses another tokenizer."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import ByteTokenizer, invoke, make_prompts, tiny_llama
from test_sampling import P_FLOOR, two_token_pvalue

from specdec.decode.drafters.suffix import TEXTS, SuffixCache, SuffixDrafter
from specdec.decode.engine.loop import SpecEngine
from specdec.decode.engine.types import GenRequest
from specdec.decode.engine.verify import Sampling

FINGERPRINT = {"vocab_size": 256, "tokenizer_hash": "bytes"}


@pytest.mark.parametrize("bsz", [1, 3])
def test_greedy_is_plain_greedy_and_a_second_pass_drafts_from_the_first(target, bsz):
    reqs = [GenRequest(p, n) for p, n in zip(make_prompts(bsz, seed=3, lo=5, hi=30), [24, 9, 17][:bsz])]
    plain = [r.token_ids for r in SpecEngine(target, ByteTokenizer()).generate(reqs)]
    engine = SpecEngine(target, ByteTokenizer(), SuffixDrafter())
    first, second = engine.generate(reqs), engine.generate(reqs)
    assert [r.token_ids for r in first] == plain and [r.token_ids for r in second] == plain
    # the second pass finds each text whole: its rounds accept most of what remains
    calls = [sum(r.stats["target_calls"] for r in res) for res in (first, second)]
    assert calls[1] < calls[0] and sum(r.stats["accepted_tokens"] for r in second) > 0


def test_continuous_batching_retires_rows_into_the_corpus(target):
    reqs = [GenRequest(p, 12) for p in make_prompts(5, seed=8, lo=4, hi=20)]
    alone = [SpecEngine(target, ByteTokenizer()).generate([r])[0].token_ids for r in reqs]
    drafter = SuffixDrafter()
    got = dict(SpecEngine(target, ByteTokenizer(), drafter).stream(iter(reqs + reqs), 2))
    assert [got[i].token_ids for i in range(len(reqs) * 2)] == alone + alone
    assert drafter.corpus.count(-1) == len(reqs)  # each distinct text is indexed once
    assert sum(got[i].stats["target_calls"] for i in range(5, 10)) < sum(got[i].stats["target_calls"] for i in range(5))


def test_sampling_keeps_the_target_distribution():
    vocab = 12
    target = tiny_llama(vocab=vocab, hidden=32, layers=2, seed=3)
    with torch.no_grad():
        target.lm_head.weight.mul_(0.25)  # many tokens matter
    prompt = [5, 7, 5, 7, 5]
    drafter = SuffixDrafter(min_share=0.0)
    # finished texts that continue the prompt's suffix in several ways: the tree's first level has siblings
    drafter.retire([[7, 5, t, u, 1] for t in range(vocab) for u in (0, 4)] + [[5, 7, 5, 7, 5, 3, 4]] * 3)
    sampling = Sampling(temperature=0.8)
    engine = SpecEngine(target, ByteTokenizer(), drafter, sampling, num_draft=8, seed=123, eos_ids=[])
    res = engine.generate([GenRequest(prompt, 2) for _ in range(6000)])
    assert two_token_pvalue(res, target, prompt, sampling) > P_FLOOR
    assert sum(r.stats["accepted_tokens"] for r in res) > 0


def test_the_cache_persists_skips_torn_lines_and_duplicates(tmp_path):
    cache = SuffixCache(tmp_path / "c", FINGERPRINT)
    assert cache.add([1, 2, 3, 4]) and not cache.add([1, 2, 3, 4]) and cache.add([5, 6, 7])
    with open(tmp_path / "c" / TEXTS, "a") as f:
        f.write('{"hash": "abc", "tokens": [9, 9')  # a job killed mid-line
    again = SuffixCache(tmp_path / "c", FINGERPRINT)
    assert again.texts == [[1, 2, 3, 4], [5, 6, 7]]
    assert not again.add([5, 6, 7]) and again.add([8, 8, 8])
    assert SuffixCache(tmp_path / "c", FINGERPRINT).texts == [[1, 2, 3, 4], [5, 6, 7], [8, 8, 8]]
    drafter = SuffixDrafter(SuffixCache(tmp_path / "c", FINGERPRINT))
    assert drafter.tree([0, 1, 2, 3], 8) == ([4], [-1])  # what followed [..., 2, 3] in an earlier job


def _job(tmp_path, family, name, *flags):
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"id": i, "prompt": f"def f{i}(x):\n    return x"}) + "\n" for i in range(3)))
    out = tmp_path / f"{name}.jsonl"
    res = invoke(["decode", "--in", str(src), "--out", str(out), "--target", str(family / "target"), "--max-new-tokens", "24",
                  "--batch-size", "2", *flags])
    return res, [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []


def test_decode_suffix_cache_across_jobs(tmp_path, tiny_family):
    cache = tmp_path / "cache"
    _, plain = _job(tmp_path, tiny_family, "plain", "--drafter", "ar")
    res, first = _job(tmp_path, tiny_family, "first", "--drafter", "suffix", "--suffix-cache", str(cache))
    assert res.exit_code == 0, res.output
    assert len((cache / TEXTS).read_text().splitlines()) == 3
    res, second = _job(tmp_path, tiny_family, "second", "--drafter", "suffix", "--suffix-cache", str(cache))
    assert res.exit_code == 0, res.output
    assert [r["completion"] for r in first] == [r["completion"] for r in plain] == [r["completion"] for r in second]
    calls = [sum(r["stats"]["target_calls"] for r in job) for job in (first, second)]
    assert calls[1] < calls[0]
    assert len((cache / TEXTS).read_text().splitlines()) == 3  # the same texts again: nothing appended


def test_decode_suffix_cache_refusals(tmp_path, tiny_family):
    res, _ = _job(tmp_path, tiny_family, "a", "--drafter", "ngram", "--suffix-cache", str(tmp_path / "c"))
    assert res.exit_code == 2 and "--suffix-cache" in res.output
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"kind": "suffix-cache", "tokenizer": FINGERPRINT}))
    res, _ = _job(tmp_path, tiny_family, "b", "--drafter", "suffix", "--suffix-cache", str(other))
    assert res.exit_code != 0 and res.output.strip().startswith("error:") and "another tokenizer" in res.output
    (tmp_path / "file").write_text("x")
    res, _ = _job(tmp_path, tiny_family, "c", "--drafter", "suffix", "--suffix-cache", str(tmp_path / "file"))
    assert res.exit_code == 2 and "is a file" in res.output
