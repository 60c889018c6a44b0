"""CLI commands: train-draft, train-acceptance, train-heads, train-lud, export, plan (torch is imported lazily).

Each command only declares options and hands off to one library function; errors reach the one
boundary in ``cli.main``. Under several processes: ``accelerate launch --num_processes N -m specdec
train-draft ...``.
"""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import Annotated, Optional

import typer

from specdec.cli import options as o
from specdec.recipes import RECIPES_DIR as RECIPES
from specdec.train.settings import HEAD_KINDS, RIDING_KINDS

# the kinds train.settings declares (a light module: --help stays free of torch)
HeadKind = Enum("HeadKind", {k.replace("-", "_"): k for k in HEAD_KINDS + RIDING_KINDS}, type=str)


class ExportTo(str, Enum):
    hf = "hf"
    vllm = "vllm"
    speculators = "speculators"
    eagle = "eagle"
    gguf = "gguf"


class LawForm(str, Enum):
    sigmoid = "sigmoid"
    log_linear = "log-linear"


def _config(recipe: Path | None, default: str, section: str, **overrides):
    from specdec.train.loop import load_config

    path = recipe or RECIPES / default
    over = {
        "steps": overrides.pop("max_steps", None),
        "budget_minutes": overrides.pop("budget_minutes", None),
        "batch": overrides.pop("batch", None),  # --batch-size
        "seq_len": overrides.pop("seq_len", None),
        "lr": overrides.pop("lr", None),
        "seed": overrides.pop("seed", None),
        "checkpoint_every": overrides.pop("checkpoint_every", None),
        "mixed_precision": overrides.pop("mixed_precision", None),
    }
    return load_config(path, over, section=section)


def _report(metrics: dict, out: Path, keys: tuple[str, ...]) -> None:
    if not metrics:  # non-main processes of a distributed run
        return
    shown = {k: metrics[k] for k in keys if k in metrics}
    typer.echo(f"wrote {out}: " + ", ".join(f"{k}={_fmt(v)}" for k, v in shown.items()), err=True)


def _fmt(v):
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k}: {_fmt(x)}" for k, x in v.items()) + "}"
    if isinstance(v, list):
        return "[" + ", ".join(_fmt(x) for x in v) + "]"
    return str(v)


def train_draft_cmd(
    data: o.Data,
    out: o.OutDir,
    target: Annotated[Optional[str], typer.Option("--target", help="Model folder, hub id or default-family member.")] = None,
    targets: Annotated[Optional[str], typer.Option("--targets", help="S2D: comma-separated targets sharing one tokenizer; one sorted draft serves each with its first layers (instead of --target).")] = None,
    s2d_depths: Annotated[Optional[str], typer.Option("--s2d-depths", help="S2D: comma-separated depth (draft layers) per --targets entry (default: by target size, the largest gets every layer).")] = None,
    recipe: o.Recipe = None,
    draft_vocab: o.DraftVocab = None,
    max_steps: o.MaxSteps = None,
    budget_minutes: o.Budget = None,
    resume: o.Resume = False,
    batch_size: o.TrainBatch = None,
    seq_len: o.SeqLen = None,
    lr: o.Lr = None,
    seed: o.TrainSeed = None,
    checkpoint_every: o.CkptEvery = None,
    mixed_precision: o.MixedPrecision = None,
    device: o.Device = "auto",
    dtype: o.DtypeOpt = o.Dtype.auto,
    device_map: o.DeviceMapOpt = None,
    attn_implementation: o.AttnImpl = None,
    trust_remote_code: o.TrustRemoteCode = False,
    threads: o.Threads = 0,
    **settings,
) -> None:
    """Distil a draft model from the target (forward KL + CE)."""
    from specdec.models.errors import UsageError
    from specdec.train.trainers.draft import train_draft
    from specdec.train.recipe import draft_knobs

    if (target is None) == (targets is None):
        raise UsageError("give --target, or --targets A,B,... (S2D: one sorted draft for several targets)")
    chosen = [t.strip() for t in targets.split(",") if t.strip()] if targets is not None else target
    depths = None
    if s2d_depths is not None:
        if targets is None:
            raise UsageError("--s2d-depths goes with --targets")
        try:
            depths = [int(d) for d in s2d_depths.split(",") if d.strip()]
        except ValueError:
            raise UsageError(f"--s2d-depths: integers are needed, not {s2d_depths!r}") from None
    given = {k: v for k, v in settings.items() if v is not None}
    if not given.get("long_context") and ("window" in given or "sinks" in given):
        raise UsageError("--window and --sinks go with --long-context")

    cfg = _config(recipe, "draft.yaml", "draft", max_steps=max_steps, budget_minutes=budget_minutes, batch=batch_size,
                  seq_len=seq_len, lr=lr, seed=seed, checkpoint_every=checkpoint_every,
                  mixed_precision=mixed_precision.value if mixed_precision else None)
    place = o.placement(device, dtype, device_map, attn_implementation, trust_remote_code, threads)
    knobs = draft_knobs(cfg.extra) | given  # the flags given, over the recipe's settings
    metrics = train_draft(chosen, data, out, cfg, resume=resume, placement=place, draft_vocab=draft_vocab, s2d_depths=depths,
                          **{k: str(v) if isinstance(v, Path) else v for k, v in knobs.items()})
    _report(metrics, out, ("heldout_ce", "top1_agreement", "expected_tau", "steps", "stopped"))


def train_acceptance_cmd(
    target: o.TargetRequired,
    draft: Annotated[Path, typer.Option("--draft", help="The draft artifact the heads read.")],
    data: o.Data,
    out: o.OutDir,
    recipe: o.Recipe = None,
    max_steps: o.MaxSteps = None,
    budget_minutes: o.Budget = None,
    resume: o.Resume = False,
    batch_size: o.TrainBatch = None,
    seq_len: o.SeqLen = None,
    lr: o.Lr = None,
    seed: o.TrainSeed = None,
    checkpoint_every: o.CkptEvery = None,
    mixed_precision: o.MixedPrecision = None,
    device: o.Device = "auto",
    dtype: o.DtypeOpt = o.Dtype.auto,
    device_map: o.DeviceMapOpt = None,
    attn_implementation: o.AttnImpl = None,
    trust_remote_code: o.TrustRemoteCode = False,
    threads: o.Threads = 0,
    **settings,
) -> None:
    """Train SpecDec++ acceptance heads (sampling and greedy) on the draft's hidden states."""
    from specdec.train.trainers.acceptance import train_acceptance
    from specdec.train.recipe import acceptance_knobs

    cfg = _config(recipe, "draft.yaml", "acceptance", max_steps=max_steps, budget_minutes=budget_minutes, batch=batch_size,
                  seq_len=seq_len, lr=lr, seed=seed, checkpoint_every=checkpoint_every,
                  mixed_precision=mixed_precision.value if mixed_precision else None)
    place = o.placement(device, dtype, device_map, attn_implementation, trust_remote_code, threads)
    knobs = acceptance_knobs(cfg.extra) | {k: str(v) if isinstance(v, Path) else v for k, v in settings.items() if v is not None}
    metrics = train_acceptance(target, draft, data, out, cfg, resume=resume, placement=place, **knobs)
    if metrics:
        typer.echo("sampling head: " + _fmt({k: metrics["sampling"][k] for k in ("brier", "brier_constant_baseline", "ece")}), err=True)
        typer.echo("greedy head:   " + _fmt({k: metrics["greedy"][k] for k in ("brier", "brier_constant_baseline", "ece")}), err=True)
        for mode in ("greedy", "sampling"):
            sim = metrics["policy_simulation"][mode]
            typer.echo(f"{mode} default policy: {_fmt(sim['chosen'])} ({sim['chosen_kind']})", err=True)
    _report(metrics, out, ("steps",))


def train_heads_cmd(
    kind: Annotated[HeadKind, typer.Option("--kind", help="medusa, clover, eagle, chimera, block (all K drafts of a round "
                "in one draft forward on the target's features, as DFlash), ppd (parallel prompt decoding: trained prompt embeddings) or hidden-transfer (linear maps of an intermediate layer's hidden states); ppd and "
                "hidden-transfer draft chains at positions riding the verify forward, --num-heads of them (default 3).")],
    target: o.TargetRequired,
    data: o.Data,
    out: o.OutDir,
    draft_vocab: o.DraftVocab = None,
    recipe: o.Recipe = None,
    max_steps: o.MaxSteps = None,
    budget_minutes: o.Budget = None,
    resume: o.Resume = False,
    batch_size: o.TrainBatch = None,
    seq_len: o.SeqLen = None,
    lr: o.Lr = None,
    seed: o.TrainSeed = None,
    checkpoint_every: o.CkptEvery = None,
    mixed_precision: o.MixedPrecision = None,
    device: o.Device = "auto",
    dtype: o.DtypeOpt = o.Dtype.auto,
    device_map: o.DeviceMapOpt = None,
    attn_implementation: o.AttnImpl = None,
    trust_remote_code: o.TrustRemoteCode = False,
    threads: o.Threads = 0,
    **settings,
) -> None:
    """Train Medusa / Clover / EAGLE / Chimera heads or a block drafter on the frozen target."""
    from specdec.train.recipe import head_knobs
    from specdec.train.trainers.heads import train_heads

    kind = kind.value
    given = {k: v for k, v in settings.items() if v is not None}
    if "fspad_align" in given:
        given.setdefault("fspad", True)  # an alignment asks for FSPAD
    if draft_vocab is not None:
        given["draft_vocab"] = draft_vocab
    cfg = _config(recipe, "heads.yaml", kind, max_steps=max_steps, budget_minutes=budget_minutes, batch=batch_size,
                  seq_len=seq_len, lr=lr, seed=seed, checkpoint_every=checkpoint_every,
                  mixed_precision=mixed_precision.value if mixed_precision else None)
    place = o.placement(device, dtype, device_map, attn_implementation, trust_remote_code, threads)
    knobs = head_knobs(cfg.extra) | given  # the flags given, over the recipe's settings
    if kind in ("eagle", "block") and knobs.get("layout") is None and not knobs.get("fspad"):
        knobs["layout"] = "published"  # what a user trains exports to the serving engines without a flag
    metrics = train_heads(kind, target, data, out, cfg, resume=resume, placement=place, **knobs)
    _report(metrics, out, ("top1_accuracy", "expected_tau", "steps", "stopped"))


def train_lud_cmd(
    target: o.TargetRequired,
    data: o.Data,
    out: o.OutDir,
    recipe: o.Recipe = None,
    max_steps: o.MaxSteps = None,
    budget_minutes: o.Budget = None,
    resume: o.Resume = False,
    batch_size: o.TrainBatch = None,
    seq_len: o.SeqLen = None,
    lr: o.Lr = None,
    seed: o.TrainSeed = None,
    checkpoint_every: o.CkptEvery = None,
    mixed_precision: o.MixedPrecision = None,
    device: o.Device = "auto",
    dtype: o.DtypeOpt = o.Dtype.auto,
    device_map: o.DeviceMapOpt = None,
    attn_implementation: o.AttnImpl = None,
    trust_remote_code: o.TrustRemoteCode = False,
    threads: o.Threads = 0,
    **declared,
) -> None:
    """Fine-tune the target with LoRA to predict lexical units of several tokens (Lexical Unit Decoding)."""
    from specdec.train.settings import LudSettings
    from specdec.train.trainers.lud import train_lud

    given = {k: v for k, v in declared.items() if v is not None}
    LudSettings(**given).check()  # a bad value is refused before the target loads

    cfg = _config(recipe, "lud.yaml", "lud", max_steps=max_steps, budget_minutes=budget_minutes, batch=batch_size,
                  seq_len=seq_len, lr=lr, seed=seed, checkpoint_every=checkpoint_every,
                  mixed_precision=mixed_precision.value if mixed_precision else None)
    place = o.placement(device, dtype, device_map, attn_implementation, trust_remote_code, threads)
    metrics = train_lud(target, data, out, cfg, resume=resume, placement=place, **given)
    _report(metrics, out, ("unit_accuracy", "unit_ce", "steps", "stopped"))


def export_cmd(
    src: Annotated[Path, typer.Argument(help="A medusa, eagle or block artifact directory.")],
    to: Annotated[ExportTo, typer.Option("--to", help="hf (the method's own checkpoint layout), vllm, speculators (EAGLE-3 "
                  "heads, and block drafters as DFlash checkpoints: the format vLLM loads), eagle (EAGLE-1 / EAGLE-3 as SafeAILab EAGLE and SpecForge write them) or "
                  "gguf (EAGLE-3 heads as one llama.cpp draft file: llama-server -m TARGET.gguf -md DRAFT.gguf --spec-type "
                  "draft-eagle3); speculators, eagle and gguf take drafters trained with --layout published (the default).")],
    out: Annotated[Optional[Path], typer.Option("--out", help="Where to write (default SRC-TO; --to gguf: SRC.gguf).")] = None,
    target: Annotated[Optional[Path], typer.Option("--target", help="--to gguf: the target's GGUF file, whose tokenizer the "
                      "draft carries (default: the file the head's target was converted from).")] = None,
) -> None:
    """Export a head artifact in the Medusa / EAGLE / speculators (EAGLE-3, DFlash) checkpoint conventions, or as a llama.cpp GGUF draft."""
    from specdec.train.trainers.heads import export_artifact

    default = src.with_name(f"{src.name}.gguf" if to is ExportTo.gguf else f"{src.name}-{to.value}")
    dst = export_artifact(src, out or default, to.value, target)
    typer.echo(str(dst))


def plan_cmd(
    target: o.TargetRequired,
    data: Annotated[Optional[list[Path]], typer.Option("--data", help="Train quick drafts on this text (JSONL, Parquet or text; repeatable), one per --sizes, at equal small budgets.")] = None,
    sizes: Annotated[Optional[str], typer.Option("--sizes", help="The quick drafts' sizes as --arch strings, ';' between them (a repeated key also starts a new size), e.g. 'layers=1,hidden=64,heads=2;layers=2,hidden=128,heads=4' (default: three sizes from layers=1,hidden=64 to layers=4,hidden=256).")] = None,
    artifacts: Annotated[Optional[str], typer.Option("--artifacts", help="Comma-separated train-draft artifact folders whose metrics (parameters, training tokens, held-out agreement) are the points, instead of --data.")] = None,
    budget_minutes: Annotated[Optional[float], typer.Option("--budget-minutes", min=0.0, help="Each quick draft's training budget (default 1 minute unless --max-steps is given).")] = None,
    max_steps: o.MaxSteps = None,
    batch_size: Annotated[int, typer.Option("--batch-size", min=1, help="Rows decoded together: the costs are measured at it.")] = 1,
    train_budget_minutes: Annotated[Optional[float], typer.Option("--train-budget-minutes", help="The real draft's training budget: acceptance is predicted at the tokens it buys at the measured training rate (default: the points' median training time).")] = None,
    law: Annotated[LawForm, typer.Option("--law", help="sigmoid: a = sigmoid(alpha + beta ln N + gamma ln D); log-linear: the same line clipped to (0, 1).")] = LawForm.sigmoid,
    repeats: Annotated[int, typer.Option("--repeats", min=1, help="Timed forwards per measured cost (the median is kept).")] = 10,
    drafts_dir: Annotated[Optional[Path], typer.Option("--drafts-dir", help="Keep the quick drafts here (default: a temporary folder, removed).")] = None,
    out: Annotated[Optional[str], typer.Option("--out", help="Write the JSON report here.")] = None,
    plot: Annotated[Optional[str], typer.Option("--plot", help="Write a PNG plot: acceptance against size with the fit, and expected speedup against k.")] = None,
    recipe: o.Recipe = None,
    seed: o.TrainSeed = None,
    device: o.Device = "auto",
    dtype: o.DtypeOpt = o.Dtype.auto,
    device_map: o.DeviceMapOpt = None,
    attn_implementation: o.AttnImpl = None,
    trust_remote_code: o.TrustRemoteCode = False,
    threads: o.Threads = 0,
) -> None:
    """Recommend a draft size, draft length and the expected speedup: fit acceptance against draft size and training tokens, time the forwards here."""
    import importlib.util

    from specdec.bench.report import cli_command
    from specdec.decode.jobs.validate import validate_output_path
    from specdec.models.errors import UsageError
    from specdec.train.plan import PlanConfig, parse_sizes, plot as draw, run_plan, summary_line, table
    from specdec.train.recipe import draft_knobs

    dirs = [a.strip() for a in (artifacts or "").split(",") if a.strip()]
    if artifacts is not None and not dirs:
        raise UsageError("--artifacts names no folder")
    if artifacts is not None and (budget_minutes is not None or max_steps is not None or drafts_dir is not None or recipe is not None):
        raise UsageError("--budget-minutes, --max-steps, --drafts-dir and --recipe set the quick drafts trained on --data, not --artifacts")
    for flag, path in (("--out", out), ("--plot", plot)):
        if path:
            validate_output_path(path, flag)
    if plot and importlib.util.find_spec("matplotlib") is None:
        raise UsageError("--plot needs matplotlib, which is not installed (pip install matplotlib)")
    cfg = PlanConfig(target=target, data=list(data or []), sizes=parse_sizes(sizes) if sizes is not None else [], artifacts=dirs,
                     batch_size=batch_size, train_budget_minutes=train_budget_minutes, form=law.value, repeats=repeats,
                     drafts_dir=drafts_dir, placement=o.placement(device, dtype, device_map, attn_implementation, trust_remote_code, threads),
                     command=cli_command())
    if cfg.data:
        if budget_minutes is None and max_steps is None:
            budget_minutes = 1.0
        train_cfg = _config(recipe, "draft.yaml", "draft", max_steps=max_steps, budget_minutes=budget_minutes, seed=seed,
                            checkpoint_every=0)
        train_cfg.save_final_checkpoint = False  # quick drafts: no resume
        cfg.train_config, cfg.knobs = train_cfg, draft_knobs(train_cfg.extra)
    console = o.console()
    report = run_plan(cfg, say=lambda text: console.print(f"[dim]{text}[/dim]"))
    console.print(table(report))
    for note in report["notes"]:
        console.print(f"note: {note}")
    if plot:
        draw(report, plot)
        console.print(f"plot written to {plot}")
    if out:
        from specdec.models.artifacts import write_json

        write_json(out, report)
        console.print(f"report written to {out}")
    typer.echo(summary_line(report))


def register(app: typer.Typer) -> None:
    from specdec.train.settings import AcceptanceSettings, DraftSettings, HeadSettings, LudSettings

    app.command("train-draft")(o.declared_flags(DraftSettings, unset=True)(train_draft_cmd))
    app.command("train-acceptance")(o.declared_flags(AcceptanceSettings, unset=True)(train_acceptance_cmd))
    app.command("train-heads")(o.declared_flags(HeadSettings, unset=True)(train_heads_cmd))
    app.command("train-lud")(o.declared_flags(LudSettings, unset=True)(train_lud_cmd))
    app.command("export")(export_cmd)
    app.command("plan")(plan_cmd)
