"""Entropy Adaptive Decoding (EAD, ``--drafter ead:DRAFT``): a small draft model generates while it is
sure of itself, the target while it is not (approximate: the output is neither model's own decoding).

Every step the draft gives the next-token distribution of each row; the rolling mean of its entropy (nats)
over the row's last ``entropy_window`` steps (fewer at the start) decides who emits the row's next token:
above ``entropy_threshold`` the target (its greedy token), else the draft (its greedy token). The draft
runs every step and is fed every emitted token, whoever emitted it (its distribution is the signal). The
target's cache holds only what it has processed: when it takes a row over it first catches up on the
tokens the draft emitted since it last ran, in the same forward that gives its next token (the first
time: the prompt too, so a row the draft carries throughout never costs a target forward).

Limits: ``entropy_threshold`` 0 means the target always (its greedy decoding exactly; the draft is not
run at all, so ``draft_calls`` is 0), ``inf`` the draft always (its greedy decoding; the target is never
run). Defaults: ``DEFAULT_THRESHOLD`` nats over ``DEFAULT_WINDOW`` steps.

Rows are decoded as one static batch (``generate``): the draft runs every live row each step; the target
runs when some row needs it, on one segment holding each such row's unseen tokens right-aligned (the
other rows hold holes there). A finished row leaves both caches.
"""

from __future__ import annotations

import time
from collections import deque

import torch

from specdec.decode.engine.cache import KVState
from specdec.decode.engine.own import OwnLoop
from specdec.decode.engine.types import GenRequest, GenResult
from specdec.models.errors import UsageError

DEFAULT_THRESHOLD = 1.5  # nats: the target takes over while the draft's rolling entropy is above this
DEFAULT_WINDOW = 5  # next-token distributions the rolling entropy averages


def entropy(logits: torch.Tensor) -> torch.Tensor:
    """The entropy (nats) of softmax(logits) over the last axis, in float32 at least; -inf logits (a
    reduced vocabulary's tokens it never drafts) count as probability 0."""
    logits = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
    logp = torch.log_softmax(logits, -1)
    p = logp.exp()
    return -torch.where(p > 0, p * logp, torch.zeros_like(p)).sum(-1)


class _Row:
    __slots__ = ("index", "seq", "tokens", "max_new", "seen", "entropies", "finish", "target_calls", "draft_calls",
                 "target_tokens", "start", "wall")

    def __init__(self, index: int, req: GenRequest, window: int, start: float):
        self.index = index
        self.seq = list(req.prompt_ids)  # prompt + emitted tokens
        self.tokens: list[int] = []  # emitted tokens
        self.max_new = req.max_new_tokens
        self.seen = 0  # tokens of seq the target's cache holds
        self.entropies: deque = deque(maxlen=window)
        self.finish: str | None = None
        self.target_calls = self.draft_calls = self.target_tokens = 0
        self.start, self.wall = start, 0.0


class EadDecoder(OwnLoop):
    """Entropy Adaptive Decoding over ``target`` with ``draft`` (same tokenizer and vocabulary); greedy."""

    approximate = True
    argmax_only = True  # the output layer screened (OwnLoop.output_layer)

    def __init__(self, target, tokenizer, options, draft, threshold: float | None = None, window: int | None = None):
        super().__init__(target, tokenizer, options)
        from specdec.models.loading import input_device

        self.model = draft
        self.threshold = DEFAULT_THRESHOLD if threshold is None else float(threshold)
        self.window = DEFAULT_WINDOW if window is None else int(window)
        if not self.threshold >= 0:  # NaN too
            raise UsageError(f"--entropy-threshold must be a number >= 0 (nats), got {threshold}")
        if self.window < 1:
            raise UsageError(f"--entropy-window must be a positive integer, got {window}")
        self.device = input_device(target)

    @property
    def uses_draft(self) -> bool:
        """At threshold 0 the target emits every token: the draft's entropy decides nothing."""
        return self.threshold > 0

    def _wants_target(self, row: _Row) -> bool:
        if not self.uses_draft:
            return True
        return sum(row.entropies) / len(row.entropies) > self.threshold

    def generate(self, requests: list[GenRequest]) -> list[GenResult]:
        start = time.perf_counter()
        rows = [_Row(i, r, self.window, start) for i, r in enumerate(requests)]
        live = [row for row in rows if row.max_new > 0]
        for row in rows:
            if row.max_new <= 0:
                row.finish = "length"
        if live:
            with self.output_layer():  # the target's tokens are its argmax; the draft's entropies come from its own layer
                self._decode(live)
        return [self._result(row) for row in rows]

    @torch.no_grad()
    def _decode(self, live: list[_Row]) -> None:
        target_state = KVState(self.target, len(live), self.device)
        draft_state = KVState(self.model, len(live), self.device, lean=True) if self.uses_draft else None
        draft_logits = None
        if draft_state is not None:  # the draft's prefill: its first distribution of every row
            draft_logits = self._feed(draft_state, [row.seq for row in live])
            for row, h in zip(live, entropy(draft_logits).tolist()):
                row.entropies.append(h)
                row.draft_calls += 1
        while live:
            toks = draft_logits.argmax(-1).tolist() if draft_logits is not None else [0] * len(live)
            takers = [j for j, row in enumerate(live) if self._wants_target(row)]
            if takers:
                taking = set(takers)
                pending = [row.seq[row.seen :] if j in taking else [] for j, row in enumerate(live)]
                best = self._feed(target_state, pending).argmax(-1).tolist()
                for j in takers:
                    row = live[j]
                    row.seen = len(row.seq)
                    row.target_calls += 1
                    row.target_tokens += 1
                    toks[j] = best[j]
            for row, tok in zip(live, toks):
                row.seq.append(tok)
                row.finish = self.append(row.tokens, [tok], row.max_new)
                if row.finish:
                    row.wall = time.perf_counter() - row.start
            keep = [j for j, row in enumerate(live) if not row.finish]
            if len(keep) < len(live):
                if not keep:
                    break
                index = torch.tensor(keep, device=self.device)
                target_state.select_rows(index)
                if draft_state is not None:
                    draft_state.select_rows(index)
                live = [live[j] for j in keep]
                toks = [toks[j] for j in keep]
            if draft_state is not None:  # the draft sees every emitted token: its next distributions
                draft_logits = self._feed(draft_state, [[t] for t in toks])
                for row, h in zip(live, entropy(draft_logits).tolist()):
                    row.entropies.append(h)
                    row.draft_calls += 1

    def _feed(self, state: KVState, pending: list[list[int]]) -> torch.Tensor:
        """One forward of ``state``'s model on each row's ``pending`` tokens, right-aligned (holes on the
        left; a row with none is all holes); the last position's logits [B, V]."""
        width = max(map(len, pending))
        ids = torch.zeros(len(pending), width, dtype=torch.long)
        valid = torch.zeros(len(pending), width, dtype=torch.bool)
        for r, p in enumerate(pending):
            if p:
                ids[r, width - len(p) :] = torch.tensor(p, dtype=torch.long)
                valid[r, width - len(p) :] = True
        ids, valid = ids.to(self.device), valid.to(self.device)
        # a whole segment of every row (one row's prompt, a step of every row) needs no hole bookkeeping:
        # the state keeps its plain causal path while it has no holes
        # (a draft's one-token steps keep its lean forward, which takes no logits_to_keep)
        out = state.forward(ids, None if bool(valid.all()) else valid, **({"logits_to_keep": 1} if width > 1 else {}))
        state.commit_prefix(width, valid)
        return out.logits[:, -1]

    def _result(self, row: _Row) -> GenResult:
        new = len(row.tokens)
        stats = {
            "new_tokens": new,
            "target_calls": row.target_calls,
            "draft_calls": row.draft_calls,
            "target_tokens": row.target_tokens,
            "target_share": round(row.target_tokens / new, 6) if new else 0.0,
            "approximate": True,
            "row_wall_s": round(row.wall, 6),
        }
        return GenResult(token_ids=row.tokens, finish_reason=row.finish or "length", stats=stats)
