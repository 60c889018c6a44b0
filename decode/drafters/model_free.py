"""Model-free drafters: n-gram prompt lookup (``ngram``) and Token Recycling (``recycle``)."""

from __future__ import annotations

import torch

from specdec.decode.drafters.base import Drafter, Proposal, Segment, TreeTemplate, chain_proposal, expand_template
from specdec.decode.engine.length import LengthPolicy


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

    length_policy = LengthPolicy.after

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

    def continuation(self, seq: list[int], k: int) -> list[int]:
        """What the lookup drafts after ``seq``: up to ``k`` tokens (none without a match)."""
        return self._lookup(seq, k)[0]

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
    proposes_trees = True

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
