"""First Finish Search: N samples race, the first to finish (in tokens) is kept, the rest stop early."""

from __future__ import annotations

import json

import pytest

from specdec.decode.drafters.model_free import NgramDrafter
from specdec.decode.engine.loop import SpecEngine
from specdec.decode.engine.types import GenRequest
from specdec.decode.engine.verify import Sampling
from tests.conftest import ByteTokenizer, invoke, make_prompts

# several end tokens make finishing within the budget likely for a random tiny model
EOS = [2, 3, 4, 5, 6, 7]


def _run(target, first_finish: bool, drafter=None, batch_size: int = 8, n: int = 6):
    prompts = make_prompts(3, seed=5)
    engine = SpecEngine(target, ByteTokenizer(), drafter, Sampling(temperature=1.0), seed=7, eos_ids=EOS, first_finish=first_finish)
    requests = [GenRequest(p, 40, group=g, key=g * n + i) for g, p in enumerate(prompts) for i in range(n)]
    results = dict(engine.stream(iter(requests), batch_size))
    return [[results[g * n + i] for i in range(n)] for g in range(len(prompts))]


@pytest.mark.parametrize("drafter, batch_size", [(None, 18), (NgramDrafter, 4)])
def test_the_winner_is_the_shortest_finished_sample_and_the_rest_stop_once_beaten(target, drafter, batch_size):
    full = _run(target, first_finish=False)
    raced = _run(target, first_finish=True, drafter=drafter() if drafter else None, batch_size=batch_size)
    seen_cancel = False
    for whole, race in zip(full, raced):
        stopped = [len(r.token_ids) for r in whole if r.finish_reason == "stop"]
        assert stopped, "every group should have a sample that finishes (the test's premise)"
        best = min(stopped)
        for w, r in zip(whole, race):
            # a sample's tokens do not depend on the race: raced samples are prefixes of the full ones
            assert r.token_ids == w.token_ids[: len(r.token_ids)]
            if r.finish_reason == "cancelled":
                seen_cancel = True
                assert len(r.token_ids) >= best  # stopped only once it could no longer finish first
            else:
                assert r.finish_reason == w.finish_reason and r.token_ids == w.token_ids
        winners = [r for r in race if r.finish_reason == "stop"]
        assert min(len(r.token_ids) for r in winners) == best
    assert seen_cancel
    # the race spends fewer tokens than decoding every sample whole
    assert sum(len(r.token_ids) for g in raced for r in g) < sum(len(r.token_ids) for g in full for r in g)


def test_without_first_finish_nothing_is_cancelled(target):
    assert all(r.finish_reason in ("stop", "length") for g in _run(target, first_finish=False) for r in g)


def _records(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_job_keeps_the_shortest_finished_of_its_samples(tiny_family, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"id": i, "prompt": p}) + "\n" for i, p in enumerate(["def add(a, b):", "import os\n", "class P"])))
    common = ["decode", "--in", prompts, "--target", tiny_family / "target", "--temperature", "1.0", "--seed", "3",
              "--max-new-tokens", "24", "--stop", "e", "--batch-size", "3"]
    res = invoke([*common, "--out", tmp_path / "all.jsonl", "--num-samples", "4"])
    assert res.exit_code == 0, res.output
    res = invoke([*common, "--out", tmp_path / "ff.jsonl", "--first-finish", "4", "--drafter", "ngram"])
    assert res.exit_code == 0, res.output
    checked = 0
    for every, ff in zip(_records(tmp_path / "all.jsonl"), _records(tmp_path / "ff.jsonl")):
        samples = every["samples"]
        stopped = [i for i, s in enumerate(samples) if s["finish_reason"] == "stop"]
        info = ff["stats"]["first_finish"]
        assert info["samples"] == 4 and "samples" not in ff
        if not stopped:
            assert info["sample"] == 0
            continue
        won = min(stopped, key=lambda i: (samples[i]["stats"]["new_tokens"], i))
        assert info["sample"] == won
        assert ff["completion"] == samples[won]["completion"] and ff["finish_reason"] == "stop"
        assert info["tokens_all"] <= sum(s["stats"]["new_tokens"] for s in samples)
        checked += 1
    assert checked >= 2


@pytest.mark.parametrize("args, message", [
    (["--first-finish", "4"], "--temperature > 0"),
    (["--first-finish", "1", "--temperature", "1"], "at least 2"),
    (["--first-finish", "3", "--num-samples", "2", "--temperature", "1"], "does not combine with --num-samples"),
])
def test_first_finish_refuses_what_it_cannot_mean(tiny_family, tmp_path, args, message):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "x"}\n')
    res = invoke(["decode", "--in", prompts, "--out", tmp_path / "o.jsonl", "--target", tiny_family / "target", *args])
    assert res.exit_code == 2 and message in res.output and res.output.count("error:") == 1
    assert not (tmp_path / "o.jsonl").exists()
