"""Benchmark diffusion decoding strategies against static one-token-per-step decoding.

Every method runs in the same process on the same records, timed as every bench times
(``bench.timing``: interleaved passes, the median of per-pass ratios to the reference). Per method:
steps per generated token, forwards per token, tokens/s, speedup over the reference (static, one
token per step), agreement with the reference (exact-match rate, token accuracy) and, for records
carrying an ``answer`` (list tasks), task accuracy. The speedup is a ratio of wall times, not of
tokens/s: an approximate strategy may stop at another length than the reference, and the work
compared is decoding the same records.

A method is a diffusion method spec, ``strategy[+key=value...]``, on top of the bench's decode
options: ``threshold+tau=0.8``, ``static+cache=dual``, ``learn2pd+filter=DIR``,
``credit+adablock=true``, ``static+steps=32``.
"""

from __future__ import annotations

import time
from pathlib import Path

from specdec.decode.diffusion.generator import Method, build_generator, load_for_decoding, parse_method
from specdec.decode.options import DecodeOptions
from specdec.bench import quality
from specdec.bench.report import provenance
from specdec.bench.timing import Run, Runner, run_passes, speedup, tokens_per_s
from specdec.decode.engine.types import GenRequest
from specdec.models.dllm import encode_prompt
from specdec.models.errors import SpecdecError

REFERENCE = "static"  # one token per step: the quality reference of every method


def is_reference(method: Method) -> bool:
    return method.strategy == REFERENCE and not method.options


def method_options(method: Method, options: DecodeOptions) -> DecodeOptions:
    """The decode options of one method; the reference is exact whatever the bench's options say."""
    if is_reference(method):
        return options.with_overrides({"strategy": REFERENCE, "steps": None, "cache": "none", "adablock": False, "filter": None})
    return options.with_overrides({"strategy": method.label})


def prepare_method(generator, prompts: list[list[int]], batch_size: int, warmup: int) -> Runner:
    """A runner decoding ``prompts`` in batches, after decoding the first ``warmup`` prompts once."""
    length = generator.gen_length
    for i in range(0, warmup, batch_size):
        generator.generate([GenRequest(p, length) for p in prompts[i : min(i + batch_size, warmup)]])

    def decode(lo: int, hi: int) -> list:
        out = []
        for i in range(lo, hi, batch_size):
            t0 = time.perf_counter()
            batch = generator.generate([GenRequest(p, length) for p in prompts[i : min(i + batch_size, hi)]])
            wall = time.perf_counter() - t0
            # the rows of a batch share its forwards: each carries its share, so sums over prompts count them once
            share = {"wall_s": wall / len(batch), "forwards": batch[0].stats["target_calls"] / len(batch)}
            out += [(r.token_ids, {**r.stats, **share}) for r in batch]
        return out

    return Runner(decode, len(prompts))


def token_agreement(output: list[int], reference: list[int]) -> tuple[int, int]:
    """(matching positions, compared positions): extra or missing tokens count as mismatches."""
    return sum(a == b for a, b in zip(output, reference)), max(len(output), len(reference))


def summarise(label: str, run: Run, reference: Run, records: list[dict], tokenizer) -> dict:
    everything = list(range(len(run.outputs)))
    decoded = sum(st["decoded_tokens"] for st in run.stats)
    forwards = round(sum(st["forwards"] for st in run.stats))
    pairs = [token_agreement(out, ref) for out, ref in zip(run.outputs, reference.outputs)]
    matched, compared = sum(m for m, _ in pairs), sum(c for _, c in pairs)
    probes = [(out, rec["answer"]) for out, rec in zip(run.outputs, records) if rec.get("answer") is not None]
    ratio = speedup(run, reference, everything, per_token=False)
    return {
        "method": label,
        "tokens_per_s": tokens_per_s(run, everything),
        "speedup": ratio,
        "walls_s": [round(w, 4) for w in run.walls],
        "steps": sum(st["steps"] for st in run.stats) / len(run.stats),
        "steps_per_token": sum(st["steps"] for st in run.stats) / max(decoded, 1),
        "forwards_per_token": forwards / max(decoded, 1),
        "token_agreement": matched / compared if compared else 1.0,
        "exact_match": sum(out == ref for out, ref in zip(run.outputs, reference.outputs)) / len(run.outputs),
        "task_accuracy": (
            sum(quality.first_line_matches(tokenizer.decode(out), answer) for out, answer in probes) / len(probes) if probes else None
        ),
        "approximate": any(st.get("approximate") for st in run.stats),
    }


def bench_diffusion(
    model_dir: str | Path,
    records: list[dict],
    methods: list[str],
    options: DecodeOptions | None = None,
    *,
    repeats: int = 1,
    warmup: int = 1,
    command: str | None = None,
    **overrides,
) -> dict:
    """Run every method on ``records`` (dicts with ``prompt``, optionally ``answer``) and report.

    ``options`` (with ``overrides``, DecodeOptions fields such as ``gen_length=16``) are the decode
    options every method starts from. The reference (``static``, one token per step) is run even when
    not listed. ``command`` is recorded in the report (default: this process's command line).
    """
    if not records:
        raise SpecdecError("the diffusion bench needs at least one record with a prompt")
    options = (options or DecodeOptions()).with_overrides(overrides)
    parsed = [parse_method(m) for m in methods]
    for method in parsed:  # other options belong to the strategy, which validates them
        if method.strategy == "learn2pd" and "filter" not in method.options and options.diffusion.filter is None:
            raise SpecdecError(f"method {method.label!r}: learn2pd needs +filter=DIR")
    if not any(is_reference(m) for m in parsed):
        parsed.insert(0, Method(REFERENCE, REFERENCE))
    model, tokenizer, spec = load_for_decoding(model_dir, options)
    prompts = [encode_prompt(tokenizer, r["prompt"]) for r in records]
    batch_size = max(1, options.scheduling.batch_size)
    generators = {m.label: build_generator(model, tokenizer, spec, method_options(m, options)) for m in parsed}
    runners = {label: prepare_method(gen, prompts, batch_size, warmup) for label, gen in generators.items()}
    runs = run_passes(runners, len(prompts), batch_size, repeats)
    reference_label = next(m.label for m in parsed if is_reference(m))
    reference = runs[reference_label]
    resolved = {k: v for k, v in options.values().items() if k not in ("drafter", "strategy", "max_new_tokens")}
    return {
        "kind": "diffusion",
        "config": resolved | {
            "model": str(model_dir),
            "records": len(records),
            "gen_length": generators[reference_label].gen_length,
            "block_size": options.diffusion.block_size,
            "batch_size": batch_size,
            "repeats": repeats,
            "warmup": warmup,
            "reference": REFERENCE + " (one token per step)",
            "attention": spec.attention,
            "device": str(model.device),
        },
        "methods": [summarise(label, runs[label], reference, records, tokenizer) for label in runs],
        **provenance(command, model.device),
    }


def render_table(report: dict):
    from rich.table import Table

    cfg = report["config"]
    table = Table(title=f"diffusion decoding: gen {cfg['gen_length']}, block {cfg['block_size']}, {cfg['records']} records, vs {cfg['reference']}")
    columns = [
        ("method", "method", "{}"),
        ("steps/token", "steps_per_token", "{:.3f}"),
        ("fwd/token", "forwards_per_token", "{:.3f}"),
        ("tokens/s", "tokens_per_s", "{:.1f}"),
        ("speedup", "speedup", "{:.2f}x"),
        ("token agr.", "token_agreement", "{:.1%}"),
        ("exact", "exact_match", "{:.1%}"),
        ("task acc.", "task_accuracy", "{:.1%}"),
    ]
    for title, _, _ in columns:
        table.add_column(title, justify="left" if title == "method" else "right")
    for row in report["methods"]:
        cells = ["-" if row.get(key) is None else fmt.format(row[key]) for _, key, fmt in columns]
        if row.get("approximate"):
            cells[0] += " (approx.)"
        table.add_row(*cells)
    return table
