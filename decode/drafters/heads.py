"""Drafters for Medusa, Clover, EAGLE and Chimera artifacts: token trees from the target's own hidden states.

All three read the target's last hidden states from the engine (``needs_hidden = True``): the
prefill's in ``begin`` and each verify forward's in ``observe``, where ``seg.keep_index`` /
``seg.accepted`` say which slots each row kept. They differ only in how a tree node's children are
scored (``_child_logprobs``); one tree builder grows either
  - a static tree: a TreeTemplate (best-first top-k per depth), or
  - a dynamic tree (EAGLE-2): expand the top-k frontier nodes by their estimated chance of being
    accepted, keep the global top-k per depth, and finally the best ``tree_tokens`` nodes of
    everything seen. EAGLE-2 takes the product of the draft's confidences as that estimate, which
    needs a calibrated drafter; an ``AcceptanceCalibration`` learned from the verdicts of this run
    maps each confidence to the acceptance rate actually seen (an under-confident drafter otherwise
    grows wide, shallow trees).
Every row gets its own tree; the engine verifies all of them in one target forward.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch

from specdec.decode.engine.cache import SlotBook, left_pad
from specdec.decode.engine.length import LengthPolicy
from specdec.decode.drafters.base import Drafter, Proposal, Segment, TreeTemplate
from specdec.models.artifacts import check_fingerprint, read_config, tokenizer_fingerprint
from specdec.models.errors import SpecdecError
from specdec.models.head_artifacts import load_heads
from specdec.models.masks import additive_mask

# (tree tokens, depth); a block drafter's default is a short tree: on a CPU each verified node costs time
DEFAULTS = {"medusa": (24, 4), "clover": (24, 4), "eagle": (32, 5), "chimera": (24, 4), "block": (8, 4)}
# a dynamic tree spends its tokens where acceptance is likely, so it can afford to go deeper
DYNAMIC_DEPTH = {"eagle": 8}


@dataclass
class Tree:
    """Nodes grown so far, per row: tokens/parents/depth/score [B, n]; parent -1 = the root;
    anc [B, n, n]: node i's ancestors and itself (kept as nodes are added, so neither the drafter's
    tree attention nor the engine's needs a transitive closure)."""

    tokens: torch.Tensor
    parents: torch.Tensor
    depth: torch.Tensor
    score: torch.Tensor
    key: torch.Tensor
    anc: torch.Tensor

    @staticmethod
    def empty(bsz: int, device) -> "Tree":
        z = torch.zeros(bsz, 0, device=device)
        return Tree(z.long(), z.long(), z.long(), z.double(), z.long(), torch.zeros(bsz, 0, 0, dtype=torch.bool, device=device))

    @property
    def size(self) -> int:
        return self.tokens.shape[1]

    def add(self, tokens, parents, depth, score, key=None) -> torch.Tensor:
        bsz, n = tokens.shape
        start = self.size
        dev = tokens.device
        inherited = self.anc.gather(1, parents.clamp(min=0)[..., None].expand(bsz, n, start)) & (parents >= 0)[..., None]
        own = torch.eye(n, dtype=torch.bool, device=dev).expand(bsz, n, n)
        self.anc = torch.cat([
            torch.cat([self.anc, torch.zeros(bsz, start, n, dtype=torch.bool, device=dev)], 2),
            torch.cat([inherited, own], 2),
        ], 1)  # fmt: skip
        self.tokens = torch.cat([self.tokens, tokens], 1)
        self.parents = torch.cat([self.parents, parents], 1)
        self.depth = torch.cat([self.depth, depth], 1)
        self.score = torch.cat([self.score, score.double()], 1)
        self.key = torch.cat([self.key, torch.zeros_like(tokens) if key is None else key], 1)
        return torch.arange(start, self.size, device=dev)

    def proposal(self, max_depth: int) -> Proposal:
        """The tree as the engine verifies it: ancestor matrix and depths with the root at slot 0."""
        bsz, n = self.tokens.shape
        attn = torch.zeros(bsz, n + 1, n + 1, dtype=torch.bool, device=self.tokens.device)
        attn[:, :, 0] = True
        attn[:, 1:, 1:] = self.anc
        depth = torch.cat([torch.zeros_like(self.depth[:, :1]), self.depth], 1)
        return Proposal(tokens=self.tokens, parents=self.parents, tree_attn=attn, depth=depth, max_depth=max_depth)


class HeadTreeDrafter(Drafter):
    """Shared tree growth; subclasses implement ``_root_state`` bookkeeping and ``_child_logprobs``."""

    needs_hidden = True
    proposes_trees = True

    def __init__(self, heads, target, tree: str = "static", tree_tokens: int | None = None, depth: int | None = None, top_k: int | None = None):
        if tree not in ("static", "dynamic"):
            raise ValueError("tree must be static or dynamic")
        kind_tokens, kind_depth = DEFAULTS[heads.kind]
        if tree == "dynamic":
            kind_depth = DYNAMIC_DEPTH.get(heads.kind, kind_depth)
        self.heads, self.target = heads, target
        self.tree = tree
        self.tree_tokens = int(tree_tokens or kind_tokens)
        self.depth = int(depth or kind_depth)
        if heads.kind != "eagle":
            self.depth = min(self.depth, heads.num_heads)
        self.top_k = int(top_k or (4 if tree == "static" else 8))
        self.default_k = self.depth  # the engine's num_draft bounds the depth (context room)
        self._tpl_key = None
        self._tpl = None
        self.calibration = AcceptanceCalibration()
        self._last_tree: Tree | None = None  # the dynamic tree under verification, for calibration
        # a dynamic tree's depth and size follow measured costs where the engine hands it a
        # decode.engine.length.DraftLength (on a CPU, where each verified node costs time)
        self.length_policy = LengthPolicy.tree if tree == "dynamic" else LengthPolicy.own
        self.length = None
        self._waiting: list[tuple[tuple, list[int]]] = []  # per round waiting to be committed: its entries [B, T, ...], accepted

    def _drain(self) -> tuple[tuple, torch.Tensor] | None:
        """The waiting rounds' entries, each tensor concatenated along time, and each row's index there of the
        newest round's last kept entry (what the next draft call starts from); None when nothing waits."""
        if not self._waiting:
            return None
        waiting, self._waiting = self._waiting, []
        tensors = tuple(torch.cat([w[0][i] for w in waiting], 1) for i in range(len(waiting[0][0])))
        last, accepted = waiting[-1]
        return tensors, tensors[0].shape[1] - last[0].shape[1] + torch.tensor(accepted, device=tensors[0].device)

    def modules(self) -> list:
        return [self.heads] if isinstance(self.heads, torch.nn.Module) else []

    # -- engine hooks --------------------------------------------------------------------------

    def begin(self, batch, seg: Segment) -> None:
        raise NotImplementedError

    def observe(self, batch, seg: Segment) -> None:
        if self._last_tree is not None:
            self.calibration.update(self._last_tree, seg)
            self._last_tree = None
        self._observe(batch, seg)

    def _observe(self, batch, seg: Segment) -> None:
        """Take in the verify forward's hidden states for the kept slots."""
        raise NotImplementedError

    def _child_logprobs(self, tree: Tree, nodes: torch.Tensor, level: int, batch) -> torch.Tensor:
        """Log-probs [B, m, V] of the children of ``nodes`` [B, m] (-1 = root), all at depth ``level``."""
        raise NotImplementedError

    def _reset_tree(self, batch) -> None:
        pass

    # -- tree growth ---------------------------------------------------------------------------

    def propose(self, batch) -> Proposal | None:
        depth = min(self.depth, batch.num_draft)
        if depth <= 0:
            return None
        self._reset_tree(batch)
        if self.tree == "static":
            tree = self._grow_static(batch, depth)
            max_depth = len(self._template(depth, batch.device))  # known without a host sync
        else:
            tree = self._last_tree = self._grow_dynamic(batch, depth)
            max_depth = int(tree.depth.max().item())
        return tree.proposal(max_depth)

    def _template(self, depth: int, device) -> list[tuple]:
        """Per depth of the static template: (parents, unique parents, inverse, ranks, top-k width).

        All template constants, computed once per shape so growing a tree costs no host syncs.
        """
        key = (self.tree_tokens, self.top_k, depth, str(device))
        if self._tpl_key != key:
            tpl = TreeTemplate.best_first(self.tree_tokens, self.top_k, depth)
            t = tpl.tensors(device)
            parents, ranks, depths = t["parents"][0], t["ranks"], t["depth"][0, 1:]
            plan = []
            for d in range(1, int(depths.max().item()) + 1):
                nodes = (depths == d).nonzero().squeeze(-1)
                par = parents[nodes]  # template indices (== tree indices: templates are depth-sorted)
                uniq, inv = torch.unique(par, return_inverse=True)
                plan.append((par, uniq, inv, ranks[nodes], int(ranks[nodes].max().item()) + 1))
            self._tpl, self._tpl_key = plan, key
        return self._tpl

    def _grow_static(self, batch, depth: int) -> Tree:
        bsz = len(batch.seqs)
        tree = Tree.empty(bsz, batch.device)
        for d, (par, uniq, inv, r, k) in enumerate(self._template(depth, batch.device), start=1):
            logp = self._child_logprobs(tree, uniq[None].expand(bsz, -1), d - 1, batch)  # [B, u, V]
            top_lp, top_tok = logp.topk(k, dim=-1)
            top_tok = self.heads.to_target(top_tok)  # a reduced vocabulary's ids as the target's
            tok = top_tok[:, inv, r]
            lp = top_lp[:, inv, r].double()
            par_b = par[None].expand(bsz, -1)
            base = tree.score.gather(1, par_b.clamp(min=0)).masked_fill(par_b < 0, 0.0) if tree.size else torch.zeros_like(lp)
            tree.add(tok, par_b, torch.full_like(tok, d), base + lp)
        return tree

    def _grow_dynamic(self, batch, depth: int) -> Tree:
        bsz = len(batch.seqs)
        dev = batch.device
        k = self.top_k
        tree = Tree.empty(bsz, dev)
        frontier = torch.full((bsz, 1), -1, dtype=torch.long, device=dev)
        f_score = torch.zeros(bsz, 1, dtype=torch.float64, device=dev)
        length, start, levels = self.length, time.perf_counter(), 0
        for d in range(1, depth + 1):
            levels = d
            logp = self._child_logprobs(tree, frontier, d - 1, batch)  # [B, m, V]
            top_lp, top_tok = logp.topk(k, dim=-1)  # [B, m, k]
            top_tok = self.heads.to_target(top_tok)  # a reduced vocabulary's ids as the target's
            m = frontier.shape[1]
            key = self.calibration.key(top_lp, d)
            score = (f_score[..., None] + self.calibration.log_accept(key)).reshape(bsz, m * k)
            par = frontier[..., None].expand(bsz, m, k).reshape(bsz, m * k)
            idx = tree.add(top_tok.reshape(bsz, m * k), par, torch.full_like(par, d), score, key.reshape(bsz, m * k))
            if d < depth:
                best = score.topk(min(k, m * k), dim=-1).indices
                frontier = idx[best]
                f_score = score.gather(1, best)
                if length is not None and not length.keep_growing(float(f_score.max().exp()), bsz):
                    break
        size = self.tree_tokens
        if length is not None:
            length.record_draft(levels, time.perf_counter() - start)
            size = length.tree_size(tree.score, self.tree_tokens, levels)
        return _best_subtree(tree, size, depth)


class AcceptanceCalibration:
    """How often a drafted child was accepted, given its parent was, per cell (the draft's confidence
    q in the child, its rank among its siblings, its depth): counts from this run's verdicts, each
    cell starting from ``prior`` pseudo-observations at its q-bin's centre (trust q until evidence
    comes), made non-decreasing in q. Updated and read with tensor ops only: no host sync.
    """

    def __init__(self, bins: int = 20, ranks: int = 3, depths: int = 8, prior: float = 4.0):
        self.bins, self.ranks, self.depths, self.prior = bins, ranks, depths, prior
        self.seen: torch.Tensor | None = None
        self._log_rate: torch.Tensor | None = None

    def _init(self, device) -> None:
        centre = (torch.arange(self.bins, dtype=torch.float64, device=device) + 0.5) / self.bins
        self.edges = torch.linspace(0, 1, self.bins + 1, device=device)[1:-1]
        self.seen = torch.full((self.depths, self.ranks, self.bins), self.prior, dtype=torch.float64, device=device)
        self.hits = centre.expand_as(self.seen) * self.prior

    def key(self, top_lp: torch.Tensor, depth: int) -> torch.Tensor:
        """Cells [B, m, k] of children with draft log-probs ``top_lp`` [B, m, k] (ranked on the last axis)."""
        if self.seen is None:
            self._init(top_lp.device)
        q = torch.bucketize(top_lp.float().exp(), self.edges.float())
        rank = torch.arange(top_lp.shape[-1], device=top_lp.device).clamp(max=self.ranks - 1)
        return (min(depth, self.depths) - 1) * self.ranks * self.bins + rank * self.bins + q

    def rate(self) -> torch.Tensor:
        """[depths, ranks, bins] acceptance rate per cell."""
        return (self.hits / self.seen).cummax(-1).values.clamp(1e-6, 1.0)

    def log_accept(self, key: torch.Tensor) -> torch.Tensor:
        """Estimated log-chance (float64) that children in cells ``key`` are accepted."""
        if self._log_rate is None:
            self._log_rate = self.rate().log().flatten()
        return self._log_rate[key]

    def update(self, tree: Tree, seg: Segment) -> None:
        """Count the verified tree: a node is at stake when its parent was accepted (or is the root)."""
        bsz, n = tree.tokens.shape
        path = seg.keep_index[:, 1:] - 1  # accepted nodes, in order; invalid slots point at node -1
        # nodes past the drafter's own (a lookup's chain merged into the tree: decode.drafters.hybrid) are not counted
        own = seg.keep_valid[:, 1:] & (path < n)
        on_path = torch.zeros(bsz, n, dtype=torch.float64, device=path.device)
        on_path.scatter_add_(1, path.clamp(min=0, max=max(n - 1, 0)), own.double())
        par = tree.parents
        at_stake = ((par == -1) | ((par >= 0) & (on_path.gather(1, par.clamp(min=0)) > 0))).double()
        key = tree.key.flatten()
        self.seen.view(-1).scatter_add_(0, key, at_stake.flatten())
        self.hits.view(-1).scatter_add_(0, key, (at_stake * on_path).flatten())
        self._log_rate = None


def _best_subtree(tree: Tree, n: int, depth: int) -> Tree:
    """Keep each row's n best-scoring nodes, topologically ordered; a node whose parent was not kept
    (only possible on exact score ties) becomes padding (parent -2)."""
    bsz, total = tree.tokens.shape
    n = min(n, total)
    # shallower first on ties, so parents win over children of equal score
    key = tree.score - tree.depth.double() * 1e-9
    keep = key.topk(n, dim=-1).indices
    order = torch.sort(tree.depth.gather(1, keep) * (total + 1) + keep, dim=-1).indices
    keep = keep.gather(1, order)  # sorted by (depth, index): topological
    new_index = torch.full((bsz, total), -2, dtype=torch.long, device=keep.device)
    new_index.scatter_(1, keep, torch.arange(n, device=keep.device)[None].expand(bsz, n))
    old_par = tree.parents.gather(1, keep)
    parents = torch.where(old_par >= 0, new_index.gather(1, old_par.clamp(min=0)), old_par)
    for _ in range(depth):  # a dropped parent drops its subtree, one level per pass
        dead = (parents >= 0) & (parents.gather(1, parents.clamp(min=0)) == -2)
        parents = parents.masked_fill(dead, -2)
    anc = tree.anc.gather(1, keep[..., None].expand(bsz, n, total)).gather(2, keep[:, None, :].expand(bsz, n, n))
    return Tree(tree.tokens.gather(1, keep), parents, tree.depth.gather(1, keep), tree.score.gather(1, keep), tree.key.gather(1, keep), anc)


def _last_kept_hidden(seg: Segment) -> torch.Tensor:
    """[B, H]: the target's hidden state at each row's last kept slot (it predicted batch.root)."""
    acc = torch.tensor(seg.accepted, device=seg.hidden.device)
    rows = torch.arange(seg.hidden.shape[0], device=seg.hidden.device)
    return seg.hidden[rows, seg.keep_index[rows, acc]]


# ---------------------------------------------------------------------------------------------


class MedusaDrafter(HeadTreeDrafter):
    """Candidates of depth d come from head d on the last hidden state, whatever the parent."""

    def begin(self, batch, seg: Segment) -> None:
        self.h = seg.hidden[:, -1]  # prompts are left-padded: the last slot is every row's last token

    def _observe(self, batch, seg: Segment) -> None:
        self.h = _last_kept_hidden(seg)

    def _reset_tree(self, batch) -> None:
        self._logp = torch.log_softmax(self.heads.medusa_logits(self.h).float(), -1)  # [heads, B, V]

    def _child_logprobs(self, tree, nodes, level, batch):
        return self._logp[level][:, None].expand(-1, nodes.shape[1], -1)

    def select_rows(self, rows: torch.Tensor) -> None:
        self.h = self.h[rows]

    def admit(self, batch, seg: Segment) -> None:
        self.h = torch.cat([self.h, seg.hidden[:, -1]], 0)


class CloverDrafter(HeadTreeDrafter):
    """Sequential heads: a node's state = step(its token, its parent's state) over a window of the
    target's hidden states (the Attention Decoder's memory); the root state comes from the
    Augmenting Block on that window."""

    def begin(self, batch, seg: Segment) -> None:
        self.mem = seg.hidden
        self.mem_valid = seg.input_valid.clone()
        self._trim()

    def _observe(self, batch, seg: Segment) -> None:
        kept = seg.hidden.gather(1, seg.keep_index[..., None].expand(-1, -1, seg.hidden.shape[-1]))
        self.mem = torch.cat([self.mem, kept], 1)
        self.mem_valid = torch.cat([self.mem_valid, seg.keep_valid], 1)
        self._trim()

    def _trim(self) -> None:
        # right-align each row's valid states, then keep the last `window` columns
        order = torch.sort(self.mem_valid.long(), dim=1, stable=True).indices
        self.mem = self.mem.gather(1, order[..., None].expand(-1, -1, self.mem.shape[-1]))
        self.mem_valid = self.mem_valid.gather(1, order)
        w = self.heads.window
        self.mem, self.mem_valid = self.mem[:, -w:], self.mem_valid[:, -w:]
        used = self.mem_valid.any(0)
        first = int(used.long().argmax().item())
        self.mem, self.mem_valid = self.mem[:, first:], self.mem_valid[:, first:]

    def select_rows(self, rows: torch.Tensor) -> None:
        self.mem, self.mem_valid = self.mem[rows], self.mem_valid[rows]
        self._trim()

    def admit(self, batch, seg: Segment) -> None:
        width = max(self.mem.shape[1], seg.hidden.shape[1])
        self.mem = torch.cat([left_pad(self.mem, width, 0.0), left_pad(seg.hidden, width, 0.0)], 0)
        self.mem_valid = torch.cat([left_pad(self.mem_valid, width, False), left_pad(seg.input_valid, width, False)], 0)
        self._trim()

    def _reset_tree(self, batch) -> None:
        mask = self.mem_valid[:, None, :]
        aug = self.heads.augmented(self.mem[:, -1:], self.mem, mask)  # query: the last committed state
        self._root_state = aug  # [B, 1, H]
        self._state = None  # [B, n, H] per node, filled as nodes are expanded
        self._root_tok = batch.root[:, None]

    def _child_logprobs(self, tree, nodes, level, batch):
        bsz, m = nodes.shape
        hsz = self.mem.shape[-1]
        if self._state is None or self._state.shape[1] < tree.size:
            pad = tree.size - (0 if self._state is None else self._state.shape[1])
            extra = torch.zeros(bsz, pad, hsz, dtype=self.mem.dtype, device=self.mem.device)
            self._state = extra if self._state is None else torch.cat([self._state, extra], 1)
        if level == 0:
            # the root's emitting state: the augmented state after consuming the root token
            prev_state, tok = self._root_state.expand(bsz, m, hsz), self._root_tok.expand(bsz, m)
        else:
            par = tree.parents.gather(1, nodes)
            states_with_root = torch.cat([self._root_emit, self._state], 1)  # slot 0 = root
            prev_state = states_with_root.gather(1, (par + 1)[..., None].expand(-1, -1, hsz))
            tok = tree.tokens.gather(1, nodes)
        state = self.heads.step(tok, prev_state, self.mem, self.mem_valid[:, None, :].expand(bsz, m, -1))
        if level > 0:
            self._state.scatter_(1, nodes[..., None].expand(-1, -1, hsz), state)
        else:
            self._root_emit = state
        head = min(level, self.heads.num_heads - 1)
        return torch.log_softmax(self.heads.head_logits(head, state).float(), -1)


class ChimeraDrafter(HeadTreeDrafter):
    """Chimera: every head reads one decoder state per round, the last committed position's (its trigram
    ending in the root), so candidates of depth d come from head d whatever the parent, as Medusa's. The
    decoder's inputs x_s (``ChimeraHeads.encode``) are computed once per committed position, when the
    token after it is known (the next kept token, or the new root), and kept over the last ``window``
    positions (right-aligned per row, as Clover keeps the target's states); ``last`` is each row's last
    committed token, the trigram's first token for the next segment's first position."""

    def begin(self, batch, seg: Segment) -> None:
        self.mem, self.mem_valid, self.last, self.last_valid = self._entries(seg.input_ids, seg.input_valid, seg.hidden, batch.root)
        self._trim()

    def _observe(self, batch, seg: Segment) -> None:
        tokens = seg.input_ids.gather(1, seg.keep_index)  # [root, accepted path...]
        hidden = seg.hidden.gather(1, seg.keep_index[..., None].expand(-1, -1, seg.hidden.shape[-1]))
        x, fresh, self.last, self.last_valid = self._entries(tokens, seg.keep_valid, hidden, batch.root, self.last, self.last_valid)
        self.mem = torch.cat([self.mem, x], 1)
        self.mem_valid = torch.cat([self.mem_valid, fresh], 1)
        self._trim()

    def _entries(self, tokens, valid, hidden, root, last=None, last_valid=None):
        """Decoder inputs of a segment's positions [B, 1+K, H], which of them are new and valid, and each
        row's last token after it. Tokens [B, K] with holes (``valid``), the hidden states [B, K, H] after
        them, ``root`` [B] the token after the last valid one, ``last`` [B] the token before the first one."""
        bsz, _, hsz = hidden.shape
        if last is None:
            last = torch.zeros(bsz, dtype=torch.long, device=tokens.device)
            last_valid = torch.zeros(bsz, dtype=torch.bool, device=tokens.device)
        tok = torch.cat([last[:, None], tokens], 1)
        val = torch.cat([last_valid[:, None], valid], 1)
        hid = torch.cat([hidden.new_zeros(bsz, 1, hsz), hidden], 1)
        # right-align each row's valid tokens: a valid token's neighbours are then the columns beside it
        order = torch.sort(val.long(), dim=1, stable=True).indices
        tok, val = tok.gather(1, order), val.gather(1, order)
        hid = hid.gather(1, order[..., None].expand(-1, -1, hsz))
        prev = torch.nn.functional.pad(tok[:, :-1], (1, 0), value=0)
        prev_valid = torch.nn.functional.pad(val[:, :-1], (1, 0), value=False)
        nxt = torch.cat([tok[:, 1:], root[:, None]], 1)
        x = self.heads.encode(prev, prev_valid, tok, nxt, hid.to(next(self.heads.parameters()).dtype))
        return x, val & (order > 0), tok[:, -1], val[:, -1]

    def _trim(self) -> None:
        self.mem, self.mem_valid = _window(self.mem, self.mem_valid, self.heads.window)

    def select_rows(self, rows: torch.Tensor) -> None:
        self.mem, self.mem_valid = self.mem[rows], self.mem_valid[rows]
        self.last, self.last_valid = self.last[rows], self.last_valid[rows]
        self._trim()

    def admit(self, batch, seg: Segment) -> None:
        x, fresh, last, last_valid = self._entries(seg.input_ids, seg.input_valid, seg.hidden, batch.root)
        x, fresh = _window(x, fresh, self.heads.window)
        width = max(self.mem.shape[1], x.shape[1])
        self.mem = torch.cat([left_pad(self.mem, width, 0.0), left_pad(x, width, 0.0)], 0)
        self.mem_valid = torch.cat([left_pad(self.mem_valid, width, False), left_pad(fresh, width, False)], 0)
        self.last, self.last_valid = torch.cat([self.last, last]), torch.cat([self.last_valid, last_valid])
        self._trim()

    def _reset_tree(self, batch) -> None:
        # the query: each row's last decoder input (right-aligned, so the last column)
        d = self.heads.decoded(self.mem[:, -1:], self.mem, self.mem_valid[:, None, :])[:, 0]
        self._logp = torch.log_softmax(self.heads.head_logits(d).float(), -1)  # [heads, B, V]

    def _child_logprobs(self, tree, nodes, level, batch):
        return self._logp[level][:, None].expand(-1, nodes.shape[1], -1)


def _window(mem: torch.Tensor, valid: torch.Tensor, window: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's valid entries right-aligned, the last ``window`` columns kept, then leading columns no row uses dropped."""
    order = torch.sort(valid.long(), dim=1, stable=True).indices
    mem = mem.gather(1, order[..., None].expand(-1, -1, mem.shape[-1]))
    valid = valid.gather(1, order)
    mem, valid = mem[:, -window:], valid[:, -window:]
    first = int(valid.any(0).long().argmax().item())
    return mem[:, first:], valid[:, first:]


class _SlotCache(SlotBook):
    """The EAGLE layer's keys/values per row: committed entries on a shared slot axis with per-row
    holes and positions (``SlotBook``, as the target's ``KVState``), then, during a round, scratch
    slots for the tree nodes that were expanded, in order of expansion. Nodes are never committed:
    the next commit overwrites them."""

    def __init__(self, bsz: int, kv_heads: int, head_dim: int, dtype, device):
        super().__init__(bsz, device)
        self.k = torch.zeros(bsz, kv_heads, 0, head_dim, dtype=dtype, device=device)
        self.v = torch.zeros_like(self.k)

    def reserve(self, n: int) -> None:
        """Room for n slots after the committed ones (grows by doubling: amortised copies)."""
        cap = self.k.shape[2]
        if self.length + n > cap:
            grow = max(self.length + n, 2 * cap, 256) - cap
            pad = torch.zeros(*self.k.shape[:2], grow, self.k.shape[3], dtype=self.k.dtype, device=self.k.device)
            self.k, self.v = torch.cat([self.k, pad], 2), torch.cat([self.v, pad], 2)

    def write(self, slots: torch.Tensor, width: int):
        """A ``DraftLayer`` store: this segment's keys go to ``slots`` [B, T] (absolute); attention
        reads the first ``width`` slots."""

        def store(k, v):
            idx = slots[:, None, :, None].expand(-1, k.shape[1], -1, k.shape[3])
            self.k.scatter_(2, idx, k)
            self.v.scatter_(2, idx, v)
            return self.k[:, :, :width], self.v[:, :, :width]

        return store

    def commit(self, valid: torch.Tensor) -> None:
        self._append(valid)

    def select_rows(self, rows: torch.Tensor) -> None:
        self.k, self.v = self.k[rows], self.v[rows]
        self._select(rows)

    def admit(self, other: "_SlotCache") -> None:
        """Append other's rows after these, the slot axes aligned as ``SlotBook._admit`` aligns them."""
        width = max(self.length, other.length)
        self.k, self.v = (
            torch.cat([left_pad(a[:, :, : self.length], width, 0.0, dim=2), left_pad(b[:, :, : other.length], width, 0.0, dim=2)], 0)
            for a, b in ((self.k, other.k), (self.v, other.v))
        )
        self._admit(other)


class EagleDrafter(HeadTreeDrafter):
    """EAGLE: a one-layer feature drafter with its own KV cache of true (token, feature) entries for
    committed text. A tree node is the entry (its token, its parent's predicted feature); each level
    runs only the nodes it expands, attending to the committed entries and to their ancestors'
    scratch slots (tree attention), so a round costs one small layer call per level.

    A round's kept entries wait until the next tree, which commits every waiting round's entries in one
    layer call (as BlockDrafter's do): with lookup (``decode.drafters.hybrid``) the head grows trees only in
    some rounds, and the rounds between cost it no call of its layer."""

    def __init__(self, heads, target, **kw):
        super().__init__(heads, target, **kw)
        # EAGLE-3 artifacts read several target layers (fused by the head); the engine returns them
        self.hidden_layers = tuple(heads.feature_layers) if heads.feature_layers else None

    def _features(self, seg: Segment, index: torch.Tensor | None = None) -> torch.Tensor:
        """The drafter's input feature per slot (per slot of ``index`` [B, T] where given: the states gathered
        before the fusion, which then runs on those slots only): the last hidden state, or the fused EAGLE-3 layers."""
        states = (seg.hidden,) if self.hidden_layers is None else seg.hidden_layers
        if index is not None:
            states = [x.gather(1, index[..., None].expand(-1, -1, x.shape[-1])) for x in states]
        if self.hidden_layers is None:
            return states[0]
        return self.heads.fuse(torch.cat(states, dim=-1).to(self.heads.fuse.weight.dtype))

    def _commit(self, tokens: torch.Tensor, valid: torch.Tensor, feats: torch.Tensor, cache: "_SlotCache | None" = None) -> torch.Tensor:
        """Append true entries (holes where ``valid`` is False) to ``cache`` (default: the drafter's);
        their predicted features [B, T, H]."""
        c = self.cache if cache is None else cache
        b, t = tokens.shape
        dev = tokens.device
        pos = c.pos[:, None] + (valid.long().cumsum(-1) - 1).clamp_(min=0)
        own = torch.ones(t, t, dtype=torch.bool, device=dev).tril_() & valid[:, None, :]
        own |= torch.eye(t, dtype=torch.bool, device=dev)  # a hole still sees itself: no empty softmax row
        mask = additive_mask(torch.cat([c.valid[:, None, :].expand(b, t, c.length), own], -1), c.k.dtype)[:, None]
        c.reserve(t)
        slots = torch.arange(c.length, c.length + t, device=dev)[None].expand(b, t)
        out = self.heads.run(self.heads.entry(tokens, feats), mask, pos, c.write(slots, c.length + t))
        c.commit(valid)
        return out

    def begin(self, batch, seg: Segment) -> None:
        self._waiting = []
        self.cache, self.f_root = self._prefill(batch, seg)

    def admit(self, batch, seg: Segment) -> None:
        self._catch_up()
        cache, f_root = self._prefill(batch, seg)
        self.cache.admit(cache)
        self.f_root = torch.cat([self.f_root, f_root], 0)

    def _prefill(self, batch, seg: Segment) -> tuple[_SlotCache, torch.Tensor]:
        """A cache of the prompts' entries and each row's root feature."""
        layer = self.heads.layer
        p = next(self.heads.parameters())
        cache = _SlotCache(len(batch.seqs), layer.kv_heads, layer.head_dim, p.dtype, p.device)
        nxt = torch.cat([seg.input_ids[:, 1:], batch.root[:, None]], 1)  # entry t = (token t+1, f_t)
        return cache, self._commit(nxt, seg.input_valid, self._features(seg), cache)[:, -1]

    def _observe(self, batch, seg: Segment) -> None:
        ids = seg.input_ids.gather(1, seg.keep_index)  # [root, accepted path...]
        nxt = torch.cat([ids[:, 1:], batch.root[:, None]], 1)
        acc = torch.tensor(seg.accepted, device=nxt.device)
        rows = torch.arange(nxt.shape[0], device=nxt.device)
        nxt[rows, acc] = batch.root  # the token after each row's last kept slot is its new root
        self._waiting.append(((nxt, seg.keep_valid, self._features(seg, seg.keep_index)), list(seg.accepted)))

    def _catch_up(self) -> None:
        """Commit the waiting rounds' entries in one call; ``f_root`` becomes the newest round's root feature."""
        drained = self._drain()
        if drained is None:
            return
        (tokens, valid, feats), last = drained
        out = self._commit(tokens, valid, feats)
        self.f_root = out[torch.arange(out.shape[0], device=out.device), last]

    def select_rows(self, rows: torch.Tensor) -> None:
        self._catch_up()
        self.cache.select_rows(rows)
        self.f_root = self.f_root[rows]

    def _reset_tree(self, batch) -> None:
        self._catch_up()
        self._fh = self.f_root.new_zeros(self.f_root.shape[0], 0, self.f_root.shape[-1])  # [B, n, H] predicted feature per tree node (zeros until expanded)
        self._slot_nodes = torch.zeros(self.f_root.shape[0], 0, dtype=torch.long, device=self.f_root.device)  # tree node of each scratch slot

    def _child_logprobs(self, tree, nodes, level, batch):
        bsz, m = nodes.shape
        if level == 0:
            return torch.log_softmax(self.heads.lm_logits(self.f_root).float(), -1)[:, None].expand(bsz, m, -1)
        c, n = self.cache, tree.size
        if self._fh.shape[1] < n:
            self._fh = torch.cat([self._fh, self._fh.new_zeros(bsz, n - self._fh.shape[1], self._fh.shape[2])], 1)
        par = tree.parents.gather(1, nodes)
        fh_with_root = torch.cat([self.f_root[:, None], self._fh], 1)
        feats = fh_with_root.gather(1, (par + 1)[..., None].expand(-1, -1, fh_with_root.shape[-1]))
        toks = tree.tokens.gather(1, nodes)
        pos = c.pos[:, None] + tree.depth.gather(1, nodes) - 1
        # scratch slots hold the expanded nodes; a node sees the slots of its ancestors and its own
        first = self._slot_nodes.shape[1]
        self._slot_nodes = torch.cat([self._slot_nodes, nodes], 1)
        e = self._slot_nodes.shape[1]
        sees = tree.anc.gather(1, nodes[..., None].expand(bsz, m, n)).gather(2, self._slot_nodes[:, None, :].expand(bsz, m, e))
        visible = torch.cat([c.valid[:, None, :].expand(bsz, m, c.length), sees], -1)
        c.reserve(e)
        slots = torch.arange(c.length + first, c.length + e, device=nodes.device)[None].expand(bsz, m)
        fh = self.heads.run(self.heads.entry(toks, feats), additive_mask(visible, c.k.dtype)[:, None], pos, c.write(slots, c.length + e))
        self._fh.scatter_(1, nodes[..., None].expand(-1, -1, fh.shape[-1]), fh)
        return torch.log_softmax(self.heads.lm_logits(fh).float(), -1)


class BlockDrafter(HeadTreeDrafter):
    """A block drafter (models.block.BlockHead): one draft call per round gives the K positions' distributions;
    depth d's candidates are position d's top-k whatever the parent (a chain with --top-k 1, else a
    Medusa-style tree). The context's keys and values per draft layer live in slot caches of committed
    positions (the target's features, as EAGLE's cache holds its entries).

    A round's kept states wait until the next draft call, which commits every waiting round's entries in
    one pass: with lookup (``decode.drafters.hybrid``) the block runs only in the rounds without a long
    match, and the rounds between cost it nothing but the states' copies."""

    def __init__(self, heads, target, **kw):
        super().__init__(heads, target, **kw)
        self.hidden_layers = tuple(heads.feature_layers) if heads.feature_layers else None

    def _layers(self, seg: Segment) -> tuple:
        return seg.hidden_layers if self.hidden_layers is not None else (seg.hidden,)

    def _context(self, seg: Segment) -> torch.Tensor:
        return self.heads.context_of(self._layers(seg))

    def _commit(self, caches: list, ctx: torch.Tensor, valid: torch.Tensor) -> None:
        """Append the context entries ``ctx`` [B, T, H] (holes where ``valid`` is False) to every layer's cache
        (the caller keeps each row's last entry: the next block's queries read it)."""
        b, t, _ = ctx.shape
        c0 = caches[0]
        pos = c0.pos[:, None] + (valid.long().cumsum(-1) - 1).clamp_(min=0)
        slots = torch.arange(c0.length, c0.length + t, device=ctx.device)[None].expand(b, t)
        for layer, c in zip(self.heads.layers, caches):
            k, v = self.heads.context_kv(layer, ctx, pos)
            c.reserve(t)
            c.write(slots, c.length + t)(k, v)
            c.commit(valid)

    def _prefill(self, batch, seg: Segment) -> tuple[list, torch.Tensor]:
        """Caches of the prompts' context entries, and each row's last entry."""
        p = next(self.heads.parameters())
        caches = [_SlotCache(len(batch.seqs), layer.kv_heads, layer.head_dim, p.dtype, p.device) for layer in self.heads.layers]
        ctx = self._context(seg)
        self._commit(caches, ctx, seg.input_valid)
        return caches, ctx[:, -1]  # prompts are left-padded: the last slot is every row's last token

    def begin(self, batch, seg: Segment) -> None:
        self._waiting = []
        self.caches, self.last = self._prefill(batch, seg)

    def admit(self, batch, seg: Segment) -> None:
        self._catch_up()
        caches, last = self._prefill(batch, seg)
        for c, new in zip(self.caches, caches):
            c.admit(new)
        self.last = torch.cat([self.last, last], 0)

    def _observe(self, batch, seg: Segment) -> None:
        """The kept slots' states (root + accepted path), gathered before the context map runs on them."""
        idx = seg.keep_index[..., None]
        kept = [x.gather(1, idx.expand(-1, -1, x.shape[-1])) for x in self._layers(seg)]
        self._waiting.append(((seg.keep_valid, *kept), list(seg.accepted)))

    def _catch_up(self) -> None:
        """Commit the waiting rounds' entries in one pass; ``last`` becomes the newest round's last kept entry."""
        drained = self._drain()
        if drained is None:
            return
        (valid, *layers), last = drained
        ctx = self.heads.context_of(layers)
        self._commit(self.caches, ctx, valid)
        self.last = ctx[torch.arange(ctx.shape[0], device=ctx.device), last]

    def select_rows(self, rows: torch.Tensor) -> None:
        self._catch_up()
        for c in self.caches:
            c.select_rows(rows)
        self.last = self.last[rows]

    def _reset_tree(self, batch) -> None:
        """The round's one draft call: the block after each row's root, attending to its committed context."""
        self._catch_up()
        h, caches = self.heads, self.caches
        c0 = caches[0]
        bsz, k = len(batch.seqs), h.block_len
        dev = c0.valid.device
        x = h.block_inputs(batch.root[:, None], self.last[:, None])[:, 0]  # [B, L, H]
        pos = c0.pos[:, None] + torch.arange(k, device=dev)
        visible = torch.cat([c0.valid[:, None, :].expand(bsz, k, c0.length), torch.ones(bsz, k, k, dtype=torch.bool, device=dev)], -1)
        slots = torch.arange(c0.length, c0.length + k, device=dev)[None].expand(bsz, k)
        stores = []
        for c in caches:
            c.reserve(k)
            stores.append(c.write(slots, c.length + k))
        out = h.drafted(h.run(x, additive_mask(visible, c0.k.dtype)[:, None], pos, stores))
        self._logp = torch.log_softmax(h.lm_logits(out).float(), -1)  # [B, K, V]

    def _child_logprobs(self, tree, nodes, level, batch):
        return self._logp[:, level][:, None].expand(-1, nodes.shape[1], -1)


DRAFTERS = {"medusa": MedusaDrafter, "clover": CloverDrafter, "eagle": EagleDrafter, "chimera": ChimeraDrafter, "block": BlockDrafter}


def build_head_drafter(artifact_dir: Path, target, tokenizer, options) -> Drafter:
    """Factory for ``--drafter DIR`` of kind medusa/clover/eagle/chimera.

    options: ``num_draft`` (tree depth; None = the kind's default), ``tree`` ("static" or "dynamic";
    None = dynamic for EAGLE, static for the others), ``tree_tokens`` (nodes per tree; None = default),
    optional ``top_k``, ``draft_weights`` ("float32" keeps the heads' float32 matrices; else Q8_0 blocks on a CPU).
    """
    cfg = read_config(artifact_dir)
    kind = cfg.get("kind")
    if kind is None:  # a draft in a published layout, converted on load (models/interop.py)
        from specdec.models.interop import load_foreign_heads

        heads, cfg = load_foreign_heads(artifact_dir, target, tokenizer)
        kind = cfg["kind"]
    else:
        if kind not in DRAFTERS:
            raise SpecdecError(f"{artifact_dir} is not a {'/'.join(DRAFTERS)} artifact (kind {kind!r})")
        check_fingerprint(cfg["target"], tokenizer_fingerprint(tokenizer), f"{kind} artifact {artifact_dir}")
        heads, _ = load_heads(artifact_dir, target)
    if getattr(options, "draft_weights", None) != "float32" and isinstance(heads, torch.nn.Module):
        from specdec.models.blocks import quantize_layers

        quantize_layers(heads)  # on a CPU where the kernel builds; float32 layers elsewhere
    return DRAFTERS[kind](
        heads, target,
        tree=getattr(options, "tree", None) or ("dynamic" if kind == "eagle" else "static"),
        tree_tokens=getattr(options, "tree_tokens", None),
        depth=getattr(options, "num_draft", None),
        top_k=getattr(options, "top_k", None),
    )
