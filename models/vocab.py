"""Reduced draft vocabularies: a drafter that proposes only the N most frequent tokens of its training
text, with a draft-to-target id map in its artifact (``draft_vocab.safetensors``: ``d2t`` [N] int64).

A 262k-token output layer costs a draft nearly what it costs the target; restricted to the tokens
that make up almost all text (N = 16k-32k covers 97-99% of code and prose), the draft's output layer
is 8-16x cheaper. Verification stays exact: a token outside the draft vocabulary is simply never
drafted, and the target's verdict is unchanged. A draft model's inputs are target tokens: one outside
its vocabulary is read as the draft's ``unk`` row (the last id, reserved for it).
"""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path

import torch

FILE = "draft_vocab.safetensors"


class DraftVocab:
    """``d2t`` [N] (draft id -> target id, the last entry the unk row's stand-in) and its inverse ``t2d``
    [V] (target id -> draft id, unk for tokens outside)."""

    def __init__(self, d2t: torch.Tensor, target_vocab: int):
        self.d2t = d2t.long()
        self.target_vocab = int(target_vocab)
        t2d = torch.full((self.target_vocab,), len(self.d2t) - 1, dtype=torch.long)
        t2d[self.d2t[:-1]] = torch.arange(len(self.d2t) - 1)
        self.t2d = t2d

    @property
    def size(self) -> int:
        return len(self.d2t)

    def to(self, device) -> "DraftVocab":
        self.d2t, self.t2d = self.d2t.to(device), self.t2d.to(device)
        return self

    def coverage(self, counts: Counter) -> float:
        inside = set(self.d2t[:-1].tolist())
        total = sum(counts.values())
        return sum(c for t, c in counts.items() if t in inside) / total if total else 0.0

    def save(self, folder: str | os.PathLike) -> None:
        from safetensors.torch import save_file

        save_file({"d2t": self.d2t.cpu().contiguous()}, str(Path(folder) / FILE),
                  metadata={"target_vocab": str(self.target_vocab)})


def most_frequent(counts: Counter, size: int, target_vocab: int, always: list[int] = ()) -> DraftVocab:
    """The ``size - 1`` most frequent tokens (``always`` first: special tokens such as EOS), then the unk
    row's stand-in (the most frequent token left out, or 0)."""
    keep = list(dict.fromkeys(int(t) for t in always))
    for tok, _ in counts.most_common():
        if len(keep) >= size - 1:
            break
        if tok not in keep:
            keep.append(int(tok))
    rest = next((t for t in range(target_vocab) if t not in set(keep)), 0) if len(keep) < target_vocab else 0
    return DraftVocab(torch.tensor(keep + [rest]), target_vocab)


def load(folder: str | os.PathLike) -> DraftVocab | None:
    """The artifact's draft vocabulary, or None where it drafts the target's whole vocabulary."""
    path = Path(folder) / FILE
    if not path.is_file():
        return None
    from safetensors import safe_open

    with safe_open(str(path), "pt") as fh:
        d2t = fh.get_tensor("d2t")
        target_vocab = int((fh.metadata() or {}).get("target_vocab", int(d2t.max()) + 1))
    return DraftVocab(d2t, target_vocab)


class MappedVocabLM(torch.nn.Module):
    """A draft causal LM over a reduced vocabulary, seen by the engine as one over the target's: inputs
    are mapped target -> draft ids, logits are spread back over the target's vocabulary (-inf outside:
    never drafted, probability zero). Everything else is the inner model's."""

    def __init__(self, inner, vocab: DraftVocab):
        super().__init__()
        self.inner = inner
        self.vocab = vocab.to(next(inner.parameters()).device)

    @property
    def config(self):
        return self.inner.config

    @property
    def dtype(self):
        return self.inner.dtype

    @property
    def device(self):
        return self.inner.device

    @property
    def generation_config(self):
        return self.inner.generation_config

    def get_input_embeddings(self):
        return self.inner.get_input_embeddings()

    def forward(self, input_ids=None, **kwargs):
        out = self.inner(input_ids=self.vocab.t2d[input_ids], **kwargs)
        logits = out.logits
        full = logits.new_full((*logits.shape[:-1], self.vocab.target_vocab), float("-inf"))
        # the unk row (last draft id) is no token: it stays -inf
        full[..., self.vocab.d2t[:-1]] = logits[..., :-1]
        out.logits = full
        return out
