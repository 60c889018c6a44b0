"""scripts/bench-limit at tiny shapes on a CPU: every method and batch size measured, lossless, rendered.

The modes are eager, recorded graphs (on a CPU a "replay" reruns the recorded step function) and
inductor's compiled steps with the ``aot_eager`` backend (graphs captured without generating code), one
intra-op thread, so the run takes about a minute on a small shared machine."""

from __future__ import annotations

import json
import os
import runpy
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "bench-limit"
METHODS = ("ar", "ngram", "draft", "eagle3")
ENGINE = tuple(m if mode == "eager" else f"{m}+{mode}" for mode in ("eager", "graphs", "inductor") for m in METHODS)


def test_bench_limit_tiny(tmp_path):
    out = tmp_path / "limit.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--shapes", "tiny", "--batch-sizes", "1,2", "--prompts", "2", "--prompt-len", "16",
         "--max-new", "16", "--methods", ",".join(METHODS), "--modes", "eager,graphs,inductor", "--hf-static",
         "--compile-backend", "aot_eager", "--job", "12", "--prefill-chunk", "4", "--out", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(out.read_text())
    assert report["complete"] and report["peak_gbps_copy"] > 0
    job = [r for r in report["rows"] if r["method"].startswith("ar, job: ")]
    assert [r["method"] for r in job] == ["ar, job: static", "ar, job: continuous", "ar, job: chunked 4"]
    # the job's records decode alike in static batches, continuously and with prompts riding in chunks
    assert all(r["batch_size"] == 2 and r["shape"] == "tiny" and r["tokens_per_s"] > 0 and r["identical"] is True for r in job)
    assert job[0]["speedup"] == 1.0 and "12 records" in job[0]["note"]
    rows = {(r["batch_size"], r["method"]): r for r in report["rows"] if r not in job}
    assert set(rows) == {(bs, m) for bs in (1, 2) for m in ENGINE} | {(bs, "hf-generate") for bs in (1, 2)} | {(1, "hf-static-compile")}
    for (bs, method), r in rows.items():
        if method.startswith("hf-") and r.get("tokens_per_s") is None:
            assert r["note"].startswith("unavailable"), r  # transformers' compiled generate may not run here
            continue
        assert r["tokens_per_s"] > 0, (bs, method)
        assert r["identical"] is True and r["same_as_ar"] == 1.0, (bs, method)  # greedy: lossless against eager ar
        if method in ENGINE:
            assert r["tau"] >= 1 and r["ideal_speedup"] > 0 and r["efficiency"] > 0, (bs, method)
            assert 0 < r["peak_fraction"] < 1.5, (bs, method)
        if method.startswith("eagle3"):  # a random head's row is there for what drafting costs
            assert r["draft_ms_per_round"] is not None and "cost only" in r["note"], (bs, method)
    assert rows[(1, "ar")]["tau"] == 1.0 and rows[(1, "ar")]["speedup"] == 1.0
    # drafts were accepted, so the lossless check covered the acceptance path, not only rejections
    assert rows[(1, "ngram")]["tau"] > 1 and rows[(2, "draft")]["accepted_tokens"] > 0
    assert report["all_identical"] is True
    # the report is a table report that scripts/benchmarks-doc renders
    doc = runpy.run_path(str(ROOT / "scripts" / "benchmarks-doc"), run_name="benchmarks_doc")
    assert doc["kind"](report) == "table"
    assert any("| tiny | 1 | ngram+graphs |" in line for line in doc["section"]("cpu-limit", report))


def test_bench_limit_llama3_needs_cuda():
    import torch

    if torch.cuda.is_available():
        return
    proc = subprocess.run([sys.executable, str(SCRIPT), "--shapes", "llama3-8b"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, check=False)
    assert proc.returncode == 2 and "no CUDA device" in proc.stderr
