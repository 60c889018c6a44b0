"""JSONL in, JSONL out: records with line numbers, error records, resumable appends.

A malformed input line never stops a job: it becomes ``{"id", "line", "error"}`` in the output,
and every output record carries the 1-based input ``line`` it answers. Output is appended and
fsync'd per batch under an exclusive lock (``OUT.lock``); on restart a torn last line is cut away,
unreadable lines are moved aside to ``OUT.corrupt``, and input lines that already have a record are
skipped, so a killed job resumes without losing or duplicating records.

Lines are split on ``\\n`` only, never with ``str.splitlines`` or universal newlines: JSON text may
hold U+2028, U+0085 and friends unescaped, and those are line breaks to ``splitlines``.
"""

from __future__ import annotations

import errno
import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Callable, Iterator

from specdec.models.errors import SpecdecError, UsageError

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX: no locking
    fcntl = None

# An input line longer than this becomes an error record without being held in memory whole.
MAX_LINE_BYTES = 64 << 20
UTF8_BOM = b"\xef\xbb\xbf"


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
    id_given: bool = True  # False: the record had no id and took its line number

    def error_record(self, message: str | None = None) -> dict:
        return {"id": self.id, "line": self.line, "error": message or self.error}


def _lone_surrogate(text: str) -> str | None:
    """The first lone surrogate in ``text`` as ``\\udXXX`` (JSON's ``"\\ud800"`` decodes to one)."""
    for ch in text:
        if "\ud800" <= ch <= "\udfff":
            return f"\\u{ord(ch):04x}"
    return None


def _check_text(text: str, what: str) -> str | None:
    bad = _lone_surrogate(text)
    return f"{what} contains a lone surrogate ({bad}), not valid Unicode" if bad else None


def _check_messages(msgs) -> str | None:
    if not isinstance(msgs, list) or not msgs:
        return "messages must be a non-empty list of {role, content} objects"
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            return f"messages[{i}] must be an object with role and content"
        role, content = m.get("role"), m.get("content")
        # any non-empty role: chat templates define their own (system/user/assistant/tool, ipython, ...)
        if not isinstance(role, str) or not role.strip():
            return f"messages[{i}]: role must be a non-empty string"
        if not isinstance(content, str):
            return f"messages[{i}]: content must be a string"
        problem = _check_text(role, f"messages[{i}].role") or _check_text(content, f"messages[{i}].content")
        if problem:
            return problem
    return None


def parse_line(text: str, line: int) -> Record:
    """One input line as a Record; a problem with it becomes ``Record.error``.

    Ids: ``id`` must be a string or an integer (kept as its string form). A record without an id
    (or with ``"id": null``) takes its 1-based line number as a string; such defaults count in
    duplicate detection like any other id (see ``read_records``).
    """
    default_id = str(line)
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        return Record(line=line, id=default_id, error=f"malformed JSON: {exc.msg} (column {exc.colno})", id_given=False)
    except (ValueError, RecursionError) as exc:  # e.g. an integer with more digits than Python converts
        return Record(line=line, id=default_id, error=f"malformed JSON: {exc}", id_given=False)
    if not isinstance(obj, dict):
        return Record(line=line, id=default_id, error="each line must be a JSON object", id_given=False)
    raw_id = obj.get("id")
    if raw_id is None:
        rec = Record(line=line, id=default_id, extra=obj, id_given=False)
    elif isinstance(raw_id, bool) or not isinstance(raw_id, (str, int)):
        return Record(line=line, id=default_id, error="id must be a string or an integer", extra=obj, id_given=False)
    elif isinstance(raw_id, str) and _lone_surrogate(raw_id):
        return Record(line=line, id=default_id, error=_check_text(raw_id, "id"), extra=obj, id_given=False)
    else:
        rec = Record(line=line, id=str(raw_id), extra=obj)
    rec.category = obj.get("category")
    if rec.category is not None and not isinstance(rec.category, str):
        rec.category = str(rec.category)
    mnt = obj.get("max_new_tokens")
    if mnt is not None:
        if not isinstance(mnt, int) or isinstance(mnt, bool) or mnt < 1:
            rec.error = "max_new_tokens must be a positive integer"
            return rec
        rec.max_new_tokens = mnt
    if "messages" in obj:
        if obj.get("prompt") is not None:
            rec.error = "give prompt or messages, not both"
            return rec
        rec.error = _check_messages(obj["messages"])
        if rec.error is None:
            rec.messages = obj["messages"]
        return rec
    prompt = obj.get("prompt")
    if prompt is None:
        rec.error = "missing prompt"
    elif not isinstance(prompt, str):
        rec.error = "prompt must be a string"
    elif not prompt:
        rec.error = "empty prompt"
    else:
        rec.error = _check_text(prompt, "prompt")
        if rec.error is None:
            rec.prompt = prompt
    return rec


def _warn(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr, flush=True)


def _binary_stream(source):
    if source == "-":
        return sys.stdin.buffer, False
    if hasattr(source, "read"):
        return getattr(source, "buffer", source), False
    return open(source, "rb"), True


def raw_lines(stream) -> Iterator[tuple[int, bytes | None, int]]:
    """(line number, bytes without the ``\\n``, size) for each ``\\n``-terminated line (the last may
    lack it); a line over ``MAX_LINE_BYTES`` comes as ``None`` and is skipped in chunks, not held."""
    limit = MAX_LINE_BYTES
    lineno = 0
    while True:
        chunk = stream.readline(limit + 1)
        if not chunk:
            return
        if isinstance(chunk, str):  # a text stream handed in by a caller
            chunk = chunk.encode("utf-8", errors="surrogatepass")
        lineno += 1
        if chunk.endswith(b"\n"):
            yield lineno, chunk[:-1], len(chunk) - 1
        elif len(chunk) <= limit:
            yield lineno, chunk, len(chunk)  # the last line, without a newline
        else:
            size = len(chunk)
            del chunk
            while True:
                rest = stream.readline(1 << 20)
                if not rest:
                    break
                if rest.endswith(b"\n" if isinstance(rest, bytes) else "\n"):
                    size += len(rest) - 1
                    break
                size += len(rest)
            yield lineno, None, size


def read_records(source: str | os.PathLike | IO, warn: Callable[[str], None] | None = _warn) -> Iterator[Record]:
    """Yield one Record per non-blank line; duplicate ids become error records.

    The first line may start with a UTF-8 byte order mark (stripped). Invalid UTF-8 is replaced
    (U+FFFD) and reported through ``warn``, once per line. Duplicates are found among all ids,
    including the line-number ids of records that gave none: an explicit ``"id": "3"`` elsewhere
    collides with line 3's default, and the error record says which side took its line number.
    """
    stream, owned = _binary_stream(source)
    seen: dict[str, Record] = {}
    try:
        for lineno, raw, size in raw_lines(stream):
            if raw is None:
                rec = Record(line=lineno, id=str(lineno), id_given=False,
                             error=f"line has {size} bytes, more than the {MAX_LINE_BYTES >> 20} MiB a record may have")
            else:
                if lineno == 1 and raw.startswith(UTF8_BOM):
                    raw = raw[len(UTF8_BOM):]
                try:
                    text = raw.decode("utf-8")
                except UnicodeDecodeError:
                    text = raw.decode("utf-8", errors="replace")
                    if warn is not None and text.strip():
                        warn(f"line {lineno}: invalid UTF-8 replaced")
                del raw
                if not text.strip():
                    continue
                rec = parse_line(text, lineno)
            first = seen.get(rec.id)
            if first is not None and rec.error is None:
                rec.error = _duplicate_message(rec, first)
            seen.setdefault(rec.id, rec)
            yield rec
    finally:
        if owned:
            stream.close()


def _duplicate_message(rec: Record, first: Record) -> str:
    message = f"duplicate id {rec.id!r} (first on line {first.line}"
    defaults = [r.line for r in (first, rec) if not r.id_given]
    if defaults:
        message += "; " + " and ".join(f"line {n}" for n in defaults)
        message += " has no id and takes its line number" if len(defaults) == 1 else " have no id and take their line numbers"
    return message + ")"


# -- the output file ----------------------------------------------------------------------------


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write_lines(path: str | os.PathLike, lines) -> None:
    """Replace ``path`` with ``lines`` (bytes, each ending in ``\\n``): a temporary file beside it,
    fsync'd, renamed over it. A crash leaves the old file or the new one, never a mix."""
    path = Path(path)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as fh:
            fh.writelines(lines)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def _record_line(obj) -> int | None:
    """The input line an output record answers."""
    value = obj.get("line")
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    return None


@dataclass
class OutputScan:
    done: dict = field(default_factory=dict)  # input line -> None (a result) or the error message
    ids: dict = field(default_factory=dict)  # input line -> the record's id
    legacy_ids: dict = field(default_factory=dict)  # id -> error or None, records without a line number
    records: int = 0
    max_line: int = 0
    sorted: bool = True  # records are in input-line order
    corrupt: list = field(default_factory=list)  # (line in OUT, reason)
    torn: bool = False


def _parse_output_line(raw: bytes) -> tuple[dict | None, str]:
    try:
        obj = json.loads(raw)
    except (ValueError, RecursionError):  # JSONDecodeError, and UnicodeDecodeError for bad bytes
        return None, "not JSON"
    if not isinstance(obj, dict) or "id" not in obj:
        return None, "not a record"
    if "line" in obj and _record_line(obj) is None:
        return None, "bad line number"
    return obj, ""


def scan_output(path: str | os.PathLike, warn: Callable[[str], None] | None = _warn) -> OutputScan:
    """Make an existing output resumable and say what it holds.

    A torn last line (no ``\\n``: a writer died mid-line) is cut silently. Any other line that is
    not a record, and a second record for an input line, is appended to ``OUT.corrupt`` (its line
    number in OUT, a tab, the line as it was) and OUT is rewritten atomically without it, with a
    warning: the records after it are kept, and only the missing ones are decoded again.
    """
    path = Path(path)
    scan = OutputScan()
    if not path.exists():
        return scan
    bad: dict[int, tuple[str, bytes]] = {}
    keep_bytes = 0
    with open(path, "rb") as fh:
        for n, raw, size in raw_lines(fh):
            if raw is None:
                bad[n] = ("longer than any record", b"")
                keep_bytes = fh.tell()
                continue
            if fh.tell() == keep_bytes + size:  # no "\n": a writer died mid-line
                scan.torn = True
                break
            keep_bytes = fh.tell()
            obj, reason = _parse_output_line(raw)
            if obj is None:
                bad[n] = (reason, raw)
                continue
            line = _record_line(obj)
            if line is None:
                scan.legacy_ids.setdefault(str(obj["id"]), obj.get("error"))
            elif line in scan.done:
                bad[n] = (f"a second record for input line {line}", raw)
                continue
            else:
                scan.done[line] = obj.get("error") or None
                scan.ids[line] = str(obj["id"])
                scan.sorted = scan.sorted and line > scan.max_line
                scan.max_line = max(scan.max_line, line)
            scan.records += 1
    if bad:
        corrupt = Path(str(path) + ".corrupt")
        with open(corrupt, "ab") as fh:
            for n, (reason, raw) in bad.items():
                fh.write(b"%d\t" % n + raw + b"\n")
            fh.flush()
            os.fsync(fh.fileno())
        atomic_write_lines(path, _lines_except(path, set(bad), keep_bytes))
        scan.corrupt = [(n, reason) for n, (reason, _) in bad.items()]
        if warn is not None:
            where = ", ".join(f"{n} ({reason})" for n, (reason, _) in bad.items())
            warn(f"{path}: moved {len(bad)} unreadable line(s) to {corrupt}: line {where}; "
                 "the records after them are kept and the missing ones will be decoded again")
    elif scan.torn:
        with open(path, "r+b") as fh:
            fh.truncate(keep_bytes)
            fh.flush()
            os.fsync(fh.fileno())
    return scan


def _lines_except(path: Path, skip: set, end: int):
    with open(path, "rb") as fh:
        for n, raw, _ in raw_lines(fh):
            if fh.tell() > end:
                return
            if n not in skip and raw is not None:
                yield raw + b"\n"


def read_jsonl_objects(path: str | os.PathLike) -> Iterator[dict]:
    """The JSON objects of a JSONL file, split on ``\\n`` only; blank, torn and unreadable lines skipped."""
    with open(path, "rb") as fh:
        for _, raw, _ in raw_lines(fh):
            if raw is None or not raw.strip():
                continue
            try:
                obj = json.loads(raw)
            except (ValueError, RecursionError):
                continue
            if isinstance(obj, dict):
                yield obj


def sort_output(path: str | os.PathLike) -> None:
    """Rewrite ``path`` in input-line order (after a resume filled holes left by moved-aside lines)."""
    rows = []
    with open(path, "rb") as fh:
        for _, raw, _ in raw_lines(fh):
            obj, _reason = _parse_output_line(raw) if raw is not None else (None, "")
            if obj is not None:
                rows.append((_record_line(obj) or 0, raw + b"\n"))
    rows.sort(key=lambda r: r[0])
    atomic_write_lines(path, (raw for _, raw in rows))


class OutputLock:
    """An exclusive, non-blocking ``flock`` on ``PATH.lock``: one writer per output file.

    The kernel drops the lock when its holder dies, however it dies, so a SIGKILLed job leaves a
    stale ``.lock`` file but never a stale lock. The file holds the holder's pid for the message.
    """

    def __init__(self, path: str | os.PathLike):
        self.target = Path(path)
        self.path = Path(str(path) + ".lock")
        self.fd: int | None = None
        if fcntl is None:  # pragma: no cover
            return
        while True:
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            except OSError as exc:
                raise UsageError(f"--out {self.target}: cannot create the lock file {self.path}: {exc.strerror}") from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                holder = os.read(fd, 32).decode("ascii", "replace").strip() or "unknown"
                os.close(fd)
                if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    raise UsageError(f"{self.target} is being written by another specdec process (pid {holder})") from None
                raise SpecdecError(f"cannot lock {self.path}: {exc.strerror}") from None
            # the previous holder unlinks the file as it lets go: if it did so between our open and
            # our flock, we hold a lock on a file nobody else will see, so take the new one instead
            try:
                st, cur = os.fstat(fd), os.stat(self.path)
                same = (st.st_dev, st.st_ino) == (cur.st_dev, cur.st_ino)
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self.fd = fd

    def release(self) -> None:
        if self.fd is None:
            return
        try:
            self.path.unlink(missing_ok=True)  # unlinked while still held, so no one locks a dead file
        finally:
            os.close(self.fd)
            self.fd = None


class OutputWriteError(SpecdecError):
    """Writing the output failed (disk full, I/O error): what is in the file stays and resumes."""


def encode_record_line(obj: dict) -> bytes:
    text = json.dumps(obj, ensure_ascii=False) + "\n"
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate somewhere: JSON's \\udXXX escapes carry it
        return (json.dumps(obj) + "\n").encode("ascii")


class _TextSink:
    """A text stream without a binary layer (a test's StringIO) behind a bytes interface."""

    def __init__(self, stream):
        self.stream = stream

    def write(self, data: bytes) -> None:
        self.stream.write(data.decode("utf-8"))

    def flush(self) -> None:
        self.stream.flush()


class JsonlWriter:
    """Appends JSON lines under an exclusive lock; ``flush()`` makes them durable (once per batch).

    Opening resumes: ``done`` maps each input line that already has a record to None (a result)
    or its error message. The file itself is created on the first write, so a job that fails
    before producing anything leaves no output behind.
    """

    def __init__(self, target: str | os.PathLike, overwrite: bool = False, warn: Callable[[str], None] | None = _warn):
        self.to_stdout = target == "-"
        self.name = "stdout" if self.to_stdout else str(target)
        self.scan = OutputScan()
        self.fh = None
        self.lock: OutputLock | None = None
        self.records = 0  # durable records in the output
        self._buffered = 0
        self._broken = False
        self._closed = False
        if self.to_stdout:
            # bytes to the binary layer: UTF-8 whatever the locale says stdout's encoding is
            sys.stdout.flush()
            self.fh = getattr(sys.stdout, "buffer", None) or _TextSink(sys.stdout)
            return
        self.path = Path(target)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise UsageError(f"--out {target}: cannot create {self.path.parent}: {exc.strerror}") from None
        self.lock = OutputLock(self.path)
        try:
            if overwrite:
                self.path.unlink(missing_ok=True)
            self.scan = scan_output(self.path, warn)
        except OSError as exc:
            self.lock.release()
            raise OutputWriteError(f"cannot repair {self.path}: {exc.strerror or exc}") from None
        except BaseException:
            self.lock.release()
            raise
        self.records = self.scan.records

    @property
    def done(self) -> dict:
        return self.scan.done

    def prior(self, rec: Record) -> tuple[bool, str | None]:
        """(already written, its error message or None) for an input record."""
        if rec.line in self.scan.done:
            written = self.scan.ids.get(rec.line)
            if written != rec.id:
                raise UsageError(
                    f"{self.name} has a record with id {written!r} for input line {rec.line}, which now has id {rec.id!r}: "
                    "the input changed since it was written (use --overwrite to start over, or another --out)"
                )
            return True, self.scan.done[rec.line]
        if rec.id in self.scan.legacy_ids:
            return True, self.scan.legacy_ids[rec.id]
        return False, None

    @property
    def needs_sort(self) -> bool:
        return not self.scan.sorted

    def write(self, obj: dict) -> None:
        data = encode_record_line(obj)
        line = obj.get("line")
        if isinstance(line, int):
            if line < self.scan.max_line:
                self.scan.sorted = False
            self.scan.max_line = max(self.scan.max_line, line)
        try:
            if self.fh is None:
                self.fh = open(self.path, "ab")
            self.fh.write(data)
        except OSError as exc:
            raise self._failed(exc) from None
        self._buffered += 1

    def flush(self) -> None:
        if self.fh is None or self._broken:
            return
        try:
            self.fh.flush()
            if not self.to_stdout:
                os.fsync(self.fh.fileno())
        except OSError as exc:
            raise self._failed(exc) from None
        self.records += self._buffered
        self._buffered = 0

    def _failed(self, exc: OSError) -> OutputWriteError:
        self._broken = True
        reason = exc.strerror or str(exc)
        if self.to_stdout:
            return OutputWriteError(f"writing to stdout failed ({reason}) after {self.records} records")
        return OutputWriteError(
            f"writing {self.path} failed ({reason}): {self.records} records were written and are kept; "
            "run the same command again to resume"
        )

    def finish(self) -> None:
        """Flush, and put the file in input-line order if a resume appended records out of it."""
        self.flush()
        if self.needs_sort and not self.to_stdout and self.path.exists():
            if self.fh is not None:
                self.fh.close()
                self.fh = None
            try:
                sort_output(self.path)
            except OSError as exc:
                raise self._failed(exc) from None
            self.scan.sorted = True

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            if not self._broken:
                self.flush()
        finally:
            try:
                if self.fh is not None and not self.to_stdout:
                    try:
                        self.fh.close()
                    except OSError:
                        if not self._broken:
                            raise
            finally:
                if self.lock is not None:
                    self.lock.release()
