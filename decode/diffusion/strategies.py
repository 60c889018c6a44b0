"""Diffusion commit strategies: what each one commits in a step, given the step's view.

A strategy is a ``select`` function over a ``StepView`` (the step's proposal, confidences, the
segment's tokens) and its options dataclass, registered in ``STRATEGIES``. The threshold, factor and
credit rules are applied through ``kernels.diffusion_select``, where they are defined once (with the
fused Triton step that the generator runs for greedy decoding when the kernels resolve to triton).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from specdec.kernels.diffusion_select import (
    CREDIT_ALPHA,
    CREDIT_DECAY,
    CREDIT_GAMMA,
    DEFAULT_FACTOR,
    DEFAULT_THRESHOLD,
    CreditState,
    commit_credit,
    commit_factor,
    commit_threshold,
    fuse_credit,
    rank_of,
    update_credit,
    without_mask,
)
from specdec.models.errors import SpecdecError

NEG_INF = float("-inf")


# --------------------------------------------------------------------------------------------
# Proposals and the per-step view a strategy sees
# --------------------------------------------------------------------------------------------


def propose(logits: Tensor, temperature: float, generator: torch.Generator | None, mask_id: int) -> tuple[Tensor, Tensor, Tensor]:
    """(tokens, confidence, probs): confidence = softmax probability of the proposed token.

    LLaDA samples with Gumbel-max in float64 (low precision Gumbel noise hurts quality); T=0 is the
    argmax of the logits, as in ``kernels.diffusion_select.top1``. MASK itself is never proposed:
    committing it would leave the position undecided forever.
    """
    logits = without_mask(logits, mask_id)
    probs = torch.softmax(logits, dim=-1)
    if temperature > 0:
        noise = torch.rand(logits.shape, dtype=torch.float64, device=logits.device, generator=generator)
        tokens = (logits.double() / temperature - torch.log(-torch.log(noise))).argmax(-1)
    else:
        tokens = logits.argmax(-1)
    return tokens, probs.gather(-1, tokens[..., None]).squeeze(-1), probs


def fill_after_eos(block: Tensor, mask_id: int, eos_id: int | None) -> Tensor:
    """End-of-text prediction (Learn2PD EoTP): once EOS is committed, everything masked after it is EOS.

    Restricted to the segment, so drafts and the static reference see the same suffix; later
    segments of a finished row are skipped altogether.
    """
    if eos_id is None:
        return block
    after_eos = (block == eos_id).long().cumsum(-1) > 0
    return torch.where(after_eos & (block == mask_id), eos_id, block)


@dataclass
class StepView:
    """Everything a strategy may look at in one step, for the b rows of the current segment."""

    logits: Tensor  # [b, L, V]
    probs: Tensor  # [b, L, V]
    x0: Tensor  # [b, L] proposed tokens
    conf: Tensor  # [b, L] confidence of x0 where selectable, -inf elsewhere
    rank: Tensor  # [b, L] rank of conf (0 = most confident)
    selectable: Tensor  # [b, L] masked and inside the row's decode window
    block: Tensor  # [b, L] the segment's tokens (MASK where undecided)
    window_step: Tensor  # [b] steps already taken in the current window
    window_masked: Tensor  # [b] masked positions at the window start
    window_steps: Tensor  # [b] steps the static schedule spreads the window over (0 = one token per step)
    ctx: "StepContext"
    scratch: dict  # per-segment strategy state (CreditDecoding's credit)


@dataclass
class StepContext:
    """What stays fixed over a segment: the forward, ids, where the segment sits in the batch."""

    forward: Callable[..., Tensor]  # the segment's SegmentForward: forward(block, rows=None) -> logits
    mask_id: int
    eos_id: int | None
    temperature: float
    generator: torch.Generator | None
    rows: Tensor  # batch indices of the segment's sub-batch
    a0: int  # first answer offset of the segment
    filter: nn.Module | None = None


@dataclass
class Selection:
    commit: Tensor  # [b, L] bool
    tokens: Tensor | None = None  # what to write where committed (default: the view's x0)
    next_logits: Tensor | None = None  # logits of the state after the commit, when the strategy already has them


def commit_tokens(block: Tensor, commit: Tensor, tokens: Tensor, ctx: StepContext) -> Tensor:
    return fill_after_eos(torch.where(commit, tokens, block), ctx.mask_id, ctx.eos_id)


def most_confident(view: StepView) -> Tensor:
    return (view.rank == 0) & view.selectable


# --------------------------------------------------------------------------------------------
# Strategies: name -> (select function, options dataclass)
# --------------------------------------------------------------------------------------------


@dataclass
class NoOptions:
    pass


@dataclass
class ThresholdOptions:
    tau: float = DEFAULT_THRESHOLD["threshold"]


@dataclass
class FactorOptions:
    f: float = DEFAULT_FACTOR


@dataclass
class LocalLeapOptions:
    anchor: float = 0.9
    radius: int = 4
    relaxed: float = 0.75


@dataclass
class CreditOptions:
    decay: float = CREDIT_DECAY
    gamma: float = CREDIT_GAMMA
    alpha: float = CREDIT_ALPHA
    tau: float = DEFAULT_THRESHOLD["credit"]


@dataclass
class EntropyOptions:
    max_entropy: float = 0.5


@dataclass
class Learn2pdOptions:
    threshold: float = 0.96


@dataclass
class FreeDaveOptions:
    drafts: int = 4


@dataclass
class OracleOptions:
    """Training-only: commit where the proposal equals a reference decode (Learn2PD labels)."""

    reference: Tensor | None = None  # [B, G] reference answer tokens of the whole batch
    log: list | None = None  # receives (features, labels, loss_mask) per step


def static_counts(view: StepView) -> Tensor:
    """LLaDA's schedule: step i of S over M masked commits floor(M/S) + [i < M mod S]; the last step takes the rest."""
    m, s, i = view.window_masked, view.window_steps, view.window_step
    remaining = view.selectable.sum(-1)
    scheduled = torch.where(s > 0, m.div(s.clamp(min=1), rounding_mode="floor") + (i < m.remainder(s.clamp(min=1))).long(), 1)
    last = (s > 0) & (i >= s - 1)
    return torch.where(last, remaining, scheduled).clamp(min=1)


def select_static(view: StepView, opts: NoOptions) -> Selection:
    # LLaDA low-confidence remasking: commit the k most confident masked tokens.
    return Selection((view.rank < static_counts(view)[:, None]) & view.selectable)


def select_threshold(view: StepView, opts: ThresholdOptions) -> Selection:
    # Fast-dLLM v1: top-1 plus every masked token whose confidence reaches tau.
    return Selection(commit_threshold(view.conf, view.rank, view.selectable, opts.tau))


def select_factor(view: StepView, opts: FactorOptions) -> Selection:
    # Fast-dLLM v1 factor rule: the largest n with c_k >= 1 - f/(k+1) for all k <= n (c sorted descending).
    return Selection(commit_factor(view.conf, view.rank, view.selectable, opts.f))


def select_localleap(view: StepView, opts: LocalLeapOptions) -> Selection:
    # LocalLeap: confident anchors lower the bar for their neighbours within +-radius.
    anchors = view.selectable & (view.conf >= opts.anchor)
    near = F.max_pool1d(anchors.float()[:, None], 2 * opts.radius + 1, stride=1, padding=opts.radius)[:, 0] > 0
    bar = torch.where(near, opts.relaxed, opts.anchor)
    return Selection(most_confident(view) | (view.selectable & (view.conf >= bar)))


def greedy_top(view: StepView) -> tuple[Tensor, Tensor]:
    """The most likely token per position and its probability (the proposal itself at T=0)."""
    top = view.x0 if view.ctx.temperature == 0 else view.probs.argmax(-1)
    return top, view.probs.gather(-1, top[..., None]).squeeze(-1)


def select_credit(view: StepView, opts: CreditOptions) -> Selection:
    # CreditDecoding: tokens that keep winning accumulate credit that is fused into the logits.
    b, length = view.block.shape
    state = view.scratch.get("credit")
    if state is None:  # a segment takes at most `length` steps: that many slots never evict
        state = CreditState.empty(b, length, slots=length, device=view.block.device)
    state = view.scratch["credit"] = update_credit(state, *greedy_top(view), opts.decay, opts.gamma)
    tokens, conf, _ = propose(fuse_credit(view.logits, state, opts.alpha), view.ctx.temperature, view.ctx.generator, view.ctx.mask_id)
    conf = conf.masked_fill(~view.selectable, NEG_INF)
    return Selection(commit_credit(conf, rank_of(conf), view.selectable, opts.tau), tokens=tokens)


def select_entropy(view: StepView, opts: EntropyOptions) -> Selection:
    # dParallel inference: the lowest-entropy masked token plus every token with entropy <= 0.5.
    entropy = (-torch.special.xlogy(view.probs, view.probs).sum(-1)).masked_fill(~view.selectable, math.inf)
    lowest = (rank_of(-entropy) == 0) & view.selectable
    return Selection(lowest | (view.selectable & (entropy <= opts.max_entropy)))


def filter_features(view: StepView, width: int) -> Tensor:
    """Learn2PD input: top-1 probability per position of the block; decided positions read 1.0."""
    undecided = view.block == view.ctx.mask_id
    feats = torch.where(undecided, view.probs.max(-1).values, 1.0)
    return F.pad(feats, (0, width - feats.shape[-1]), value=1.0)[:, :width]


def select_learn2pd(view: StepView, opts: Learn2pdOptions) -> Selection:
    # Learn2PD: a tiny learned filter predicts which current predictions are already final.
    filt = view.ctx.filter
    feats = filter_features(view, filt.width).to(next(filt.parameters()).dtype)
    score = torch.sigmoid(filt(feats))[:, : view.block.shape[-1]]
    score = F.pad(score, (0, view.block.shape[-1] - score.shape[-1]), value=0.0)
    return Selection(most_confident(view) | (view.selectable & (score > opts.threshold)))


def select_oracle(view: StepView, opts: OracleOptions) -> Selection:
    reference = opts.reference[view.ctx.rows, view.ctx.a0 : view.ctx.a0 + view.block.shape[-1]]
    correct = view.x0 == reference
    if opts.log is not None:
        opts.log.append((filter_features(view, view.block.shape[-1]).float().cpu(), correct.float().cpu(), view.selectable.cpu()))
    # Forcing the reference token at the top-1 position keeps the trajectory on the reference.
    return Selection((view.selectable & correct) | most_confident(view), tokens=torch.where(correct, view.x0, reference))


def select_freedave(view: StepView, opts: FreeDaveOptions) -> Selection:
    # FreeDave: draft k = the k most confident tokens; one batch-expanded forward verifies all drafts
    # against one-token static steps, so the result is exactly static one-token-per-step greedy.
    b, length = view.block.shape
    k = min(opts.drafts, length)
    ctx = view.ctx
    ks = torch.arange(1, k + 1, device=view.block.device)
    take = (view.rank[:, None, :] < ks[None, :, None]) & view.selectable[:, None, :]
    drafts = commit_tokens(view.block[:, None].expand(b, k, length), take, view.x0[:, None].expand(b, k, length), ctx)
    if bool((drafts == drafts[:, :1]).all()):
        # One token left (or EOS filled the rest): draft 1 is the static step, nothing to verify.
        return Selection(drafts[:, 0] != view.block, tokens=drafts[:, 0])
    logits = ctx.forward(drafts.reshape(b * k, length), torch.arange(b, device=drafts.device).repeat_interleave(k))
    # Drafting never moves the decode window, so the selectable set bounds every draft's static step.
    window = view.selectable.repeat_interleave(k, 0)
    targets = static_step(drafts.reshape(b * k, length), logits, window, ctx).view(b, k, length)
    agree = (drafts[:, 1:] == targets[:, :-1]).all(-1)  # draft j+1 is what static does from draft j
    best = agree.long().cumprod(-1).sum(-1)  # index of the last draft on the static path
    rows = torch.arange(b, device=drafts.device)
    chosen = drafts[rows, best]
    return Selection(chosen != view.block, tokens=chosen, next_logits=logits.view(b, k, length, -1)[rows, best])


def static_step(block: Tensor, logits: Tensor, window: Tensor, ctx: StepContext) -> Tensor:
    """One greedy one-token static step (the FreeDave verification target)."""
    tokens, conf, _ = propose(logits, 0.0, None, ctx.mask_id)
    selectable = (block == ctx.mask_id) & window
    conf = conf.masked_fill(~selectable, NEG_INF)
    return commit_tokens(block, (rank_of(conf) == 0) & selectable, tokens, ctx)


@dataclass(frozen=True)
class Strategy:
    select: Callable[[StepView, Any], Selection]
    options: type
    # the strategy's rule as ``kernels.diffusion_select.select_step`` arguments, for a fused greedy step
    kernel_rule: Callable[[Any], dict] | None = None


STRATEGIES: dict[str, Strategy] = {
    "static": Strategy(select_static, NoOptions),
    "threshold": Strategy(select_threshold, ThresholdOptions, lambda o: {"rule": "threshold", "threshold": o.tau}),
    "factor": Strategy(select_factor, FactorOptions, lambda o: {"rule": "factor", "factor": o.f}),
    "localleap": Strategy(select_localleap, LocalLeapOptions),
    "credit": Strategy(
        select_credit, CreditOptions, lambda o: {"rule": "credit", "threshold": o.tau, "decay": o.decay, "gamma": o.gamma, "alpha": o.alpha}
    ),
    "entropy": Strategy(select_entropy, EntropyOptions),
    "learn2pd": Strategy(select_learn2pd, Learn2pdOptions),
    "freedave": Strategy(select_freedave, FreeDaveOptions),
    "oracle": Strategy(select_oracle, OracleOptions),
}
PUBLIC_STRATEGIES = tuple(name for name in STRATEGIES if name != "oracle")


def make_options(strategy: str, options: dict):
    if strategy not in STRATEGIES:
        raise SpecdecError(f"unknown diffusion strategy {strategy!r}; choose from {', '.join(PUBLIC_STRATEGIES)}")
    cls = STRATEGIES[strategy].options
    known = {f.name: f for f in fields(cls)}
    unknown = sorted(set(options) - set(known))
    if unknown:
        raise SpecdecError(f"strategy {strategy} has no option(s) {', '.join(unknown)}; it takes: {', '.join(known) or 'none'}")
    return cls(**options)
