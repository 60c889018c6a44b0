"""ADED: a model-free drafter that learns the target's behaviour as it decodes.

Each row keeps an adaptive tri-gram table (decayed counts of the next token given the two before it),
built from its prompt and updated with every verified token, and drafts a small token tree from it
each round. The tree is verified like every other draft, so greedy output is identical to plain
decoding and sampled output keeps the target's distribution (a table token is a one-hot draft).

The choices:
- Table. When a context is seen again its counts are multiplied by ``decay`` (0.9) before the new
  token adds 1, so the table follows the current text rather than the whole history; counts that
  fall below ``min_count`` are dropped, which bounds each context's list. A tri-gram context never
  seen falls back to the bi-gram table of the last token; a seen one is topped up with bi-gram
  followers it lacks at ``backoff`` times their bi-gram probability (stupid back-off), so a node
  still has siblings to offer when one continuation dominates.
- Search. The tree grows best-first from the root, one node at a time, up to ``num_draft`` nodes
  and ``max_depth`` levels: the frontier holds the ``top_k`` most frequent continuations of every
  node's context, and the node added is the one with the highest priority
      P(path to its parent) * min(1, a + c * sqrt(ln N / n))
  where ``a`` is the edge's estimated acceptance: the table probability as a prior of ``prior``
  pseudo-proposals, updated by how often this (context, token) was proposed with its parent accepted
  (n) and how often it was then accepted; N counts the proposals from the context. The bonus (UCB)
  lets a rarely tried continuation in, while the product with the parent's path acceptance keeps
  exploration from buying deep nodes that are unlikely to be reached. A node's own path acceptance
  (for its children) is P(parent) * a, without the bonus.
- Statistics. ``observe`` reads the verified tree from ``seg.keep_index``/``seg.accepted`` (the
  accepted nodes) to count, per row, proposals at stake and acceptances; the table itself is updated
  from each row's ``batch.seqs`` growth, which holds exactly the verified tokens.
Everything is host-side Python on small dicts: the only tensors are the proposal and one read of the
verified path per round.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field

import torch

from specdec.decode.drafters.base import Drafter, Proposal, Segment, tree_proposal

Context = tuple[int, int]


class NgramTable:
    """Decayed tri-gram and bi-gram counts of one row's text."""

    def __init__(self, decay: float = 0.9, min_count: float = 0.02, backoff: float = 0.4):
        self.decay, self.min_count, self.backoff = decay, min_count, backoff
        self.tri: dict[Context, dict[int, float]] = {}
        self.bi: dict[int, dict[int, float]] = {}
        self.indexed = 0  # tokens of the row's text already counted

    def _bump(self, counts: dict[int, float], tok: int) -> None:
        for t in list(counts):
            c = counts[t] * self.decay
            if c < self.min_count:
                del counts[t]
            else:
                counts[t] = c
        counts[tok] = counts.get(tok, 0.0) + 1.0

    def add(self, seq: list[int]) -> None:
        """Count the transitions of ``seq`` not counted yet (the text only grows between calls)."""
        for i in range(max(self.indexed, 1), len(seq)):
            self._bump(self.bi.setdefault(seq[i - 1], {}), seq[i])
            if i >= 2:
                self._bump(self.tri.setdefault((seq[i - 2], seq[i - 1]), {}), seq[i])
        self.indexed = max(self.indexed, len(seq))

    def candidates(self, ctx: Context, k: int) -> list[tuple[int, float]]:
        """The ``k`` likeliest next tokens after ``ctx`` with their probabilities, likeliest first."""
        tri, bi = self.tri.get(ctx), self.bi.get(ctx[1])
        scored: dict[int, float] = {}
        if tri:
            total = sum(tri.values())
            scored = {t: c / total for t, c in tri.items()}
        if bi:
            total = sum(bi.values())
            scale = self.backoff if tri else 1.0
            for t, c in bi.items():
                scored.setdefault(t, scale * c / total)
        return sorted(scored.items(), key=lambda tp: (-tp[1], tp[0]))[:k]


@dataclass
class EdgeStats:
    """How often a (context, token) was proposed with its parent accepted, and then accepted."""

    proposed: dict[tuple[Context, int], int] = field(default_factory=dict)
    accepted: dict[tuple[Context, int], int] = field(default_factory=dict)
    visits: dict[Context, int] = field(default_factory=dict)  # proposals from the context, all tokens

    def record(self, ctx: Context, tok: int, hit: bool) -> None:
        key = (ctx, tok)
        self.proposed[key] = self.proposed.get(key, 0) + 1
        self.visits[ctx] = self.visits.get(ctx, 0) + 1
        if hit:
            self.accepted[key] = self.accepted.get(key, 0) + 1


@dataclass
class _Node:
    token: int
    parent: int  # index in the tree, -1 = child of the root
    depth: int
    ctx: Context  # the two tokens before this one


@dataclass
class _RowState:
    table: NgramTable
    stats: EdgeStats = field(default_factory=EdgeStats)
    tree: list[_Node] = field(default_factory=list)  # the tree under verification


class AdedDrafter(Drafter):
    """ADED: a per-row adaptive tri-gram table and a UCB-guided token tree (see the module docstring)."""

    default_k = 20  # tree nodes
    proposes_trees = True

    def __init__(self, max_depth: int = 6, top_k: int = 4, explore: float = 0.3, prior: float = 2.0,
                 decay: float = 0.9, min_count: float = 0.02, backoff: float = 0.4):
        self.max_depth, self.top_k, self.explore, self.prior = max_depth, top_k, explore, prior
        self._table_args = (decay, min_count, backoff)
        self.rows: list[_RowState] = []

    # -- engine hooks --------------------------------------------------------------------------

    def _new_rows(self, seqs: list[list[int]]) -> list[_RowState]:
        rows = []
        for seq in seqs:
            row = _RowState(NgramTable(*self._table_args))
            row.table.add(seq)  # the prompt and the target's first token
            rows.append(row)
        return rows

    def begin(self, batch, seg: Segment) -> None:
        self.rows = self._new_rows(batch.seqs)

    def admit(self, batch, seg: Segment) -> None:
        """``batch`` holds the admitted rows only; they join after the running ones."""
        self.rows += self._new_rows(batch.seqs)

    def select_rows(self, rows: torch.Tensor) -> None:
        self.rows = [self.rows[i] for i in rows.tolist()]

    def propose(self, batch) -> Proposal | None:
        n, depth = batch.num_draft, min(self.max_depth, batch.num_draft)
        for row, seq in zip(self.rows, batch.seqs):
            row.tree = self._grow(row, seq, n, depth) if n > 0 else []
        return tree_proposal([([nd.token for nd in row.tree], [nd.parent for nd in row.tree]) for row in self.rows], batch.device)

    def observe(self, batch, seg: Segment) -> None:
        if seg.accepted is not None and any(row.tree for row in self.rows):
            paths = seg.keep_index[:, 1:].tolist()  # slot i + 1 holds node i
            for row, path, acc in zip(self.rows, paths, seg.accepted):
                self._count(row, {slot - 1 for slot in path[:acc]})
        for row, seq in zip(self.rows, batch.seqs):
            row.table.add(seq)
            row.tree = []

    # -- the search ----------------------------------------------------------------------------

    def _grow(self, row: _RowState, seq: list[int], n_nodes: int, max_depth: int) -> list[_Node]:
        """Best-first growth of up to ``n_nodes`` nodes by UCB priority; parents precede children."""
        nodes: list[_Node] = []
        frontier: list[tuple[float, int, int, int, Context, float]] = []
        order = 0  # ties go to the earlier push: shallower nodes and likelier siblings first

        def push_children(parent: int, ctx: Context, reach: float, depth: int) -> None:
            nonlocal order
            if depth >= max_depth:
                return
            visits = row.stats.visits.get(ctx, 0)
            for tok, p in row.table.candidates(ctx, self.top_k):
                tried = row.stats.proposed.get((ctx, tok), 0)
                est = (row.stats.accepted.get((ctx, tok), 0) + self.prior * p) / (tried + self.prior)
                bonus = self.explore * math.sqrt(math.log(visits + 1) / (tried + 1))
                priority = reach * min(1.0, est + bonus)
                heapq.heappush(frontier, (-priority, order, parent, tok, ctx, reach * est))
                order += 1

        push_children(-1, (seq[-2] if len(seq) > 1 else -1, seq[-1]), 1.0, 0)
        while frontier and len(nodes) < n_nodes:
            _, _, parent, tok, ctx, reach = heapq.heappop(frontier)
            depth = 1 if parent < 0 else nodes[parent].depth + 1
            nodes.append(_Node(tok, parent, depth, ctx))
            push_children(len(nodes) - 1, (ctx[1], tok), reach, depth)
        return nodes

    def _count(self, row: _RowState, accepted: set[int]) -> None:
        """A node was at stake when its parent was accepted (or is the root)."""
        for i, nd in enumerate(row.tree):
            if nd.parent < 0 or nd.parent in accepted:
                row.stats.record(nd.ctx, nd.token, i in accepted)
