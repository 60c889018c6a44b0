"""Drafters that copy: spans of the context and of the job's earlier outputs (CopySpec), and the
input itself for jobs whose output is mostly their input (input-guided Aggressive Decoding).

Both are model-free chains verified like every other draft, so greedy output is identical to plain
decoding and sampled output keeps the target's distribution (a copied token is a one-hot draft).
They differ from ``ngram`` in where they look and how far they copy: ``copy`` indexes every window of
``gamma`` tokens of each row's text and of the rows that finished earlier in the job by hash (a
dictionary lookup, not a scan), and copies runs whose length follows how much of the last copy was
kept; ``input-copy`` reads only the row's prompt, keeps its place there from round to round and
re-aligns after a mismatch.
"""

from __future__ import annotations

import torch

from specdec.decode.drafters.base import Drafter, Proposal, Segment, chain_proposal


class CopyDrafter(Drafter):
    """CopySpec: when the last ``gamma`` tokens occurred before (in the row's own text, most recent
    first, else in an output the job finished earlier), propose the tokens that followed them.

    The run length adapts per row: a copy kept whole doubles the next one (up to ``max_copy``), a copy
    cut short makes the next one the length that was kept plus a few (at least ``min_copy``).
    """

    default_k = 64  # the most a round may copy; the adaptive length decides within it

    def __init__(self, gamma: int = 4, min_copy: int = 4, start_copy: int = 16, max_copy: int = 64, memory_tokens: int = 1 << 20):
        self.gamma, self.min_copy, self.start_copy, self.max_copy = gamma, min_copy, start_copy, max_copy
        self.memory_tokens = memory_tokens
        self.memory: list[list[int]] = []  # finished rows' text, the job's earlier outputs
        self.memory_index: dict[tuple, tuple[int, int]] = {}  # window -> (memory text, position after it)
        self._memory_size = 0
        self.index: list[dict] = []  # per row: window -> position after its latest occurrence
        self.indexed: list[int] = []  # per row: windows ending before this position are in the index
        self.length: list[int] = []  # per row: the next copy's length
        self.last: list[int] = []  # per row: tokens proposed in the last round
        self._seqs: list[list[int]] = []

    def _add_rows(self, n: int) -> None:
        self.index += [{} for _ in range(n)]
        self.indexed += [0] * n
        self.length += [self.start_copy] * n
        self.last += [0] * n

    def begin(self, batch, seg: Segment) -> None:
        # a new batch of the same job: the rows of the last one are earlier outputs now
        for seq in self._seqs[: len(self.index)]:
            self._remember(seq)
        self.index, self.indexed, self.length, self.last = [], [], [], []
        self._add_rows(len(batch.seqs))
        self._seqs = batch.seqs

    def admit(self, batch, seg: Segment) -> None:
        """``batch`` holds the admitted rows only; they join after the running ones."""
        self._add_rows(len(batch.seqs))
        self._seqs = list(self._seqs) + list(batch.seqs)

    def select_rows(self, rows: torch.Tensor) -> None:
        keep = rows.tolist()
        for r in sorted(set(range(len(self.index))) - set(keep)):
            if r < len(self._seqs):
                self._remember(self._seqs[r])
        for name in ("index", "indexed", "length", "last"):
            values = getattr(self, name)
            setattr(self, name, [values[i] for i in keep])
        self._seqs = [self._seqs[i] for i in keep if i < len(self._seqs)]

    def _remember(self, seq: list[int]) -> None:
        """Index a finished row's text for the rows that come after it (bounded by ``memory_tokens``)."""
        if self._memory_size + len(seq) > self.memory_tokens:
            return
        m = len(self.memory)
        self.memory.append(list(seq))
        self._memory_size += len(seq)
        g = self.gamma
        for end in range(g, len(seq)):
            self.memory_index[tuple(seq[end - g : end])] = (m, end)

    def _update_index(self, r: int, seq: list[int]) -> None:
        g, index = self.gamma, self.index[r]
        # every window with a token after it; the current suffix (ending at len(seq)) must find an earlier one
        for end in range(max(self.indexed[r], g), len(seq)):
            index[tuple(seq[end - g : end])] = end
        self.indexed[r] = max(self.indexed[r], len(seq))

    def _lookup(self, r: int, seq: list[int], k: int) -> list[int]:
        if len(seq) < self.gamma:
            return []
        key = tuple(seq[-self.gamma :])
        n = min(self.length[r], k)
        start = self.index[r].get(key)
        if start is not None and start < len(seq):
            draft = seq[start : start + n]
            period = len(seq) - start
            while len(draft) < n:  # the copy runs into the text being copied: it repeats with this period
                draft.append(draft[len(draft) - period])
            return draft
        hit = self.memory_index.get(key)
        if hit is not None:
            text, pos = self.memory[hit[0]], hit[1]
            return text[pos : pos + n]
        return []

    def propose(self, batch) -> Proposal | None:
        self._seqs = batch.seqs
        drafts = []
        for r, seq in enumerate(batch.seqs):
            self._update_index(r, seq)
            drafts.append(self._lookup(r, seq, batch.num_draft))
        self.last = [len(d) for d in drafts]
        return chain_proposal(drafts, batch.device)

    def observe(self, batch, seg: Segment) -> None:
        if seg.accepted is None:
            return
        for r, (kept, tried) in enumerate(zip(seg.accepted, self.last)):
            if tried:
                grow = kept == tried
                self.length[r] = min(2 * self.length[r], self.max_copy) if grow else kept + self.min_copy
        self.last = [0] * len(self.last)


class InputCopyDrafter(Drafter):
    """Input-guided aggressive decoding: the draft is the row's input from where the output stands in
    it: the request's ``reference`` (a record's ``source`` field, the text an edit rewrites) when it has
    one, else its prompt. The place is kept from round to round (the output is expected to follow the
    input in order); after a mismatch it is found again as the next occurrence in the input of the
    output's last ``align`` tokens (fewer when those do not occur), searched after the previous place
    first."""

    default_k = 64  # the most a round may copy; the adaptive length decides within it

    def __init__(self, align: int = 4, start_copy: int = 8, max_copy: int = 64):
        self.align, self.start_copy, self.max_copy = align, start_copy, max_copy
        self.prompt_len: list[int] = []
        self.inputs: list[list[int] | None] = []  # per row: the reference copied from (None: the prompt)
        self.place: list[int] = []  # per row: index in the input of the next output token, -1 unknown
        # per row: the next copy's length, doubling while copies are kept and falling to what was kept
        # when one is cut (an output that stopped following its input costs a short draft, not a long one)
        self.length: list[int] = []
        self.last: list[int] = []

    def _add_rows(self, seqs: list[list[int]], references: list) -> None:
        # at begin/admit every new row holds its prompt and the first token the target emitted
        self.prompt_len += [len(s) - 1 for s in seqs]
        self.inputs += list(references) if references else [None] * len(seqs)
        self.place += [-1] * len(seqs)
        self.length += [self.start_copy] * len(seqs)
        self.last += [0] * len(seqs)

    def begin(self, batch, seg: Segment) -> None:
        self.prompt_len, self.inputs, self.place, self.length, self.last = [], [], [], [], []
        self._add_rows(batch.seqs, batch.references)

    def admit(self, batch, seg: Segment) -> None:
        """``batch`` holds the admitted rows only; they join after the running ones."""
        self._add_rows(batch.seqs, batch.references)

    def select_rows(self, rows: torch.Tensor) -> None:
        keep = rows.tolist()
        for name in ("prompt_len", "inputs", "place", "length", "last"):
            values = getattr(self, name)
            setattr(self, name, [values[i] for i in keep])

    def _align(self, prompt: list[int], out: list[int], after: int) -> int:
        """Index in ``prompt`` after the latest occurrence of the output's tail, preferring one at or
        after ``after``; -1 when even its last token does not occur."""
        for n in range(min(self.align, len(out)), 0, -1):
            tail = out[-n:]
            hits = [i + n for i in range(len(prompt) - n + 1) if prompt[i : i + n] == tail]
            if hits:
                ahead = [h for h in hits if h >= after]
                return min(ahead) if ahead else hits[-1]
        return -1

    def propose(self, batch) -> Proposal | None:
        drafts = []
        for r, seq in enumerate(batch.seqs):
            prompt, out = seq[: self.prompt_len[r]], seq[self.prompt_len[r] :]
            if self.inputs[r] is not None:
                prompt = self.inputs[r]
            place = self.place[r]
            # still in step: the token before the place is the output's last one
            if not (0 < place <= len(prompt) and prompt[place - 1] == out[-1]):
                place = self._align(prompt, out, max(place, 0))
            self.place[r] = place
            n = min(self.length[r], batch.num_draft)
            drafts.append(prompt[place : place + n] if place >= 0 else [])
        self.last = [len(d) for d in drafts]
        return chain_proposal(drafts, batch.device)

    def observe(self, batch, seg: Segment) -> None:
        if seg.accepted is None:
            return
        # the accepted drafts and the target's next token follow the place when they match the input
        for r, (kept, tried) in enumerate(zip(seg.accepted, self.last)):
            if self.place[r] >= 0:
                self.place[r] += kept + 1
            if tried:
                self.length[r] = min(2 * self.length[r], self.max_copy) if kept == tried else max(kept, 1)
        self.last = [0] * len(self.last)
