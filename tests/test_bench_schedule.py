"""scripts/bench-schedule on the test family: both schedules decode the job alike, and the forward
counter counts the target's forwards exactly (and no draft's)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "bench-schedule"


def run_script(tiny_family, tmp_path, *extra) -> tuple[dict, list[int]]:
    out, job, prompts = tmp_path / "schedule.json", tmp_path / "job.jsonl", tmp_path / "prompts.jsonl"
    # short prompts of different lengths: the test family's context is short
    prompts.write_text("".join(json.dumps({"prompt": "def f(x):\n    return " + "x + " * n}) + "\n" for n in (1, 4, 2, 7, 3)))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "SPECDEC_HOME": str(tiny_family)}
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--target", str(tiny_family / "target"), "--records", "10", "--batch-size", "4",
         "--min-new", "3", "--max-new", "9", "--repeats", "1", "--warmup", "0", "--device", "cpu",
         "--in", str(prompts), "--job", str(job), "--out", str(out), *extra],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    budgets = [json.loads(line)["max_new_tokens"] for line in job.read_text().splitlines()]
    return json.loads(out.read_text()), budgets


def test_static_forwards_are_counted_exactly(tiny_family, tmp_path):
    report, budgets = run_script(tiny_family, tmp_path)
    assert report["outputs_identical"] is True
    assert all(p["records"] == 10 and p["failed"] == 0 for p in report["passes"])
    rows = {r["schedule"]: r for r in report["rows"]}
    assert set(rows) == {"static", "continuous"}
    # a static batch of ar: one prefill (the first token) and one forward per further token of its longest row
    batches = [budgets[i : i + 4] for i in range(0, len(budgets), 4)]
    assert rows["static"]["target_forwards"] == sum(max(b) for b in batches)
    assert rows["static"]["rows_per_forward"] <= 4 and rows["continuous"]["rows_per_forward"] <= 4
    assert all(r["records_per_s"] > 0 and r["ms_per_forward"] > 0 for r in rows.values())
    assert report["job"]["budget_tokens"] == sum(budgets)


def test_a_draft_models_forwards_are_not_counted(tiny_family, tmp_path):
    report, budgets = run_script(tiny_family, tmp_path, "--drafter", str(tiny_family / "draft"))
    assert report["outputs_identical"] is True
    static = next(r for r in report["rows"] if r["schedule"] == "static")
    # the draft runs num_draft forwards a round; the target at most one a token of each batch's longest row
    batches = [budgets[i : i + 4] for i in range(0, len(budgets), 4)]
    assert 0 < static["target_forwards"] <= sum(max(b) for b in batches)
    assert static["tau"] >= 1
