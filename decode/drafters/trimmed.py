"""The target drafting for itself with its output layer cut to the tokens it emits (``trimmed``).

A small model's decode step on a CPU is split between its decoder layers and its output layer: Gemma 3
270M's 262k x 640 output layer is 178 MB of the 279 MB a token reads (Q8_0), about 40% of the step.
This drafter runs the target's own forward, in the target's own cache, one token at a time, with the
output layer swapped for the rows of a token set (``TrimmedHead``): the tokens the target emits most
(the vocabulary counted from the target's own outputs that its family's trained drafters ship, or one
given as ``trimmed:PATH``) and every token of the rows' text, a set that grows as the job goes on. Its
hidden states are the target's, so its draft is the target's own next token wherever that token is in
the set: 98.7% of Gemma 3 270M's greedy tokens on held-out code and prose, with a 16k-token set.

A round feeds the root and N drafts (N + 1 forwards of the layers and the small output layer), keeping
each position's last hidden state (``Proposal.states``); verification then needs no forward of its own:
the engine runs the full output layer once over the N + 1 states (the screen of ``models.head`` reads
its 178 MB once for all of them) and the one verification routine decides, and the cache keeps the
accepted slots. The output is the target's own: greedy, each position's argmax of the full layer;
sampled, speculative sampling with the draft's distribution (the target's softmax over the set).

With ``--lookup ngram`` (one row, greedy), each forward also takes what n-gram lookup guesses follows the draft it
feeds: the guesses the draft itself would draw are kept, the cache drops the rest. Where the text repeats,
several drafts then cost one forward of a few positions instead of one forward each. What is drafted does
not change (each draft is still the set's argmax, or a sample of its softmax), only how many forwards it takes.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch

from specdec.decode.drafters.base import Drafter, Proposal, draw
from specdec.decode.engine.length import LengthPolicy
from specdec.models import blocks as qblocks
from specdec.models import vocab


class TrimmedHead(torch.nn.Module):
    """An output layer over a token set: the target's own rows for those tokens (its GGUF blocks where the
    target reads them, else its weights), every other token at -inf. The set only grows (``add``)."""

    def __init__(self, linear: torch.nn.Linear, fast, tokens: torch.Tensor):
        super().__init__()
        object.__setattr__(self, "linear", linear)  # the target's layer, not a submodule: its weights stay the target's
        self.vocab = linear.out_features
        self.found = getattr(fast, "blocks", None)  # (blocks, qtype) of a GGUF target (fast: its models.head.FastHead)
        self.ids = torch.empty(0, dtype=torch.long)
        self.member = torch.zeros(self.vocab, dtype=torch.bool)
        self.rows = None
        self.bias = None
        self.add(tokens)

    def add(self, tokens) -> int:
        """Add tokens to the set; the number new to it."""
        t = torch.as_tensor(tokens, dtype=torch.long).reshape(-1)
        t = t[(t >= 0) & (t < self.vocab)].unique()
        new = t[~self.member[t]]
        if new.numel() == 0:
            return 0
        self.member[new] = True
        self.ids = torch.cat([self.ids, new])
        src = self.found[0] if self.found is not None else self.linear.weight.detach()
        part = src.index_select(0, new)
        self.rows = part if self.rows is None else torch.cat([self.rows, part])
        if self.linear.bias is not None:
            b = self.linear.bias.detach().index_select(0, new)
            self.bias = b if self.bias is None else torch.cat([self.bias, b])
        return int(new.numel())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.reshape(-1, x.shape[-1])
        if self.found is not None:  # the set's blocks, at most MAX_ROWS positions a call (a GGUF target's states are float32)
            h = h.float().contiguous()
            part = torch.cat([qblocks.matmul(h[i : i + qblocks.MAX_ROWS], (self.rows, self.found[1]))
                              for i in range(0, h.shape[0], qblocks.MAX_ROWS)]).to(x.dtype)
        else:
            part = torch.nn.functional.linear(h, self.rows.to(h.dtype))
        if self.bias is not None:
            part = part + self.bias.to(part.dtype)
        out = torch.full((h.shape[0], self.vocab), float("-inf"), dtype=part.dtype, device=part.device)
        out.index_copy_(1, self.ids.to(part.device), part)
        return out.reshape(*x.shape[:-1], self.vocab)


@contextlib.contextmanager
def swapped(model, head: TrimmedHead):
    """Within: the model's output layer computes ``head``'s logits (its forward swapped on the instance)."""
    linear = model.get_output_embeddings()
    had = "forward" in linear.__dict__
    before = linear.__dict__.get("forward")
    linear.forward = head.forward
    try:
        yield
    finally:
        if had:
            linear.forward = before
        else:
            del linear.forward


class TrimmedDrafter(Drafter):
    """N drafts a round from the target's own forwards over a ``TrimmedHead``, their states kept for the
    engine's verification (``Proposal.states``); the set takes every token of the rows' text."""

    default_k = 7  # the full layer's screen reads its bytes once for up to 8 positions (models.head.SCREEN_UP_TO)
    length_policy = LengthPolicy.own  # each round costs forwards of the layers, not a verify forward
    has_draft_probs = True
    drafts_in_target = True  # its forwards run in the target's cache (``Batch.target_state``)

    def __init__(self, target, tokens: torch.Tensor, lookup: Drafter | None = None):
        """lookup: n-gram lookup (``--lookup ngram``), whose guesses of what follows a draft are fed with it
        (``_propose_guessed``, one row)."""
        self.target = target
        self.head = TrimmedHead(target.get_output_embeddings(), getattr(target, "_specdec_head", None), tokens)
        self.lookup = lookup
        self.fed = {"guessed": 0, "stepped": 0}  # drafts fed in a forward with the lookup's guesses, or one a forward

    def begin(self, batch, seg) -> None:
        for seq in batch.seqs:
            self.head.add(seq)
        if self.lookup is not None:
            self.lookup.begin(batch, seg)

    def admit(self, batch, seg) -> None:
        for seq in batch.seqs:
            self.head.add(seq)
        if self.lookup is not None:
            self.lookup.admit(batch, seg)

    def select_rows(self, rows: torch.Tensor) -> None:
        if self.lookup is not None:
            self.lookup.select_rows(rows)

    def retire(self, seqs) -> None:
        if self.lookup is not None:
            self.lookup.retire(seqs)

    def observe(self, batch, seg) -> None:
        for seq, kept in zip(batch.seqs, seg.accepted or []):
            self.head.add(seq[-(kept + 1):])
        if self.lookup is not None:
            self.lookup.observe(batch, seg)

    def propose(self, batch) -> Proposal | None:
        n = batch.num_draft
        state = getattr(batch, "target_state", None)
        if n <= 0 or state is None:
            return None
        # a guess is kept only where the draft draws it: a sample rarely is the lookup's, and a wasted guess widens a forward
        if self.lookup is not None and len(batch.seqs) == 1 and batch.sampling.greedy:
            return self._propose_guessed(batch, state, n)
        bsz = len(batch.seqs)
        tok = batch.root[:, None]
        ones = torch.ones(bsz, 1, dtype=torch.bool, device=tok.device)
        tokens, probs, states = [], [], []
        with swapped(self.target, self.head):
            for i in range(n + 1):
                out = state.forward(tok, hidden=(-1,))
                state.commit_prefix(1, ones)
                states.append(out.hidden_states[-1][:, -1])
                if i < n:
                    t, q = draw(out.logits[:, -1], batch.sampling, batch.generator)
                    tokens.append(t)
                    probs.append(q)
                    tok = t[:, None]
        self.fed["stepped"] += n
        return Proposal(tokens=torch.stack(tokens, 1), draft_probs=None if probs[0] is None else torch.stack(probs, 1),
                        states=torch.stack(states, 1))

    def _propose_guessed(self, batch, state, n: int) -> Proposal:
        """One row's chain fed with the lookup's guesses: each forward takes the next draft and what the lookup
        says follows it; the guesses the draft itself draws (the set's argmax, or its sample) stay, the first
        it does not draw is replaced by what it drew, and the cache drops the positions after it. Where the
        text repeats, several drafts then cost one forward of a few positions instead of one forward each."""
        seq = list(batch.seqs[0])
        tok = seq[-1]  # the next token to feed: the root, then each draft drawn after the kept positions
        tokens, probs, states, have = [], [], [], 0  # drafts (the last one not yet fed), positions fed and kept
        with swapped(self.target, self.head):
            while have < n + 1:
                guess = self.lookup.continuation(seq + [int(x) for x in tokens], n - have)
                feed = torch.tensor([[tok, *guess]], device=batch.root.device)
                out = state.forward(feed, hidden=(-1,))
                keep = 1
                while True:  # the draft's own token after each kept position; a guess it matches is kept
                    t, q = draw(out.logits[:, keep - 1], batch.sampling, batch.generator)
                    if keep == feed.shape[1] or int(t) != int(feed[0, keep]):
                        break
                    tokens.append(t)
                    probs.append(q)
                    keep += 1
                state.commit_prefix(keep, torch.ones(1, keep, dtype=torch.bool, device=feed.device))
                states.append(out.hidden_states[-1][:, :keep])
                have += keep
                self.fed["guessed"] += keep - 1
                if have < n + 1:
                    tokens.append(t)
                    probs.append(q)
                    tok = int(t)
                    self.fed["stepped"] += 1
        return Proposal(tokens=torch.stack(tokens, 1), draft_probs=None if probs[0] is None else torch.stack(probs, 1),
                        states=torch.cat(states, 1))


def check_trimmed_spec(spec: str) -> None:
    """``trimmed`` or ``trimmed:PATH`` (a folder holding ``draft_vocab.safetensors``, or that file)."""
    _, _, arg = spec.partition(":")
    if arg and _vocab_file(arg) is None:
        from specdec.models.errors import UsageError

        raise UsageError(f"{spec!r}: trimmed:PATH names a draft vocabulary ({vocab.FILE}, or a folder holding one)")


def _vocab_file(arg: str) -> Path | None:
    path = Path(arg)
    if path.is_dir() or path.name != vocab.FILE:
        path = path / vocab.FILE
    return path if path.is_file() else None


def family_vocab(target) -> torch.Tensor | None:
    """The target ids of the draft vocabulary its family's trained drafters ship (counted from the target's
    own outputs), when the target is a family's target and one of its members has one."""
    from specdec.models.artifacts import FAMILY_MEMBERS, family_dir, family_of

    source = getattr(target, "name_or_path", None) or getattr(target.config, "_name_or_path", None)
    family = family_of(source) if source else None
    if family is None:
        return None
    for member in FAMILY_MEMBERS:
        found = vocab.load(family_dir(family) / member)
        if found is not None:
            return found.d2t
    return None


def build_trimmed(spec: str, target, tokenizer, lookup: Drafter | None = None) -> TrimmedDrafter:
    _, _, arg = spec.partition(":")
    base = vocab.load(_vocab_file(arg).parent).d2t if arg else family_vocab(target)
    specials = [int(t) for t in (tokenizer.all_special_ids or [])] if tokenizer is not None else []
    tokens = torch.tensor(specials, dtype=torch.long) if base is None else torch.cat([base, torch.tensor(specials, dtype=torch.long)])
    return TrimmedDrafter(target, tokens, lookup)
