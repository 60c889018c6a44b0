"""`specdec decode` as a user runs it: error records, exit codes, resume, kill -9, multi-process."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import invoke

from specdec.decode.jobs.io import scan_output


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def decode(tiny_family, *args):
    return invoke(["decode", "--target", str(tiny_family / "target"), "--max-new-tokens", "8", *args])


PROMPTS = [{"prompt": f"def f{i}(x):\n    return x + {i}\n", "category": "code"} for i in range(6)]


def test_decode_writes_one_record_per_line_in_order(tiny_family, tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", PROMPTS)
    res = decode(tiny_family, "--in", str(src), "--out", str(tmp_path / "out.jsonl"), "--batch-size", "4")
    assert res.exit_code == 0, res.output
    out = read_jsonl(tmp_path / "out.jsonl")
    assert [o["id"] for o in out] == [str(i) for i in range(1, 7)]
    for o in out:
        assert o["category"] == "code" and o["finish_reason"] in ("stop", "length")
        assert {"prompt_tokens", "new_tokens", "target_calls", "wall_s"} <= set(o["stats"])
        assert o["stats"]["new_tokens"] <= 8


def test_decode_output_is_training_data(tiny_family, tmp_path):
    """Self-distillation is a pipeline: each output record echoes its prompt (or messages), so
    train-draft reads prompt + completion from it; error records are not training text."""
    from specdec.train.data import record_text

    chat = {"messages": [{"role": "user", "content": "def g(y):"}]}
    src = write_jsonl(tmp_path / "in.jsonl", [PROMPTS[0], chat, "{broken"])
    res = decode(tiny_family, "--in", str(src), "--out", str(tmp_path / "out.jsonl"))
    assert res.exit_code == 3, res.output
    out = read_jsonl(tmp_path / "out.jsonl")
    assert out[0]["prompt"] == PROMPTS[0]["prompt"] and out[1]["messages"] == chat["messages"]
    assert record_text(out[0]) == PROMPTS[0]["prompt"] + out[0]["completion"]
    assert record_text(out[1]) == "def g(y):\n" + out[1]["completion"]
    assert record_text(out[2]) is None


def test_bad_records_become_errors_and_the_job_goes_on(tiny_family, tmp_path):
    rows = [
        PROMPTS[0],
        "{not json",
        {"id": "no-prompt"},
        {"id": "empty", "prompt": ""},
        {"id": "long", "prompt": "x = 1\n" * 400},  # longer than the 256-position context
        {"id": "n", "prompt": "y", "max_new_tokens": -3},
        {"messages": [{"role": "user", "content": "write a loop"}]},
        PROMPTS[1],
    ]
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    res = decode(tiny_family, "--in", str(src), "--out", str(tmp_path / "out.jsonl"))
    assert res.exit_code == 3, res.output
    out = read_jsonl(tmp_path / "out.jsonl")
    assert len(out) == len(rows)
    errors = {o["line"]: o for o in out if "error" in o}
    assert sorted(errors) == [2, 3, 4, 5, 6]
    assert "malformed JSON" in errors[2]["error"] and errors[2]["id"] == "2"
    assert "missing prompt" in errors[3]["error"]
    assert "empty prompt" in errors[4]["error"]
    assert "context" in errors[5]["error"]
    assert "max_new_tokens" in errors[6]["error"]
    assert "completion" in out[6] and "completion" in out[7]


def test_strict_stops_at_first_bad_record(tiny_family, tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", [PROMPTS[0], "{oops", PROMPTS[1]])
    res = decode(tiny_family, "--in", str(src), "--out", str(tmp_path / "out.jsonl"), "--strict")
    assert res.exit_code == 3
    out = read_jsonl(tmp_path / "out.jsonl")
    assert len(out) == 2 and "error" in out[1]


def test_usage_error_exit_code(tiny_family, tmp_path):
    res = invoke(["decode", "--no-such-flag"])
    assert res.exit_code == 2


def test_stdout_carries_only_jsonl(tiny_family, tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", PROMPTS[:2])
    proc = subprocess.run(
        [sys.executable, "-m", "specdec", "decode", "--in", str(src), "--out", "-", "--target", str(tiny_family / "target"),
         "--max-new-tokens", "4"],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert len(lines) == 2 and all(json.loads(line)["completion"] is not None for line in lines)


def test_resume_repairs_a_torn_line_and_skips_done_ids(tiny_family, tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", PROMPTS)
    full = tmp_path / "full.jsonl"
    assert decode(tiny_family, "--in", str(src), "--out", str(full)).exit_code == 0
    reference = read_jsonl(full)
    # a killed writer left two records and half of a third
    partial = tmp_path / "out.jsonl"
    text = full.read_text().splitlines(keepends=True)
    partial.write_text(text[0] + text[1] + text[2][: len(text[2]) // 2])
    scan = scan_output(partial)  # repairs the torn line
    assert set(scan.ids.values()) | set(scan.legacy_ids) == {"1", "2"}
    assert decode(tiny_family, "--in", str(src), "--out", str(partial)).exit_code == 0
    out = read_jsonl(partial)
    assert [o["id"] for o in out] == [o["id"] for o in reference]
    assert [o["completion"] for o in out] == [o["completion"] for o in reference]
    # --overwrite starts over
    assert decode(tiny_family, "--in", str(src), "--out", str(partial), "--overwrite").exit_code == 0
    assert len(read_jsonl(partial)) == len(PROMPTS)


def test_sigkill_mid_run_then_resume(tiny_family, tmp_path):
    rows = [{"id": f"r{i}", "prompt": f"def g{i}(a, b):\n    return a * {i}\n"} for i in range(40)]
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out.jsonl"
    cmd = [sys.executable, "-m", "specdec", "decode", "--in", str(src), "--out", str(out), "--target",
           str(tiny_family / "target"), "--max-new-tokens", "24", "--batch-size", "1"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while time.time() < deadline:
        if out.exists() and out.read_text().count("\n") >= 3:
            break
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    done_before = out.read_text().count("\n")
    assert 3 <= done_before < len(rows), "the job should have been killed mid-run"
    rerun = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stderr
    got = read_jsonl(out)
    assert [o["id"] for o in got] == [r["id"] for r in rows]  # every id once, in order
    clean = tmp_path / "clean.jsonl"
    subprocess.run(cmd[:7] + [str(clean)] + cmd[8:], check=True, capture_output=True, timeout=300)
    assert [o["completion"] for o in got] == [o["completion"] for o in read_jsonl(clean)]


def test_a_draft_of_another_tokenizer_is_bridged_and_one_without_its_tokenizer_refused(tiny_family, tmp_path):
    """A draft that brings its own tokenizer drafts re-tokenised text (decode.drafters.bridge); one whose
    vocabulary is not the target's and that brings no tokenizer to say what its ids mean is refused before any work."""
    import shutil

    src = write_jsonl(tmp_path / "in.jsonl", PROMPTS[:2])
    plain, bridged = tmp_path / "plain.jsonl", tmp_path / "bridged.jsonl"
    assert decode(tiny_family, "--in", str(src), "--out", str(plain), "--drafter", "ar").exit_code == 0
    res = decode(tiny_family, "--in", str(src), "--out", str(bridged), "--drafter", str(tiny_family / "foreign-draft"))
    assert res.exit_code == 0, res.output
    assert [o["completion"] for o in read_jsonl(bridged)] == [o["completion"] for o in read_jsonl(plain)]
    bare = tmp_path / "bare-draft"
    shutil.copytree(tiny_family / "foreign-draft", bare)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
        (bare / name).unlink(missing_ok=True)
    out = tmp_path / "out.jsonl"
    res = decode(tiny_family, "--in", str(src), "--out", str(out), "--drafter", str(bare))
    assert res.exit_code == 1
    assert "vocabulary size 301" in res.output and "300" in res.output
    assert not out.exists() or out.read_text() == ""


def test_speculative_decode_equals_plain_and_sampling_is_seeded(tiny_family, tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", PROMPTS)
    outs = {}
    for name, extra in {"ar": [], "draft": ["--drafter", str(tiny_family / "draft")], "ngram": ["--drafter", "ngram"]}.items():
        path = tmp_path / f"{name}.jsonl"
        assert decode(tiny_family, "--in", str(src), "--out", str(path), "--batch-size", "3", *extra).exit_code == 0
        outs[name] = [o["completion"] for o in read_jsonl(path)]
    assert outs["draft"] == outs["ar"] and outs["ngram"] == outs["ar"]
    sampled = []
    for i in range(2):
        path = tmp_path / f"s{i}.jsonl"
        args = ["--in", str(src), "--out", str(path), "--temperature", "0.9", "--seed", "7", "--drafter", str(tiny_family / "draft")]
        assert decode(tiny_family, *args).exit_code == 0
        sampled.append([o["completion"] for o in read_jsonl(path)])
    assert sampled[0] == sampled[1]
    # the race (no top-p): one text per seed whatever the drafter and batch, and a resumed job's records
    # are what an uninterrupted one writes (each record's draws are named by its input line)
    raced = {}
    for name, extra in {"ar": ["--batch-size", "4"], "ngram": ["--drafter", "ngram", "--batch-size", "2"]}.items():
        path = tmp_path / f"r-{name}.jsonl"
        assert decode(tiny_family, "--in", str(src), "--out", str(path), "--temperature", "0.9", "--seed", "3", *extra).exit_code == 0
        raced[name] = [o["completion"] for o in read_jsonl(path)]
    part = write_jsonl(tmp_path / "part.jsonl", PROMPTS[:2])
    resumed = tmp_path / "resumed.jsonl"
    for path in (part, src):  # the first two records, then the whole file: a resume of the same output
        assert decode(tiny_family, "--in", str(path), "--out", str(resumed), "--temperature", "0.9", "--seed", "3").exit_code == 0
    assert raced["ngram"] == raced["ar"] == [o["completion"] for o in read_jsonl(resumed)]


def test_two_process_accelerate_launch_merges_in_order(tiny_family, tmp_path):
    pytest.importorskip("accelerate")
    src = write_jsonl(tmp_path / "in.jsonl", PROMPTS + ["{bad"])
    single = tmp_path / "single.jsonl"
    assert decode(tiny_family, "--in", str(src), "--out", str(single)).exit_code == 3
    multi = tmp_path / "multi.jsonl"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        # --multi_gpu with no GPU gives N CPU processes over gloo (--cpu would start only one)
        [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
         "-m", "specdec", "decode",
         "--in", str(src), "--out", str(multi), "--target", str(tiny_family / "target"), "--max-new-tokens", "8"],
        capture_output=True, text=True, timeout=300, env=env,
    )
    # one record failed on some rank: the launcher reports failure, and the merged file is complete
    assert proc.returncode != 0 and multi.exists(), proc.stderr[-2000:]
    shards = [tmp_path / f"multi.jsonl.rank{r}-of-2" for r in range(2)]
    assert all(s.exists() and s.read_text() for s in shards), "both ranks must have decoded records"
    got, ref = read_jsonl(multi), read_jsonl(single)
    assert [o["id"] for o in got] == [o["id"] for o in ref]
    assert [o.get("completion") for o in got] == [o.get("completion") for o in ref]
