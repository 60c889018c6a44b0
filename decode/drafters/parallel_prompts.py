"""PPD (parallel prompt decoding) and Hidden Transfer: drafts predicted inside the target's own verify forward.

Both drafters declare ``ride_positions = m`` (``decode.drafters.base.Riding``): the engine appends m positions
after each row's chain in every verify forward, at positions continuing after its last draft, seeing the
committed text, the root and all the row's drafts; their key/value slots are never committed. The drafter
injects its inputs there through forward hooks on the target (``riding``, entered by the engine around that
forward; the modules' ``injecting``, ``models.heads``):
  - PPD (``ppd`` artifacts, ``PromptTokens``): m trained soft prompt embeddings replace the input embeddings;
  - Hidden Transfer (``hidden-transfer`` artifacts, ``TransferMaps``): the output of decoder layer l at the
    riding positions is replaced by W_j h_l(last real position), run through the remaining layers.
Riding position j predicts the token two past the row's last real position, plus j: when the row accepts all
its drafts, the new root is the target's token after the last draft and the riding predictions are the chain
after it, proposed the next round (argmax: one-hot drafts, lossless at any temperature). A row that rejected a
draft proposes nothing that round; its next forward carries [root, riding positions], whose predictions are
valid again. Chains only (no trees), one chain per row. PPD's ensemble (e prompt embeddings per future
position) rides e chains of m positions, each blind to the others (``ride_layout``), and drafts the argmax of
their mean logits.
"""

from __future__ import annotations

import heapq
from pathlib import Path

import torch

from specdec.decode.drafters.base import Proposal, Riding, Segment, tree_proposal
from specdec.decode.engine.length import LengthPolicy
from specdec.models.artifacts import check_fingerprint, read_config, tokenizer_fingerprint
from specdec.models.errors import SpecdecError
from specdec.models.head_artifacts import load_heads
from specdec.models.heads import RIDE_KINDS


TREE_NODES = 8  # a sparse tree's most nodes (--tree-tokens): each carries a riding chain, so the width is (1 + n)(1 + e m)
TOP_K = 3  # candidates per future position a sparse tree draws from (--top-k)
PRIOR = (0.5, 0.1)  # a position's chance that the target's token is its top-1 / a lower candidate, before any is seen
PRIOR_WEIGHT = 2.0
DECAY = 0.995  # observations fade: the text changes as a job goes on


class RidingDrafter(Riding):
    """A drafter whose drafts are the predictions of positions riding the previous verify forward; ``heads``
    (a ``models.heads`` PromptTokens or TransferMaps, attached to ``target``) injects their inputs.

    ``tree`` None: one chain, its riding positions after the row's last draft (drafts are ready only when the
    row accepted every one). ``tree`` "static" or "dynamic" (PPD's sparse tree): the nodes are paths of the
    riding predictions' top-``top_k`` candidates, those most likely accepted first (each position's chance
    per candidate rank, counted on the job's own verdicts), and every node, the root included, carries a
    riding chain, so whichever node a row stops at, the next round's candidates follow it. Static: ``nodes``
    nodes; dynamic: as many (at most ``nodes``) as maximise expected tokens per second of the measured forward
    of width (1 + n)(1 + e m) (``decode.engine.length.DraftLength.tree_size``)."""

    def __init__(self, heads, target, num_draft: int | None = None, tree: str | None = None, nodes: int | None = None,
                 top_k: int | None = None):
        self.heads, self.target = heads, target
        self.chain = heads.riding_width  # positions of one riding chain (PPD's ensemble: e chains of m)
        self.ride_positions = self.chain
        self.default_k = heads.num_heads if num_draft is None else min(int(num_draft), heads.num_heads)
        self.tree = tree
        self.nodes = int(nodes or TREE_NODES)
        self.top_k = int(top_k or TOP_K)
        if tree is not None:
            self.proposes_trees = True
            self.length_policy = LengthPolicy.tree if tree == "dynamic" else LengthPolicy.own
            self.length = None  # set by the engine where forward costs are measured
        m = heads.num_heads
        self.hits = torch.tensor([[PRIOR[0]] + [PRIOR[1]] * (self.top_k - 1)] * m, dtype=torch.float64) * PRIOR_WEIGHT
        self.trials = torch.full((m,), PRIOR_WEIGHT, dtype=torch.float64)
        self.next: torch.Tensor | None = None  # [B, m] chain: each row's riding predictions of the last forward
        self.cands: torch.Tensor | None = None  # [B, m, top_k] tree: their top candidates
        self.ready: torch.Tensor | None = None  # [B] bool: they follow the row's new root
        self.asked: torch.Tensor | None = None  # [B, m, top_k] tree: the candidates the last proposal drew from

    def modules(self) -> list:
        return [self.heads] if isinstance(self.heads, torch.nn.Module) else []

    def ride_count(self, slots: int) -> int:
        return slots * self.chain if self.tree is not None else self.chain

    def ride_ids(self, bsz: int, device, count: int | None = None) -> torch.Tensor:
        return torch.full((bsz, count or self.ride_positions), self.heads.placeholder, dtype=torch.long, device=device)

    def riding(self, start: int, last: torch.Tensor):
        bsz = last.shape[0]
        if self.tree is not None:  # a chain after every slot: the root's, then each node's
            src = torch.arange(start, device=last.device).repeat_interleave(self.chain)[None].expand(bsz, -1)
        else:
            src = last[:, None].expand(-1, self.chain)
        cols = start + torch.arange(src.shape[1], device=last.device)[None].expand(bsz, -1)
        return self.heads.injecting(cols, src)

    def ride_layout(self, start: int, last: torch.Tensor, valid: torch.Tensor, tree=(None, None)):
        """Which slots of [root, drafts, riding...] each sees and their position offsets, where the default (causal,
        positions counting valid slots) is wrong: an ensemble's chains must not see each other (as in training),
        and a tree's chains see their node's ancestors only, at positions continuing from their node."""
        e, m = self.heads.ensemble, self.heads.num_heads
        bsz, t = valid.shape
        dev = valid.device
        j = torch.arange(t - start, device=dev) % m
        group = torch.arange(t - start, device=dev) // m
        own = (group[:, None] == group[None, :]) & (j[None, :] <= j[:, None])  # a position sees its own chain up to itself
        if self.tree is None:
            if e == 1:
                return None
            attn = torch.ones(t, t, dtype=torch.bool, device=dev).tril_()
            attn[start:, start:] = own
            depth = (valid.long().cumsum(-1) - 1).clamp_(min=0)
            depth[:, start:] = last[:, None] + 1 + j[None]
            return attn[None].expand(bsz, t, t), depth
        node_attn, node_depth = tree
        if node_attn is None:  # no proposal: the root alone
            node_attn = torch.ones(bsz, 1, 1, dtype=torch.bool, device=dev)
            node_depth = torch.zeros(bsz, 1, dtype=torch.long, device=dev)
        slot = torch.arange(start, device=dev).repeat_interleave(self.chain)
        attn = torch.zeros(bsz, t, t, dtype=torch.bool, device=dev)
        attn[:, :start, :start] = node_attn
        attn[:, start:, :start] = node_attn[:, slot]  # what its node sees, the node included
        attn[:, start:, start:] = own
        depth = torch.cat([node_depth, node_depth[:, slot] + 1 + j[None]], dim=1)
        return attn, depth

    def begin(self, batch, seg: Segment) -> None:
        self.next = self.cands = self.asked = None
        self.ready = torch.zeros(len(batch.seqs), dtype=torch.bool, device=batch.device)

    def propose(self, batch) -> Proposal | None:
        k = min(self.heads.num_heads, batch.num_draft)
        if k <= 0 or self.ready is None or not bool(self.ready.any()):
            return None
        if self.tree is None:
            if self.next is None:
                return None
            return Proposal(tokens=self.next[:, :k], lengths=torch.where(self.ready, k, 0))
        if self.cands is None:
            return None
        paths, chances = self._paths(k)
        n = len(paths)
        if self.length is not None and n > 1:
            scores = torch.tensor(chances, dtype=torch.float64).log()[None].expand(len(batch.seqs), -1)
            n = self.length.tree_size(scores, n, 0, width=lambda nodes: (1 + nodes) * (1 + self.chain))
        paths = sorted(paths[:n], key=lambda p: (len(p), p))  # parents before children
        index = {p: i for i, p in enumerate(paths)}
        parents = [index.get(p[:-1], -1) for p in paths]
        cands = self.cands.tolist()
        trees = [([cands[r][len(p) - 1][p[-1]] for p in paths], parents) if ok else ([], [])
                 for r, ok in enumerate(self.ready.tolist())]
        self.asked = self.cands
        return tree_proposal(trees, batch.device)

    def _paths(self, depth: int) -> tuple[list[tuple[int, ...]], list[float]]:
        """The paths of candidate ranks, at most ``self.nodes``, best first by the product of each position's
        chance that the target's token is that rank's candidate (prefix-closed: a path is worth at most its prefix)."""
        p = (self.hits / self.trials[:, None]).clamp(1e-6, 1.0).tolist()
        heap = [(-p[0][r], (r,)) for r in range(self.top_k)]
        heapq.heapify(heap)
        paths, chances = [], []
        while heap and len(paths) < self.nodes:
            neg, path = heapq.heappop(heap)
            paths.append(path)
            chances.append(-neg)
            if len(path) < depth:
                for r in range(self.top_k):
                    heapq.heappush(heap, (neg * p[len(path)][r], path + (r,)))
        return paths, chances

    def observe(self, batch, seg: Segment) -> None:
        if seg.ride_logits is None:  # no position rode this forward (no room left for drafts)
            self.next = self.cands = None
            self.ready = torch.zeros(len(batch.seqs), dtype=torch.bool, device=batch.device)
            return
        if self.tree is None:
            drafted = seg.input_valid[:, 1:].sum(-1)
            accepted = torch.tensor(seg.accepted, device=drafted.device)
            self.ready = accepted == drafted
            self.next = self.heads.to_target(self.heads.combine(seg.ride_logits).argmax(-1))
            return
        bsz, slots = seg.input_ids.shape
        if self.asked is not None:
            self._count(batch, seg.accepted)
        accepted = torch.tensor(seg.accepted, device=seg.keep_index.device)
        last = seg.keep_index.gather(1, accepted[:, None]).squeeze(1)  # the slot of each row's deepest accepted node
        chains = seg.ride_logits.view(bsz, slots, self.chain, -1)[torch.arange(bsz, device=last.device), last]
        self.cands = self.heads.to_target(self.heads.combine(chains).topk(self.top_k, dim=-1).indices)
        self.ready = torch.ones(bsz, dtype=torch.bool, device=batch.device)
        self.asked = None

    def _count(self, batch, accepted: list[int]) -> None:
        """Each position's hits by candidate rank: the target's tokens at depths 0..accepted (the accepted path, then
        its own next token) against the candidates the round's tree drew from."""
        self.hits.mul_(DECAY)
        self.trials.mul_(DECAY)
        asked = self.asked.tolist()
        m = self.heads.num_heads
        for r, (a, seq) in enumerate(zip(accepted, batch.seqs)):
            if not self.ready[r] or len(seq) < a + 1:
                continue
            got = seq[len(seq) - a - 1 :]
            for d in range(min(a + 1, m)):
                self.trials[d] += 1
                if got[d] in asked[r][d]:
                    self.hits[d, asked[r][d].index(got[d])] += 1

    def select_rows(self, rows: torch.Tensor) -> None:
        self.ready = self.ready[rows]
        for name in ("next", "cands", "asked"):
            if getattr(self, name) is not None:
                setattr(self, name, getattr(self, name)[rows])

    def admit(self, batch, seg: Segment) -> None:
        """New rows propose nothing until a forward has carried their riding positions."""
        n = len(batch.seqs)
        self.ready = torch.cat([self.ready, torch.zeros(n, dtype=torch.bool, device=self.ready.device)])
        for name in ("next", "cands", "asked"):
            x = getattr(self, name)
            if x is not None:
                setattr(self, name, torch.cat([x, x.new_zeros(n, *x.shape[1:])]))


def build_riding_drafter(artifact_dir: Path, target, tokenizer, options) -> RidingDrafter:
    """Factory for ``--drafter DIR`` of kind ppd / hidden-transfer; ``options.num_draft`` caps the chain at the
    artifact's m riding positions."""
    cfg = read_config(artifact_dir)
    kind = cfg.get("kind")
    if kind not in RIDE_KINDS:
        raise SpecdecError(f"{artifact_dir} is not a {'/'.join(RIDE_KINDS)} artifact (kind {kind!r})")
    check_fingerprint(cfg["target"], tokenizer_fingerprint(tokenizer), f"{kind} artifact {artifact_dir}")
    heads, _ = load_heads(artifact_dir, target)
    return RidingDrafter(heads, target, getattr(options, "num_draft", None), tree=getattr(options, "tree", None),
                         nodes=getattr(options, "tree_tokens", None), top_k=getattr(options, "top_k", None))
