"""The canvas of a diffusion batch and the model forward over one of its segments.

A batch is laid out as a *canvas*: left-padded prompts followed by each row's answer budget of MASK
tokens. ``SegmentForward`` runs the model for the segment being decoded, exactly or with the
Fast-dLLM approximate caches.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from specdec.models.dllm import DllmSpec, dllm_attention, model_mask
from specdec.models.errors import SpecdecError

CACHE_MODES = ("none", "prefix", "dual")


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
