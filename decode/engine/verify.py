"""The one verification routine shared by every drafter.

A proposal is a token tree per row (a chain is the tree whose node i has parent i-1). The target
scored the root (the last committed token) and every node in one forward; ``verify`` decides which
path is accepted and which token the target emits after it (the bonus / correction token).

Semantics (Leviathan et al. 2023; Chen et al. 2023):
- greedy (temperature 0): accept while the node's token equals the target's argmax at its parent;
  emit the argmax at the last accepted node. Identical to plain greedy decoding.
- sampling with draft probabilities q (a chain from a draft model): accept x with probability
  min(1, p(x)/q(x)); at the first rejection sample from normalize(max(p - q, 0)); when every draft
  is accepted, sample the bonus from p.
- sampling with deterministic candidates (n-gram, trees from heads): q is one-hot. Children of a
  node are tried in order: accept child x with probability p'(x), else remove x from p' and
  renormalize; if every child is rejected, sample from p'. The emitted token is distributed as p.
- sampling a tree whose siblings were drawn from the draft distribution q at their parent
  (``verify_tree_drafted``): RSD siblings are draws without replacement, tested in order by
  recursive rejection sampling; SpecTr siblings are i.i.d. draws, tested in order by k-sequential
  selection. Each emits exactly p; see the functions.
Temperature and top-p are applied to p and q alike before any test.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdec.decode.engine.types import Scheme
from specdec.kernels import backend as pick_backend
from specdec.kernels.qmatmul import argmax
from specdec.kernels.verify import verify_chain_triton


@dataclass
class Sampling:
    temperature: float = 0.0
    top_p: float = 1.0

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    @property
    def race(self) -> bool:
        """Whether tokens are drawn by the race (``race_noise``): sampling without a nucleus."""
        return not self.greedy and self.top_p >= 1.0


@dataclass
class Verdict:
    accepted: torch.Tensor  # [B] number of accepted draft nodes
    path: torch.Tensor  # [B, D] node indices (0-based into the proposal) of the accepted path, -1 padded
    next_token: torch.Tensor  # [B] token emitted after the accepted path


def logits_to_probs(logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """Temperature then top-p (nucleus) filtering, in float32."""
    probs = torch.softmax(logits.float() / max(sampling.temperature, 1e-5), dim=-1)
    if sampling.top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        cum = sorted_p.cumsum(-1)
        # keep the smallest prefix whose mass reaches top_p (always keeps the top token)
        drop = cum - sorted_p >= sampling.top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


# -- sampling as a race: Gumbel-max with noise fixed by (seed, request, position) -------------------------
#
# argmax_i(logit_i / T + g_i), g_i i.i.d. standard Gumbel, is an exact draw from softmax(logit / T). With
# the noise a function of the request and the position only, a draft token is accepted exactly when
# it is the token the target draws there, so each token is sampled independently of how it was
# drafted: a seeded job writes the same text whichever drafter, draft length or batch it ran with.
# Against one-hot drafts (n-gram, retrieval, heads' candidate trees) this accepts as often as
# rejection sampling (a draft x is kept with probability p(x) either way) and needs no normalised
# distribution: only each position's argmax, which the half-precision screen of ``models.head``
# finds exactly. Nucleus sampling (top-p < 1) and drafts sampled from a draft's q keep rejection
# sampling.


def _race_seed(seed: int, request: int, position: int) -> int:
    """A 63-bit generator seed per (job seed, request, position): splitmix64 of their combination."""
    x = (seed * 0x9E3779B97F4A7C15 + request * 0xBF58476D1CE4E5B9 + position * 0x94D049BB133111EB) & (2**64 - 1)
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & (2**64 - 1)
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & (2**64 - 1)
    return (x ^ (x >> 31)) >> 1


def race_noise(seed: int, requests: list[int], positions: torch.Tensor, vocab: int, device) -> torch.Tensor:
    """[B, W, V] float32 Gumbel noise for row b's slot w, which samples the token at ``positions[b, w]``
    of request ``requests[b]``; slots of one row at the same position (a tree's siblings) share it, and
    slots at a negative position (nothing drafted there) get a constant."""
    bsz, width = positions.shape
    # drawn where they are used: a GPU's generator, not a host's copied over each round
    out = torch.empty(bsz, width, vocab, device=device)
    gen = torch.Generator(device=device)
    for b, pos in enumerate(positions.tolist()):
        done: dict[int, int] = {}
        for w, p in enumerate(pos):
            if p < 0:
                out[b, w] = 0.5  # any finite noise: no token is drawn there
                continue
            if p in done:
                out[b, w] = out[b, done[p]]
                continue
            gen.manual_seed(_race_seed(seed, requests[b], p))
            torch.rand(vocab, generator=gen, out=out[b, w])
            done[p] = w
    # -log(-log(u)); torch.rand's u is a multiple of 2^-24 and may be 0, whose infinite noise would
    # make every token a candidate of the half-precision screen: 0 counts as half a step
    out.clamp_(min=2.0**-25).log_().neg_().log_().neg_()
    return out


def race_scores(logits: torch.Tensor, noise: torch.Tensor, temperature: float) -> torch.Tensor:
    """logits / T + noise, in float32: the scores whose argmax is the race's draw (``models.head``
    computes the same expression for the tokens it recomputes)."""
    return logits.float() * (1.0 / temperature) + noise


def sample_from(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling with a supplied uniform per row (so kernels can reproduce it exactly)."""
    cdf = probs.cumsum(-1)
    target = uniform.unsqueeze(-1) * cdf[..., -1:]
    idx = torch.searchsorted(cdf, target, right=True).squeeze(-1)
    return idx.clamp_(max=probs.shape[-1] - 1)


def verify_chain_core(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    sampling: Sampling,
    u_accept: torch.Tensor | None,
    u_sample: torch.Tensor | None,
    lengths: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chain verification given the random stream: returns (accepted [B], next_token [B]).

    logits [B, K+1, V] (the root's and each draft's), tokens [B, K], draft_probs [B, K, V] already
    tempered (None = one-hot drafts), u_accept [B, K] and u_sample [B] uniforms in [0, 1);
    lengths [B] (optional): row r drafted only its first lengths[r] tokens.
    This is the reference the Triton kernel in ``kernels/verify.py`` reproduces.
    """
    bsz, k = tokens.shape
    in_draft = None if lengths is None else torch.arange(k, device=tokens.device)[None] < lengths[:, None]
    if sampling.greedy:
        best = argmax(logits)
        match = tokens == best[:, :k]
        if in_draft is not None:
            match &= in_draft
        accepted = match.long().cumprod(-1).sum(-1)
        return accepted, best.gather(1, accepted[:, None]).squeeze(1)
    p = logits_to_probs(logits, sampling)
    px = p[:, :k].gather(-1, tokens[..., None]).squeeze(-1)
    if draft_probs is None:
        ok = u_accept < px
    else:
        qx = draft_probs.gather(-1, tokens[..., None]).squeeze(-1)
        ok = u_accept * qx < px  # u < p/q without dividing by a zero q
    if in_draft is not None:
        ok &= in_draft
    accepted = ok.long().cumprod(-1).sum(-1)
    rows = torch.arange(bsz, device=logits.device)
    p_at = p[rows, accepted]  # [B, V]: target distribution after the accepted prefix
    rejected = accepted < (k if lengths is None else lengths)
    if rejected.any():
        idx = accepted.clamp(max=k - 1)
        if draft_probs is None:
            residual = p_at.scatter(-1, tokens[rows, idx][:, None], 0.0)
        else:
            residual = (p_at - draft_probs[rows, idx]).clamp_(min=0.0)
        # a residual with no mass can only follow an acceptance of probability one: fall back to p
        empty = residual.sum(-1, keepdim=True) <= 0
        residual = torch.where(empty, p_at, residual)
        p_at = torch.where(rejected[:, None], residual, p_at)
    return accepted, sample_from(p_at, u_sample)


def verify_chain_accelerated(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    sampling: Sampling,
    u_accept: torch.Tensor | None,
    u_sample: torch.Tensor | None,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """``verify_chain_core`` through the Triton kernel where it applies (the backend resolves to triton,
    top-p = 1, at least one draft); the reference everywhere else."""
    if pick_backend(backend, logits.device) == "torch" or sampling.top_p < 1.0 or tokens.shape[1] == 0:
        return verify_chain_core(logits, tokens, draft_probs, sampling, u_accept, u_sample)
    return verify_chain_triton(logits, tokens, draft_probs, sampling.greedy, sampling.temperature, u_accept, u_sample)


def verify_chain(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    sampling: Sampling,
    generator: torch.Generator | None,
    lengths: torch.Tensor | None = None,
    kernels: str = "torch",
) -> Verdict:
    bsz, k = tokens.shape
    if k == 0 and sampling.greedy:
        # nothing drafted (plain decoding's round): the root's argmax, as the reference takes it, in one launch
        # rather than the kernels' or the reference's dozen (on a GPU each is host time in every step)
        return Verdict(accepted=torch.zeros(bsz, dtype=torch.long, device=logits.device),
                       path=torch.zeros(bsz, 0, dtype=torch.long, device=logits.device), next_token=argmax(logits[:, 0]))
    u_accept = u_sample = None
    if not sampling.greedy:
        u = torch.rand(bsz, k + 1, generator=generator, device=logits.device)
        u_accept, u_sample = u[:, :k], u[:, k]
    if kernels != "torch" and lengths is None:
        accepted, next_token = verify_chain_accelerated(logits, tokens, draft_probs, sampling, u_accept, u_sample, kernels)
    else:
        accepted, next_token = verify_chain_core(logits, tokens, draft_probs, sampling, u_accept, u_sample, lengths)
    steps = torch.arange(k, device=tokens.device)
    path = torch.where(steps[None] < accepted[:, None], steps[None], torch.full_like(steps[None], -1))
    return Verdict(accepted=accepted, path=path, next_token=next_token)


def verify_tree(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    parents: torch.Tensor,
    sampling: Sampling,
    generator: torch.Generator | None,
    max_depth: int,
    ancestors: torch.Tensor | None = None,
    depth: torch.Tensor | None = None,
) -> Verdict:
    """Tree verification with deterministic candidates (one-hot q), greedy or exact sampling.

    logits [B, N+1, V] (root at index 0, node i at i+1), tokens [B, N], parents [B, N] with -1 for a
    child of the root and -2 for padding; nodes are in topological order. ancestors [B|1, N+1, N+1]
    and depth [B|1, N+1] (as used for the tree attention) make the greedy case loop-free.
    """
    if sampling.greedy and ancestors is not None:
        return _verify_tree_greedy(logits, tokens, parents, ancestors, depth, max_depth)
    bsz = tokens.shape[0]
    dev = tokens.device
    rows = torch.arange(bsz, device=dev)
    children = _children(parents)
    max_children = children.shape[-1]

    greedy = sampling.greedy
    probs = None if greedy else logits_to_probs(logits, sampling)
    best = argmax(logits) if greedy else None
    cur = torch.zeros(bsz, dtype=torch.long, device=dev)  # current slot (0 = root)
    alive = torch.ones(bsz, dtype=torch.bool, device=dev)
    path = torch.full((bsz, max_depth), -1, dtype=torch.long, device=dev)
    accepted = torch.zeros(bsz, dtype=torch.long, device=dev)
    dist = None if greedy else probs[rows, cur]
    for depth in range(max_depth):
        kids = children[rows, cur]  # [B, C]
        chosen = torch.full((bsz,), -1, dtype=torch.long, device=dev)
        for j in range(max_children):
            kid = kids[:, j]
            live = alive & (chosen < 0) & (kid >= 0)
            tok = tokens[rows, kid.clamp(min=0)]
            if greedy:
                ok = live & (tok == best[rows, cur])
            else:
                u = torch.rand(bsz, generator=generator, device=dev)
                mass = dist.sum(-1)
                px = dist[rows, tok]
                ok = live & (u * mass < px)
                # rejected candidates leave the residual distribution
                rej = live & ~ok
                dist = torch.where(rej[:, None], dist.scatter(-1, tok[:, None], 0.0), dist)
            chosen = torch.where(ok, kid, chosen)
        step = chosen >= 0
        path[:, depth] = torch.where(step, chosen, path[:, depth])
        accepted += step.long()
        cur = torch.where(step, chosen + 1, cur)
        if not greedy:
            dist = torch.where(step[:, None], probs[rows, cur], dist)
        alive &= step
        if not bool(alive.any()):
            break
    if greedy:
        next_token = best[rows, cur]
    else:
        next_token = sample_from(dist, torch.rand(bsz, generator=generator, device=dev))
    return Verdict(accepted=accepted, path=path, next_token=next_token)


# how the sampled siblings of a drafted tree are verified (Proposal.scheme); Scheme.standard is a chain
TREE_SCHEMES = (Scheme.rsd, Scheme.spectr)


def verify_tree_drafted(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    parents: torch.Tensor,
    draft_probs: torch.Tensor | None,
    scheme: Scheme,
    sampling: Sampling,
    generator: torch.Generator | None,
    max_depth: int,
    ancestors: torch.Tensor | None = None,
    depth: torch.Tensor | None = None,
) -> Verdict:
    """Tree verification where the children of a node were sampled from the draft distribution there.

    draft_probs [B, N, V]: the tempered q each node was drawn from (its parent's; siblings share it).
    scheme rsd: siblings are draws without replacement from q (Gumbel-top-k), spectr: i.i.d. draws.
    At each node the siblings are tested in order (``_rsd_node`` / ``_spectr_node``); an accepted one
    becomes the next node, else the token after the path is drawn from the scheme's residual. Greedy
    needs no q: the drafts are the draft's top tokens and the tree reduces to prefix match.
    """
    if sampling.greedy:
        return verify_tree(logits, tokens, parents, sampling, generator, max_depth, ancestors, depth)
    if scheme not in TREE_SCHEMES:
        raise ValueError(f"tree verification scheme must be one of {', '.join(TREE_SCHEMES)}, not {scheme!r}")
    node_test = _rsd_node if scheme == Scheme.rsd else _spectr_node
    bsz = tokens.shape[0]
    dev = tokens.device
    rows = torch.arange(bsz, device=dev)
    children = _children(parents)
    probs = logits_to_probs(logits, sampling)
    cur = torch.zeros(bsz, dtype=torch.long, device=dev)
    alive = torch.ones(bsz, dtype=torch.bool, device=dev)
    path = torch.full((bsz, max_depth), -1, dtype=torch.long, device=dev)
    accepted = torch.zeros(bsz, dtype=torch.long, device=dev)
    dist = probs[:, 0]  # what the token after the path is drawn from
    for d in range(max_depth):
        kids = children[rows, cur]  # [B, C]
        active = alive & (kids[:, 0] >= 0)
        if not bool(active.any()):
            break
        q = draft_probs[rows, kids[:, 0].clamp(min=0)]
        kid_tokens = tokens.gather(1, kids.clamp(min=0))
        j, residual = node_test(probs[rows, cur], q, kid_tokens, kids >= 0, generator)
        j = torch.where(active, j, torch.full_like(j, -1))
        step = j >= 0
        chosen = kids.gather(1, j.clamp(min=0)[:, None]).squeeze(1)
        dist = torch.where((active & ~step)[:, None], residual, dist)
        path[:, d] = torch.where(step, chosen, path[:, d])
        accepted += step.long()
        cur = torch.where(step, chosen + 1, cur)
        dist = torch.where(step[:, None], probs[rows, cur], dist)
        alive = step
    next_token = sample_from(dist, torch.rand(bsz, generator=generator, device=dev))
    return Verdict(accepted=accepted, path=path, next_token=next_token)


def _rsd_node(p, q, kid_tokens, kid_valid, generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Recursive rejection sampling (RSD) at one node: (index of the accepted sibling or -1 [B], residual [B, V]).

    Sibling j is a draw from q without the earlier siblings, so it is tested against the current
    pair (p_j, q_j) with min(1, p_j(x)/q_j(x)); a rejection moves to (norm(max(p_j - q_j, 0)), q_j
    without x), which is exactly the next sibling's proposal. Both stay unnormalised: the ratio
    test carries their masses. A sibling with no q mass left (the draft's support was exhausted)
    is never accepted, so the residual is then drawn from.
    """
    bsz, width = kid_tokens.shape
    rows = torch.arange(bsz, device=p.device)
    chosen = torch.full((bsz,), -1, dtype=torch.long, device=p.device)
    for j in range(width):
        x = kid_tokens[:, j]
        px, qx = p[rows, x], q[rows, x]
        live = kid_valid[:, j] & (chosen < 0) & (qx > 0)
        u = torch.rand(bsz, generator=generator, device=p.device)
        ok = live & (u * qx * p.sum(-1) < px * q.sum(-1))
        chosen = torch.where(ok, torch.full_like(chosen, j), chosen)
        rejected = (live & ~ok)[:, None]
        p_next, q_next = _rsd_reject(p, q, x)
        p, q = torch.where(rejected, p_next, p), torch.where(rejected, q_next, q)
    return chosen, p


def _rsd_reject(p, q, x) -> tuple[torch.Tensor, torch.Tensor]:
    """After rejecting x: p <- max(p - q, 0) of the normalised pair, q <- q without x."""
    pn = p / p.sum(-1, keepdim=True).clamp(min=1e-30)
    residual = (pn - q / q.sum(-1, keepdim=True).clamp(min=1e-30)).clamp(min=0.0)
    # no mass left only when p = q, whose test accepts with probability one: rounding, keep p
    residual = torch.where(residual.sum(-1, keepdim=True) <= 0, pn, residual)
    return residual, q.scatter(-1, x[:, None], 0.0)


def _spectr_node(p, q, kid_tokens, kid_valid, generator) -> tuple[torch.Tensor, torch.Tensor]:
    """SpecTr k-sequential selection at one node: (index of the accepted sibling or -1 [B], residual [B, V]).

    The k siblings are i.i.d. draws from q; each is accepted with min(1, p(x)/(rho q(x))), so a
    sibling is accepted as x with probability m(x) = min(q(x), p(x)/rho), alpha = sum m, and the
    selection emits x with probability m(x) c, c = (1 - (1 - alpha)^k)/alpha. The residual p - m c
    (drawn from with probability (1 - alpha)^k) is a distribution iff c <= rho: ``spectr_rho``
    takes the smallest such rho, which maximises acceptance.
    """
    bsz, width = kid_tokens.shape
    rows = torch.arange(bsz, device=p.device)
    k = kid_valid.sum(-1)
    rho = spectr_rho(p, q, k)
    chosen = torch.full((bsz,), -1, dtype=torch.long, device=p.device)
    for j in range(width):
        x = kid_tokens[:, j]
        px, qx = p[rows, x], q[rows, x]
        live = kid_valid[:, j] & (chosen < 0) & (qx > 0)
        u = torch.rand(bsz, generator=generator, device=p.device)
        ok = live & (u * rho * qx < px)
        chosen = torch.where(ok, torch.full_like(chosen, j), chosen)
    m = torch.minimum(q, p / rho[:, None])
    residual = (p - m * _spectr_c(m.sum(-1), k)[:, None]).clamp(min=0.0)
    # no mass left only when every candidate is accepted surely (alpha = 1): rounding, keep p
    residual = torch.where(residual.sum(-1, keepdim=True) <= 0, p, residual)
    return chosen, residual


def _spectr_c(alpha: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """sum_{i<k} (1 - alpha)^i: how much the k tries multiply one try's acceptance."""
    safe = alpha.clamp(min=1e-12)
    return torch.where(alpha > 1e-12, (1 - (1 - safe) ** k) / safe, k.to(alpha.dtype))


def spectr_rho(p: torch.Tensor, q: torch.Tensor, k: torch.Tensor, iters: int = 24) -> torch.Tensor:
    """The smallest rho in [1, k] with c(rho) <= rho, per row (SpecTr's one-dimensional search).

    c grows with rho while rho - c need not be monotone, so the bisection keeps its upper end
    feasible (rho = k always is: c <= k): whatever it returns makes the residual exact.
    """
    k = k.clamp(min=1)

    def feasible(rho):
        return _spectr_c(torch.minimum(q, p / rho[:, None]).sum(-1), k) <= rho

    lo = torch.ones(p.shape[0], dtype=p.dtype, device=p.device)
    hi = k.to(p.dtype)
    for _ in range(iters):
        mid = (lo + hi) / 2
        ok = feasible(mid)
        hi, lo = torch.where(ok, mid, hi), torch.where(ok, lo, mid)
    return torch.where(feasible(lo) & (lo <= 1), lo, hi)


def _verify_tree_greedy(logits, tokens, parents, ancestors, depth, max_depth) -> Verdict:
    """A node is accepted iff it and all its ancestors carry the target's argmax at their parent;
    the deepest accepted node (the earliest among equals) ends the path."""
    bsz, n = tokens.shape
    best = argmax(logits)  # [B, N+1]
    correct = (tokens == best.gather(1, (parents + 1).clamp(min=0))) & (parents >= -1)
    anc = ancestors[:, 1:, 1:].expand(bsz, n, n)  # node -> its ancestors (and itself), root dropped
    ok = ~(anc & ~correct[:, None, :]).any(-1)
    node_depth = depth[:, 1:].expand(bsz, n)
    score = torch.where(ok, node_depth * (n + 1) - torch.arange(n, device=tokens.device), torch.full_like(node_depth, -1))
    top_score, deepest = score.max(-1)
    accepted = torch.where(top_score >= 0, node_depth.gather(1, deepest[:, None]).squeeze(1), torch.zeros_like(top_score))
    on_path = anc.gather(1, deepest[:, None, None].expand(bsz, 1, n)).squeeze(1) & (accepted[:, None] > 0)
    slot = torch.where(on_path, node_depth - 1, torch.full_like(node_depth, max_depth))  # path position of each node
    path = torch.full((bsz, max_depth + 1), -1, dtype=torch.long, device=tokens.device)
    path.scatter_(1, slot, torch.arange(n, device=tokens.device).expand(bsz, n))
    last = torch.where(accepted > 0, deepest + 1, torch.zeros_like(deepest))
    return Verdict(accepted=accepted, path=path[:, :max_depth], next_token=best.gather(1, last[:, None]).squeeze(1))


def _children(parents: torch.Tensor) -> torch.Tensor:
    """children[b, c, j]: the j-th child (in proposal order) of slot c (0 = root, node i at i + 1), -1 = none."""
    bsz, n = parents.shape
    rows = torch.arange(bsz, device=parents.device)
    parent_slot = parents + 1
    order = torch.arange(n, device=parents.device).expand(bsz, n)
    sibling_rank = _rank_among_siblings(parent_slot)
    max_children = int(sibling_rank.max().item()) + 1 if n else 1
    children = torch.full((bsz, n + 1, max_children), -1, dtype=torch.long, device=parents.device)
    valid = parents >= -1  # padding nodes carry parent -2
    children[rows[:, None].expand(bsz, n)[valid], parent_slot[valid], sibling_rank[valid]] = order[valid]
    return children


def _rank_among_siblings(parent_slot: torch.Tensor) -> torch.Tensor:
    """For each node, how many earlier nodes share its parent."""
    same = parent_slot[:, :, None] == parent_slot[:, None, :]  # [B, N, N]
    earlier = torch.ones_like(same[0]).tril(-1).bool()
    return (same & earlier).sum(-1)
