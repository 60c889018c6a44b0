"""Retrieval drafts: a datastore over a corpus's token ids (REST), and its fusion with a draft model (RASD).

The datastore is the corpus's documents tokenized with the target's tokenizer, concatenated with a
separator after each document, and the suffix array of that text. A lookup takes the longest suffix of
a row's text (``max_suffix`` tokens down to ``min_suffix``) that occurs in the corpus: two binary
searches on the suffix array give the range of its occurrences, and since that range is sorted by what
follows, an evenly spaced sample of at most ``max_occurrences`` of them keeps the proportions of their
continuations. The continuations form a trie with a count per node (how many occurrences pass through
it); the nodes with the highest counts, up to the round's budget, are the draft tree. A node never
counts more than its parent, so the best nodes by count (shallower first on ties) are prefix-closed and
already in topological order, and the trie is grown best-first: only the nodes a round considers have
their children counted. The tree is verified like every other token tree (one-hot drafts), so
greedy output is identical to plain decoding and sampled output keeps the target's distribution.

RASD (``draft+retrieval=INDEX``): the draft model drafts its greedy chain of K tokens as usual; the
retrieval trie of the same row is grafted onto it by longest-prefix matching (a trie node whose path
is a prefix of the chain is that chain node, so agreeing retrieval costs nothing), and what branches
off is pruned with the draft's probabilities where the draft computed them anyway: a retrieval token
hanging from the root or from a chain node stays when it is among the draft's ``prune_top_k``
likeliest tokens at that step, or when the retrieval itself is confident (at least ``keep_share`` of
the occurrences through its parent take it). So the draft thins out the retrieval's weak alternatives
without vetoing, as a draft that never saw the corpus would, a continuation the corpus agrees on.
Nodes further off the chain have no draft distribution and keep their trie counts. Up to
``retrieval_tokens`` new nodes join the chain, best count first, and one target forward verifies the
fused tree. The chain is the draft's argmax at any temperature: the tree's tokens are one-hot
candidates either way, and the draft's cache keeps what the accepted path shares with the chain.

A datastore folder holds ``datastore.safetensors`` (``tokens`` int32 with -1 separators,
``suffix_array`` int64) and ``config.json`` (kind ``retrieval-index``, the tokenizer fingerprint under
``specdec_target``, token and document counts). ``specdec index build`` writes one.
"""

from __future__ import annotations

import bisect
import heapq
import os
import shutil
from array import array
from pathlib import Path

import torch

from specdec.decode.drafters.base import Drafter, Proposal, Segment, tree_proposal
from specdec.decode.drafters.draft_model import ModelDrafter
from specdec.decode.engine.length import LengthPolicy
from specdec.models.artifacts import check_fingerprint, read_config, tokenizer_fingerprint, write_json
from specdec.models.errors import SpecdecError, UsageError

INDEX_KIND = "retrieval-index"
SEPARATOR = -1  # ends every document: no token equals it, so no match and no continuation crosses it
DATA_FILE = "datastore.safetensors"


def suffix_array(tokens: torch.Tensor) -> torch.Tensor:
    """Start positions of the suffixes of ``tokens`` in lexicographic order, a suffix that ends
    before another being the smaller (prefix doubling: each round sorts by twice as many tokens)."""
    n = tokens.numel()
    if n == 0:
        return torch.zeros(0, dtype=torch.long)
    _, rank = torch.unique(tokens.long(), return_inverse=True)
    h = 1
    while h < n and int(rank.max()) < n - 1:
        after = torch.full_like(rank, -1)  # past the end: smaller than any token, the separator included
        after[: n - h] = rank[h:]
        _, rank = torch.unique(rank * (n + 1) + after + 1, return_inverse=True)
        h *= 2
    return torch.argsort(rank, stable=True)


class Datastore:
    """The corpus and its suffix array, held as compact host arrays (lookups compare short slices)."""

    def __init__(self, tokens: torch.Tensor, sa: torch.Tensor, config: dict | None = None):
        self.config = config or {}
        self.tokens = array("i", tokens.to(torch.int32).contiguous().numpy().tobytes())
        self.sa = array("q", sa.to(torch.int64).contiguous().numpy().tobytes())

    @classmethod
    def from_documents(cls, docs: list[list[int]], config: dict | None = None) -> "Datastore":
        tokens, sa = build_arrays(docs)
        return cls(tokens, sa, config)

    def __len__(self) -> int:
        return len(self.tokens)

    def find(self, pattern: list[int]) -> tuple[int, int]:
        """The suffix-array range [lo, hi) of the suffixes that start with ``pattern``."""
        pat, n, tok = array("i", pattern), len(pattern), self.tokens

        def key(s: int) -> array:
            return tok[s : s + n]

        lo = bisect.bisect_left(self.sa, pat, key=key)
        return lo, bisect.bisect_right(self.sa, pat, lo=lo, key=key)

    def match(self, seq: list[int], max_suffix: int, min_suffix: int, cap: int) -> list[int]:
        """Where the continuations of the longest suffix of ``seq`` that occurs in the corpus start (the
        position after each of at most ``cap`` occurrences that its document goes on from); empty when
        not even ``min_suffix`` tokens occur."""
        lo_n, hi_n = min_suffix, min(max_suffix, len(seq))
        best = None
        # occurrences only shrink as the suffix grows (an occurrence of a suffix holds one of each shorter one)
        while lo_n <= hi_n:
            mid = (lo_n + hi_n) // 2
            lo, hi = self.find(seq[-mid:])
            if hi > lo:
                best, lo_n = (mid, lo, hi), mid + 1
            else:
                hi_n = mid - 1
        n = best[0] if best else 0
        while n >= min_suffix:
            _, lo, hi = best if best[0] == n else (n, *self.find(seq[-n:]))
            step = max(1, -(-(hi - lo) // cap))  # evenly spaced: the range is sorted by what follows
            starts = [self.sa[i] + n for i in range(lo, hi, step)]
            starts = [p for p in starts if self.tokens[p] != SEPARATOR]
            if starts:
                return starts
            n -= 1  # every occurrence ends its document: a shorter suffix may have something after it
        return []

    def continuations(self, seq: list[int], max_suffix: int, min_suffix: int, depth: int, cap: int) -> list[list[int]]:
        """The continuations ``match`` finds, up to ``depth`` tokens each (up to their document's end)."""
        out = []
        for p in self.match(seq, max_suffix, min_suffix, cap):
            cont = self.tokens[p : p + depth]
            out.append((cont[: cont.index(SEPARATOR)] if SEPARATOR in cont else cont).tolist())
        return out

    def check_tokenizer(self, tokenizer, what: str = "retrieval index") -> None:
        expected = self.config.get("specdec_target")
        if expected:
            check_fingerprint(expected, tokenizer_fingerprint(tokenizer), what)


def build_arrays(docs: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """The concatenated documents (each followed by the separator) and their suffix array."""
    flat: list[int] = []
    for doc in docs:
        flat += doc
        flat.append(SEPARATOR)
    tokens = torch.tensor(flat, dtype=torch.int32)
    return tokens, suffix_array(tokens)


def save_datastore(out: str | os.PathLike, docs: list[list[int]], fingerprint: dict, sources: list[str], overwrite: bool = False) -> dict:
    """Write an index folder; returns its config. Refuses an existing folder unless ``overwrite`` and it
    is an index (or empty): a mistyped --out must not wipe something else."""
    from safetensors.torch import save_file

    out = Path(out)
    check_output_dir(out, overwrite)
    tokens, sa = build_arrays(docs)
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    save_file({"tokens": tokens, "suffix_array": sa}, str(out / DATA_FILE))
    config = {
        "kind": INDEX_KIND,
        "specdec_target": fingerprint,
        "tokens": int(tokens.numel()) - len(docs),
        "documents": len(docs),
        "sources": sources,
    }
    write_json(out / "config.json", config)
    return config


def check_output_dir(out: Path, overwrite: bool) -> None:
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {out} is a file; an index is a folder")
    if out.is_dir() and any(out.iterdir()):
        if not overwrite:
            raise UsageError(f"--out {out} exists: pass --overwrite to replace it")
        if not (out / DATA_FILE).exists():
            raise UsageError(f"--out {out} is not a retrieval index: refusing to overwrite it")


def _index_folder(path: str | os.PathLike) -> Path:
    path = Path(path)
    if not path.is_dir() or not (path / DATA_FILE).exists():
        raise UsageError(f"{path}: not a retrieval index folder (build one with specdec index build)")
    return path


def open_datastore(path: str | os.PathLike, tokenizer=None) -> Datastore:
    """Load an index folder, checked against the target's tokenizer when one is given."""
    from safetensors.torch import load_file

    path = _index_folder(path)
    config = read_config(path)
    if config.get("kind") != INDEX_KIND:
        raise SpecdecError(f"{path}/config.json: kind {config.get('kind')!r}, expected {INDEX_KIND!r}")
    tensors = load_file(str(path / DATA_FILE))
    store = Datastore(tensors["tokens"], tensors["suffix_array"], config)
    if tokenizer is not None:
        store.check_tokenizer(tokenizer, f"retrieval index {path}")
    return store


# ---------------------------------------------------------------------------------------------
# Trees


class Trie:
    """The continuations as a trie, grown best-first on demand: ``take`` gives the node with the most
    occurrences through it (the shallower, then the earlier found, on ties), and only a node that is
    ``expand``ed has its children counted. A child never counts more than its parent, so the nodes
    taken form a tree, parents first, and a round reads the corpus only for the nodes it considers.
    Per node: its token, parent (-1: the root), depth and count."""

    def __init__(self, corpus: array, starts: list[int], max_depth: int):
        self.corpus, self.max_depth = corpus, max_depth
        self.occurrences = len(starts)
        self.token: list[int] = []
        self.parent: list[int] = []
        self.depth: list[int] = []
        self.count: list[int] = []
        self._next: list[list[int]] = []  # per node: where the token after it lies, per occurrence
        self._heap: list[tuple[int, int, int]] = []
        self._children(-1, starts, 0)

    def _children(self, parent: int, at: list[int], depth: int) -> None:
        if depth >= self.max_depth:
            return
        groups: dict[int, list[int]] = {}
        for p in at:
            tok = self.corpus[p]
            if tok != SEPARATOR:  # the corpus ends with one: p + 1 stays inside it
                groups.setdefault(tok, []).append(p + 1)
        for tok, nxt in groups.items():
            node = len(self.token)
            self.token.append(tok)
            self.parent.append(parent)
            self.depth.append(depth + 1)
            self.count.append(len(nxt))
            self._next.append(nxt)
            heapq.heappush(self._heap, (-len(nxt), depth + 1, node))

    def take(self) -> int | None:
        return heapq.heappop(self._heap)[2] if self._heap else None

    def expand(self, node: int) -> None:
        self._children(node, self._next[node], self.depth[node])


class RetrievalDrafter(Drafter):
    """REST: each round, the trie of what followed the row's longest matching suffix in the datastore,
    its ``num_draft`` best nodes (up to ``max_depth`` deep) as the token tree. No per-row state: the
    lookup reads only the row's text, so rows join and leave freely."""

    default_k = 16  # tree nodes: each widens the verify forward, which a CPU pays for in full
    proposes_trees = True

    def __init__(self, store: Datastore, max_suffix: int = 16, min_suffix: int = 2, max_occurrences: int = 64, max_depth: int = 12):
        self.store = store
        self.max_suffix, self.min_suffix = max_suffix, min_suffix
        self.max_occurrences, self.max_depth = max_occurrences, max_depth

    def trie(self, seq: list[int], depth: int) -> Trie:
        return Trie(self.store.tokens, self.store.match(seq, self.max_suffix, self.min_suffix, self.max_occurrences), depth)

    def tree(self, seq: list[int], budget: int) -> tuple[list[int], list[int]]:
        trie = self.trie(seq, self.max_depth)
        slot: dict[int, int] = {}
        tokens, parents = [], []
        while len(tokens) < budget and (node := trie.take()) is not None:
            slot[node] = len(tokens)
            tokens.append(trie.token[node])
            parents.append(slot[trie.parent[node]] if trie.parent[node] >= 0 else -1)
            trie.expand(node)
        return tokens, parents

    def admit(self, batch, seg: Segment) -> None:
        pass  # drafts come from each row's own text and the shared datastore

    def propose(self, batch) -> Proposal | None:
        if batch.num_draft <= 0:
            return None
        return tree_proposal([self.tree(seq, batch.num_draft) for seq in batch.seqs], batch.device)


def check_retrieval_spec(spec: str) -> str:
    """The index folder ``retrieval:INDEX`` names; a ``UsageError`` when it names none."""
    _, _, path = spec.partition(":")
    if not path:
        raise UsageError("retrieval:INDEX names an index folder (build one with specdec index build)")
    _index_folder(path)
    return path


def build_retrieval(spec: str, target, tokenizer, options) -> RetrievalDrafter:
    """``retrieval:INDEX``: the registry's factory; an index holds token ids of the tokenizer it was
    built with, so it must be the target's."""
    path = check_retrieval_spec(spec)
    store = open_datastore(path, tokenizer)
    _check_vocab(store, target, path)
    return RetrievalDrafter(store)


def _check_vocab(store: Datastore, target, path) -> None:
    vocab = getattr(getattr(target, "config", None), "vocab_size", None)
    top = max(store.tokens, default=-1)
    if vocab is not None and top >= vocab:
        raise SpecdecError(f"retrieval index {path} holds token id {top}; the target's vocabulary has {vocab}")


class RasdDrafter(ModelDrafter):
    """RASD: the draft model's greedy chain with the retrieval trie grafted on and pruned by the
    draft's probabilities (the module docstring states the choices). ``num_draft`` is the chain's K;
    up to ``retrieval_tokens`` retrieval nodes, ``retrieval_depth`` deep (or K when deeper), join it."""

    length_policy = LengthPolicy.own  # it decides each round's length itself
    proposes_trees = True  # the draft's chain with retrieval branches
    has_draft_probs = False  # its trees are verified as the draft took them (one-hot q)

    def __init__(self, model, store: Datastore, retrieval_tokens: int = 8, retrieval_depth: int = 8, prune_top_k: int = 8,
                 keep_share: float = 0.5):
        super().__init__(model)
        self.retrieval = RetrievalDrafter(store)
        self.retrieval_tokens, self.retrieval_depth = retrieval_tokens, retrieval_depth
        self.prune_top_k, self.keep_share = prune_top_k, keep_share
        self._tops: list[torch.Tensor] = []  # per chain step: the draft's top tokens, [B, prune_top_k]

    def _pick(self, logits: torch.Tensor, batch) -> tuple[torch.Tensor, None]:
        """The chain's next token, the draft's argmax at any temperature (the fused tree's tokens are
        one-hot candidates); the draft's likeliest tokens there are kept to prune retrieval branches."""
        self._tops.append(logits.topk(min(self.prune_top_k, logits.shape[-1]), dim=-1).indices)
        return logits.argmax(-1), None

    def propose(self, batch) -> Proposal | None:
        k = batch.num_draft
        self._tops = []
        chain = self._propose_fixed(batch, k)  # ModelDrafter's chain, through _pick above
        if chain is None:
            return None
        # the cache holds the chain: ModelDrafter.observe keeps the accepted path's run along nodes 0, 1, ...
        self._spine_width = 1
        chains = chain.tokens.tolist()
        tops = torch.stack(self._tops, 1).tolist()  # [B, K, top_k]: the draft's likeliest tokens after each chain prefix
        depth = max(k, self.retrieval_depth)
        trees = [self._fuse(c, [set(t) for t in tp], self.retrieval.trie(seq, depth)) for c, tp, seq in zip(chains, tops, batch.seqs)]
        return tree_proposal(trees, batch.device)

    def _fuse(self, chain: list[int], top: list[set[int]], trie: Trie) -> tuple[list[int], list[int]]:
        """The chain (nodes 0..K-1) plus the trie's best nodes, merged by prefix and pruned where the
        draft's distribution is at hand (after the root and after each chain node but the last)."""
        k = len(chain)
        tokens, parents = list(chain), [-1] + list(range(k - 1))
        kids = {(parents[i], tok): i for i, tok in enumerate(chain)}
        placed = {-1: -1}  # trie node -> tree node (the roots coincide); only placed nodes are expanded
        added = 0
        while added < self.retrieval_tokens and (node := trie.take()) is not None:
            parent, tok = placed[trie.parent[node]], trie.token[node]
            here = kids.get((parent, tok))
            if here is not None:  # the chain (or a branch already placed) says the same: no new node
                placed[node] = here
                trie.expand(node)
                continue
            step = parent + 1  # the draft step whose distribution the root (-1) or chain node ``parent`` feeds
            above = trie.occurrences if trie.parent[node] < 0 else trie.count[trie.parent[node]]
            confident = trie.count[node] >= self.keep_share * above
            if parent < k and step < k and tok not in top[step] and not confident:
                continue
            placed[node] = kids[(parent, tok)] = len(tokens)
            tokens.append(tok)
            parents.append(parent)
            added += 1
            trie.expand(node)
        return tokens, parents
