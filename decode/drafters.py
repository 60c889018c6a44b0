"""Drafters: everything that proposes tokens for the one decode loop to verify.

A drafter implements five steps, all batched over the active rows:
  begin(batch, seg)      after the target's prefill (seg holds its inputs, logits, hidden states)
  propose(batch)         -> Proposal (a chain or a token tree per row) or None for a plain step
  observe(batch, seg)    after each verification (seg also holds what each row kept)
  select_rows(rows)      rows that finished leave the batch
  admit(batch, seg)      continuous batching: new rows join after the running ones; batch and seg
                         are the new rows' own prefill, exactly as ``begin`` would get them
A drafter with per-row state that does not implement ``admit`` refuses it (``admits`` is False), so
a running batch never goes on with state that lacks the new rows.
The registry maps a kind (as written in an artifact's config.json, or a model-free name) to a
factory; the CLI never branches on names.
"""

from __future__ import annotations

import copy
import heapq
from dataclasses import dataclass
from typing import Callable

import torch

from specdec.decode.cache import KVState
from specdec.decode.verify import logits_to_probs
from specdec.models import arch
from specdec.models.errors import SpecdecError, UsageError


@dataclass
class Proposal:
    tokens: torch.Tensor  # [B, N]
    parents: torch.Tensor | None = None  # [B, N] parent node index, -1 = child of the root; None = chain
    lengths: torch.Tensor | None = None  # chain only: valid drafts per row (default N)
    # [B, N, V] tempered draft distribution each draft was sampled from (chain; or a tree's, per node)
    draft_probs: torch.Tensor | None = None
    # how a tree's sampled siblings are verified: "standard" (one-hot q, verify_tree) or one of
    # verify.TREE_SCHEMES ("rsd": siblings drawn without replacement, "spectr": i.i.d.), with draft_probs
    scheme: str = "standard"
    tree_attn: torch.Tensor | None = None  # [B or 1, N+1, N+1] ancestor matrix incl. the root (derived if None)
    depth: torch.Tensor | None = None  # [B or 1, N+1] depth of the root (0) and of each node
    max_depth: int = 0
    # PEARL's pre-verify (a chain without lengths): tokens [B, 1] hold each row's first draft only, the
    # drafter draws the rest meanwhile; rest() waits for them and returns the whole chain, first draft included
    rest: Callable[[], Proposal] | None = None
    # chain only: each row's drafter-given class for decode.length (n-gram: the match length; default 0)
    classes: list[int] | None = None

    @property
    def is_tree(self) -> bool:
        return self.parents is not None


@dataclass
class Segment:
    """What one target forward saw and produced, handed to drafters."""

    input_ids: torch.Tensor  # [B, T]
    input_valid: torch.Tensor  # [B, T]
    logits: torch.Tensor  # [B, T, V]
    hidden: torch.Tensor | None  # [B, T, H] last hidden states, when a drafter asked for them
    hidden_layers: tuple | None = None  # the hidden states of the layers in ``Drafter.hidden_layers`` (EAGLE-3)
    keep_index: torch.Tensor | None = None  # [B, M] segment slots each row kept (root + accepted path)
    keep_valid: torch.Tensor | None = None  # [B, M]
    accepted: list[int] | None = None  # per row, accepted draft nodes this round


class Drafter:
    needs_hidden = False
    hidden_layers: tuple[int, ...] | None = None  # extra hidden-state layers the drafter reads (EAGLE-3)
    default_k = 4
    # how decode.length may choose a round's chain length on a CPU: "after" (the engine trims a proposal:
    # drafting cost nothing), "before" (the engine sets batch.num_draft before a draft model drafts) or
    # None (the drafter decides its lengths itself)
    length_policy: str | None = None

    def begin(self, batch, seg: Segment) -> None:
        pass

    def propose(self, batch) -> Proposal | None:
        return None

    def observe(self, batch, seg: Segment) -> None:
        pass

    def select_rows(self, rows: torch.Tensor) -> None:
        pass

    def admit(self, batch, seg: Segment) -> None:
        raise SpecdecError(f"the {type(self).__name__} drafter cannot take new rows into a running batch: decode with --schedule static")


def chain_proposal(drafts: list[list[int]], device) -> Proposal | None:
    """A chain proposal of per-row token lists of any lengths (None when no row has a draft)."""
    width = max(map(len, drafts), default=0)
    if width == 0:
        return None
    tokens = torch.zeros(len(drafts), width, dtype=torch.long)
    for r, d in enumerate(drafts):
        tokens[r, : len(d)] = torch.tensor(d, dtype=torch.long)
    lengths = torch.tensor([len(d) for d in drafts])
    return Proposal(tokens=tokens.to(device), lengths=lengths.to(device))


def tree_proposal(trees: list[tuple[list[int], list[int]]], device, **fields) -> Proposal | None:
    """A tree proposal of per-row (tokens, parents) lists (parent -1: a child of the root; nodes in
    topological order), padded with parent -2; None when no row has a node. ``fields`` go to the
    Proposal as they are (a sampled tree's ``draft_probs`` and ``scheme``)."""
    width = max((len(t) for t, _ in trees), default=0)
    if width == 0:
        return None
    tokens = torch.zeros(len(trees), width, dtype=torch.long)
    parents = torch.full((len(trees), width), -2, dtype=torch.long)
    max_depth = 0
    for r, (tok, par) in enumerate(trees):
        if tok:
            tokens[r, : len(tok)] = torch.tensor(tok)
            parents[r, : len(par)] = torch.tensor(par)
            depth: list[int] = []
            for p in par:
                depth.append(1 if p < 0 else depth[p] + 1)
            max_depth = max(max_depth, max(depth))
    tokens, parents = tokens.to(device), parents.to(device)
    attn, dep = tree_attention_from_parents(parents)
    return Proposal(tokens=tokens, parents=parents, tree_attn=attn, depth=dep, max_depth=max_depth, **fields)


def draw(logits: torch.Tensor, sampling, generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A draft token per row and the tempered q it was drawn from (greedy: the argmax, no q)."""
    if sampling.greedy:
        return logits.argmax(-1), None
    q = logits_to_probs(logits, sampling)
    return torch.multinomial(q, 1, generator=generator).squeeze(-1), q


def admits(drafter: Drafter) -> bool:
    """Whether the drafter can take new rows into a running batch (continuous batching)."""
    return type(drafter).admit is not Drafter.admit


class NoDrafter(Drafter):
    """Plain autoregressive decoding: the loop with nothing to verify (method ``ar``)."""

    default_k = 0

    def admit(self, batch, seg: Segment) -> None:
        pass


# ---------------------------------------------------------------------------------------------
# Trees


def tree_attention_from_parents(parents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Ancestor matrix [B, N+1, N+1] (root at 0, a node sees itself and its ancestors) and depth."""
    bsz, n = parents.shape
    slot = (parents + 1).clamp(min=0)
    adj = torch.zeros(bsz, n + 1, n + 1, dtype=torch.float32, device=parents.device)
    rows = torch.arange(bsz, device=parents.device)[:, None].expand(bsz, n)
    nodes = torch.arange(1, n + 1, device=parents.device)[None].expand(bsz, n)
    adj[rows, nodes, slot] = 1.0
    anc = adj + torch.eye(n + 1, device=parents.device)
    # transitive closure by repeated squaring: depth <= n, so log2(n) + 1 rounds suffice
    for _ in range(max(1, int(n).bit_length())):
        anc = (anc @ anc).clamp_(max=1.0)
    anc = anc > 0
    depth = anc.sum(-1) - 1
    return anc, depth


@dataclass
class TreeTemplate:
    """A static tree: node i extends node parents[i] with that node's ranks[i]-th candidate."""

    parents: list[int]
    ranks: list[int]

    @staticmethod
    def best_first(n_nodes: int, top_k: int, max_depth: int, decay: float = 0.55) -> "TreeTemplate":
        # Expected-acceptance heuristic: a rank-r child is accepted with prior ~ decay * (r+1)^-1.5,
        # a path's score is the product along it; keep the n best paths (prefix-closed by construction).
        def prior(r: int) -> float:
            return decay / (r + 1) ** 1.5

        heap = [(-prior(r), (r,)) for r in range(top_k)]
        heapq.heapify(heap)
        paths: list[tuple[int, ...]] = []
        while heap and len(paths) < n_nodes:
            neg, path = heapq.heappop(heap)
            paths.append(path)
            if len(path) < max_depth:
                for r in range(top_k):
                    heapq.heappush(heap, (neg * prior(r), path + (r,)))
        paths.sort(key=lambda p: (len(p), p))
        index = {p: i for i, p in enumerate(paths)}
        return TreeTemplate(parents=[index.get(p[:-1], -1) for p in paths], ranks=[p[-1] for p in paths])

    def tensors(self, device) -> dict:
        parents = torch.tensor(self.parents, dtype=torch.long, device=device)[None]
        anc, depth = tree_attention_from_parents(parents)
        return {
            "parents": parents,
            "ranks": torch.tensor(self.ranks, device=device),
            "tree_attn": anc,
            "depth": depth,
            "max_depth": int(depth.max().item()),
            "levels": [(depth[0, 1:] == d).nonzero().squeeze(-1) for d in range(1, int(depth.max().item()) + 1)],
        }


def expand_template(tpl: dict, candidates: Callable[[torch.Tensor, int], torch.Tensor], root: torch.Tensor) -> torch.Tensor:
    """Fill a static tree: node tokens [B, N] from ``candidates(parent_tokens [B, n], depth)`` -> [B, n, k]."""
    parents, ranks = tpl["parents"][0], tpl["ranks"]
    with_root = torch.empty(root.shape[0], parents.shape[0] + 1, dtype=torch.long, device=root.device)
    with_root[:, 0] = root
    for d, nodes in enumerate(tpl["levels"]):
        cand = candidates(with_root[:, parents[nodes] + 1], d)  # [B, n_d, k]
        with_root[:, nodes + 1] = cand.gather(-1, ranks[nodes][None, :, None].expand(cand.shape[0], -1, 1)).squeeze(-1)
    return with_root[:, 1:]


# ---------------------------------------------------------------------------------------------
# Model-free drafters


class NgramDrafter(Drafter):
    """Prompt lookup (HF prompt_lookup_num_tokens): match the last n tokens (n = max..min) against
    the row's earlier text and propose what followed the most recent match.

    A recent match's continuation runs into the end of the text after ``len(seq) - start`` tokens;
    the draft then continues periodically (the text since the match is assumed to repeat, so its
    own draft tokens follow), which keeps drafts K long inside loops and lists.
    """

    default_k = 12

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    length_policy = "after"

    def _lookup(self, seq: list[int], k: int) -> tuple[list[int], int]:
        """(the draft, the length of the match it came from; 0: none)."""
        for n in range(self.max_ngram, self.min_ngram - 1, -1):
            if len(seq) <= n:
                continue
            suffix = seq[-n:]
            first = suffix[0]
            for i in range(len(seq) - n - 1, -1, -1):
                if seq[i] == first and seq[i : i + n] == suffix:
                    start = i + n
                    draft = seq[start : start + k]
                    period = len(seq) - start
                    while len(draft) < k:
                        draft.append(draft[len(draft) - period])
                    return draft, n
        return [], 0

    def admit(self, batch, seg: Segment) -> None:
        pass  # drafts come from each row's own text

    def propose(self, batch) -> Proposal | None:
        found = [self._lookup(seq, batch.num_draft) for seq in batch.seqs]
        proposal = chain_proposal([d for d, _ in found], batch.device)
        if proposal is not None:
            proposal.classes = [n for _, n in found]  # a longer match predicts more reliably
        return proposal


class RecycleDrafter(Drafter):
    """Token Recycling: an adjacency matrix of the target's own top-k next tokens, refreshed from
    every target forward, expanded into a static tree by BFS from the last token."""

    default_k = 24  # tree nodes
    needs_prefill_logits = True

    def __init__(self, top_k: int = 8, max_depth: int = 6):
        self.top_k, self.max_depth = top_k, max_depth
        self.adj: torch.Tensor | None = None
        self._tpl: dict | None = None
        self._tpl_size = -1

    def _update(self, seg: Segment) -> None:
        if self.adj is None:
            # distinct placeholders: every row of the matrix holds k different tokens, so siblings never repeat
            vocab, dev = seg.logits.shape[-1], seg.logits.device
            self.adj = torch.arange(self.top_k, device=dev).expand(vocab, -1).clone()
        valid = seg.input_valid
        self.adj[seg.input_ids[valid]] = seg.logits[valid].topk(self.top_k, dim=-1).indices

    def begin(self, batch, seg: Segment) -> None:
        self._update(seg)

    def observe(self, batch, seg: Segment) -> None:
        self._update(seg)

    def admit(self, batch, seg: Segment) -> None:
        self._update(seg)  # one matrix for every row: the new prompts' logits refresh it

    def propose(self, batch) -> Proposal | None:
        n = batch.num_draft
        if n <= 0:
            return None
        if self._tpl_size != n:
            self._tpl = TreeTemplate.best_first(n, self.top_k, self.max_depth).tensors(batch.device)
            self._tpl_size = n
        tpl = self._tpl
        tokens = expand_template(tpl, lambda par, d: self.adj[par], batch.root)
        return Proposal(
            tokens=tokens,
            parents=tpl["parents"].expand(tokens.shape[0], -1),
            tree_attn=tpl["tree_attn"],
            depth=tpl["depth"],
            max_depth=tpl["max_depth"],
        )


# ---------------------------------------------------------------------------------------------
# Model drafters


class ModelDrafter(Drafter):
    """A causal LM drafting K tokens autoregressively with its own KV cache (draft model,
    layer-skip self-speculation). Its cache holds the committed text up to the last token it was
    fed plus its own drafts; after verification only the accepted drafts stay."""

    default_k = 4
    length_policy = "before"

    def __init__(self, model, scheme: str = "standard", width: int = 2):
        """scheme "rsd": each of the K draft steps proposes ``width`` siblings drawn from q without
        replacement; only the first is extended, so the draft still runs one chain. scheme "spectr":
        ``width`` i.i.d. chains of K drafts (the draft runs them as width x B rows). Either way the
        target verifies a K x width tree (``verify.verify_tree_drafted``)."""
        self.model = model
        self.scheme, self.width = scheme, width
        self.state: KVState | None = None
        self.fed: list[int] = []
        self._drafted = 0
        self._spine_width = 0  # siblings per level of the last RSD proposal (0: none)
        self._chains = 0  # chains of the last SpecTr proposal, the draft's rows widened to B x chains (0: none)
        self._templates: dict = {}

    def begin(self, batch, seg: Segment) -> None:
        # a draft is called once per drafted token: its per-call cost is what decode.lean trims
        self.state = KVState(self.model, len(batch.seqs), batch.device, lean=True, compile=batch.compile)
        self.fed = [0] * len(batch.seqs)

    def _feed_pending(self, batch, hidden: bool = False):
        """Feed every row's not-yet-fed tokens; the last position's logits (and hidden state if asked)."""
        pending = [seq[f:] for seq, f in zip(batch.seqs, self.fed)]
        width = max(map(len, pending))
        ids = torch.zeros(len(pending), width, dtype=torch.long)
        valid = torch.zeros(len(pending), width, dtype=torch.bool)
        for r, p in enumerate(pending):
            ids[r, width - len(p) :] = torch.tensor(p, dtype=torch.long)
            valid[r, width - len(p) :] = True
        ids, valid = ids.to(batch.device), valid.to(batch.device)
        out = self.state.forward(ids, valid, hidden=hidden)
        self.state.commit_prefix(width, valid)
        self.fed = [len(seq) for seq in batch.seqs]
        return (out.logits[:, -1], out.hidden_states[-1][:, -1]) if hidden else out.logits[:, -1]

    def _pick(self, logits: torch.Tensor, batch) -> tuple[torch.Tensor, torch.Tensor | None]:
        return draw(logits, batch.sampling, batch.generator)

    def propose(self, batch) -> Proposal | None:
        if self.scheme == "rsd":
            return self._propose_siblings(batch, batch.num_draft)
        if self.scheme == "spectr":
            return self._propose_chains(batch, batch.num_draft)
        return self._propose_fixed(batch, batch.num_draft)

    def _siblings(self, logits: torch.Tensor, batch, width: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``width`` candidate tokens [B, width] at one draft step, the first a draw from q, and q."""
        if batch.sampling.greedy:
            return logits.topk(width, dim=-1).indices, None  # the limit of either scheme as T -> 0
        q = logits_to_probs(logits, batch.sampling)
        if self.scheme == "spectr":
            return torch.multinomial(q, width, replacement=True, generator=batch.generator), q
        # Gumbel-top-k over log q: the top tokens in order are successive draws without replacement
        u = torch.rand(q.shape, generator=batch.generator, device=q.device).clamp_(min=1e-20)
        return (q.log() - (-u.log()).log()).topk(width, dim=-1).indices, q

    def _propose_siblings(self, batch, k: int) -> Proposal | None:
        if k <= 0:
            return None
        width = max(1, min(self.width, self.model.config.vocab_size))
        logits = self._feed_pending(batch)
        tokens, probs = [], []
        for i in range(k):
            sibs, q = self._siblings(logits, batch, width)
            tokens.append(sibs)
            probs.append(q)
            if i < k - 1:
                out = self.state.forward(sibs[:, :1])
                self.state.commit_prefix(1, torch.ones_like(sibs[:, :1], dtype=torch.bool))
                logits = out.logits[:, -1]
        self._drafted = k - 1
        self._spine_width = width
        tpl = self._spine_template(k, width, batch.device)
        draft_probs = None if probs[0] is None else torch.stack(probs, 1).repeat_interleave(width, dim=1)
        tokens = torch.cat(tokens, 1)
        return Proposal(
            tokens=tokens,
            parents=tpl["parents"].expand(tokens.shape[0], -1),
            draft_probs=draft_probs,
            tree_attn=tpl["tree_attn"],
            depth=tpl["depth"],
            max_depth=k,
            scheme=self.scheme,
        )

    def _propose_chains(self, batch, k: int) -> Proposal | None:
        if k <= 0:
            return None
        width = max(1, min(self.width, self.model.config.vocab_size))
        bsz = len(batch.seqs)
        logits = self._feed_pending(batch)
        heads, q = self._siblings(logits, batch, width)  # i.i.d. heads (distinct top tokens when greedy)
        # every row's cache is copied to its chains: row r's chain j is row r * width + j
        self.state.select_rows(torch.arange(bsz, device=batch.device).repeat_interleave(width))
        self._chains = width
        tok = heads.reshape(-1)
        tokens, probs = [tok], [None if q is None else q.repeat_interleave(width, dim=0)]
        for _ in range(k - 1):
            out = self.state.forward(tok[:, None])
            self.state.commit_prefix(1, torch.ones_like(tok[:, None], dtype=torch.bool))
            tok, q = self._pick(out.logits[:, -1], batch)
            tokens.append(tok)
            probs.append(q)
        self._drafted = k - 1
        # chain-major nodes: node j * k + d is chain j's d-th draft
        tokens = torch.stack(tokens, 1).reshape(bsz, width * k)
        draft_probs = None if probs[0] is None else torch.stack(probs, 1).reshape(bsz, width * k, -1)
        tpl = self._chain_template(k, width, batch.device)
        return Proposal(
            tokens=tokens,
            parents=tpl["parents"].expand(bsz, -1),
            draft_probs=draft_probs,
            tree_attn=tpl["tree_attn"],
            depth=tpl["depth"],
            max_depth=k,
            scheme=self.scheme,
        )

    def _chain_template(self, k: int, width: int, device) -> dict:
        key = ("chains", k, width, str(device))
        if key not in self._templates:
            parents = [-1 if d == 0 else j * k + d - 1 for j in range(width) for d in range(k)]
            self._templates[key] = TreeTemplate(parents, [j if d == 0 else 0 for j in range(width) for d in range(k)]).tensors(device)
        return self._templates[key]

    def _spine_template(self, k: int, width: int, device) -> dict:
        """Level-major tree: node d * width + j is the j-th sibling at depth d + 1, child of node (d - 1) * width."""
        key = (k, width, str(device))
        if key not in self._templates:
            parents = [-1 if d == 0 else (d - 1) * width for d in range(k) for _ in range(width)]
            self._templates[key] = TreeTemplate(parents, [j for _ in range(k) for j in range(width)]).tensors(device)
        return self._templates[key]

    def _propose_fixed(self, batch, k: int) -> Proposal | None:
        if k <= 0:
            return None
        logits = self._feed_pending(batch)
        tokens, probs = [], []
        for i in range(k):
            tok, q = self._pick(logits, batch)
            tokens.append(tok)
            probs.append(q)
            if i < k - 1:
                out = self.state.forward(tok[:, None])
                self.state.commit_prefix(1, torch.ones_like(tok[:, None], dtype=torch.bool))
                logits = out.logits[:, -1]
        self._drafted = k - 1  # slots holding drafts d1..d_{k-1}
        draft_probs = None if probs[0] is None else torch.stack(probs, 1)
        return Proposal(tokens=torch.stack(tokens, 1), draft_probs=draft_probs)

    def observe(self, batch, seg: Segment) -> None:
        if self._drafted == 0 and seg.accepted is None:
            return
        if self._chains:
            # back to one cache row per text row: the chain the accepted path runs along (chain 0 if none)
            chain = torch.zeros_like(seg.keep_index[:, 0])
            if seg.keep_index.shape[1] > 1:
                chain = torch.where(seg.keep_valid[:, 1], (seg.keep_index[:, 1] - 1) // (self._drafted + 1), chain)
            rows = torch.arange(len(seg.accepted), device=chain.device) * self._chains + chain
            self.state.select_rows(rows)
            self._chains = 0
        keep = [min(a, self._drafted) for a in seg.accepted]
        if self._spine_width and seg.keep_index is not None and seg.keep_index.shape[1] > 1:
            # the cache holds the first siblings only: an accepted later sibling ends what it may keep
            nodes = seg.keep_index[:, 1:] - 1
            spine = torch.arange(nodes.shape[1], device=nodes.device)[None] * self._spine_width
            run = ((nodes == spine) & seg.keep_valid[:, 1:]).long().cumprod(-1).sum(-1).tolist()
            keep = [min(kp, r) for kp, r in zip(keep, run)]
        self.state.rollback(self._drafted, keep)
        self.fed = [f + kp for f, kp in zip(self.fed, keep)]
        self._drafted = 0
        self._spine_width = 0

    def select_rows(self, rows: torch.Tensor) -> None:
        self.state.select_rows(rows)
        idx = rows.tolist()
        self.fed = [self.fed[i] for i in idx]

    def admit(self, batch, seg: Segment) -> None:
        # the new prompts get a forward of their own now: fed lazily, each would widen the next round's
        # pending feed to a whole prompt for every row of the batch
        state = KVState(self.model, len(batch.seqs), batch.device, lean=True, compile=batch.compile)
        state.forward(seg.input_ids, seg.input_valid)
        state.commit_prefix(seg.input_ids.shape[1], seg.input_valid)
        self.state.admit(state)
        self.fed += [len(seq) - 1 for seq in batch.seqs]  # the prompt; its first token (the root) is pending


def layer_skip_view(model, skip: list[int]):
    """The target with some decoder layers skipped, sharing all weights (SWIFT / Draft&Verify).

    Shallow copies only: the modules from the model down to its layer list, and each kept layer and
    its attention, which is re-indexed so the view has a cache of its own. The view's config (every
    copied module's) lists only the kept layers, their layer types included.
    """
    parent, name, layers = arch.decoder_layers(model)
    keep = [i for i in range(len(layers)) if i not in set(skip)]
    if not keep or len(keep) == len(layers):
        raise UsageError(f"layerskip must skip some but not all of the {len(layers)} layers (asked to skip {sorted(set(skip))})")
    config = copy.deepcopy(model.config)
    config.num_hidden_layers = len(keep)
    if getattr(config, "layer_types", None):
        config.layer_types = [config.layer_types[i] for i in keep]
    index_attr = arch.layer_index_attr(config)
    new_layers = []
    for new_idx, old_idx in enumerate(keep):
        layer = _shallow(layers[old_idx])
        attn_name, attn = arch.attention_module(layer, config)
        attn = _shallow(attn)
        setattr(attn, index_attr, new_idx)
        setattr(layer, attn_name, attn)
        if isinstance(getattr(layer, index_attr, None), int):  # some layers carry their index too (Gemma-3)
            setattr(layer, index_attr, new_idx)
        new_layers.append(layer)
    # copy the chain model -> ... -> parent, so the original model keeps its layers and config
    path = next(q for q, m in model.named_modules() if m is parent)
    chain = [_shallow(model)]
    for part in filter(None, path.split(".")):
        child = _shallow(getattr(chain[-1], part))
        setattr(chain[-1], part, child)
        chain.append(child)
    setattr(chain[-1], name, torch.nn.ModuleList(new_layers))
    for module in chain:
        if getattr(module, "config", None) is not None:
            module.config = config
    return chain[0]


def _shallow(module: torch.nn.Module) -> torch.nn.Module:
    clone = copy.copy(module)
    clone._modules = dict(module._modules)
    clone._parameters = dict(module._parameters)
    clone._buffers = dict(module._buffers)
    return clone


# what a searched skip set must keep: agreement of the layer-skip draft's greedy token with the target's,
# teacher-forced on calibration text. Chains of K drafts at agreement a give tau = (1 - a^(K+1)) / (1 - a):
# 0.6 gives 1.96 at K = 2, 2.2 at K = 3
SKIP_AGREEMENT = 0.6
_searched: dict = {}


def search_layerskip(model, tokenizer, agreement: float = SKIP_AGREEMENT) -> list[int]:
    """The layers ``layerskip`` skips by default: the most whose skipping keeps the draft's greedy token
    the target's on ``agreement`` of the positions of a calibration text (the shipped example prompts:
    code, data, docstrings). Layers are tried from the least important alone (each skipped on its own)
    and kept while the set as a whole still agrees; the first and last layers are never skipped. A
    model's result is remembered for the process and under $SPECDEC_HOME. Which layers a model can lose
    depends on the model: Gemma 3 270M loses almost nothing without layer 8 or 9, and everything without
    layer 1 or its first global-attention layer 5 (the middle half, once the default, agreed on 0 of 300
    code positions)."""
    n = len(arch.decoder_layers(model)[2])
    key = _model_key(model)
    if key in _searched:
        return _searched[key]
    disk = _skip_cache_path()
    stored = _read_json(disk).get(key)
    if stored is not None:
        _searched[key] = stored
        return stored
    import json as _json

    from specdec.examples import example_path

    texts = [_json.loads(line)["prompt"] for line in example_path("prompts.jsonl").read_text().splitlines()[:8]]
    try:
        ids = tokenizer("".join(texts), return_tensors="pt")["input_ids"][:, :160].to(next(model.parameters()).device)
    except (TypeError, AttributeError, KeyError):  # no tokenizer to encode the calibration text with
        return middle_layers(n)
    with torch.inference_mode():
        ref = model(ids).logits.argmax(-1)

        def agree(skip) -> float:
            got = layer_skip_view(model, sorted(skip))(ids).logits.argmax(-1)
            return float((got == ref).float().mean())

        alone = sorted(range(1, n - 1), key=lambda i: -agree([i]))
        chosen: list[int] = []
        for i in alone:
            if len(chosen) + 1 >= n - 2:
                break
            if agree(chosen + [i]) >= agreement:
                chosen.append(i)
    chosen = sorted(chosen) or [alone[0]]
    _searched[key] = chosen
    try:
        data = _read_json(disk)
        data[key] = chosen
        disk.parent.mkdir(parents=True, exist_ok=True)
        disk.write_text(_json.dumps(data, indent=1, sort_keys=True))
    except OSError:
        pass  # a read-only home searches again next time
    return chosen


def _model_key(model) -> str:
    """A model's identity for the skip-set cache: its name, depth and a digest of a few weights."""
    import hashlib

    _, _, layers = arch.decoder_layers(model)
    digest = hashlib.sha256()
    for p in (model.get_input_embeddings().weight, *(next(layer.parameters()) for layer in layers)):
        digest.update(repr(float(p.detach().flatten()[:4096].double().sum())).encode())
    return f"{getattr(model.config, 'model_type', '?')}-{len(layers)}-{digest.hexdigest()[:16]}"


def _skip_cache_path():
    from specdec.models.artifacts import specdec_home

    return specdec_home() / "layerskip.json"


def _read_json(path) -> dict:
    import json as _json

    try:
        return _json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def middle_layers(num_layers: int) -> list[int]:
    """The middle half of the layers (what ``layerskip`` skips when no calibration text can be encoded)."""
    lo, hi = num_layers // 4, num_layers - num_layers // 4
    return list(range(max(lo, 1), min(hi, num_layers - 1)))


def parse_layerskip(spec: str, num_layers: int) -> list[int]:
    """``layerskip:2,3`` names the skipped layers (0-based); bare ``layerskip`` (searched, see
    ``search_layerskip``) returns [] here.

    A draft that skips nothing is the target itself, one that skips everything is no model: both,
    and targets too shallow to leave a useful draft, are usage errors."""
    if num_layers < 3:
        raise UsageError(f"layerskip needs a target with at least 3 decoder layers; this one has {num_layers}")
    _, _, arg = spec.partition(":")
    if not arg:
        return []
    try:
        skip = sorted({int(x) for x in arg.split(",") if x.strip()})
    except ValueError:
        raise UsageError(f"{spec!r}: layerskip:I,J,... names the layers to skip by integer index") from None
    bad = [i for i in skip if not 0 <= i < num_layers]
    if bad:
        raise UsageError(f"{spec!r}: the target has layers 0..{num_layers - 1}; no layer {bad[0]}")
    if not skip or len(skip) == num_layers:
        raise UsageError(f"{spec!r}: layerskip must skip some but not all of the target's {num_layers} layers")
    return skip
