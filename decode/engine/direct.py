"""The target's decode step with its decoder layers run in one C++ call (``kernels/step.cpp``): the same floats.

At one to a few positions, a small target's step on a CPU pays per operation: Gemma 3 270M runs about a
thousand small operations a token, and from Python each also pays the interpreter, the module machinery
and argument parsing, about as much again as the operations themselves. ``decoder_layers`` runs the
decoder layers' operations from C++: the same ATen operations transformers' modules call, in the same
order on the same shapes (the RMSNorms, models.blocks' quantised-block products or ``nn.Linear``, the
rotary embedding, the cache write and transformers' SDPA call), so the logits are the same floats. The
embedding, masks, final norm and output layer stay transformers' own modules and functions, called as
transformers' forward calls them; the rotary tables are the rotary module's own output, computed once for
a run of positions and read from there (checked to be its rows). The families it describes (``FAMILIES``): Gemma 3
(its norms as models.norms routes them) and Llama, Mistral, Qwen2 and Qwen3.

That the floats are the same is checked, not assumed: ``direct_step`` runs both forwards on a probe (a
prefill, then steps of one and of three positions over preallocated buffers) and compares the logits
with ``torch.equal``; any difference, or a model it does not describe (another architecture, a norm
models.norms did not route, accelerate's hooks, soft-capped attention), keeps transformers' forward,
and so does a forward while a hook sits on a module the step skips (a riding drafter's).

Attention of a few positions: ATen's SDPA on a CPU took about 13% of Gemma 3 270M's one-token step (about
230 us a layer over 257 cached keys, most of it the kernel's setup rather than arithmetic). The step's
own attention (``kernels/step.cpp``: split-key softmax attention, the keys and values read once in place)
serves a target whose layers run on a GGUF file's quantised blocks: such a target already computes with
specdec's kernels rather than transformers' float32 ones. Its transformers forward is switched to the
same function (``OWN_ATTENTION``, registered with transformers), so both forwards still give the same
floats and the probe still decides; like the blocks, only inside the engine (outside it, transformers'
SDPA). A float model keeps transformers' SDPA, so its text stays transformers' own to the last float.
The step's attention is built for AVX2 and AVX-512 (``kernels/small_attention.h``, one source) and takes up
to 16 query rows (AVX2) or 64 (AVX-512: 16 Gemma 3 270M positions) itself, each row's floats its own
whatever the width: a verification's positions attend with the floats plain decoding's one position gets,
where SDPA's change with the number of positions. With AVX-512 the blocks' products are so too (two
accumulators a position at every width), so on such a CPU a GGUF target's verification of up to 16
positions computes each with plain decoding's floats, bit for bit (tested layer by layer); the AVX2
kernels' accumulator count follows the width, so there the last bits may differ, as two summation orders do.
"""

from __future__ import annotations

import contextlib
import inspect
import weakref
from dataclasses import dataclass

import torch
from torch.utils.hooks import RemovableHandle

from specdec.models import arch
from specdec.models.blocks import MAX_ROWS  # wider forwards read float32 weights in transformers' route: they go to it

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# positions the rotary tables hold at most (DirectStep._rope): Gemma 3's two layer types' cos and sin take 4 KiB a
# position, 32 MiB at this length; positions past it are computed by the module each forward
ROPE_TABLE_MAX = 8192


@dataclass(frozen=True)
class Family:
    """How a family's decoder layers differ. ``norms``: the six norm slots (input, query, key, after
    attention, before the MLP, after the MLP), each the module's attribute name or None."""

    norms: tuple
    gemma_norm: bool  # models.norms' Gemma RMSNorm, else Llama's RMSNorm
    qk_norm: int  # 0: none, 1: after the heads' transpose (Gemma 3), 2: before it (Qwen3)
    act: str  # the config's activation: gelu_pytorch_tanh or silu

    def style(self) -> list[int]:
        return [int(self.gemma_norm), self.qk_norm, int(self.act == "gelu_pytorch_tanh")]


_LLAMA = Family(("input_layernorm", None, None, None, "post_attention_layernorm", None), False, 0, "silu")
FAMILIES = {
    "Gemma3ForCausalLM": Family(("input_layernorm", "q_norm", "k_norm", "post_attention_layernorm",
                                 "pre_feedforward_layernorm", "post_feedforward_layernorm"), True, 1, "gelu_pytorch_tanh"),
    "LlamaForCausalLM": _LLAMA,
    "MistralForCausalLM": _LLAMA,
    "Qwen2ForCausalLM": _LLAMA,
    "Qwen3ForCausalLM": Family(("input_layernorm", "q_norm", "k_norm", None, "post_attention_layernorm", None), False, 2, "silu"),
}
_CACHE: "weakref.WeakKeyDictionary[torch.nn.Module, DirectStep | None]" = weakref.WeakKeyDictionary()
OWN_ATTENTION = "specdec_step_sdpa"  # transformers' name for the step's attention (kernels/step.cpp's ``attention``)


def direct_step(model, buffers) -> "DirectStep | None":
    """The model's DirectStep, or None where it would not give transformers' logits (built and probed once).
    ``buffers(layers, capacity, device, zeroed)``: the preallocated cache the engine's forwards run over
    (decode.engine.cache's SlotBuffers), which the probe runs over too."""
    if model not in _CACHE:
        family = FAMILIES.get(type(model).__name__)
        step = DirectStep(model, family) if family is not None and _supported(model, family) else None
        _CACHE[model] = step if step is not None and _probe(model, step, buffers) else None
    return _CACHE[model]


def _probe(model, step: "DirectStep", buffers) -> bool:
    """The step gives transformers' floats: with the step's own attention in both forwards where the target's
    layers run on quantised blocks, else (or where the two would differ so) with SDPA in both."""
    if step.blocks is not None and model.config._attn_implementation == "sdpa":
        for layer in step.base.layers:  # the switch that says when (the blocks' own: inside the engine)
            layer.self_attn._specdec_step_attention = step.blocks
        model.set_attn_implementation(register_attention())
        if step.matches_hf(buffers):
            return True
        model.set_attn_implementation("sdpa")
    return step.matches_hf(buffers)


def step_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, is_causal=None, **kwargs):
    """transformers' SDPA attention function as the decode step computes it: the step's own ``attention``
    operator, which takes a few positions itself and hands the rest to SDPA exactly as transformers does.
    Only while the model's quantised blocks are active (inside the engine; outside it the model is
    transformers' float32 model, whose forward a user or a benchmark's peer gets, SDPA included); and
    anything beyond softmax(QK^T)V (dropout, soft-capping, sinks, a position bias, a paged cache) goes to
    transformers' SDPA function."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    state = getattr(module, "_specdec_step_attention", None)
    if (state is None or not state.active or dropout or kwargs.get("output_attentions") or any(kwargs.get(name) is not None
                                                          for name in ("softcap", "s_aux", "sinks", "position_bias", "cache"))):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    groups = getattr(module, "num_key_value_groups", 1)
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    return torch.ops.specdec_q.attention(query, key, value, attention_mask, groups, float(scale), bool(causal)), None


def register_attention(function=None) -> str:
    """Register ``function`` (``step_attention``) with transformers (masks built as for SDPA) under ``OWN_ATTENTION``."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(OWN_ATTENTION, function or step_attention)
    AttentionMaskInterface.register(OWN_ATTENTION, sdpa_mask)
    return OWN_ATTENTION


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

    return blocks.kernel_ready() and hasattr(torch.ops.specdec_q, "decoder_layers")


def _layers(*args):
    """kernels/step.cpp's operator (one name to reach it by, in tests too)."""
    return torch.ops.specdec_q.decoder_layers(*args)


def _supported(model, family: Family) -> bool:
    cfg, base = model.config, getattr(model, "model", None)
    act = getattr(cfg, "hidden_activation", None) or getattr(cfg, "hidden_act", None)
    if (base is None or getattr(cfg, "_attn_implementation", None) not in ("sdpa", OWN_ATTENTION) or act != family.act
            or getattr(cfg, "attn_logit_softcapping", None) is not None or getattr(cfg, "use_bidirectional_attention", False)
            or getattr(cfg, "mlp_bias", False)):
        return False
    if any(hasattr(m, "_hf_hook") for m in model.modules()):  # accelerate's offloading moves weights in its hooks
        return False
    for layer in base.layers:
        if not all(isinstance(_linear(layer, n), torch.nn.Linear) for n in LINEARS):
            return False
        for name in family.norms:
            module = _norm(layer, name)
            if (module is None) != (name is None) or (module is not None and not _norm_ok(module, family)):
                return False  # an unexpected layout, or arithmetic this step does not describe
    return _norm_ok(base.norm, family) and _op_ready()


def _linear(layer, name: str):
    return getattr(layer.self_attn, name, None) or getattr(layer.mlp, name, None)


def _norm(layer, name: str | None):
    return None if name is None else getattr(layer, name, None) or getattr(layer.self_attn, name, None)


def _norm_ok(module, family: Family) -> bool:
    if family.gemma_norm:  # routed by models.norms: its arithmetic is the one the step runs
        return getattr(module, "_specdec_norm", None) is not None
    return (type(module).__name__.endswith("RMSNorm") and "forward" not in vars(module)
            and isinstance(getattr(module, "variance_epsilon", None), float))


def _foreign(hooks) -> bool:
    """Hooks other than transformers' own output capturing (which records what ``output_hidden_states``
    returns, and runs on every forward whether asked or not)."""
    return any(not getattr(h, "__module__", "").startswith("transformers.utils.output_capturing") for h in hooks.values())


def foreign_hooks(module) -> bool:
    """``module`` carries hooks a forward that skips its call would skip: accelerate's, or anyone's but transformers'."""
    return hasattr(module, "_hf_hook") or _foreign(module._forward_hooks) or _foreign(module._forward_pre_hooks)


class DirectStep:
    def __init__(self, model, family: Family):
        self.model, self.base, self.family = model, model.model, family
        types = arch.layer_types(self.base.config)
        self.types = sorted(set(types))
        self.kinds = [self.types.index(t) for t in types]
        attn = self.base.layers[0].self_attn
        self.head_dim, self.groups, self.scaling = attn.head_dim, attn.num_key_value_groups, float(attn.scaling)
        self.causal = bool(getattr(attn, "is_causal", True))
        self.blocks = getattr(model, "_specdec_blocks", None)
        # Gemma 3's rotary tables differ by layer type; the others' serve every layer
        self.rope_by_type = "layer_type" in inspect.signature(self.base.rotary_emb.forward).parameters
        self.window = arch.sliding_window(self.base.config) if arch.SLIDING in self.types else None  # sliding layers'
        self._rope_table = None  # (positions, dtype, per type (cos, sin)); False: the module's own calls (_rope)
        self._own_causal: bool | None = None  # _causal's masks held equal to transformers' (None: not compared yet)
        # the modules whose calls the step skips: a hook registered on one later (a riding drafter's) sends the
        # forward back to transformers
        self.skipped = [model, self.base, *(m for layer in self.base.layers for m in layer.modules())]
        self._hook_count, self._hooked, self._hook_stamp = -1, False, -1
        self.enabled = True  # python_layers switches it off
        self._linears: dict[bool, tuple[list, list, list]] = {}
        self.biases = [_linear(layer, n).bias for layer in self.base.layers for n in LINEARS]
        self.norm_modules = [_norm(layer, n) for layer in self.base.layers for n in family.norms]
        self.eps = [float(getattr(m, "variance_epsilon", 0.0) or 0.0) if m is not None else 0.0 for m in self.norm_modules]
        self._norms, self._norm_versions = [], None
        self._normed = [m for m in self.norm_modules if m is not None]

    def _weights(self):
        """Per layer the seven weights (blocks where models.blocks routes the layer and its switch is on), their
        ggml types (0: dense) and input widths; per layer the six norm slots as the step reads them."""
        on = self.blocks is not None and self.blocks.active
        if on not in self._linears:
            linears, qtypes, widths = [], [], []
            for layer in self.base.layers:
                for name in LINEARS:
                    lin = _linear(layer, name)
                    found = getattr(lin, "_specdec_blocks", None) if on else None
                    linears.append(found[0] if found else lin.weight)
                    qtypes.append(found[1] if found else 0)
                    widths.append(lin.in_features)
            self._linears[on] = linears, qtypes, widths
        # the norm slots are rebuilt only when a norm's weight was replaced or written in place since
        weights = [m._parameters["weight"] for m in self._normed]  # not Module.__getattr__: a third as long
        versions = [(id(w), w._version) for w in weights]
        if versions != self._norm_versions:
            norms = []
            for m in self.norm_modules:
                if m is None:
                    norms += [None, None, None]
                elif self.family.gemma_norm:
                    scale, eps, count = m._specdec_norm
                    norms += [scale(), eps, count]  # 1 + w, renewed where the weight was written in place
                else:
                    norms += [m.weight, None, None]
            self._norms, self._norm_versions = norms, versions
        return (*self._linears[on], self._norms)

    def usable(self, input_ids: torch.Tensor, mask, model_kwargs: dict, cache) -> bool:
        """This forward is one the direct step computes as transformers would."""
        if not self.enabled or model_kwargs or input_ids.numel() > MAX_ROWS or torch.is_grad_enabled():
            return False
        if input_ids.device.type != "cpu" or (self.blocks is not None and self.blocks.suspended):
            return False
        # torch numbers every hook it registers (RemovableHandle.next_id): while no hook was registered anywhere
        # since the last look and none of the skipped modules had one, none has one now, without walking them all
        # (a third of a millisecond a forward, 2% of a Gemma 3 270M token on a CPU)
        stamp = RemovableHandle.next_id
        if self._hooked or stamp != self._hook_stamp:
            self._hook_stamp = stamp
            count = sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in self.skipped)
            if count != self._hook_count:  # hooks came or went: are any of them someone else's than transformers' own?
                self._hook_count = count
                self._hooked = any(foreign_hooks(m) for m in self.skipped)
        if self._hooked:
            return False
        layers = getattr(cache, "layers", None)
        if not layers or len(layers) != len(self.kinds) or len(self.base.layers) != len(self.kinds):
            return False  # layers dropped or swapped since the step was built (an early-exit view's)
        return all(getattr(layer, "is_initialized", False) and getattr(layer, "end", None) is not None
                                    for layer in layers)

    def _rotary(self, x, positions) -> list:
        """Each layer type's (cos, sin) at ``positions``, from transformers' rotary module."""
        rotary = self.base.rotary_emb
        return [rotary(x, positions, t) for t in self.types] if self.rope_by_type else [rotary(x, positions)] * len(self.types)

    def _rope(self, x, positions) -> list:
        """``_rotary``'s tables, read from its own output for positions 0..n-1 computed once (and again, twice as
        long, when a position passes n): the module's dozen operations and its call each forward were a fortieth of
        a Gemma 3 270M token on a CPU. Its arithmetic is elementwise (a position times each frequency, then cos and
        sin), so a position's row does not depend on the positions computed beside it; that is checked, not
        assumed: a table whose rows differ from the module's own calls at a few positions is not used again."""
        if self._rope_table is False or positions.dim() != 2:
            return self._rotary(x, positions)
        top = int(positions.max()) + 1
        if top > ROPE_TABLE_MAX:
            return self._rotary(x, positions)
        table = self._rope_table
        if table is None or top > table[0] or table[1] != x.dtype:
            n = min(ROPE_TABLE_MAX, max(1024, 2 * top))
            whole = self._rotary(x, torch.arange(n)[None])
            table = (n, x.dtype, [(cos[0], sin[0]) for cos, sin in whole])
            probes = [torch.tensor([[0]]), torch.tensor([[n - 1]]), torch.arange(5, 13)[None], torch.tensor([[n // 2, 3, n - 2]])]
            if not all(torch.equal(read[0], want[0]) and torch.equal(read[1], want[1]) for p in probes
                       for read, want in zip(self._read(table, p), self._rotary(x, p))):
                self._rope_table = False
                return self._rotary(x, positions)
            self._rope_table = table
        return self._read(table, positions)

    @staticmethod
    def _read(table, positions) -> list:
        return [(cos[positions], sin[positions]) for cos, sin in table[2]]

    def _sees_all(self, cache, t: int = 1) -> bool:
        """The next ``t`` positions' keys (the cache's slots and their own) all lie within the sliding window, if any."""
        layer = cache.layers[0]
        return self.window is None or layer.end + t - layer.offset <= self.window

    @staticmethod
    def _causal(positions, cache) -> torch.Tensor:
        """The causal mask of a segment after slots without holes, where no sliding window hides a key: key slot j
        visible to the query at position p iff j <= p, [B, 1, T, S] booleans."""
        slots = torch.arange(cache.layers[0].end + positions.shape[1], device=positions.device)
        return (slots[None, None, None, :] <= positions[:, None, :, None])

    def _masks(self, mask, x, positions, cache, own: bool = False) -> list:
        """Each layer type's mask as transformers' forward hands it to its layers: the one given (per type, or one
        for all), or, where none is given, each type's own causal mask built by transformers' functions; none at
        all for one position under the step's own attention (``own``)."""
        if isinstance(mask, dict):
            return [mask[t] for t in self.types]
        if mask is not None:
            return [mask for _ in self.types]
        if own and x.shape[1] == 1 and self._sees_all(cache):
            # The engine passes no mask only for rows without holes (KVState's causal path), so one position within
            # any sliding window sees every key: the step's own attention computes that without a mask, to the
            # floats it gives under transformers' mask of all visible keys (a zero added to each score), which
            # transformers' mask functions took a fifth of a millisecond a forward to build or decline
            return [None for _ in self.types]
        from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

        kwargs = {"config": self.base.config, "inputs_embeds": x, "attention_mask": None, "past_key_values": cache,
                  "position_ids": positions}
        make = {arch.FULL: create_causal_mask, arch.SLIDING: create_sliding_window_causal_mask}
        # A verification's few positions under the step's own attention, the cache from its first slot on and within
        # any sliding window: every layer type's mask is the plain causal one, built here in a few microseconds where
        # transformers' functions took 0.3-0.5 ms (4 and 8 Gemma 3 positions). Held equal to theirs at the first such
        # forward, else theirs from then on
        if own and self._own_causal is not False and cache.layers[0].offset == 0 and self._sees_all(cache, x.shape[1]):
            causal = self._causal(positions, cache)
            if self._own_causal is None:
                theirs = [make[t](**kwargs) for t in self.types]
                self._own_causal = all(m is not None and m.dtype == torch.bool and torch.equal(m, causal) for m in theirs)
                return theirs
            return [causal for _ in self.types]
        return [make[t](**kwargs) for t in self.types]

    def __call__(self, input_ids: torch.Tensor, mask, positions: torch.Tensor, cache, hidden: bool | tuple = False):
        """Logits [B, T, V] of a segment after the cache (written at the cache's write offset), as
        transformers' forward with ``attention_mask=mask`` (None, one mask, or one per layer type) returns them;
        with ``hidden``, also its ``hidden_states`` as ``output_hidden_states`` gives them (the embeddings, each
        layer's output but the last, the last one's after the final norm), those not in ``hidden`` (a tuple of
        indices) None."""
        from transformers.modeling_outputs import CausalLMOutputWithPast

        x = self.base.embed_tokens(input_ids)
        own = self.model.config._attn_implementation == OWN_ATTENTION and self.blocks is not None and self.blocks.active
        masks = self._masks(mask, x, positions, cache, own)
        tables = self._rope(x, positions)
        rope = [table for pair in tables for table in pair]
        layers = cache.layers
        start, offset, t = layers[0].end, layers[0].offset, input_ids.shape[1]
        linears, qtypes, widths, norms = self._weights()
        keys, values = [layer.keys for layer in layers], [layer.values for layer in layers]
        # a drafter that reads the target's hidden states (EAGLE, a block drafter) gets them from a call per run of
        # layers between the states it reads (``hidden``: their indices; True: all): the same operations in the
        # same order, so the same floats as transformers' forward and as one call
        n_layers = len(self.kinds)
        wanted = range(1, n_layers) if hidden is True else [i % (n_layers + 1) for i in hidden] if hidden else ()
        cuts = sorted({i for i in wanted if 0 < i < n_layers} | {n_layers})
        states = [None] * n_layers
        states[0] = x
        a = 0
        per_linear, per_norm = len(LINEARS), len(self.family.norms)  # the per-layer lists' entries a layer
        for b in cuts:
            lin, nrm = slice(per_linear * a, per_linear * b), slice(per_norm * a, per_norm * b)
            x = _layers(x, linears[lin], self.biases[lin], qtypes[lin], widths[lin], norms[3 * nrm.start: 3 * nrm.stop],
                        self.eps[nrm], keys[a:b], values[a:b], rope, masks, self.kinds[a:b], self.family.style(),
                        self.head_dim, self.groups, self.scaling, self.causal, start, offset, own)
            if b < n_layers:
                states[b] = x
            a = b
        for layer in layers:
            layer.end = start + t
        x = self.base.norm(x)
        logits = arch.output_logits(self.model, x)
        if not hidden:
            return CausalLMOutputWithPast(logits=logits)
        return CausalLMOutputWithPast(logits=logits, hidden_states=(*states, x))

    def matches_hf(self, buffers) -> bool:
        """Both forwards on a probe over preallocated buffers (a 5-token prefill by transformers, then segments
        of one and three positions, then two under a mask with a hole, as the engine passes masks) give equal
        logits (and, for the three positions, equal hidden states), with the blocks' switch on and off."""
        cfg, dev = self.model.config, next(self.model.parameters()).device
        gen = torch.Generator().manual_seed(0)
        ids = torch.randint(0, cfg.vocab_size, (1, 11), generator=gen).to(dev)
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
                    for a, b in ((5, 6), (6, 9), (9, 11)):
                        pos = torch.arange(a, b, device=dev)[None]
                        for c in caches:
                            c.at(a, False)
                        mask = self._probe_mask(a, b, dev) if a == 9 else None
                        hidden = a == 6  # a drafter's forward: the hidden states too, from a call per layer
                        ref = self.model(input_ids=ids[:, a:b], attention_mask=mask, position_ids=pos,
                                         past_key_values=caches[0], use_cache=True, output_hidden_states=hidden)
                        got = self(ids[:, a:b], mask, pos, caches[1], hidden)
                        if not torch.equal(ref.logits, got.logits):
                            return False
                        if hidden and not (len(ref.hidden_states) == len(got.hidden_states) and all(
                                torch.equal(r, g) for r, g in zip(ref.hidden_states, got.hidden_states))):
                            return False
            finally:
                if self.blocks is not None:
                    self.blocks.enabled = before
        return True

    def _probe_mask(self, a: int, b: int, dev) -> "torch.Tensor | dict":
        """An additive mask over slots [0, b) for the positions a..b-1 with slot 2 a hole, in the form the
        engine's cache passes it (one per layer type where the model mixes them)."""
        from specdec.models.masks import additive_mask

        visible = torch.ones(b - a, b, dtype=torch.bool, device=dev).tril_(a)
        visible[:, 2] = False
        mask = additive_mask(visible[None, None], self.base.embed_tokens.weight.dtype)
        return {t: mask for t in self.types} if len(self.types) > 1 else mask
