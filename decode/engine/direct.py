"""The target's decode step with its decoder layers run in one C++ call (``kernels/step.cpp``): the same floats.

At one to a few positions, a small target's step on a CPU pays per operation: Gemma 3 270M runs about a
thousand small operations a token, and from Python each also pays the interpreter, the module machinery
and argument parsing, about as much again as the operations themselves. ``gemma_layers`` runs the
decoder layers' operations from C++: the same ATen operations transformers' modules call, in the same
order on the same shapes (models.norms' RMSNorm, models.blocks' quantised-block products or
``nn.Linear``, transformers' rotary embedding, cache write and SDPA call), so the logits are the same
floats. The embedding, rotary tables, masks, final norm and output layer stay transformers' own modules
and functions, called as transformers' forward calls them.

That the floats are the same is checked, not assumed: ``direct_step`` runs both forwards on a probe (a
prefill, then steps of one and of three positions over preallocated buffers) and compares the logits
with ``torch.equal``; any difference, or a model it does not describe (another architecture, a norm
models.norms did not route, hooks, soft-capped attention), keeps transformers' forward.
"""

from __future__ import annotations

import contextlib
import weakref

import torch

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
NORMS = ("input_layernorm", "q_norm", "k_norm", "post_attention_layernorm", "pre_feedforward_layernorm",
         "post_feedforward_layernorm")
MAX_ROWS = 16  # positions per forward the blocks kernel serves (models.blocks.MAX_ROWS); wider forwards go to transformers
_CACHE: "weakref.WeakKeyDictionary[torch.nn.Module, DirectStep | None]" = weakref.WeakKeyDictionary()


def direct_step(model, buffers) -> "DirectStep | None":
    """The model's DirectStep, or None where it would not give transformers' logits (built and probed once).
    ``buffers(layers, capacity, device, zeroed)``: the preallocated cache the engine's forwards run over
    (decode.engine.cache's SlotBuffers), which the probe runs over too."""
    if model not in _CACHE:
        step = DirectStep(model) if _supported(model) else None
        _CACHE[model] = step if step is not None and step.matches_hf(buffers) else None
    return _CACHE[model]


@contextlib.contextmanager
def python_layers(model):
    """Within: ``model``'s forwards run transformers' modules from Python (a benchmark's baseline, and the
    forward whose blocks-kernel calls a benchmark replays one by one)."""
    step = _CACHE.get(model)
    if step is None:
        yield
        return
    before, step.enabled = step.enabled, False
    try:
        yield
    finally:
        step.enabled = before


def _op_ready() -> bool:
    from specdec.models import blocks

    return blocks.kernel_ready() and hasattr(torch.ops.specdec_q, "gemma_layers")


def _supported(model) -> bool:
    cfg, base = getattr(model, "config", None), getattr(model, "model", None)
    if cfg is None or base is None or type(model).__name__ != "Gemma3ForCausalLM":
        return False
    if (getattr(cfg, "_attn_implementation", None) != "sdpa" or getattr(cfg, "attn_logit_softcapping", None) is not None
            or getattr(cfg, "use_bidirectional_attention", False) or getattr(cfg, "hidden_activation", None) != "gelu_pytorch_tanh"
            or getattr(cfg, "attention_bias", True)):
        return False
    if any(hasattr(m, "_hf_hook") for m in model.modules()):  # accelerate's offloading moves weights in its hooks
        return False
    for layer in base.layers:
        attn = layer.self_attn
        if not all(hasattr(getattr(attn, n, None) or getattr(layer.mlp, n, None), "weight") for n in LINEARS):
            return False
        norms = [getattr(layer, n, None) or getattr(attn, n, None) for n in NORMS]
        if any(getattr(n, "_specdec_norm", None) is None for n in norms):
            return False  # models.norms keeps transformers' forward for it: its arithmetic is not described here
        if type(layer.mlp.act_fn).__name__ != "GELUTanh" or getattr(layer.mlp.act_fn, "act", None) is None:
            return False
    return getattr(base.norm, "_specdec_norm", None) is not None and _op_ready()


def _layers(*args):
    """kernels/step.cpp's operator (one name to reach it by, in tests too)."""
    return torch.ops.specdec_q.gemma_layers(*args)


def _foreign(hooks) -> bool:
    return any(not getattr(h, "__module__", "").startswith("transformers.utils.output_capturing") for h in hooks.values())


class DirectStep:
    def __init__(self, model):
        self.model, self.base = model, model.model
        cfg = self.base.config
        self.types = sorted(set(cfg.layer_types))
        self.kinds = [self.types.index(t) for t in cfg.layer_types]
        attn = self.base.layers[0].self_attn
        self.head_dim, self.groups, self.scaling = attn.head_dim, attn.num_key_value_groups, float(attn.scaling)
        self.causal = bool(attn.is_causal)
        self.blocks = getattr(model, "_specdec_blocks", None)
        # the modules whose calls the step skips: a hook registered on one later (a riding drafter's) sends the
        # forward back to transformers
        self.skipped = [m for layer in self.base.layers for m in layer.modules()]
        self._hook_count, self._hooked = -1, False
        self.enabled = True  # python_layers switches it off
        self._linears: dict[bool, tuple[list, list, list]] = {}
        self.norms = [(getattr(layer, name, None) or getattr(layer.self_attn, name))._specdec_norm
                      for layer in self.base.layers for name in NORMS]

    def _weights(self):
        """Per layer the seven weights (blocks where models.blocks routes the layer and its switch is on), their
        ggml types (0: float32) and input widths; per layer the six norms' (1 + w, epsilon, count)."""
        on = self.blocks is not None and self.blocks.active
        if on not in self._linears:
            linears, qtypes, widths = [], [], []
            for layer in self.base.layers:
                for name in LINEARS:
                    lin = getattr(layer.self_attn, name, None) or getattr(layer.mlp, name)
                    found = getattr(lin, "_specdec_blocks", None) if on else None
                    linears.append(found[0] if found else lin.weight)
                    qtypes.append(found[1] if found else 0)
                    widths.append(lin.in_features)
            self._linears[on] = linears, qtypes, widths
        norms = []
        for scale, eps, count in self.norms:
            norms += [scale(), eps, count]  # 1 + w renewed where the weight was written in place
        return (*self._linears[on], norms)

    def usable(self, input_ids: torch.Tensor, mask, hidden: bool, model_kwargs: dict, cache) -> bool:
        """This forward is one the direct step computes as transformers would."""
        if not self.enabled or hidden or model_kwargs or input_ids.numel() > MAX_ROWS or torch.is_grad_enabled() or input_ids.device.type != "cpu":
            return False
        if mask is not None and not isinstance(mask, dict):
            return False
        if self.blocks is not None and self.blocks.suspended:
            return False
        count = sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in self.skipped)
        if count != self._hook_count:  # hooks came or went: are any of them someone else's than transformers' own?
            self._hook_count = count
            self._hooked = any(_foreign(m._forward_hooks) or _foreign(m._forward_pre_hooks) for m in self.skipped)
        if self._hooked:
            return False
        layers = getattr(cache, "layers", None)
        return bool(layers) and all(getattr(layer, "is_initialized", False) and getattr(layer, "end", None) is not None
                                    for layer in layers)

    def __call__(self, input_ids: torch.Tensor, mask, positions: torch.Tensor, cache):
        """Logits [B, T, V] of a segment after the cache (written at the cache's write offset), as
        transformers' forward with ``attention_mask=mask`` (None, or one mask per layer type) returns them."""
        from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask
        from transformers.modeling_outputs import CausalLMOutputWithPast

        x = self.base.embed_tokens(input_ids)
        if mask is None:
            kwargs = {"config": self.base.config, "inputs_embeds": x, "attention_mask": None, "past_key_values": cache,
                      "position_ids": positions}
            mask = {"full_attention": create_causal_mask(**kwargs),
                    "sliding_attention": create_sliding_window_causal_mask(**kwargs)}
        rope = []
        for t in self.types:
            rope += list(self.base.rotary_emb(x, positions, t))
        layers = cache.layers
        start, offset, t = layers[0].end, layers[0].offset, input_ids.shape[1]
        linears, qtypes, widths, norms = self._weights()
        x = _layers(
            x, linears, qtypes, widths, norms, [layer.keys for layer in layers], [layer.values for layer in layers],
            rope, [mask[t] for t in self.types], self.kinds, self.head_dim, self.groups, self.scaling, self.causal,
            start, offset)
        for layer in layers:
            layer.end = start + t
        logits = self.model.lm_head(self.base.norm(x))
        cap = self.model.config.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return CausalLMOutputWithPast(logits=logits)

    def matches_hf(self, buffers) -> bool:
        """Both forwards on a probe over preallocated buffers (a 5-token prefill by transformers, then segments
        of one and three positions) give equal logits, with the blocks' switch on and off."""
        cfg, dev = self.model.config, next(self.model.parameters()).device
        gen = torch.Generator().manual_seed(0)
        ids = torch.randint(0, cfg.vocab_size, (1, 9), generator=gen).to(dev)
        switches = [False, True] if self.blocks is not None else [None]
        for on in switches:
            before = self.blocks.enabled if self.blocks is not None else None
            if self.blocks is not None:
                self.blocks.enabled = on
            try:
                caches = [buffers(cfg.num_hidden_layers, 16, dev, zeroed=False) for _ in range(2)]
                with torch.no_grad():
                    for c in caches:
                        c.at(0, False)
                        self.model(input_ids=ids[:, :5], position_ids=torch.arange(5, device=dev)[None],
                                   past_key_values=c, use_cache=True)
                    for a, b in ((5, 6), (6, 9)):
                        pos = torch.arange(a, b, device=dev)[None]
                        for c in caches:
                            c.at(a, False)
                        ref = self.model(input_ids=ids[:, a:b], position_ids=pos, past_key_values=caches[0], use_cache=True)
                        got = self(ids[:, a:b], None, pos, caches[1])
                        if not torch.equal(ref.logits, got.logits):
                            return False
            finally:
                if self.blocks is not None:
                    self.blocks.enabled = before
        return True
