"""A decode job: JSONL records in, one JSON line per record out, whatever the generator.

Batches are formed in input order; bad records become error records in place; each batch is
written and flushed before the next starts. Under ``accelerate launch`` rank r takes records
r, r+N, ... into its own resumable shard, and rank 0 merges the shards in input order.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from specdec.decode.artifacts import SpecdecError, artifact_kind, resolve_member
from specdec.decode.io import JsonlWriter, Record, read_records
from specdec.decode.loading import DecodeOptions, build_drafter, load_target
from specdec.decode.types import GenRequest


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

    def add(self, stats: dict) -> None:
        self.ok += 1
        if "strategy" in stats:  # diffusion: its rows share batch forwards, so count steps, not calls
            self.new_tokens += stats.get("decoded_tokens", 0)
            self.diffusion_steps += stats.get("steps", 0)
            return
        self.new_tokens += stats.get("new_tokens", 0)
        self.target_calls += stats.get("target_calls", 0)
        self.drafted += stats.get("drafted_tokens", 0)
        self.accepted += stats.get("accepted_tokens", 0)
        for name in ("pos_drafted", "pos_accepted"):
            mine, theirs = getattr(self, name), stats.get(name.replace("pos_", "position_"), [])
            mine.extend([0] * (len(theirs) - len(mine)))
            for i, v in enumerate(theirs):
                mine[i] += v

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
    """Loads the target and the generator once; ``run`` decodes a stream of records."""

    def __init__(self, target: str | None, options: DecodeOptions, console=None):
        self.options = options
        self.console = console
        from specdec.decode.loading import apply_threads

        apply_threads(options)
        target = target or ensure_default_family(console)
        path = resolve_member(target)
        self.is_diffusion = is_diffusion_model(path, options)
        if self.is_diffusion:
            from specdec.decode.loading import _hook

            self.generator, self.tokenizer, self.max_context = _hook("specdec.decode.diffusion", "generator_from_options")(
                path, options
            )
        else:
            model, self.tokenizer, _ = load_target(str(path), options)
            from specdec.decode.engine import SpecEngine
            from specdec.decode.loading import kernel_backend
            from specdec.decode.verify import Sampling

            drafter = build_drafter(options.drafter, model, self.tokenizer, options)
            self.generator = SpecEngine(
                model,
                self.tokenizer,
                drafter,
                Sampling(options.temperature, options.top_p),
                num_draft=options.num_draft,
                seed=options.seed,
                stop=options.stop,
                kernels=kernel_backend(options, next(model.parameters()).device),
            )
            self.max_context = getattr(model.config, "max_position_embeddings", None) or 1 << 30

    def encode(self, rec: Record) -> list[int]:
        return encode_record(self.tokenizer, rec)

    def prepare(self, rec: Record) -> GenRequest | str:
        """A request, or the error message that replaces the record."""
        if rec.error:
            return rec.error
        try:
            ids = self.encode(rec)
        except Exception as exc:  # a tokenizer/chat-template failure concerns this record only
            return f"cannot tokenize: {exc}"
        if not ids:
            return "prompt encodes to no tokens"
        room = self.max_context - len(ids)
        if room <= 0:
            return f"prompt has {len(ids)} tokens; the model's context is {self.max_context}"
        return GenRequest(ids, min(rec.max_new_tokens or self.options.max_new_tokens, room))

    def output(self, rec: Record, req: GenRequest, result, wall: float) -> dict:
        text = self.tokenizer.decode(result.token_ids, skip_special_tokens=True)
        finish = result.finish_reason
        for s in self.options.stop:
            if s and s in text:
                text, finish = text[: text.index(s)], "stop"
        out = {"id": rec.id}
        if rec.category is not None:
            out["category"] = rec.category
        # the input is echoed so an output file is training data on its own (train-draft reads prompt + completion)
        if rec.messages is not None:
            out["messages"] = rec.messages
        else:
            out["prompt"] = rec.prompt
        stats = {"prompt_tokens": len(req.prompt_ids), **result.stats, "wall_s": round(wall, 6)}
        stats.pop("batch_wall_s", None)
        out.update(completion=text, finish_reason=finish, stats=stats)
        return out

    def run(self, records, writer: JsonlWriter, strict: bool = False, progress=None, line_key: bool = False) -> JobSummary:
        summary = JobSummary()
        start = time.perf_counter()
        pending: list[tuple[Record, GenRequest | str]] = []
        stop = False

        def flush_batch():
            reqs = [(r, q) for r, q in pending if isinstance(q, GenRequest)]
            results = {}
            if reqs:
                t0 = time.perf_counter()
                outs = self.generator.generate([q for _, q in reqs])
                wall = time.perf_counter() - t0
                results = {id(r): self.output(r, q, o, wall) for (r, q), o in zip(reqs, outs)}
            for rec, req in pending:
                obj = results.get(id(rec)) or rec.error_record(req)
                if "error" in obj:
                    summary.failed += 1
                else:
                    summary.add(obj["stats"])
                if line_key:
                    obj = {**obj, "_line": rec.line}
                writer.write(obj)
            writer.flush()
            if progress is not None:
                progress(len(pending), summary)
            pending.clear()

        for rec in records:
            if rec.id in writer.done:
                summary.skipped += 1
                if progress is not None:
                    progress(1, summary)
                continue
            req = self.prepare(rec)
            pending.append((rec, req))
            if isinstance(req, str) and strict:
                stop = True
                break
            if sum(isinstance(q, GenRequest) for _, q in pending) >= self.options.batch_size:
                flush_batch()
        if pending:
            flush_batch()
        summary.wall_s = time.perf_counter() - start
        summary.stopped_early = stop
        return summary


def is_diffusion_model(path: Path, options: DecodeOptions) -> bool:
    """specdec's dLLMs say so in config.json; third-party ones (LLaDA, Dream) carry a mask token id
    and run their own code, so they are recognised only with --trust-remote-code."""
    from specdec.decode.artifacts import read_config

    if artifact_kind(path) == "dllm":
        return True
    return options.trust_remote_code and read_config(path).get("mask_token_id") is not None


def ensure_default_family(console=None) -> str:
    """The default family's target, building the recipe first when it is not cached."""
    from specdec.decode.artifacts import family_dir

    target = family_dir() / "target"
    if not (target / "metrics.json").exists():
        if console is not None:
            console.print(f"[yellow]The default model family is not built yet: building it in {family_dir()} (once).[/yellow]")
        from specdec.train.recipe import run_recipe

        run_recipe("tiny-stdlib", console=console)
    return str(target)


# -- sharding under accelerate launch -----------------------------------------------------------


def shard_path(out: str, rank: int, world: int) -> str:
    return f"{out}.rank{rank}-of-{world}"


def merge_shards(out: str, world: int) -> None:
    rows = []
    for r in range(world):
        path = Path(shard_path(out, r, world))
        if path.exists():
            rows.extend(json.loads(line) for line in path.read_text().splitlines() if line.strip())
    rows.sort(key=lambda o: o.pop("_line"))
    tmp = Path(out + ".tmp")
    tmp.write_text("".join(json.dumps(o, ensure_ascii=False) + "\n" for o in rows))
    os.replace(tmp, out)


def run_decode_job(
    in_path: str,
    out_path: str,
    target: str | None,
    options: DecodeOptions,
    strict: bool = False,
    overwrite: bool = False,
    console=None,
) -> tuple[JobSummary, int]:
    """Returns (summary, exit code): 0 all records succeeded, 3 some failed."""
    from accelerate import PartialState

    state = PartialState(cpu=True) if os.environ.get("WORLD_SIZE", "1") != "1" else None
    world, rank = (state.num_processes, state.process_index) if state else (1, 0)
    if world > 1 and out_path == "-":
        raise SpecdecError("multi-process decoding needs --out FILE (shards are merged into it)")
    decoder = Decoder(target, options, console)
    records = read_records(in_path)
    if world > 1:
        records = (r for i, r in enumerate(records) if i % world == rank)
    writer = JsonlWriter(shard_path(out_path, rank, world) if world > 1 else out_path, overwrite=overwrite)
    total = _count_lines(in_path)
    try:
        with _progress(console, total if world == 1 else None) as advance:
            summary = decoder.run(records, writer, strict=strict, progress=advance, line_key=world > 1)
    finally:
        writer.close()
    if world > 1:
        state.wait_for_everyone()
        if rank == 0:
            merge_shards(out_path, world)
        state.wait_for_everyone()
    code = 3 if summary.failed else 0
    return summary, code


def _count_lines(path: str) -> int | None:
    if path == "-":
        return None
    with open(path, "rb") as fh:
        return sum(1 for line in fh if line.strip())


class _progress:
    """A rich progress bar on stderr (or nothing without a console)."""

    def __init__(self, console, total):
        self.console, self.total = console, total

    def __enter__(self):
        if self.console is None:
            return None
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self.bar = Progress(
            TextColumn("decode"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), TextColumn("{task.description}"),
            console=self.console, transient=False,
        )
        self.bar.__enter__()
        task = self.bar.add_task("", total=self.total)

        def advance(n, summary: JobSummary):
            self.bar.update(task, advance=n, description=f"{summary.rate_label()} failed {summary.failed}")

        return advance

    def __exit__(self, *exc):
        if self.console is not None:
            self.bar.__exit__(*exc)
        return False


def print_summary(summary: JobSummary, console) -> None:
    if console is None:
        return
    tps = summary.new_tokens / summary.wall_s if summary.wall_s else 0.0
    console.print(
        f"records ok {summary.ok}, failed {summary.failed}, skipped (already done) {summary.skipped}; "
        f"{summary.new_tokens} tokens in {summary.wall_s:.2f}s ({tps:.1f} tokens/s); "
        + (
            f"{summary.diffusion_steps / max(summary.new_tokens, 1):.3f} denoising steps per token"
            if summary.diffusion_steps
            else f"tau {summary.tau:.3f} tokens per target call (bonus token included)"
        )
    )
    if summary.drafted:
        console.print(f"acceptance by position: {summary.acceptance_by_position}")


def stderr_console():
    from rich.console import Console

    return Console(stderr=True, file=sys.stderr)


def encode_record(tokenizer, rec: Record) -> list[int]:
    """A record's prompt token ids: its messages through the chat template, or its prompt text."""
    if rec.messages is not None:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("records with messages need a tokenizer with a chat template")
        out = tokenizer.apply_chat_template(rec.messages, add_generation_prompt=True, tokenize=True)
        return list(out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out)
    return tokenizer(rec.prompt, add_special_tokens=True)["input_ids"]
