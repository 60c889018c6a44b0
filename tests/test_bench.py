"""`specdec bench`: same prompts, same process, every method identical to ar at T=0, report schema."""

from __future__ import annotations

import json

import pytest
from conftest import invoke

from specdec.decode.options import DecodeOptions, parse_method


def test_method_specs_parse_into_decode_options():
    name, overrides = parse_method("draft+k=4+tree-tokens=32+acceptance=acceptance")
    opts = DecodeOptions().with_overrides(overrides)
    assert name == "draft" and opts.drafting.num_draft == 4 and opts.drafting.tree_tokens == 32 and opts.drafting.acceptance == "acceptance"


def test_bench_report(tiny_family, tmp_path):
    prompts = tmp_path / "p.jsonl"
    rows = [{"prompt": f"def h{i}(x):\n    return x - {i}\n", "category": ["code", "data"][i % 2]} for i in range(4)]
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    report_path, plot_path = tmp_path / "r.json", tmp_path / "r.png"
    draft = str(tiny_family / "draft")
    res = invoke([
        "bench", "--in", str(prompts), "--target", str(tiny_family / "target"), "--max-new-tokens", "12",
        "--methods", f"ngram,recycle,{draft}+k=3,hf-lookup,hf-assisted:{draft}", "--warmup", "1", "--repeats", "2",
        "--out", str(report_path), "--plot", str(plot_path),
    ])
    assert res.exit_code == 0, res.output
    report = json.loads(report_path.read_text())
    methods = {m["method"]: m for m in report["methods"]}
    assert list(methods) == ["ar", "ngram", "recycle", f"{draft}+k=3", "hf-lookup", f"hf-assisted:{draft}"]
    for spec, m in methods.items():
        assert m["identical_to_ar"] == 1.0, spec  # lossless, and the peers agree with us
        assert m["tokens_per_s"] > 0 and m["speedup"] > 0
        assert set(m["by_category"]) == {"code", "data"}
        assert 0 < m["distinct4"] <= 1
    assert methods["ar"]["speedup"] == 1.0 and methods["ar"]["tau"] == 1.0
    # per category as the headline: per pass against that pass's ar, then the median
    assert all(c["speedup"] == 1.0 and c["tokens_per_s"] > 0 for c in methods["ar"]["by_category"].values())
    assert all(len(m["walls_s"]) == 2 for m in methods.values())  # two round-robin passes each
    ng, ar = methods["ngram"]["walls_s"], methods["ar"]["walls_s"]
    ratios = sorted(a / w for a, w in zip(ar, ng))
    assert methods["ngram"]["speedup"] == pytest.approx(sum(ratios) / 2, rel=1e-2)  # median of per-round ratios
    assert methods["recycle"]["tau"] >= 1.0 and methods["recycle"]["acceptance_by_position"]
    assert methods["recycle"]["ideal_speedup"] > 0 and methods["recycle"]["efficiency"] > 0
    assert methods["hf-lookup"]["tau"] is None  # peers do not report target calls
    assert report["config"]["peak_gbps_copy"] > 0  # the roofline: bandwidth against a copy's, per method
    for spec in ("ar", "ngram", f"{draft}+k=3"):
        assert methods[spec]["achieved_gbps"] > 0 and methods[spec]["peak_fraction"] > 0 and methods[spec]["bytes_per_forward"] > 0
    assert "peak_fraction" not in methods["hf-lookup"]
    assert report["config"]["peak_rss_mib"] > 0 and all({"peak_mib", "kv_estimate_mib"} <= set(m) for m in methods.values())
    assert plot_path.stat().st_size > 1000


def test_bench_interleaves_methods_batch_by_batch(tiny_family, tmp_path, monkeypatch):
    """Each pass decodes every chunk of prompts with every method before the next chunk, the order
    rotating, and each method's outputs come back in prompt order."""
    from specdec.bench import bench
    from specdec.bench.timing import Runner

    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"x = {i}\n"}) + "\n" for i in range(5)))
    calls = []

    def fake_prepare(spec, model, tok, ids, base, warmup):
        def decode(lo, hi):
            calls.append((spec, lo, hi))
            return [([i, len(spec)], {"new_tokens": 2, "wall_s": 0.01}) for i in range(lo, hi)]
        return bench._Prepared(Runner(decode, len(ids)))

    monkeypatch.setattr(bench, "_prepare_method", fake_prepare)
    cfg = bench.BenchConfig(in_path=str(prompts), target=str(tiny_family / "target"), methods=["ar", "ngram", "recycle"],
                            repeats=2, options=DecodeOptions(batch_size=2, max_new_tokens=2))
    report = bench.run_bench(cfg)
    one_pass = [("ar", 0, 2), ("ngram", 0, 2), ("recycle", 0, 2), ("ngram", 2, 4), ("recycle", 2, 4), ("ar", 2, 4),
                ("recycle", 4, 5), ("ar", 4, 5), ("ngram", 4, 5)]
    assert calls == one_pass * 2
    for m in report["methods"]:
        assert len(m["walls_s"]) == 2 and m["prompts"] == 5


def test_bench_reports_carry_their_provenance(tiny_family, tmp_path, monkeypatch):
    """Command line, machine, date and version: what docs need to show (and rerun) a report."""
    from datetime import datetime

    import specdec
    from specdec.bench.report import cli_command

    prompts = tmp_path / "my prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "x = 1\n"}) + "\n")
    args = ["bench", "--in", str(prompts), "--target", str(tiny_family / "target"), "--methods", "ngram",
            "--max-new-tokens", "4", "--warmup", "0", "--out", str(tmp_path / "r.json")]
    monkeypatch.setattr("sys.argv", ["/somewhere/bin/specdec", *args])
    assert cli_command() == "specdec bench --in '" + str(prompts) + "' " + " ".join(args[3:])
    res = invoke(args)
    assert res.exit_code == 0, res.output
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["command"] == cli_command()
    machine = report["machine"]
    assert set(machine) == {"platform", "cpu", "cores", "torch", "transformers", "gpu"}
    assert machine["cores"] >= 1 and machine["torch"] and machine["transformers"]
    assert datetime.fromisoformat(report["date"]).utcoffset().total_seconds() == 0
    assert report["specdec_version"] == specdec.__version__
    assert report["kind"] == "speculative" and report["config"]["max_new_tokens"] == 4


def test_reports_name_the_specdec_home_not_this_machines_folders(tmp_path, monkeypatch):
    """A report's command and paths rerun on another machine: the home folder is ``$SPECDEC_HOME``."""
    from specdec.bench.report import cli_command, provenance, shown_path

    home = tmp_path / "home"
    (home / "tiny-stdlib" / "target").mkdir(parents=True)
    monkeypatch.setenv("SPECDEC_HOME", str(home))
    target = home / "tiny-stdlib" / "target"
    assert shown_path(target) == "$SPECDEC_HOME/tiny-stdlib/target"
    assert shown_path(tmp_path / "elsewhere") == str(tmp_path / "elsewhere")
    argv = ["bench", "--target", str(target), "--in", str(tmp_path / "p.jsonl")]
    assert cli_command(argv) == f"specdec bench --target $SPECDEC_HOME/tiny-stdlib/target --in {tmp_path / 'p.jsonl'}"
    monkeypatch.setattr("sys.argv", ["scripts/bench-schedule", "--target", str(target)])
    assert provenance()["command"] == "scripts/bench-schedule --target $SPECDEC_HOME/tiny-stdlib/target"
    # a folder that only begins like the home is not under it
    assert shown_path(str(home) + "-other/x") == str(home) + "-other/x"
    # the settings name the methods as their rows do
    from specdec.bench.bench import BenchConfig, _config

    methods = _config(BenchConfig("p.jsonl", methods=["ar", f"{target}+lookup=ngram"]))["methods"]
    assert methods == ["ar", "$SPECDEC_HOME/tiny-stdlib/target+lookup=ngram"]


def test_roofline_counts_the_bytes_each_forward_must_read():
    """Weights once per batch forward (the batch's longest row), KV per row and forward at its average
    context, a draft's weights once per drafted position; achieved bandwidth over wall time."""
    from conftest import tiny_llama

    from specdec.bench.roofline import bytes_read, kv_bytes_per_token, param_bytes, roofline, weight_bytes_read

    model, draft = tiny_llama(layers=2), tiny_llama(layers=1, hidden=32)
    stats = [{"target_calls": 5, "new_tokens": 8, "drafted_tokens": 12}, {"target_calls": 3, "new_tokens": 4, "drafted_tokens": 6},
             {"target_calls": 4, "new_tokens": 6, "drafted_tokens": 9}]
    lens = [10, 20, 30]
    read = bytes_read(stats, lens, 2, model, draft)
    # a forward reads its tokens' rows of the input embedding, not the table: only a tied table is read whole
    table = model.get_input_embeddings().weight
    assert not model.config.tie_word_embeddings
    assert weight_bytes_read(model) == param_bytes(model) - table.numel() * table.element_size()
    tied = tiny_llama(layers=1, hidden=32)
    tied.lm_head.weight = tied.get_input_embeddings().weight
    assert weight_bytes_read(tied) == param_bytes(tied)
    kv = kv_bytes_per_token(model)
    assert kv == 2 * 2 * 2 * 12 * 8  # 2 (k, v) x layers x kv heads x head dim x float64
    want = (5 + 4) * weight_bytes_read(model) + (5 * 14 + 3 * 22 + 4 * 33) * kv + (12 + 9) * weight_bytes_read(draft)
    assert read["target_forwards"] == 9 and read["bytes"] == want
    row = roofline(stats, lens, 2, wall_s=2.0, peak=want, model=model, draft=draft)
    assert row["peak_fraction"] == 0.5 and row["achieved_gbps"] == round(want / 2 / 1e9, 3)


def test_ideal_speedup_charges_a_round_its_drafts_per_row():
    """At batch size 2 the rows share each draft forward: a round of K=4 drafts costs four draft
    forwards, not eight (the verify width is per row too)."""
    from specdec.bench.bench import _ideal
    from specdec.bench.timing import Run

    stats = [{"target_calls": 5, "drafted_tokens": 16}, {"target_calls": 5, "drafted_tokens": 16}]  # a prefill + 4 rounds each
    run = Run(outputs=[[], []], stats=stats, walls=[1.0], rounds=4)  # 4 batch rounds

    def costs(width, model=None):
        return 0.25 if model is not None else {1: 1.0, 5: 1.5}[width]

    got = _ideal("draft+k=4", run, {"tau": 3.0, "speedup": 1.2}, costs, draft_model=object())
    assert got["verify_cost"] == 1.5 and got["draft_cost"] == 1.0
    assert got["ideal_speedup"] == round(3.0 / (1.0 + 1.5), 3)


def test_ideal_speedup_costs_each_verify_forward_at_its_own_width():
    """Rounds of width 1 and 9 cost what each costs, not what a forward at their mean width 5 would
    (the cost is not linear in the width: on a CPU a forward of 2 can cost more than one of 4)."""
    from specdec.bench.bench import _ideal
    from specdec.bench.timing import Run

    stats = [{"target_calls": 21, "drafted_tokens": 80, "verify_widths": {"1": 10, "9": 10}}]
    run = Run(outputs=[[]], stats=stats, walls=[1.0], rounds=20)
    costs = {1: 1.0, 5: 4.0, 9: 3.0}
    got = _ideal("ngram", run, {"tau": 2.0, "speedup": 1.0}, lambda w, model=None: costs[w], draft_model=None)
    assert got["verify_cost"] == 2.0 and got["ideal_speedup"] == 1.0


def test_model_free_drafters_are_charged_no_drafting_and_the_others_their_propose_time():
    """What the registry declares model-free drafts for free in the ideal speedup, whatever its name; a drafter
    that runs a model and holds no draft model of its own (self-speculation, heads) pays its measured propose time."""
    from specdec.bench.bench import _draft_cost_per_round
    from specdec.bench.timing import Run

    run = Run(outputs=[[]], stats=[{}], walls=[1.0], rounds=4, propose_s=2.0)
    free = ["ar", "ngram", "recycle", "copy", "input-copy", "aded", "stand", "retrieval:INDEX", "ngram+max-ngram=2"]
    for spec in free:
        assert _draft_cost_per_round(spec, run, None, None, 3.0) == 0.0, spec
    for spec in ["swift", "layerskip:1", "medusa"]:
        assert _draft_cost_per_round(spec, run, None, None, 3.0) == 0.5, spec


def test_a_drafter_drafting_in_the_targets_cache_gets_no_ideal_speedup():
    """trimmed's rounds verify with the output layer alone: the model of a round as one verify forward of the
    chain's width would call it more than 100% efficient, so the report leaves the ideal out."""
    from specdec.bench.bench import _ideal
    from specdec.bench.timing import Run

    run = Run(outputs=[[]], stats=[{"target_calls": 5, "drafted_tokens": 28}], walls=[1.0], rounds=4, propose_s=2.0)
    assert _ideal("trimmed+lookup=ngram", run, {"tau": 7.0, "speedup": 1.9}, lambda w, m=None: 1.0, None) == \
        {"ideal_speedup": None, "efficiency": None}
    assert _ideal("layerskip:1", run, {"tau": 7.0, "speedup": 1.9}, lambda w, m=None: 1.0, None)["ideal_speedup"] is not None


def test_compiled_methods_warm_up_on_the_shortest_and_the_longest_prompts():
    from specdec.bench.bench import spread_by_length

    prompts = [[0] * n for n in (7, 3, 12, 5, 9)]
    assert [len(p) for p in spread_by_length(prompts, 2)] == [3, 12]
    assert [len(p) for p in spread_by_length(prompts, 3)] == [3, 7, 12]
    assert [len(p) for p in spread_by_length(prompts, 1)] == [12]
    assert [len(p) for p in spread_by_length(prompts, 9)] == [3, 5, 7, 9, 12]


def test_no_pass_reads_what_an_earlier_pass_or_the_warm_up_decoded(tiny_family, tmp_path):
    """copy looks up the job's finished outputs: were its drafter kept across passes, the second pass
    would copy its own first-pass answers to the same prompts and its tau would jump. Every pass starts
    fresh, so every pass drafts the same (greedy) and tau is the same in each."""
    prompts = tmp_path / "p.jsonl"
    rows = [{"prompt": f"def g{i}(values):\n    total = 0\n    for v in values:\n"} for i in range(3)]
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    report_path = tmp_path / "r.json"
    res = invoke(["bench", "--in", str(prompts), "--target", str(tiny_family / "target"), "--max-new-tokens", "24",
                  "--methods", "copy,ngram+k=4", "--warmup", "3", "--repeats", "3", "--out", str(report_path)])
    assert res.exit_code == 0, res.output
    methods = {m["method"]: m for m in json.loads(report_path.read_text())["methods"]}
    for spec in ("copy", "ngram+k=4"):
        taus = methods[spec]["tau_by_pass"]
        assert len(taus) == 3 and len(set(taus)) == 1, (spec, taus)


def test_transformers_generate_runs_batched_at_the_bench_batch_size(tiny_family, tmp_path, monkeypatch):
    """--batch-size B: transformers' plain generate decodes left-padded batches of B prompts (its output cut
    at each row's end of text), as a user of transformers batches; outputs agree with ar's."""
    from transformers import GenerationMixin

    calls = []
    original = GenerationMixin.generate

    def spy(self, *args, **kwargs):
        calls.append(kwargs["input_ids"].shape[0])
        return original(self, *args, **kwargs)

    monkeypatch.setattr(GenerationMixin, "generate", spy)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"def f{i}(x):\n" + "    y = x\n" * i}) + "\n" for i in range(5)))
    report_path = tmp_path / "r.json"
    res = invoke(["bench", "--in", str(prompts), "--target", str(tiny_family / "target"), "--max-new-tokens", "10",
                  "--methods", "hf-generate", "--warmup", "0", "--batch-size", "3", "--out", str(report_path)])
    assert res.exit_code == 0, res.output
    methods = {m["method"]: m for m in json.loads(report_path.read_text())["methods"]}
    assert methods["hf-generate"]["identical_to_ar"] == 1.0 and methods["hf-generate"]["new_tokens"] > 0
    assert sorted(calls) == [2, 3]  # five prompts: a batch of three, then of two


def test_competing_load_keeps_its_processes_running_and_stops_them():
    from specdec.bench.bench import competing_load

    with competing_load(2) as procs:
        assert len(procs) == 2 and all(p.poll() is None for p in procs)  # spinning through the block
    assert all(p.poll() is not None for p in procs)  # none outlives the run
    with competing_load(0) as none:
        assert none == []


def test_a_method_held_at_its_own_threads_leaves_the_others_theirs():
    import torch

    from specdec.models import threads

    with threads.held(torch.get_num_threads()):  # this process's setting back after the test
        threads.follow_load(1)
        gov = threads.governor()
        with threads.held(2):
            assert torch.get_num_threads() == 2 and threads.governor() is None  # the load is not followed inside
        assert threads.governor() is gov and torch.get_num_threads() == gov.current  # the governor is back
        threads.fix(3)
        with threads.held(1):
            assert torch.get_num_threads() == 1
        assert torch.get_num_threads() == 3 and threads.governor() is None


def test_bench_scores_approximate_modes_and_several_outputs_against_greedy(tiny_family, tmp_path):
    """An approximate mode is labelled, its agreement with ar's output and its task scores reported;
    a method with several outputs per prompt (superposed drafts) is judged by its first, its tokens/s
    counting all of them."""
    prompts = tmp_path / "tasks.jsonl"
    rows = [{"prompt": "reverse: a b\nanswer:", "answer": "b a"},
            {"prompt": "def f(x):\n    \"\"\"Twice x.\"\"\"\n", "answer": "    return 2 * x\n", "task": "code"}]
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    report_path = tmp_path / "r.json"
    res = invoke(["bench", "--in", prompts, "--target", tiny_family / "target", "--max-new-tokens", "10", "--warmup", "0",
                  "--methods", "ar,skipdecode:2,2,skipdecode:2,1,superposed+num-samples=3", "--out", report_path])
    assert res.exit_code == 0, res.output
    methods = {m["method"]: m for m in json.loads(report_path.read_text())["methods"]}
    assert "approximate" not in methods["ar"] and methods["ar"]["token_agreement"] == 1.0
    # every layer at every step: greedy itself, labelled approximate all the same (the mode is)
    assert methods["skipdecode:2,2"]["approximate"] and methods["skipdecode:2,2"]["token_agreement"] == 1.0
    assert methods["skipdecode:2,1"]["approximate"] and methods["skipdecode:2,1"]["token_agreement"] < 1.0
    for m in methods.values():
        assert set(m) >= {"list_exact", "code_exact", "code_parses"}
        assert all(0 <= m[k] <= 1 for k in ("list_exact", "code_exact", "code_parses"))
    sup = methods["superposed+num-samples=3"]
    assert sup["approximate"] and sup["new_tokens"] > methods["ar"]["new_tokens"]  # three drafts a prompt
