"""How every bench times its methods: interleaved passes, per-pass ratios to a reference, the median.

Each of ``repeats`` passes decodes every prompt with every method, a chunk of prompts (one batch) at a
time, every method in turn on that chunk with the order rotating, so a shared machine's drifting speed
hits all methods alike. A method's speedup is the median over passes of its tokens/s over the
reference method's tokens/s in the same pass (or of the wall times' ratio, see ``speedup``).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Callable


@dataclass
class Run:
    """One method's timed passes: outputs and stats of the last pass, the wall times of every pass."""

    outputs: list  # token lists per prompt
    stats: list  # per-prompt stats dicts
    walls: list  # seconds per pass
    record_walls: list = field(default_factory=list)  # per pass: each prompt's share of its batch's wall time
    propose_s: float = 0.0  # seconds spent drafting in the last pass (speculative methods)
    rounds: int = 0  # drafting calls in the last pass (speculative methods)
    pass_taus: list = field(default_factory=list)  # tokens per target call in each pass (speculative methods)


class Runner:
    """One method, built and warmed up, timed a chunk of prompts at a time: ``start_pass``, then
    ``run(lo, hi)`` for chunks in any order, then ``end_pass`` -> (outputs, stats, wall, propose_s,
    propose calls) with outputs and stats in prompt order. ``decode(lo, hi)`` returns one
    (tokens, stats) per prompt, stats holding the prompt's share of its batch's time as ``wall_s``
    (rescaled to the share of the chunk's time);
    ``timed`` (optional) counts drafting time: ``reset()``, ``seconds``, ``calls``. ``fresh`` (optional)
    rebuilds the method before each pass and returns its new ``timed``."""

    def __init__(self, decode: Callable[[int, int], list], n_prompts: int, timed=None, fresh: Callable | None = None):
        self.decode, self.n, self.timed, self.fresh = decode, n_prompts, timed, fresh
        self.pass_stats: list[list] = []  # every pass's per-prompt stats

    def start_pass(self) -> None:
        if self.fresh is not None:  # the method starts the pass knowing nothing of earlier ones (see bench)
            self.timed = self.fresh()
        if self.timed is not None:
            self.timed.reset()
        self.results: list = [None] * self.n
        self.wall = 0.0

    def run(self, lo: int, hi: int) -> None:
        t0 = time.perf_counter()
        out = self.decode(lo, hi)
        wall = time.perf_counter() - t0
        # each prompt's share scaled to the whole chunk's time, so a pass's shares add up to its wall time
        # and a speedup over every prompt is the same whether summed per prompt or per pass
        total = sum(st["wall_s"] for _, st in out)
        for _, st in out:
            st["wall_s"] = wall * st["wall_s"] / total if total else wall / len(out)
        self.wall += wall
        self.results[lo:hi] = out

    def end_pass(self) -> tuple:
        outputs = [toks for toks, _ in self.results]
        stats = [st for _, st in self.results]
        timed = self.timed
        return outputs, stats, self.wall, timed.seconds if timed else 0.0, timed.calls if timed else 0


def run_passes(runners: dict[str, Runner], n_prompts: int, chunk: int, repeats: int) -> dict[str, Run]:
    """Every runner over all prompts, ``repeats`` times, interleaved ``chunk`` prompts at a time."""
    names = list(runners)
    passes: dict[str, list] = {name: [] for name in names}
    chunk = max(1, chunk)
    for _ in range(max(1, repeats)):
        for name in names:
            runners[name].start_pass()
        for c, lo in enumerate(range(0, n_prompts, chunk)):
            for name in names[c % len(names) :] + names[: c % len(names)]:
                runners[name].run(lo, min(lo + chunk, n_prompts))
        for name in names:
            passes[name].append(runners[name].end_pass())
    return {name: _collect(passes[name]) for name in names}


def _collect(passes: list[tuple]) -> Run:
    outputs, stats, _, propose_s, rounds = passes[-1]
    walls = [p[2] for p in passes]
    record_walls = [[st["wall_s"] for st in p[1]] for p in passes]
    taus = []
    for p in passes:
        calls = sum(st.get("target_calls") or 0 for st in p[1])
        taus.append(round(sum(len(t) for t in p[0]) / calls, 3) if calls else None)
    return Run(outputs, stats, walls, record_walls, propose_s, rounds, taus)


def pass_walls(run: Run, idx: list[int]) -> list[float]:
    """Seconds per pass spent on the prompts ``idx``."""
    return [sum(w[i] for i in idx) for w in run.record_walls]


def tokens_per_s(run: Run, idx: list[int]) -> float:
    walls = pass_walls(run, idx)
    return sum(len(run.outputs[i]) for i in idx) / statistics.median(walls) if all(walls) else 0.0


def speedup(run: Run, reference: Run, idx: list[int], per_token: bool = True) -> float | None:
    """Median over passes of the run's tokens/s over the reference's on the prompts ``idx``; with
    ``per_token`` False, of the reference's wall time over the run's (the same prompts done faster,
    for methods whose outputs may differ in length from the reference's)."""
    toks = sum(len(run.outputs[i]) for i in idx) if per_token else 1
    ref_toks = sum(len(reference.outputs[i]) for i in idx) if per_token else 1
    pairs = zip(pass_walls(run, idx), pass_walls(reference, idx))
    ratios = [(toks / w) / (ref_toks / r) for w, r in pairs if w and r and ref_toks]
    return statistics.median(ratios) if ratios else None
