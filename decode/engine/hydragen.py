"""Hydragen: attention over a prefix every row shares, computed once for the whole batch.

Rows that share a prompt prefix (a system prompt, few-shot examples) would each hold a copy of its keys
and values and each read them at every step. Here the prefix's keys and values are held once (one row)
and a row's cache holds only its own suffix. Attention splits exactly in two: over the prefix, the
queries of every row and every head of a key/value group are stacked into one matrix, so the prefix is
read once per step by a matrix-matrix product instead of once per row (two bmm's around a softmax, or
with ``kernels="triton"`` the flash-attention kernel ``kernels.prefix_attention``); over each row's
suffix, with the row's mask (holes, trees), as before. The two softmaxes are merged with their log-sum-exps:
``out = (e^lse_p out_p + e^lse_s out_s) / (e^lse_p + e^lse_s)``, which is softmax attention over the
concatenated keys up to floating-point reassociation.

It runs as a transformers attention function. ``enable`` registers, for the model's SDPA, a wrapper
that takes the prefix from the forward's keyword ``shared_prefix`` (one (keys, values) pair per layer)
and hands every forward without one to the original function, so the model is unchanged for everything
else. Models it cannot serve exactly keep the copied prefix: sliding windows (the prefix would need a
per-query window), attention logit soft-capping, other implementations. An attention that asks for
more than softmax(QK^T)V (soft-capping, attention sinks, a position bias) at run time is refused
rather than computed without it.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

from specdec.decode.engine.direct import OWN_ATTENTION
from specdec.kernels import BACKENDS
from specdec.kernels.prefix_attention import prefix_attention
from specdec.models import arch
from specdec.models.errors import SpecdecError

PREFIX = "specdec_hydragen_"
# attention-function keywords that change the result beyond softmax(QK^T)V (None when unused)
UNSUPPORTED = ("softcap", "sliding_window", "s_aux", "sinks", "position_bias")
# eager attention differs per architecture; such models keep the copied prefix. specdec_tree is SDPA with
# a Triton kernel for verify forwards (kernels.tree_attention), which CUDA decodes use by default; OWN_ATTENTION
# is SDPA as the CPU decode step computes it for a target on quantised blocks
SUPPORTED = ("sdpa", "specdec_tree", OWN_ATTENTION)


def enable(model, kernels: str | None = None) -> bool:
    """Make ``model`` take ``shared_prefix`` in its forwards; False (and nothing changed) where it cannot.

    ``kernels`` ("torch" | "triton" | "auto", see ``kernels.backend``) picks how attention over the
    prefix is computed; None keeps the choice the model was enabled with ("torch" the first time)."""
    cfg = model.config
    if kernels is None and cfg._attn_implementation.startswith(PREFIX):
        return True
    kernels = kernels or "torch"
    if kernels not in BACKENDS:
        raise ValueError(f"kernel backend must be one of {BACKENDS}, got {kernels!r}")
    name = _original_name(cfg._attn_implementation)
    if name not in SUPPORTED or arch.sliding_window(cfg) is not None:
        return False
    if getattr(cfg.get_text_config(), "attn_logit_softcapping", None):
        return False
    # the registry is global: one name per (backend, original) so that models may differ in their choice
    wrapped = f"{PREFIX}{kernels}_{name}"
    AttentionInterface.register(wrapped, _wrapper(AttentionInterface._global_mapping[name], kernels))
    # forwards without a mask (one row without holes) get the original implementation's mask builder
    AttentionMaskInterface.register(wrapped, ALL_MASK_ATTENTION_FUNCTIONS._global_mapping[name])
    model.set_attn_implementation(wrapped)
    return True


def _original_name(name: str) -> str:
    """The implementation a wrapped name (PREFIX + backend + "_" + original) wraps; ``name`` otherwise."""
    return name.removeprefix(PREFIX).split("_", 1)[1] if name.startswith(PREFIX) else name


def _wrapper(original, kernels: str):
    def attention(module, query, key, value, attention_mask, shared_prefix=None, **kwargs):
        if shared_prefix is None:
            return original(module, query, key, value, attention_mask, **kwargs)
        extra = [name for name in UNSUPPORTED if kwargs.get(name) is not None]
        if extra:
            raise SpecdecError(
                f"this model's attention takes {', '.join(extra)}, which a prefix held once cannot honour: "
                "decode with --shared-prefix off"
            )
        prefix_key, prefix_value = shared_prefix[module.layer_idx]
        scaling = kwargs.get("scaling")
        if scaling is None:
            scaling = query.shape[-1] ** -0.5
        out = prefix_suffix_attention(query, key, value, attention_mask, prefix_key, prefix_value, scaling, kernels)
        return out, None

    return attention


def prefix_suffix_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    prefix_key: torch.Tensor,
    prefix_value: torch.Tensor,
    scaling: float,
    kernels: str = "torch",
) -> torch.Tensor:
    """Softmax attention of query [B, H, T, D] over the shared prefix's keys/values [1, Hkv, P, D]
    followed by each row's own key/value [B, Hkv, S, D] (additive or boolean mask [B, 1|H, T, S], None:
    causal over the suffix's last T slots). Returns [B, T, H, D], the layout attention functions return.
    ``kernels`` picks the prefix part's implementation (``kernels.prefix_attention``)."""
    bsz, heads, t, dim = query.shape
    kv_heads = key.shape[1]
    groups = heads // kv_heads
    dtype = query.dtype
    work = torch.promote_types(dtype, torch.float32)  # half precision softmaxes are merged in float32
    q = query.to(work)

    # prefix: every row's queries of a key/value head's group in one matrix [Hkv, g*B*T, D], in the
    # model's dtype (the kernel reads the prefix in it); out_p and lse_p come back in the working dtype
    stacked = query.view(bsz, kv_heads, groups, t, dim).permute(1, 2, 0, 3, 4).reshape(kv_heads, groups * bsz * t, dim)
    out_p, lse_p = prefix_attention(stacked, prefix_key[0], prefix_value[0], scaling, kernels)
    out_p = out_p.view(kv_heads, groups, bsz, t, dim).permute(2, 0, 1, 3, 4).reshape(bsz, heads, t, dim)
    lse_p = lse_p.view(kv_heads, groups, bsz, t).permute(2, 0, 1, 3).reshape(bsz, heads, t)

    # each row's suffix, with its mask
    k, v = key.to(work), value.to(work)
    if groups > 1:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scaling  # [B, H, T, S]
    if mask is None:
        s = k.shape[2]
        mask = torch.ones(t, s, dtype=torch.bool, device=q.device).tril(diagonal=s - t)
    if mask.dtype == torch.bool:
        scores = scores.masked_fill(~mask, float("-inf"))
    else:
        scores = scores + mask.to(work)
    lse_s = torch.logsumexp(scores, dim=-1)
    out_s = torch.matmul(torch.softmax(scores, dim=-1), v)

    # merge the two softmaxes by their normalisers
    top = torch.maximum(lse_p, lse_s)
    w_p, w_s = torch.exp(lse_p - top), torch.exp(lse_s - top)
    out = (out_p * w_p[..., None] + out_s * w_s[..., None]) / (w_p + w_s)[..., None]
    return out.to(dtype).transpose(1, 2).contiguous()
