"""A block drafter: all K draft tokens of a round from one forward of a small draft, conditioned on the
target's hidden states (the scheme of DFlash, P-EAGLE and PARD: parallel drafting instead of EAGLE's
one layer call per draft position).

The draft is ``num_layers`` pre-norm Llama layers (``models.heads.DraftLayer``). Its queries are one
block of K positions after the last token the target has read: the first holds the embedding of the
token the target just emitted (the round's root), the other K - 1 a learned mask embedding; each is
fused with the context entry of the last position the target read, ``fc([embedding, entry])`` (EAGLE's
entry, as P-EAGLE keeps it: the freshest target state sits in every query rather than only behind
attention), plus a learned block-position vector. Every layer's keys and values are the block's own (attended both
ways inside the block) and the *context*: the target's features of every committed position (EAGLE-3's
low, middle and high layers fused by one linear map and normed), projected by that layer's key and
value maps. Block position j predicts the token j + 1 after the root, through a norm and the target's
frozen output layer (its rows of a reduced draft vocabulary, ``models.heads._TargetHead``).

Two layouts. The one above is specdec's own (``layout="specdec"``). ``layout="published"`` is DFlash's, as
speculators' ``dflash`` checkpoints and vLLM run it (``models.interop.export_dflash`` writes it, ``_dflash`` reads
one trained elsewhere): the block is the root then K positions filled with a mask token's row of the target's
embedding matrix, with no fusion and no position vectors (RoPE alone places them); the root's slot drafts nothing
and mask slot j predicts the token j after the root; the layers are Qwen3's (per-head q/k norms), and the context
entries go into their key/value maps without the layer's input norm. What each slot predicts, and so training
and decoding, is the same in both.

At decode the context's keys and values are computed once per committed position (a slot cache, as
EAGLE's), so a round costs one draft call over K positions whatever K is. The K per-position
distributions are independent given the context, so a round's proposal is a chain (top-1 per position)
or a Medusa-style tree of per-position top-k candidates, verified by the one engine as any tree.

Training: the target's features of a block of text, ``anchors`` cut points t per block; cut t's block
holds the data token t + 1 as its root and its positions j predict tokens t + 2 + j, each against the
target's own distribution there (soft cross-entropy, or its cached top-k), weighted 0.9^j. ``loss="lk"``
adds the acceptance-oriented term of the LK losses (2026): the negative expected accepted length of
the chain, sum_j prod_{i<=j} alpha_i, where alpha_i = sum_x min(p_i(x), q_i(x)) is the chance that
position i's draft is accepted by speculative sampling.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from specdec.models.heads import DraftLayer, _RMSNorm, _rope, _TargetHead, _frozen, layer_config, layer_hf_config, register_rope

LOSSES = ("kl", "lk")
LAYOUTS = ("specdec", "published")
POSITION_DECAY = 0.9  # later block positions are reached less often: their loss weighs less


class BlockHead(_TargetHead, nn.Module):
    kind = "block"

    def __init__(self, target_config, num_heads: int = 4, num_layers: int = 1, feature_layers: list[int] | None = None,
                 anchors: int = 64, loss: str = "kl", layout: str = "specdec", mask_token_id: int | None = None,
                 layer: dict | None = None, own_head: int | None = None):
        """``layer`` (published): the draft layers' shape and rotation (``models.heads.layer_config``'s keys; default
        the target's); ``own_head``: an output layer of that many rows of its own (a DFlash checkpoint trained
        elsewhere) instead of the target's rows of the draft vocabulary."""
        super().__init__()
        if loss not in LOSSES:
            raise ValueError(f"loss must be one of {LOSSES}, not {loss!r}")
        if layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, not {layout!r}")
        published = layout == "published"
        if published and (not feature_layers or mask_token_id is None):
            raise ValueError("the published (DFlash) layout fuses chosen target layers and fills the block with a mask token: "
                             "it needs feature_layers and mask_token_id")
        hidden = target_config.hidden_size
        if published:
            self.layer_cfg = {**(layer or layer_config(target_config)), "model_type": "qwen3"}
            shape = layer_hf_config(self.layer_cfg)
        else:
            shape = target_config
        heads = shape.num_attention_heads
        head_dim = getattr(shape, "head_dim", None) or hidden // heads
        eps = getattr(shape, "rms_norm_eps", 1e-6)
        self.num_heads, self.num_layers, self.anchors, self.loss = int(num_heads), int(num_layers), int(anchors), loss
        self.layout, self.mask_token_id = layout, None if mask_token_id is None else int(mask_token_id)
        # the published block is the root then num_heads masks, the root's own slot predicting nothing (DFlash's
        # anchor); specdec's is num_heads slots, the root's predicting the token after it
        self.first = 1 if published else 0
        self.block_len = self.num_heads + self.first
        self.feature_layers = list(feature_layers) if feature_layers else None
        self.fuse = nn.Linear(len(self.feature_layers) * hidden, hidden, bias=False) if self.feature_layers else None
        self.context_norm = _RMSNorm(hidden, eps)
        if not published:
            self.mask_embedding = nn.Parameter(torch.zeros(hidden))
            self.fc = nn.Linear(2 * hidden, hidden, bias=False)
            self.block_position = nn.Parameter(torch.zeros(self.num_heads, hidden))
        self.layers = nn.ModuleList(DraftLayer(hidden, getattr(shape, "intermediate_size", 4 * hidden), heads,
                                               getattr(shape, "num_key_value_heads", None) or heads, head_dim, eps,
                                               qk_norm=published)
                                    for _ in range(self.num_layers))
        self.norm = _RMSNorm(hidden, eps)
        self.lm_head = nn.Linear(hidden, int(own_head), bias=False) if own_head else None
        # published: the rotation the layer's config gives in other engines (the one the export writes)
        positions = int(getattr(shape, "max_position_embeddings", 2048)) + self.block_len + 1
        register_rope(self, shape, head_dim, positions)
        self._target = None

    def init_from_target(self, target) -> "BlockHead":
        """The mask embedding starts as the mean of the target's input embeddings of its first tokens (a
        token-like vector rather than zeros). The output norm starts at ones, not at the target's final norm:
        with Gemma's large per-dimension scales a fresh block's random features gave logits of hundreds (a
        first loss of ~100 nats that took hundreds of steps to come down), where unit features give a
        near-uniform start."""
        if self.layout == "published":
            return self  # its mask is a token of the target's vocabulary, and its output norm starts at ones as well
        embed = target.get_input_embeddings()
        with torch.no_grad():
            ids = torch.arange(min(4096, embed.weight.shape[0]), device=embed.weight.device)
            self.mask_embedding.copy_(embed(ids[None])[0].float().mean(0))
        return self

    def attach(self, target, init_from_lm_head: bool = False):
        self._target = _frozen(target)
        return self

    def hparams(self) -> dict:
        hp = {"num_heads": self.num_heads, "num_layers": self.num_layers, "feature_layers": self.feature_layers,
              "anchors": self.anchors, "loss": self.loss}
        if self.layout == "published":
            hp |= {"layout": self.layout, "mask_token_id": self.mask_token_id, "layer": self.layer_cfg}
        return hp

    # -- pieces shared by training and decoding --------------------------------------------------

    def context(self, hidden_states) -> torch.Tensor:
        """[B, T, H]: the context entry per position (fused chosen layers, or the last, normed)."""
        if self.fuse is None:
            return self.context_of([hidden_states[-1]])
        return self.context_of([hidden_states[i] for i in self.feature_layers])

    def context_of(self, layers) -> torch.Tensor:
        """The context entries from the chosen layers' states, in ``feature_layers``' order (the last layer's alone without them)."""
        if self.fuse is None:
            return self.context_norm(layers[0].to(self.context_norm.weight.dtype))
        return self.context_norm(self.fuse(torch.cat(list(layers), dim=-1).to(self.fuse.weight.dtype)))

    def rope(self, position_ids):
        return self.rope_cos[position_ids], self.rope_sin[position_ids]

    def context_kv(self, layer: DraftLayer, ctx, position_ids):
        """The context entries' keys and values [B, kvh, T, D] in ``layer``."""
        b, t, _ = ctx.shape
        a, d = layer.self_attn, layer.head_dim
        # the published layer maps the context entries as they are (DFlash's target_hidden skips the layer's input norm)
        x = ctx if self.layout == "published" else layer.input_layernorm(ctx)
        k = a.k_proj(x).view(b, t, layer.kv_heads, d).transpose(1, 2)
        v = a.v_proj(x).view(b, t, layer.kv_heads, d).transpose(1, 2)
        if hasattr(a, "k_norm"):
            k = a.k_norm(k)
        cos, sin = self.rope(position_ids)
        return _rope(k, cos, sin), v

    def block_inputs(self, root, last) -> torch.Tensor:
        """[B, n, L, H] (L = ``block_len``) for root tokens [B, n] after context entries ``last`` [B, n, H]: the root's
        embedding, then the mask, each fused with the last entry, plus its block position; published: the root's and
        the mask token's rows of the target's embedding matrix (as DFlash's checkpoints read them: unscaled), no more."""
        embed, _ = self._target
        b, n = root.shape
        if self.layout == "published":
            w = embed.weight
            mask = w[self.mask_token_id].expand(b, n, self.num_heads, -1)
            return torch.cat([w[root][:, :, None], mask], 2).to(self.context_norm.weight.dtype)
        e = embed(root).to(self.mask_embedding.dtype)
        x = torch.cat([e[:, :, None], self.mask_embedding.expand(b, n, self.num_heads - 1, -1)], 2)
        x = self.fc(torch.cat([x, last[:, :, None].to(x.dtype).expand(-1, -1, self.num_heads, -1)], -1))
        return x + self.block_position

    def run(self, x, mask, position_ids, stores):
        """The block [B, Q, H] through the layers; ``stores[l](k, v)`` returns layer l's keys/values with the
        context's in front; the output feature per position, normed for the output layer."""
        cos, sin = self.rope(position_ids)
        for layer, store in zip(self.layers, stores):
            x = layer(x, cos, sin, mask, store)
        return self.norm(x)

    def drafted(self, out):
        """The block outputs [..., L, H] of its drafting slots [..., K, H]: slot j predicts the (j + 1)-th token after the root."""
        return out[..., self.first:, :]

    def lm_logits(self, f):
        if self.lm_head is not None:  # its rows are the draft vocabulary's (set_vocab's d2t without the unk stand-in)
            return self.lm_head(f.to(self.lm_head.weight.dtype))
        return self.target_logits(f)

    # -- training ------------------------------------------------------------------------------

    def _blocks(self, hidden_states, input_ids, anchors: torch.Tensor):
        """Block outputs [B, A, K, H] for cut points ``anchors`` [A] (shared by the batch's rows): cut t sees the
        context entries 0..t and its own block (the root x_{t+1} at position t + 1, masks after it)."""
        ctx = self.context(hidden_states)
        b, t, h = ctx.shape
        k, a = self.block_len, anchors.numel()
        dev = ctx.device
        ctx_pos = torch.arange(t, device=dev)[None].expand(b, t)
        root = F.pad(input_ids, (0, 1), value=0)[:, anchors + 1]  # [B, A]; the last cut's root is padding
        x = self.block_inputs(root, ctx[:, anchors]).reshape(b, a * k, h)
        pos = (anchors[:, None] + 1 + torch.arange(k, device=dev)).reshape(-1)
        own = torch.arange(a, device=dev).repeat_interleave(k)
        visible = torch.cat([torch.arange(t, device=dev)[None] <= anchors[own][:, None], own[:, None] == own[None]], 1)
        mask = torch.zeros(visible.shape, dtype=x.dtype, device=dev).masked_fill_(~visible, torch.finfo(x.dtype).min)
        stores = []
        for layer in self.layers:
            ck, cv = self.context_kv(layer, ctx, ctx_pos)
            stores.append(lambda kk, vv, ck=ck, cv=cv: (torch.cat([ck, kk], 2), torch.cat([cv, vv], 2)))
        out = self.run(x, mask[None, None].expand(b, 1, -1, -1), pos[None].expand(b, -1), stores)
        return self.drafted(out.view(b, a, k, h))

    def chain_logits(self, hidden_states, input_ids, k):
        """[k, B, T, V]: entry j at position t predicts token t + 2 + j from the context up to t (every cut)."""
        t = input_ids.shape[1]
        outs = []
        for start in range(0, t, 64):  # cuts in chunks: the attention's queries grow with them
            anchors = torch.arange(start, min(start + 64, t), device=input_ids.device)
            outs.append(self.lm_logits(self._blocks(hidden_states, input_ids, anchors)[:, :, :k]))
        return torch.cat(outs, 1).permute(2, 0, 1, 3)

    def forward(self, hidden_states, input_ids, target_logits):
        t = input_ids.shape[1]
        dev = input_ids.device
        cuts = t - 2  # cuts 0..t-3 have a root inside the block and at least one target inside it
        anchors = torch.randperm(cuts, device=dev)[: self.anchors].sort().values if cuts > self.anchors else torch.arange(cuts, device=dev)
        logits = self.lm_logits(self._blocks(hidden_states, input_ids, anchors)).float()  # [B, A, K, V]
        log_q = F.log_softmax(logits, -1)
        p_idx = anchors[:, None] + 1 + torch.arange(self.num_heads, device=dev)  # the teacher's position per (cut, j)
        valid = p_idx <= t - 1
        p_idx = p_idx.clamp(max=t - 1)
        if isinstance(target_logits, tuple):  # a cached top-k over the head's output space
            values, indices = (x[:, p_idx] for x in target_logits)  # [B, A, K, k]
            p = F.softmax(values.float(), -1)
            q_at = log_q.gather(-1, indices.long())
            ce = -(p * q_at).sum(-1)
            alpha = torch.minimum(p, q_at.exp()).sum(-1)
        else:
            p = F.softmax(target_logits[:, p_idx].float(), -1)
            ce = -(p * log_q).sum(-1)
            alpha = torch.minimum(p, log_q.exp()).sum(-1)
        w = POSITION_DECAY ** torch.arange(self.num_heads, device=dev, dtype=ce.dtype) * valid
        ce_loss = (ce * w).sum() / (w.sum() * ce.shape[0])
        parts = {f"ce{j}": float((ce[..., j].detach() * valid[:, j]).sum() / (valid[:, j].sum() * ce.shape[0]).clamp(min=1)) for j in range(self.num_heads)}
        # chance the chain reaches and passes position j: the product of the acceptance chances before it
        reach = torch.cumprod(alpha * valid + (~valid), -1) * valid
        expected = reach.sum(-1).mean()
        parts["expected_accepted"] = float(expected.detach())
        if self.loss == "lk":
            return ce_loss + (self.num_heads - expected) / self.num_heads, parts
        return ce_loss, parts
