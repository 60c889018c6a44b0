"""A plain-function forward for Llama-architecture draft models: the draft's per-token cost.

A draft model is called once per drafted token, at one token a call, and on a small model that call's
price is set by work per module and per op, not arithmetic. ``LeanStep`` runs the same arithmetic as
plain tensor ops, with q/k/v and gate/up fused into one matmul each, against the same cache
(so ``KVState``'s crop/rollback/row selection apply unchanged).

Eagerly it is used for drafts only (the target keeps HF's forward: the lossless guarantee is stated against
it), and only where it reproduces HF: ``lean_step`` checks the model's structure (Llama's modules,
SiLU MLP, no biases, default RoPE, SDPA, at most 50M parameters) and then compares the two forwards on a probe
(prefill and one cached step); any difference, or any other architecture, keeps HF's forward.
That probe is what keeps this from drifting with transformers: a change there fails it, not decoding.

A target's recorded decode steps (``--compile graphs``, ``decode.engine.compiled``) run the same
arithmetic through ``fused_step``: ``LeanStep.static`` against the preallocated buffers, its small ops
fused into three kernels (``kernels.decode_step``: Triton on a GPU, their PyTorch references elsewhere),
so a recorded layer is about a dozen kernels instead of HF's forty. For a target the fused matmul
weights are the model's own (its q/k/v and gate/up parameters become views of them: no second copy of
an 8B model's projections). Its probe runs both forwards on the same preallocated buffers, in float32
(a 16-bit model's on a float32 copy of its first two layers, where a structural slip moves the logits by
their whole norm, then on the model itself within its dtype's drift); a model it does not reproduce, or
one spread over several GPUs, records HF's forward.
"""

from __future__ import annotations

import weakref
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from transformers import DynamicCache
from transformers.modeling_outputs import CausalLMOutputWithPast

from specdec.decode.engine.direct import foreign_hooks
from specdec.kernels.decode_step import ops, rms_norm_reference, rotate
from specdec.models.masks import additive_mask

# past this size a model's forward is arithmetic, not per-op work, and the fused copies of its weights would cost memory
LEAN_MAX_PARAMS = 50_000_000
_CACHE: "weakref.WeakKeyDictionary[torch.nn.Module, LeanStep | None]" = weakref.WeakKeyDictionary()
_FUSED: "weakref.WeakKeyDictionary[torch.nn.Module, dict]" = weakref.WeakKeyDictionary()
# RoPE types whose frequencies HF computes once (the rotary module's inv_freq): the fused step reads them
STATIC_ROPE = ("default", "linear", "llama3")
# the fused step's attention reads the buffers as SDPA does under either name
FUSED_ATTENTION = ("sdpa", "specdec_tree")


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


def fused_step(model, backend: str) -> "LeanStep | None":
    """The target's fused step for recorded decode steps with ``backend``'s kernels ("triton" or "torch"),
    or None where it would not reproduce HF's forward (built and checked once per model and backend)."""
    made = _FUSED.setdefault(model, {})
    step = made.get(backend)
    if backend not in made or (step is not None and step.stale()):
        step = None
        # one device: the fused forward moves nothing between GPUs (a --device-map model keeps HF's forward)
        spread = len(set(getattr(model, "hf_device_map", {}).values())) > 1
        if not spread and not any(foreign_hooks(m) for m in model.modules()) and _supported(model, None, STATIC_ROPE, FUSED_ATTENTION):
            # the model's parameters become views of the fused weights: made outside inference mode (a job's
            # first step runs inside it), so that they stay parameters with version counters
            with torch.inference_mode(False):
                step = LeanStep(model, share=True, backend=backend)
                ok = step.static_matches_hf()
            made[("errors", backend)] = step.errors
            step = step if ok else None
        made[backend] = step
    return step


def fused_errors(model, backend: str) -> dict | None:
    """What ``fused_step``'s probe measured for ``model`` (relative differences by dtype), None if it did not run."""
    return _FUSED.get(model, {}).get(("errors", backend))


def _supported(model, max_params: int | None = LEAN_MAX_PARAMS, rope_types=("default",), attention=("sdpa",)) -> bool:
    cfg = getattr(model, "config", None)
    base = getattr(model, "model", None)
    layers = getattr(base, "layers", None)
    if cfg is None or layers is None or len(layers) == 0 or not hasattr(model, "lm_head"):
        return False
    if max_params is not None and sum(p.numel() for p in model.parameters()) > max_params:
        return False
    rope = getattr(cfg, "rope_parameters", None) or {}
    if (
        getattr(cfg, "hidden_act", None) != "silu"
        or getattr(cfg, "attention_bias", True)
        or getattr(cfg, "mlp_bias", True)
        or getattr(cfg, "pretraining_tp", 1) != 1
        or rope.get("rope_type", "default") not in rope_types
        or getattr(cfg, "_attn_implementation", None) not in attention
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
    def __init__(self, model, share: bool = False, backend: str = "torch"):
        """share: the model's q/k/v and gate/up parameters become views of the fused weights (a target's:
        one copy of its projections); otherwise the fused weights are copies. backend: the kernels of
        ``static`` (``kernels.decode_step.ops``)."""
        cfg, base = model.config, model.model
        self.model = model
        self.embed = base.embed_tokens.weight
        self.layers = []
        for layer in base.layers:
            a, m = layer.self_attn, layer.mlp
            qkv = _fused(torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight], 0).detach(),
                         [a.q_proj, a.k_proj, a.v_proj] if share else [])
            gate_up = _fused(torch.cat([m.gate_proj.weight, m.up_proj.weight], 0).detach(), [m.gate_proj, m.up_proj] if share else [])
            self.layers.append((
                layer.input_layernorm.weight, layer.input_layernorm.variance_epsilon,
                qkv,
                a.o_proj.weight,
                layer.post_attention_layernorm.weight, layer.post_attention_layernorm.variance_epsilon,
                gate_up,
                m.down_proj.weight,
                a.layer_idx,
            ))
        self.backend = backend
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

    def _rotary(self, position_ids, dtype):
        """HF's rotary tables cos, sin [B, T, D] for explicit positions, in the model's dtype."""
        freqs = position_ids[..., None].float() * self.inv_freq
        emb = torch.cat((freqs, freqs), -1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    @torch.no_grad()
    def __call__(self, input_ids, attention_mask, position_ids, past_key_values):
        """(logits [B, T, V], final normed hidden [B, T, H]) for a segment after the cache; the same
        arguments as HF's forward (a 4-D additive mask over cache + segment, explicit positions)."""
        b, t = input_ids.shape
        hd = self.head_dim
        nq, nk = self.heads * hd, self.kv_heads * hd
        x = F.embedding(input_ids, self.embed)
        cos, sin = (table[:, None] for table in self._rotary(position_ids, x.dtype))
        for ln1, eps1, qkv_w, o_w, ln2, eps2, gu_w, down_w, idx in self.layers:
            qkv = F.linear(_rms(x, ln1, eps1), qkv_w)
            q = qkv[..., :nq].view(b, t, self.heads, hd).transpose(1, 2)
            k = qkv[..., nq : nq + nk].view(b, t, self.kv_heads, hd).transpose(1, 2)
            v = qkv[..., nq + nk :].view(b, t, self.kv_heads, hd).transpose(1, 2)
            q, k = rotate(q, cos, sin), rotate(k, cos, sin)
            k, v = past_key_values.update(k, v, idx)
            if self.kv_heads != self.heads:
                k = k.repeat_interleave(self.heads // self.kv_heads, 1)
                v = v.repeat_interleave(self.heads // self.kv_heads, 1)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask, scale=self.scale)
            x = x + F.linear(o.transpose(1, 2).reshape(b, t, nq), o_w)
            gate, up = F.linear(_rms(x, ln2, eps2), gu_w).split(self.inter, -1)
            x = x + F.linear(F.silu(gate) * up, down_w)
        x = _rms(x, self.norm, self.eps)
        return F.linear(x, self.head), x

    @torch.no_grad()
    def static(self, input_ids, attention_mask, position_ids, past_key_values, output_hidden_states=False, **unused):
        """HF's forward for a compiled step (``decode.engine.compiled``), fused: the same keyword arguments
        and output (logits, and with ``output_hidden_states`` HF's tuple: the embeddings, each layer's
        output, the last one normed), against ``decode.engine.buffers.SlotBuffers`` in their compiled mode
        (every layer written at its write offset, a tensor; the mask [B, 1, T, capacity] spans the
        whole buffer, additive or boolean). The write offsets advance by T, as HF's cache update does."""
        rms_norm, rope_write, silu_mul = ops(self.backend)
        b, t = input_ids.shape
        hd, nq = self.head_dim, self.heads * self.head_dim
        g = self.heads // self.kv_heads
        cache = past_key_values.layers
        x = F.embedding(input_ids, self.embed)
        cos, sin = self._rotary(position_ids, x.dtype)
        # the queries of the g heads sharing a key/value head are g * t rows of it: the mask repeats per head
        mask = attention_mask
        if g > 1:
            mask = mask[:, :, None].expand(b, 1, g, t, mask.shape[-1]).reshape(b, 1, g * t, mask.shape[-1])
        hidden = [x] if output_hidden_states else None
        _, h = rms_norm(x, self.layers[0][0], self.layers[0][1])
        for i, (_, _, qkv_w, o_w, ln2, eps2, gu_w, down_w, idx) in enumerate(self.layers):
            layer = cache[idx]
            q = rope_write(F.linear(h, qkv_w), cos, sin, layer.keys, layer.values, layer.cumulative_length,
                           self.heads, self.kv_heads)
            o = F.scaled_dot_product_attention(q, layer.keys, layer.values, attn_mask=mask, scale=self.scale)
            o = o.reshape(b, self.kv_heads, g, t, hd).permute(0, 3, 1, 2, 4).reshape(b, t, nq)
            x, h = rms_norm(x, ln2, eps2, residual=F.linear(o, o_w))
            out = F.linear(silu_mul(F.linear(h, gu_w)), down_w)
            last = i + 1 == len(self.layers)
            norm_w, norm_eps = (self.norm, self.eps) if last else self.layers[i + 1][:2]
            x, h = rms_norm(x, norm_w, norm_eps, residual=out)
            if hidden is not None:
                hidden.append(h if last else x)
        torch._foreach_add_([layer.cumulative_length for layer in cache], t)
        return CausalLMOutputWithPast(logits=F.linear(h, self.head), hidden_states=tuple(hidden) if hidden is not None else None)

    def static_matches_hf(self) -> bool:
        """``static`` and HF's forward agree on a probe (a 6-token prefill with a padded slot, then one step)
        run in preallocated buffers as compiled steps run: the largest difference over the logits and hidden
        states, relative to their norm, within 1e-3 in float32 (TF32 off; a GPU's kernels fuse and order
        sums differently). A 16-bit model's own rounding would hide a slip in a small part of the sum (a random
        model's attention is a few percent of its residual stream), so its structure is checked on a float32
        copy of its first two layers and 256 vocabulary rows (a slip there differs by about the logits' whole
        norm), and the model itself within 10% (its dtype's kernels: a model of many layers drifts a few
        percent in bfloat16). ``errors`` records what was measured."""
        self.errors = {}
        if self.embed.dtype.itemsize < 4:
            self.errors["float32 copy"] = LeanStep(_float_copy(self.model), backend=self.backend)._probe()
            if self.errors["float32 copy"] > 1e-3:
                return False
        self.errors[str(self.embed.dtype).removeprefix("torch.")] = own = self._probe()
        return own <= (1e-3 if self.embed.dtype.itemsize >= 4 else 0.1)

    def _probe(self) -> float:
        """The largest relative difference (norm of the difference over the norm of HF's) between ``static``'s
        outputs and HF's on the probe; inf where their shapes differ."""
        from specdec.decode.engine.buffers import SlotBuffers

        cfg, dev, dtype = self.model.config, self.embed.device, self.embed.dtype
        capacity = 16
        # each segment written from its first position's slot
        steps = [(seg, vis, p, int(p[0, 0])) for seg, vis, p in _probe_segments(cfg.vocab_size, dev)]
        caches = [SlotBuffers(len(self.layers), capacity, dev, zeroed=True) for _ in range(2)]
        empty = torch.empty(2, self.kv_heads, 0, self.head_dim, dtype=dtype, device=dev)
        for layer in caches[1].layers:  # HF's forward allocates its buffers at the first write; compiled steps find them made
            layer.lazy_initialization(empty, empty)
        boolean = cfg._attn_implementation == "specdec_tree"
        # the float32 probe at float32's own precision, whatever a job set for its matmuls
        matmul, cudnn = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
        try:
            worst = self._probe_steps(steps, caches, capacity, boolean, dtype)
        finally:
            torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = matmul, cudnn
        return worst

    def _probe_steps(self, steps, caches, capacity: int, boolean: bool, dtype) -> float:
        worst = 0.0
        with torch.no_grad():
            for seg, vis, p, at in steps:
                vis = F.pad(vis, (0, capacity - vis.shape[-1]), value=False).to(self.embed.device)
                mask = vis if boolean else additive_mask(vis, dtype)
                outs = []
                for cache, forward in zip(caches, (self.model, self.static)):
                    cache.at(at, compiled_step=True)
                    outs.append(forward(input_ids=seg, attention_mask=mask, position_ids=p, past_key_values=cache,
                                        use_cache=True, output_hidden_states=True))
                ref, got = outs
                if len(ref.hidden_states) != len(got.hidden_states):
                    return float("inf")
                pairs = [(ref.logits, got.logits)] + list(zip(ref.hidden_states, got.hidden_states))
                worst = max([worst] + [_relative(a, b) for a, b in pairs])
        return worst

    def matches_hf(self) -> bool:
        """Both forwards on a probe (a 6-token prefill with one padded slot, then one cached step) agree."""
        cfg, dev = self.model.config, self.embed.device
        steps = _probe_segments(cfg.vocab_size, dev)
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


def _rms(x, w, eps):
    """HF's LlamaRMSNorm (in float32 whatever the model's dtype), as the fused kernel's reference computes it."""
    return rms_norm_reference(x, w, eps)[1]


def _probe_segments(vocab: int, dev) -> list:
    """The probes' (input_ids, visible, positions): a 6-token prefill of two rows, row 1's first slot padding,
    then one cached step."""
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (2, 6), generator=gen).to(dev)
    visible = torch.ones(6, 6, dtype=torch.bool).tril_()[None, None].repeat(2, 1, 1, 1)
    visible[1, :, 1:, 0] = False  # row 1's first slot is padding
    pos = torch.arange(6)[None].repeat(2, 1).to(dev)
    return [(ids, visible, pos), (ids[:, :1], torch.ones(2, 1, 1, 7, dtype=torch.bool), pos[:, -1:] + 1)]


def _fused(weight: torch.Tensor, linears: list) -> torch.Tensor:
    """``weight`` (the rows of ``linears``' weights stacked); the linears' weights become views of it."""
    start = 0
    for linear in linears:
        rows = linear.weight.shape[0]
        linear.weight = torch.nn.Parameter(weight[start : start + rows], requires_grad=linear.weight.requires_grad)
        start += rows
    return weight


def _float_copy(model):
    """A float32 copy of ``model`` with its first two layers and its first 256 vocabulary rows, on its device."""
    import copy

    cfg = copy.deepcopy(model.config)
    layers = min(2, cfg.num_hidden_layers)
    cfg.num_hidden_layers, cfg.vocab_size, cfg.tie_word_embeddings, cfg.pad_token_id = layers, min(256, cfg.vocab_size), False, None
    if getattr(cfg, "layer_types", None):
        cfg.layer_types = cfg.layer_types[:layers]
    with torch.device(model.model.embed_tokens.weight.device):
        small = type(model)(cfg).float().eval()
    with torch.no_grad():
        small.model.embed_tokens.weight.copy_(model.model.embed_tokens.weight[: cfg.vocab_size])
        small.lm_head.weight.copy_(model.lm_head.weight[: cfg.vocab_size])
        small.model.norm.load_state_dict(model.model.norm.state_dict())
        for mine, theirs in zip(small.model.layers, model.model.layers):
            mine.load_state_dict(theirs.state_dict())
    return small


def _relative(ref: torch.Tensor, got: torch.Tensor) -> float:
    if ref.shape != got.shape:
        return float("inf")
    ref, got = ref.double(), got.double()
    return float((ref - got).norm() / ref.norm().clamp_min(1e-30))


def lean_output(logits, hidden) -> SimpleNamespace:
    """What KVState.forward's callers read from an HF output: ``logits`` and ``hidden_states[-1]``."""
    return SimpleNamespace(logits=logits, hidden_states=(hidden,))
