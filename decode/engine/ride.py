"""Prompts that ride the verify forwards (continuous batching with ``prefill_chunk``, SARATHI).

A request admitted into a running batch joins as a row of the target's state whose prompt is
prefilled a chunk a round inside the batch's verify forwards (``Ride``), instead of in a forward of its
own. It is not yet a row of the batch the drafter sees: each chunk's outputs are kept on its ``Joining``
entry and handed over as one prefill segment (``stack``) when its prompt is complete.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from specdec.decode.drafters.base import Segment
from specdec.decode.engine.cache import left_pad
from specdec.decode.engine.types import GenRequest


@dataclass
class Joining:
    """A request whose prompt is being prefilled a chunk a round in the verify forwards; its row of the
    target's state follows the batch's rows, in the order of the joining list."""

    request: GenRequest
    index: int  # the request's index in the job
    done: int = 0  # prompt tokens in the cache
    pieces: list = field(default_factory=list)  # per chunk: (logits, hidden, hidden layers) of its tokens

    @property
    def complete(self) -> bool:
        return self.done == len(self.request.prompt_ids)


class Ride:
    """One verify forward's rows for the joining requests: each takes the next chunk of its prompt
    (``prefill_chunk`` tokens, or the verify width when that is wider), causal within the chunk, left
    aligned like the batch's rows, the rest of the row holes."""

    def __init__(self, engine, joining: list[Joining], width: int):
        self.engine, self.joining = engine, joining
        chunk = max(engine.prefill_chunk, width)
        self.lengths = [min(chunk, len(j.request.prompt_ids) - j.done) for j in joining]
        self.width = max(width, *self.lengths)
        self.verify_width = width
        self.keep_all = engine.drafter.needs_prefill_logits
        # logits are kept at the batch's verify positions and at the last token of each chunk that ends
        # a prompt (its first new token), not for every prompt token of every chunk
        ends = sorted({n - 1 for j, n in zip(joining, self.lengths) if j.done + n == len(j.request.prompt_ids)} - set(range(width)))
        self.kept = list(range(width)) + ends
        self.model_kwargs = {} if self.keep_all else {"logits_to_keep": torch.tensor(self.kept, device=engine.device)}

    def inputs(self, input_ids, valid, tree_attn, depth) -> tuple:
        """The forward's (input_ids, input_valid, tree_attn, depth): the batch's rows padded with holes to
        the ride's width, then one row per joining request."""
        device, w = self.engine.device, self.width
        bsz, t = input_ids.shape
        pad = w - t
        ids = torch.zeros(len(self.joining), w, dtype=torch.long)
        for i, (j, n) in enumerate(zip(self.joining, self.lengths)):
            ids[i, :n] = torch.tensor(j.request.prompt_ids[j.done : j.done + n], dtype=torch.long)
        own = torch.arange(w)[None] < torch.tensor(self.lengths)[:, None]
        input_ids = torch.cat([F.pad(input_ids, (0, pad)), ids.to(device)])
        valid = torch.cat([F.pad(valid, (0, pad), value=False), own.to(device)])
        if tree_attn is None:  # causal rows: depths follow from the holes
            return input_ids, valid, None, None
        causal = torch.ones(w, w, dtype=torch.bool, device=device).tril_()
        tree_attn = torch.cat([F.pad(tree_attn, (0, pad, 0, pad), value=False), causal.expand(len(self.joining), w, w)])
        steps = torch.arange(w, device=device)
        depth = torch.cat([F.pad(depth, (0, pad)), steps.expand(len(self.joining), w)])
        return input_ids, valid, tree_attn, depth

    def split(self, out, bsz: int) -> tuple:
        """The batch's rows' (logits, last hidden, hidden layers) at the verify positions; each joining
        request's chunk outputs go to its pieces."""
        hidden, layers = self.engine.hidden_of(out)
        t = self.verify_width
        logits = out.logits
        for i, (j, n) in enumerate(zip(self.joining, self.lengths)):
            row = bsz + i
            ends = j.done + n == len(j.request.prompt_ids)
            if self.keep_all:
                piece = logits[row, :n]
            else:
                piece = logits[row, self.kept.index(n - 1)][None] if ends else None
            j.pieces.append((piece, None if hidden is None else hidden[row, :n],
                             None if layers is None else tuple(h[row, :n] for h in layers)))
            j.done += n
        cut = (lambda x: None if x is None else x[:bsz, :t])
        return logits[:bsz, :t], cut(hidden), None if layers is None else tuple(cut(h) for h in layers)

    def keep(self, index: torch.Tensor, keep_valid: torch.Tensor) -> tuple:
        """The slots every row keeps: the batch's rows' (index [B, M] into the segment, validity), padded,
        then each joining row's whole chunk."""
        m = max(index.shape[1], *self.lengths)
        device = self.engine.device
        steps = torch.arange(m, device=device)
        pad = m - index.shape[1]
        index = torch.cat([F.pad(index, (0, pad)), steps.expand(len(self.joining), m)])
        own = steps[None] < torch.tensor(self.lengths, device=device)[:, None]
        return index, torch.cat([F.pad(keep_valid, (0, pad), value=False), own])


def stack(pieces: list[list[tuple]], prompts: list[list[int]], device, keep_all: bool) -> Segment:
    """The prefill segment of requests whose prompts were prefilled in chunks (each request's chunks'
    (logits, hidden, hidden layers)), left-padded among themselves as one prefill pads them. Logits are
    every prompt token's with ``keep_all``, else the last token's (the one piece its chunks kept)."""
    width = max(map(len, prompts))

    def rows(parts: list) -> torch.Tensor:  # one [T_i, ...] tensor per request -> [B, width, ...]
        return torch.stack([left_pad(p, width, 0, dim=0) for p in parts])

    ids = rows([torch.tensor(p, dtype=torch.long, device=device) for p in prompts])
    valid = rows([torch.ones(len(p), dtype=torch.bool, device=device) for p in prompts])
    logits = [torch.cat([c[0] for c in chunks if c[0] is not None]) for chunks in pieces]
    logits = rows(logits) if keep_all else torch.stack(logits)
    hidden = layers = None
    if pieces[0][0][1] is not None:
        hidden = rows([torch.cat([c[1] for c in chunks]) for chunks in pieces])
    if pieces[0][0][2] is not None:
        count = len(pieces[0][0][2])
        layers = tuple(rows([torch.cat([c[2][i] for c in chunks]) for chunks in pieces]) for i in range(count))
    return Segment(ids, valid, logits, hidden, layers)
