"""JSONL in, JSONL out: records with line numbers, error records, resumable appends.

A malformed input line never stops a job: it becomes ``{"id", "line", "error"}`` in the output.
Output is appended and flushed per batch; on restart a torn last line is cut away and ids that
already have a record are skipped, so a killed job resumes without duplicates.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Iterator


@dataclass
class Record:
    line: int  # 1-based line number in the input
    id: str
    prompt: str | None = None
    messages: list | None = None
    category: str | None = None
    max_new_tokens: int | None = None
    error: str | None = None
    extra: dict = field(default_factory=dict)  # the record's raw fields (e.g. a probe's ``answer``)

    def error_record(self, message: str | None = None) -> dict:
        return {"id": self.id, "line": self.line, "error": message or self.error}


def parse_line(text: str, line: int) -> Record:
    default_id = str(line)
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        return Record(line=line, id=default_id, error=f"malformed JSON: {exc.msg} (column {exc.colno})")
    if not isinstance(obj, dict):
        return Record(line=line, id=default_id, error="each line must be a JSON object")
    rid = obj.get("id", default_id)
    rid = str(rid) if rid is not None else default_id
    rec = Record(line=line, id=rid, category=obj.get("category"), extra=obj)
    if rec.category is not None and not isinstance(rec.category, str):
        rec.category = str(rec.category)
    mnt = obj.get("max_new_tokens")
    if mnt is not None:
        if not isinstance(mnt, int) or isinstance(mnt, bool) or mnt < 1:
            rec.error = "max_new_tokens must be a positive integer"
            return rec
        rec.max_new_tokens = mnt
    if "messages" in obj:
        msgs = obj["messages"]
        if not isinstance(msgs, list) or not msgs or not all(isinstance(m, dict) and "content" in m for m in msgs):
            rec.error = "messages must be a non-empty list of {role, content} objects"
        else:
            rec.messages = msgs
        return rec
    prompt = obj.get("prompt")
    if prompt is None:
        rec.error = "missing prompt"
    elif not isinstance(prompt, str):
        rec.error = "prompt must be a string"
    elif not prompt:
        rec.error = "empty prompt"
    else:
        rec.prompt = prompt
    return rec


def read_records(source: str | os.PathLike | IO[str]) -> Iterator[Record]:
    """Yield one Record per non-blank line; duplicate ids become error records."""
    stream = sys.stdin if source == "-" else (open(source, encoding="utf-8", errors="replace") if not hasattr(source, "read") else source)
    seen: set[str] = set()
    try:
        for lineno, text in enumerate(stream, start=1):
            if not text.strip():
                continue
            rec = parse_line(text, lineno)
            if rec.id in seen and rec.error is None:
                rec.error = f"duplicate id {rec.id!r}"
            seen.add(rec.id)
            yield rec
    finally:
        if stream is not sys.stdin and not hasattr(source, "read"):
            stream.close()


def repair_and_scan(path: str | os.PathLike) -> set[str]:
    """Cut a torn last line (a killed writer) and return the ids already written."""
    path = Path(path)
    if not path.exists():
        return set()
    data = path.read_bytes()
    done: set[str] = set()
    keep = 0
    pos = 0
    while pos < len(data):
        end = data.find(b"\n", pos)
        if end < 0:
            break  # no newline: torn
        chunk = data[pos:end]
        try:
            obj = json.loads(chunk)
        except json.JSONDecodeError:
            break  # a torn line followed by nothing valid: cut from here
        if isinstance(obj, dict) and "id" in obj:
            done.add(str(obj["id"]))
        pos = end + 1
        keep = pos
    if keep < len(data):
        with open(path, "r+b") as fh:
            fh.truncate(keep)
    return done


class JsonlWriter:
    """Appends JSON lines; ``flush()`` makes them durable (called once per batch)."""

    def __init__(self, target: str | os.PathLike, overwrite: bool = False):
        self.to_stdout = target == "-"
        if self.to_stdout:
            self.fh = sys.stdout
            self.done: set[str] = set()
        else:
            path = Path(target)
            path.parent.mkdir(parents=True, exist_ok=True)
            if overwrite and path.exists():
                path.unlink()
            self.done = repair_and_scan(path)
            self.fh = open(path, "a", encoding="utf-8")

    def write(self, obj: dict) -> None:
        self.fh.write(json.dumps(obj, ensure_ascii=False) + "\n")

    def flush(self) -> None:
        self.fh.flush()
        if not self.to_stdout:
            os.fsync(self.fh.fileno())

    def close(self) -> None:
        self.flush()
        if not self.to_stdout:
            self.fh.close()
