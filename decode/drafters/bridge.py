"""A draft causal LM whose tokenizer is not the target's (universal assisted generation).

Most targets have no small sibling that shares their tokenizer. Each round this drafter turns the
row's target tokens into text, the text into the draft's tokens, lets the draft continue greedily, and
turns the continuation back into target tokens: the row's last few target tokens are re-encoded
together with the new text, and what follows them, where they come out unchanged, is the proposal
(where the join re-tokenises differently under every window tried, the row drafts nothing that round).

The target verifies the proposal like any other: greedy output is plain decoding's token for token,
and at T > 0 the drafts are verified as given tokens (a one-hot q: accepted with probability p(x),
else the residual), which keeps the target's distribution exactly. The draft keeps no cache across
rounds: it reads the last ``context`` tokens of each row's text afresh each round (the batch's rows in
one forward a step), which a small draft on a short context pays for easily and which needs no
reconciliation of two tokenizations.
"""

from __future__ import annotations

import torch

from specdec.decode.drafters.base import Drafter, Segment, chain_proposal

WINDOWS = (8, 4, 2, 1)  # target tokens re-encoded with the new text to find where the continuation starts


class TokenizerBridgeDrafter(Drafter):
    default_k = 4

    def __init__(self, model, draft_tokenizer, target_tokenizer, context: int = 256):
        # not ``model``: that names a draft that reads the target's token ids (the bench times it on them); this
        # one reads its own, so its cost is the measured propose time, and the memory model counts it through modules()
        self.draft_model, self.draft_tokenizer, self.target_tokenizer = model.eval(), draft_tokenizer, target_tokenizer
        self.context = context

    def modules(self) -> list:
        return [self.draft_model]

    def admit(self, batch, seg: Segment) -> None:
        pass  # nothing is kept per row: each round reads the row's text afresh

    def _continuations(self, texts: list[str], k: int) -> list[str]:
        """The draft's greedy continuations of ``texts`` (k of its tokens each), as text: one batched
        forward per step, rows left-padded with their positions counted from their first real token."""
        tok = self.draft_tokenizer
        ids = [tok(t, add_special_tokens=True)["input_ids"][-self.context :] or [tok.eos_token_id or 0] for t in texts]
        device = next(self.draft_model.parameters()).device
        width = max(map(len, ids))
        x = torch.tensor([[0] * (width - len(i)) + i for i in ids], device=device)
        mask = torch.tensor([[0] * (width - len(i)) + [1] * len(i) for i in ids], device=device)
        new = torch.zeros(len(ids), 0, dtype=torch.long, device=device)
        past = None
        with torch.inference_mode():
            for _ in range(k):
                positions = (mask.cumsum(-1) - 1).clamp(min=0)[:, -x.shape[1] :]
                out = self.draft_model(input_ids=x, attention_mask=mask, position_ids=positions, past_key_values=past, use_cache=True)
                past = out.past_key_values
                x = out.logits[:, -1].argmax(-1, keepdim=True)
                new = torch.cat([new, x], dim=1)
                mask = torch.cat([mask, torch.ones_like(x)], dim=1)
        texts_out = []
        for row, more in zip(ids, new.tolist()):
            base = tok.decode(row, skip_special_tokens=True)
            full = tok.decode(row + more, skip_special_tokens=True)
            texts_out.append(full[len(base) :] if full.startswith(base) else tok.decode(more, skip_special_tokens=True))
        return texts_out

    def to_target(self, seq: list[int], new_text: str, k: int) -> list[int]:
        """Up to ``k`` target tokens for ``new_text`` continuing the row ``seq`` (target ids): the row's last
        target tokens re-encoded with the new text, read after them where they come out unchanged."""
        tok = self.target_tokenizer
        if not new_text:
            return []
        for w in WINDOWS:
            if len(seq) < w:
                continue
            tail = seq[-w:]
            enc = tok(tok.decode(tail, skip_special_tokens=False) + new_text, add_special_tokens=False)["input_ids"]
            if enc[:w] == tail:
                return enc[w : w + k]
        return []

    def propose(self, batch):
        if batch.num_draft <= 0:
            return None
        seqs = [list(seq) for seq in batch.seqs]
        texts = self._continuations([self.target_tokenizer.decode(s, skip_special_tokens=True) for s in seqs], batch.num_draft)
        return chain_proposal([self.to_target(s, t, batch.num_draft) for s, t in zip(seqs, texts)], batch.device)
