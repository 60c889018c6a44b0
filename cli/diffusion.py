"""CLI commands for masked-diffusion LMs: train-dllm and train-filter.

Commands only declare options and hand off to the library; torch, transformers and datasets are
imported inside the command bodies so ``specdec --help`` stays instant.
"""

from __future__ import annotations

import json
from enum import Enum
from pathlib import Path
from typing import Annotated, Optional

import typer

from specdec.cli import options as o
from specdec.models.errors import SpecdecError, UsageError


class DllmAttention(str, Enum):
    block = "block"
    bidirectional = "bidirectional"


class LabelCache(str, Enum):
    none = "none"
    prefix = "prefix"


# the shared --checkpoint-every with a trainer's own default (the recipes set theirs)
CkptEvery = Annotated[int, typer.Option("--checkpoint-every", min=0, help="Checkpoint every N optimizer steps under OUT/checkpoints (0 = only at the end); --resume goes on from the newest complete one.")]


def register(app: typer.Typer) -> None:
    app.command("train-dllm", help="Turn an AR checkpoint into a masked-diffusion LM (or train one from a config).")(train_dllm_command)
    app.command("train-filter", help="Train a Learn2PD filter for a dLLM (used by --strategy learn2pd --filter DIR).")(train_filter_command)


def train_dllm_command(
    out: Annotated[Path, typer.Option("--out", help="Output directory for the dLLM.")],
    data: Annotated[list[Path], typer.Option("--data", help="JSONL (prompt[+completion] or text) or plain-text file; repeat for more.")],
    from_dir: Annotated[Optional[Path], typer.Option("--target", help="The AR checkpoint to adapt (or a dLLM, for --certainty-forcing).")] = None,
    config: Annotated[Optional[Path], typer.Option("--config", help="JSON LlamaConfig kwargs: train from scratch instead of --target.")] = None,
    tokenizer: Annotated[Optional[Path], typer.Option("--tokenizer", help="Tokenizer directory when training from --config.")] = None,
    block_size: Annotated[int, typer.Option(help="Block size of block diffusion (and of decoding).")] = 32,
    attention: Annotated[DllmAttention, typer.Option("--attention", help="block (block diffusion) or bidirectional.")] = DllmAttention.block,
    max_steps: Annotated[int, typer.Option(help="Optimizer steps at most.")] = 500,
    budget_minutes: Annotated[Optional[float], typer.Option(help="Stop after this many minutes.")] = None,
    list_tasks: Annotated[int, typer.Option(help="Add this many generated list tasks (copy/reverse/sort) to the mix.")] = 0,
    certainty_forcing: Annotated[bool, typer.Option("--certainty-forcing", help="dParallel certainty-forcing distillation of --target (a dLLM).")] = False,
    lora: Annotated[bool, typer.Option("--lora", help="Train a LoRA (merged into the saved model).")] = False,
    cf_prompts: Annotated[int, typer.Option(help="Certainty forcing: code prompts cut from --data whose own answers are distilled.")] = 256,
    gen_length: Annotated[int, typer.Option(help="Certainty forcing: answer length of the self-generated decodes (decode at this length).")] = 128,
    cf_cache: Annotated[LabelCache, typer.Option(help="Certainty forcing: cache of the self-generating static decodes (none, or prefix: same result up to rounding under block attention, much faster).")] = LabelCache.none,
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
) -> None:
    from specdec.train.trainers.dllm import train_dllm
    from specdec.train.listtasks import list_tasks as make_list_tasks

    if (from_dir is None) == (config is None):
        raise UsageError("give exactly one of --target DIR or --config FILE")
    place = o.placement(device, dtype, device_map, attn_implementation, trust_remote_code, threads)
    try:
        model_config = json.loads(config.read_text()) if config is not None else None
        extra = [(t.prompt, t.completion) for t in make_list_tasks(list_tasks, seed=seed)]
        metrics = train_dllm(
            from_dir, data, out, block_size=block_size, attention=attention.value, max_steps=max_steps, budget_minutes=budget_minutes,
            seed=seed, certainty_forcing=certainty_forcing, lora=lora, extra_examples=extra, model_config=model_config, tokenizer_dir=tokenizer,
            cf_prompts=cf_prompts, cf_gen_length=gen_length, cf_cache=cf_cache.value, placement=place, resume=resume,
            checkpoint_every=checkpoint_every, **training_overrides(lr=lr, batch_size=batch_size, seq_len=seq_len,
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
    gen_length: Annotated[int, typer.Option(help="Answer length of the labelling decodes.")] = 128,
    block_size: Annotated[int, typer.Option(help="Decode block size (the filter's width).")] = 32,
    hidden: Annotated[int, typer.Option(help="0: logistic regression; >0: MLP hidden size.")] = 0,
    max_steps: Annotated[int, typer.Option(help="Optimizer steps at most.")] = 2000,
    budget_minutes: Annotated[Optional[float], typer.Option(help="Stop after this many minutes.")] = None,
    code_prompts: Annotated[int, typer.Option(help="Cut this many code prompts (64-256 tokens, as the held-out prompts) from --data's texts instead of using them as prompts.")] = 0,
    cache: Annotated[LabelCache, typer.Option(help="Cache of the labelling decodes (none, or prefix: same result up to rounding under block attention, much faster).")] = LabelCache.none,
    seed: Annotated[int, typer.Option(help="Random seed.")] = 0,
    resume: o.Resume = False,
    checkpoint_every: CkptEvery = 500,
    device: o.Device = "auto",
    dtype: o.DtypeOpt = o.Dtype.auto,
    device_map: o.DeviceMapOpt = None,
    attn_implementation: o.AttnImpl = None,
    trust_remote_code: o.TrustRemoteCode = False,
    threads: o.Threads = 0,
) -> None:
    from specdec.train.prompts import cut_code_prompts
    from specdec.train.trainers.filter import train_filter

    place = o.placement(device, dtype, device_map, attn_implementation, trust_remote_code, threads)
    prompts = read_prompts(data)
    if code_prompts:
        prompts = cut_code_prompts(dllm, prompts, code_prompts, seed)
    metrics = train_filter(
        dllm, prompts, out, gen_length=gen_length, block_size=block_size, hidden=hidden, max_steps=max_steps,
        budget_minutes=budget_minutes, seed=seed, cache=cache.value, placement=place, resume=resume, checkpoint_every=checkpoint_every,
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
