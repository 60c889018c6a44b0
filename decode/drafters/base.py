"""The drafter contract: everything that proposes tokens for the one decode loop to verify.

A drafter implements five steps, all batched over the active rows:
  begin(batch, seg)      after the target's prefill (seg holds its inputs, logits, hidden states)
  propose(batch)         -> Proposal (a chain or a token tree per row) or None for a plain step
  observe(batch, seg)    after each verification (seg also holds what each row kept)
  select_rows(rows)      rows that finished leave the batch
  admit(batch, seg)      continuous batching: new rows join after the running ones; batch and seg
                         are the new rows' own prefill, exactly as ``begin`` would get them
and declares what it needs and what its proposals hold as attributes of ``Drafter`` (its
capabilities), which the engine, the memory model and the bench read and nothing probes for. A rare
capability is a class of its own that only its drafters derive from: ``Riding`` (positions that ride
the verify forward).
A drafter with per-row state that does not implement ``admit`` refuses it (``admits`` is False), so
a running batch never goes on with state that lacks the new rows.
The registry (``decode.drafters.registry``) maps a drafter spec to the factory that builds it and
the options that factory takes; the CLI never branches on names.
"""
from __future__ import annotations

import contextlib
import heapq
from dataclasses import dataclass
from typing import Callable

import torch

from specdec.decode.engine.length import LengthPolicy
from specdec.decode.engine.types import Scheme
from specdec.decode.engine.verify import logits_to_probs
from specdec.models.errors import SpecdecError


@dataclass
class Proposal:
    tokens: torch.Tensor  # [B, N]
    parents: torch.Tensor | None = None  # [B, N] parent node index, -1 = child of the root; None = chain
    lengths: torch.Tensor | None = None  # chain only: valid drafts per row (default N)
    # [B, N, V] tempered draft distribution each draft was sampled from (chain; or a tree's, per node)
    draft_probs: torch.Tensor | None = None
    # how a tree's sampled siblings are verified: standard (one-hot q, verify_tree) or one of
    # verify.TREE_SCHEMES (rsd: siblings drawn without replacement, spectr: i.i.d.), with draft_probs
    scheme: Scheme = Scheme.standard
    tree_attn: torch.Tensor | None = None  # [B or 1, N+1, N+1] ancestor matrix incl. the root (derived if None)
    depth: torch.Tensor | None = None  # [B or 1, N+1] depth of the root (0) and of each node
    max_depth: int = 0
    # PEARL's pre-verify (a chain without lengths): tokens [B, 1] hold each row's first draft only, the
    # drafter draws the rest meanwhile; rest() waits for them and returns the whole chain, first draft included
    rest: Callable[[], Proposal] | None = None
    # chain only: each row's drafter-given class for decode.engine.length (n-gram: the match length; default 0)
    classes: list[int] | None = None
    # chain only, from a drafter that drafts with the target's own layers in the target's cache
    # (``decode.drafters.trimmed``): [B, N+1, H] the target's last hidden states at the root and each draft, whose
    # N + 1 slots it committed there; verification then runs the output layer on them instead of a forward
    states: torch.Tensor | None = None

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
    # ``Drafter.ride_positions`` > 0: the outputs at the m positions that rode the verify forward after each
    # row's chain (never committed to the cache); None when no position rode this forward
    ride_logits: torch.Tensor | None = None  # [B, m, V]
    ride_hidden: torch.Tensor | None = None  # [B, m, H] last hidden states, when the drafter asked for them


class Drafter:
    """The base of every drafter: the five steps as no-ops (``admit`` refuses) and the capabilities as
    class attributes, each drafter overriding what differs (as a class attribute, or per instance where
    its options decide it)."""

    # -- what it needs from the engine
    needs_hidden = False  # the target's last hidden states in every segment (Medusa, Clover, EAGLE)
    hidden_layers: tuple[int, ...] | None = None  # extra hidden-state layers the drafter reads (EAGLE-3)
    drafts_in_target = False  # it drafts with the target's layers in the target's cache (``Proposal.states``)
    needs_prefill_logits = False  # every prompt token's logits in begin/admit segments (else the last one's)
    # -- what its proposals hold
    default_k = 4  # drafted tokens (or tree nodes) per round when the user fixes no --num-draft
    proposes_trees = False  # token trees (else chains)
    has_draft_probs = False  # at T > 0, the distribution each draft was sampled from (Proposal.draft_probs)
    scheme: Scheme = Scheme.standard  # how its sampled trees are verified (Scheme.rsd, Scheme.spectr: siblings)
    width = 1  # with scheme rsd/spectr: siblings per draft step
    tree_tokens: int | None = None  # trees of a fixed size: nodes per tree, whatever num_draft (the verify width)
    pre_verify = False  # a proposal may hold each row's first draft and a ``rest`` (PEARL: decode.engine.split)
    length_policy = LengthPolicy.own  # how decode.engine.length may choose its lengths on a CPU (LengthPolicy)
    # -- what it holds: the draft model it runs, if any (memory and draft-cost estimates)
    model = None

    @property
    def admits(self) -> bool:
        """Whether it can take new rows into a running batch (continuous batching): it implements ``admit``."""
        return type(self).admit is not Drafter.admit

    def modules(self) -> list:
        """The modules it holds beside the target (a draft model, heads), for the memory model."""
        return [self.model] if isinstance(self.model, torch.nn.Module) else []

    def cache_bytes(self) -> int:
        """The memory its own key/value cache takes now (a draft model's; 0 for drafters without one)."""
        state = getattr(self, "state", None)
        return state.cache_bytes() if hasattr(state, "cache_bytes") else 0

    def cost_share(self, target) -> float:
        """A drafted token's (a draft model's) or a drafted level's (heads') cost as a share of a target
        forward, by parameters: the fixed cost model of untimed lengths (``decode.engine.length``); 0
        for drafters that hold no modules."""
        own = sum(p.numel() for m in self.modules() for p in m.parameters())
        return min(1.0, own / max(1, sum(p.numel() for p in target.parameters())))

    def begin(self, batch, seg: Segment) -> None:
        pass

    def propose(self, batch) -> Proposal | None:
        return None

    def observe(self, batch, seg: Segment) -> None:
        pass

    def select_rows(self, rows: torch.Tensor) -> None:
        pass

    def retire(self, seqs: list[list[int]]) -> None:
        """Rows that finished, their whole text (prompt and output), before they leave the batch."""

    def admit(self, batch, seg: Segment) -> None:
        raise SpecdecError(f"the {type(self).__name__} drafter cannot take new rows into a running batch: decode with --schedule static")


class Riding(Drafter):
    """An optional capability, carried only by the drafters that have it (``rides``): positions that ride the
    verify forward (PPD, Hidden Transfer: decode.drafters.parallel_prompts). The engine appends
    ``ride_positions`` input positions (``ride_ids``) after each row's chain, at positions continuing after
    its last draft, seeing the committed text, the root and every draft of the row; ``riding`` is entered
    around that forward (hooks that inject the drafter's inputs), their outputs come back as
    ``Segment.ride_logits`` / ``ride_hidden``, and their slots are never committed (dropped as rejected
    drafts are). Chains only, unless ``ride_layout`` lays out a tree's."""

    ride_positions = 0

    def ride_count(self, slots: int) -> int:
        """Riding positions in a verify forward of ``slots`` slots (root and drafts): ``ride_positions`` after the
        chain, or (a tree that carries a riding chain per node) a multiple of them."""
        return self.ride_positions

    def ride_layout(self, start: int, last: torch.Tensor, valid: torch.Tensor, tree=(None, None)):
        """(tree_attn [B, T, T], depth [B, T]) for a verify segment whose riding positions start at column
        ``start`` (``last`` [B]: each row's drafts; ``valid`` [B, T]; ``tree``: the proposal's own ancestor
        matrix and depths, or Nones for a chain), where the default does not hold; None: causal, positions
        counting valid slots."""
        return None

    def ride_ids(self, bsz: int, device, count: int | None = None) -> torch.Tensor:
        """[B, count] input ids of the riding positions (placeholders whose inputs ``riding`` replaces)."""
        return torch.zeros(bsz, count or self.ride_positions, dtype=torch.long, device=device)

    def riding(self, start: int, last: torch.Tensor):
        """A context manager entered around a verify forward that carries ``ride_positions`` riding positions
        at input columns start..start+m-1; ``last`` [B]: each row's last real column (root 0, or its last
        draft). Default: nothing injected."""
        return contextlib.nullcontext()



def rides(drafter: Drafter) -> int:
    """Positions ``drafter`` rides on each verify forward (0: it has no riding capability)."""
    return drafter.ride_positions if isinstance(drafter, Riding) else 0


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
