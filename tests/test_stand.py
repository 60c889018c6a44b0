"""STAND: greedy output is plain greedy output (static and continuous batching, groups or none);
sampled output has the target's joint distribution of two tokens (chi-square), which a deliberately
broken variant fails; ``decode --num-samples`` writes N distinct samples per record and resumes."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import ByteTokenizer, invoke, make_prompts, tiny_llama
from test_sampling import P_FLOOR, two_token_pvalue

from specdec.decode.drafters import stand
from specdec.decode.drafters.base import NoDrafter
from specdec.decode.engine.loop import SpecEngine
from specdec.decode.drafters.stand import StandDrafter, StandTable
from specdec.decode.engine.types import GenRequest
from specdec.decode.engine.verify import Sampling


def test_table_longest_context_wins_and_averages():
    table = StandTable(top_k=2, max_ngram=3)
    text = [1, 2, 3]
    table.add(text, 2, [7, 8], [0.6, 0.4])  # after (3), (2, 3), (1, 2, 3)
    table.add([9, 3], 1, [8, 5], [0.9, 0.1])  # after (3), (9, 3)
    assert table.lookup([1, 2, 3]) == ([7, 8], pytest.approx([0.6, 0.4]))
    # (3) averaged over both positions: 7: 0.3, 8: 0.65, 5: 0.05 -> cut to its top 2
    tokens, q = table.lookup([4, 3])
    assert tokens == [8, 7] and q == pytest.approx([0.65 / 0.95, 0.3 / 0.95])
    assert table.lookup([4]) is None


def greedy_runs(target, requests, drafter, batch_size=None):
    engine = SpecEngine(target, ByteTokenizer(), drafter, Sampling(), seed=0, eos_ids=[])
    if batch_size is None:
        return [r.token_ids for r in engine.generate(list(requests))]
    return {i: r.token_ids for i, r in engine.stream(iter(requests), batch_size=batch_size)}


@pytest.mark.parametrize("bsz", [1, 3])
def test_greedy_is_plain_greedy(target, bsz):
    # different prompt lengths and budgets: rows finish at different rounds
    requests = [GenRequest(p, 12 + 9 * i) for i, p in enumerate(make_prompts(bsz, seed=bsz))]
    drafter = StandDrafter()
    assert greedy_runs(target, requests, drafter) == greedy_runs(target, requests, NoDrafter())
    assert any(drafter.pred), "the tables never proposed anything"


def test_greedy_with_rows_joining_a_running_batch(target):
    prompts = make_prompts(4, seed=5)
    # two samples of each prompt share a table; budgets differ so rows leave and others join mid-batch
    requests = [GenRequest(p, 5 + 7 * (j % 3), group=i) for i, p in enumerate(prompts) for j in range(2)]
    requests += [GenRequest(p, 20) for p in make_prompts(2, seed=6)]  # rows without a group
    got = greedy_runs(target, requests, StandDrafter(), batch_size=3)
    assert got == greedy_runs(target, requests, NoDrafter(), batch_size=3)


def test_rows_of_a_group_share_one_table(target):
    seen = []

    class Probe(StandDrafter):
        def propose(self, batch):
            seen.append((list(batch.groups), [id(self.tables[key]) for key in self.row_keys], len(self.tables)))
            return super().propose(batch)

    prompt = make_prompts(1, seed=2)[0]
    requests = [GenRequest(prompt, 6, group=7), GenRequest(prompt, 6, group=7), GenRequest(prompt, 16)]
    SpecEngine(target, ByteTokenizer(), Probe(), Sampling(temperature=1.0), seed=0, eos_ids=[]).generate(requests)
    groups, tables, count = seen[0]
    assert groups == [7, 7, None] and tables[0] == tables[1] != tables[2] and count == 2
    assert seen[-1][0] == [None] and seen[-1][2] == 1  # the group's table left with its last row


def engine_pairs(rows: int = 4000, batch_size: int = 1000):
    """The first two tokens of ``rows`` samples of one prompt, all of one group, streamed so that rows
    draft from a table the other rows' rounds filled."""
    vocab = 12
    target = tiny_llama(vocab=vocab, hidden=32, layers=2, seed=3)
    with torch.no_grad():
        target.lm_head.weight.mul_(0.25)  # undo most of the sharpening: many tokens matter
    drafter = StandDrafter(top_k=4, min_reach=0.0)
    prompt = [5, 7, 5, 7, 5]
    sampling = Sampling(temperature=0.8)
    engine = SpecEngine(target, ByteTokenizer(), drafter, sampling, num_draft=2, seed=11, eos_ids=[])
    # every other row runs longer, so the batch never empties and the group's table lives on
    requests = [GenRequest(prompt, 2 + 4 * (i % 2), group=0) for i in range(rows)]
    res = [r for _, r in sorted(engine.stream(iter(requests), batch_size), key=lambda ir: ir[0])]
    return two_token_pvalue(res, target, prompt, sampling), res


def test_engine_samples_the_target_joint_distribution():
    pvalue, res = engine_pairs()
    assert pvalue > P_FLOOR
    assert sum(r.stats["accepted_tokens"] for r in res) > len(res) // 4


def test_drafting_the_likeliest_tokens_under_the_rsd_rule_fails(monkeypatch):
    """RSD's ratio test assumes each sibling is a draw from q: top tokens taken in order are not."""
    monkeypatch.setattr(stand.StandDrafter, "_order", lambda self, tokens, probs, u: list(range(len(tokens))))
    pvalue, _ = engine_pairs(rows=2000, batch_size=500)  # fails by far: half the samples suffice
    assert pvalue < 1e-6


# -- decode --num-samples ------------------------------------------------------------------------

PROMPTS = [{"prompt": f"def f{i}(x):\n    return x + {i}\n"} for i in range(5)]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def read_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def decode(tiny_family, *args):
    return invoke(["decode", "--target", str(tiny_family / "target"), "--max-new-tokens", "12", "--drafter", "stand", *args])


def test_num_samples_writes_distinct_samples_per_record(tiny_family, tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", PROMPTS + [{"prompt": ""}])
    out = tmp_path / "out.jsonl"
    res = decode(tiny_family, "--in", src, "--out", out, "--temperature", "1.0", "--num-samples", "3", "--batch-size", "4")
    assert res.exit_code == 3, res.output  # the empty prompt is an error record
    recs = read_jsonl(out)
    assert [r["line"] for r in recs] == list(range(1, 7))
    assert "error" in recs[-1] and "samples" not in recs[-1]
    for rec in recs[:-1]:
        samples = rec["samples"]
        assert len(samples) == 3
        assert (rec["completion"], rec["finish_reason"], rec["stats"]) == (samples[0]["completion"], samples[0]["finish_reason"], samples[0]["stats"])
    texts = [s["completion"] for rec in recs[:-1] for s in rec["samples"]]
    assert len(set(texts)) > len(texts) // 2, texts  # independent samples, not copies


def test_num_samples_resumes_without_duplicates(tiny_family, tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", PROMPTS)
    out = tmp_path / "out.jsonl"
    args = ("--in", src, "--out", out, "--temperature", "0.8", "--num-samples", "2", "--schedule", "static", "--batch-size", "2")
    assert decode(tiny_family, *args).exit_code == 0
    full = out.read_text().splitlines(keepends=True)
    out.write_text("".join(full[:2]) + full[2][:10])  # two records and a torn third
    assert decode(tiny_family, *args).exit_code == 0
    recs = read_jsonl(out)
    assert [r["line"] for r in recs] == [1, 2, 3, 4, 5]
    assert [r["samples"] for r in recs[:2]] == [json.loads(line)["samples"] for line in full[:2]]
    assert all(len(r["samples"]) == 2 for r in recs)


def test_num_samples_at_temperature_zero_is_refused(tiny_family, tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", PROMPTS)
    res = decode(tiny_family, "--in", src, "--out", tmp_path / "out.jsonl", "--num-samples", "2")
    assert res.exit_code == 2
    assert "error:" in res.output and "--num-samples" in res.output
    assert not (tmp_path / "out.jsonl").exists()


def test_bench_counts_every_sample_of_a_prompt(tiny_family, tmp_path):
    prompts = write_jsonl(tmp_path / "p.jsonl", PROMPTS[:3])
    report_path = tmp_path / "r.json"
    args = ["bench", "--in", prompts, "--target", tiny_family / "target", "--max-new-tokens", "8", "--methods", "ar,stand",
            "--warmup", "1", "--batch-size", "2", "--out", report_path]
    res = invoke([*args, "--temperature", "0.8", "--num-samples", "3"])
    assert res.exit_code == 0, res.output
    report = json.loads(report_path.read_text())
    assert report["config"]["num_samples"] == 3
    for m in report["methods"]:
        assert 3 * 8 < m["new_tokens"] <= 3 * 3 * 8, m  # more than one sample per prompt counted
        assert m["target_calls"] >= 3 * 3 * 2 and m["tau"] > 0
    res = invoke([*args, "--num-samples", "2"])
    assert res.exit_code == 2 and "--num-samples" in res.output
