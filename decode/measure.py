"""Measurements that benchmarks, the planner and recipes share: what one engine forward costs, and how
much of a set of outputs loops."""

from __future__ import annotations

import contextlib
import statistics
import time

import torch


def time_forward(model, prefix: list[int], t: int, repeats: int, batch_size: int = 1, compile: str = "off",
                 lean: bool = False, greedy: bool | None = None, kernels: str = "torch") -> float:
    """Median seconds of one forward of ``t`` tokens per row, ``batch_size`` rows each after a cache
    holding ``prefix``, run as the engine runs it (``KVState``: compiled steps with ``compile`` and the
    engine's resolved ``kernels``, a draft's lean forward with ``lean``), after three warm-up forwards. The forward is not committed,
    so every repeat writes the same slots. With ``greedy`` True the time includes what a greedy verification reads
    of the logits, each position's argmax, as the engine takes it (``decode.engine.verify``)."""
    from specdec.decode.engine.cache import KVState
    from specdec.decode.engine.verify import argmax

    device = next(model.parameters()).device
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)  # time the kernels, not their launch
    times = []
    from specdec.models import head

    # inputs made under inference mode, as the engine's are: a compiled step guards on it; the output layer
    # as the engine runs it (greedy None: as plain nn.Linear, as transformers runs it)
    scope = head.scope(model, greedy) if greedy is not None else contextlib.nullcontext()
    with torch.inference_mode(), scope:
        ids = torch.tensor([prefix], device=device).expand(batch_size, -1)
        step = ids[:, :t] if t <= ids.shape[1] else ids[:, :1].repeat(1, t)
        state = KVState(model, batch_size, device, lean=lean, compile=compile, kernels=kernels)
        state.forward(ids, logits_to_keep=1)
        state.commit_prefix(ids.shape[1], torch.ones_like(ids, dtype=torch.bool))
        for i in range(3 + repeats):
            sync()
            t0 = time.perf_counter()
            out = state.forward(step)
            if greedy:
                argmax(out.logits)
            sync()
            if i >= 3:
                times.append(time.perf_counter() - t0)
    return statistics.median(times)


def distinct_ngram_ratio(token_lists: list[list[int]], n: int = 4) -> float:
    """Distinct n-grams over all n-grams, each output counted on its own: text that loops scores low."""
    grams, total = set(), 0
    for toks in token_lists:
        for i in range(len(toks) - n + 1):
            grams.add((id(toks), tuple(toks[i : i + n])))
            total += 1
    return len(grams) / total if total else 0.0
