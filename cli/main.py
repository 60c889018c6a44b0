"""The ``specdec`` command line. Commands declare options and hand off to one function each;
torch and transformers are imported inside the commands so ``specdec --help`` is instant."""

from __future__ import annotations

import importlib
import sys
from typing import Annotated, Optional

import typer

from specdec.decode.artifacts import SpecdecError

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
    from rich.console import Console

    return Console(stderr=True)


def _fail(exc: SpecdecError) -> typer.Exit:
    _console().print(f"[red]error:[/red] {exc}")
    return typer.Exit(exc.exit_code)


TargetOpt = Annotated[Optional[str], typer.Option("--target", help="Target model dir or default-family member (default: the embedded family's target).")]
DrafterOpt = Annotated[str, typer.Option("--drafter", help="ar, ngram, recycle, layerskip[:i,j], a default-family member (draft, medusa, clover, eagle) or an artifact dir.")]


@app.command()
def decode(
    in_path: Annotated[str, typer.Option("--in", help="Input JSONL ('-' for stdin).")],
    out_path: Annotated[str, typer.Option("--out", help="Output JSONL ('-' for stdout). Re-running resumes it.")] = "-",
    target: TargetOpt = None,
    drafter: DrafterOpt = "ar",
    num_draft: Annotated[Optional[int], typer.Option("--num-draft", "-k", help="Drafted tokens per round (tree nodes for tree drafters).")] = None,
    max_new_tokens: Annotated[int, typer.Option(help="Default new-token budget per record.")] = 128,
    temperature: Annotated[float, typer.Option(help="0 = greedy.")] = 0.0,
    top_p: Annotated[float, typer.Option(help="Nucleus sampling mass.")] = 1.0,
    seed: Annotated[int, typer.Option(help="Sampling seed.")] = 0,
    batch_size: Annotated[int, typer.Option(help="Records decoded together.")] = 8,
    stop: Annotated[Optional[list[str]], typer.Option("--stop", help="Stop string (repeatable).")] = None,
    strict: Annotated[bool, typer.Option(help="Stop at the first bad record.")] = False,
    overwrite: Annotated[bool, typer.Option(help="Start --out over instead of resuming it.")] = False,
    acceptance: Annotated[Optional[str], typer.Option(help="Acceptance-head artifact: adaptive draft length (SpecDec++).")] = None,
    stop_threshold: Annotated[Optional[float], typer.Option(help="Adaptive drafting stops when 1 - prod(P_accept) exceeds this (default: the acceptance artifact's policy for the decode mode).")] = None,
    min_draft: Annotated[Optional[int], typer.Option(help="Adaptive drafting: fewest drafts per round; 0 lets a round draft nothing (default: the artifact's policy).")] = None,
    max_draft: Annotated[Optional[int], typer.Option(help="Adaptive drafting: most drafts per round (default: the artifact's policy).")] = None,
    tree: Annotated[str, typer.Option(help="Tree drafters: static or dynamic (EAGLE-2).")] = "static",
    tree_tokens: Annotated[Optional[int], typer.Option(help="Tree drafters: nodes per tree.")] = None,
    strategy: Annotated[str, typer.Option(help="Diffusion targets: static, threshold, factor, localleap, credit, entropy, learn2pd, freedave; options as in bench specs (threshold+tau=0.8).")] = "static",
    adablock: Annotated[bool, typer.Option(help="Diffusion targets: adaptive block ends at a confident newline (AdaBlock).")] = False,
    gen_length: Annotated[Optional[int], typer.Option(help="Diffusion targets: tokens to generate (default --max-new-tokens).")] = None,
    block_size: Annotated[int, typer.Option(help="Diffusion targets: block length.")] = 32,
    steps: Annotated[Optional[int], typer.Option(help="Diffusion targets: steps for static (default: one token per step).")] = None,
    cache: Annotated[str, typer.Option(help="Diffusion targets: none, prefix or dual (approximate).")] = "none",
    filter_dir: Annotated[Optional[str], typer.Option("--filter", help="Diffusion targets: Learn2PD filter artifact.")] = None,
    kernels: Annotated[str, typer.Option(help="auto, triton or torch.")] = "auto",
    threads: Annotated[int, typer.Option(help="CPU intra-op threads (0: one; small models decode fastest single-threaded).")] = 0,
    dtype: Annotated[str, typer.Option(help="float32, bfloat16, float16.")] = "float32",
    trust_remote_code: Annotated[bool, typer.Option(help="Allow the checkpoint's own Python code (off by default).")] = False,
) -> None:
    """Decode a JSONL file of prompts: one output line per input line, in order, resumable."""
    from specdec.decode.job import print_summary, run_decode_job
    from specdec.decode.loading import DecodeOptions

    console = _console()
    opts = DecodeOptions(
        drafter=drafter, num_draft=num_draft, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
        seed=seed, batch_size=batch_size, stop=list(stop or []), acceptance=acceptance, stop_threshold=stop_threshold,
        min_draft=min_draft, max_draft=max_draft, tree=tree, tree_tokens=tree_tokens, strategy=strategy,
        gen_length=gen_length, block_size=block_size, steps=steps, cache=cache, filter=filter_dir, adablock=adablock, kernels=kernels,
        threads=threads, dtype=dtype, trust_remote_code=trust_remote_code,
    )
    try:
        summary, code = run_decode_job(in_path, out_path, target, opts, strict=strict, overwrite=overwrite, console=console)
    except SpecdecError as exc:
        raise _fail(exc)
    print_summary(summary, console)
    raise typer.Exit(code)


@app.command()
def bench(
    in_path: Annotated[str, typer.Option("--in", help="Prompts JSONL (with optional category).")] = "examples/prompts.jsonl",
    target: TargetOpt = None,
    methods: Annotated[str, typer.Option(help="Comma-separated method specs, e.g. ar,ngram,draft+k=4,hf-assisted:draft,hf-lookup.")] = "ar,ngram,recycle,draft",
    max_new_tokens: Annotated[int, typer.Option(help="New tokens per prompt.")] = 128,
    temperature: Annotated[float, typer.Option(help="0 = greedy.")] = 0.0,
    batch_size: Annotated[int, typer.Option(help="Batch size for specdec methods (peers run at bs=1).")] = 1,
    repeats: Annotated[int, typer.Option(help="Timed passes, each decoding every prompt with every method, interleaved batch by batch; speedup is the median of per-pass ratios to ar.")] = 1,
    warmup: Annotated[int, typer.Option(help="Warm-up prompts per method before timing.")] = 2,
    limit: Annotated[Optional[int], typer.Option(help="Use only the first N prompts.")] = None,
    json_path: Annotated[Optional[str], typer.Option("--json", help="Write the JSON report here.")] = None,
    plot: Annotated[Optional[str], typer.Option(help="Write a PNG plot (speedup and tau per method and category).")] = None,
    kernels: Annotated[str, typer.Option(help="auto, triton or torch.")] = "auto",
    threads: Annotated[int, typer.Option(help="CPU intra-op threads for every method (0: one).")] = 0,
    trust_remote_code: Annotated[bool, typer.Option(help="Allow the checkpoint's own Python code.")] = False,
    device: Annotated[str, typer.Option(help="Where the models run: cpu, cuda, cuda:N.")] = "cpu",
) -> None:
    """Benchmark methods against plain decoding (and peers) in one process, on the same prompts."""
    from specdec.decode.bench import BenchConfig, render, run_bench

    console = _console()
    cfg = BenchConfig(
        in_path=in_path, target=target, methods=[m for m in methods.split(",") if m], max_new_tokens=max_new_tokens,
        temperature=temperature, batch_size=batch_size, repeats=repeats, warmup=warmup, limit=limit,
        kernels=kernels, threads=threads, trust_remote_code=trust_remote_code, device=device,
    )
    try:
        report = run_bench(cfg, console)
    except SpecdecError as exc:
        raise _fail(exc)
    render(report, console, json_path, plot)


@recipe_app.command("list")
def recipe_list() -> None:
    """List the recipes that ship with specdec."""
    from specdec.recipes import list_recipes

    for name in list_recipes():
        typer.echo(name)


@recipe_app.command("run")
def recipe_run(
    name: Annotated[str, typer.Argument(help="Recipe name (see `specdec recipe list`).")],
    budget_minutes: Annotated[Optional[float], typer.Option(help="Wall-clock budget for the whole recipe.")] = None,
    force: Annotated[bool, typer.Option(help="Rebuild members that are already cached.")] = False,
    only: Annotated[Optional[list[str]], typer.Option(help="Stages to run: target, prompts, drafters, dllm.")] = None,
) -> None:
    """Build a model family into $SPECDEC_HOME/<name>/ (cached members are kept)."""
    import json

    from specdec.train.recipe import run_recipe

    console = _console()
    try:
        report = run_recipe(name, budget_minutes=budget_minutes, force=force, only=only, console=console)
    except SpecdecError as exc:
        raise _fail(exc)
    console.print_json(json.dumps(report, default=str))


def _register_optional(module: str) -> None:
    """Command groups living in their own modules register themselves on the app."""
    try:
        mod = importlib.import_module(module)
    except ImportError:
        return
    mod.register(app)


for _module in ("specdec.cli.train", "specdec.cli.diffusion"):
    _register_optional(_module)


def main() -> None:
    try:
        app()
    except SpecdecError as exc:  # errors raised outside a command body
        _console().print(f"[red]error:[/red] {exc}")
        sys.exit(exc.exit_code)
