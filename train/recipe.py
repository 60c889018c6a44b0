"""The ``tiny-stdlib`` recipe: build the embedded default family under $SPECDEC_HOME.

Stages are cached: a member whose folder holds metrics.json is not rebuilt (``force`` rebuilds).
Each stage gets a share of the wall-clock budget from the recipe YAML.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass, field, fields
from pathlib import Path

import yaml

from specdec.decode.artifacts import SpecdecError, family_dir, write_json
from specdec.recipes import recipe_path


@dataclass
class RecipeConfig:
    name: str
    seed: int = 0
    budget_minutes: float = 20.0
    shares: dict = field(default_factory=lambda: {"target": 0.48, "drafters": 0.3, "dllm": 0.2})
    tokenizer: dict = field(default_factory=dict)
    target: dict = field(default_factory=dict)
    training: dict = field(default_factory=dict)
    heldout_fraction: float = 0.03
    eval_prompts: int = 16
    eval_new_tokens: int = 128

    @classmethod
    def load(cls, path: Path, **overrides) -> "RecipeConfig":
        raw = yaml.safe_load(path.read_text()) or {}
        known = {f.name for f in fields(cls)}
        unknown = set(raw) - known
        if unknown:
            raise SpecdecError(f"{path}: unknown recipe keys {sorted(unknown)}")
        raw.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**raw)


def log(console, msg: str) -> None:
    if console is not None:
        console.print(msg)


def run_recipe(name: str, budget_minutes: float | None = None, force: bool = False, only: list[str] | None = None, console=None) -> dict:
    cfg = RecipeConfig.load(recipe_path(name), budget_minutes=budget_minutes)
    if cfg.name != "tiny-stdlib":
        raise SpecdecError(f"recipe {cfg.name!r} has no builder")
    fam = family_dir(cfg.name)
    fam.mkdir(parents=True, exist_ok=True)
    budget_s = cfg.budget_minutes * 60
    start = time.perf_counter()
    report: dict = {"recipe": cfg.name, "budget_minutes": cfg.budget_minutes}
    want = set(only or ["target", "prompts", "drafters", "dllm"])

    from specdec.train.corpus import stdlib_corpus

    corpus = stdlib_corpus(cfg.heldout_fraction)
    if "target" in want:
        report["target"] = build_target(cfg, corpus, fam / "target", cfg.shares["target"] * budget_s, force, console)
    if "prompts" in want or ("drafters" in want and not (fam / "dev_prompts.jsonl").exists()):
        write_prompts(corpus, fam / "target", fam / "prompts.jsonl")
        write_list_task_probes(fam / "list_tasks.jsonl")
    data = write_training_text(corpus, fam / "data" / "train.jsonl")
    if "drafters" in want:
        report["drafters"] = _stage(
            "drafters", fam, force, console,
            lambda: _hook("specdec.cli.train", "build_drafters_for_recipe")(
                fam, [data], cfg.shares["drafters"] * cfg.budget_minutes, cfg.seed
            ),
            members=("draft", "draft-ce", "acceptance", "medusa", "clover", "eagle"),
        )
    if "dllm" in want:
        texts = [json.loads(line)["prompt"] for line in data.read_text().splitlines()]
        report["dllm"] = _stage(
            "dllm", fam, force, console,
            lambda: _hook("specdec.train.dllm", "build_for_recipe")(
                fam / "target", fam, texts, cfg.shares["dllm"] * cfg.budget_minutes, cfg.seed
            ),
            members=("dllm",),
        )
    report["wall_s"] = round(time.perf_counter() - start, 1)
    write_json(fam / "recipe_report.json", report)
    return report


def _stage(name, fam: Path, force: bool, console, build, members) -> dict:
    if not force and all((fam / m / "metrics.json").exists() for m in members):
        log(console, f"[dim]{name}: cached in {fam}[/dim]")
        return {"cached": True}
    log(console, f"[bold]{name}[/bold]: building")
    try:
        return build()
    except ImportError as exc:  # a stage whose code is not in this checkout
        log(console, f"[yellow]{name}: skipped ({exc})[/yellow]")
        return {"skipped": str(exc)}


def _hook(module: str, func: str):
    import importlib

    mod = importlib.import_module(module)
    if not hasattr(mod, func):
        raise ImportError(f"{module}.{func} is missing")
    return getattr(mod, func)


def build_target(cfg: RecipeConfig, corpus, out: Path, budget_s: float, force: bool, console) -> dict:
    if (out / "metrics.json").exists() and not force:
        log(console, f"[dim]target: cached in {out}[/dim]")
        return json.loads((out / "metrics.json").read_text())
    import torch

    from specdec.train.lm import TargetArch, build_model, pretrain, save_target, token_blocks, train_tokenizer

    torch.manual_seed(cfg.seed)
    t0 = time.perf_counter()
    log(console, f"[bold]target[/bold]: tokenizer on {len(corpus.train_files)} stdlib files")
    tok = train_tokenizer(corpus, out, **cfg.tokenizer)
    seq_len = cfg.training.get("seq_len", 512)
    train_blocks = token_blocks(tok, corpus.train_files, corpus, seq_len)
    heldout_blocks = token_blocks(tok, corpus.heldout_files, corpus, seq_len)
    arch = TargetArch(**cfg.target)
    model = build_model(arch, tok)
    n_params = sum(p.numel() for p in model.parameters())
    remaining = max(budget_s - (time.perf_counter() - t0), 30.0)
    log(console, f"target: {n_params / 1e6:.2f}M parameters, {len(train_blocks)} blocks of {seq_len}, {remaining:.0f}s")
    stats = pretrain(  # shows run_training's progress bar on stderr
        model,
        train_blocks,
        heldout_blocks,
        budget_s=remaining,
        lr=cfg.training.get("lr", 3e-3),
        batch_size=cfg.training.get("batch_size", 16),
        seed=cfg.seed,
        progress=console is not None,
    )
    model = model.float().eval()
    metrics = {
        "parameters": n_params,
        **stats,
        "heldout_files": len(corpus.heldout_files),
        "wall_s": round(time.perf_counter() - t0, 1),
    }
    metrics.update(evaluate_continuations(model, tok, corpus, cfg.eval_prompts, cfg.eval_new_tokens))
    save_target(model, tok, out, metrics, arch)
    write_json(out / "corpus_split.json", corpus.manifest())
    log(console, f"target: held-out loss {metrics['heldout_loss']:.3f}, distinct-4 {metrics['distinct4']:.3f}")
    return metrics


def evaluate_continuations(model, tok, corpus, n: int, new_tokens: int) -> dict:
    from specdec.decode.engine import SpecEngine
    from specdec.decode.types import GenRequest
    from specdec.train.lm import distinct_ngram_ratio

    prompts = held_out_prompts(corpus, tok, per_category=max(1, n // 3))[:n]
    engine = SpecEngine(model, tok)
    results = engine.generate([GenRequest(tok(p["prompt"])["input_ids"], new_tokens) for p in prompts])
    return {"distinct4": round(distinct_ngram_ratio([r.token_ids for r in results]), 4), "eval_prompts": len(prompts)}


# -- held-out prompts -------------------------------------------------------------------------

_ANCHORS = {
    "docstring": re.compile(r'^\s*[ru]?"""(?!.*""")\s*\w.*$'),  # opens a docstring, prose follows
    "data": re.compile(r"^\s*\w[\w.]*\s*=\s*[\[{(]\s*$"),
    "code": re.compile(r"^\s*(async\s+)?def \w+\(.*\)\s*(->.*)?:\s*$"),
}


def held_out_prompts(corpus, tok, per_category: int = 16, lo: int = 64, hi: int = 256) -> list[dict]:
    """Prefixes of held-out files ending at a function body, a docstring or a data literal."""
    sources = ((path, corpus.read(path)) for path in corpus.heldout_files)
    out, numbered = [], {k: 0 for k in _ANCHORS}
    for cat, path, line, text in anchored_prompts(sources, tok, per_category, lo, hi):
        numbered[cat] += 1
        out.append({"id": f"{cat}-{numbered[cat]:02d}", "category": cat, "prompt": text,
                    "source": f"{path.relative_to(corpus.root)}:{line + 1}"})
    return out


def anchored_prompts(sources, tok, per_kind: int, lo: int = 64, hi: int = 256, kinds=tuple(_ANCHORS)) -> list[tuple[str, object, int, str]]:
    """(kind, source, line index, prompt) for up to ``per_kind`` prompts of each anchor kind, cut from
    ``sources`` ((source, text) pairs, read lazily: it stops once every kind is full) as a prefix of
    ``lo``..``hi`` tokens ending at a function header and its first body line, a docstring opening or
    a data literal; the kinds in turn. The one definition of specdec's prompt distribution (the
    held-out prompts, and the training prompts that dLLM distillation answers)."""
    anchors = {k: _ANCHORS[k] for k in kinds}
    found: dict[str, list] = {k: [] for k in anchors}
    for source, text in sources:
        lines = text.splitlines(keepends=True)
        used_until = -1
        for i, line in enumerate(lines):
            for kind, pattern in anchors.items():
                if len(found[kind]) >= per_kind or i <= used_until or not pattern.match(line):
                    continue
                prompt = _prefix(lines, i + (2 if kind == "code" else 1), tok, lo, hi)
                if prompt is None:
                    continue
                found[kind].append((kind, source, i, prompt))
                used_until = i + 40  # spread prompts over the text
        if all(len(v) >= per_kind for v in found.values()):
            break
    return [found[kind][i] for i in range(per_kind) for kind in anchors if i < len(found[kind])]


def _prefix(lines: list[str], end: int, tok, lo: int, hi: int) -> str | None:
    start = end
    text = ""
    while start > 0:
        cand = "".join(lines[start - 1 : end])
        n = len(tok(cand)["input_ids"])
        if n > hi:
            break
        start -= 1
        text = cand
        if n >= lo and lines[start].strip() == "":
            break
    n = len(tok(text)["input_ids"]) if text else 0
    return text if lo <= n <= hi else None


def dev_prompts(corpus, tok, bench: list[dict], per_category: int = 8, distance: int = 120, lo: int = 64, hi: int = 256) -> list[dict]:
    """Held-out prompts of the benchmark's kinds, each anchored at least ``distance`` lines from every
    benchmark prompt's anchor: what a trainer tunes a choice on (train-acceptance --policy-prompts)
    without seeing the benchmark. Each kind is scanned on its own, up to ``per_category``, at most two
    from a file."""
    taken: dict[str, list[int]] = {}
    for p in bench:
        source, line = p["source"].rsplit(":", 1)
        taken.setdefault(source, []).append(int(line) - 1)
    out = []
    for kind in _ANCHORS:
        sources = ((path, corpus.read(path)) for path in corpus.heldout_files)
        found, per_file = [], {}
        for _, path, line, text in anchored_prompts(sources, tok, 10 * per_category, lo, hi, kinds=(kind,)):
            name = str(path.relative_to(corpus.root))
            if per_file.get(name, 0) < 2 and all(abs(line - b) >= distance for b in taken.get(name, [])):
                per_file[name] = per_file.get(name, 0) + 1  # at most two a file: spread over the held-out files
                found.append({"id": f"dev-{kind}-{len(found) + 1:02d}", "category": kind, "prompt": text, "source": f"{name}:{line + 1}"})
        out += found[:per_category]
    return out


def write_prompts(corpus, target_dir: Path, out: Path, per_category: int = 16) -> Path:
    """The benchmark's held-out prompts to ``out``, and dev prompts kept apart from them to dev_prompts.jsonl
    beside it."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(target_dir)
    prompts = held_out_prompts(corpus, tok, per_category)
    out.write_text("".join(json.dumps(p) + "\n" for p in prompts))
    dev = dev_prompts(corpus, tok, prompts)
    (out.parent / "dev_prompts.jsonl").write_text("".join(json.dumps(p) + "\n" for p in dev))
    return out


def write_list_task_probes(out: Path, n: int = 48, seed: int = 0) -> Path:
    """Held-out list tasks (copy / reverse / sort) with answers: the dLLM's offline quality probes."""
    from specdec.train.listtasks import list_tasks

    tasks = list_tasks(n, seed=seed, split="heldout")
    out.write_text("".join(json.dumps(t.record(i)) + "\n" for i, t in enumerate(tasks)))
    return out


def write_training_text(corpus, out: Path, chunk_chars: int = 2000, max_chunks: int = 4000) -> Path:
    """Training files cut into chunks, as JSONL records with a prompt (what train-* commands read)."""
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    records = []
    for path in corpus.train_files:
        text = corpus.read(path)
        for i in range(0, len(text), chunk_chars):
            records.append({"prompt": text[i : i + chunk_chars]})
    step = max(1, len(records) // max_chunks)
    out.write_text("".join(json.dumps(r) + "\n" for r in records[::step][:max_chunks]))
    return out
