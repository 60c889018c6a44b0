"""A plain-function forward for Llama-architecture draft models: the draft's per-token cost.

A draft model is called once per drafted token, at one token a call, and on a small model that call's
price is set by work per module and per op, not arithmetic. ``LeanStep`` runs the same arithmetic as
plain tensor ops, with q/k/v and gate/up fused into one matmul each, against the same cache
(so ``KVState``'s crop/rollback/row selection apply unchanged).

It is used for drafts only (the target keeps HF's forward: the lossless guarantee is stated against
it), and only where it reproduces HF: ``lean_step`` checks the model's structure (Llama's modules,
SiLU MLP, no biases, default RoPE, SDPA, at most 50M parameters) and then compares the two forwards on a probe
(prefill and one cached step); any difference, or any other architecture, keeps HF's forward.
That probe is what keeps this from drifting with transformers: a change there fails it, not decoding.
"""

from __future__ import annotations

import weakref
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from specdec.decode.engine.direct import foreign_hooks
from specdec.models.masks import additive_mask

# past this size a model's forward is arithmetic, not per-op work, and the fused copies of its weights would cost memory
LEAN_MAX_PARAMS = 50_000_000
_CACHE: "weakref.WeakKeyDictionary[torch.nn.Module, LeanStep | None]" = weakref.WeakKeyDictionary()


def lean_step(model) -> "LeanStep | None":
    """The model's LeanStep, or None where it would not reproduce HF's forward (built and checked once per model).

    A model with hooks keeps HF's forward: hooks (accelerate's offloading, a profiler's counters) run
    only through module calls, which the plain-function forward skips."""
    if any(foreign_hooks(m) for m in model.modules()):
        return None
    if model not in _CACHE or (_CACHE[model] is not None and _CACHE[model].stale()):
        step = LeanStep(model) if _supported(model) else None
        _CACHE[model] = step if step is not None and step.matches_hf() else None
    return _CACHE[model]


def _supported(model) -> bool:
    cfg = getattr(model, "config", None)
    base = getattr(model, "model", None)
    layers = getattr(base, "layers", None)
    if cfg is None or layers is None or len(layers) == 0 or not hasattr(model, "lm_head"):
        return False
    if sum(p.numel() for p in model.parameters()) > LEAN_MAX_PARAMS:
        return False
    rope = getattr(cfg, "rope_parameters", None) or {}
    if (
        getattr(cfg, "hidden_act", None) != "silu"
        or getattr(cfg, "attention_bias", True)
        or getattr(cfg, "mlp_bias", True)
        or getattr(cfg, "pretraining_tp", 1) != 1
        or rope.get("rope_type", "default") != "default"
        or getattr(cfg, "_attn_implementation", None) != "sdpa"
    ):
        return False
    rotary = getattr(base, "rotary_emb", None)
    if getattr(rotary, "attention_scaling", None) != 1.0 or not hasattr(rotary, "inv_freq"):
        return False
    need = {"input_layernorm", "post_attention_layernorm", "self_attn", "mlp"}
    for layer in layers:
        if not need <= set(dict(layer.named_children())):
            return False
        attn, mlp = layer.self_attn, layer.mlp
        projs = [getattr(attn, n, None) for n in ("q_proj", "k_proj", "v_proj", "o_proj")]
        projs += [getattr(mlp, n, None) for n in ("gate_proj", "up_proj", "down_proj")]
        if any(p is None or not isinstance(p, torch.nn.Linear) or p.bias is not None for p in projs):
            return False
        if len(list(layer.children())) != 4 or len(list(attn.children())) != 4:  # extra norms (qk-norm) etc.
            return False
    return True


class LeanStep:
    def __init__(self, model):
        cfg, base = model.config, model.model
        self.model = model
        self.embed = base.embed_tokens.weight
        self.layers = []
        for layer in base.layers:
            a, m = layer.self_attn, layer.mlp
            self.layers.append((
                layer.input_layernorm.weight, layer.input_layernorm.variance_epsilon,
                torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight], 0).detach(),
                a.o_proj.weight,
                layer.post_attention_layernorm.weight, layer.post_attention_layernorm.variance_epsilon,
                torch.cat([m.gate_proj.weight, m.up_proj.weight], 0).detach(),
                m.down_proj.weight,
                a.layer_idx,
            ))
        self.norm, self.eps = base.norm.weight, base.norm.variance_epsilon
        self.head = model.lm_head.weight
        self.heads, self.kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.heads
        self.inter = cfg.intermediate_size
        self.inv_freq = base.rotary_emb.inv_freq
        self.scale = self.head_dim**-0.5
        self._fused_from = [p for layer in base.layers for p in (
            layer.self_attn.q_proj.weight, layer.self_attn.k_proj.weight, layer.self_attn.v_proj.weight,
            layer.mlp.gate_proj.weight, layer.mlp.up_proj.weight)]
        self._versions = [p._version for p in self._fused_from]

    def stale(self) -> bool:
        """The model's weights were written in place since the fused copies were made (loading, merging)."""
        return any(p._version != v for p, v in zip(self._fused_from, self._versions))

    @staticmethod
    def _rms(x, w, eps):
        x32 = x.to(torch.float32)  # as HF's LlamaRMSNorm: in float32 whatever the model's dtype
        return w * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)

    @torch.no_grad()
    def __call__(self, input_ids, attention_mask, position_ids, past_key_values):
        """(logits [B, T, V], final normed hidden [B, T, H]) for a segment after the cache; the same
        arguments as HF's forward (a 4-D additive mask over cache + segment, explicit positions)."""
        b, t = input_ids.shape
        hd, half = self.head_dim, self.head_dim // 2
        nq, nk = self.heads * hd, self.kv_heads * hd
        x = F.embedding(input_ids, self.embed)
        freqs = position_ids[..., None].float() * self.inv_freq
        emb = torch.cat((freqs, freqs), -1)
        cos, sin = emb.cos()[:, None].to(x.dtype), emb.sin()[:, None].to(x.dtype)
        for ln1, eps1, qkv_w, o_w, ln2, eps2, gu_w, down_w, idx in self.layers:
            qkv = F.linear(self._rms(x, ln1, eps1), qkv_w)
            q = qkv[..., :nq].view(b, t, self.heads, hd).transpose(1, 2)
            k = qkv[..., nq : nq + nk].view(b, t, self.kv_heads, hd).transpose(1, 2)
            v = qkv[..., nq + nk :].view(b, t, self.kv_heads, hd).transpose(1, 2)
            q = q * cos + torch.cat((-q[..., half:], q[..., :half]), -1) * sin
            k = k * cos + torch.cat((-k[..., half:], k[..., :half]), -1) * sin
            k, v = past_key_values.update(k, v, idx)
            if self.kv_heads != self.heads:
                k = k.repeat_interleave(self.heads // self.kv_heads, 1)
                v = v.repeat_interleave(self.heads // self.kv_heads, 1)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask, scale=self.scale)
            x = x + F.linear(o.transpose(1, 2).reshape(b, t, nq), o_w)
            gate, up = F.linear(self._rms(x, ln2, eps2), gu_w).split(self.inter, -1)
            x = x + F.linear(F.silu(gate) * up, down_w)
        x = self._rms(x, self.norm, self.eps)
        return F.linear(x, self.head), x

    def matches_hf(self) -> bool:
        """Both forwards on a probe (a 6-token prefill with one padded slot, then one cached step) agree."""
        cfg, dev = self.model.config, self.embed.device
        gen = torch.Generator().manual_seed(0)
        ids = torch.randint(0, cfg.vocab_size, (2, 6), generator=gen).to(dev)
        visible = torch.ones(6, 6, dtype=torch.bool).tril_()[None, None].repeat(2, 1, 1, 1)
        visible[1, :, 1:, 0] = False  # row 1's first slot is padding
        pos = torch.arange(6)[None].repeat(2, 1).to(dev)
        steps = [(ids, visible, pos), (ids[:, :1], torch.ones(2, 1, 1, 7, dtype=torch.bool), pos[:, -1:] + 1)]
        caches = [DynamicCache(), DynamicCache()]  # full layers, as KVState builds them
        dtype = self.embed.dtype
        with torch.no_grad():
            for seg, vis, p in steps:
                mask = additive_mask(vis.to(dev), dtype)
                ref = self.model(input_ids=seg, attention_mask=mask, position_ids=p, past_key_values=caches[0],
                                 use_cache=True, output_hidden_states=True)
                logits, hidden = self(seg, mask, p, caches[1])
                if not (torch.allclose(ref.logits, logits, rtol=1e-4, atol=1e-4)
                        and torch.allclose(ref.hidden_states[-1], hidden, rtol=1e-4, atol=1e-4)):
                    return False
        return True


def lean_output(logits, hidden) -> SimpleNamespace:
    """What KVState.forward's callers read from an HF output: ``logits`` and ``hidden_states[-1]``."""
    return SimpleNamespace(logits=logits, hidden_states=(hidden,))
