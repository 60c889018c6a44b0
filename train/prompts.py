"""Code prompts cut from Python source: the one definition of specdec's prompt distribution (the
held-out benchmark prompts, the dev prompts kept apart from them, and the training prompts that
self-distillation and dLLM distillation answer)."""

from __future__ import annotations

import math
import random
import re

from specdec.models.errors import SpecdecError


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


def code_prompts(tokenizer, texts: list[str], n: int, seed: int, min_tokens: int = 64, max_tokens: int = 256) -> list[str]:
    """``n`` prompts cut from training texts as the recipe cuts its held-out prompts (examples/prompts.jsonl):
    a prefix of ``min_tokens``..``max_tokens`` tokens ending at a function header and its first body line,
    a docstring opening or a data literal, the three kinds in turn."""
    order = list(range(len(texts)))
    random.Random(seed).shuffle(order)
    found = anchored_prompts(((i, texts[i]) for i in order), tokenizer, math.ceil(n / len(_ANCHORS)), min_tokens, max_tokens)
    return [prompt for _, _, _, prompt in found][:n]


def cut_code_prompts(model_dir, texts: list[str], n: int, seed: int) -> list[str]:
    """``code_prompts`` with the tokenizer of the model in ``model_dir`` (a dLLM, or the AR target); an
    error when none can be cut."""
    from transformers import AutoTokenizer

    prompts = code_prompts(AutoTokenizer.from_pretrained(model_dir), texts, n, seed)
    if not prompts:
        raise SpecdecError("no code prompts could be cut from --data: it needs Python source texts")
    return prompts
