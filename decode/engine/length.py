"""Draft lengths and tree sizes chosen by measured costs and acceptance (on a CPU).

On a GPU a verify forward of a dozen tokens costs about what one token costs (the weights are read
once either way). On a CPU it does not: Gemma 3 270M on two cores takes about 1.6x a one-token
forward for 8 tokens, 2.3x for 16, so a chain of 12 n-gram drafts of which the first is accepted 4
times in 10 loses to plain decoding. ``DraftLength`` keeps, per drafter-given class (n-gram: the
length of the match), the acceptance rate of each draft position given the earlier ones, and the
seconds of the target's forwards by their width; each round a row drafts the length K that
maximises expected tokens per second: (1 + sum_{i<=K} prod_{j<=i} a_j) / (t(1 + K) + K d), with
t the forward time at that width and d a draft token's time; a batch of rows drafts min(its chain, W)
a row, with the one W that maximises the rows' expected tokens together over t(1 + W) + W d (the
forward is as wide as its longest row). Unmeasured widths are interpolated
(or extrapolated by the nearest slope); a small share of rounds drafts two positions further, so
positions past the chosen length keep being measured. Which tokens are drafted never depends on
it: the output is unchanged, only the work per round.

Trees (EAGLE's dynamic tree): the drafter scores each node by its calibrated chance of acceptance,
so the n best nodes of a row are worth 1 + the sum of their chances; ``tree_size`` picks the n that
maximises that per second of the verify forward of width 1 + n (the drafting already spent), and
``keep_growing`` stops deepening the tree once the best frontier node's chance is worth less than
another level costs. ``draft_s`` is then the seconds of one level.

When sampling (T>0) the lengths decide how many random draws each round takes, so lengths that
followed measured seconds would make a seeded job's output depend on the machine's load. There
``timed=False``: costs come from a fixed model (a forward of width w costs 1 + SLOPE_PRIOR * rows *
(w - 1) one-token forwards; a drafted token ``draft_share`` of one, the draft's parameters over the
target's) and the lengths follow acceptance alone, which the seed fixes.
"""

from __future__ import annotations

import random
from enum import Enum

import torch

CLASSES = 8  # drafter classes (n-gram match lengths); higher ones share the last
PRIOR_ACCEPT = 0.5  # a position's conditional acceptance before anything is seen
PRIOR_WEIGHT = 2.0  # ...worth this many observations
DECAY = 0.995  # observations fade: the text changes as a job goes on
EXPLORE = 0.05  # share of rounds that draft two positions past the chosen length
SLOPE_PRIOR = 0.08  # extra seconds per extra token, as a share of a one-token forward, before any are measured


class LengthPolicy(Enum):
    """How this module may choose a drafter's lengths (``Drafter.length_policy``), where the engine uses it
    (on a CPU, with no --num-draft fixed):

    - ``own``: it chooses none: the drafter drafts up to ``num_draft`` as it finds drafts, or decides each
      round's length itself (SpecDec++'s acceptance heads, PEARL, SWIFT, RASD);
    - ``after``: drafting costs nothing (a lookup in the text), so the drafter drafts ``num_draft`` and the
      engine trims each row's chain to the length chosen for it;
    - ``before``: each drafted token costs a draft-model forward, so the engine sets ``batch.num_draft`` to
      the length chosen before the drafter drafts;
    - ``tree``: the drafter sizes its dynamic tree itself with the engine's ``DraftLength``, which the
      engine hands it as ``drafter.length`` (``tree_size``, ``keep_growing``).
    """

    own = "own"
    after = "after"
    before = "before"
    tree = "tree"


class DraftLength:
    def __init__(self, max_k: int, seed: int = 0, timed: bool = True, draft_share: float = 0.0):
        self.max_k = max(1, max_k)
        self.timed = timed
        self.acc = torch.full((CLASSES, self.max_k), PRIOR_ACCEPT * PRIOR_WEIGHT, dtype=torch.float64)
        self.seen = torch.full((CLASSES, self.max_k), PRIOR_WEIGHT, dtype=torch.float64)
        self.times: dict[tuple[int, int], float] = {}  # (rows bucket, width) -> EWMA seconds
        self.warm: set[tuple[int, int]] = set()  # (rows bucket, width) run at least once
        # EWMA seconds per drafted position (draft models; model-free drafters ~0); untimed: a share of a forward
        self.draft_s = 0.0 if timed else draft_share
        self.rng = random.Random(seed)
        self.chosen: list[int] = []  # the lengths of the last choice (stats)
        self.plain_asked: dict[int, int] = {}  # rows bucket -> rounds asked to draft nothing so a plain step is measured

    # -- costs ---------------------------------------------------------------------------------

    @staticmethod
    def _bucket(rows: int) -> int:
        return min(rows.bit_length(), 6)  # 1, 2-3, 4-7, ... rows

    def record_forward(self, rows: int, width: int, seconds: float) -> None:
        if not self.timed:
            return
        key = (self._bucket(rows), width)
        if key not in self.warm:  # a shape's first forward also builds its kernels: not what the width costs
            self.warm.add(key)
            return
        old = self.times.get(key)
        self.times[key] = seconds if old is None else 0.8 * old + 0.2 * seconds

    def record_draft(self, positions: int, seconds: float) -> None:
        if positions > 0 and self.timed:
            per = seconds / positions
            self.draft_s = per if not self.draft_s else 0.9 * self.draft_s + 0.1 * per

    def forward_cost(self, rows: int, width: int) -> float | None:
        """Seconds of a forward of ``width`` tokens per row: measured, interpolated or extrapolated."""
        if not self.timed:
            return 1.0 + SLOPE_PRIOR * rows * (width - 1)
        b = self._bucket(rows)
        known = sorted((w, t) for (bb, w), t in self.times.items() if bb == b)
        if not known:
            return None
        for (w0, t0), (w1, t1) in zip(known, known[1:]):
            if w0 <= width <= w1:
                return t0 + (t1 - t0) * (width - w0) / (w1 - w0)
        if len(known) == 1:
            # one width measured: scaled by the prior's model, per row as the untimed one has it (8 rows pay each extra
            # position 8 times: 8 rows x 33 tree nodes cost tens of plain steps on a CPU, not 3.5)
            (w0, t0), = known
            return t0 * (1 + SLOPE_PRIOR * rows * (width - 1)) / (1 + SLOPE_PRIOR * rows * (w0 - 1))
        if width < known[0][0]:  # narrower than anything measured (a tree that has always been wide)
            (w0, t0), (w1, t1) = known[:2]
            return max(t0 - max((t1 - t0) / (w1 - w0), 0.0) * (w0 - width), t0 / 4)
        (w_prev, t_prev), (w_last, t_last) = known[-2:]
        return t_last + max((t_last - t_prev) / (w_last - w_prev), 0.0) * (width - w_last)

    # -- acceptance ----------------------------------------------------------------------------

    def observe(self, classes: list[int], drafted: list[int], accepted: list[int]) -> None:
        """Each row drafted ``drafted[r]`` positions of class ``classes[r]`` and ``accepted[r]`` of them were kept."""
        self.acc.mul_(DECAY).add_((1 - DECAY) * PRIOR_ACCEPT * PRIOR_WEIGHT)
        self.seen.mul_(DECAY).add_((1 - DECAY) * PRIOR_WEIGHT)
        for c, n, a in zip(classes, drafted, accepted):
            c = min(max(c, 0), CLASSES - 1)
            reach = min(n, a + 1)  # positions tested: every accepted one and the first rejected
            if reach:
                self.seen[c, :reach] += 1
                self.acc[c, :a] += 1

    def expected(self, cls: int) -> torch.Tensor:
        """[max_k + 1] expected tokens of a round drafting 0..max_k positions (the bonus token included)."""
        a = (self.acc[min(max(cls, 0), CLASSES - 1)] / self.seen[min(max(cls, 0), CLASSES - 1)]).clamp(0, 1)
        return torch.cat([torch.ones(1, dtype=torch.float64), 1 + a.cumprod(0).cumsum(0)])

    def best(self, cls: int, rows: int, available: int, explore: bool = True, draft_s: float | None = None) -> int:
        """The length in 0..available with the most expected tokens per second (``available`` when no cost is known);
        with ``explore``, now and then two positions more; ``draft_s``: a drafted position's seconds, if not the measured."""
        available = min(available, self.max_k)
        if available <= 0:
            return 0
        if self.forward_cost(rows, 1) is None:
            return available
        best_k = self._width([cls], [available], rows, draft_s)
        if explore and best_k < available and self.rng.random() < EXPLORE:
            best_k = min(available, best_k + 2)
        return best_k

    def lengths(self, classes: list[int], available: list[int], draft_s: float | None = None) -> list[int]:
        """Each row's length; ``draft_s`` as in ``best`` (0 for a lookup beside a head whose draft levels are measured)."""
        rows = len(classes)
        b = self._bucket(rows)
        if self.timed and any(available) and (b, 1) not in self.times and self.plain_asked.get(b, 0) < 2:
            # a batch this wide has not run a plain step yet (with several rows some row nearly always has drafts):
            # two rounds without drafts measure one (the first only builds the shape), where the choice would
            # otherwise extrapolate it from wide forwards, which on a CPU cost per position far more than it.
            # Asked twice at most: a round may still be wide for drafts these lengths do not govern (a head's tree)
            self.plain_asked[b] = self.plain_asked.get(b, 0) + 1
            self.chosen = [0] * rows
            return self.chosen
        self.chosen = self._batch(classes, available, draft_s)
        # one row now and then drafts two positions more, so the positions past the chosen lengths stay measured: one
        # row a round at most, since the widest row sets the whole batch's forward (8 rows exploring each on their own
        # made a third of the rounds wide)
        if self.rng.random() < EXPLORE:
            r = self.rng.randrange(rows)
            self.chosen[r] = min(available[r], self.max_k, self.chosen[r] + 2)
        return self.chosen

    def _batch(self, classes: list[int], available: list[int], draft_s: float | None) -> list[int]:
        """The rows' lengths as one choice: a batch's forward is as wide as its longest row, so each row drafts
        min(its chain, W) with the W that gives the batch the most expected tokens per second. Chosen row by row,
        one row's strong match would widen every row's forward and pay for its own tokens only (with 8 rows on a
        CPU, a third of the rounds went wide so). For one row this is ``best``'s choice."""
        caps = [min(max(n, 0), self.max_k) for n in available]
        if max(caps) == 0 or self.forward_cost(len(classes), 1) is None:
            return caps
        width = self._width(classes, caps, len(classes), draft_s)
        return [min(n, width) for n in caps]

    def _width(self, classes: list[int], caps: list[int], rows: int, draft_s: float | None) -> int:
        """The W in 0..max(caps) with the most expected tokens per second when each row drafts min(its cap, W) and
        the forward of ``rows`` rows is 1 + W wide (costs known)."""
        gains = [self.expected(c) for c in classes]
        d = self.draft_s if draft_s is None else draft_s
        best_w, best_rate = 0, 0.0
        for w in range(max(caps) + 1):
            tokens = sum(float(g[min(n, w)]) for g, n in zip(gains, caps))
            rate = tokens / (self.forward_cost(rows, 1 + w) + w * d)
            if rate > best_rate * (1 + 1e-9):
                best_w, best_rate = w, rate
        return best_w

    # -- trees ---------------------------------------------------------------------------------

    def tree_size(self, scores: torch.Tensor, most: int, levels: int, width=None) -> int:
        """Nodes to verify (1..most) given every row's node scores [B, n] (log chance of acceptance,
        -inf for padding), after ``levels`` levels of drafting: the most expected tokens per second.
        ``width(n)``: the verify forward's width with n nodes (default 1 + n; more where positions ride with them)."""
        width = width or (lambda n: 1 + n)
        rows = scores.shape[0]
        most = min(most, scores.shape[1])
        t1 = self.forward_cost(rows, 1)
        if t1 is None or most <= 1:
            return most
        chance = scores.topk(most, dim=-1).values.exp().nan_to_num(0.0).double()  # [B, most], best first
        gain = (1 + chance.cumsum(-1)).mean(0)  # expected tokens per row with the n best nodes
        spent = levels * self.draft_s
        rates = [float(gain[n - 1]) / (self.forward_cost(rows, width(n)) + spent) for n in range(1, most + 1)]
        best = 1 + max(range(most), key=rates.__getitem__)
        if self.rng.random() < EXPLORE:  # keep the neighbouring sizes measured
            best = min(max(best + self.rng.choice((-2, 2)), 1), most)
        return best

    def keep_growing(self, best_chance: float, rows: int) -> bool:
        """Whether another level pays: its best node's chance of acceptance, a token's worth of a
        one-token forward, against a level's cost."""
        t1 = self.forward_cost(rows, 1)
        if t1 is None or not self.draft_s:
            return True
        return best_chance * t1 > self.draft_s
