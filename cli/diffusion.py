"""CLI commands for masked-diffusion LMs: train-dllm and train-filter.

Commands only declare options and hand off to the library; torch, transformers and datasets are
imported inside the command bodies so ``specdec --help`` stays instant.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer

from specdec.cli import options as o
from specdec.models.errors import SpecdecError, UsageError


# the shared --checkpoint-every with a trainer's own default (the recipes set theirs)
CkptEvery = Annotated[int, typer.Option("--checkpoint-every", min=0, help="Checkpoint every N optimizer steps under OUT/checkpoints (0 = only at the end); --resume goes on from the newest complete one.")]


def register(app: typer.Typer) -> None:
    from specdec.train.settings import DllmSettings, FilterSettings

    app.command("train-dllm", help="Turn an AR checkpoint into a masked-diffusion LM (or train one from a config).")(
        o.declared_flags(DllmSettings)(train_dllm_command))
    app.command("train-filter", help="Train a Learn2PD filter for a dLLM (used by --strategy learn2pd --filter DIR).")(
        o.declared_flags(FilterSettings)(train_filter_command))


def train_dllm_command(
    out: Annotated[Path, typer.Option("--out", help="Output directory for the dLLM.")],
    data: Annotated[list[Path], typer.Option("--data", help="JSONL (prompt[+completion] or text) or plain-text file; repeat for more.")],
    from_dir: Annotated[Optional[Path], typer.Option("--target", help="The AR checkpoint to adapt (or a dLLM, for --certainty-forcing).")] = None,
    config: Annotated[Optional[Path], typer.Option("--config", help="JSON LlamaConfig kwargs: train from scratch instead of --target.")] = None,
    tokenizer: Annotated[Optional[Path], typer.Option("--tokenizer", help="Tokenizer directory when training from --config.")] = None,
    max_steps: Annotated[int, typer.Option(help="Optimizer steps at most.")] = 500,
    budget_minutes: Annotated[Optional[float], typer.Option(help="Stop after this many minutes.")] = None,
    lr: Annotated[Optional[float], typer.Option(help="Peak learning rate (default 3e-4).")] = None,
    batch_size: o.TrainBatch = None,
    seq_len: o.SeqLen = None,
    mixed_precision: o.MixedPrecision = None,
    seed: Annotated[int, typer.Option(help="Random seed.")] = 0,
    resume: o.Resume = False,
    checkpoint_every: CkptEvery = 100,
    device: o.Device = "auto",
    dtype: o.DtypeOpt = o.Dtype.auto,
    device_map: o.DeviceMapOpt = None,
    attn_implementation: o.AttnImpl = None,
    trust_remote_code: o.TrustRemoteCode = False,
    threads: o.Threads = 0,
    **declared,
) -> None:
    from specdec.train.listtasks import list_tasks as make_list_tasks
    from specdec.train.settings import DllmSettings
    from specdec.train.trainers.dllm import train_dllm

    settings = DllmSettings(**declared)
    settings.check()
    if (from_dir is None) == (config is None):
        raise UsageError("give exactly one of --target DIR or --config FILE")
    place = o.placement(device, dtype, device_map, attn_implementation, trust_remote_code, threads)
    try:
        model_config = json.loads(config.read_text()) if config is not None else None
        extra = [(t.prompt, t.completion) for t in make_list_tasks(settings.list_tasks, seed=seed)]
        metrics = train_dllm(
            from_dir, data, out, max_steps=max_steps, budget_minutes=budget_minutes, seed=seed, extra_examples=extra,
            model_config=model_config, tokenizer_dir=tokenizer, placement=place, resume=resume, checkpoint_every=checkpoint_every,
            **settings.kwargs(), **training_overrides(lr=lr, batch_size=batch_size, seq_len=seq_len,
                                                      mixed_precision=mixed_precision.value if mixed_precision else None),
        )  # fmt: skip
    except json.JSONDecodeError as exc:
        raise UsageError(f"--config {config}: not valid JSON ({exc})") from None
    typer.echo(
        f"wrote {out}: {metrics['steps']} steps, loss {metrics['loss_first']:.4f} -> {metrics['loss_last']:.4f}, "
        f"held-out masked CE {_fmt(metrics['heldout_masked_ce_before'])} -> {_fmt(metrics['heldout_masked_ce'])}"
    )


def train_filter_command(
    dllm: Annotated[Path, typer.Option("--target", help="The dLLM the filter is for.")],
    data: Annotated[Path, typer.Option("--data", help="prompts.jsonl: one {\"prompt\": ...} per line (texts with --code-prompts).")],
    out: Annotated[Path, typer.Option("--out", help="Output directory for the filter.")],
    max_steps: Annotated[int, typer.Option(help="Optimizer steps at most.")] = 2000,
    budget_minutes: Annotated[Optional[float], typer.Option(help="Stop after this many minutes.")] = None,
    seed: Annotated[int, typer.Option(help="Random seed.")] = 0,
    resume: o.Resume = False,
    checkpoint_every: CkptEvery = 500,
    device: o.Device = "auto",
    dtype: o.DtypeOpt = o.Dtype.auto,
    device_map: o.DeviceMapOpt = None,
    attn_implementation: o.AttnImpl = None,
    trust_remote_code: o.TrustRemoteCode = False,
    threads: o.Threads = 0,
    **declared,
) -> None:
    from specdec.train.prompts import cut_code_prompts
    from specdec.train.settings import FilterSettings
    from specdec.train.trainers.filter import train_filter

    settings = FilterSettings(**declared)
    settings.check()
    place = o.placement(device, dtype, device_map, attn_implementation, trust_remote_code, threads)
    prompts = read_prompts(data)
    if settings.code_prompts:
        prompts = cut_code_prompts(dllm, prompts, settings.code_prompts, seed)
    metrics = train_filter(
        dllm, prompts, out, max_steps=max_steps, budget_minutes=budget_minutes, seed=seed, placement=place, resume=resume,
        checkpoint_every=checkpoint_every, **settings.kwargs(),
    )  # fmt: skip
    held = metrics["heldout"]
    typer.echo(
        f"wrote {out}: {metrics['records']} labelled steps, BCE {metrics['loss_first']:.4f} -> {metrics['loss_last']:.4f}, "
        f"held-out precision {_fmt(held.get('precision'))} recall {_fmt(held.get('recall'))}"
    )


def training_overrides(**values) -> dict:
    """The shared training options the user gave (the rest keep the trainer's defaults)."""
    return {k: v for k, v in values.items() if v is not None}


def read_prompts(path: Path) -> list[str]:
    from datasets import load_dataset

    if not path.is_file():
        raise UsageError(f"no such prompts file: {path}")
    prompts = [row["prompt"] for row in load_dataset("json", data_files=str(path), split="train") if row.get("prompt")]
    if not prompts:
        raise SpecdecError(f"{path} has no records with a prompt")
    return prompts


def _fmt(x) -> str:
    return "n/a" if x is None else f"{x:.4f}"
