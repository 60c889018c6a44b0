"""PEARL's pre-verify: one verification split into two target forwards, so a round whose first draft
every row rejects ends without waiting for the rest of the drafts (``decode.drafters.pearl``)."""

from __future__ import annotations

import torch

from specdec.decode.drafters.base import Proposal, Segment
from specdec.decode.engine.cache import KVState
from specdec.decode.engine.verify import Verdict, verify_chain


def verify(engine, state: KVState, batch, first: Proposal) -> tuple[Segment, Verdict, Proposal]:
    """PEARL's pre-verify: ``first`` holds each row's first draft d1 and the drafter draws d2..dK
    meanwhile. A forward over [root] alone tests d1; a row that rejects it is done (the correction
    token drawn from the root's residual), and when every row does, the round ends without waiting
    for the rest. Otherwise a second forward over [d1..dK] (the root is in the cache now) tests
    d2..dK for the rows that accepted d1, the others holes. These are the tests one forward over
    [root, d1..dK] makes, in the same order, split in two: greedy output and the sampled
    distribution are those of ``SpecEngine._verify``. Whether any row goes on is a second host sync. Returns
    the proposal the verdict refers to."""
    bsz = len(batch.seqs)
    root = batch.root[:, None]
    ones = torch.ones(bsz, 1, dtype=torch.bool, device=engine.device)
    out = state.forward(root, None, hidden=engine.wants_hidden)
    state.commit_prefix(1, ones)
    # the token after an accepted d1 needs d1's logits, which only the second forward has: the root's
    # stand in for them, and what is drawn from them is never used
    first_verdict = verify_chain(out.logits.expand(-1, 2, -1), first.tokens, first.draft_probs, batch.sampling, batch.generator)
    seg = Segment(root, ones, out.logits, *engine.hidden_of(out), keep_index=torch.zeros_like(root), keep_valid=ones)
    ok = first_verdict.accepted > 0
    if not bool(ok.any()):
        return seg, first_verdict, first
    proposal = first.rest()
    n = proposal.tokens.shape[1]
    all_ok = bool(ok.all())
    valid = ok[:, None].expand(bsz, n)
    # every row going on: no validity given keeps a single row's mask-free causal path open
    out2 = state.forward(proposal.tokens, None if all_ok else valid, hidden=engine.wants_hidden)
    probs = None if proposal.draft_probs is None else proposal.draft_probs[:, 1:]
    rest = verify_chain(out2.logits, proposal.tokens[:, 1:], probs, batch.sampling, batch.generator, None, engine.kernels)
    accepted = torch.where(ok, rest.accepted + 1, 0)
    next_token = torch.where(ok, rest.next_token, first_verdict.next_token)
    keep = int(accepted.max().item())
    steps = torch.arange(n, device=engine.device)[None]
    state.commit_prefix(keep, (steps < accepted[:, None])[:, :keep])
    path = torch.where(steps < accepted[:, None], steps, -1)
    index = torch.arange(keep + 1, device=engine.device)[None].expand(bsz, keep + 1)
    (hidden, layers), (hidden2, layers2) = (seg.hidden, seg.hidden_layers), engine.hidden_of(out2)
    seg = Segment(
        torch.cat([root, proposal.tokens], 1),
        torch.cat([ones, valid], 1),
        torch.cat([out.logits, out2.logits], 1),
        None if hidden is None else torch.cat([hidden, hidden2], 1),
        None if layers is None else tuple(torch.cat(pair, 1) for pair in zip(layers, layers2)),
        keep_index=index,
        keep_valid=index <= accepted[:, None],
    )
    return seg, Verdict(accepted=accepted, path=path, next_token=next_token), proposal
