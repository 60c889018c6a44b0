"""The modules of Medusa, Clover, EAGLE and Chimera artifacts, and their artifact I/O.

Every head module exposes the same three things:
  forward(hidden_states, input_ids, target_logits) -> (loss, parts)   training (one call per step)
  chain_logits(hidden_states, input_ids, k) -> [k, B, T, V]            teacher-forced chains for metrics:
      entry k at position t predicts token t+2+k from the target's states up to t
  plus the decode-side steps decode/drafters/heads.py calls (medusa_logits / clover step / eagle step / chimera encode + decoded).
The target's embedding and LM head are used frozen and are not part of the artifact; the artifact
holds only the trained head weights (model.safetensors) and config.json with the target's
tokenizer fingerprint.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from specdec.models import blocks


class ResBlock(nn.Module):
    """x + SiLU(W x + b), W zero-initialised so a fresh block is the identity (Medusa)."""

    def __init__(self, hidden: int):
        super().__init__()
        self.linear = nn.Linear(hidden, hidden)
        nn.init.zeros_(self.linear.weight)

    def forward(self, x):
        return x + F.silu(self.linear(x))


KINDS = ("medusa", "clover", "eagle", "chimera", "block")  # block: models.block.BlockHead


def _frozen(target):
    """(embedding, lm_head) of the target, kept outside the module's parameters."""
    return (target.get_input_embeddings(), target.get_output_embeddings())


class _TargetHead:
    """How a head reads the target's output layer: whole, or restricted to a reduced draft vocabulary's
    rows (``set_vocab``: ``d2t`` [N] draft id -> target id, its last entry the unk stand-in, never
    proposed). Restricted logits are over draft ids 0..N-2; ``to_target`` maps them back."""

    @property
    def d2t(self) -> torch.Tensor | None:
        return self._buffers.get("vocab_d2t")

    def set_vocab(self, vocab) -> None:
        self.register_buffer("vocab_d2t", vocab.d2t.clone(), persistent=False)  # saved in draft_vocab.safetensors
        self._rows_key = None

    def target_logits(self, f):
        _, lm_head = self._target
        if self.d2t is None:
            return lm_head(f.to(lm_head.weight.dtype))
        quantised = getattr(lm_head, "_specdec_rows", None)
        rows = f.numel() // f.shape[-1]
        if quantised is not None and not torch.is_grad_enabled() and rows <= blocks.MAX_ROWS and f.dtype == torch.float32 \
                and not quantised[1].suspended:
            # a GGUF target's output layer is its file's blocks: the restricted rows of those blocks are the same weights
            # in a quarter of the float32 bytes, and a draft call reads them every round (models.blocks)
            (qblocks, qtype), _ = quantised
            key = (qblocks.data_ptr(), self.d2t.data_ptr())
            if getattr(self, "_qrows_key", None) != key:
                self._qrows = qblocks[self.d2t[:-1].cpu()].contiguous()
                self._qrows_key = key
            return blocks.matmul(f.reshape(rows, -1), (self._qrows, qtype)).view(*f.shape[:-1], -1)
        w = lm_head.weight
        key = (w.data_ptr(), w._version, w.device, self.d2t.device)
        if getattr(self, "_rows_key", None) != key:  # the restricted rows, gathered once per weight version
            self._rows = w.detach()[self.d2t[:-1]].contiguous()
            self._rows_key = key
        return F.linear(f.to(self._rows.dtype), self._rows)

    def to_target(self, idx: torch.Tensor) -> torch.Tensor:
        """Indices into ``target_logits``'s last axis as target token ids."""
        return idx if self.d2t is None else self.d2t[:-1][idx]

    def labels(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Target token ids as indices into ``target_logits``'s last axis (-100, ignored, outside the draft vocabulary)."""
        if self.d2t is None:
            return input_ids
        key = (self.d2t.data_ptr(), self.d2t.device)
        if getattr(self, "_t2d_key", None) != key:
            vocab = int(self._target[1].weight.shape[0])
            t2d = torch.full((vocab,), -100, dtype=torch.long, device=self.d2t.device)
            t2d[self.d2t[:-1]] = torch.arange(len(self.d2t) - 1, device=self.d2t.device)
            self._t2d, self._t2d_key = t2d, key
        return self._t2d[input_ids]


# ---------------------------------------------------------------------------------------------
# Medusa (Cai et al. 2024): head i = ResBlock^L then Linear(H, V) on h_t, predicts token t+2+i


class MedusaHeads(_TargetHead, nn.Module):
    kind = "medusa"

    def __init__(self, hidden: int, vocab: int, num_heads: int = 4, num_layers: int = 1, decay: float = 0.8,
                 shared_head: bool = False):
        """shared_head: every head ends in the target's own (frozen) output layer instead of a trained
        one of its own (Medusa-1 with the LM head shared): a 262k-row layer per head would outweigh
        everything else, and with a reduced vocabulary only its rows are read."""
        super().__init__()
        self.num_heads, self.num_layers, self.decay, self.shared_head = num_heads, num_layers, decay, shared_head
        self.heads = nn.ModuleList(
            nn.Sequential(*[ResBlock(hidden) for _ in range(num_layers)], *([] if shared_head else [nn.Linear(hidden, vocab, bias=False)]))
            for _ in range(num_heads)
        )
        self._target = None

    def attach(self, target, init_from_lm_head: bool = False):
        self._target = _frozen(target)
        if init_from_lm_head and not self.shared_head:
            with torch.no_grad():
                for head in self.heads:
                    head[-1].weight.copy_(target.get_output_embeddings().weight)
        return self

    def hparams(self) -> dict:
        return {"num_heads": self.num_heads, "num_layers": self.num_layers, "shared_head": self.shared_head}

    def medusa_logits(self, h):
        """[num_heads, ..., V] from last hidden states h [..., H] (V: the draft vocabulary's size - 1 when reduced)."""
        if self.shared_head:
            return torch.stack([self.target_logits(head(h)) for head in self.heads])
        return torch.stack([head(h) for head in self.heads])

    def chain_logits(self, hidden_states, input_ids, k):
        return self.medusa_logits(hidden_states[-1])[:k]

    def forward(self, hidden_states, input_ids, target_logits):
        return decayed_head_loss(self.medusa_logits(hidden_states[-1]), self.labels(input_ids), self.decay)


def decayed_head_loss(logits, input_ids, decay: float):
    """sum_i decay^i * CE(head i at t, token t+2+i) (Medusa-1 weights); logits [heads, B, T, V]."""
    t = input_ids.shape[1]
    loss, parts = 0.0, {}
    for i in range(logits.shape[0]):
        if t - 2 - i <= 0:
            break
        ce = F.cross_entropy(logits[i, :, : t - 2 - i].float().reshape(-1, logits.shape[-1]), input_ids[:, 2 + i :].reshape(-1),
                             ignore_index=-100)
        loss = loss + decay**i * ce
        parts[f"ce{i}"] = float(ce.detach())
    return loss, parts


# ---------------------------------------------------------------------------------------------
# Clover (Xiao et al. 2024): Regressive Connection + Attention Decoder + Augmenting Block


class _Attention(nn.Module):
    """Multi-head attention without positions (the target's hidden states already carry them)."""

    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.heads = heads
        self.q = nn.Linear(hidden, hidden, bias=False)
        self.kv = nn.Linear(hidden, 2 * hidden, bias=False)
        self.o = nn.Linear(hidden, hidden, bias=False)
        nn.init.zeros_(self.o.weight)  # a fresh block is the identity on its residual path

    def forward(self, x, mem, mask):
        """x [B, Q, H] queries, mem [B, S, H] keys/values, mask [B, Q, S] bool (True = attend)."""
        b, q, h = x.shape
        d = h // self.heads
        qs = self.q(x).view(b, q, self.heads, d).transpose(1, 2)
        k, v = self.kv(mem).view(b, mem.shape[1], 2, self.heads, d).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(qs, k.to(qs.dtype), v.to(qs.dtype), attn_mask=mask[:, None])
        return self.o(out.transpose(1, 2).reshape(b, q, h))


class _Block(nn.Module):
    """Pre-norm attention + MLP (the Augmenting Block and the Attention Decoder share this shape)."""

    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.norm1, self.norm2 = nn.RMSNorm(hidden, eps=1e-6), nn.RMSNorm(hidden, eps=1e-6)
        self.attn = _Attention(hidden, heads)
        self.mlp = nn.Sequential(nn.Linear(hidden, 2 * hidden), nn.SiLU(), nn.Linear(2 * hidden, hidden))
        nn.init.zeros_(self.mlp[-1].weight)
        nn.init.zeros_(self.mlp[-1].bias)

    def forward(self, x, mem, mask):
        x = x + self.attn(self.norm1(x), mem, mask)
        return x + self.mlp(self.norm2(x))


def window_mask(t: int, window: int, device) -> torch.Tensor:
    """[T, T]: query t sees keys t-window < j <= t."""
    i = torch.arange(t, device=device)
    diff = i[:, None] - i[None, :]
    return (diff >= 0) & (diff < window)


class CloverHeads(_TargetHead, nn.Module):
    kind = "clover"

    def __init__(self, hidden: int, vocab: int, num_heads: int = 4, attn_heads: int = 4, window: int = 64, decay: float = 0.8):
        super().__init__()
        self.num_heads, self.attn_heads, self.window, self.decay = num_heads, attn_heads, window, decay
        self.augment = _Block(hidden, attn_heads)  # Augmenting Block: self-attention over the target's states
        self.embed_norm = nn.RMSNorm(hidden, eps=1e-6)
        self.fc = nn.Linear(2 * hidden, hidden)  # Regressive Connection: [embed(prev token), state] -> query
        with torch.no_grad():  # start as "the state", so head 0 begins where Medusa does
            self.fc.weight.zero_()
            self.fc.weight[:, hidden:].copy_(torch.eye(hidden))
            self.fc.bias.zero_()
        self.decoder = _Block(hidden, attn_heads)  # Attention Decoder: cross-attention to the target's states
        self.heads = nn.ModuleList(ResBlock(hidden) for _ in range(num_heads))
        self._target = None

    def attach(self, target, init_from_lm_head: bool = False):
        self._target = _frozen(target)
        return self

    def hparams(self) -> dict:
        return {"num_heads": self.num_heads, "attn_heads": self.attn_heads, "window": self.window}

    def augmented(self, x, mem, mask):
        """The Augmenting Block: states x [B, Q, H] attending to the target's states mem [B, S, H]."""
        return self.augment(x, mem, mask)

    def step(self, tokens, state, mem, mask):
        """One regressive step: tokens [B, Q], state [B, Q, H], mem [B, S, H], mask [B, Q, S]."""
        embed, _ = self._target
        x = self.fc(torch.cat([self.embed_norm(embed(tokens).to(state.dtype)), state], dim=-1))
        return self.decoder(x, mem, mask)

    def head_logits(self, i, state):
        return self.target_logits(self.heads[i](state))

    def chain_logits(self, hidden_states, input_ids, k):
        h = hidden_states[-1]
        b, t, _ = h.shape
        mask = window_mask(t, self.window, h.device)[None].expand(b, t, t)
        state = self.augmented(h, h, mask)
        out = []
        for i in range(k):
            # the token fed at step i is token t+1+i (teacher-forced); past the end, pad
            tok = F.pad(input_ids[:, 1 + i :], (0, 1 + i), value=0)
            state = self.step(tok, state, h, mask)
            out.append(self.head_logits(min(i, self.num_heads - 1), state))
        return torch.stack(out)

    def forward(self, hidden_states, input_ids, target_logits):
        return decayed_head_loss(self.chain_logits(hidden_states, input_ids, self.num_heads), self.labels(input_ids), self.decay)


# ---------------------------------------------------------------------------------------------
# Chimera (Zeng et al. 2024): trigram encoder + full-context decoder + residual decoding heads


class ChimeraHeads(_TargetHead, nn.Module):
    """A lightweight draft made of the target's own parts and three small ones.

    Position s (whose last hidden state h_s predicted token s+1) gets the decoder input
        x_s = fc([trigram(tok_{s-1}, tok_s, tok_{s+1}), h_s]),
    the trigram encoder being SiLU(Linear(3H -> H)) over the three tokens' RMS-normalised (frozen) target
    input embeddings (a token before the sequence's start is a zero vector). The full-context decoder is
    one pre-norm causal self-attention + MLP block over x (the last ``window`` positions, like Clover's);
    residual decoding head i (``num_layers`` Medusa ResBlocks, then the target's frozen LM head, as
    Clover's heads) reads its output at s and predicts token s+2+i.

    At decode s is the last committed position and tok_{s+1} the round's root, so the trigram is the
    sequence's last three tokens; all heads read that one state (a Medusa-shaped tree). A fresh module is
    Medusa with shared LM heads: fc starts as "h_s", the decoder and the ResBlocks as identities.
    """

    kind = "chimera"

    def __init__(self, hidden: int, vocab: int, num_heads: int = 4, num_layers: int = 1, attn_heads: int = 4, window: int = 64,
                 decay: float = 0.8):
        super().__init__()
        self.num_heads, self.num_layers, self.attn_heads, self.window, self.decay = num_heads, num_layers, attn_heads, window, decay
        self.embed_norm = nn.RMSNorm(hidden, eps=1e-6)
        self.trigram = nn.Linear(3 * hidden, hidden)  # the trigram encoder
        self.fc = nn.Linear(2 * hidden, hidden)  # [trigram encoding, h_s] -> decoder input
        with torch.no_grad():
            self.fc.weight.zero_()
            self.fc.weight[:, hidden:].copy_(torch.eye(hidden))
            self.fc.bias.zero_()
        self.decoder = _Block(hidden, attn_heads)  # the full-context decoder
        self.heads = nn.ModuleList(nn.Sequential(*[ResBlock(hidden) for _ in range(num_layers)]) for _ in range(num_heads))
        self._target = None

    def attach(self, target, init_from_lm_head: bool = False):
        self._target = _frozen(target)
        return self

    def hparams(self) -> dict:
        return {"num_heads": self.num_heads, "num_layers": self.num_layers, "attn_heads": self.attn_heads, "window": self.window}

    def encode(self, prev, prev_valid, tokens, nxt, h):
        """Decoder inputs x [..., H] of positions with tokens ``tokens``, the tokens before (``prev``, a zero
        vector where ``prev_valid`` is False) and after them (``nxt``), and last hidden states ``h`` [..., H]."""
        embed, _ = self._target
        e = self.embed_norm(embed(torch.stack([prev, tokens, nxt], -1)).to(h.dtype))  # [..., 3, H]
        keep = torch.stack([prev_valid, torch.ones_like(prev_valid), torch.ones_like(prev_valid)], -1)
        g = F.silu(self.trigram((e * keep[..., None].to(e.dtype)).flatten(-2)))
        return self.fc(torch.cat([g, h], -1))

    def decoded(self, x, mem, mask):
        """The full-context decoder: queries x [B, Q, H] over decoder inputs mem [B, S, H], mask [B, Q, S]."""
        return self.decoder(x, mem, mask)

    def head_logits(self, d):
        """[num_heads, ..., V] from decoder outputs d [..., H]."""
        return torch.stack([self.target_logits(head(d)) for head in self.heads])

    def states(self, hidden_states, input_ids):
        """Decoder outputs [B, T, H] at every position, teacher-forced (the last position's next token is a pad)."""
        h = hidden_states[-1]
        b, t, _ = h.shape
        prev = F.pad(input_ids[:, :-1], (1, 0), value=0)
        prev_valid = (torch.arange(t, device=h.device) > 0)[None].expand(b, t)
        nxt = F.pad(input_ids[:, 1:], (0, 1), value=0)
        x = self.encode(prev, prev_valid, input_ids, nxt, h)
        return self.decoded(x, x, window_mask(t, self.window, h.device)[None].expand(b, t, t))

    def chain_logits(self, hidden_states, input_ids, k):
        return self.head_logits(self.states(hidden_states, input_ids))[:k]

    def forward(self, hidden_states, input_ids, target_logits):
        return decayed_head_loss(self.head_logits(self.states(hidden_states, input_ids)), self.labels(input_ids), self.decay)


# ---------------------------------------------------------------------------------------------
# EAGLE (Li et al. 2024): fc(concat(embed(x_{t+1}), f_t)) -> one decoder layer -> f_hat_{t+1}


class _RMSNorm(nn.Module):
    def __init__(self, hidden: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))
        self.eps = eps

    def forward(self, x):
        x32 = x.float()
        return self.weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


class DraftLayer(nn.Module):
    """One pre-norm Llama decoder layer (RoPE attention + SwiGLU), the EAGLE drafter's body.

    Parameter names follow the Llama checkpoint layout (``self_attn.q_proj``, ``mlp.gate_proj``, ...)
    so exports need no renaming. Written out here, rather than borrowed from transformers, because
    the drafter runs it once per tree level: per-call overhead is what a tree costs on small
    models, and the decode side writes tree nodes' keys straight into its own slot cache
    (``store``) instead of re-running the expanded tree every level.
    """

    def __init__(self, hidden: int, intermediate: int, heads: int, kv_heads: int, head_dim: int, eps: float, qk_norm: bool = False):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.input_layernorm = _RMSNorm(hidden, eps)
        self.post_attention_layernorm = _RMSNorm(hidden, eps)
        self.self_attn = nn.Module()
        self.self_attn.q_proj = nn.Linear(hidden, heads * head_dim, bias=False)
        self.self_attn.k_proj = nn.Linear(hidden, kv_heads * head_dim, bias=False)
        self.self_attn.v_proj = nn.Linear(hidden, kv_heads * head_dim, bias=False)
        self.self_attn.o_proj = nn.Linear(heads * head_dim, hidden, bias=False)
        if qk_norm:  # Qwen3's per-head RMSNorm of queries and keys before the rotation (DFlash's draft layer)
            self.self_attn.q_norm = _RMSNorm(head_dim, eps)
            self.self_attn.k_norm = _RMSNorm(head_dim, eps)
        self.mlp = nn.Module()
        self.mlp.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.mlp.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.mlp.down_proj = nn.Linear(intermediate, hidden, bias=False)
        self._fused_cache: dict = {}

    def forward(self, x, cos, sin, mask, store=None):
        """x [B, T, H]; cos/sin [B, T, D] of each token's position; mask [B, 1, T, S] over the keys (bool,
        True = attend, or additive float); ``store(k, v)`` puts this segment's keys/values [B, kvh, T, D] into a
        cache and returns all S keys/values (None: the segment attends to itself only, S = T)."""
        b, t, _ = x.shape
        a, d = self.self_attn, self.head_dim
        qkv = F.linear(self.input_layernorm(x), self._fused("qkv", a.q_proj, a.k_proj, a.v_proj)).view(b, t, -1, d).transpose(1, 2)
        q, k, v = qkv.split([self.heads, self.kv_heads, self.kv_heads], dim=1)
        if hasattr(a, "q_norm"):
            q, k = a.q_norm(q), a.k_norm(k)
        q, k = _rope(q, cos, sin), _rope(k, cos, sin)
        if store is not None:
            k, v = store(k, v)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=self.heads != self.kv_heads)
        x = x + a.o_proj(out.transpose(1, 2).reshape(b, t, self.heads * d))
        gate, up = F.linear(self.post_attention_layernorm(x), self._fused("gate_up", self.mlp.gate_proj, self.mlp.up_proj)).chunk(2, -1)
        return x + self.mlp.down_proj(F.silu(gate) * up)

    def _fused(self, name: str, *linears) -> torch.Tensor:
        """The linears' weights stacked into one matrix (one matmul instead of several). Cached while
        the weights neither change nor need gradients: decoding calls this layer once per tree level."""
        ws = [m.weight for m in linears]
        if torch.is_grad_enabled() and any(w.requires_grad for w in ws):
            return torch.cat(ws)
        key = tuple((w.data_ptr(), w._version, w.dtype) for w in ws)
        hit = self._fused_cache.get(name)
        if hit is None or hit[0] != key:
            hit = self._fused_cache[name] = (key, torch.cat(ws))
        return hit[1]


def _rope(x, cos, sin):
    """Rotary embedding, half-split convention (Llama): x [B, h, T, D], cos/sin [B, T, D]."""
    cos, sin = cos[:, None].to(x.dtype), sin[:, None].to(x.dtype)
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def rope_theta(config) -> float:
    params = getattr(config, "rope_parameters", None) or {}
    return float(params.get("rope_theta") or getattr(config, "rope_theta", None) or 10000.0)


def rope_frequencies(config, head_dim: int) -> tuple[torch.Tensor, float]:
    """(inv_freq [head_dim / 2], attention scaling) of the target's RoPE over ``head_dim``, its type and
    scaling included (Llama-3, YaRN, linear, longrope: transformers' own initialisers), so the drafter's
    positions mean what the target's do and an exported head runs beside the target in other engines.
    Dynamic NTK scaling depends on the sequence length; the drafter uses its base frequencies."""
    import copy

    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope_type = (getattr(config, "rope_parameters", None) or {}).get("rope_type", "default")
    if rope_type in ROPE_INIT_FUNCTIONS and rope_type != "dynamic":
        cfg = copy.deepcopy(config)
        cfg.head_dim = head_dim
        cfg.partial_rotary_factor = 1.0
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](cfg, "cpu")
        return inv_freq.double(), float(scaling)
    return 1.0 / rope_theta(config) ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim), 1.0


def _flat_rope(params: dict | None) -> dict:
    """Per-layer-type rope parameters flattened as speculators does (models/utils.flatten_rope_parameters:
    the ``sliding_attention`` entry when nested)."""
    params = dict(params or {})
    if params and all(isinstance(v, dict) for v in params.values()):
        params = dict(params.get("sliding_attention") or params.get("full_attention") or next(iter(params.values())))
    return params


def layer_config(config) -> dict:
    """The draft layer's shape from a target (or foreign draft) config: what the exports write as the
    layer's Llama config and what ``Eagle*Head`` is rebuilt from."""
    get = (lambda k, d=None: config.get(k, d)) if isinstance(config, dict) else (lambda k, d=None: getattr(config, k, d))
    hidden, heads = int(get("hidden_size")), int(get("num_attention_heads"))
    rope = get("rope_parameters") or {}
    if not rope and (get("rope_theta") or get("rope_scaling")):  # a transformers-4 config
        rope = {**(get("rope_scaling") or {}), "rope_theta": float(get("rope_theta") or 10000.0)}
        rope.setdefault("rope_type", rope.pop("type", None) or "default")
    rope = _flat_rope(rope) or {"rope_type": "default", "rope_theta": 10000.0}
    rope.setdefault("rope_type", "default")
    return {
        "hidden_size": hidden, "intermediate_size": int(get("intermediate_size") or 4 * hidden), "num_attention_heads": heads,
        "num_key_value_heads": int(get("num_key_value_heads") or heads), "head_dim": int(get("head_dim") or hidden // heads),
        "rms_norm_eps": float(get("rms_norm_eps") or 1e-6), "max_position_embeddings": int(get("max_position_embeddings") or 2048),
        "rope_parameters": rope, "attention_bias": bool(get("attention_bias") or False), "mlp_bias": bool(get("mlp_bias") or False),
        "hidden_act": get("hidden_act") or "silu", "model_type": "qwen3" if get("model_type") == "qwen3" else "llama",
    }


def layer_hf_config(layer: dict):
    """A transformers config object of the layer (for RoPE initialisers)."""
    from transformers import LlamaConfig

    return LlamaConfig(**{k: v for k, v in layer.items() if k != "model_type"}, num_hidden_layers=1)


def register_rope(module: nn.Module, config, head_dim: int, positions: int) -> None:
    """``module.rope_cos`` / ``rope_sin`` [positions, head_dim]: the target's rotary tables (``rope_frequencies``) for
    positions 0..positions-1, as non-persistent float32 buffers (the drafters' layers index them by position id)."""
    inv_freq, scaling = rope_frequencies(config, head_dim)
    freqs = torch.outer(torch.arange(positions, dtype=torch.float64), inv_freq)
    emb = torch.cat([freqs, freqs], dim=-1)
    module.register_buffer("rope_cos", (emb.cos() * scaling).float(), persistent=False)
    module.register_buffer("rope_sin", (emb.sin() * scaling).float(), persistent=False)


class FeatureSampler(nn.Module):
    """FSPAD's feature sampling (Gui et al. 2024, "Boosting Lossless Speculative Decoding via Feature
    Sampling and Partial Alignment Distillation"; the authors' ``Efc`` in ``cnets_fspad.py``).

    EAGLE's entry already pairs f_t with the embedding e of the token the target emitted after it (at
    decode: the root token the target sampled, or a tree node's token; at training: the data token
    t+1, the token the target was fed there), but only linearly: x = fc([e, f_t]). FSPAD lets the
    token *select* ("sample") the part of the uncertain feature that belongs to it: a gated MLP whose
    gate is computed from the token's embedding and whose value is the fused entry,
        x + down(SiLU(gate(e)) * up(RMSNorm(x))).
    ``down`` starts at zero, so a fresh sampler is the identity and an fspad head starts as EAGLE."""

    def __init__(self, hidden: int, intermediate: int, eps: float):
        super().__init__()
        self.norm = _RMSNorm(hidden, eps)
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)
        nn.init.zeros_(self.down_proj.weight)

    def forward(self, x, e):
        """x [..., H] the fused entry fc([e, f]), e [..., H] the token's embedding."""
        return x + self.down_proj(F.silu(self.gate_proj(e)) * self.up_proj(self.norm(x)))


class EagleHead(_TargetHead, nn.Module):
    """EAGLE (and EAGLE-3 with ``feature_layers`` / ``unroll``); with ``fspad`` the FSPAD variant:
    (1) feature sampling: the entry passes through a ``FeatureSampler`` (the token's embedding gates
    the fused feature; used identically at training and at decode, through ``entry``);
    (2) partial alignment distillation: the feature-regression loss covers only the first
    ``fspad_align`` fraction of the predicted feature's dimensions (``aligned_dims``); the rest are
    shaped by the token loss (soft CE to the target's distribution) alone. The whole predicted feature
    still goes to the LM head and is fed to the next step, as in EAGLE."""

    kind = "eagle"

    def __init__(self, target_config, feature_layers: list[int] | None = None, noise: float = 0.2, ce_weight: float = 0.1,
                 reg_weight: float = 1.0, unroll: int = 1, decay: float = 0.8, fspad: bool = False, fspad_align: float = 0.5):
        super().__init__()
        hidden = target_config.hidden_size
        heads = target_config.num_attention_heads
        self._sampler_dims = (hidden, getattr(target_config, "intermediate_size", 4 * hidden), getattr(target_config, "rms_norm_eps", 1e-6))
        self.sampler, self.fspad_align = None, None
        if fspad:
            self.enable_fspad(fspad_align)
        self.feature_layers = list(feature_layers) if feature_layers else None
        self.noise, self.ce_weight, self.reg_weight, self.unroll, self.decay = noise, ce_weight, reg_weight, unroll, decay
        # EAGLE-3: low/mid/high layer features fused into one
        self.fuse = nn.Linear(len(self.feature_layers) * hidden, hidden, bias=False) if self.feature_layers else None
        self.fc = nn.Linear(2 * hidden, hidden)
        head_dim = getattr(target_config, "head_dim", None) or hidden // heads
        self.decoder = nn.Module()  # keeps the ``decoder.layers.0.*`` checkpoint names
        self.decoder.layers = nn.ModuleList([DraftLayer(
            hidden, getattr(target_config, "intermediate_size", 4 * hidden), heads,
            getattr(target_config, "num_key_value_heads", None) or heads, head_dim, getattr(target_config, "rms_norm_eps", 1e-6),
        )])
        # the output is a feature for the target's LM head, as f_t is: no final norm
        register_rope(self, target_config, head_dim, int(getattr(target_config, "max_position_embeddings", 2048)) + 64)  # + tree depth
        self._target = None

    @property
    def layer(self) -> DraftLayer:
        return self.decoder.layers[0]

    def attach(self, target, init_from_lm_head: bool = False):
        self._target = _frozen(target)
        return self

    def hparams(self) -> dict:
        # getattr: the published heads (models.interop) build themselves without EagleHead.__init__
        fspad = {"fspad": True, "fspad_align": self.fspad_align} if getattr(self, "sampler", None) is not None else {}
        return {"feature_layers": self.feature_layers, "unroll": self.unroll, "noise": self.noise, "ce_weight": self.ce_weight,
                "reg_weight": self.reg_weight, **fspad}

    # -- FSPAD --------------------------------------------------------------------------------

    def enable_fspad(self, align: float = 0.5) -> "EagleHead":
        """Make this head FSPAD's: add the (identity-initialised) feature sampler, and regress only the
        first ``align`` fraction of the predicted feature's dimensions. Call before training starts."""
        align = float(align)
        if not 0.0 < align <= 1.0:
            raise ValueError(f"fspad_align must be in (0, 1], not {align}")
        if self.sampler is None:
            p = next(self.parameters(), None)
            self.sampler = FeatureSampler(*self._sampler_dims)
            if p is not None:
                self.sampler.to(device=p.device, dtype=p.dtype)
        self.fspad_align = align
        return self

    def aligned_dims(self, hidden: int) -> int:
        """How many leading feature dimensions the regression loss covers (all of them without FSPAD)."""
        if getattr(self, "fspad_align", None) is None:
            return hidden
        return max(1, min(hidden, round(self.fspad_align * hidden)))

    def regression_loss(self, pred, true):
        """Smooth-L1 between the predicted and the target's features over the aligned dimensions (EAGLE's
        term over all of them; FSPAD's partial alignment over the first ``aligned_dims``)."""
        k = self.aligned_dims(pred.shape[-1])
        return F.smooth_l1_loss(pred[..., :k].float(), true[..., :k].float())

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        # an FSPAD artifact rebuilt by a builder that does not pass ``fspad``: its sampler's weights say so
        if getattr(self, "sampler", None) is None and any(k.startswith("sampler.") for k in state_dict):
            self.enable_fspad(0.5)
        return super().load_state_dict(state_dict, strict=strict, assign=assign)

    def features(self, hidden_states):
        """The drafter's input feature per position: the last layer, or fused chosen layers."""
        if self.fuse is None:
            return hidden_states[-1]
        return self.fuse(torch.cat([hidden_states[i] for i in self.feature_layers], dim=-1))

    def entry(self, tokens, feats):
        embed, _ = self._target
        e = embed(tokens).to(feats.dtype)
        x = self.fc(torch.cat([e, feats], dim=-1))
        sampler = getattr(self, "sampler", None)
        return x if sampler is None else sampler(x, e)  # FSPAD: the token samples the feature

    def rope(self, position_ids):
        """(cos, sin) [B, T, D] for position ids [B, T]."""
        return self.rope_cos[position_ids], self.rope_sin[position_ids]

    def run(self, x, mask, position_ids, store=None):
        return self.layer(x, *self.rope(position_ids), mask, store)

    def lm_logits(self, f):
        return self.target_logits(f)

    def unrolled(self, hidden_states, input_ids, steps: int, noise: float = 0.0):
        """Predicted features [steps, B, T-1, H]: entry s of step u predicts f_{s+u+1}.

        Step 0 feeds the true features; step u feeds step u-1's prediction (EAGLE-3 training-time
        test). A step-u entry from start s sits at position s+u and sees the true entries 0..s and
        its own chain, which is the tree attention it gets at decode time.
        """
        f = self.features(hidden_states)
        b, t, h = f.shape
        n = t - 1
        dev = f.device
        feats = f[:, :n]
        if noise:
            feats = feats + (torch.rand_like(feats) - 0.5) * noise
        s = torch.arange(n, device=dev)
        causal = s[:, None] >= s[None, :]
        entries, outs = [], []
        prev = feats
        for u in range(steps):
            tok = F.pad(input_ids[:, 1 + u :], (0, u), value=0)[:, :n]  # token s+u+1
            entries.append(self.entry(tok, prev))
            m = len(entries)
            mask = torch.zeros(m * n, m * n, dtype=torch.bool, device=dev)
            for a in range(m):
                mask[a * n : (a + 1) * n, :n] = causal  # true entries 0..s
                for c in range(1, a + 1):
                    mask[a * n : (a + 1) * n, c * n : (c + 1) * n] = torch.eye(n, dtype=torch.bool, device=dev)
            pos = torch.cat([s + a for a in range(m)])[None].expand(b, -1)
            out = self.run(torch.cat(entries, dim=1), mask[None, None].expand(b, 1, -1, -1), pos)
            prev = out[:, (m - 1) * n :]
            outs.append(prev)
        return torch.stack(outs)

    def chain_logits(self, hidden_states, input_ids, k):
        fh = self.unrolled(hidden_states, input_ids, k)
        return F.pad(self.lm_logits(fh), (0, 0, 0, 1))  # [k, B, T, V], last position padded

    def forward(self, hidden_states, input_ids, target_logits):
        fh = self.unrolled(hidden_states, input_ids, self.unroll, noise=self.noise)
        f = hidden_states[-1]
        t = input_ids.shape[1]
        loss, parts = 0.0, {}
        for u in range(self.unroll):
            valid = t - 1 - u  # starts s with s+u+1 <= T-1
            if valid <= 0:
                break
            pred = fh[u, :, :valid]
            true = f[:, 1 + u : 1 + u + valid].to(pred.dtype)
            reg = self.regression_loss(pred, true)
            log_q = F.log_softmax(self.lm_logits(pred).float(), -1)
            ce = soft_ce(log_q, target_logits, 1 + u, valid)
            loss = loss + self.decay**u * (self.reg_weight * reg + self.ce_weight * ce)
            parts[f"reg{u}"], parts[f"ce{u}"] = float(reg.detach()), float(ce.detach())
        return loss, parts


def soft_ce(log_q, teacher, start: int, n: int):
    """Cross-entropy of the head's log-probs ``log_q`` [B, n, V] against the teacher at positions
    start..start+n-1: full logits [B, T, V], or a cached top-k (values, indices) pair over the head's
    output space, renormalised over its support."""
    if isinstance(teacher, tuple):
        values, indices = (t[:, start : start + n] for t in teacher)
        p = F.softmax(values.float(), -1)
        return -(p * log_q.gather(-1, indices.long())).sum(-1).mean()
    p = F.softmax(teacher[:, start : start + n].float(), -1)
    return -(p * log_q).sum(-1).mean()


# ---------------------------------------------------------------------------------------------
# Inputs that ride the target's own forward (decode.drafters.parallel_prompts): PPD and Hidden Transfer.
# Both predict tokens t+2..t+m+1 at m extra positions of a forward whose last real position is t; what
# differs is what they inject there, through forward hooks on the target (``injecting``), the same in
# training (``forward`` on a packed batch of train.trainers.lud.pack) and at decode (the engine's riding positions).

RIDE_KINDS = ("ppd", "hidden-transfer")


class _RideHeads(_TargetHead, nn.Module):
    """m riding positions (``num_heads``): position j (0-based) after the last real position t predicts
    token t+2+j. ``placeholder``: their input id (its embedding is replaced or left unused)."""

    ensemble = 1  # riding chains per round, each of num_heads positions, blind to the others (PPD's ensemble)

    def __init__(self, num_heads: int, placeholder: int):
        super().__init__()
        self.num_heads, self.placeholder = int(num_heads), int(placeholder)
        self._target, self._model = None, None

    @property
    def riding_width(self) -> int:
        """Positions that ride one forward per row: ``ensemble`` groups of ``num_heads``."""
        return self.num_heads * self.ensemble

    def combine(self, logits: torch.Tensor) -> torch.Tensor:
        """[..., G * e * m, V] riding outputs of G rounds (or cuts) -> [..., G * m, V]: the ensemble's mean logits."""
        e, m = self.ensemble, self.num_heads
        if e == 1:
            return logits
        shape = logits.shape
        return logits.view(*shape[:-2], shape[-2] // (e * m), e, m, shape[-1]).mean(-3).reshape(*shape[:-2], -1, shape[-1])

    def attach(self, target, init_from_lm_head: bool = False):
        self._target = _frozen(target)
        self._model = (target,)  # a tuple: not a submodule (neither trained nor saved)
        return self

    def hparams(self) -> dict:
        return {"num_heads": self.num_heads, "placeholder": self.placeholder}

    def injecting(self, cols: torch.Tensor, src: torch.Tensor):
        """A context manager: within it, the target's forwards take this module's inputs at columns ``cols``
        [B, K*m] (K groups of m riding positions, in order), ``src`` [B, K*m] the column of each group's last
        real position."""
        raise NotImplementedError

    @staticmethod
    def _hooked(module, hook):
        import contextlib

        @contextlib.contextmanager
        def scope():
            handle = module.register_forward_hook(hook)
            try:
                yield
            finally:
                handle.remove()

        return scope()

    def packed_logits(self, target, batch: dict, masks) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits [B, K*m, V], labels [B, K*m]) of the riding positions of a packed batch (``train.trainers.lud.pack``
        with unit size m + 1: each cut's last real position, then its m placeholders, which come last in the
        input); ``masks`` makes its 4-D attention mask (``train.trainers.lud.MaskMaker``)."""
        m, e, ids = self.num_heads, self.ensemble, batch["input_ids"]
        bsz = ids.shape[0]
        groups = batch["unit_pos"].view(bsz, -1, m + 1)  # with an ensemble, each cut's e groups in a row (LudCollate copies)
        cols = groups[..., 1:].reshape(bsz, -1)
        src = groups[..., :1].expand(-1, -1, m).reshape(bsz, -1)
        labels = batch["unit_labels"].view(bsz, -1, e, m + 1)[:, :, 0, 1:].reshape(bsz, -1)
        with self.injecting(cols, src):
            logits = target(input_ids=ids, attention_mask=masks(batch["visible"], batch["position_ids"]),
                            position_ids=batch["position_ids"], logits_to_keep=cols.shape[1]).logits  # the placeholders: last
        return self.combine(logits), self.labels(labels)

    def forward(self, target, batch: dict, masks):
        """Training (the target frozen): the mean CE of the riding positions' predictions on a packed batch."""
        logits, labels = self.packed_logits(target, batch, masks)
        m = self.num_heads
        ce = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="none")
        ce = ce.view(labels.shape[0], -1, m)
        return ce.mean(), {f"ce{j}": float(ce[..., j].mean().detach()) for j in range(m)}


class PromptTokens(_RideHeads):
    """PPD (parallel prompt decoding, Chen et al. 2024): trained soft prompt embeddings replace the input
    embeddings (the embedding module's outputs, so a scaled embedding's scale is learnt in) at the riding
    positions; an ensemble of ``ensemble`` (e) embeddings per future position: e chains of m positions ride
    each forward, each blind to the others, and a position's prediction is their mean logits."""

    kind = "ppd"

    def __init__(self, hidden: int, num_heads: int = 3, placeholder: int = 0, ensemble: int = 1):
        super().__init__(num_heads, placeholder)
        if int(ensemble) < 1:
            raise ValueError(f"the PPD ensemble must be >= 1, not {ensemble}")
        self.ensemble = int(ensemble)
        self.prompts = nn.Parameter(torch.zeros(self.ensemble * self.num_heads, hidden))  # member-major: [e0: m, e1: m, ...]

    def hparams(self) -> dict:
        return {**super().hparams(), "ensemble": self.ensemble}

    def attach(self, target, init_from_lm_head: bool = False):
        super().attach(target)
        if init_from_lm_head:  # a fresh set starts at the mean input embedding (the module's output, scale included)
            embed = target.get_input_embeddings()
            with torch.no_grad():
                ids = torch.arange(min(4096, embed.weight.shape[0]), device=embed.weight.device)
                vecs = embed(ids).float()
                self.prompts.copy_(vecs.mean(0).expand_as(self.prompts))
                if self.ensemble > 1:  # identical members would get identical gradients and stay one
                    g = torch.Generator().manual_seed(0)
                    noise = torch.randn(self.prompts.shape, generator=g).to(self.prompts.device) * vecs.std(0).to(self.prompts.device)
                    self.prompts[self.num_heads :].add_(0.1 * noise[self.num_heads :])
        return self

    def injecting(self, cols, src):
        m, e = self.num_heads, self.ensemble
        rows = torch.arange(cols.shape[0], device=cols.device)[:, None].expand_as(cols)
        idx = torch.arange(cols.shape[1], device=cols.device)
        which = (idx // m % e) * m + idx % m  # group g of m positions is member g mod e

        def hook(module, args, out):
            return out.index_put((rows, cols), self.prompts[which].to(out.dtype).expand(cols.shape[0], -1, -1))

        return self._hooked(self._model[0].get_input_embeddings(), hook)


def transfer_layer(num_layers: int) -> int:
    """Hidden Transfer's default layer: the output of decoder layer round(2L/3) (1-based) is replaced, so the last
    L - round(2L/3) layers run the pseudo states; returned 0-based."""
    return max(0, round(2 * num_layers / 3) - 1)


class TransferMaps(_RideHeads):
    """Hidden Transfer (Wu et al. 2024): linear maps W_1..W_m (H x H, initialised to the identity) turn the
    hidden state that decoder layer ``layer`` (0-based) outputs at the last real position into pseudo
    hidden states of the m riding positions, which replace that layer's outputs there and run through the
    remaining layers in the same forward."""

    kind = "hidden-transfer"

    def __init__(self, hidden: int, num_layers: int, num_heads: int = 3, placeholder: int = 0, layer: int | None = None):
        super().__init__(num_heads, placeholder)
        self.layer = transfer_layer(num_layers) if layer is None else int(layer)
        if not 0 <= self.layer < num_layers - 1:
            raise ValueError(f"the transfer layer must be 0..{num_layers - 2} (some layer must follow it), not {self.layer}")
        self.maps = nn.Parameter(torch.eye(hidden).repeat(self.num_heads, 1, 1))

    def hparams(self) -> dict:
        return {**super().hparams(), "layer": self.layer}

    def injecting(self, cols, src):
        from specdec.models.arch import decoder_layers

        bsz, k = cols.shape[0], cols.shape[1] // self.num_heads
        rows = torch.arange(bsz, device=cols.device)[:, None].expand_as(cols)

        def hook(module, args, out):
            h = out[0] if isinstance(out, tuple) else out
            base = h[rows, src].view(bsz, k, self.num_heads, h.shape[-1])  # each group's last real state, per map
            pseudo = torch.einsum("bkmh,mgh->bkmg", base, self.maps.to(h.dtype)).reshape(bsz, -1, h.shape[-1]).to(h.dtype)  # (autocast)
            h = h.index_put((rows, cols), pseudo)
            return (h, *out[1:]) if isinstance(out, tuple) else h

        return self._hooked(decoder_layers(self._model[0])[2][self.layer], hook)
