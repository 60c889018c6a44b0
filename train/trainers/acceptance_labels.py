"""Labels and features of the acceptance heads: what the draft proposes at a position, and whether
(greedy) or with which chance (sampling) the target keeps it.

- sampling: label min(1, p(x)/q(x)) on the draft's own sampled token x (a share of positions use a
  token of the target instead), the probability that exact speculative sampling accepts x;
- greedy: the draft proposes argmax q, accepted iff it is argmax p.
"""

from __future__ import annotations

import time

from specdec.models.acceptance import HEAD_MODES, acceptance_features


def acceptance_labels(p_probs, q_probs, tokens):
    """min(1, p(x)/q(x)) per position: p_probs, q_probs [..., V] (same temperature), tokens [...].

    The probability that exact speculative sampling accepts a drafted x; 1 where q(x) = 0 is
    impossible for a drafted token but is clamped anyway (a target-chosen token q never proposed).
    """
    import torch

    px = p_probs.gather(-1, tokens[..., None]).squeeze(-1)
    qx = q_probs.gather(-1, tokens[..., None]).squeeze(-1)
    return torch.where(qx > 0, (px / qx.clamp(min=1e-30)).clamp(max=1.0), torch.ones_like(px))


def propose_tokens(p_probs, q_probs, target_frac: float, generator):
    """The token judged at each position: sampled from q, or (target_frac of positions) from p."""
    import torch

    from_q, from_p = _sample(q_probs, generator), _sample(p_probs, generator)
    # the seeded CPU generator draws on the CPU: the same labels whichever device the models run on
    use_p = (torch.rand(from_q.shape, generator=generator) < target_frac).to(from_q.device)
    return torch.where(use_p, from_p, from_q), use_p


def _sample(probs, generator):
    """One token per row of ``probs`` [..., V] by inverting the CDF: exact, and several times faster on
    CPU than torch.multinomial over a whole block of positions (labelling's largest cost)."""
    import torch

    cdf = probs.float().cumsum(-1)
    u = torch.rand(cdf.shape[:-1] + (1,), generator=generator).to(cdf.device) * cdf[..., -1:]
    return torch.searchsorted(cdf, u, right=True).squeeze(-1).clamp_(max=probs.shape[-1] - 1)


def greedy_labels(p_logits, q_logits):
    """(tokens, labels) of greedy decoding: the draft proposes argmax q, accepted iff it is argmax p."""
    tokens = q_logits.argmax(-1)
    return tokens, (tokens == p_logits.argmax(-1)).float()


def label_blocks(draft, target, blocks, temperature: float, target_frac: float, seed: int, batch: int = 8, deadline: float | None = None,
                 modes: tuple[str, ...] = HEAD_MODES):
    """{"sampling": (features [N, F], label [N]), "greedy": (features, label)} over the judged positions
    of ``blocks`` (position t judges token t+1), both from the same two forwards.

    sampling: the draft's sample x (``target_frac`` of positions: the target's), label min(1, p(x)/q(x)).
    greedy: x = argmax q, label 1[argmax q == argmax p].
    With a ``deadline`` (a ``time.perf_counter()`` value) labelling stops at the first batch boundary
    after it, so a budgeted run spends its minutes on training rather than labelling the whole corpus.
    """
    import torch

    g = torch.Generator().manual_seed(seed)
    out = {m: ([], []) for m in modes}
    with torch.no_grad():
        for i in range(0, len(blocks), batch):
            if deadline is not None and out[modes[0]][0] and time.perf_counter() > deadline:
                break
            ids = blocks[i : i + batch]["input_ids"].to(target.get_input_embeddings().weight.device)
            d = draft(input_ids=ids, output_hidden_states=True)
            hidden = d.hidden_states[-1][:, :-1]
            q_logits = d.logits.float()[:, :-1]  # position t proposes token t+1
            p_logits = target(input_ids=ids).logits.float()[:, :-1]
            q = torch.softmax(q_logits / temperature, -1)
            p = torch.softmax(p_logits / temperature, -1)
            tokens, _ = propose_tokens(p, q, target_frac, g)  # drawn in every mode: one random stream per seed
            if "sampling" in out:
                _append(out["sampling"], acceptance_features(hidden, q_logits, tokens), acceptance_labels(p, q, tokens))
            if "greedy" in out:
                g_tokens, g_labels = greedy_labels(p_logits, q_logits)
                _append(out["greedy"], acceptance_features(hidden, q_logits, g_tokens), g_labels)
    return {m: (torch.cat(f), torch.cat(y)) for m, (f, y) in out.items()}


def _append(acc, feats, labels):
    acc[0].append(feats.reshape(-1, feats.shape[-1]))
    acc[1].append(labels.flatten())


def build_features(draft, target, blocks, temperature: float, target_frac: float, seed: int, batch: int = 8, deadline: float | None = None):
    """(features [N, F], label [N]) of the sampling head (``label_blocks``' first half)."""
    return label_blocks(draft, target, blocks, temperature, target_frac, seed, batch, deadline, modes=("sampling",))["sampling"]


def target_continuations(target, blocks, prefix_len: int, new_tokens: int, temperature: float = 0.0, seed: int = 0,
                         batch: int = 128, limit: int | None = None, deadline: float | None = None):
    """[N, prefix_len + new_tokens]: the first ``prefix_len`` tokens of each block followed by the target's
    own continuation (greedy at ``temperature`` 0, else sampled; no EOS stop), decoded by the engine's own
    loop (``ar``): the text a decode at that temperature verifies drafts against."""
    import torch

    from specdec.decode.engine.loop import SpecEngine
    from specdec.decode.engine.types import GenRequest
    from specdec.decode.engine.verify import Sampling

    engine = SpecEngine(target, None, sampling=Sampling(temperature=temperature), seed=seed, eos_ids=[])
    n = len(blocks) if limit is None else min(limit, len(blocks))
    rows = []
    for i in range(0, n, batch):
        if deadline is not None and rows and time.perf_counter() > deadline:
            break
        ids = blocks[i : min(i + batch, n)]["input_ids"][:, :prefix_len].to(target.get_input_embeddings().weight.device)
        results = engine.generate([GenRequest(prompt_ids=row.tolist(), max_new_tokens=new_tokens) for row in ids])
        rows.append(torch.cat([ids, torch.tensor([r.token_ids for r in results], dtype=ids.dtype, device=ids.device)], 1))
    return torch.cat(rows) if rows else torch.zeros(0, prefix_len + new_tokens, dtype=torch.long)


def label_continuations(draft, target, seqs, prefix_len: int, temperature: float = 0.0, seed: int = 0, batch: int = 32):
    """Head (features [N, L, F], labels [N, L]) on the continuation part of ``seqs``: index j judges token
    prefix_len + j. In a decode of the prefix, token prefix_len is the prefill's, so a round's first draft
    is judged at j = 1, its i-th at j = 1 + (tokens committed since) + i - 1.

    Greedy (``temperature`` 0): the draft proposes argmax q, label 1[argmax q == argmax p]. Sampling: the
    draft's own sample x ~ q at the temperature, label min(1, p(x)/q(x)), the chance that exact
    speculative sampling keeps it."""
    import torch

    g = torch.Generator().manual_seed(seed)
    feats, labels = [], []
    with torch.no_grad():
        for i in range(0, len(seqs), batch):
            ids = seqs[i : i + batch]
            d = draft(input_ids=ids, output_hidden_states=True)
            sl = slice(prefix_len - 1, ids.shape[1] - 1)
            q_logits = d.logits.float()[:, sl]
            p_logits = target(input_ids=ids).logits.float()[:, sl]
            if temperature > 0:
                q = torch.softmax(q_logits / temperature, -1)
                tokens = _sample(q, g)
                y = acceptance_labels(torch.softmax(p_logits / temperature, -1), q, tokens)
            else:
                tokens, y = greedy_labels(p_logits, q_logits)
            feats.append(acceptance_features(d.hidden_states[-1][:, sl], q_logits, tokens))
            labels.append(y)
    return torch.cat(feats), torch.cat(labels)


def draw_acceptance(pred, chance, draws: int, seed: int):
    """(pred, 0/1 labels) with each row repeated ``draws`` times and every position accepted with its
    ``chance``: sampled rounds replayed as coin flips, ``draws`` per row for a steadier estimate."""
    import torch

    g = torch.Generator().manual_seed(seed)
    chance = chance.repeat(draws, 1)
    return pred.repeat(draws, 1), (torch.rand(chance.shape, generator=g).to(chance.device) < chance).float()
