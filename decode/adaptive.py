"""SpecDec++ adaptive draft length: a draft model that stops when its acceptance head loses faith.

When the draft proposes token i, the acceptance head reads what produced it (the draft's hidden
state there and the statistics of q, ``acceptance_features``): P_i = P(token i accepted | earlier
accepted). The decision comes before token i is fed, so a round that stops after n tokens costs the
n draft forwards of a fixed-length round, no more. A row stops when 1 - prod_i P_i > stop_threshold,
bounded by [min_draft, max_draft];
rows stop independently (a chain Proposal with per-row ``lengths``) and drafting ends when every
row has stopped. Rows that stopped keep drafting alongside the others (their extra tokens are
outside their length), which keeps one KV slot per draft step for the whole batch; the inherited
ModelDrafter.observe rollback stays correct because a row never accepts beyond its length.
"""

from __future__ import annotations

from pathlib import Path

import torch

from specdec.decode.drafters import ModelDrafter, Proposal


FEATURES = "prev-hidden+q-stats"  # recorded in the artifact; decode refuses heads that read anything else
N_STATS = 3


def acceptance_features(hidden, logits, tokens):
    """[..., H + 3]: the draft's hidden state where it proposed ``tokens`` and, from its logits there
    (softmax at T=1), q(token), max q and the entropy of q. Training and decoding both call this."""
    logq = torch.log_softmax(logits.float(), -1)
    q = logq.exp()
    stats = torch.stack([q.gather(-1, tokens[..., None]).squeeze(-1), q.max(-1).values, -torch.special.xlogy(q, q).sum(-1)], -1)
    return torch.cat([hidden.float(), stats], -1)


class AdaptiveDrafter(ModelDrafter):
    def __init__(self, model, head, stop_threshold: float = 0.3, min_draft: int = 2, max_draft: int = 20):
        super().__init__(model)
        if not 0 < stop_threshold < 1 or min_draft < 1 or max_draft < min_draft:
            raise ValueError("need 0 < stop_threshold < 1 and 1 <= min_draft <= max_draft")
        self.head = head
        self.stop_threshold = stop_threshold
        self.min_draft, self.max_draft = min_draft, max_draft
        self.default_k = max_draft  # the engine bounds drafting by the room left in the context
        self.last_lengths: torch.Tensor | None = None  # per-row lengths of the last proposal (for stats/tests)

    def propose(self, batch) -> Proposal | None:
        kmax = min(self.max_draft, batch.num_draft)
        if kmax <= 0:
            return None
        kmin = min(self.min_draft, kmax)
        logits, h = self._feed_pending(batch, hidden=True)
        bsz = logits.shape[0]
        lengths = torch.zeros(bsz, dtype=torch.long, device=logits.device)  # 0 = still drafting
        keep_going = torch.ones(bsz, dtype=torch.float64, device=logits.device)  # prod_i P_i
        tokens, probs = [], []
        n = 0
        while True:
            tok, q = self._pick(logits, batch)
            tokens.append(tok)
            probs.append(q)
            n += 1
            feats = acceptance_features(h, logits, tok).to(_dtype(self.head))
            keep_going = keep_going * torch.sigmoid(self.head(feats).double())
            stop = ((1 - keep_going) > self.stop_threshold) & (n >= kmin) | (n >= kmax)
            lengths = torch.where(stop & (lengths == 0), torch.full_like(lengths, n), lengths)
            if bool((lengths > 0).all()):  # one host sync per draft step: the stop decision
                break
            out = self.state.forward(tok[:, None], hidden=True)
            self.state.commit_prefix(1, torch.ones_like(tok[:, None], dtype=torch.bool))
            logits, h = out.logits[:, -1], out.hidden_states[-1][:, -1]
        self._drafted = n - 1  # drafts d1..d_{n-1} sit in the draft cache, as after a fixed-length round
        self.last_lengths = lengths
        draft_probs = None if probs[0] is None else torch.stack(probs, 1)
        return Proposal(tokens=torch.stack(tokens, 1), lengths=lengths, draft_probs=draft_probs)


def _dtype(module) -> torch.dtype:
    return next(module.parameters()).dtype


def build_adaptive(acceptance_dir: Path, draft_model, options, tokenizer=None) -> AdaptiveDrafter:
    """Factory for ``--acceptance DIR``: options has stop_threshold, min_draft, max_draft.

    The acceptance artifact's target fingerprint is checked against ``tokenizer`` (or
    ``options.tokenizer``) when one is given, and its hidden size against the draft's.
    """
    from specdec.decode.artifacts import SpecdecError, check_fingerprint, read_config, tokenizer_fingerprint
    from specdec.train.acceptance import load_acceptance_head

    cfg = read_config(acceptance_dir)
    if cfg.get("kind") != "acceptance":
        raise SpecdecError(f"{acceptance_dir} is not an acceptance artifact (kind {cfg.get('kind')!r})")
    tokenizer = tokenizer if tokenizer is not None else getattr(options, "tokenizer", None)
    if tokenizer is not None:
        check_fingerprint(cfg["target"], tokenizer_fingerprint(tokenizer), f"acceptance head {acceptance_dir}")
    hidden = getattr(draft_model.config, "hidden_size", None)
    if hidden != cfg.get("hidden_size"):  # checked before the weights are read
        raise SpecdecError(
            f"acceptance head {acceptance_dir} was trained on a draft with hidden size {cfg.get('hidden_size')}, "
            f"this draft has {hidden}"
        )
    head, _ = load_acceptance_head(acceptance_dir)
    head.to(device=next(draft_model.parameters()).device, dtype=next(draft_model.parameters()).dtype)
    return AdaptiveDrafter(
        draft_model,
        head,
        stop_threshold=float(getattr(options, "stop_threshold", 0.3)),
        min_draft=int(getattr(options, "min_draft", 2)),
        max_draft=int(getattr(options, "max_draft", 20)),
    )
