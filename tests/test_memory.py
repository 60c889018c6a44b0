"""--max-memory (decode/jobs/memory.py) and the bench's memory fields."""

from __future__ import annotations

import json

import pytest
from conftest import invoke

from specdec.decode.drafters.base import Drafter
from specdec.decode.jobs.memory import draft_width, fit, memory_model, parse_size, weight_bytes
from specdec.bench.roofline import kv_bytes_per_token, param_bytes
from specdec.models.errors import SpecdecError, UsageError


@pytest.mark.parametrize("text,size", [("4GiB", 4 << 30), ("800MB", 800 * 10**6), ("512MiB", 512 << 20), ("1.5 GiB", 3 << 29), ("64kib", 64 << 10)])
def test_parse_size(text, size):
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["4", "", "GiB", "-1GiB", "0MiB", "4 GiBs", "4XB", "nanGiB", "1e3MB", "4GiB extra"])
def test_parse_size_refuses(text):
    with pytest.raises(UsageError, match="--max-memory"):
        parse_size(text)


def test_memory_model_counts_weights_kv_and_buffers(target, draft_model):
    from specdec.decode.drafters.draft_model import ModelDrafter
    from specdec.decode.drafters.base import NoDrafter

    drafter = ModelDrafter(draft_model)
    mm = memory_model(target, drafter, prompt_tokens=30, max_new_tokens=20)
    assert mm.weights == weight_bytes(target, drafter) == param_bytes(target) + param_bytes(draft_model)
    width = draft_width(drafter, 4)
    assert width == 5
    kv = (30 + 20 + 5) * (kv_bytes_per_token(target) + kv_bytes_per_token(draft_model))
    assert mm.row_bytes(width) == kv + 5 * target.config.vocab_size * 4
    # no row caches past the model's context
    long = memory_model(target, NoDrafter(), prompt_tokens=10_000, max_new_tokens=20)
    assert long.row_bytes(1) == target.config.max_position_embeddings * kv_bytes_per_token(target) + target.config.vocab_size * 4


def test_fit_picks_the_largest_batch_that_fits(target, draft_model):
    from specdec.decode.drafters.draft_model import ModelDrafter

    drafter = ModelDrafter(draft_model)
    mm = memory_model(target, drafter, 512, 32)
    row = mm.row_bytes(draft_width(drafter, 4))
    budget = mm.weights + 3 * row + row // 2
    plan = fit(budget, mm, drafter, 8, None, "x")
    assert plan.batch_size == 3 and plan.num_draft is None
    assert mm.total(plan.batch_size, draft_width(drafter, 4)) <= budget < mm.total(plan.batch_size + 1, draft_width(drafter, 4))
    assert "batch size 8 -> 3" in plan.note
    assert fit(mm.weights + 100 * row, mm, drafter, 8, None, "x").batch_size == 8  # never above --batch-size


def test_fit_shrinks_k_then_refuses(target, draft_model):
    from specdec.decode.drafters.draft_model import ModelDrafter

    drafter = ModelDrafter(draft_model)
    mm = memory_model(target, drafter, 512, 32)
    budget = mm.weights + mm.row_bytes(draft_width(drafter, 2))  # one row at K=2, not at K=4
    plan = fit(budget, mm, drafter, 8, None, "x")
    assert (plan.batch_size, plan.num_draft) == (1, 2) and "K 4 -> 2" in plan.note
    assert mm.total(1, draft_width(drafter, plan.num_draft)) <= budget
    with pytest.raises(SpecdecError, match=r"too small: one row needs .*at least") as err:
        fit(mm.weights + mm.row_bytes(1) // 2, mm, drafter, 8, None, "x")
    assert "\n" not in str(err.value)
    with pytest.raises(SpecdecError, match="the weights alone take"):
        fit(mm.weights // 2, mm, drafter, 8, None, "x")


def test_fit_shrinks_tree_tokens(target):
    class Tree(Drafter):  # what fit reads of a head-tree drafter
        tree_tokens, default_k, needs_hidden = 32, 5, True

    mm = memory_model(target, Tree(), 512, 32)
    assert mm.hidden == target.config.hidden_size * 8  # float64 hidden states of each verify token
    budget = mm.weights + mm.row_bytes(17)
    plan = fit(budget, mm, Tree(), 4, None, "x")
    assert (plan.batch_size, plan.tree_tokens, plan.num_draft) == (1, 16, None) and "tree tokens 32 -> 16" in plan.note


def _jsonl(path, n):
    path.write_text("".join(json.dumps({"prompt": f"def f{i}(x):\n    return x + {i}\n"}) + "\n" for i in range(n)))
    return path


def _budget(family, rows: float, drafter=None) -> str:
    """A budget of the weights plus ``rows`` rows at the default K, by the memory model."""
    from transformers import AutoModelForCausalLM

    from specdec.decode.drafters.draft_model import ModelDrafter
    from specdec.decode.drafters.base import NoDrafter

    model = AutoModelForCausalLM.from_pretrained(family / "target")
    d = ModelDrafter(AutoModelForCausalLM.from_pretrained(family / "draft")) if drafter else NoDrafter()
    mm = memory_model(model, d, model.config.max_position_embeddings, 16)
    return f"{(mm.weights + int(rows * mm.row_bytes(draft_width(d, None)))) / 1024:.3f}KiB"


def test_decode_under_a_reduced_batch_is_identical(tiny_family, tmp_path):
    src = _jsonl(tmp_path / "in.jsonl", 5)
    common = ["decode", "--in", src, "--target", tiny_family / "target", "--drafter", tiny_family / "draft",
              "--max-new-tokens", "16", "--device", "cpu", "--dtype", "float32", "--batch-size", "4"]
    plain = invoke([*common, "--out", tmp_path / "plain.jsonl"])
    assert plain.exit_code == 0, plain.output
    fitted = invoke([*common, "--out", tmp_path / "fit.jsonl", "--max-memory", _budget(tiny_family, 2.5, drafter=True)])
    assert fitted.exit_code == 0, fitted.output
    assert "note: --max-memory" in fitted.stderr and "batch size 4 -> 2" in fitted.stderr
    read = lambda p: [json.loads(line)["completion"] for line in p.read_text().splitlines()]  # noqa: E731
    assert read(tmp_path / "fit.jsonl") == read(tmp_path / "plain.jsonl")


def test_decode_refuses_a_budget_below_the_weights(tiny_family, tmp_path):
    src = _jsonl(tmp_path / "in.jsonl", 1)
    res = invoke(["decode", "--in", src, "--out", tmp_path / "o.jsonl", "--target", tiny_family / "target", "--device", "cpu",
                  "--max-memory", "1KiB"])
    assert res.exit_code == 1
    errors = [line for line in res.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "--max-memory 1KiB is too small: the weights alone take" in errors[0] and "needed" in errors[0]


@pytest.mark.parametrize("value", ["4", "lots", "0GiB", "4GB!"])
def test_decode_max_memory_parse_errors(tiny_family, tmp_path, value):
    src = _jsonl(tmp_path / "in.jsonl", 1)
    res = invoke(["decode", "--in", src, "--out", tmp_path / "o.jsonl", "--target", tiny_family / "target", "--max-memory", value])
    assert res.exit_code == 2
    assert [line for line in res.stderr.splitlines() if line.strip()] == [line for line in res.stderr.splitlines() if line.startswith("error:")]
    assert res.stderr.count("error:") == 1 and "--max-memory" in res.stderr
    assert not (tmp_path / "o.jsonl").exists()


def test_bench_reports_memory(tiny_family, tmp_path):
    src = _jsonl(tmp_path / "p.jsonl", 2)
    out = tmp_path / "r.json"
    res = invoke(["bench", "--in", src, "--target", tiny_family / "target", "--max-new-tokens", "8", "--device", "cpu",
                  "--methods", f"ngram,{tiny_family / 'draft'}+k=3,hf-lookup", "--warmup", "0", "--out", out])
    assert res.exit_code == 0, res.output
    report = json.loads(out.read_text())
    assert report["config"]["peak_rss_mib"] > 0
    methods = {m["method"]: m for m in report["methods"]}
    assert all(m["peak_mib"] is None for m in methods.values())  # a CPU: no per-method peak
    assert methods["hf-lookup"]["kv_estimate_mib"] is None
    ar, ngram, draft = methods["ar"], methods["ngram"], methods[f"{tiny_family / 'draft'}+k=3"]
    assert 0 < ar["kv_estimate_mib"] < ngram["kv_estimate_mib"]  # ngram's 12 drafts widen the verify buffers
    assert draft["kv_estimate_mib"] > ar["kv_estimate_mib"]  # the draft model's cache too


def test_peak_memory_is_per_method_and_chunk(monkeypatch):
    """On CUDA the peak counter is reset before each timed chunk and the max taken after (faked here:
    this machine may have no GPU)."""
    import torch

    from specdec.bench import bench
    from specdec.bench.timing import Runner

    allocated = {"now": 0, "peak": 0}
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: allocated.update(peak=allocated["now"]))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: allocated["peak"])
    sizes = iter([3 << 20, 5 << 20, 1 << 20])

    def decode(lo, hi):
        allocated["peak"] = max(allocated["peak"], next(sizes))
        return [([1], {"wall_s": 0.0})]

    runner = Runner(decode, 3)
    peak = bench._PeakMemory(runner, "cuda")
    for i in range(3):
        runner.decode(i, i + 1)
    assert peak.mib() == 5.0
    assert bench._PeakMemory(Runner(decode, 1), "cpu").mib() is None
