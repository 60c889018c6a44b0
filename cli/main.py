"""The ``specdec`` command line and its one error boundary.

Commands declare options and hand off to one function each; torch and transformers are imported
inside the commands so ``specdec --help`` is instant. ``main`` turns every failure into one
``error:`` line and a documented exit code: 2 for usage errors (bad option values, paths, option
combinations), 1 for other errors, 3 when a decode job wrote error records, 130/143 when interrupted.
Set ``SPECDEC_DEBUG=1`` to see the traceback of an unexpected error.
"""

from __future__ import annotations

import os
import re
import sys
from enum import Enum
from pathlib import Path
from typing import Annotated, Optional

import typer
from typer._click import exceptions as click_exceptions

from specdec.cli import diffusion as diffusion_cli
from specdec.cli import index as index_cli
from specdec.cli import options as o
from specdec.cli import train as train_cli
from specdec.decode.options import DraftingOptions
from specdec.models.errors import SpecdecError, UsageError

app = typer.Typer(
    name="specdec",
    help="Lossless speculative decoding and parallel diffusion decoding for offline batch work.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
recipe_app = typer.Typer(help="Build the embedded default model family (and other recipes).", no_args_is_help=True)
app.add_typer(recipe_app, name="recipe")


def _console():
    return o.console()


def default_target(console) -> str:
    """The default model, Gemma 3 270M: converted from its registry package on first use (said up
    front, with how long it takes)."""
    from specdec.models.gguf import gemma_target

    say = None if console is None else (lambda text: console.print(f"[yellow]{text}[/yellow]"))
    return str(gemma_target(announce=say))


def placement_options(device: str, dtype: o.Dtype, device_map: o.DeviceMap | None, attn_implementation: str | None,
                      trust_remote_code: bool, threads: int, weights: str = "auto"):
    """The shared placement options as a piece of the decode options (checked with the others)."""
    from specdec.decode.options import PlacementOptions

    return PlacementOptions(device, dtype.value, device_map.value if device_map else None, attn_implementation, trust_remote_code, threads,
                            weights)


class Schedule(str, Enum):
    auto = "auto"
    continuous = "continuous"
    static = "static"


@app.command()
@o.declared_flags(DraftingOptions)
def decode(
    in_path: Annotated[str, typer.Option("--in", help="Input JSONL ('-' for stdin).")],
    out_path: Annotated[str, typer.Option("--out", help="Output JSONL ('-' for stdout). Re-running resumes it.")] = "-",
    target: o.Target = None,
    drafter: o.DrafterOpt = "auto",
    max_new_tokens: o.MaxNewTokens = 128,
    temperature: o.Temperature = 0.0,
    top_p: o.TopP = 1.0,
    seed: o.Seed = 0,
    num_samples: o.NumSamples = 1,
    first_finish: Annotated[int, typer.Option("--first-finish", help="First Finish Search: launch N samples of each record (needs --temperature > 0) and keep the first to finish (EOS or a stop string, counted in tokens); the others stop once they cannot finish first.")] = 0,
    beams: Annotated[int, typer.Option("--beams", help="Beam search with B beams (greedy, no drafting): the B outputs best first, with their scores, in each record's samples.")] = 1,
    beam_groups: Annotated[int, typer.Option("--beam-groups", help="Diverse Beam Search: the beams in G groups decoded in turn (G divides --beams).")] = 1,
    diversity_penalty: Annotated[float, typer.Option("--diversity-penalty", help="Diverse Beam Search: subtracted from a token's log-probability for each earlier group's beam that chose it at the same step.")] = 0.0,
    batch_size: o.BatchSize = 8,
    max_memory: Annotated[Optional[str], typer.Option("--max-memory", help="Memory budget (4GiB, 800MB, 512MiB): the largest --batch-size that fits it by specdec's memory model (weights, KV at the model's full context, verify buffers), shrinking the draft's tree tokens / K when one row does not fit.")] = None,
    shared_prefix: Annotated[str, typer.Option("--shared-prefix", help="A prompt prefix the records share is prefilled once for the job: auto (the longest common prefix of 32+ tokens), off, or FILE (its text).")] = "auto",
    schedule: Annotated[Schedule, typer.Option("--schedule", help="Batching: continuous (a finished row's place goes to the next record at once), static (a batch ends with its longest row), or auto: continuous for causal LMs, static for diffusion LMs (which only batch statically).")] = Schedule.auto,
    stop: Annotated[Optional[list[str]], typer.Option("--stop", help="Stop string (repeatable).")] = None,
    strict: Annotated[bool, typer.Option("--strict", help="Stop at the first bad record (exit 3).")] = False,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Start --out over instead of resuming it.")] = False,
    strategy: Annotated[str, typer.Option("--strategy", help="Diffusion LMs: static, threshold, factor, localleap, credit, entropy, learn2pd, freedave, with options as in bench specs (threshold+tau=0.8).")] = "static",
    adablock: Annotated[bool, typer.Option("--adablock", help="Diffusion LMs: adaptive block ends at a confident newline (AdaBlock).")] = False,
    gen_length: Annotated[Optional[int], typer.Option("--gen-length", help="Diffusion LMs: tokens to generate (default --max-new-tokens).")] = None,
    block_size: Annotated[int, typer.Option("--block-size", help="Diffusion LMs: block length.")] = 32,
    steps: Annotated[Optional[int], typer.Option("--steps", help="Diffusion LMs: steps for static (default: one token per step).")] = None,
    cache: Annotated[o.DiffusionCache, typer.Option("--cache", help="Diffusion LMs: none, prefix or dual (approximate).")] = o.DiffusionCache.none,
    filter_dir: Annotated[Optional[str], typer.Option("--filter", help="Diffusion LMs: Learn2PD filter artifact.")] = None,
    kernels: o.KernelsOpt = o.Kernels.auto,
    device: o.Device = "auto",
    dtype: o.DtypeOpt = o.Dtype.auto,
    device_map: o.DeviceMapOpt = None,
    attn_implementation: o.AttnImpl = None,
    trust_remote_code: o.TrustRemoteCode = False,
    threads: o.Threads = 0,
    weights: o.Weights = "auto",
    compile: o.Compile = "auto",
    prefill_chunk: Annotated[int, typer.Option("--prefill-chunk", help="Continuous batching: an admitted record's prompt is prefilled N tokens a round inside the running batch's verify forwards (SARATHI; more when the verify forward is wider) instead of in a forward of its own (0).")] = 0,
    **drafting_flags,
) -> None:
    """Decode a JSONL file of prompts: one output line per input line, in order, resumable."""
    from specdec.decode.jobs.job import print_summary, run_decode_job
    from specdec.decode.options import DecodeOptions, DiffusionOptions, SamplingOptions, SchedulingOptions

    console = _console()
    opts = DecodeOptions(  # checked once, by run_decode_job, before any model loads
        sampling=SamplingOptions(max_new_tokens, temperature, top_p, seed, num_samples, list(stop or []), first_finish, beams,
                                 beam_groups, diversity_penalty),
        drafting=DraftingOptions(drafter=drafter, **drafting_flags),
        scheduling=SchedulingOptions(batch_size, schedule.value, prefill_chunk, shared_prefix, max_memory, compile, kernels.value),
        placement=placement_options(device, dtype, device_map, attn_implementation, trust_remote_code, threads, weights),
        diffusion=DiffusionOptions(strategy, gen_length, block_size, steps, cache.value, filter_dir, adablock),
    )
    summary, code = run_decode_job(in_path, out_path, target, opts, strict=strict, overwrite=overwrite, console=console,
                                   default_target=lambda: default_target(console))
    print_summary(summary, console)
    raise typer.Exit(code)


@app.command()
def bench(
    in_path: Annotated[str, typer.Option("--in", help="Prompts JSONL (with optional category); the shipped examples/prompts.jsonl by default.")] = "",
    target: o.Target = None,
    methods: Annotated[str, typer.Option("--methods", help="Comma-separated method specs, e.g. ar,ngram,draft+k=4,hf-assisted:draft,hf-lookup (default: the methods that need no trained artifact and transformers' own; for a dLLM, static and three parallel strategies).")] = "",
    max_new_tokens: o.MaxNewTokens = 128,
    temperature: o.Temperature = 0.0,
    num_samples: o.NumSamples = 1,
    batch_size: Annotated[int, typer.Option("--batch-size", help="Batch size for specdec methods and transformers' plain generate (prompt lookup and assisted generation take one row).")] = 1,
    repeats: Annotated[int, typer.Option("--repeats", min=1, help="Timed passes, each decoding every prompt with every method, interleaved batch by batch; speedup is the median of per-pass ratios to ar.")] = 1,
    warmup: Annotated[int, typer.Option("--warmup", min=0, help="Warm-up prompts per method before timing.")] = 2,
    limit: Annotated[Optional[int], typer.Option("--limit", min=1, help="Use only the first N prompts.")] = None,
    out: Annotated[Optional[str], typer.Option("--out", help="Write the JSON report here.")] = None,
    plot: Annotated[Optional[str], typer.Option("--plot", help="Write a PNG plot (speedup and tau per method and category).")] = None,
    kernels: o.KernelsOpt = o.Kernels.auto,
    device: o.Device = "auto",
    dtype: o.DtypeOpt = o.Dtype.auto,
    device_map: o.DeviceMapOpt = None,
    attn_implementation: o.AttnImpl = None,
    trust_remote_code: o.TrustRemoteCode = False,
    threads: o.Threads = 0,
    weights: o.Weights = "auto",
    shared_prefix: Annotated[str, typer.Option("--shared-prefix", help="A prompt prefix shared by a batch's records is prefilled once: auto, off, or FILE.")] = "auto",
    compile: o.Compile = "auto",
    busy: Annotated[int, typer.Option("--busy", min=0, help="Competing CPU-bound processes kept running through the whole run (a shared machine's load), recorded in the report.")] = 0,
) -> None:
    """Benchmark methods against plain decoding (and transformers' own) in one process, on the same prompts."""
    from specdec.bench.bench import BenchConfig, render, run_bench
    from specdec.bench.report import cli_command
    from specdec.decode.jobs.validate import validate_output_path
    from specdec.decode.options import DecodeOptions, SamplingOptions, SchedulingOptions
    from specdec.examples import example_path

    console = _console()
    in_path = in_path or str(example_path("prompts.jsonl"))
    if not os.path.isfile(in_path):
        raise UsageError(f"--in {in_path}: no such file")
    for flag, path in (("--out", out), ("--plot", plot)):  # a run is not lost to a report that cannot be written at its end
        if path:
            validate_output_path(path, flag)
    options = DecodeOptions(  # checked once, with every method spec, by run_bench before any model loads
        sampling=SamplingOptions(max_new_tokens, temperature, num_samples=num_samples),
        scheduling=SchedulingOptions(batch_size, shared_prefix=shared_prefix, compile=compile, kernels=kernels.value),
        placement=placement_options(device, dtype, device_map, attn_implementation, trust_remote_code, threads, weights),
    )
    cfg = BenchConfig(
        in_path=in_path, target=target, methods=[m for m in re.split(r",(?!\d)", methods) if m],  # layerskip:3,5 and skipdecode:18,9 keep their commas
        repeats=repeats, warmup=warmup, limit=limit, busy=busy, command=cli_command(), options=options,
    )
    report = run_bench(cfg, console, default_target=lambda: default_target(console))
    render(report, console, out, plot)


@recipe_app.command("list")
def recipe_list() -> None:
    """List the recipes that ship with specdec."""
    from specdec.recipes import list_recipes

    for name in list_recipes():
        typer.echo(name)


@recipe_app.command("run")
def recipe_run(
    name: Annotated[str, typer.Argument(help="Recipe name (see `specdec recipe list`) or a recipe YAML file.")],
    budget_minutes: Annotated[Optional[float], typer.Option("--budget-minutes", min=0.0, help="Wall-clock budget for the whole recipe.")] = None,
    force: Annotated[bool, typer.Option("--force", help="Rebuild members that are already cached.")] = False,
    only: Annotated[Optional[list[str]], typer.Option("--only", help="Stages to run: target, prompts, drafters, dllm.")] = None,
    device: Annotated[Optional[str], typer.Option("--device", help="Where every stage trains: auto, cpu, cuda or cuda:N (default: the recipe's).")] = None,
) -> None:
    """Build a model family into $SPECDEC_HOME/<name>/ (cached members are kept)."""
    import json

    from specdec.bench.report import cli_command
    from specdec.train.recipe import STAGES, run_recipe

    bad = sorted(set(only or []) - set(STAGES))
    if bad:
        raise UsageError(f"--only must name stages among {', '.join(STAGES)}, not {', '.join(bad)}")
    console = _console()
    report = run_recipe(name, budget_minutes=budget_minutes, force=force, only=only, console=console, device=device,
                        command=cli_command())
    console.print_json(json.dumps(report, default=str))


@recipe_app.command("export")
def recipe_export(
    name: Annotated[str, typer.Argument(help="Recipe name or YAML file whose built family to ship.")],
    out: Annotated[Path, typer.Option("--out", help="Folder to write (replaced whole), e.g. families/pycode.")],
    members: Annotated[Optional[str], typer.Option("--members", help="Comma-separated members to ship (default: the recipe's export.members).")] = None,
) -> None:
    """Ship a built family: bf16 safetensors in files under the recipe's size cap, and a model card (README.md)."""
    from specdec.bench.report import cli_command
    from specdec.train.recipe import export_recipe

    shipped = export_recipe(name, out, [m for m in members.split(",") if m] if members else None, command=cli_command())
    typer.echo(f"wrote {out}: {len(shipped['files'])} files, {shipped['total_bytes'] / 1e6:.1f} MB"
               + (f"; not shipped: {', '.join(shipped['left_out'])}" if shipped["left_out"] else ""))


# after decode and bench, so --help lists the commands in the order a user meets them
train_cli.register(app)
diffusion_cli.register(app)
index_cli.register(app)


def _error(message: str, code: int) -> int:
    print(f"error: {message}", file=sys.stderr, flush=True)
    return code


def run(argv: list[str] | None = None) -> int:
    """Run the CLI on ``argv``; returns the exit code. Nothing escapes as a traceback."""
    try:
        code = app(args=argv, prog_name="specdec", standalone_mode=False)
    except click_exceptions.NoArgsIsHelpError as exc:
        print(exc.format_message(), file=sys.stderr)
        return 0
    except click_exceptions.UsageError as exc:
        # typer words a rejected value through pydantic ("Value error, ..."): keep the sentence
        return _error(exc.format_message().replace("Value error, ", ""), 2)
    except typer.Exit as exc:
        return exc.exit_code
    except typer.Abort:
        return _error("aborted", 130)
    except SpecdecError as exc:
        return _error(str(exc), exc.exit_code)
    except KeyboardInterrupt:
        return _error("interrupted", 130)
    except MemoryError:
        return _error("out of memory: try a smaller --batch-size or --max-new-tokens", 1)
    except OSError as exc:
        return _error(f"{exc.strerror or exc}{f': {exc.filename}' if getattr(exc, 'filename', None) else ''}", 1)
    except Exception as exc:
        if os.environ.get("SPECDEC_DEBUG"):
            raise
        name = type(exc).__name__
        if "OutOfMemory" in name:
            return _error(f"out of GPU memory ({exc}): try a smaller --batch-size, --dtype bfloat16 or --device-map auto", 1)
        return _error(f"unexpected {name}: {exc} (set SPECDEC_DEBUG=1 for the traceback)", 1)
    return code or 0


def main() -> None:
    sys.exit(run())
