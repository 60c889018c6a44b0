"""STAND: model-free speculative *sampling* from n-gram tables of the target's own distributions.

An n-gram drafter proposes tokens with a one-hot q, which at T > 0 is accepted only as often as the
target happens to sample that very token. STAND's tables store, per context, a compact copy of the
distribution the target itself produced there, so a draft has a real q close to p and exact
speculative sampling accepts far more. The draft is a token tree verified with recursive rejection
sampling (``verify.verify_tree_drafted``, scheme rsd), so sampled output keeps the target's
distribution; at T = 0 the tree holds the stored argmax tokens and the usual greedy check keeps the
output identical to plain greedy decoding.

The choices:
- Tables. A context is the last 1, 2 or 3 tokens; the longest one with an entry wins. An entry is
  the running average of the target's processed next-token distribution (temperature and top-p
  applied as the verifier applies them) over every position where the context was verified, kept
  as its ``top_k`` heaviest tokens; q is that average renormalised over them (tokens under ``min_q``
  dropped), zero elsewhere. Entries come from the prefill's logits (``begin``/``admit``) and from
  the verified segment's logits at the slots each row kept (``observe``): the root and the accepted
  nodes, whose tokens are now committed text.
- Sharing. Rows of one ``GenRequest.group`` (the samples of one prompt) read and write one table:
  their texts take the same paths, and each row's draft still depends only on text verified before
  the round, so every row stays an exact, independent sample. A row without a group has a table of
  its own. A table is dropped when its last row leaves.
- Trees. Best-first growth up to ``nodes`` nodes and ``num_draft`` levels. A node's children are
  its context's q drawn by Gumbel-top-k, i.e. successive draws without replacement, which is what
  RSD's rule assumes of siblings. Whether a next sibling is added may not depend on its own value
  (RSD would then see a biased draw), so its priority uses the expected q of the next draw,
  sum q^2 / sum q over the tokens not drawn yet; a node's own q(x) only sets the priority of what
  lies below it. Priorities multiply along the path (q approximates the target's chance to emit
  the token) and are calibrated per depth by observed acceptance: ``rho_d`` = (times a node at
  depth d was accepted + prior) / (summed q of the children that were at stake there + prior), so a
  depth whose q overstates acceptance gets fewer nodes. Slots under ``min_reach`` are not drafted.
Host-side Python on small dicts; the tensors are one top-k per observed position, the proposal and
its [B, N, V] draft distributions.
"""

from __future__ import annotations

import heapq
import itertools
import math

import torch

from specdec.decode.drafters.base import Drafter, Proposal, Segment, tree_proposal
from specdec.decode.engine.types import Scheme
from specdec.decode.engine.verify import logits_to_probs


class StandTable:
    """Per context (a tuple of the last 1..``max_ngram`` tokens): summed top-k probabilities of the
    target's next-token distribution and how many positions were summed."""

    def __init__(self, top_k: int = 8, max_ngram: int = 3, min_q: float = 1e-3):
        self.top_k, self.max_ngram, self.min_q = top_k, max_ngram, min_q
        self.mass: dict[tuple, dict[int, float]] = {}
        self.count: dict[tuple, int] = {}
        self._q: dict[tuple, tuple[list[int], list[float]] | None] = {}  # lookups since the last change
        self.refs = 0  # rows reading this table
        self.has_prompt = False  # the group's prompt is in (its samples share one prompt)

    def add(self, text: list[int], end: int, tokens: list[int], probs: list[float]) -> None:
        """The distribution after ``text[end]`` (its top tokens and their probabilities)."""
        for n in range(1, min(self.max_ngram, end + 1) + 1):
            ctx = tuple(text[end - n + 1 : end + 1])
            mass = self.mass.setdefault(ctx, {})
            for t, p in zip(tokens, probs):
                mass[t] = mass.get(t, 0.0) + p
            self.count[ctx] = self.count.get(ctx, 0) + 1
            self._q.pop(ctx, None)
            if len(mass) > self.top_k:  # a running average of top-k lists, itself cut to its top k
                for t, _ in sorted(mass.items(), key=lambda tp: tp[1])[: len(mass) - self.top_k]:
                    del mass[t]

    def lookup(self, tail: list[int]) -> tuple[list[int], list[float]] | None:
        """(tokens, q) of the longest context ``tail`` ends with, likeliest first; None if none."""
        for n in range(min(self.max_ngram, len(tail)), 0, -1):
            ctx = tuple(tail[-n:])
            if ctx not in self.mass:
                continue
            if ctx not in self._q:
                self._q[ctx] = self._distribution(ctx)
            if self._q[ctx] is not None:
                return self._q[ctx]
        return None

    def _distribution(self, ctx: tuple) -> tuple[list[int], list[float]] | None:
        n_obs = self.count[ctx]
        kept = sorted(((t, m) for t, m in self.mass[ctx].items() if m / n_obs >= self.min_q), key=lambda tm: (-tm[1], tm[0]))
        total = sum(m for _, m in kept)
        return ([t for t, _ in kept], [m / total for _, m in kept]) if total > 0 else None


class _Node:
    __slots__ = ("token", "parent", "depth", "q_tokens", "q_probs", "qx")

    def __init__(self, token, parent, depth, q_tokens, q_probs, qx):
        self.token, self.parent, self.depth = token, parent, depth
        self.q_tokens, self.q_probs, self.qx = q_tokens, q_probs, qx  # the q it was drawn from, and q(token)


class StandDrafter(Drafter):
    """STAND: stochastic n-gram trees from the target's own stored distributions (module docstring)."""

    default_k = 6  # tree depth
    needs_prefill_logits = True
    proposes_trees = True
    has_draft_probs = True

    def __init__(self, top_k: int = 8, max_ngram: int = 3, nodes: int = 8, min_q: float = 1e-3,
                 min_reach: float = 0.02, prior: float = 4.0):
        self.top_k, self.max_ngram, self.nodes = top_k, max_ngram, nodes
        self.min_q, self.min_reach, self.prior = min_q, min_reach, prior
        self.tables: dict = {}  # ("group", g) or ("row", n) -> StandTable
        self.row_keys: list = []  # per row: its table's key
        self.indexed: list[int] = []  # per row: len(seq) when its text was last added to the table
        self.trees: list[list[_Node]] = []  # per row: the tree under verification
        self.hit: list[float] = []  # per depth: accepted nodes
        self.pred: list[float] = []  # per depth: summed q of the children at stake
        self._ids = itertools.count()
        self._vocab = 0

    # -- engine hooks --------------------------------------------------------------------------

    def begin(self, batch, seg: Segment) -> None:
        self.tables, self.row_keys, self.indexed, self.trees = {}, [], [], []
        self._add_rows(batch, seg)

    def admit(self, batch, seg: Segment) -> None:
        """``batch`` holds the admitted rows only; they join after the running ones."""
        self._add_rows(batch, seg)

    def select_rows(self, rows: torch.Tensor) -> None:
        keep = rows.tolist()
        for r in set(range(len(self.row_keys))) - set(keep):
            table = self.tables[self.row_keys[r]]
            table.refs -= 1
            if table.refs == 0:
                del self.tables[self.row_keys[r]]
        self.row_keys = [self.row_keys[i] for i in keep]
        self.indexed = [self.indexed[i] for i in keep]
        self.trees = [self.trees[i] for i in keep]

    def _add_rows(self, batch, seg: Segment) -> None:
        groups = batch.groups or [None] * len(batch.seqs)
        fresh = []  # rows whose table still lacks their prompt
        for r, group in enumerate(groups):
            key = ("group", group) if group is not None else ("row", next(self._ids))
            table = self.tables.setdefault(key, StandTable(self.top_k, self.max_ngram, self.min_q))
            table.refs += 1
            if not table.has_prompt:
                table.has_prompt = True
                fresh.append(r)
            self.row_keys.append(key)
            self.indexed.append(len(batch.seqs[r]))
        self.trees += [[] for _ in groups]
        self._vocab = seg.logits.shape[-1]
        if not fresh:
            return
        # the logits may cover the prompts' last positions only (right-aligned with the inputs)
        width = seg.logits.shape[1]
        valid = seg.input_valid[:, -width:]
        rows = torch.tensor(fresh, device=seg.logits.device)
        top_p, top_t = self._top(seg.logits[rows], batch)
        base = len(self.row_keys) - len(groups)
        for i, r in enumerate(fresh):
            table = self.tables[self.row_keys[base + r]]
            prompt = batch.seqs[r][:-1]  # the last token is the target's first, not yet in the prefill
            slots = valid[r].nonzero().squeeze(-1).tolist()
            first = len(prompt) - len(slots)  # prompt index of the first slot with logits
            for j, s in enumerate(slots):
                table.add(prompt, first + j, top_t[i][s], top_p[i][s])

    def _top(self, logits: torch.Tensor, batch) -> tuple[list, list]:
        """Top-k of the processed distribution at every position of ``logits`` [B, T, V], as lists."""
        probs = logits_to_probs(logits, batch.sampling)
        top = probs.topk(min(self.top_k, probs.shape[-1]), dim=-1)
        return top.values.tolist(), top.indices.tolist()

    def observe(self, batch, seg: Segment) -> None:
        if seg.accepted is None:
            return
        if any(self.trees):
            self._calibrate(seg)
        # slot m of what a row kept holds seq[root + m] (root: the last token before this round);
        # its logits are the target's distribution after it
        keep = seg.keep_index
        kept_logits = seg.logits.gather(1, keep[..., None].expand(-1, -1, seg.logits.shape[-1]))
        top_p, top_t = self._top(kept_logits, batch)
        valid = seg.keep_valid.tolist()
        for r, seq in enumerate(batch.seqs):
            table, root = self.tables[self.row_keys[r]], self.indexed[r] - 1
            for m, ok in enumerate(valid[r]):
                if ok and root + m < len(seq):  # a finished row drops what it accepted after its stop
                    table.add(seq, root + m, top_t[r][m], top_p[r][m])
            self.indexed[r] = len(seq)
        self.trees = [[] for _ in self.trees]

    def _calibrate(self, seg: Segment) -> None:
        """Per depth: whether a child of the path's node there was accepted, against their summed q."""
        paths = seg.keep_index[:, 1:].tolist()
        for tree, path, accepted in zip(self.trees, paths, seg.accepted):
            if not tree:
                continue
            at = -1  # the path's node (-1: the root)
            for d in range(len(path) + 1):
                stake = sum(nd.qx for nd in tree if nd.parent == at)
                if stake == 0:
                    break
                while len(self.pred) <= d:
                    self.pred.append(0.0)
                    self.hit.append(0.0)
                self.pred[d] += stake
                if d >= accepted:
                    break
                self.hit[d] += 1.0
                at = path[d] - 1

    def _rho(self, d: int) -> float:
        """How far q's acceptance at depth ``d`` holds up: observed over predicted, shrunk towards 1."""
        if d >= len(self.pred):
            return 1.0
        return (self.hit[d] + self.prior) / (self.pred[d] + self.prior)

    # -- the tree ------------------------------------------------------------------------------

    def propose(self, batch) -> Proposal | None:
        depth = batch.num_draft
        if depth <= 0:
            return None
        greedy = batch.sampling.greedy
        bsz = len(batch.seqs)
        # one uniform per (row, expansion, candidate): the root and every node may be expanded
        u = None if greedy else torch.rand(bsz, self.nodes + 1, self.top_k, generator=batch.generator,
                                           device=batch.device).clamp_(min=1e-20).tolist()
        self.trees = [
            self._grow(self.tables[key], seq, depth, None if greedy else u[r]) for r, (key, seq) in enumerate(zip(self.row_keys, batch.seqs))
        ]
        width = max(map(len, self.trees))
        sampled = {} if greedy or width == 0 else {"draft_probs": self._draft_probs(batch, width), "scheme": Scheme.rsd}
        return tree_proposal([([nd.token for nd in tree], [nd.parent for nd in tree]) for tree in self.trees], batch.device, **sampled)

    def _draft_probs(self, batch, width: int) -> torch.Tensor:
        """[B, N, V]: each node's q (its parent's context distribution), zero off its support."""
        bsz, k = len(self.trees), self.top_k
        pad_idx, pad_val = [[0] * k] * width, [[0.0] * k] * width
        idx = [[nd.q_tokens + [0] * (k - len(nd.q_tokens)) for nd in tree] + pad_idx[len(tree) :] for tree in self.trees]
        val = [[nd.q_probs + [0.0] * (k - len(nd.q_probs)) for nd in tree] + pad_val[len(tree) :] for tree in self.trees]
        idx = torch.tensor(idx, dtype=torch.long, device=batch.device)
        val = torch.tensor(val, dtype=torch.float32, device=batch.device)
        # scatter_add: the padding entries add zero to token 0 instead of overwriting its q
        return torch.zeros(bsz, width, self._vocab, device=batch.device).scatter_add_(2, idx, val)

    def _order(self, tokens: list[int], probs: list[float], u: list[float] | None) -> list[int]:
        """Indices of the support in draw order: Gumbel-top-k (draws without replacement from q) when
        sampling, likeliest first when greedy."""
        if u is None:
            return list(range(len(tokens)))
        keys = [math.log(p) - math.log(-math.log(x)) for p, x in zip(probs, u)]
        return sorted(range(len(tokens)), key=lambda i: -keys[i])

    def _grow(self, table: StandTable, seq: list[int], max_depth: int, u: list | None) -> list[_Node]:
        nodes: list[_Node] = []
        frontier: list = []  # (-priority, order, parent, reach, depth, drawn order, next index, tokens, probs)
        tie = itertools.count()
        expansions = 0

        def expand(parent: int, path: list[int], reach: float, depth: int) -> None:
            nonlocal expansions
            if depth >= max_depth:
                return
            found = table.lookup((seq[-self.max_ngram :] + path)[-self.max_ngram :])
            if found is None:
                return
            tokens, probs = found
            order = self._order(tokens, probs, None if u is None else u[expansions])
            expansions += 1
            push(parent, reach, depth, order, 0, tokens, probs)

        def push(parent, reach, depth, order, j, tokens, probs) -> None:
            if j >= len(order):
                return
            # the next draw's expected q, not its own: whether it is drafted may not depend on its value
            rest = [probs[i] for i in order[j:]]
            expected = sum(p * p for p in rest) / sum(rest)
            priority = reach * self._rho(depth) * expected
            if priority >= self.min_reach:
                heapq.heappush(frontier, (-priority, next(tie), parent, reach, depth, order, j, tokens, probs))

        paths: list[list[int]] = []
        expand(-1, [], 1.0, 0)
        while frontier and len(nodes) < self.nodes:
            _, _, parent, reach, depth, order, j, tokens, probs = heapq.heappop(frontier)
            i = order[j]
            nodes.append(_Node(tokens[i], parent, depth + 1, tokens, probs, probs[i]))
            path = (paths[parent] if parent >= 0 else []) + [tokens[i]]
            paths.append(path)
            push(parent, reach, depth, order, j + 1, tokens, probs)
            expand(len(nodes) - 1, path, reach * self._rho(depth) * probs[i], depth + 1)
        return nodes
