"""The command-line options every command shares, declared once: the same name, type and help on
``decode``, ``bench`` and every ``train-*`` command. Enumerated options are Enums, so a bad value is
a usage error (exit 2) before anything loads. The decode options' values are checked by
``decode.jobs.validate`` (with the placement's, ``models.loading.Placement``), not here."""

from __future__ import annotations

import dataclasses
import functools
import inspect
import typing
from enum import Enum
from pathlib import Path
from typing import Annotated, Optional

import typer


class Kernels(str, Enum):
    auto = "auto"
    triton = "triton"
    torch = "torch"


class Dtype(str, Enum):
    auto = "auto"
    bfloat16 = "bfloat16"
    float16 = "float16"
    float32 = "float32"


class DeviceMap(str, Enum):
    auto = "auto"


class Precision(str, Enum):
    auto = "auto"
    no = "no"
    bf16 = "bf16"
    fp16 = "fp16"


class DiffusionCache(str, Enum):
    none = "none"
    prefix = "prefix"
    dual = "dual"


Target = Annotated[Optional[str], typer.Option("--target", help="Model folder, hub id or default-family member (default: the embedded family's target).")]
TargetRequired = Annotated[str, typer.Option("--target", help="Model folder, hub id or default-family member.")]
Device = Annotated[str, typer.Option("--device", help="auto (CUDA when present), cpu, cuda or cuda:N.")]
DtypeOpt = Annotated[Dtype, typer.Option("--dtype", help="auto: the checkpoint's dtype on a GPU, float32 on a CPU without native bf16.")]
DeviceMapOpt = Annotated[Optional[DeviceMap], typer.Option("--device-map", help="auto: spread a target too large for one GPU over all visible GPUs (accelerate).")]
AttnImpl = Annotated[Optional[str], typer.Option("--attn-implementation", help="sdpa, eager or flex_attention (default: the model's own choice).")]
TrustRemoteCode = Annotated[bool, typer.Option("--trust-remote-code", help="Allow the checkpoint's own Python code (off by default).")]
Compile = Annotated[str, typer.Option("--compile", help="Decode steps over preallocated key/value buffers: graphs (CUDA graphs of the eager kernels, recorded in a forward per shape), inductor (torch.compile, a minute or more per shape), off, or auto (graphs on a GPU, off on a CPU).")]
Threads = Annotated[int, typer.Option("--threads", help="CPU intra-op threads (0: follow the load, the cores other processes keep busy left to them; one thread for forwards under 1.2M parameters x rows).")]
Weights = Annotated[str, typer.Option("--weights", help="auto: a GGUF target's layers multiply by the file's quantised blocks on a CPU (the same weights, 4-7x fewer bytes a token); float32: by the converted float32 weights.")]
DrafterOpt = Annotated[str, typer.Option("--drafter", help="auto (the default: the fastest lossless method measured for the target's family, else ngram; the job says which), ar, ngram, recycle, copy, input-copy, aded, stand, retrieval:INDEX, layerskip[:i,j], swift, trimmed[:PATH], a default-family member (draft, medusa, clover, eagle) or an artifact folder; approximate modes: superposed, ead:DRAFT, skipdecode[:FIRST,LAST], an lud artifact.")]
KernelsOpt = Annotated[Kernels, typer.Option("--kernels", help="Verification and tree-attention kernels: auto (Triton on CUDA), triton or torch.")]
BatchSize = Annotated[int, typer.Option("--batch-size", help="Rows decoded together (training: sequences per process per micro-batch).")]
MaxNewTokens = Annotated[int, typer.Option("--max-new-tokens", help="New-token budget per record.")]
Temperature = Annotated[float, typer.Option("--temperature", help="0 = greedy.")]
TopP = Annotated[float, typer.Option("--top-p", help="Nucleus sampling mass, in (0, 1].")]
Seed = Annotated[int, typer.Option("--seed", help="Seed for sampling (training: init, data order).")]
NumSamples = Annotated[int, typer.Option("--num-samples", help="Independent samples per prompt (needs --temperature > 0), decoded as rows of one batch: drafters such as stand share what they learn between them. With --drafter superposed: its k drafts (greedy).")]
Data = Annotated[list[Path], typer.Option("--data", help="Training data: JSONL (e.g. the output of specdec decode), Parquet or text; repeat for several files.")]
OutDir = Annotated[Path, typer.Option("--out", help="Artifact folder to write (checkpoints go under OUT/checkpoints).")]
DraftVocab = Annotated[Optional[int], typer.Option("--draft-vocab", min=0, help="Draft only the N - 1 most frequent tokens of the training data (a draft-to-target id map in the artifact): the target's output layer is read at N rows; verification stays exact. Default: 32768 for a target of 65536 tokens or more (a new draft or heads), the whole vocabulary otherwise; 0: the whole vocabulary.")]
Recipe = Annotated[Optional[Path], typer.Option("--recipe", help="Recipe YAML (training-config fields; unknown keys are an error). Default: the packaged recipe.")]
MaxSteps = Annotated[Optional[int], typer.Option("--max-steps", min=1, help="Optimizer steps (overrides the recipe).")]
Budget = Annotated[Optional[float], typer.Option("--budget-minutes", min=0.0, help="Stop training after this many wall-clock minutes.")]
Resume = Annotated[bool, typer.Option("--resume", help="Continue exactly from the latest complete checkpoint in OUT.")]
TrainBatch = Annotated[Optional[int], typer.Option("--batch-size", min=1, help="Sequences per process per micro-batch.")]
SeqLen = Annotated[Optional[int], typer.Option("--seq-len", min=2, help="Tokens per training block.")]
Lr = Annotated[Optional[float], typer.Option("--lr", min=0.0, help="Peak learning rate.")]
TrainSeed = Annotated[Optional[int], typer.Option("--seed", help="Seed for init, data order and sampling.")]
CkptEvery = Annotated[Optional[int], typer.Option("--checkpoint-every", min=0, help="Checkpoint every N optimizer steps (0 = only at the end).")]
MixedPrecision = Annotated[Optional[Precision], typer.Option("--mixed-precision", help="auto (bf16 where the hardware has it natively, else fp32), no, bf16 or fp16.")]


def placement(device: str, dtype: Dtype, device_map: DeviceMap | None, attn_implementation: str | None, trust_remote_code: bool, threads: int):
    """The shared placement options as ``models.loading.Placement`` (validated there)."""
    from specdec.models.loading import Placement

    return Placement(device, dtype.value, device_map.value if device_map else None, attn_implementation, trust_remote_code, threads)


def console():
    """The console progress, tables and summaries go to: stderr, so stdout carries only JSONL."""
    import sys

    from rich.console import Console

    # a log or a pipe has no width: rich's default of 80 columns folds bench's tables into slivers
    return Console(stderr=True, width=None if sys.stderr.isatty() else 160)


def declared_flags(cls, exclude: tuple = (), unset: bool = False):
    """A command decorator: the fields of ``cls`` (a piece of ``decode.options``, a trainer's settings) that
    declare their help become the command's flags, each made from its one declaration (name, type,
    default, choices, help, short alias); the command takes them as keyword arguments (``**declared`` in
    its signature). So a new drafting option is a field in ``DraftingOptions`` and nothing here.
    ``unset``: every flag defaults to None (a switch is ``--x/--no-x``), so the command tells what was given
    from what a recipe or the settings' defaults fill in."""
    from specdec.decode.options import flag

    hints = typing.get_type_hints(cls)
    made, choice_enums = [], set()
    for f in dataclasses.fields(cls):
        help_text = f.metadata.get("help")
        if not help_text or f.name in exclude:
            continue
        typ, choices = hints[f.name], f.metadata.get("choices")
        args = typing.get_args(typ)
        optional = type(None) in args
        base = next(a for a in args if a is not type(None)) if optional else typ
        if choices:  # a choice is refused by the CLI itself, its values listed in --help
            base = Enum(f"{f.name.title().replace('_', '')}Choice", [(c, c) for c in choices], type=str)
            choice_enums.add(f.name)
        names = [flag(f.name)] + ([f.metadata["short"]] if f.metadata.get("short") else [])
        if unset and base is bool:
            names[0] = f"{names[0]}/--no-{names[0][2:]}"
        annotation = Annotated[Optional[base] if optional or unset else base, typer.Option(*names, help=help_text)]
        made.append(inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=None if unset else f.default,
                                      annotation=annotation))

    def wrap(fn):
        own = [p for p in inspect.signature(fn, eval_str=True).parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
        own = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in own]

        @functools.wraps(fn)
        def command(**kwargs):
            for name in choice_enums:
                if isinstance(kwargs.get(name), Enum):
                    kwargs[name] = kwargs[name].value
            return fn(**kwargs)

        params = own + made
        command.__signature__ = inspect.Signature(params)
        command.__annotations__ = {p.name: p.annotation for p in params}
        del command.__wrapped__  # typer reads the signature above, not the function's own
        return command

    return wrap
