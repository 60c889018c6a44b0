"""CLI commands: train-draft, train-acceptance, train-heads, export (torch is imported lazily).

Each command only declares options and hands off to one library function; a SpecdecError becomes
a clean message and exit code 1 (2 for usage errors). Runs as a module too, which is what
``accelerate launch --multi_gpu --num_processes N -m specdec.cli.train train-draft ...`` needs.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from specdec.decode.artifacts import SpecdecError

RECIPES = Path(__file__).resolve().parent.parent / "recipes"

Data = Annotated[list[Path], typer.Option("--data", help="Training data: JSONL (e.g. the output of specdec decode), Parquet or text; repeat for several files.")]
Target = Annotated[Path, typer.Option("--target", help="The target model directory (HF causal LM with its tokenizer).")]
Out = Annotated[Path, typer.Option("--out", help="Artifact directory to write (checkpoints go under OUT/checkpoints).")]
Recipe = Annotated[Optional[Path], typer.Option("--recipe", help="Recipe YAML (TrainConfig fields; unknown keys are an error). Default: the packaged recipe.")]
MaxSteps = Annotated[Optional[int], typer.Option("--max-steps", help="Optimizer steps (overrides the recipe).")]
Budget = Annotated[Optional[float], typer.Option("--budget-minutes", help="Stop training after this many wall-clock minutes.")]
Resume = Annotated[bool, typer.Option("--resume", help="Continue exactly from the latest checkpoint in OUT.")]
Batch = Annotated[Optional[int], typer.Option("--batch", help="Sequences per process per micro-batch.")]
SeqLen = Annotated[Optional[int], typer.Option("--seq-len", help="Tokens per training block.")]
Lr = Annotated[Optional[float], typer.Option("--lr", help="Peak learning rate.")]
Seed = Annotated[Optional[int], typer.Option("--seed", help="Seed for init, data order and sampling.")]
CkptEvery = Annotated[Optional[int], typer.Option("--checkpoint-every", help="Checkpoint every N optimizer steps (0 = only at the end).")]
Precision = Annotated[Optional[str], typer.Option("--mixed-precision", help="auto (default: bf16 where the hardware has it natively, else fp32), no, bf16 or fp16.")]


def _config(recipe: Path | None, default: str, section: str, **overrides):
    from specdec.train.loop import load_config

    path = recipe or RECIPES / default
    over = {
        "steps": overrides.pop("max_steps", None),
        "budget_minutes": overrides.pop("budget_minutes", None),
        "batch": overrides.pop("batch", None),
        "seq_len": overrides.pop("seq_len", None),
        "lr": overrides.pop("lr", None),
        "seed": overrides.pop("seed", None),
        "checkpoint_every": overrides.pop("checkpoint_every", None),
        "mixed_precision": overrides.pop("mixed_precision", None),
    }
    return load_config(path, over, section=section)


def _run(fn, *args, **kwargs):
    try:
        return fn(*args, **kwargs)
    except SpecdecError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(getattr(exc, "exit_code", 1)) from None


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
    target: Target,
    data: Data,
    out: Out,
    init: Annotated[Optional[Path], typer.Option("--init", help="Start from this causal LM checkpoint (same vocabulary).")] = None,
    arch: Annotated[Optional[str], typer.Option("--arch", help="New small Llama: layers=N,hidden=N,heads=N[,kv_heads=N,ffn=N].")] = None,
    recipe: Recipe = None,
    kd_weight: Annotated[Optional[float], typer.Option("--kd-weight", help="Weight of forward KL to the target (1-W goes to CE; 0 = CE only).")] = None,
    temperature: Annotated[Optional[float], typer.Option("--temperature", help="Distillation temperature.")] = None,
    lora: Annotated[bool, typer.Option("--lora", help="Train a LoRA adapter on the --init draft.")] = False,
    lora_save: Annotated[str, typer.Option("--lora-save", help="merged (plain weights) or adapter (peft adapter dir).")] = "merged",
    cache_teacher: Annotated[Optional[bool], typer.Option("--cache-teacher/--no-cache-teacher", help="Compute the target's top-k logits once, on disk, inside the budget (default: the recipe's).")] = None,
    ce_labels: Annotated[Optional[str], typer.Option("--ce-labels", help="CE term's labels under KD: data (next tokens) or target (the target's greedy tokens). Default: the recipe's.")] = None,
    max_steps: MaxSteps = None,
    budget_minutes: Budget = None,
    resume: Resume = False,
    batch: Batch = None,
    seq_len: SeqLen = None,
    lr: Lr = None,
    seed: Seed = None,
    checkpoint_every: CkptEvery = None,
    mixed_precision: Precision = None,
) -> None:
    """Distil a draft model from the target (forward KL + CE)."""
    from specdec.train.draft import train_draft

    cfg = _run(_config, recipe, "draft.yaml", "draft", max_steps=max_steps, budget_minutes=budget_minutes, batch=batch,
               seq_len=seq_len, lr=lr, seed=seed, checkpoint_every=checkpoint_every, mixed_precision=mixed_precision)
    flags = {"kd_weight": kd_weight, "temperature": temperature, "cache_teacher": cache_teacher, "ce_labels": ce_labels}
    knobs = draft_knobs(cfg.extra) | {k: v for k, v in flags.items() if v is not None}
    metrics = _run(train_draft, target, data, out, cfg, init=init, arch=arch, lora=lora, lora_save=lora_save, resume=resume, **knobs)
    _report(metrics, out, ("heldout_ce", "top1_agreement", "expected_tau", "steps", "stopped"))


def train_acceptance_cmd(
    target: Target,
    draft: Annotated[Path, typer.Option("--draft", help="The draft artifact the heads read.")],
    data: Data,
    out: Out,
    recipe: Recipe = None,
    reject_weight: Annotated[Optional[float], typer.Option("--reject-weight", help="BCE weight of the reject class (sampling head).")] = None,
    greedy_reject_weight: Annotated[Optional[float], typer.Option("--greedy-reject-weight", help="BCE weight of the reject class (greedy head).")] = None,
    greedy_sequences: Annotated[Optional[int], typer.Option("--greedy-sequences", help="Most greedy continuations of the target to label for the greedy head.")] = None,
    temperature: Annotated[Optional[float], typer.Option("--temperature", help="Sampling temperature the sampling head and its default policy are for (decode at it).")] = None,
    policy_prompts: Annotated[Optional[Path], typer.Option("--policy-prompts", help="Prompts JSONL like the ones you will decode: the greedy stop policy is chosen on real rounds over them (default: held-out training text).")] = None,
    max_steps: MaxSteps = None,
    budget_minutes: Budget = None,
    resume: Resume = False,
    batch: Batch = None,
    seq_len: SeqLen = None,
    lr: Lr = None,
    seed: Seed = None,
    checkpoint_every: CkptEvery = None,
    mixed_precision: Precision = None,
) -> None:
    """Train SpecDec++ acceptance heads (sampling and greedy) on the draft's hidden states."""
    from specdec.train.acceptance import train_acceptance

    cfg = _run(_config, recipe, "draft.yaml", "acceptance", max_steps=max_steps, budget_minutes=budget_minutes, batch=batch,
               seq_len=seq_len, lr=lr, seed=seed, checkpoint_every=checkpoint_every, mixed_precision=mixed_precision)
    knobs = acceptance_knobs(cfg.extra)
    if reject_weight is not None:
        knobs["reject_weight"] = reject_weight
    if greedy_reject_weight is not None:
        knobs["greedy_reject_weight"] = greedy_reject_weight
    if greedy_sequences is not None:
        knobs["greedy_sequences"] = greedy_sequences
    if temperature is not None:
        knobs["temperature"] = temperature
    metrics = _run(train_acceptance, target, draft, data, out, cfg, resume=resume, policy_prompts=policy_prompts, **knobs)
    if metrics:
        typer.echo("sampling head: " + _fmt({k: metrics["sampling"][k] for k in ("brier", "brier_constant_baseline", "ece")}), err=True)
        typer.echo("greedy head:   " + _fmt({k: metrics["greedy"][k] for k in ("brier", "brier_constant_baseline", "ece")}), err=True)
        for mode in ("greedy", "sampling"):
            sim = metrics["policy_simulation"][mode]
            typer.echo(f"{mode} default policy: {_fmt(sim['chosen'])} ({sim['chosen_kind']})", err=True)
    _report(metrics, out, ("steps",))


def draft_knobs(extra: dict) -> dict:
    """train_draft's loss keyword arguments from a recipe section's ``extra``."""
    return {"kd_weight": float(extra.get("kd_weight", 0.9)),
            "temperature": float(extra.get("temperature", 1.0)),
            "cache_teacher": bool(extra.get("cache_teacher", False)),
            "ce_labels": str(extra.get("ce_labels", "data"))}


def acceptance_knobs(extra: dict) -> dict:
    """train_acceptance keyword arguments from a recipe section's ``extra``."""
    return {"reject_weight": float(extra.get("reject_weight", 6.0)),
            "target_token_frac": float(extra.get("target_token_frac", 0.15)),
            "temperature": float(extra.get("temperature", 1.0)),
            "greedy_reject_weight": float(extra.get("greedy_reject_weight", 1.0)),
            "greedy_sequences": int(extra.get("greedy_sequences", 1024))}


def train_heads_cmd(
    kind: Annotated[str, typer.Option("--kind", help="medusa, clover or eagle.")],
    target: Target,
    data: Data,
    out: Out,
    num_heads: Annotated[Optional[int], typer.Option("--num-heads", help="Medusa/Clover heads (default 4).")] = None,
    eagle3: Annotated[bool, typer.Option("--eagle3", help="EAGLE: multi-layer features and unrolled training-time steps.")] = False,
    unroll: Annotated[Optional[int], typer.Option("--unroll", help="EAGLE: unrolled training-time steps (1 = EAGLE-1).")] = None,
    recipe: Recipe = None,
    max_steps: MaxSteps = None,
    budget_minutes: Budget = None,
    resume: Resume = False,
    batch: Batch = None,
    seq_len: SeqLen = None,
    lr: Lr = None,
    seed: Seed = None,
    checkpoint_every: CkptEvery = None,
    mixed_precision: Precision = None,
) -> None:
    """Train Medusa / Clover / EAGLE heads on the frozen target."""
    from specdec.train.heads import KINDS, train_heads

    if kind not in KINDS:
        typer.echo(f"error: --kind must be one of {', '.join(KINDS)}", err=True)
        raise typer.Exit(2)
    cfg = _run(_config, recipe, "heads.yaml", kind, max_steps=max_steps, budget_minutes=budget_minutes, batch=batch,
               seq_len=seq_len, lr=lr, seed=seed, checkpoint_every=checkpoint_every, mixed_precision=mixed_precision)
    hp = {"num_heads": num_heads, "unroll": unroll}
    if eagle3:
        hp.update(eagle3=True, feature_layers="eagle3")
    metrics = _run(train_heads, kind, target, data, out, cfg, resume=resume, **hp)
    _report(metrics, out, ("top1_accuracy", "expected_tau", "steps", "stopped"))


def export_cmd(
    src: Annotated[Path, typer.Argument(help="A medusa or eagle artifact directory.")],
    to: Annotated[str, typer.Option("--to", help="hf (the method's own checkpoint layout) or vllm.")],
    out: Annotated[Optional[Path], typer.Option("--out", help="Where to write (default SRC-TO).")] = None,
) -> None:
    """Export a head artifact in the Medusa / EAGLE checkpoint conventions."""
    from specdec.train.heads import export_artifact

    dst = _run(export_artifact, src, out or src.with_name(f"{src.name}-{to}"), to)
    typer.echo(str(dst))


def register(app: typer.Typer) -> None:
    app.command("train-draft")(train_draft_cmd)
    app.command("train-acceptance")(train_acceptance_cmd)
    app.command("train-heads")(train_heads_cmd)
    app.command("export")(export_cmd)


# ---------------------------------------------------------------------------------------------
# Recipe hook: the tiny-stdlib family


def build_drafters_for_recipe(family_dir: Path, train_files: list[Path], budget_minutes: float, seed: int) -> dict:
    """Train every learned drafter of a family from ``family_dir/target`` within ``budget_minutes``.

    First the target's own greedy continuations of code prompts cut from ``train_files`` are written to
    family_dir/data/regen.jsonl (self-distillation, as `specdec decode` writes them), and every drafter
    trains on those: a drafter's job is to predict the target, not the corpus. Writes
    family_dir/{draft, draft-ce, acceptance, medusa, clover, eagle}; draft (KD) and draft-ce (CE only) get
    the same budget and recipe so their tau is comparable. Returns {member: metrics}.
    """
    from specdec.train.acceptance import train_acceptance
    from specdec.train.data import load_texts, self_distill
    from specdec.train.dllm import cut_code_prompts
    from specdec.train.draft import train_draft
    from specdec.train.heads import train_heads
    from specdec.train.loop import load_config

    family_dir = Path(family_dir)
    target = family_dir / "target"
    if not (target / "config.json").exists():
        raise SpecdecError(f"{target} has no config.json: build the target first")
    # the KD / CE pair gets about 1.6 minutes each at the default 20-minute budget: at 1.1 minutes CE's
    # extra steps (no teacher forwards) tie KD at T=0 on this family, from 1.5 minutes KD wins at T=0 and
    # T=0.7 (README, "KD vs CE")
    share = {"regen": 0.08, "draft": 0.3, "draft-ce": 0.3, "acceptance": 0.08, "medusa": 0.05, "clover": 0.06, "eagle": 0.13}
    big = 100_000  # steps: the budget is what stops each run
    results: dict = {}

    texts = load_texts(train_files)
    try:  # code prompts as the held-out ones are cut
        prompts = cut_code_prompts(target, texts, 2048, seed)
    except SpecdecError:  # text that is not Python source: each document's first half
        prompts = [t[: len(t) // 2] for t in texts]
    regen = family_dir / "data" / "regen.jsonl"
    written = self_distill(target, prompts, regen, max(0.75 * budget_minutes * share["regen"], 0.05) * 60)
    results["regen"] = {"prompts": written, "file": str(regen)}
    if written >= 16:  # too few documents for a held-out split: the corpus it is
        train_files = [regen]

    def cfg(recipe: str, section: str, member: str):
        # a fixed share of the whole budget per run (a share of the time *left* starves the last
        # runs when loading and metrics overrun); ~25% is kept for loading, features and metrics
        minutes = max(0.75 * budget_minutes * share[member], 0.05)
        return load_config(RECIPES / recipe, {"steps": big, "seed": seed, "budget_minutes": minutes, "clock_schedule": True,
                                              "heldout": 0.02, "progress": sys.stderr.isatty()}, section=section)

    c = cfg("draft.yaml", "draft", "draft")
    arch = c.extra.get("arch", "layers=2,hidden=128,heads=4")
    # KD and CE-only get the same training minutes so their tau compares at equal training time
    c_ce = load_config(RECIPES / "draft.yaml", {"steps": big, "seed": seed, "budget_minutes": c.budget_minutes,
                                                "clock_schedule": True, "heldout": 0.02, "progress": c.progress}, section="draft")
    results["draft"] = train_draft(target, train_files, family_dir / "draft", c, arch=arch, **draft_knobs(c.extra))
    results["draft-ce"] = train_draft(target, train_files, family_dir / "draft-ce", c_ce, arch=arch, kd_weight=0.0)
    a = cfg("draft.yaml", "acceptance", "acceptance")
    dev = family_dir / "dev_prompts.jsonl"  # held-out prompts kept apart from the benchmark's (recipe.write_prompts)
    results["acceptance"] = train_acceptance(target, family_dir / "draft", train_files, family_dir / "acceptance", a,
                                             policy_prompts=dev if dev.exists() else None, **acceptance_knobs(a.extra))
    for kind in ("medusa", "clover", "eagle"):
        results[kind] = train_heads(kind, target, train_files, family_dir / kind, cfg("heads.yaml", kind, kind))
    return results


def main() -> None:
    app = typer.Typer(add_completion=False, no_args_is_help=True)
    register(app)
    app()


if __name__ == "__main__":
    main()
