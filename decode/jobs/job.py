"""A decode job: JSONL records in, one JSON line per record out, whatever the generator.

Records are decoded in input order, continuously batched for causal LMs (``--schedule continuous``,
the default: a finished row's place goes to the next record at once) or in static batches (each
batch written and flushed before the next starts; diffusion LMs always). Either way the output is
in input order, with bad records as error records in place. Under ``accelerate launch`` rank r takes
records r, r+N, ... into its own resumable shard, and rank 0 merges the shards in input order.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import os
import signal
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from specdec.decode.diffusion.generator import generator_from_options
from specdec.decode.jobs.io import (
    JsonlWriter,
    OutputLock,
    OutputWriteError,
    Record,
    atomic_write_lines,
    encode_record_line,
    read_jsonl_objects,
    read_records,
)
from specdec.decode.engine.types import GenRequest, add_counts
from specdec.decode.jobs.build import build_engine, load_decode_target
from specdec.decode.jobs.progress import ProgressBar
from specdec.decode.jobs.validate import DecodePlan, plan_decode
from specdec.decode.options import DecodeOptions
from specdec.models.errors import SpecdecError, UsageError


@dataclass
class JobSummary:
    ok: int = 0
    failed: int = 0
    skipped: int = 0
    new_tokens: int = 0
    target_calls: int = 0
    drafted: int = 0
    accepted: int = 0
    pos_drafted: list = field(default_factory=list)
    pos_accepted: list = field(default_factory=list)
    wall_s: float = 0.0
    diffusion_steps: int = 0  # per-row denoising steps (diffusion decoding only)
    failed_before: int = 0  # error records already in the output when a resumed job started
    stopped_at_line: int | None = None  # --strict: the input line of the first bad record
    stop_reason: str | None = None

    def add(self, stats: dict, record: bool = True) -> None:
        """Count one sample's stats; ``record`` False for a record's later samples (``--num-samples``)."""
        self.ok += record
        if "strategy" in stats:  # diffusion: its rows share batch forwards, so count steps, not calls
            self.new_tokens += stats.get("decoded_tokens", 0)
            self.diffusion_steps += stats.get("steps", 0)
            return
        self.new_tokens += stats.get("new_tokens", 0)
        self.target_calls += stats.get("target_calls", 0)
        self.drafted += stats.get("drafted_tokens", 0)
        self.accepted += stats.get("accepted_tokens", 0)
        for name in ("pos_drafted", "pos_accepted"):
            add_counts(getattr(self, name), stats.get(name.replace("pos_", "position_"), []))

    @property
    def tau(self) -> float:
        return self.new_tokens / self.target_calls if self.target_calls else 0.0

    def rate_label(self) -> str:
        if self.diffusion_steps:
            return f"steps/token {self.diffusion_steps / max(self.new_tokens, 1):.2f}"
        return f"tau {self.tau:.2f}"

    @property
    def acceptance_by_position(self) -> list[float]:
        return [round(a / d, 4) if d else 0.0 for a, d in zip(self.pos_accepted, self.pos_drafted)]


class Decoder:
    """Loads the target and the generator once; ``run`` decodes a stream of records.

    ``plan``: the decode as ``decode.jobs.validate.plan_decode`` checked it (made here from ``target``
    and ``options`` when not given); nothing is checked again."""

    def __init__(self, target: str, options: DecodeOptions, console=None, plan: DecodePlan | None = None):
        plan = plan or plan_decode(target, options)
        self.options = options = plan.options
        self.console = console
        self.is_diffusion = plan.is_diffusion
        self.schedule = plan.schedule
        if self.is_diffusion:
            self.generator, self.tokenizer, self.max_context = generator_from_options(plan.source, options)
            return
        model, self.tokenizer, _ = load_decode_target(plan.source, options)
        drafter = plan.drafter.build(model, self.tokenizer, options)
        self.max_context = getattr(model.config, "max_position_embeddings", None) or 1 << 30
        if options.scheduling.max_memory is not None:
            options = self.options = _fit_memory(options, model, drafter, self.max_context)
        self.generator = build_engine(model, self.tokenizer, options, drafter)

    def encode(self, rec: Record) -> list[int]:
        return encode_record(self.tokenizer, rec)

    def prepare(self, rec: Record) -> GenRequest | str:
        """A request, or the error message that replaces the record."""
        if rec.error:
            return rec.error
        chars = prompt_chars(rec)
        if chars > self.max_context * MAX_CHARS_PER_TOKEN:
            return f"prompt has {chars} characters, more than the model's context can hold"
        try:
            ids = self.encode(rec)
        except Exception as exc:  # a tokenizer/chat-template failure concerns this record only
            return f"cannot tokenize: {exc}"
        if not ids:
            return "prompt encodes to no tokens"
        room = self.max_context - len(ids)
        if room <= 0:
            return f"prompt has {len(ids)} tokens; the model's context is {self.max_context}"
        source = rec.extra.get("source")
        if source is not None and not isinstance(source, str):
            return "source must be a string"
        reference = self.tokenizer(source, add_special_tokens=False)["input_ids"] if source else None
        return GenRequest(ids, min(rec.max_new_tokens or self.options.sampling.max_new_tokens, room), reference=reference,
                          key=rec.line * self.rows_per_record)

    def output(self, rec: Record, req: GenRequest, result, wall: float) -> dict:
        text = self.tokenizer.decode(result.token_ids, skip_special_tokens=True)
        finish = result.finish_reason
        for s in self.options.sampling.stop:
            if s and s in text:
                text, finish = text[: text.index(s)], "stop"
        out = {"id": rec.id, "line": rec.line}
        if rec.category is not None:
            out["category"] = rec.category
        # the input is echoed so an output file is training data on its own (train-draft reads prompt + completion)
        if rec.messages is not None:
            out["messages"] = rec.messages
        else:
            out["prompt"] = rec.prompt
        stats = {"prompt_tokens": len(req.prompt_ids), **result.stats, "wall_s": round(wall, 6)}
        stats.pop("batch_wall_s", None)
        stats.pop("row_wall_s", None)
        stats.pop("verify_widths", None)  # bench's, for its ideal speedup
        out.update(completion=text, finish_reason=finish, stats=stats)
        if result.score is not None:
            out["score"] = round(result.score, 6)
        if stats.get("approximate"):  # an approximate mode's output (decode.engine.own), said where it is read
            out["approximate"] = True
        return out

    def output_samples(self, rec: Record, req: GenRequest, results: list, walls: list[float]) -> dict:
        """The record of a request's outputs: the first in the usual fields (what a record without
        ``--num-samples`` holds), and with more than one every output, the first included, in ``samples``
        (several samples, beams best first, superposed drafts). With ``--first-finish`` only the winner,
        its stats saying which sample it was and the tokens every sample spent."""
        if self.options.sampling.first_finish:
            return self._first_finish(rec, req, results, walls)
        pairs = [(r, w) for res, w in zip(results, walls) for r in (res, *res.alternatives)]
        outs = [self.output(rec, req, r, w) for r, w in pairs]
        if len(outs) > 1:
            keep = ("completion", "finish_reason", "score", "stats")
            outs[0]["samples"] = [{k: o[k] for k in keep if k in o} for o in outs]
        return outs[0]

    def _first_finish(self, rec: Record, req: GenRequest, results: list, walls: list[float]) -> dict:
        """First Finish Search's record: the sample that finished (EOS or a stop string) with the fewest
        tokens, the lowest sample index among equals; sample 0 when none finished within the budget."""
        finished = [i for i, r in enumerate(results) if r.finish_reason == "stop"]
        won = min(finished, key=lambda i: (len(results[i].token_ids), i)) if finished else 0
        out = self.output(rec, req, results[won], walls[won])
        out["stats"]["first_finish"] = {
            "sample": won, "samples": len(results),
            "tokens_all": sum(r.stats.get("new_tokens", len(r.token_ids)) for r in results),
            "target_calls_all": sum(r.stats.get("target_calls", 0) for r in results),
            "cancelled": sum(r.finish_reason == "cancelled" for r in results),
        }
        return out

    @property
    def rows_per_record(self) -> int:
        """Rows a record is decoded as: its samples (--num-samples, --first-finish), one where the method
        makes a record's outputs itself (beams, superposed drafts)."""
        sampling = self.options.sampling
        if self.generator.expands_samples:  # beam search's B outputs too (decode.engine.beams)
            return 1
        return sampling.first_finish or sampling.num_samples

    def samples(self, rec: Record, req: GenRequest) -> list[GenRequest]:
        """The requests a record is decoded as (``rows_per_record``): one group, named by its input line."""
        n = self.rows_per_record
        return [req] if n == 1 else [dataclasses.replace(req, group=rec.line, key=req.key + i) for i in range(n)]

    def run(self, records, writer: JsonlWriter, strict: bool = False, progress=None) -> JobSummary:
        """Decode ``records`` into ``writer``, skipping input lines it already holds a record for.

        ``strict``: stop at the first bad record (its error record is written), or at an error record
        already in the output; ``summary.stopped_at_line`` says where. Records are written in input
        order whatever the schedule.
        """
        summary = JobSummary()
        start = time.perf_counter()
        todo = self._todo(records, writer, strict, summary, progress)
        if self.schedule == "continuous":
            self._run_continuous(todo, writer, summary, progress)
        else:
            self._run_static(todo, writer, summary, progress)
        summary.wall_s = time.perf_counter() - start
        return summary

    def _todo(self, records, writer: JsonlWriter, strict: bool, summary: JobSummary, progress):
        """(record, request or error message) for each record the output does not hold yet, in input
        order; records already written are counted and passed over."""
        for rec in records:
            written, prior_error = writer.prior(rec)
            if written:
                summary.skipped += 1
                if prior_error is not None:
                    summary.failed_before += 1
                    if strict:
                        summary.stopped_at_line, summary.stop_reason = rec.line, prior_error
                        return
                if progress is not None:
                    progress(1, summary)
                continue
            req = self.prepare(rec)
            if isinstance(req, str) and strict:
                summary.stopped_at_line, summary.stop_reason = rec.line, req
                yield rec, req
                return
            yield rec, req

    def _write(self, writer: JsonlWriter, summary: JobSummary, obj: dict) -> None:
        if "error" in obj:
            summary.failed += 1
        else:
            for i, sample in enumerate(obj.get("samples") or [obj]):
                summary.add(sample["stats"], record=i == 0)
        writer.write(obj)

    def _run_static(self, todo, writer: JsonlWriter, summary: JobSummary, progress) -> None:
        """Batches of ``batch_size`` rows in input order (a record's samples in the same batch); a batch
        ends when its longest row does, and is written and flushed before the next starts."""
        pending: list[tuple[Record, GenRequest | str]] = []
        n = self.rows_per_record

        def flush_batch():
            reqs = [(r, q) for r, q in pending if isinstance(q, GenRequest)]
            results = {}
            if reqs:
                t0 = time.perf_counter()
                outs = self.generator.generate([s for r, q in reqs for s in self.samples(r, q)])
                wall = time.perf_counter() - t0
                results = {id(r): self.output_samples(r, q, outs[i * n : (i + 1) * n], [wall] * n) for i, (r, q) in enumerate(reqs)}
            for rec, req in pending:
                self._write(writer, summary, results.get(id(rec)) or rec.error_record(req))
            writer.flush()
            if progress is not None:
                progress(len(pending), summary)
            pending.clear()

        for rec, req in todo:
            pending.append((rec, req))
            if n * sum(isinstance(q, GenRequest) for _, q in pending) >= self.options.scheduling.batch_size:
                flush_batch()
        if pending:
            flush_batch()

    def _run_continuous(self, todo, writer: JsonlWriter, summary: JobSummary, progress) -> None:
        """``batch_size`` rows in flight (``SpecEngine.stream``): records are read as rows free up, and
        a finished record waits until every earlier one is written. Flushed every ``batch_size``
        records written, and at least every ``FLUSH_EVERY_S`` seconds while records come."""
        # [record, request or error, output record once known, (stream index, result) per finished sample]
        queue: deque[list] = deque()  # input order
        waiting: dict[int, list] = {}  # stream index -> its queue entry
        n = self.rows_per_record
        unflushed, last_flush = 0, time.perf_counter()

        def write_ready():
            nonlocal unflushed, last_flush
            done = 0
            while queue and queue[0][2] is not None:
                self._write(writer, summary, queue.popleft()[2])
                done += 1
            unflushed += done
            if unflushed and (unflushed >= self.options.scheduling.batch_size or time.perf_counter() - last_flush >= FLUSH_EVERY_S):
                writer.flush()
                unflushed, last_flush = 0, time.perf_counter()
            if done and progress is not None:
                progress(done, summary)

        def requests():
            for rec, req in todo:
                entry = [rec, req, None if isinstance(req, GenRequest) else rec.error_record(req), []]
                queue.append(entry)
                if entry[2] is not None:
                    write_ready()
                    continue
                for sample in self.samples(rec, req):  # handed one after another: they share a batch
                    waiting[next(handed)] = entry
                    yield sample

        handed = itertools.count()  # the stream numbers requests in the order they are handed to it
        for i, result in self.generator.stream(requests(), self.options.scheduling.batch_size):
            entry = waiting.pop(i)
            entry[3].append((i, result))
            if len(entry[3]) < n:
                continue
            results = [r for _, r in sorted(entry[3], key=lambda ir: ir[0])]
            entry[2] = self.output_samples(entry[0], entry[1], results, [r.stats.get("row_wall_s", 0.0) for r in results])
            write_ready()
        write_ready()
        writer.flush()


def _fit_memory(options: DecodeOptions, model, drafter, max_context: int) -> DecodeOptions:
    """The options with batch size and draft width fitted to ``--max-memory`` (decode/jobs/memory.py), the
    choice said once on stderr. Rows are costed at the model's whole context: the job has not read
    its prompts yet, and any prompt up to the context is accepted."""
    from specdec.decode.jobs.memory import fit, memory_model, parse_size

    scheduling, drafting = options.scheduling, options.drafting
    budget = parse_size(scheduling.max_memory)
    mm = memory_model(model, drafter, max_context, options.sampling.max_new_tokens)
    plan = fit(budget, mm, drafter, scheduling.batch_size, drafting.num_draft, scheduling.max_memory)
    print(plan.note, file=sys.stderr, flush=True)
    if plan.tree_tokens is not None:  # the heads are loaded already: resize the tree in place rather than reload them
        drafter.tree_tokens = plan.tree_tokens
    return options.with_overrides({"batch_size": plan.batch_size, "num_draft": plan.num_draft,
                                   "tree_tokens": plan.tree_tokens if plan.tree_tokens is not None else drafting.tree_tokens})


# a continuous job flushes at least this often while records are being written (a batch's worth of
# records can take long when the rows in flight are long ones)
FLUSH_EVERY_S = 10.0


# -- sharding under accelerate launch -----------------------------------------------------------


def shard_path(out: str, rank: int, world: int) -> str:
    return f"{out}.rank{rank}-of-{world}"


def merge_shards(out: str, world: int) -> None:
    """Join the ranks' shards into ``out`` in input-line order, replacing it atomically."""
    rows = []
    for r in range(world):
        path = Path(shard_path(out, r, world))
        if path.exists():
            rows.extend(read_jsonl_objects(path))
    rows.sort(key=lambda o: o.get("line") or 0)
    try:
        atomic_write_lines(out, (encode_record_line(o) for o in rows))
    except OSError as exc:
        raise OutputWriteError(
            f"merging the shards into {out} failed ({exc.strerror or exc}); the shards are kept: run the same command again"
        ) from None


# -- signals and the job -----------------------------------------------------------------


class Interrupted(SpecdecError):
    """SIGINT / SIGTERM: the exit code is 128 + the signal's number, as a shell reports it."""

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.exit_code = 128 + signum


class StrictStop(SpecdecError):
    """--strict met a bad record: exit 3, like a job whose output holds error records."""

    exit_code = 3


class _Signal(BaseException):
    """Raised by the handler; a BaseException so that ``except Exception`` in a batch cannot swallow it."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


@contextlib.contextmanager
def _signals_raise():
    """SIGINT and SIGTERM raise ``_Signal`` in the main thread while the job runs."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        # a second signal while the job winds down ends the process the ordinary way
        for s in (signal.SIGINT, signal.SIGTERM):
            signal.signal(s, signal.SIG_DFL)
        raise _Signal(signum)

    old = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def run_decode_job(
    in_path: str,
    out_path: str,
    target: str | None,
    options: DecodeOptions,
    strict: bool = False,
    overwrite: bool = False,
    console=None,
    default_target: Callable[[], str] | None = None,
) -> tuple[JobSummary, int]:
    """Returns (summary, exit code): 0 when every record in the output succeeded, 3 when some are
    error records (written now or by the run this one resumes). ``target`` None: ``default_target()``,
    asked for once the options are checked.

    Raises ``UsageError`` (exit 2) for bad options and paths before any model loads (``plan_decode``,
    ``validate_paths``: the one check), and when another process writes the same output;
    ``Interrupted`` (130 / 143) on SIGINT / SIGTERM once the records already decoded are durable;
    ``StrictStop`` (3) where ``--strict`` stopped; ``OutputWriteError`` (1) when the output cannot be
    written (disk full).
    """
    plan = plan_decode(target, options, default_target, paths=(in_path, out_path))
    held: list[JsonlWriter] = []
    with _signals_raise():
        try:
            return _decode_job(in_path, out_path, plan, strict, overwrite, console, held)
        except _Signal as sig:
            name = signal.Signals(sig.signum).name
            if not held:
                raise Interrupted(f"interrupted ({name}) before any record was decoded", sig.signum) from None
            writer = held[0]
            try:
                writer.close()
            except SpecdecError:
                pass
            resume = "" if writer.to_stdout else "; run the same command again to resume"
            where = "stdout" if writer.to_stdout else writer.path
            raise Interrupted(f"interrupted ({name}): {writer.records} records written to {where}{resume}", sig.signum) from None


def _decode_job(in_path, out_path, plan: DecodePlan, strict, overwrite, console, held) -> tuple[JobSummary, int]:
    from accelerate import PartialState

    state = None
    placement = plan.options.placement
    if os.environ.get("WORLD_SIZE", "1") != "1":
        # one process per GPU where there are GPUs (accelerate gives each rank its own), CPU processes elsewhere
        import torch

        state = PartialState(cpu=placement.device == "cpu" or not torch.cuda.is_available())
        if placement.device == "auto" and not placement.device_map:
            plan = dataclasses.replace(plan, options=plan.options.with_overrides({"device": str(state.device)}))
    world, rank = (state.num_processes, state.process_index) if state else (1, 0)
    if plan.note and console is not None and rank == 0:
        console.print(plan.note)
    if world > 1 and out_path == "-":
        raise UsageError("multi-process decoding needs --out FILE (shards are merged into it)")
    # rank 0 holds the merged output's lock from the start, so a second job on it is refused at once
    out_lock = OutputLock(out_path) if world > 1 and rank == 0 else None
    try:
        writer = JsonlWriter(shard_path(out_path, rank, world) if world > 1 else out_path, overwrite=overwrite)
        held.append(writer)
        try:
            decoder = Decoder(plan.target, plan.options, console, plan=plan)
            records = read_records(in_path, warn=_warn if rank == 0 else None)
            if world > 1:
                records = (r for i, r in enumerate(records) if i % world == rank)
            with ProgressBar("decode", _count_lines(in_path) if world == 1 else None, enabled=console is not None,
                             console=console) as bar:

                def advance(n: int, summary: JobSummary) -> None:
                    bar.update(advance=n, status=f"{summary.rate_label()} failed {summary.failed + summary.failed_before}")

                summary = decoder.run(records, writer, strict=strict, progress=advance if console is not None else None)
            writer.finish()
        finally:
            writer.close()
        if world > 1:
            state.wait_for_everyone()
            if rank == 0:
                merge_shards(out_path, world)
            state.wait_for_everyone()
    finally:
        if out_lock is not None:
            out_lock.release()
    if summary.stopped_at_line is not None:
        print_summary(summary, console)
        raise StrictStop(f"stopped at line {summary.stopped_at_line} (--strict): {summary.stop_reason}")
    code = 3 if summary.failed or summary.failed_before else 0
    return summary, code


def _warn(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr, flush=True)


def _count_lines(path: str) -> int | None:
    """Non-blank lines of a regular file (a pipe cannot be read twice), in blocks: a huge line is
    never held whole."""
    if path == "-" or not Path(path).is_file():
        return None
    count, blank = 0, True
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 20):
            parts = chunk.split(b"\n")
            for i, part in enumerate(parts):
                if part.strip():
                    blank = False
                if i < len(parts) - 1:
                    count += not blank
                    blank = True
    return count + (not blank)


def print_summary(summary: JobSummary, console) -> None:
    if console is None:
        return
    tps = summary.new_tokens / summary.wall_s if summary.wall_s else 0.0
    earlier = f" ({summary.failed_before} of them error records)" if summary.failed_before else ""
    console.print(
        f"records ok {summary.ok}, failed {summary.failed}, skipped (already done) {summary.skipped}{earlier}; "
        f"{summary.new_tokens} tokens in {summary.wall_s:.2f}s ({tps:.1f} tokens/s); "
        + (
            f"{summary.diffusion_steps / max(summary.new_tokens, 1):.3f} denoising steps per token"
            if summary.diffusion_steps
            else f"tau {summary.tau:.3f} tokens per target call (bonus token included)"
        )
    )
    if summary.drafted:
        console.print(f"acceptance by position: {summary.acceptance_by_position}")


# A token spans at most a few dozen characters in the tokenizers specdec meets (long tokens are
# runs of spaces or punctuation, and a text averages far fewer), so a prompt over this many
# characters per context position cannot fit: it is refused without tokenizing megabytes.
MAX_CHARS_PER_TOKEN = 32


def prompt_chars(rec: Record) -> int:
    if rec.messages is not None:
        return sum(len(m.get("content") or "") + len(m.get("role") or "") for m in rec.messages if isinstance(m, dict))
    return len(rec.prompt or "")


def encode_record(tokenizer, rec: Record) -> list[int]:
    """A record's prompt token ids: its messages through the chat template, or its prompt text."""
    if rec.messages is not None:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("records with messages need a tokenizer with a chat template")
        out = tokenizer.apply_chat_template(rec.messages, add_generation_prompt=True, tokenize=True)
        return list(out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out)
    return tokenizer(rec.prompt, add_special_tokens=True)["input_ids"]
