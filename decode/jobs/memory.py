"""A memory model of speculative decoding, and fitting a decode job into ``--max-memory`` (SpecMemo).

What a job holds, by the model's own arithmetic (``param_bytes`` / ``kv_bytes_per_token``):

- the weights, once: the target's and the drafter's own modules (a draft model, heads); parameters
  the drafter shares with the target (layer-skip views) are counted once;
- per row: the KV cache of ``prompt + max_new_tokens + width`` tokens for the target, and for the
  draft model if there is one (capped at the model's context: the engine never caches past it);
  the verify forward's logits, ``width x vocab`` float32; and its hidden states (``width x hidden``
  per layer read) when the drafter reads them (Medusa, Clover, EAGLE).

``width`` is the verify forward's token count: root + drafts, i.e. K+1 for chains, tree tokens + 1
for head trees, K x siblings + 1 for RSD/SpecTr trees. Activations of the forwards themselves,
the transient copy of the cache when continuous batching admits rows, and small drafter caches not
exposed as ``drafter.model`` (SWIFT's layer-skip views, EAGLE's one-layer cache) are not counted:
the model is a lower bound of the working set, not an allocator trace.

``decode`` does not know the prompts when it sizes the job (stdin can be read once), so its prompt
bound is the longest prompt the job accepts, the model's context (``max_position_embeddings``):
every row is costed at the full context. Honest for any input, pessimistic for short prompts.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from specdec.decode.engine.types import Scheme
from specdec.models.errors import SpecdecError, UsageError

_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30, "TIB": 1 << 40}
_SIZE = re.compile(r"(\d+(?:\.\d+)?)\s*([A-Za-z]+)")


def parse_size(text: str, flag: str = "--max-memory") -> int:
    """``4GiB``, ``800MB``, ``512MiB``, ``1.5GiB`` -> bytes. A unit is required (a bare ``4`` could mean
    bytes or GiB); anything else, or a size under one byte, is a ``UsageError``."""
    m = _SIZE.fullmatch(str(text).strip())
    unit = m.group(2).upper() if m else None
    if unit not in _UNITS:
        raise UsageError(f"{flag} must be a size such as 4GiB, 800MB or 512MiB (units: B, KB, MB, GB, TB, KiB, MiB, GiB, TiB), got {text!r}")
    size = int(float(m.group(1)) * _UNITS[unit])
    if size < 1:
        raise UsageError(f"{flag} must be more than 0 bytes, got {text!r}")
    return size


def param_bytes(model) -> int:
    """Bytes of the weights the model holds."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


def kv_bytes_per_token(model) -> int:
    """Bytes of keys and values one token adds to the cache, over every layer."""
    cfg = model.config
    layers = int(getattr(cfg, "num_hidden_layers", 0) or 0)
    heads = int(getattr(cfg, "num_attention_heads", 1) or 1)
    kv_heads = int(getattr(cfg, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads)
    element = next(model.parameters()).element_size()
    return 2 * layers * kv_heads * head_dim * element


def fmt_size(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


def weight_bytes(model, drafter=None) -> int:
    """Target + drafter parameters, each tensor once (a layer-skip view shares the target's)."""
    seen, total = set(), 0
    for module in [model, *(drafter.modules() if drafter is not None else [])]:
        for p in module.parameters():
            key = (p.data_ptr(), p.numel())
            if key not in seen:
                seen.add(key)
                total += p.numel() * p.element_size()
    return total


def draft_width(drafter, num_draft: int | None, tree_tokens: int | None = None) -> int:
    """Tokens in one verify forward (root included) for the drafter at ``num_draft`` / ``tree_tokens``."""
    if drafter is None:
        return 1
    if drafter.tree_tokens is not None:  # head trees: the tree's size, whatever the depth
        return 1 + int(tree_tokens if tree_tokens is not None else drafter.tree_tokens)
    k = drafter.default_k if num_draft is None else num_draft
    if drafter.scheme != Scheme.standard:  # RSD/SpecTr: K levels of ``width`` siblings
        return 1 + k * max(1, int(drafter.width))
    return 1 + k


@dataclass(frozen=True)
class MemoryModel:
    weights: int  # bytes, target + drafter
    kv_target: int  # bytes per cached token
    kv_draft: int  # bytes per cached token of a draft model (0: none)
    tokens: int  # prompt bound + max_new_tokens per row, before the draft width
    context: int  # the model's context: no row caches more
    vocab: int
    hidden: int  # bytes per verify token of hidden states the drafter reads (0: none)

    def row_bytes(self, width: int) -> int:
        cached = min(self.tokens + width, self.context)
        return cached * (self.kv_target + self.kv_draft) + width * self.vocab * 4 + width * self.hidden

    def total(self, batch: int, width: int) -> int:
        return self.weights + batch * self.row_bytes(width)


def memory_model(model, drafter, prompt_tokens: int, max_new_tokens: int) -> MemoryModel:
    cfg = model.config
    draft = drafter.model
    kv_draft = kv_bytes_per_token(draft) if draft is not None and draft is not model else 0
    hidden = 0
    if drafter.needs_hidden or drafter.hidden_layers:
        layers = 1 + len(drafter.hidden_layers or ())
        hidden = layers * cfg.hidden_size * next(model.parameters()).element_size()
    context = int(getattr(cfg, "max_position_embeddings", None) or 1 << 30)
    return MemoryModel(weight_bytes(model, drafter), kv_bytes_per_token(model), kv_draft, prompt_tokens + max_new_tokens,
                       context, int(cfg.vocab_size), hidden)


@dataclass(frozen=True)
class MemoryPlan:
    batch_size: int
    num_draft: int | None  # the engine's K (None: the drafter's default, unchanged)
    tree_tokens: int | None  # head trees' size (None: unchanged)
    needed: int  # bytes the plan needs by the model
    note: str


def fit(budget: int, mm: MemoryModel, drafter, batch_size: int, num_draft: int | None, label: str) -> MemoryPlan:
    """The largest batch size <= ``batch_size`` whose rows fit ``budget`` at the drafter's draft width;
    when not even one row fits, the tree tokens (head trees) or K (other drafters) shrink, down to 1,
    until one does. Raises ``SpecdecError`` when nothing fits, saying what is needed."""
    tree = drafter.tree_tokens is not None
    k0 = drafter.default_k if num_draft is None else num_draft
    size0 = drafter.tree_tokens if tree else k0
    width = lambda size: draft_width(drafter, size, size) if size else 1  # noqa: E731
    rows = lambda size: max(0, budget - mm.weights) // mm.row_bytes(width(size))  # noqa: E731
    size = size0
    if rows(size) < 1 and size0:
        # shrinking draws fewer tokens per round but keeps decoding lossless (any draft length verifies exactly)
        size = next((s for s in range(size0 - 1, 0, -1) if rows(s) >= 1), 0)
    if rows(size) < 1 or (size == 0 and size0):
        smallest = mm.total(1, width(min(size0, 1)))
        what = (f"the weights alone take {fmt_size(mm.weights)}" if mm.weights >= budget else
                f"one row needs {fmt_size(mm.row_bytes(width(min(size0, 1))))} beside {fmt_size(mm.weights)} of weights")
        raise SpecdecError(f"--max-memory {label} is too small: {what}; at least {fmt_size(smallest)} is needed")
    batch = int(min(batch_size, rows(size)))
    changes = [f"batch size {batch_size} -> {batch}" if batch != batch_size else f"batch size {batch}"]
    if size != size0:
        changes.append(f"{'tree tokens' if tree else 'K'} {size0} -> {size}")
    needed = mm.total(batch, width(size))
    note = f"note: --max-memory {label}: {', '.join(changes)} (needs {fmt_size(needed)} by the memory model, rows costed at {min(mm.tokens + width(size), mm.context)} tokens)"
    return MemoryPlan(batch, size if (not tree and size != size0) else num_draft, size if tree and size != size0 else None, needed, note)
