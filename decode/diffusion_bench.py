"""Benchmark diffusion decoding strategies against static one-token-per-step decoding.

Every method runs in the same process on the same records; speed ratios therefore compare like
with like. Per method: steps per generated token, forwards per token, tokens/s, speedup over the
reference (static, one token per step), agreement with the reference (exact-match rate, token
accuracy) and, for records carrying an ``answer`` (list tasks), task accuracy.

A method is ``strategy[+key=value...]``: ``threshold+tau=0.8``, ``static+cache=dual``,
``learn2pd+filter=DIR``, ``credit+adablock=true``, ``static+steps=32``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from specdec.models.artifacts import SpecdecError
from specdec.decode.diffusion import DiffusionGenerator, Method, parse_method  # noqa: F401  (bench specs)
from specdec.models.dllm import encode_prompt, load_dllm
from specdec.decode.types import GenRequest, GenResult

REFERENCE = "static"  # one token per step: the quality reference of every method


def is_reference(method: Method) -> bool:
    return method.strategy == REFERENCE and not method.options


@dataclass
class Run:
    method: Method
    seconds: float
    results: list[GenResult]
    forwards: int


def run_method(generator: DiffusionGenerator, prompts: list[list[int]], gen_length: int, batch_size: int) -> tuple[list[GenResult], int]:
    results, forwards = [], 0
    for i in range(0, len(prompts), batch_size):
        batch = generator.generate([GenRequest(p, gen_length) for p in prompts[i : i + batch_size]])
        forwards += batch[0].stats["target_calls"]
        results.extend(batch)
    return results, forwards


def time_method(generator, prompts, gen_length: int, batch_size: int, repeats: int, warmup: int) -> tuple[float, list[GenResult], int]:
    """Best of ``repeats`` timed passes over all prompts (the machine may be shared), after decoding
    the first ``warmup`` prompts once (warm-up prompts, as ``specdec bench --warmup`` says)."""
    if warmup > 0:
        run_method(generator, prompts[:warmup], gen_length, batch_size)
    best = float("inf")
    for _ in range(max(1, repeats)):
        start = time.perf_counter()
        results, forwards = run_method(generator, prompts, gen_length, batch_size)
        best = min(best, time.perf_counter() - start)
    return best, results, forwards


def token_agreement(output: list[int], reference: list[int]) -> tuple[int, int]:
    """(matching positions, compared positions): extra or missing tokens count as mismatches."""
    return sum(a == b for a, b in zip(output, reference)), max(len(output), len(reference))


def first_line_matches(completion: str, answer: str) -> bool:
    """Exact match of the completion's first line, ignoring surrounding whitespace."""
    lines = completion.strip().splitlines()
    return bool(lines) and lines[0].strip() == answer.strip()


def summarise(run: Run, reference: Run, records: list[dict], tokenizer) -> dict:
    results = run.results
    decoded = sum(r.stats["decoded_tokens"] for r in results)
    generated = sum(len(r.token_ids) for r in results)
    pairs = [token_agreement(r.token_ids, ref.token_ids) for r, ref in zip(results, reference.results)]
    matched, compared = sum(m for m, _ in pairs), sum(c for _, c in pairs)
    probes = [(r, rec["answer"]) for r, rec in zip(results, records) if rec.get("answer") is not None]

    return {
        "method": run.method.label,
        "tokens_per_s": generated / run.seconds if run.seconds > 0 else None,
        "seconds": round(run.seconds, 4),
        "speedup": reference.seconds / run.seconds if run.seconds > 0 else None,
        "steps": sum(r.stats["steps"] for r in results) / len(results),
        "steps_per_token": sum(r.stats["steps"] for r in results) / max(decoded, 1),
        "forwards_per_token": run.forwards / max(decoded, 1),
        "token_agreement": matched / compared if compared else 1.0,
        "exact_match": sum(r.token_ids == ref.token_ids for r, ref in zip(results, reference.results)) / len(results),
        "task_accuracy": (
            sum(first_line_matches(tokenizer.decode(r.token_ids), answer) for r, answer in probes) / len(probes) if probes else None
        ),
        "approximate": any(r.stats.get("approximate") for r in results),
    }


def bench_diffusion(
    model_dir: str | Path,
    records: list[dict],
    methods: list[str],
    gen_length: int = 128,
    block_size: int = 32,
    batch_size: int = 8,
    repeats: int = 1,
    warmup: int = 1,
    trust_remote_code: bool = False,
    device: str = "cpu",
) -> dict:
    """Run every method on ``records`` (dicts with ``prompt``, optionally ``answer``) and report.

    The reference (``static``, one token per step) is run even when not listed.
    """

    if not records:
        raise SpecdecError("the diffusion bench needs at least one record with a prompt")
    parsed = [parse_method(m) for m in methods]
    for method in parsed:  # other options belong to the strategy, which validates them
        if method.strategy == "learn2pd" and "filter" not in method.options:
            raise SpecdecError(f"method {method.label!r}: learn2pd needs +filter=DIR")
    if not any(is_reference(m) for m in parsed):
        parsed.insert(0, Method(REFERENCE, REFERENCE))
    model, tokenizer, spec = load_dllm(model_dir, trust_remote_code=trust_remote_code)
    model.to(device)
    prompts = [encode_prompt(tokenizer, r["prompt"]) for r in records]
    runs = []
    for method in parsed:
        generator = DiffusionGenerator(model, tokenizer, spec, method.strategy, gen_length=gen_length, block_size=block_size, **method.generator_kwargs())
        seconds, results, forwards = time_method(generator, prompts, gen_length, batch_size, repeats, warmup)
        runs.append(Run(method, seconds, results, forwards))
    reference = next(r for r in runs if is_reference(r.method))
    return {
        "config": {
            "model": str(model_dir),
            "records": len(records),
            "gen_length": gen_length,
            "block_size": block_size,
            "batch_size": batch_size,
            "repeats": repeats,
            "warmup": warmup,
            "reference": REFERENCE + " (one token per step)",
            "attention": spec.attention,
            "device": str(model.device),
        },
        "methods": [summarise(run, reference, records, tokenizer) for run in runs],
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


def plot(report: dict, path: str | Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for row in report["methods"]:
        ax.scatter(row["token_agreement"], row["speedup"])
        ax.annotate(row["method"], (row["token_agreement"], row["speedup"]), fontsize=8, xytext=(3, 3), textcoords="offset points")
    ax.set_xlabel("token agreement with static one-token-per-step")
    ax.set_ylabel("speedup (wall time)")
    ax.set_title(f"gen {report['config']['gen_length']}, block {report['config']['block_size']}")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
