"""Masked-diffusion LM (dLLM) decoding: one step loop, one commit rule per strategy.

A batch is laid out as a *canvas*: left-padded prompts followed by ``gen_length`` MASK tokens.
The canvas is decoded segment by segment (semi-autoregressive blocks of ``block_size``); inside a
segment every step runs one forward, turns the logits into a proposal (token + confidence per
position) and asks the strategy's ``select`` function which masked positions to commit. Strategies
differ only in that function (see ``STRATEGIES``); the loop, the caches, end-of-text handling and
batching are shared.

Invariants every strategy keeps (tests/test_diffusion.py checks them): at least one token is
committed per step for every row that still has masked positions in its window, nothing outside
the current segment is committed, and a committed token is never rewritten.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from specdec.models.artifacts import resolve_member
from specdec.models.dllm import DllmSpec, dllm_attention, load_dllm, load_filter, model_mask
from specdec.models.errors import SpecdecError
from specdec.models.loading import apply_threads, resolve_device
from specdec.decode.options import parse_method as parse_spec
from specdec.decode.types import GenRequest, GenResult

CACHE_MODES = ("none", "prefix", "dual")
NEG_INF = float("-inf")


# --------------------------------------------------------------------------------------------
# The canvas and the forward over one segment (with optional approximate caches)
# --------------------------------------------------------------------------------------------


@dataclass
class Canvas:
    """A batch laid out for diffusion decoding: left-padded prompts, then each row's answer budget."""

    tokens: Tensor  # [B, N]
    valid: Tensor  # [B, N] real prompt tokens and in-budget answer positions
    position_ids: Tensor  # [B, N]
    allowed: Tensor | None  # [B, 1, N, N] attention mask; None for models with native attention
    prompt_len: int  # P: every row's answer starts at position P
    budgets: list[int]  # answer length per row

    @property
    def gen_length(self) -> int:
        return self.tokens.shape[1] - self.prompt_len


def build_canvas(prompts: list[list[int]], budgets: list[int], spec: DllmSpec, filler: int, device) -> Canvas:
    if any(not p for p in prompts):
        raise SpecdecError("diffusion decoding needs a non-empty prompt")
    b, p, g = len(prompts), max(len(x) for x in prompts), max(budgets)
    tokens = torch.full((b, p + g), filler, dtype=torch.long)
    valid = torch.zeros((b, p + g), dtype=torch.bool)
    for row, (prompt, budget) in enumerate(zip(prompts, budgets)):
        tokens[row, p - len(prompt) : p] = torch.tensor(prompt, dtype=torch.long)
        tokens[row, p : p + budget] = spec.mask_token_id
        valid[row, p - len(prompt) : p + budget] = True
    tokens, valid = tokens.to(device), valid.to(device)
    position_ids = (valid.long().cumsum(1) - 1).clamp(min=0)
    allowed = None
    if spec.attention != "native":
        context = torch.full((b,), p - spec.shift, device=device)
        allowed = dllm_attention(valid, context, spec.attention, spec.block_size)
    return Canvas(tokens, valid, position_ids, allowed, p, list(budgets))


class SegmentForward:
    """Logits for one decode segment of a sub-batch, under a cache mode.

    ``none`` recomputes every visible position each step (exact). ``prefix`` and ``dual`` are the
    Fast-dLLM approximations: the forward at the segment start caches the keys/values of the
    prefix (``dual``: also of the masked suffix) and later steps recompute only the segment.
    They are APPROXIMATE: with bidirectional attention the cached entries go stale as the segment
    changes. With block attention and segment == attention block the prefix cache is exact in
    exact arithmetic, but the different forward shapes still change rounding, so results are
    labelled approximate either way.
    """

    def __init__(self, model, spec: DllmSpec, canvas: Canvas, rows: Tensor, a0: int, a1: int, cache: str, counter: list[int]):
        self.model, self.cache, self.counter = model, cache, counter
        p, s = canvas.prompt_len, spec.shift
        self.tok_lo, self.tok_hi = p + a0, p + a1  # token positions decoded by this segment
        self.qs, self.qe = p + a0 - s, p + a1 - s  # query positions whose logits predict them
        self.base = canvas.tokens[rows]
        self.pos = canvas.position_ids[rows]
        self.allowed = None if canvas.allowed is None else canvas.allowed[rows]
        n = self.base.shape[1]
        if self.allowed is None:
            self.vis_end = n
        else:  # block attention: nothing after the current attention block can influence it
            seen = self.allowed[:, 0, self.qs : self.qe].any(0).any(0)
            self.vis_end = int(seen.nonzero().max()) + 1
        # The segment's own tokens must be fresh inputs; with the shift the last one sits at qe.
        fe = min(self.qe + s, self.vis_end)
        dev = self.base.device
        span = lambda lo, hi: torch.arange(lo, hi, device=dev)  # noqa: E731
        if cache == "none":
            self.fresh, self.cached_idx = (0, self.vis_end), span(0, 0)
        elif cache == "prefix":
            self.fresh, self.cached_idx = (self.qs, self.vis_end), span(0, self.qs)
        else:
            self.fresh, self.cached_idx = (self.qs, fe), torch.cat([span(0, self.qs), span(fe, self.vis_end)])
        lo, hi = self.fresh
        keys = torch.cat([self.cached_idx, span(lo, hi)])
        self.step_allowed = None if self.allowed is None else self.allowed[:, :, lo:hi][..., keys]
        self.kv: list[tuple[Tensor, Tensor]] = []

    def first(self) -> Tensor:
        """The segment-start forward over everything visible; fills the cache for later steps."""
        want_cache = self.cache != "none"
        allowed = None if self.allowed is None else self.allowed[:, :, : self.vis_end, : self.vis_end]
        logits, past = self._run(self.base[:, : self.vis_end], self.pos[:, : self.vis_end], allowed, None, self.qs, want_cache)
        if want_cache:
            idx = self.cached_idx
            self.kv = [(layer.keys[:, :, idx], layer.values[:, :, idx]) for layer in past.layers]
        return logits

    def __call__(self, block: Tensor, rows: Tensor | None = None) -> Tensor:
        """Logits for the segment holding ``block``; ``rows`` repeats sub-batch rows (FreeDave drafts)."""
        lo, hi = self.fresh
        pick = (lambda t: t) if rows is None else (lambda t: t.index_select(0, rows))  # noqa: E731
        tokens = pick(self.base[:, lo:hi]).clone()
        a, z = max(lo, self.tok_lo), min(hi, self.tok_hi)
        tokens[:, a - lo : z - lo] = block[:, a - self.tok_lo : z - self.tok_lo]
        allowed = None if self.step_allowed is None else pick(self.step_allowed)
        past = None
        if self.kv:
            from transformers import DynamicCache

            past = DynamicCache(ddp_cache_data=[(pick(k), pick(v)) for k, v in self.kv])
        logits, _ = self._run(tokens, pick(self.pos[:, lo:hi]), allowed, past, self.qs - lo, False)
        return logits

    def _run(self, tokens, position_ids, allowed, past, first_query: int, use_cache: bool):
        self.counter[0] += 1
        keep = torch.arange(first_query, first_query + self.qe - self.qs, device=tokens.device)
        if allowed is None:  # remote-code model: its own attention, no cache
            out = self.model(input_ids=tokens)
            return out.logits[:, keep], None
        out = self.model(
            input_ids=tokens,
            position_ids=position_ids,
            attention_mask=model_mask(self.model, allowed),
            past_key_values=past,
            use_cache=use_cache,
            logits_to_keep=keep,
        )
        return out.logits, out.past_key_values


# --------------------------------------------------------------------------------------------
# Proposals and the per-step view a strategy sees
# --------------------------------------------------------------------------------------------


def propose(logits: Tensor, temperature: float, generator: torch.Generator | None, mask_id: int) -> tuple[Tensor, Tensor, Tensor]:
    """(tokens, confidence, probs): confidence = softmax probability of the proposed token.

    LLaDA samples with Gumbel-max in float64 (low precision Gumbel noise hurts quality); T=0 is argmax.
    MASK itself is never proposed: committing it would leave the position undecided forever.
    """
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32)).clone()
    logits[..., mask_id] = NEG_INF
    probs = torch.softmax(logits, dim=-1)
    if temperature > 0:
        noise = torch.rand(logits.shape, dtype=torch.float64, device=logits.device, generator=generator)
        tokens = (logits.double() / temperature - torch.log(-torch.log(noise))).argmax(-1)
    else:
        tokens = probs.argmax(-1)
    return tokens, probs.gather(-1, tokens[..., None]).squeeze(-1), probs


def rank_of(score: Tensor) -> Tensor:
    """0 for the highest score in each row, 1 for the next, ... (stable: ties go to the leftmost)."""
    order = torch.sort(score, dim=-1, descending=True, stable=True).indices
    return torch.empty_like(order).scatter_(-1, order, torch.arange(score.shape[-1], device=score.device).expand_as(order))


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

    forward: SegmentForward
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


def top1(view: StepView) -> Tensor:
    return (view.rank == 0) & view.selectable


# --------------------------------------------------------------------------------------------
# Strategies: name -> (select function, options dataclass)
# --------------------------------------------------------------------------------------------


@dataclass
class NoOptions:
    pass


@dataclass
class ThresholdOptions:
    tau: float = 0.9


@dataclass
class FactorOptions:
    f: float = 1.0


@dataclass
class LocalLeapOptions:
    anchor: float = 0.9
    radius: int = 4
    relaxed: float = 0.75


@dataclass
class CreditOptions:
    decay: float = 0.65
    gamma: float = 0.5
    alpha: float = 0.7
    tau: float = 0.95


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
    return Selection(top1(view) | (view.selectable & (view.conf >= opts.tau)))


def select_factor(view: StepView, opts: FactorOptions) -> Selection:
    # Fast-dLLM v1 factor rule: the largest n with c_k >= 1 - f/(k+1) for all k <= n (c sorted descending).
    ordered = torch.sort(view.conf, dim=-1, descending=True).values
    k = torch.arange(1, ordered.shape[-1] + 1, device=ordered.device)
    n = (ordered >= 1 - opts.f / (k + 1)).long().cumprod(-1).sum(-1)
    return Selection(top1(view) | ((view.rank < n[:, None]) & view.selectable))


def select_localleap(view: StepView, opts: LocalLeapOptions) -> Selection:
    # LocalLeap: confident anchors lower the bar for their neighbours within +-radius.
    anchors = view.selectable & (view.conf >= opts.anchor)
    near = F.max_pool1d(anchors.float()[:, None], 2 * opts.radius + 1, stride=1, padding=opts.radius)[:, 0] > 0
    bar = torch.where(near, opts.relaxed, opts.anchor)
    return Selection(top1(view) | (view.selectable & (view.conf >= bar)))


def select_credit(view: StepView, opts: CreditOptions) -> Selection:
    # CreditDecoding: tokens that keep winning accumulate credit that is fused into the logits.
    credit = view.scratch.get("credit")
    if credit is None:
        credit = view.scratch["credit"] = torch.zeros_like(view.probs)
    masked = view.block == view.ctx.mask_id
    top_p, top_v = view.probs.max(-1)
    credit.mul_(opts.decay).scatter_add_(-1, top_v[..., None], (top_p.pow(opts.gamma) * masked)[..., None])
    fused = view.logits.to(credit.dtype) + opts.alpha * torch.log1p(credit)  # propose() drops MASK
    tokens, conf, _ = propose(fused, view.ctx.temperature, view.ctx.generator, view.ctx.mask_id)
    conf = conf.masked_fill(~view.selectable, NEG_INF)
    commit = ((rank_of(conf) == 0) | (conf > opts.tau)) & view.selectable
    return Selection(commit, tokens=tokens)


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
    return Selection(top1(view) | (view.selectable & (score > opts.threshold)))


def select_oracle(view: StepView, opts: OracleOptions) -> Selection:
    reference = opts.reference[view.ctx.rows, view.ctx.a0 : view.ctx.a0 + view.block.shape[-1]]
    correct = view.x0 == reference
    if opts.log is not None:
        opts.log.append((filter_features(view, view.block.shape[-1]).float().cpu(), correct.float().cpu(), view.selectable.cpu()))
    # Forcing the reference token at the top-1 position keeps the trajectory on the reference.
    return Selection((view.selectable & correct) | top1(view), tokens=torch.where(correct, view.x0, reference))


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


STRATEGIES: dict[str, Strategy] = {
    "static": Strategy(select_static, NoOptions),
    "threshold": Strategy(select_threshold, ThresholdOptions),
    "factor": Strategy(select_factor, FactorOptions),
    "localleap": Strategy(select_localleap, LocalLeapOptions),
    "credit": Strategy(select_credit, CreditOptions),
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


# --------------------------------------------------------------------------------------------
# The generator: one step loop for every strategy
# --------------------------------------------------------------------------------------------


@dataclass
class DecodeConfig:
    strategy: str = "static"
    gen_length: int = 128
    block_size: int = 32
    steps: int | None = None  # static only: total steps over gen_length (None = one token per step)
    temperature: float = 0.0
    cache: str = "none"
    adablock: bool = False
    adablock_threshold: float = 0.3  # AdaBlock: a predicted delimiter this confident ends the window
    seed: int = 0


@dataclass
class StepEvent:
    """One step as seen by an ``on_step`` observer: the segment's tokens before and after the commit."""

    a0: int
    rows: Tensor
    before: Tensor
    after: Tensor
    selectable: Tensor


@dataclass
class _Window:
    """Per-row decode window inside the segment: the whole segment, or AdaBlock's shorter pieces."""

    end: Tensor  # [b]
    step: Tensor  # [b]
    masked: Tensor  # [b]
    steps: Tensor  # [b]


class DiffusionGenerator:
    """Masked-diffusion decoding behind the ``BatchGenerator`` contract.

    ``cache="prefix"|"dual"`` are approximate (Fast-dLLM style, see ``SegmentForward``) and every
    result they produce carries ``"approximate": true`` in its stats. ``freedave`` reproduces greedy
    one-token-per-step ``static`` exactly (given deterministic kernels) with fewer forwards.
    ``adablock=True`` composes with any strategy: a confident predicted newline ends the decode
    window early, so text after a line break waits until the line is done.
    """

    def __init__(
        self,
        model,
        tokenizer,
        spec: DllmSpec,
        strategy: str = "static",
        gen_length: int = 128,
        block_size: int = 32,
        steps: int | None = None,
        temperature: float = 0.0,
        cache: str = "none",
        filter_dir: str | Path | None = None,
        adablock: bool = False,
        adablock_threshold: float = 0.3,
        seed: int = 0,
        on_step: Callable[["StepEvent"], None] | None = None,
        **strategy_options,
    ):
        self.cfg = DecodeConfig(strategy, gen_length, block_size, steps, temperature, cache, adablock, adablock_threshold, seed)
        self.options = make_options(strategy, strategy_options)
        self.strategy = STRATEGIES[strategy]
        if cache not in CACHE_MODES:
            raise SpecdecError(f"--cache must be one of {', '.join(CACHE_MODES)}, not {cache!r}")
        if cache != "none" and spec.attention == "native":
            raise SpecdecError("--cache prefix|dual needs a specdec dLLM; remote-code models decode with --cache none")
        if gen_length < 1 or block_size < 1 or (steps is not None and steps < 1):
            raise SpecdecError("--gen-length, --block-size and --steps must be positive")
        if strategy == "freedave" and temperature > 0:
            raise SpecdecError("freedave is lossless only for greedy decoding: use --temperature 0")
        if strategy == "learn2pd" and filter_dir is None:
            raise SpecdecError("learn2pd needs a trained filter: --filter DIR (specdec train-filter)")
        self.model, self.tokenizer, self.spec = model, tokenizer, spec
        self.filter = None if filter_dir is None else load_filter(filter_dir).to(model.device)
        self.delimiters = delimiter_ids(tokenizer) if adablock else []
        self.filler = spec.eos_token_id if spec.eos_token_id is not None else 0
        self.on_step = on_step  # instrumentation (tests, tracing); costs nothing when None

    @torch.inference_mode()
    def generate(self, requests: list[GenRequest]) -> list[GenResult]:
        if not requests:
            return []
        cfg, spec = self.cfg, self.spec
        budgets = [max(1, min(r.max_new_tokens, cfg.gen_length)) for r in requests]
        canvas = build_canvas([r.prompt_ids for r in requests], budgets, spec, self.filler, self.model.device)
        counter = [0]
        row_steps = torch.zeros(len(requests), dtype=torch.long, device=canvas.tokens.device)
        batch_steps = 0
        finished = [False] * len(requests)
        for a0 in range(0, canvas.gen_length, cfg.block_size):
            a1 = min(a0 + cfg.block_size, canvas.gen_length)
            active = [r for r, done in enumerate(finished) if not done and budgets[r] > a0]
            if not active:
                break
            rows = torch.tensor(active, device=canvas.tokens.device)
            block, steps, committed = self._decode_segment(canvas, rows, a0, a1, counter)
            canvas.tokens[rows, canvas.prompt_len + a0 : canvas.prompt_len + a1] = block
            row_steps.index_add_(0, rows, committed)
            batch_steps += steps
            if spec.eos_token_id is not None:
                for r, has_eos in zip(active, (block == spec.eos_token_id).any(-1).tolist()):
                    finished[r] = finished[r] or has_eos
        return self._results(canvas, row_steps.tolist(), batch_steps, counter[0])

    def _decode_segment(self, canvas: Canvas, rows: Tensor, a0: int, a1: int, counter: list[int]):
        cfg, spec = self.cfg, self.spec
        p = canvas.prompt_len
        block = canvas.tokens[rows, p + a0 : p + a1].clone()
        forward = SegmentForward(self.model, spec, canvas, rows, a0, a1, cfg.cache, counter)
        generator = torch.Generator(device=block.device).manual_seed(cfg.seed + a0) if cfg.temperature > 0 else None
        ctx = StepContext(forward, spec.mask_token_id, spec.eos_token_id, cfg.temperature, generator, rows, a0, self.filter)
        cols = torch.arange(block.shape[1], device=block.device)
        b = block.shape[0]
        zeros = torch.zeros(b, dtype=torch.long, device=block.device)
        window = _Window(end=zeros, step=zeros.clone(), masked=zeros.clone(), steps=zeros.clone())
        scratch: dict = {}
        committed = torch.zeros(b, dtype=torch.long, device=block.device)
        logits = forward.first()
        steps = 0
        while True:
            masked = block == ctx.mask_id
            # The one host sync per step: is anything left to decode in this segment?
            if not bool(masked.any()):
                break
            if logits is None:
                logits = forward(block)
            x0, conf, probs = propose(logits, cfg.temperature, generator, ctx.mask_id)
            window = self._advance_windows(window, masked, x0, conf, cols, a1 - a0)
            selectable = masked & (cols[None] < window.end[:, None])
            conf = conf.masked_fill(~selectable, NEG_INF)
            view = StepView(logits, probs, x0, conf, rank_of(conf), selectable, block, window.step, window.masked, window.steps, ctx, scratch)
            sel = self.strategy.select(view, self.options)
            commit = sel.commit & masked  # never rewrite a committed token
            before = block
            block = commit_tokens(block, commit, x0 if sel.tokens is None else sel.tokens, ctx)
            if self.on_step is not None:
                self.on_step(StepEvent(a0, rows, before, block, selectable))
            logits = sel.next_logits
            committed += commit.any(-1).long()
            window.step = window.step + 1
            steps += 1
        return block, steps, committed

    def _advance_windows(self, window: _Window, masked: Tensor, x0: Tensor, conf: Tensor, cols: Tensor, length: int) -> _Window:
        """Open a new window for rows whose window is done; without AdaBlock it is the whole segment."""
        open_new = ~(masked & (cols[None] < window.end[:, None])).any(-1) & masked.any(-1)
        start = window.end
        end = torch.full_like(start, length)
        if self.cfg.adablock and self.delimiters:
            # AdaBlock: the first confidently predicted delimiter after the window start ends the window.
            is_delim = torch.isin(x0, torch.tensor(self.delimiters, device=x0.device))
            cand = is_delim & masked & (cols[None] >= start[:, None]) & (conf >= self.cfg.adablock_threshold)
            end = torch.where(cand.any(-1), cand.long().argmax(-1) + 1, end)
        new_end = torch.where(open_new, end, window.end)
        in_window = masked & (cols[None] >= torch.where(open_new, start, 0)[:, None]) & (cols[None] < new_end[:, None])
        steps = self._window_steps(new_end - start) if self.cfg.steps is not None else torch.zeros_like(start)
        return _Window(
            end=new_end,
            step=torch.where(open_new, 0, window.step),
            masked=torch.where(open_new, in_window.sum(-1), window.masked),
            steps=torch.where(open_new, steps, window.steps),
        )

    def _window_steps(self, width: Tensor) -> Tensor:
        # LLaDA splits steps evenly over blocks; a shorter (AdaBlock or last) window gets its share.
        per_block = max(1, self.cfg.steps * self.cfg.block_size // self.cfg.gen_length)
        return (per_block * width + self.cfg.block_size - 1).div(self.cfg.block_size, rounding_mode="floor").clamp(min=1)

    def _results(self, canvas: Canvas, row_steps: list[int], batch_steps: int, calls: int) -> list[GenResult]:
        cfg, eos = self.cfg, self.spec.eos_token_id
        answers = canvas.tokens[:, canvas.prompt_len :].tolist()
        results = []
        for row, budget in enumerate(canvas.budgets):
            tokens = answers[row][:budget]
            stop = eos is not None and eos in tokens
            if stop:
                tokens = tokens[: tokens.index(eos)]
            stats = {
                "target_calls": calls,
                "steps": row_steps[row],
                "batch_steps": batch_steps,
                "decoded_tokens": len(tokens) + int(stop),
                "strategy": cfg.strategy,
                "cache": cfg.cache,
                "approximate": cfg.cache != "none",
                "gen_length": cfg.gen_length,
                "block_size": cfg.block_size,
            }
            results.append(GenResult(tokens, "stop" if stop else "length", stats))
        return results


def delimiter_ids(tokenizer) -> list[int]:
    """Token ids that end a line (AdaBlock's delimiter), found through the tokenizer, not by model name."""
    ids = set()
    vocab = tokenizer.get_vocab()
    for token, idx in vocab.items():
        text = tokenizer.convert_tokens_to_string([token])
        if text.endswith("\n") and text.strip() == "":
            ids.add(idx)
    return sorted(ids)


@dataclass
class Method:
    label: str
    strategy: str
    options: dict = field(default_factory=dict)

    def generator_kwargs(self) -> dict:
        kwargs = {k: v for k, v in self.options.items() if k != "filter"}
        if "filter" in self.options:
            kwargs["filter_dir"] = resolve_member(str(self.options["filter"]))
        return kwargs


def parse_method(text: str) -> Method:
    """A diffusion method spec, ``threshold+tau=0.8``: the strategy and its typed options (the same
    ``name+key=value`` syntax as every method spec, ``decode.options.parse_method``)."""
    strategy, pairs = parse_spec(text.strip())
    return Method(text.strip(), strategy, {key.replace("-", "_"): _parse_value(value) for key, value in pairs.items()})


def _parse_value(value: str):
    if value.lower() in ("true", "false"):
        return value.lower() == "true"
    for cast in (int, float):
        try:
            return cast(value)
        except ValueError:
            pass
    return value


def generator_from_options(path: str | Path, options) -> tuple[DiffusionGenerator, object, int]:
    """The job runner's hook: (generator, tokenizer, max context) from its ``DecodeOptions``.

    ``options.strategy`` is a method spec, as in ``specdec bench``: ``threshold+tau=0.8``.
    """
    method = parse_method(options.strategy)
    placement = options.placement
    device = resolve_device(placement.device)
    # auto: as saved on a GPU, float32 on a CPU (the same rule as causal LMs)
    dtype = placement.dtype if placement.dtype != "auto" else (None if device.type == "cuda" else "float32")
    model, tokenizer, spec = load_dllm(path, trust_remote_code=options.trust_remote_code, dtype=dtype)
    model.to(device)
    apply_threads(placement.threads, model)
    kwargs = {
        "gen_length": options.gen_length or options.max_new_tokens,
        "block_size": options.block_size,
        "steps": options.steps,
        "temperature": options.temperature,
        "cache": options.cache,
        "filter_dir": None if options.filter is None else resolve_member(options.filter),
        "seed": options.seed,
        "adablock": options.adablock,
    }
    generator = DiffusionGenerator(model, tokenizer, spec, method.strategy, **(kwargs | method.generator_kwargs()))
    return generator, tokenizer, getattr(model.config, "max_position_embeddings", None) or 1 << 30
