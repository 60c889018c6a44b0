"""What `specdec decode` does with hostile input, files and signals: locks, moved-aside corrupt lines,
resume keyed on input lines, \\n-only splitting, path and option checks before loading, SIGTERM,
--strict, BOM / invalid UTF-8 / lone surrogates, message and id rules. Kills are real signals."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import invoke

from specdec.decode.jobs import io as dio
from specdec.decode.jobs.io import OutputLock, read_records, scan_output
from specdec.models.errors import SpecdecError, UsageError

WEIRD = "a\u2028b\u2029c\u0085d\u001ce\rf\x0bg\x0ch\u001di\u001ej"  # each is a line break to str.splitlines


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_bytes().split(b"\n") if line]


def without_timing(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k != "stats"} for r in rows]


def decode(tiny_family, *args):
    return invoke(["decode", "--target", str(tiny_family / "target"), "--max-new-tokens", "8", *args])


def decode_cmd(tiny_family, src, out, *args) -> list[str]:
    return [sys.executable, "-m", "specdec", "decode", "--in", str(src), "--out", str(out), "--target",
            str(tiny_family / "target"), *args]


def error_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("error:")]


def flat(text: str) -> str:
    """The text with whitespace runs collapsed (the console wraps long lines)."""
    return " ".join(text.split())


def wait_for_lines(path: Path, n: int, proc, timeout: float = 120) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if path.exists() and path.read_bytes().count(b"\n") >= n:
            return
        if proc.poll() is not None:
            raise AssertionError(f"the job ended (rc {proc.returncode}) before writing {n} lines")
        time.sleep(0.02)
    raise AssertionError("timed out")


ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
PROMPTS = [{"id": f"r{i}", "prompt": f"def g{i}(a, b):\n    return a * {i}\n"} for i in range(6)]


# -- one writer per output ----------------------------------------------------------------------


def test_second_writer_is_refused_and_a_killed_holder_releases_the_lock(tiny_family, tmp_path):
    out = tmp_path / "out.jsonl"
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from specdec.decode.jobs.io import OutputLock; OutputLock(sys.argv[1]); "
         "print('locked', flush=True); time.sleep(60)", str(out)],
        stdout=subprocess.PIPE, text=True, env=ENV,
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        src = write_jsonl(tmp_path / "in.jsonl", PROMPTS[:2])
        res = decode(tiny_family, "--in", str(src), "--out", str(out))
        assert res.exit_code == 2, res.output
        assert error_lines(res.output) and len(error_lines(res.output)) == 1
        assert f"is being written by another specdec process (pid {holder.pid})" in flat(res.output)
        assert "Traceback" not in res.output and not out.exists()
    finally:
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait()
    lock = OutputLock(out)  # the kernel dropped the dead holder's lock
    lock.release()
    assert not Path(str(out) + ".lock").exists()
    assert decode(tiny_family, "--in", str(src), "--out", str(out)).exit_code == 0
    assert len(read_jsonl(out)) == 2


def test_lock_refuses_within_one_process_too(tmp_path):
    lock = OutputLock(tmp_path / "o.jsonl")
    try:
        with pytest.raises(UsageError, match=rf"being written by another specdec process \(pid {os.getpid()}\)"):
            OutputLock(tmp_path / "o.jsonl")
    finally:
        lock.release()


# -- corrupt lines and torn lines ---------------------------------------------------------------


def test_garbage_in_the_middle_is_moved_aside_and_later_records_kept(tiny_family, tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", PROMPTS)
    out = tmp_path / "out.jsonl"
    assert decode(tiny_family, "--in", str(src), "--out", str(out)).exit_code == 0
    reference = read_jsonl(out)
    lines = out.read_bytes().split(b"\n")[:-1]
    # mark the records after the bad line: a redo would not reproduce the marks
    marked = [json.loads(x) for x in lines]
    for r in marked[3:]:
        r["stats"]["wall_s"] = -1.0
    lines = [json.dumps(r).encode() for r in marked]
    lines[2] = b'{"id": "r2", "compl\x00garbage'
    out.write_bytes(b"\n".join(lines) + b"\n" + lines[5][:20])  # and a torn last line
    res = decode(tiny_family, "--in", str(src), "--out", str(out))
    assert res.exit_code == 0, res.output
    assert "warning:" in res.output and "moved 1 unreadable line" in flat(res.output)
    got = read_jsonl(out)
    assert without_timing(got) == without_timing(reference)  # complete, in order, nothing twice
    assert [r["stats"]["wall_s"] for r in got[3:]] == [-1.0] * 3  # kept, not decoded again
    corrupt = Path(str(out) + ".corrupt").read_bytes()
    assert corrupt == b"3\t" + lines[2] + b"\n"  # the torn tail is cut silently, not moved aside


def test_scan_keeps_records_after_bad_lines_and_cuts_only_a_torn_tail(tmp_path):
    out = tmp_path / "o.jsonl"
    good = [json.dumps({"id": str(i), "line": i, "completion": WEIRD}, ensure_ascii=False).encode() for i in (1, 2, 3)]
    out.write_bytes(good[0] + b"\n\xff\xfe not json\n" + good[1] + b"\n[1, 2]\n" + good[1] + b"\n" + good[2] + b"\n" + good[0][:9])
    warnings = []
    scan = scan_output(out, warn=warnings.append)
    assert sorted(scan.done) == [1, 2, 3] and scan.records == 3 and scan.torn
    assert [n for n, _ in scan.corrupt] == [2, 4, 5] and len(warnings) == 1
    assert out.read_bytes() == b"".join(g + b"\n" for g in good)
    assert Path(str(out) + ".corrupt").read_bytes().split(b"\n")[0] == b"2\t\xff\xfe not json"
    # a torn last line alone is cut with no warning and nothing moved aside
    out.write_bytes(good[0] + b"\n" + good[1][:5])
    warnings.clear()
    assert sorted(scan_output(out, warn=warnings.append).done) == [1] and not warnings
    assert out.read_bytes() == good[0] + b"\n"


# -- resume keyed on input lines ----------------------------------------------------------------


def test_duplicate_id_killed_between_copies_resumes_like_an_uninterrupted_run(tiny_family, tmp_path):
    rows = [dict(p) for p in PROMPTS] + [{"id": f"t{i}", "prompt": f"x = {i}\n"} for i in range(2)]
    rows[5]["id"] = rows[1]["id"]  # lines 2 and 6 share an id: line 6 is an error record
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    clean = tmp_path / "clean.jsonl"
    res = decode(tiny_family, "--in", str(src), "--out", str(clean), "--max-new-tokens", "48", "--batch-size", "1")
    assert res.exit_code == 3, res.output
    reference = read_jsonl(clean)
    assert len(reference) == 8 and [r["line"] for r in reference] == list(range(1, 9))
    assert [r["line"] for r in reference if "error" in r] == [6] and "duplicate id 'r1'" in reference[5]["error"]
    out = tmp_path / "out.jsonl"
    cmd = decode_cmd(tiny_family, src, out, "--max-new-tokens", "48", "--batch-size", "1")
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=ENV)
    wait_for_lines(out, 2, proc)  # the first copy is written, the second is not
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert 2 <= out.read_bytes().count(b"\n") < 6, "killed too late"
    res = decode(tiny_family, "--in", str(src), "--out", str(out), "--max-new-tokens", "48", "--batch-size", "1")
    assert res.exit_code == 3, res.output
    assert without_timing(read_jsonl(out)) == without_timing(reference)


def test_exit_code_counts_error_records_already_in_the_output(tiny_family, tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", [PROMPTS[0], "{broken", PROMPTS[1], PROMPTS[2]])
    out = tmp_path / "out.jsonl"
    assert decode(tiny_family, "--in", str(src), "--out", str(out)).exit_code == 3
    lines = out.read_bytes().split(b"\n")
    out.write_bytes(b"\n".join(lines[:2]) + b"\n")  # the error record is in, the rest is not
    res = decode(tiny_family, "--in", str(src), "--out", str(out))
    assert res.exit_code == 3, res.output  # this run wrote no error record, the file holds one
    assert len(read_jsonl(out)) == 4


def test_changed_input_is_not_silently_mixed_in(tiny_family, tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", PROMPTS[:3])
    out = tmp_path / "out.jsonl"
    assert decode(tiny_family, "--in", str(src), "--out", str(out)).exit_code == 0
    write_jsonl(src, [PROMPTS[3]] + PROMPTS[:3])
    res = decode(tiny_family, "--in", str(src), "--out", str(out))
    assert res.exit_code == 2 and "the input changed" in flat(res.output)


# -- \n is the only line break ------------------------------------------------------------------


def test_line_breaks_other_than_newline_survive_reading_merging_and_resuming(tmp_path):
    from specdec.decode.jobs.job import merge_shards, shard_path

    # the input: raw U+2028 etc. inside strings, and a raw CR as JSON whitespace between fields
    src = tmp_path / "in.jsonl"
    src.write_bytes(json.dumps({"id": "a", "prompt": WEIRD}, ensure_ascii=False).encode().replace(b", ", b",\r ")
                    + b"\n" + json.dumps({"prompt": "q" + WEIRD}, ensure_ascii=False).encode() + b"\n")
    recs = list(read_records(src))
    assert [(r.id, r.prompt, r.error) for r in recs] == [("a", WEIRD, None), ("2", "q" + WEIRD, None)]
    # shards whose completions hold every line break str.splitlines knows
    out = str(tmp_path / "out.jsonl")
    rows = [{"id": str(i), "line": i, "prompt": "p", "completion": WEIRD * i} for i in range(1, 6)]
    for rank in range(2):
        w = dio.JsonlWriter(shard_path(out, rank, 2))
        for row in rows[rank::2]:
            w.write(row)
        w.close()
    merge_shards(out, 2)
    assert read_jsonl(Path(out)) == rows
    scan = scan_output(out, warn=None)
    assert sorted(scan.done) == [1, 2, 3, 4, 5] and not scan.corrupt


def test_no_jsonl_reader_in_decode_or_train_uses_splitlines():
    root = Path(__file__).resolve().parents[1]
    offenders = []
    for path in [*root.joinpath("decode").glob("*.py"), *root.joinpath("train").glob("*.py")]:
        for n, line in enumerate(path.read_text().split("\n"), 1):
            if "splitlines" in line and "json" in line:
                offenders.append(f"{path.name}:{n}")
    assert not offenders


# -- paths ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", ["missing-in", "dir-in", "dir-out", "out-under-file", "same-file"])
def test_bad_paths_are_refused_before_loading_and_create_nothing(tiny_family, tmp_path, case):
    src = write_jsonl(tmp_path / "in.jsonl", PROMPTS[:1])
    (tmp_path / "d").mkdir()
    in_path, out_path = {
        "missing-in": (tmp_path / "nope.jsonl", tmp_path / "o.jsonl"),
        "dir-in": (tmp_path / "d", tmp_path / "o.jsonl"),
        "dir-out": (src, tmp_path / "d"),
        "out-under-file": (src, src / "sub" / "o.jsonl"),
        "same-file": (src, src),
    }[case]
    before = sorted(p.name for p in tmp_path.rglob("*"))
    res = invoke(["decode", "--in", str(in_path), "--out", str(out_path), "--target", str(tmp_path / "no-model")])
    assert res.exit_code == 2, res.output
    assert len(error_lines(res.output)) == 1 and "Traceback" not in res.output
    assert sorted(p.name for p in tmp_path.rglob("*")) == before


def test_unwritable_or_unsearchable_output_folder_is_a_usage_error(tmp_path):
    import shutil
    import tempfile

    from specdec.decode.jobs.validate import validate_paths

    root = Path(tempfile.mkdtemp(dir="/tmp"))  # pytest's own tmp folders are private to their owner
    try:
        root.chmod(0o755)
        src = write_jsonl(root / "in.jsonl", PROMPTS[:1])
        src.chmod(0o644)
        (root / "ro").mkdir(mode=0o555)
        (root / "private").mkdir(mode=0o700)
        cases = [(src, root / "ro" / "sub" / "o.jsonl", "cannot create files in"), (src, root / "private" / "o.jsonl", "denied"),
                 (root / "private" / "in.jsonl", root / "o.jsonl", "--in")]
        if os.geteuid() != 0:
            for in_path, out_path, message in cases:
                with pytest.raises(UsageError, match=message):
                    validate_paths(str(in_path), str(out_path))
            return
        for in_path, out_path, message in cases:
            pid = os.fork()  # root may write anywhere: check as nobody, in a child
            if pid == 0:
                code = 1
                try:
                    os.setuid(65534)
                    validate_paths(str(in_path), str(out_path))
                except UsageError as exc:
                    code = 2 if message in str(exc) else 3
                except BaseException:
                    code = 4
                os._exit(code)
            _, status = os.waitpid(pid, 0)
            assert os.waitstatus_to_exitcode(status) == 2, (in_path, out_path)
        assert not list((root / "ro").iterdir()) and not list((root / "private").iterdir())
    finally:
        shutil.rmtree(root)


def test_disk_full_is_one_error_line_and_the_rerun_resumes(tiny_family, tmp_path):
    import resource

    src = write_jsonl(tmp_path / "in.jsonl", PROMPTS + [{"prompt": f"y = {i}\n"} for i in range(10)])
    clean = tmp_path / "clean.jsonl"
    assert decode(tiny_family, "--in", str(src), "--out", str(clean), "--batch-size", "2").exit_code == 0
    out = tmp_path / "out.jsonl"
    limit = len(clean.read_bytes()) // 2  # the file system "fills up" halfway

    def small_disk():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))  # writes past it fail with EFBIG

    proc = subprocess.run(decode_cmd(tiny_family, src, out, "--max-new-tokens", "8", "--batch-size", "2"),
                          capture_output=True, text=True, env=ENV, preexec_fn=small_disk, timeout=300)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert len(error_lines(proc.stderr)) == 1 and "Traceback" not in proc.stderr
    written = int(re.search(r"\): (\d+) records were written", flat(proc.stderr)).group(1))
    assert "run the same command again to resume" in flat(proc.stderr)
    data = out.read_bytes()
    complete = data[: data.rfind(b"\n") + 1]
    assert len(read_jsonl_bytes(complete)) >= written > 0  # at most the torn line beyond them
    res = decode(tiny_family, "--in", str(src), "--out", str(out), "--batch-size", "2")
    assert res.exit_code == 0, res.output
    assert without_timing(read_jsonl(out)) == without_timing(read_jsonl(clean))


def read_jsonl_bytes(data: bytes) -> list[dict]:
    return [json.loads(line) for line in data.split(b"\n") if line]


# -- signals and --strict ------------------------------------------------------------------------


@pytest.mark.parametrize("sig,code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_signal_stops_with_one_line_and_the_records_stay(tiny_family, tmp_path, sig, code):
    rows = [{"id": f"r{i}", "prompt": f"def g{i}(a, b):\n    return a * {i}\n"} for i in range(200)]
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out.jsonl"
    proc = subprocess.Popen(decode_cmd(tiny_family, src, out, "--max-new-tokens", "32", "--batch-size", "1"),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=ENV)
    wait_for_lines(out, 2, proc)
    os.kill(proc.pid, sig)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == code, err[-2000:]
    assert "Traceback" not in err and len(error_lines(err)) == 1
    n = len(read_jsonl(out))
    name = signal.Signals(sig).name
    assert f"error: interrupted ({name}): {n} records written to {out}; run the same command again to resume" in flat(err)
    assert out.read_bytes().endswith(b"\n") and 2 <= n < len(rows)
    assert not Path(str(out) + ".lock").exists()


def test_strict_says_where_it_stopped(tiny_family, tmp_path):
    from dataclasses import fields

    from specdec.decode.jobs.job import JobSummary

    src = write_jsonl(tmp_path / "in.jsonl", [PROMPTS[0], PROMPTS[1], "{oops", PROMPTS[2]])
    out = tmp_path / "out.jsonl"
    res = decode(tiny_family, "--in", str(src), "--out", str(out), "--strict")
    assert res.exit_code == 3, res.output
    assert "error: stopped at line 3 (--strict): malformed JSON" in flat(res.output)
    assert len(read_jsonl(out)) == 3
    # resuming under --strict stops at the error record already written
    res = decode(tiny_family, "--in", str(src), "--out", str(out), "--strict")
    assert res.exit_code == 3 and "stopped at line 3 (--strict)" in flat(res.output)
    names = {f.name for f in fields(JobSummary)}
    assert "stopped_at_line" in names and not hasattr(JobSummary(), "stopped_early")


# -- input text ----------------------------------------------------------------------------------


def test_bom_is_stripped_and_invalid_utf8_warns_once_per_line(tmp_path, capsys):
    src = tmp_path / "in.jsonl"
    src.write_bytes(b"\xef\xbb\xbf" + json.dumps({"prompt": "a"}).encode() + b"\n"
                    + b'{"prompt": "b\xff\xfe c\xff"}\n{"prompt": "fine"}\n')
    recs = list(read_records(src))
    assert [r.error for r in recs] == [None, None, None]
    assert recs[1].prompt == "b\ufffd\ufffd c\ufffd"
    err = capsys.readouterr().err
    assert err.count("warning: line 2: invalid UTF-8 replaced") == 1 and "line 1" not in err and "line 3" not in err


def test_lone_surrogates_are_error_records(tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", ['{"prompt": "x\\ud800y"}', '{"messages": [{"role": "user", "content": "\\udc00"}]}',
                                              '{"id": "\\ud83d", "prompt": "ok"}', '{"prompt": "\\ud83d\\ude00 is fine"}'])
    recs = list(read_records(src))
    assert recs[0].error == "prompt contains a lone surrogate (\\ud800), not valid Unicode"
    assert recs[1].error == "messages[0].content contains a lone surrogate (\\udc00), not valid Unicode"
    assert "lone surrogate" in recs[2].error and recs[2].id == "3"
    assert recs[3].error is None and recs[3].prompt == "\U0001f600 is fine"
    # and whatever slips through is still written as valid JSON
    assert json.loads(dio.encode_record_line({"id": "\ud800"})) == {"id": "\ud800"}


def test_huge_prompt_is_refused_by_length_before_tokenizing(tiny_family, tmp_path, monkeypatch):
    from specdec.decode.jobs import job

    encode = job.Decoder.encode

    def encode_short_only(self, rec):
        assert len(rec.prompt or "") < 100_000, "a 12 MB prompt was tokenized"
        return encode(self, rec)

    monkeypatch.setattr(job.Decoder, "encode", encode_short_only)
    src = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "x" * 12_000_000}, PROMPTS[0]])
    out = tmp_path / "out.jsonl"
    res = decode(tiny_family, "--in", str(src), "--out", str(out))
    assert res.exit_code == 3, res.output
    rows = read_jsonl(out)
    assert rows[0]["error"] == "prompt has 12000000 characters, more than the model's context can hold"
    assert "completion" in rows[1]


def test_oversized_line_is_an_error_record_and_the_next_line_is_read(tmp_path, monkeypatch):
    monkeypatch.setattr(dio, "MAX_LINE_BYTES", 1000)
    src = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "x" * 5000}, {"prompt": "short"}, {"prompt": "y" * 999}])
    recs = list(read_records(src))
    assert "more than the" in recs[0].error and recs[0].line == 1
    assert recs[1].prompt == "short" and recs[1].line == 2
    assert recs[2].error is not None and recs[2].line == 3  # 1011 bytes with the JSON around it


def test_message_validation_names_the_index(tmp_path):
    bad = [
        {"messages": [{"role": "user", "content": "a"}, "hello"]},
        {"messages": [{"role": "user", "content": "a"}, {"role": "", "content": "b"}]},
        {"messages": [{"role": 3, "content": "b"}]},
        {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "user"}]},
        {"messages": [{"role": "user", "content": ["parts"]}]},
        {"messages": []},
        {"prompt": "p", "messages": [{"role": "user", "content": "a"}]},
        {"messages": [{"role": "ipython", "content": "a"}]},
    ]
    recs = list(read_records(write_jsonl(tmp_path / "in.jsonl", bad)))
    assert recs[0].error == "messages[1] must be an object with role and content"
    assert recs[1].error == "messages[1]: role must be a non-empty string"
    assert recs[2].error == "messages[0]: role must be a non-empty string"
    assert recs[3].error == "messages[2]: content must be a string"
    assert recs[4].error == "messages[0]: content must be a string"
    assert "non-empty list" in recs[5].error
    assert recs[6].error == "give prompt or messages, not both"
    assert recs[7].error is None


def test_id_rules(tmp_path):
    rows = [
        {"prompt": "a"},  # line 1: id "1"
        {"id": True, "prompt": "b"},
        {"id": 1.5, "prompt": "c"},
        {"id": [1], "prompt": "d"},
        {"id": {"x": 1}, "prompt": "e"},
        {"id": 7, "prompt": "f"},
        {"id": "1", "prompt": "g"},  # collides with line 1's default
        {"prompt": "h"},  # line 8: id "8"
        {"id": "7", "prompt": "i"},  # collides with line 6's explicit 7
        {"id": "8", "prompt": "j"},  # collides with line 8's default
    ]
    recs = list(read_records(write_jsonl(tmp_path / "in.jsonl", rows)))
    for r in recs[1:5]:
        assert r.error == "id must be a string or an integer" and r.id == str(r.line)
    assert recs[5].id == "7" and recs[5].error is None
    assert recs[6].error == "duplicate id '1' (first on line 1; line 1 has no id and takes its line number)"
    assert recs[7].id == "8" and recs[7].error is None
    assert recs[8].error == "duplicate id '7' (first on line 6)"
    assert recs[9].error == "duplicate id '8' (first on line 8; line 8 has no id and takes its line number)"


# -- option values -------------------------------------------------------------------------------


BAD_OPTIONS = [
    (["--max-new-tokens", "0"], "--max-new-tokens"),
    (["--max-new-tokens", "-5"], "--max-new-tokens"),
    (["--num-draft", "0"], "--num-draft"),
    (["--num-draft", "-3"], "--num-draft"),
    (["--num-draft", "100000"], "--num-draft"),
    (["--batch-size", "0"], "--batch-size"),
    (["--batch-size", "-2"], "--batch-size"),
    (["--temperature", "-1"], "--temperature"),
    (["--temperature", "nan"], "--temperature"),
    (["--top-p", "0"], "--top-p"),
    (["--top-p", "-1"], "--top-p"),
    (["--top-p", "2"], "--top-p"),
    (["--top-p", "nan"], "--top-p"),
    (["--threads", "-4"], "--threads"),
    (["--tree-tokens", "-1"], "--tree-tokens"),
    (["--stop-threshold", "5"], "--stop-threshold"),
]


@pytest.mark.parametrize("args,message", BAD_OPTIONS, ids=[" ".join(a) for a, _ in BAD_OPTIONS])
def test_bad_option_values_are_usage_errors_before_loading(tmp_path, args, message):
    src = write_jsonl(tmp_path / "in.jsonl", PROMPTS[:1])
    out = tmp_path / "o.jsonl"
    # a target that does not exist: the option is refused before anything looks for it
    res = invoke(["decode", "--in", str(src), "--out", str(out), "--target", str(tmp_path / "no-model"), *args])
    assert res.exit_code == 2, res.output
    assert len(error_lines(res.output)) == 1 and "Traceback" not in res.output
    assert message in flat(res.output)
    assert not out.exists()


@pytest.mark.parametrize("args,message", BAD_OPTIONS, ids=[" ".join(a) for a, _ in BAD_OPTIONS])
def test_validate_options_refuses_each_bad_value(args, message):
    import dataclasses

    from specdec.decode.jobs.validate import validate_options

    flag, raw = args
    name = flag[2:].replace("-", "_")
    value = float(raw) if name in ("temperature", "top_p", "stop_threshold") else int(raw)
    with pytest.raises(UsageError, match=re.escape(flag)) as info:
        validate_options(dataclasses.replace(decode_options(), **{name: value}))
    assert info.value.exit_code == 2 and f"got {value}" in str(info.value)


def decode_options():
    try:
        from specdec.decode.options import DecodeOptions
    except ImportError:  # the options module's older name
        from specdec.decode.loading import DecodeOptions
    return DecodeOptions()


def test_validate_options_accepts_the_defaults_and_edge_values():
    import dataclasses

    from specdec.decode.jobs.validate import validate_options

    validate_options(decode_options())
    for change in ({"num_draft": 1}, {"num_draft": 256}, {"top_p": 1.0}, {"top_p": 1e-9}, {"temperature": 0.0},
                   {"stop_threshold": 0.5}, {"threads": 0}, {"min_draft": 0}):
        validate_options(dataclasses.replace(decode_options(), **change))
    for change in ({"num_draft": 257}, {"temperature": float("inf")}, {"stop_threshold": 0.0}, {"stop_threshold": 1.0}):
        with pytest.raises(UsageError):
            validate_options(dataclasses.replace(decode_options(), **change))


def test_what_a_method_declares_rules_out_options_whatever_its_name():
    """The registry's traits, not lists of names: an approximate mode, named or an artifact kind (lud),
    decodes greedily and batches by --batch-size; only a method whose outputs differ at T = 0 takes
    --num-samples there."""
    from specdec.decode.drafters.registry import DRAFTER_KINDS, DrafterChoice, resolve_drafter
    from specdec.decode.jobs.validate import check_drafter_traits
    from specdec.decode.options import DecodeOptions

    lud = DrafterChoice("lud-artifact", "lud", "lud-artifact", DRAFTER_KINDS["lud"])
    for choice in (resolve_drafter("skipdecode"), resolve_drafter("superposed"), lud):
        check_drafter_traits(choice, DecodeOptions(drafter=choice.spec))
        with pytest.raises(UsageError, match="decodes greedily"):
            check_drafter_traits(choice, DecodeOptions(drafter=choice.spec, temperature=0.7))
        with pytest.raises(UsageError, match="--max-memory"):
            check_drafter_traits(choice, DecodeOptions(drafter=choice.spec, max_memory="1GiB"))
    check_drafter_traits(resolve_drafter("superposed"), DecodeOptions(drafter="superposed", num_samples=3))
    check_drafter_traits(resolve_drafter("copy"), DecodeOptions(drafter="copy", num_samples=3, temperature=0.7))
    with pytest.raises(UsageError, match="--num-samples 3 needs --temperature > 0"):
        check_drafter_traits(resolve_drafter("copy"), DecodeOptions(drafter="copy", num_samples=3))


def test_errors_keep_their_exit_codes():
    assert UsageError.exit_code == 2 and SpecdecError.exit_code == 1
    from specdec.decode.jobs.job import Interrupted, StrictStop

    assert Interrupted("x", signal.SIGTERM).exit_code == 143 and StrictStop.exit_code == 3


def test_stdout_output_without_a_binary_layer(tiny_family, tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_bytes(json.dumps({"prompt": "a" + WEIRD}, ensure_ascii=False).encode() + b"\n" + b'{"prompt": "c"}\n')
    res = decode(tiny_family, "--in", str(src), "--out", "-")  # invoke's stdout is a StringIO
    assert res.exit_code == 0, res.output
    rows = [json.loads(line) for line in res.stdout.split("\n") if line]
    assert [r["line"] for r in rows] == [1, 2] and rows[0]["prompt"] == "a" + WEIRD
