"""The diffusion commit rules, once: top-1 token, confidence and which positions commit in one step.

Inputs are the logits of the current block, [B, L, V], and which positions may commit, [B, L]
(masked and inside the decode window). Confidence is the softmax probability of the proposed token;
the MASK token is never proposed. Rules, each always committing the most confident eligible position:
- "threshold" (Fast-dLLM v1): also every eligible position with confidence >= threshold (0.9).
- "factor" (Fast-dLLM v1): with the eligible confidences sorted c1 >= c2 >= ..., the largest n such
  that c_k >= 1 - factor / (k + 1) for every k <= n.
- "credit" (CreditDecoding): credit C per position and token; each step C <- decay C, then
  C[argmax] += p(argmax) ** gamma; the fused logits l + alpha log(1 + C) give the token and the
  confidence, and positions whose fused confidence > threshold (0.95) commit.

The rule functions (``commit_threshold``, ``commit_factor``, ``commit_credit``, ``update_credit``,
``fuse_credit``) are the reference: ``decode.diffusion.strategies`` decodes with them at any temperature, and
``select_step`` runs them fused in Triton for greedy decoding, where it must reproduce them.

Credit is kept in compact form: ``slots`` (token, credit) pairs per position instead of a dense
[B, L, V] tensor (a step adds credit to one token only). When the slots are full the smallest credit
is evicted. A segment of L positions takes at most L steps (every step commits one), so L slots
never evict and the compact state is exactly the dense rule; decoding uses L. Start a block with
``CreditState.empty``.

Ties follow torch: argmax and ranks prefer the lowest index.

The Triton path runs in two launches: one program per position streams its logits row once
(online max, sum and argmax; the credit update and fused softmax need only the slot tokens' logits
on top), then one program per row ranks the L confidences and applies the rule.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from specdec.kernels import backend as pick_backend
from specdec.kernels import load_triton

triton, tl = load_triton()

RULES = ("threshold", "factor", "credit")
DEFAULT_THRESHOLD = {"threshold": 0.9, "credit": 0.95}
DEFAULT_FACTOR = 1.0
CREDIT_DECAY = 0.65
CREDIT_GAMMA = 0.5
CREDIT_ALPHA = 0.7
MAX_BLOCK = 256  # the rank step compares all L x L pairs in one program


# --------------------------------------------------------------------------------------------
# The rules on tensors (the reference)
# --------------------------------------------------------------------------------------------


def rank_of(score: Tensor) -> Tensor:
    """0 for the highest score in each row, 1 for the next, ... (stable: ties go to the leftmost)."""
    order = torch.sort(score, dim=-1, descending=True, stable=True).indices
    return torch.empty_like(order).scatter_(-1, order, torch.arange(score.shape[-1], device=score.device).expand_as(order))


def eligible_rank(confidence: Tensor, eligible: Tensor) -> Tensor:
    """Rank of each eligible position's confidence among the eligible ones (the others rank last)."""
    return rank_of(confidence.masked_fill(~eligible, float("-inf")))


def commit_threshold(confidence: Tensor, rank: Tensor, eligible: Tensor, threshold: float) -> Tensor:
    return eligible & ((confidence >= threshold) | (rank == 0))


def commit_factor(confidence: Tensor, rank: Tensor, eligible: Tensor, factor: float) -> Tensor:
    fails = eligible & (confidence < 1 - factor / (rank + 2))  # c_k >= 1 - f / (k + 1), k = rank + 1
    count = torch.where(fails, rank, confidence.shape[-1]).amin(-1, keepdim=True).clamp(min=1)
    return eligible & (rank < count)


def commit_credit(confidence: Tensor, rank: Tensor, eligible: Tensor, threshold: float) -> Tensor:
    return eligible & ((confidence > threshold) | (rank == 0))


@dataclass
class CreditState:
    tokens: Tensor  # [B, L, slots] int64, -1 = empty slot
    credit: Tensor  # [B, L, slots] float32

    @classmethod
    def empty(cls, batch: int, length: int, slots: int = 8, device=None) -> "CreditState":
        return cls(
            tokens=torch.full((batch, length, slots), -1, dtype=torch.int64, device=device),
            credit=torch.zeros(batch, length, slots, dtype=torch.float32, device=device),
        )


def update_credit(state: CreditState, top: Tensor, top_prob: Tensor, decay: float = CREDIT_DECAY, gamma: float = CREDIT_GAMMA) -> CreditState:
    """Decay every credit, then add p(top) ** gamma to top's slot (or take the least-credited slot)."""
    credit = state.credit * decay
    hit = state.tokens == top[..., None]
    has = hit.any(-1)
    slot = torch.where(has, hit.int().argmax(-1), credit.argmin(-1))[..., None]
    kept = torch.where(has[..., None], credit.gather(-1, slot), 0.0)
    credit = credit.scatter(-1, slot, kept + top_prob.float().pow(gamma)[..., None])
    tokens = state.tokens.scatter(-1, slot, top[..., None])
    return CreditState(tokens=tokens, credit=credit)


def fuse_credit(logits: Tensor, state: CreditState, alpha: float = CREDIT_ALPHA) -> Tensor:
    """logits + alpha log(1 + C): only slot tokens move (an empty slot adds 0 to token 0)."""
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    bonus = (alpha * torch.log(1 + state.credit)).to(logits.dtype)
    return logits.scatter_add(-1, state.tokens.clamp(min=0), bonus)


def without_mask(logits: Tensor, mask_id: int | None) -> Tensor:
    """A copy in at least float32 in which ``mask_id`` can never be proposed."""
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32)).clone()
    if mask_id is not None:
        logits[..., mask_id] = float("-inf")
    return logits


def top1(logits: Tensor) -> tuple[Tensor, Tensor]:
    """(argmax token, its softmax probability); argmax of the logits, not of the probabilities:
    rounding can tie probabilities of distinct logits."""
    tokens = logits.argmax(-1)
    return tokens, torch.softmax(logits, dim=-1).gather(-1, tokens[..., None]).squeeze(-1)


# --------------------------------------------------------------------------------------------
# One greedy step: the reference composition and its fused Triton twin
# --------------------------------------------------------------------------------------------


@dataclass
class Selection:
    tokens: Tensor  # [B, L] int64
    confidence: Tensor  # [B, L] float32
    commit: Tensor  # [B, L] bool, only ever True at eligible positions
    credit: CreditState | None  # the updated state ("credit" rule)


def select_step(
    logits: Tensor,
    eligible: Tensor,
    rule: str = "threshold",
    *,
    threshold: float | None = None,
    factor: float = DEFAULT_FACTOR,
    credit: CreditState | None = None,
    decay: float = CREDIT_DECAY,
    gamma: float = CREDIT_GAMMA,
    alpha: float = CREDIT_ALPHA,
    mask_id: int | None = None,
    backend: str = "auto",
) -> Selection:
    """Selection for one greedy step; the credit rule needs ``credit`` (not modified; the new state is returned)."""
    if rule not in RULES:
        raise ValueError(f"rule must be one of {RULES}, got {rule!r}")
    if rule == "credit" and credit is None:
        raise ValueError("the credit rule needs a CreditState (CreditState.empty at the start of a block)")
    threshold = DEFAULT_THRESHOLD.get(rule, 0.0) if threshold is None else threshold
    params = dict(threshold=threshold, factor=factor, credit=credit, decay=decay, gamma=gamma, alpha=alpha, mask_id=mask_id)
    if pick_backend(backend, logits.device) == "torch" or logits.shape[1] > MAX_BLOCK:
        return select_reference(logits, eligible, rule, **params)
    return _select_triton(logits, eligible, rule, **params)


def select_reference(
    logits: Tensor,
    eligible: Tensor,
    rule: str,
    *,
    threshold: float,
    factor: float = DEFAULT_FACTOR,
    credit: CreditState | None = None,
    decay: float = CREDIT_DECAY,
    gamma: float = CREDIT_GAMMA,
    alpha: float = CREDIT_ALPHA,
    mask_id: int | None = None,
) -> Selection:
    logits = without_mask(logits, mask_id)
    tokens, confidence = top1(logits)
    if rule == "credit":
        credit = update_credit(credit, tokens, confidence, decay, gamma)
        tokens, confidence = top1(fuse_credit(logits, credit, alpha))
    eligible = eligible.to(torch.bool)
    rank = eligible_rank(confidence, eligible)
    if rule == "factor":
        commit = commit_factor(confidence, rank, eligible, factor)
    elif rule == "credit":
        commit = commit_credit(confidence, rank, eligible, threshold)
    else:
        commit = commit_threshold(confidence, rank, eligible, threshold)
    return Selection(tokens=tokens, confidence=confidence.float(), commit=commit, credit=credit if rule == "credit" else None)


def _select_triton(logits, eligible, rule, *, threshold, factor, credit, decay, gamma, alpha, mask_id) -> Selection:
    bsz, length, vocab = logits.shape
    dev = logits.device
    logits = logits if logits.stride(-1) == 1 else logits.contiguous()
    tokens = torch.empty(bsz, length, dtype=torch.int64, device=dev)
    confidence = torch.empty(bsz, length, dtype=torch.float32, device=dev)
    commit = torch.empty(bsz, length, dtype=torch.bool, device=dev)
    use_credit = rule == "credit"
    if use_credit:
        old = CreditState(credit.tokens.contiguous(), credit.credit.contiguous())
        new = CreditState(torch.empty_like(old.tokens), torch.empty_like(old.credit))
        slots = old.tokens.shape[-1]
    else:  # any valid pointers: the credit code is compiled out
        old = new = CreditState(tokens, confidence)
        slots = 1
    _position_kernel[(bsz * length,)](
        logits, tokens, confidence, old.tokens, old.credit, new.tokens, new.credit,
        length, vocab, slots, logits.stride(0), logits.stride(1), -1 if mask_id is None else mask_id, decay, gamma, alpha,
        CREDIT=use_credit, BLOCK_V=min(4096, triton.next_power_of_2(vocab)),
        BLOCK_S=triton.next_power_of_2(slots), num_warps=8,
    )  # fmt: skip
    eligible = eligible.to(torch.bool).contiguous().view(torch.uint8)
    _commit_kernel[(bsz,)](
        confidence, eligible, commit.view(torch.uint8), length, threshold, factor,
        RULE=RULES.index(rule), BLOCK_L=triton.next_power_of_2(length),
    )  # fmt: skip
    return Selection(tokens=tokens, confidence=confidence, commit=commit, credit=new if use_credit else None)


@triton.jit
def _position_kernel(
    logits_ptr, tok_ptr, conf_ptr, old_tok_ptr, old_cred_ptr, new_tok_ptr, new_cred_ptr,
    L, V, SLOTS, s_lb, s_ll, mask_id, decay, gamma, alpha,
    CREDIT: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_S: tl.constexpr,
):  # fmt: skip
    pos = tl.program_id(0).to(tl.int64)  # b * L + l; outputs and credit state are contiguous
    row = logits_ptr + (pos // L) * s_lb + (pos % L) * s_ll
    offs = tl.arange(0, BLOCK_V)
    m = float("-inf")
    s = 0.0
    top = 0
    for start in range(0, V, BLOCK_V):
        x = tl.load(row + start + offs, mask=start + offs < V, other=float("-inf")).to(tl.float32)
        x = tl.where(start + offs == mask_id, float("-inf"), x)  # MASK is never proposed
        tile_max = tl.max(x, 0)
        take = tile_max > m  # strict: the earliest maximum wins, as in torch.argmax
        top = tl.where(take, start + tl.argmax(x, 0, tie_break_left=True), top)
        m_new = tl.maximum(m, tile_max)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        s = s * tl.exp(m - m_safe) + tl.sum(tl.exp(x - m_safe), 0)
        m = m_new
    conf = 1.0 / s  # exp(max - max) / sum
    if CREDIT:
        slot = tl.arange(0, BLOCK_S)
        in_s = slot < SLOTS
        ids = tl.load(old_tok_ptr + pos * SLOTS + slot, mask=in_s, other=-1)
        cred = tl.load(old_cred_ptr + pos * SLOTS + slot, mask=in_s, other=0.0) * decay
        hit = (ids == top) & in_s
        has = tl.max(hit.to(tl.int32), 0) > 0
        least = tl.min(tl.where(in_s, cred, float("inf")), 0)
        least_slot = tl.min(tl.where(in_s & (cred == least), slot, BLOCK_S), 0)
        chosen = tl.where(has, tl.min(tl.where(hit, slot, BLOCK_S), 0), least_slot)
        bump = tl.where(gamma == 0.5, tl.sqrt(conf), tl.exp2(gamma * tl.log2(conf)))  # torch's pow(0.5) is sqrt
        cred = tl.where(slot == chosen, tl.where(has, cred + bump, bump), cred)
        ids = tl.where(slot == chosen, top, ids)
        tl.store(new_tok_ptr + pos * SLOTS + slot, ids, mask=in_s)
        tl.store(new_cred_ptr + pos * SLOTS + slot, cred, mask=in_s)
        # Fused softmax from the plain one: only slot tokens move, by alpha * log(1 + C) >= 0, and
        # top always holds credit now, so the fused maximum is at a slot token.
        live = in_s & (ids >= 0)
        raw = tl.load(row + ids, mask=live, other=float("-inf")).to(tl.float32)
        fused = raw + alpha * tl.log(1.0 + cred)
        f_max = tl.max(tl.where(live, fused, float("-inf")), 0)
        moved = tl.where(live, tl.exp(fused - f_max) - tl.exp(raw - f_max), 0.0)
        conf = 1.0 / (s * tl.exp(m - f_max) + tl.sum(moved, 0))
        top = tl.min(tl.where(live & (fused == f_max), ids, V), 0)
    tl.store(tok_ptr + pos, top.to(tl.int64))
    tl.store(conf_ptr + pos, conf)


@triton.jit
def _commit_kernel(conf_ptr, eligible_ptr, commit_ptr, L, threshold, factor, RULE: tl.constexpr, BLOCK_L: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, BLOCK_L)
    in_l = i < L
    conf = tl.load(conf_ptr + b * L + i, mask=in_l, other=0.0)
    eligible = (tl.load(eligible_ptr + b * L + i, mask=in_l, other=0) != 0) & in_l
    # rank[i] = eligible positions ahead of i in a stable descending sort (the reference's order)
    ci = conf[:, None]
    cj = conf[None, :]
    ahead = eligible[None, :] & ((cj > ci) | ((cj == ci) & (i[None, :] < i[:, None])))
    rank = tl.sum(ahead.to(tl.int32), 1)
    if RULE == 1:  # factor
        fails = eligible & (conf < 1.0 - factor / (rank + 2).to(tl.float32))
        count = tl.maximum(tl.min(tl.where(fails, rank, L), 0), 1)
        commit = eligible & (rank < count)
    elif RULE == 2:  # credit
        commit = eligible & ((conf > threshold) | (rank == 0))
    else:  # threshold
        commit = eligible & ((conf >= threshold) | (rank == 0))
    tl.store(commit_ptr + b * L + i, commit.to(tl.uint8), mask=in_l)
