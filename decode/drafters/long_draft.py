"""LongSpec's drafter: a draft model whose KV cache keeps a constant size however long the text grows.

The cache holds each row's first ``sinks`` tokens (attention sinks) and its last ``window`` committed
tokens; the middle is evicted. Eviction happens after each feed of the committed text (before the round's
drafts are drawn), so between feeds the cache holds at most sinks + window slots per row, and while a
round drafts, those plus the round's drafts. A prompt is fed in chunks of ``window`` tokens with an
eviction after each, so even a long prefill keeps the buffers at sinks + 2 window slots (+ headroom).

Positions stay the text's own: a slot keeps the position id it was written at (``SlotBook.positions``),
the keys were rotated at that position when written (HF caches store keys already rotated), and a new
token gets its row's next position, so evicting slots shifts nothing. Which slots a query sees is the
slots' validity mask, as everywhere in ``decode.engine.cache``. The draft was trained for it
(``train.trainers.draft``: a sinks + window mask at anchor-offset positions); whatever it drafts, the target
verifies: decoding stays lossless.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from specdec.decode.drafters.base import Segment
from specdec.decode.drafters.draft_model import ModelDrafter
from specdec.decode.engine.cache import KVState
from specdec.decode.engine.types import Scheme


def long_context(model) -> dict | None:
    """A LongSpec draft's ``{"window": W, "sinks": S}`` (its config's ``specdec_long``), None for another draft."""
    meta = getattr(getattr(model, "config", None), "specdec_long", None)
    if not isinstance(meta, dict) or "window" not in meta:
        return None
    return {"window": int(meta["window"]), "sinks": int(meta.get("sinks", 0))}


def evict(state: KVState, sinks: int, window: int) -> None:
    """Keep, of each row's slots, those at positions below ``sinks`` and the last ``window`` before the row's
    next position; the kept slots move, in order, to the head of the buffers, each row's right-aligned
    (holes on the left of shorter rows). Nothing moves when no slot would go."""
    if state.cache is None or not state.length or state.prefix is not None:
        return
    start = state.pos[:, None] - window
    keep = state.valid & ((state.positions < sinks) | (state.positions >= start))
    count = keep.sum(-1)
    width = int(count.max())
    if width == state.length:
        return
    # each kept slot's place: right-aligned in its row, in the order of the slots
    place = width - count[:, None] + keep.long().cumsum(-1) - 1
    rows, slots = keep.nonzero(as_tuple=True)
    index = torch.zeros(keep.shape[0], width, dtype=torch.long, device=keep.device)
    index[rows, place[rows, slots]] = slots
    valid = torch.zeros(keep.shape[0], width, dtype=torch.bool, device=keep.device)
    valid[rows, place[rows, slots]] = True
    # gathered first (copies), then written over the buffers' head: the old slots may overlap the new ones
    kv = []
    for k, v in state.cache.committed(state.length):
        idx = index[:, None, :, None]
        kv.append((k.gather(2, idx.expand(-1, k.shape[1], -1, k.shape[-1])), v.gather(2, idx.expand(-1, v.shape[1], -1, v.shape[-1]))))
    for layer in state.cache.layers:
        layer.offset = 0
    state.cache.write_rows(0, keep.shape[0], kv, width, width)
    state.positions = state.positions.gather(1, index)
    state.valid = valid
    state._solid = False


class LongDrafter(ModelDrafter):
    """A ModelDrafter whose cache keeps the sinks and the last ``window`` tokens of every row (``evict``)."""

    def __init__(self, model, window: int, sinks: int = 4, scheme: Scheme | str = Scheme.standard, width: int = 2):
        super().__init__(model, scheme=scheme, width=width)
        self.window, self.sinks = max(1, int(window)), max(0, int(sinks))
        self.chunk = self.window  # the prompt is fed this many tokens at a time

    def _feed_pending(self, batch, hidden: bool = False):
        """Feed every row's not-yet-fed tokens, ``chunk`` at a time while more are pending, evicting after
        each feed; the last position's logits (and hidden state if asked)."""
        self._feed_chunks(batch.seqs, batch.device)
        out = super()._feed_pending(batch, hidden)
        evict(self.state, self.sinks, self.window)
        return out

    def _feed_chunks(self, seqs, device) -> None:
        """Feed the rows' pending tokens until at most ``chunk`` are left per row, a chunk per forward."""
        while True:
            rest = [len(s) - f for s, f in zip(seqs, self.fed)]
            if max(rest, default=0) <= self.chunk:
                return
            # a row takes what brings it down to ``chunk`` pending, at most a chunk: every row ends the
            # loop with its last tokens still to feed (the final feed's logits are each row's last)
            upto = [f + min(self.chunk, max(r - self.chunk, 0)) for f, r in zip(self.fed, rest)]
            super()._feed_pending(SimpleNamespace(seqs=[s[:u] for s, u in zip(seqs, upto)], device=device))
            evict(self.state, self.sinks, self.window)

    def admit(self, batch, seg: Segment) -> None:
        # the new rows' prompts (their first token, the root, is pending) fed in chunks into a state of their
        # own, evicting as the drafter does, then merged after the running rows
        running, fed = self.state, self.fed
        self.state = KVState(self.model, len(batch.seqs), batch.device, lean=True, compile=batch.compile)
        self.fed = [0] * len(batch.seqs)
        prompts = [seq[: len(seq) - 1] for seq in batch.seqs]
        self._feed_chunks(prompts, batch.device)
        if max(len(p) - f for p, f in zip(prompts, self.fed)) > 0:
            super()._feed_pending(SimpleNamespace(seqs=prompts, device=batch.device))
            evict(self.state, self.sinks, self.window)
        new, new_fed = self.state, self.fed
        self.state, self.fed = running, fed
        self.state.admit(new)
        self.fed = fed + new_fed
