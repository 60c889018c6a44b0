"""Lookup and trained heads in one verified tree (``--lookup ngram`` with a head artifact).

Where the text repeats, a lookup in it (n-gram prompt lookup, a suffix cache) proposes long chains that
a trained head cannot match; elsewhere the head's tree is the only source of drafts. ``LookupTree``
runs both for every round: the lookup first (it costs no forward), then

- every row's match is long (``STRONG_MATCH`` tokens or more): the round is the lookup's chain alone,
  trimmed to the length the engine's cost model chooses for its match class; the head is not run, so a
  round costs what an ``ngram`` round costs;
- otherwise: the head grows its tree and each row's lookup chain is merged into it as one more path
  from the root (a prefix the tree already holds is shared, not repeated), so the target verifies
  both kinds of candidates in one forward;
- unless the head does not pay: ``HeadGate`` measures the tokens a second of those rounds yields with the
  head and without it (the lookup's short chains alone, or a plain step), and keeps to the faster, trying
  the other one round in ``EXPLORE_EVERY`` times the ratio of the two rates (so that both rates stay
  measured, and a choice several times slower, such as a head's tree over a batch of 8 rows on a CPU,
  takes about the same small share of the time). A head too weak for the machine then costs a few
  rounds, not the job.

The head keeps its state (its own cache of the target's features) in every round, whichever source
won, because it observes every verify segment as it would alone. Verification does not depend on where
a candidate came from (a tree of deterministic candidates is verified exactly, greedy or sampled), so
the output is the target's own.
"""

from __future__ import annotations

import time

import torch

from specdec.decode.drafters.base import Drafter, Proposal, Segment, tree_proposal
from specdec.decode.engine.length import LengthPolicy

STRONG_MATCH = 2  # n-gram matches of this many tokens or more draft alone: their chains are accepted far more often than a head's
LOOKUPS = ("ngram", "suffix")  # model-free chain drafters a head's tree takes candidates from
EXPLORE_EVERY = 8  # rounds between tries of the choice the measured rates do not favour, at equal rates
EXPLORE_AT_MOST_EVERY = 64  # the longest such interval, however slow that choice measured: the text may change
DECAY = 0.9  # weight of a rate's history per round it is measured: the text's nature drifts


class HeadGate:
    """Whether a round without a long match runs the head: by tokens per second measured for each choice
    (decayed sums over the rounds that made it), the faster one, the other once in ``interval()`` rounds.
    What a round yields does not depend on the choice (verification is exact either way): only its speed."""

    def __init__(self, clock=time.perf_counter):
        self.clock = clock
        self.sums = {True: [0.0, 0.0], False: [0.0, 0.0]}  # with the head / without it: [tokens, seconds]
        self.rounds = 0
        self._since = 0  # rounds since the slower choice was last tried
        self._open: tuple[bool, float] | None = None

    def rate(self, head: bool) -> float | None:
        tokens, seconds = self.sums[head]
        return tokens / seconds if seconds > 0 else None

    def interval(self) -> float:
        """Rounds between tries of the slower choice: ``EXPLORE_EVERY`` times how many times slower it measured
        (its tries then take about the same share of the time however slow it is), at most ``EXPLORE_AT_MOST_EVERY``."""
        with_head, without = self.rate(True), self.rate(False)
        if not with_head or not without:
            return EXPLORE_EVERY
        return min(EXPLORE_EVERY * max(with_head, without) / min(with_head, without), EXPLORE_AT_MOST_EVERY)

    def choose(self) -> bool:
        self.rounds += 1
        with_head, without = self.rate(True), self.rate(False)
        if with_head is None or without is None:
            choice = with_head is None  # measure both first, the head first
        else:
            self._since += 1
            choice = with_head >= without
            if self._since >= self.interval():
                choice, self._since = not choice, 0
        self._open = (choice, self.clock())
        return choice

    def record(self, tokens: int) -> None:
        """The round just verified (if it was a gated one) yielded ``tokens``."""
        if self._open is None:
            return
        head, start = self._open
        self._open = None
        s = self.sums[head]
        s[0] = DECAY * s[0] + tokens
        s[1] = DECAY * s[1] + max(self.clock() - start, 1e-9)


class LookupTree(Drafter):
    """``heads`` (a HeadTreeDrafter) with the chains of ``lookup`` (a model-free chain drafter whose
    proposals may carry match ``classes``) merged into its trees."""

    proposes_trees = True

    def __init__(self, heads, lookup):
        self.heads, self.lookup = heads, lookup
        self.needs_hidden = heads.needs_hidden
        self.hidden_layers = heads.hidden_layers
        self.default_k = max(heads.default_k, lookup.default_k)
        # the engine's cost model (decode.engine.length) sizes the lookup's chains by their match class as it does
        # for ngram alone (and a dynamic tree's nodes), whatever the head's own policy: under a static tree a chain
        # would otherwise be capped at the tree's depth
        self.length_policy = LengthPolicy.tree
        self.model = heads.model
        self._length = None
        self._round: tuple[list[list[int]], list[int]] | None = None  # the lookup's chains in the tree under verification
        self.gate = HeadGate()
        self.sources = {"lookup": 0, "tree": 0, "idle": 0}  # rounds of each kind: a long match, the head's tree, the head gated off

    # the engine hands a drafter of LengthPolicy.tree its DraftLength: the head sizes its trees with it and the
    # lookup's chains are trimmed by it
    @property
    def length(self):
        return self._length

    @length.setter
    def length(self, value) -> None:
        self._length = value
        self.heads.length = value

    @property
    def admits(self) -> bool:
        return self.heads.admits and self.lookup.admits

    def modules(self) -> list:
        return self.heads.modules()

    def cost_share(self, target) -> float:
        return self.heads.cost_share(target)

    def begin(self, batch, seg: Segment) -> None:
        self.heads.begin(batch, seg)
        self.lookup.begin(batch, seg)

    def admit(self, batch, seg: Segment) -> None:
        self.heads.admit(batch, seg)
        self.lookup.admit(batch, seg)

    def select_rows(self, rows: torch.Tensor) -> None:
        self.heads.select_rows(rows)
        self.lookup.select_rows(rows)

    def retire(self, seqs: list[list[int]]) -> None:
        self.heads.retire(seqs)
        self.lookup.retire(seqs)

    def _chains(self, batch) -> tuple[list[list[int]], list[int]]:
        """Each row's lookup chain (trimmed by the cost model where the engine keeps one) and match class."""
        bsz = len(batch.seqs)
        found = self.lookup.propose(batch)
        if found is None:
            return [[] for _ in range(bsz)], [0] * bsz
        tokens = found.tokens.tolist()
        have = found.lengths.tolist() if found.lengths is not None else [len(t) for t in tokens]
        classes = list(found.classes) if found.classes is not None else [0] * bsz
        if self._length is not None:
            # the lookup's drafts cost nothing: the measured seconds per drafted position are the head's tree levels
            have = self._length.lengths(classes, have, draft_s=0.0)
        return [t[:n] for t, n in zip(tokens, have)], classes

    def propose(self, batch) -> Proposal | None:
        self._round = None
        self.gate._open = None  # a round that was never observed (the batch emptied) measured nothing
        chains, classes = self._chains(batch)
        strong = all(c >= STRONG_MATCH and chain for c, chain in zip(classes, chains))
        # the head's first tree waits for a measured plain step of this batch: sized by costs known only by their
        # prior, a tree over 8 rows can cost tens of plain steps on a CPU
        untimed = self._length is not None and self._length.forward_cost(len(chains), 1) is None
        if strong or untimed or not self.gate.choose():
            self.sources["lookup" if strong else "idle"] += 1
            if not any(chains):
                return None  # a plain step
            width = max(map(len, chains))
            tokens = torch.zeros(len(chains), width, dtype=torch.long)
            for r, chain in enumerate(chains):
                tokens[r, : len(chain)] = torch.tensor(chain)
            lengths = torch.tensor([len(c) for c in chains])
            # a chain: the engine learns its acceptance per class (DraftLength.observe) as it does for ngram's
            return Proposal(tokens=tokens.to(batch.device), lengths=lengths.to(batch.device), classes=classes)
        self.sources["tree"] += 1
        tree = self.heads.propose(batch)
        if not any(chains):
            return tree
        self._round = (chains, classes)
        return merge_chains(tree, chains, batch.device)

    def observe(self, batch, seg: Segment) -> None:
        self.gate.record(sum(seg.accepted) + len(seg.accepted))  # the accepted drafts and each row's own token
        self.heads.observe(batch, seg)
        self.lookup.observe(batch, seg)
        if self._round is None or self._length is None:
            return
        chains, classes = self._round
        self._round = None
        # the lookup's chain was verified inside the tree: its accepted prefix is what the kept path shares with it
        kept = seg.input_ids.gather(1, seg.keep_index).tolist()
        accepted = []
        for r, chain in enumerate(chains):
            path = kept[r][1 : 1 + seg.accepted[r]]
            n = 0
            while n < min(len(chain), len(path)) and chain[n] == path[n]:
                n += 1
            accepted.append(n)
        self._length.observe(classes, [len(c) for c in chains], accepted)


def merge_chains(tree: Proposal | None, chains: list[list[int]], device) -> Proposal | None:
    """``tree`` (a tree proposal, or None) with each row's chain added as a path from the root: a chain's
    prefix that is already a path of the tree is shared, the rest hangs below it. The tree's own nodes keep
    their indices (a drafter that learns from which of its nodes were accepted still reads them)."""
    bsz = len(chains)
    if tree is None:
        rows = [([], []) for _ in range(bsz)]
    else:
        rows = list(zip(tree.tokens.tolist(), tree.parents.tolist()))
    merged = []
    for (toks, pars), chain in zip(rows, chains):
        toks, pars = list(toks), list(pars)
        # padding nodes (parent -2) stay where they are, as padding: no chain hangs below them
        children: dict[tuple[int, int], int] = {(p, t): i for i, (t, p) in enumerate(zip(toks, pars)) if p >= -1}
        at = -1
        for token in chain:
            nxt = children.get((at, token))
            if nxt is None:
                toks.append(token)
                pars.append(at)
                nxt = children[(at, token)] = len(toks) - 1
            at = nxt
        merged.append((toks, pars))
    return tree_proposal(merged, device)
