"""Drafts in other tools' layouts: read them as specdec heads, write specdec heads in them.

Layouts (each read from its own loader's source, which decides what a field means):
  speculators  config.json with ``speculators_model_type: "eagle3"``, ``transformer_layer_config`` (a
               Llama/Qwen3 config of the draft's layer), ``draft_vocab_size``,
               ``eagle_aux_hidden_state_layer_ids``, ``norm_before_residual`` / ``norm_before_fc`` /
               ``fc_norm`` / ``norm_output`` and ``speculators_config`` (algorithm, proposal methods with
               ``speculative_tokens``, verifier ``name_or_path``); model.safetensors with ``fc.weight``,
               ``layers.0.*`` (q/k/v read 2H: the normalised embedding beside the normalised fused feature,
               plus ``hidden_norm``), ``norm.weight``, ``lm_head.weight`` (draft vocabulary rows),
               ``embed_tokens.weight`` and, for a reduced vocabulary, ``d2t`` (int64 offsets: target id =
               draft id + d2t[draft id]) and ``t2d`` (bool mask over the target vocabulary).
               (speculators 0.9.0: models/eagle3/{config,core,model_definitions}.py, model.py
               DraftVocabMixin, train/vocab_mapping.py.) speculators 0.9.0 has no EAGLE-1 or Medusa type.
  eagle3       EAGLE-3 as SafeAILab/EAGLE (eagle/model/cnets.py) and SpecForge
               (specforge/modeling/draft/llama3_eagle.py, LlamaForCausalLMEagle3) write it: a Llama config
               with ``draft_vocab_size``, the same tensors with the layer under ``midlayer.*``. SpecForge's
               own ``norm_output`` (default true) means "norm before lm_head" (compute_logits), not
               speculators' "feed the normalised state back"; ``fc_norm`` is per-layer norms before fc.
  eagle        EAGLE-1 (SafeAILab/EAGLE eagle/model/cnets1.py): ``fc`` (bias per config ``bias``, default
               true) on concat(embed(token), feature), ``layers.0.*`` of a Llama layer WITHOUT its input
               norm (layer index 0 skips it), no final norm, the target's LM head.
  medusa-hf    FasterDecoding/Medusa: config ``medusa_num_heads`` / ``medusa_num_layers`` and
               ``medusa_lm_head.safetensors`` with ``{head}.{layer}.linear.{weight,bias}`` and
               ``{head}.{num_layers}.weight``.
  medusa-vllm  vLLM's MedusaModel (vllm/model_executor/models/medusa.py): ``blocks.{h}.layers.{l}.weight``
               (+ ``.bias`` when ``medusa_fc_bias``), ``lm_heads.{h}.weight`` (one ``lm_head`` with
               ``original_lm_head``); a truncated vocabulary (``token_map``) is refused.

specdec's own EAGLE heads are not these architectures (their layer normalises fc's output, EAGLE-1's
does not; their EAGLE-3 variant fuses layers before fc and has no final norm or LM head of its own),
so they cannot be written in a published layout exactly. ``train-heads --kind eagle --layout
published`` trains the published architecture (EAGLE-1, or EAGLE-3 with ``--eagle3``) as a specdec head
(``Eagle1Head`` / ``Eagle3Head``), which runs in specdec's EAGLE drafter and exports exactly.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from specdec.models.artifacts import load_weights, read_config, write_json
from specdec.models.errors import SpecdecError, UsageError
from specdec.models.layouts import SPECULATORS_VERSION, _weight_keys, foreign_kind, foreign_layout  # noqa: F401
from specdec.models.heads import DraftLayer, EagleHead, MedusaHeads, _RMSNorm, layer_config, layer_hf_config, register_rope, soft_ce

LAYOUTS = ("eagle1", "eagle3")  # published EAGLE architectures specdec trains and runs as heads


# ---------------------------------------------------------------------------------------------
# the draft layer's configuration (its shape: models.heads.layer_config)


def default_aux_layers(num_layers: int) -> list[int]:
    """Three distinct target layers whose inputs EAGLE-3 fuses: EAGLE's and vLLM's (2, n//2, n-3) where
    those are distinct, else spread over the layers (the published loaders fuse exactly three)."""
    ids = [2, num_layers // 2, num_layers - 3]
    if len(set(ids)) == 3 and min(ids) >= 0:
        return ids
    if num_layers < 3:
        raise UsageError(f"EAGLE-3 fuses three target layers; the target has {num_layers}")
    return sorted({round(i * (num_layers - 1) / 2) for i in range(3)})


# ---------------------------------------------------------------------------------------------
# EAGLE-1 and EAGLE-3 as published, run by specdec's EAGLE drafter


class Eagle1Head(EagleHead):
    """EAGLE-1 as SafeAILab/EAGLE (cnets1.py) and vLLM (llama_eagle.py) run it: specdec's EagleHead
    without the input norm of layer 0, fc's bias as the checkpoint says; features are the target's
    last (normalised) hidden states, logits its LM head."""

    layout = "eagle1"

    def __init__(self, layer: dict, fc_bias: bool = True, own_embed: bool = False, vocab: int | None = None, **train):
        super().__init__(layer_hf_config(layer), None, **{k: v for k, v in train.items() if k in ("noise", "ce_weight", "reg_weight", "unroll")})
        self.layer_cfg, self.fc_bias = dict(layer), bool(fc_bias)
        self.layer.input_layernorm = nn.Identity()
        if not fc_bias:
            self.fc = nn.Linear(2 * layer["hidden_size"], layer["hidden_size"], bias=False)
        self.embed_tokens = nn.Embedding(vocab, layer["hidden_size"]) if own_embed else None

    def hparams(self) -> dict:
        return {**super().hparams(), "layout": self.layout, "layer": self.layer_cfg, "fc_bias": self.fc_bias,
                "own_embed": self.embed_tokens is not None}

    def entry(self, tokens, feats):
        if self.embed_tokens is None:
            return super().entry(tokens, feats)
        return self.fc(torch.cat([self.embed_tokens(tokens).to(feats.dtype), feats], dim=-1))


class Eagle3Layer(DraftLayer):
    """The EAGLE-3 draft layer: its input is concat(embedding, feature) [.., 2H]; the embedding goes
    through ``input_layernorm``, the feature through ``hidden_norm``, q/k/v read both; the residual is
    the feature (normalised with ``norm_before_residual``). Qwen3 layers add per-head q/k norms."""

    def __init__(self, layer: dict, norm_before_residual: bool = False):
        h, nh, kvh, d = layer["hidden_size"], layer["num_attention_heads"], layer["num_key_value_heads"], layer["head_dim"]
        super().__init__(h, layer["intermediate_size"], nh, kvh, d, layer["rms_norm_eps"])
        bias, mlp_bias = layer.get("attention_bias", False), layer.get("mlp_bias", False)
        a, m = self.self_attn, self.mlp
        a.q_proj, a.k_proj, a.v_proj = (nn.Linear(2 * h, n * d, bias=bias) for n in (nh, kvh, kvh))
        a.o_proj = nn.Linear(nh * d, h, bias=bias)
        m.gate_proj, m.up_proj = (nn.Linear(h, layer["intermediate_size"], bias=mlp_bias) for _ in range(2))
        m.down_proj = nn.Linear(layer["intermediate_size"], h, bias=mlp_bias)
        self.hidden_norm = _RMSNorm(h, layer["rms_norm_eps"])
        if layer.get("model_type") == "qwen3":
            a.q_norm, a.k_norm = _RMSNorm(d, layer["rms_norm_eps"]), _RMSNorm(d, layer["rms_norm_eps"])
        self.norm_before_residual = bool(norm_before_residual)

    def forward(self, x, cos, sin, mask, store=None):
        from specdec.models.heads import _rope

        b, t, two_h = x.shape
        a, d = self.self_attn, self.head_dim
        emb, hid = x.split(two_h // 2, dim=-1)
        normed = self.hidden_norm(hid)
        residual = normed if self.norm_before_residual else hid
        inp = torch.cat([self.input_layernorm(emb), normed], dim=-1)
        bias = torch.cat([a.q_proj.bias, a.k_proj.bias, a.v_proj.bias]) if a.q_proj.bias is not None else None
        qkv = F.linear(inp, self._fused("qkv", a.q_proj, a.k_proj, a.v_proj), bias).view(b, t, -1, d)
        q, k, v = qkv.split([self.heads, self.kv_heads, self.kv_heads], dim=2)
        if hasattr(a, "q_norm"):
            q, k = a.q_norm(q), a.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        q, k = _rope(q, cos, sin), _rope(k, cos, sin)
        if store is not None:
            k, v = store(k, v)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=self.heads != self.kv_heads)
        x = residual + a.o_proj(out.transpose(1, 2).reshape(b, t, self.heads * d))
        m, y = self.mlp, self.post_attention_layernorm(x)
        return x + m.down_proj(F.silu(m.gate_proj(y)) * m.up_proj(y))


class _Fuse:
    """What the EAGLE drafter calls ``heads.fuse``: the concatenated target layers -> the feature."""

    def __init__(self, head: "Eagle3Head"):
        self.head = head

    @property
    def weight(self):
        return self.head.fc.weight

    def __call__(self, x):
        return self.head.fuse_concat(x)


class Eagle3Head(EagleHead):
    """EAGLE-3 as speculators (Eagle3DraftModel), vLLM (llama_eagle3.py), SpecForge and SafeAILab/EAGLE
    run it. Parameter names are speculators' (``fc``, ``layers.0.*``, ``norm``, ``lm_head``, ``input_norm``,
    ``fc_norm.{i}``, ``embed_tokens``); ``draft_ids`` [N] are the target ids of the LM head's rows (a
    reduced draft vocabulary; absent for the full one).

    feature = fc(concat(target layers ``feature_layers``)) (after ``input_norm`` / ``fc_norm`` if set);
    a step maps (token, feature) to the layer's output h, fed back as the next feature (normalised
    first with ``norm_output``, speculators' Eagle 3.1 meaning); logits = lm_head(norm(h)) (no norm
    with ``logits_norm`` false: SpecForge's ``norm_output: false``).
    """

    layout = "eagle3"

    def __init__(self, layer: dict, feature_layers: list[int], target_hidden: int | None = None, vocab: int | None = None,
                 draft_ids: torch.Tensor | None = None, norm_before_residual: bool = False, norm_before_fc: bool = False,
                 fc_norm: bool = False, norm_output: bool = False, logits_norm: bool = True, own_embed: bool = False,
                 noise: float = 0.0, unroll: int = 7, decay: float = 0.8, **_):
        nn.Module.__init__(self)
        h = layer["hidden_size"]
        th = int(target_hidden or h)
        n = len(feature_layers)
        self.layer_cfg = dict(layer)
        self.feature_layers = [int(i) for i in feature_layers]
        self.noise, self.unroll, self.decay, self.ce_weight, self.reg_weight = noise, unroll, decay, 1.0, 0.0
        self.norm_before_residual, self.norm_before_fc, self.fc_norm_on = bool(norm_before_residual), bool(norm_before_fc), bool(fc_norm)
        self.norm_output, self.logits_norm = bool(norm_output), bool(logits_norm)
        self.target_vocab = int(vocab) if vocab is not None else None
        self.fc = nn.Linear(n * th, h, bias=False)
        self.input_norm = _RMSNorm(n * th, layer["rms_norm_eps"]) if norm_before_fc else None
        self.fc_norm = nn.ModuleList(_RMSNorm(th, layer["rms_norm_eps"]) for _ in range(n)) if fc_norm else None
        self.layers = nn.ModuleList([Eagle3Layer(layer, norm_before_residual)])
        self.norm = _RMSNorm(h, layer["rms_norm_eps"])
        size = len(draft_ids) if draft_ids is not None else vocab
        self.lm_head = nn.Linear(h, int(size), bias=False)
        if draft_ids is not None:
            self.register_buffer("draft_ids", torch.as_tensor(draft_ids, dtype=torch.long).clone())
        else:
            self.draft_ids = None
        self.embed_tokens = nn.Embedding(vocab, h) if own_embed else None
        register_rope(self, layer_hf_config(layer), layer["head_dim"], layer["max_position_embeddings"] + 64)
        self._target = None

    @property
    def layer(self):
        return self.layers[0]

    @property
    def fuse(self):
        return _Fuse(self)

    def attach(self, target, init_from_lm_head: bool = False):
        super().attach(target)
        if init_from_lm_head:  # EAGLE-3 starts its LM head from the target's (its draft-vocabulary rows)
            w = target.get_output_embeddings().weight
            with torch.no_grad():
                self.lm_head.weight.copy_(w if self.draft_ids is None else w[self.draft_ids.to(w.device)])
        return self

    def hparams(self) -> dict:
        return {"layout": self.layout, "layer": self.layer_cfg, "feature_layers": self.feature_layers,
                "target_hidden_size": self.fc.in_features // len(self.feature_layers),
                "draft_vocab_size": self.lm_head.out_features, "reduced_vocab": self.draft_ids is not None,
                "norm_before_residual": self.norm_before_residual, "norm_before_fc": self.norm_before_fc, "fc_norm": self.fc_norm_on,
                "norm_output": self.norm_output, "logits_norm": self.logits_norm, "own_embed": self.embed_tokens is not None,
                "unroll": self.unroll, "noise": self.noise}

    def fuse_concat(self, x):
        if self.input_norm is not None:
            x = self.input_norm(x)
        if self.fc_norm is not None:
            x = torch.cat([norm(c) for norm, c in zip(self.fc_norm, x.chunk(len(self.fc_norm), dim=-1))], dim=-1)
        return self.fc(x)

    def features(self, hidden_states):
        return self.fuse_concat(torch.cat([hidden_states[i] for i in self.feature_layers], dim=-1))

    def embed(self, tokens):
        return (self._target[0] if self.embed_tokens is None else self.embed_tokens)(tokens)

    def entry(self, tokens, feats):
        return torch.cat([self.embed(tokens).to(feats.dtype), feats], dim=-1)

    def run(self, x, mask, position_ids, store=None):
        out = self.layer(x, *self.rope(position_ids), mask, store)
        return self.norm(out) if self.norm_output else out

    def draft_logits(self, f):
        """[.., N] logits over the draft vocabulary."""
        if self.logits_norm and not self.norm_output:
            f = self.norm(f)
        return self.lm_head(f.to(self.lm_head.weight.dtype))

    def lm_logits(self, f):
        logits = self.draft_logits(f)
        if self.draft_ids is None:
            return logits
        full = logits.new_full((*logits.shape[:-1], self.target_vocab), float("-inf"))
        full[..., self.draft_ids] = logits
        return full

    def forward(self, hidden_states, input_ids, target_logits):
        """EAGLE-3's training-time test: cross-entropy of each unrolled step against the target's
        distribution over the draft vocabulary (no feature regression)."""
        fh = self.unrolled(hidden_states, input_ids, self.unroll, noise=self.noise)
        t = input_ids.shape[1]
        loss, parts = 0.0, {}
        for u in range(self.unroll):
            valid = t - 1 - u
            if valid <= 0:
                break
            log_q = F.log_softmax(self.draft_logits(fh[u, :, :valid]).float(), -1)
            if isinstance(target_logits, tuple):  # a teacher cache's top-k over the draft vocabulary (train.teacher)
                ce = soft_ce(log_q, target_logits, 1 + u, valid)
            else:
                tl = target_logits[:, 1 + u : 1 + u + valid].float()
                if self.draft_ids is not None:
                    tl = tl[..., self.draft_ids]
                ce = -(F.softmax(tl, -1) * log_q).sum(-1).mean()
            loss = loss + self.decay**u * ce
            parts[f"ce{u}"] = float(ce.detach())
        return loss, parts


def build_published_eagle(target, hp: dict):
    """``build_heads``' eagle kind with ``layout``: the published EAGLE-1 / EAGLE-3 architecture as a
    specdec head (rebuilt from an artifact's config when ``hp`` is one)."""
    layout = hp.get("layout")
    if layout == "published":
        layout = "eagle3" if (hp.get("eagle3") or hp.get("feature_layers")) else "eagle1"
    layer = hp.get("layer") or layer_config(target.config)
    vocab = target.config.vocab_size
    if layout == "eagle1":
        return Eagle1Head(layer, fc_bias=hp.get("fc_bias", True), own_embed=bool(hp.get("own_embed")), vocab=vocab,
                          noise=float(hp.get("noise", 0.2)), unroll=int(hp.get("unroll") or 1))
    if layout != "eagle3":
        raise UsageError(f"layout must be published, eagle1 or eagle3, not {layout!r}")
    n = target.config.num_hidden_layers
    layers = hp.get("feature_layers")
    layers = default_aux_layers(n) if layers in (None, "eagle3") else [int(i) for i in layers]
    if len(set(layers)) != len(layers) or min(layers) < 0 or max(layers) >= n:
        raise UsageError(f"EAGLE-3 feature layers must be distinct target layers 0..{n - 1}, not {layers}")
    draft_ids = hp.get("draft_ids")  # a reduced vocabulary being trained: models.vocab's d2t without its unk row
    if draft_ids is None and hp.get("reduced_vocab"):  # rebuilt from an artifact: the buffer's size comes from its config
        draft_ids = torch.zeros(int(hp["draft_vocab_size"]), dtype=torch.long)
    return Eagle3Head(layer, layers, target_hidden=hp.get("target_hidden_size") or target.config.hidden_size, vocab=vocab,
                      draft_ids=draft_ids, norm_before_residual=bool(hp.get("norm_before_residual")),
                      norm_before_fc=bool(hp.get("norm_before_fc")), fc_norm=bool(hp.get("fc_norm")),
                      norm_output=bool(hp.get("norm_output")), logits_norm=hp.get("logits_norm", True) is not False,
                      own_embed=bool(hp.get("own_embed")), noise=float(hp.get("noise", 0.0)), unroll=int(hp.get("unroll") or 7))


# ---------------------------------------------------------------------------------------------
# import: a published layout -> a specdec head on the target


def _tensors(folder: Path, name: str | None = None) -> dict:
    if name is not None and (folder / name).is_file():
        from safetensors.torch import load_file

        return load_file(str(folder / name))
    if not (folder / "model.safetensors").is_file() and not (folder / "model.safetensors.index.json").is_file():
        pickled = [p.name for p in folder.iterdir() if p.suffix in (".bin", ".pt", ".pth")]
        if pickled:
            raise SpecdecError(f"{folder} holds only pickled weights ({', '.join(sorted(pickled))}); specdec reads safetensors "
                               "only: convert them (safetensors.torch.save_file of the state dict) first")
        raise SpecdecError(f"{folder} has no model.safetensors")
    return load_weights(folder)


def _check(folder: Path, what: str, target, hidden: int, vocab: int) -> None:
    tc = target.config
    if hidden != tc.hidden_size or vocab != tc.vocab_size:
        raise SpecdecError(f"{folder}: this {what} draft has hidden size {hidden} and vocabulary {vocab}; the target has "
                           f"{tc.hidden_size} and {tc.vocab_size}")


def _load(head: nn.Module, state: dict, folder: Path, what: str) -> None:
    missing, unexpected = head.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.startswith("rope_")]
    if missing or unexpected:
        raise SpecdecError(f"{folder}: the {what} checkpoint does not match its config (missing {missing[:4]}, unexpected "
                           f"{sorted(unexpected)[:4]})")


def _own_embed(state: dict, target) -> bool:
    """Keep a checkpoint's embedding only where it differs from the target's (vLLM shares the target's
    where the two are the same; the draft's own loaders read the checkpoint's)."""
    w = state.get("embed_tokens.weight")
    if w is None:
        return False
    t = target.get_input_embeddings().weight
    # compared at the checkpoint's precision: a target's embedding saved in float32 is still the target's
    if w.shape == t.shape and torch.equal(w, t.detach().to("cpu", w.dtype)):
        del state["embed_tokens.weight"]
        return False
    return True


def _d2t_ids(state: dict, size: int, vocab: int) -> torch.Tensor | None:
    """Target ids of the draft rows from ``d2t`` offsets (EAGLE-3, speculators, vLLM, SGLang all read
    target = draft + d2t[draft]); None for the whole vocabulary in order."""
    d2t = state.pop("d2t", None)
    state.pop("t2d", None)
    if size == vocab and (d2t is None or not bool(d2t.any())):
        return None
    if d2t is None:
        raise SpecdecError(f"a draft vocabulary of {size} tokens (target {vocab}) needs a d2t map, and the checkpoint has none")
    ids = torch.arange(size) + d2t.long()
    if int(ids.min()) < 0 or int(ids.max()) >= vocab or len(set(ids.tolist())) != size:
        raise SpecdecError(f"d2t maps draft ids outside the target vocabulary of {vocab} or twice onto one token")
    return ids


def _eagle3(folder: Path, cfg: dict, target, layout: str):
    state = _tensors(folder)
    if layout == "speculators":
        layer_cfg = dict(cfg.get("transformer_layer_config") or {})
        if int(layer_cfg.get("num_hidden_layers", 1)) != 1:
            raise SpecdecError(f"{folder}: a {layer_cfg.get('num_hidden_layers')}-layer EAGLE-3 draft; specdec runs one-layer drafts")
        if layer_cfg.get("model_type", "qwen3") not in ("llama", "qwen3"):
            raise SpecdecError(f"{folder}: draft layer of type {layer_cfg.get('model_type')!r}; speculators and specdec run llama and qwen3")
        layer_cfg.setdefault("model_type", "qwen3")  # speculators' default transformer_layer_config is Qwen3Config
        aux = cfg.get("eagle_aux_hidden_state_layer_ids")
        flags = {k: bool(cfg.get(k)) for k in ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output")}
        logits_norm = True
    else:
        layer_cfg = dict(cfg)
        if int(cfg.get("num_hidden_layers", 1)) != 1:
            raise SpecdecError(f"{folder}: a {cfg.get('num_hidden_layers')}-layer EAGLE-3 draft; specdec runs one-layer drafts")
        aux = (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids") or cfg.get("eagle_aux_hidden_state_layer_ids")
        if (cfg.get("eagle_config") or {}).get("use_aux_hidden_state") is False:
            raise SpecdecError(f"{folder}: an EAGLE-3 draft without auxiliary hidden states (use_aux_hidden_state false) is not supported")
        # SpecForge (llama3_eagle.py): norm_output (default true) = norm before the LM head; fc_norm per layer
        flags = {"norm_before_residual": bool(cfg.get("norm_before_residual")), "norm_before_fc": False,
                 "fc_norm": bool(cfg.get("fc_norm")), "norm_output": False}
        logits_norm = cfg.get("norm_output", True) is not False
        state = {("layers.0." + k[len("midlayer."):] if k.startswith("midlayer.") else k): v for k, v in state.items()}
    layer = layer_config(layer_cfg)
    n = target.config.num_hidden_layers
    aux = [int(i) for i in aux] if aux else default_aux_layers(n)
    if max(aux) >= n or min(aux) < 0:
        raise SpecdecError(f"{folder}: EAGLE-3 layer ids {aux} are not inputs of the target's {n} layers")
    if state["fc.weight"].shape[1] != len(aux) * target.config.hidden_size:
        raise SpecdecError(f"{folder}: fc reads {state['fc.weight'].shape[1]} features, not {len(aux)} target layers of "
                           f"{target.config.hidden_size}")
    _check(folder, "EAGLE-3", target, layer["hidden_size"], int(layer_cfg.get("vocab_size") or target.config.vocab_size))
    size = int(cfg.get("draft_vocab_size") or state["lm_head.weight"].shape[0])
    ids = _d2t_ids(state, size, target.config.vocab_size)
    for k in ("verifier_lm_head.weight", "verifier_norm.weight"):
        state.pop(k, None)
    head = Eagle3Head(layer, aux, target_hidden=target.config.hidden_size, vocab=target.config.vocab_size, draft_ids=ids,
                      logits_norm=logits_norm, own_embed=_own_embed(state, target), **flags)
    if ids is not None:
        state["draft_ids"] = ids
    _load(head, state, folder, "EAGLE-3")
    return head


def _dflash(folder: Path, cfg: dict, target):
    """A speculators ``dflash`` checkpoint as specdec's block drafter of the published layout (``models.block``)."""
    from specdec.models.block import BlockHead
    from specdec.models.vocab import DraftVocab

    tl = dict(cfg.get("transformer_layer_config") or {})
    vocab = int(tl.get("vocab_size") or target.config.vocab_size)
    _check(folder, "DFlash", target, int(cfg.get("target_hidden_size") or tl.get("hidden_size") or 0), vocab)
    if int(tl.get("hidden_size") or 0) != target.config.hidden_size:
        raise SpecdecError(f"{folder}: this DFlash draft's layers are {tl.get('hidden_size')} wide and the target's "
                           f"{target.config.hidden_size}; specdec's block drafter keeps the target's width")
    unsupported = [what for what, on in (
        ("sample_from_anchor (a drafted root slot)", cfg.get("sample_from_anchor")),
        ("sliding-window draft layers", "sliding_attention" in (tl.get("layer_types") or [])),
        ("attention or MLP biases", tl.get("attention_bias") or tl.get("mlp_bias")),
        ("an activation other than SiLU", (tl.get("hidden_act") or "silu") != "silu")) if on]
    if unsupported or cfg.get("mask_token_id") is None or not cfg.get("aux_hidden_state_layer_ids"):
        raise SpecdecError(f"{folder}: this DFlash draft has {', '.join(unsupported) or 'no mask token or target layers'}, "
                           "which specdec's block drafter does not run")
    state = _tensors(folder)
    for name in ("verifier_lm_head.weight", "verifier_norm.weight", "embed_tokens.weight"):
        state.pop(name, None)  # the target's own weights (speculators reloads them from the verifier too)
    size = int(cfg.get("draft_vocab_size") or vocab)
    ids = _d2t_ids(state, size, vocab)
    rows = state.pop("lm_head.weight", None)
    state["fuse.weight"], state["context_norm.weight"] = state.pop("fc.weight"), state.pop("hidden_norm.weight")
    layer = layer_config(tl)
    head = BlockHead(target.config, int(cfg["block_size"]) - 1, int(tl.get("num_hidden_layers") or 1),
                     [int(i) for i in cfg["aux_hidden_state_layer_ids"]], layout="published",
                     mask_token_id=int(cfg["mask_token_id"]), layer=layer, own_head=None if rows is None else rows.shape[0])
    if rows is not None:
        state["lm_head.weight"] = rows
    elif ids is not None:
        raise SpecdecError(f"{folder}: a draft vocabulary of {size} tokens needs the checkpoint's lm_head rows, and it has none")
    if ids is not None:  # the rows' target ids, then a stand-in for the rest (never drafted: no row of its own)
        drafted = set(ids.tolist())
        standin = next(i for i in range(vocab) if i not in drafted)
        head.set_vocab(DraftVocab(torch.cat([ids, torch.tensor([standin])]), vocab))
    _load(head, state, folder, "DFlash")
    return head


def _eagle1(folder: Path, cfg: dict, target):
    state = _tensors(folder)
    if int(cfg.get("num_hidden_layers", 1)) != 1:
        raise SpecdecError(f"{folder}: a {cfg.get('num_hidden_layers')}-layer EAGLE draft; specdec runs one-layer drafts")
    if "fuse.weight" in state:
        raise SpecdecError(f"{folder}: specdec's own EAGLE-3 variant written before published layouts existed; decode the "
                           "specdec artifact it came from instead")
    layer = layer_config(cfg)
    _check(folder, "EAGLE", target, layer["hidden_size"], int(cfg.get("vocab_size") or target.config.vocab_size))
    # EAGLE's loader (cnets1.py) has no input norm in layer 0: a checkpoint's is not read
    state.pop("layers.0.input_layernorm.weight", None)
    state = {("decoder." + k if k.startswith("layers.") else k): v for k, v in state.items() if not k.startswith("lm_head")}
    head = Eagle1Head(layer, fc_bias="fc.bias" in state, own_embed=_own_embed(state, target), vocab=target.config.vocab_size)
    _load(head, state, folder, "EAGLE")
    return head


def _medusa(folder: Path, cfg: dict, target, layout: str):
    hidden, vocab = int(cfg.get("hidden_size") or target.config.hidden_size), int(cfg.get("vocab_size") or target.config.vocab_size)
    _check(folder, "Medusa", target, hidden, vocab)
    out = {}
    if layout == "medusa-hf":
        n, layers = int(cfg["medusa_num_heads"]), int(cfg.get("medusa_num_layers", 1))
        src = _tensors(folder, "medusa_lm_head.safetensors")
        src = {k[len("medusa_head."):] if k.startswith("medusa_head.") else k: v for k, v in src.items()}
        for i in range(n):
            for j in range(layers):
                for p in ("weight", "bias"):
                    out[f"heads.{i}.{j}.linear.{p}"] = src[f"{i}.{j}.linear.{p}"]
            out[f"heads.{i}.{layers}.weight"] = src[f"{i}.{layers}.weight"]
    else:
        n, layers = int(cfg["num_heads"]), int(cfg.get("num_hidden_layers", 1))
        if int(cfg.get("truncated_vocab_size") or vocab) != vocab:
            raise SpecdecError(f"{folder}: a Medusa draft over a truncated vocabulary (token_map) is not supported")
        src = {k.replace("medusa_heads.", ""): v for k, v in _tensors(folder).items()}
        for i in range(n):
            for j in range(layers):
                w = src[f"blocks.{i}.layers.{j}.weight"]
                out[f"heads.{i}.{j}.linear.weight"] = w
                # vLLM reads the bias only with medusa_fc_bias (else its layers have none)
                b = src.get(f"blocks.{i}.layers.{j}.bias") if cfg.get("medusa_fc_bias") else None
                out[f"heads.{i}.{j}.linear.bias"] = b if b is not None else torch.zeros(w.shape[0], dtype=w.dtype)
            out[f"heads.{i}.{layers}.weight"] = src["lm_head.weight" if cfg.get("original_lm_head") else f"lm_heads.{i}.weight"]
    head = MedusaHeads(hidden, vocab, n, layers)
    _load(head, out, folder, "Medusa")
    return head


def load_foreign_heads(path: str | os.PathLike, target, tokenizer=None):
    """(head attached to ``target``, a specdec-style config) for a draft in a published layout."""
    from specdec.models.artifacts import check_fingerprint, tokenizer_fingerprint
    from specdec.models.loading import cached

    folder = Path(path)
    cfg = read_config(folder)
    layout = foreign_layout(folder, cfg)
    if layout is None:
        raise SpecdecError(f"{folder} is not a draft in a published layout")
    if cfg.get("specdec_target") and tokenizer is not None:
        check_fingerprint(cfg["specdec_target"], tokenizer_fingerprint(tokenizer), f"draft {folder}")

    def build():
        if layout == "dflash":
            head = _dflash(folder, cfg, target)
        elif layout in ("speculators", "eagle3"):
            head = _eagle3(folder, cfg, target, layout)
        elif layout == "eagle":
            head = _eagle1(folder, cfg, target)
        else:
            head = _medusa(folder, cfg, target, layout)
        p = next(target.parameters())
        head = head.to(device=p.device, dtype=p.dtype).eval().requires_grad_(False).attach(target)
        return head, {"kind": head.kind, **head.hparams(), "format": layout}

    return cached(("foreign-heads", str(folder.resolve()), id(target)), build)


# ---------------------------------------------------------------------------------------------
# export: a specdec head artifact -> a published layout


def _verifier(src: Path) -> str | None:
    """The target a specdec artifact was trained on (its training config), for the exports' metadata."""
    import yaml

    f = src / "training_config.yaml"
    if not f.is_file():
        return None
    target = (yaml.safe_load(f.read_text()) or {}).get("target")
    if not target:
        return None
    from specdec.models.loading import resolve_source

    try:
        source = resolve_source(target)  # a family member or a converted GGUF file: its folder
    except SpecdecError:
        return str(target)
    return str(Path(source).resolve()) if Path(source).exists() else source


def _target_embedding(verifier: str | None, vocab: int, hidden: int) -> torch.Tensor | None:
    """The target's input embedding read from its folder's safetensors (exports carry it, as
    speculators' own checkpoints do), or None where the target folder is not at hand."""
    if not verifier or not Path(verifier).is_dir():
        return None
    from safetensors import safe_open

    for f in sorted(Path(verifier).glob("*.safetensors")):
        with safe_open(str(f), "pt") as fh:
            for name in ("model.embed_tokens.weight", "model.language_model.embed_tokens.weight", "embed_tokens.weight"):
                if name in fh.keys():
                    w = fh.get_tensor(name)
                    return w.float() if tuple(w.shape) == (vocab, hidden) else None
    return None


def _sorted_vocab(state: dict, ids: torch.Tensor | None):
    """(d2t offsets, t2d mask) with the LM head's rows in ascending target order, as speculators'
    vocab mapping builds them (train/vocab_mapping.py sorts the chosen ids)."""
    if ids is None:
        return None, None
    order = torch.argsort(ids)
    ids = ids[order]
    state["lm_head.weight"] = state["lm_head.weight"][order].contiguous()
    return ids - torch.arange(len(ids)), ids


def _published(src: Path, to: str):
    cfg = read_config(src)
    if cfg.get("kind") == "medusa":
        raise UsageError(f"--to {to}: {src} is a Medusa head; speculators {SPECULATORS_VERSION} and EAGLE have no Medusa "
                         "layout (export it --to hf or --to vllm)")
    if cfg.get("kind") != "eagle":
        raise SpecdecError(f"--to {to} writes EAGLE heads; {src} is kind {cfg.get('kind')!r}")
    layout = cfg.get("layout")
    if layout not in LAYOUTS:
        raise SpecdecError(f"{src} is specdec's own EAGLE{'-3' if cfg.get('feature_layers') else ''} architecture, which no "
                           "published loader runs (its layer normalises fc's output; EAGLE-3's fuses into q/k/v); train it with "
                           f"`specdec train-heads --kind eagle --layout published{' --eagle3' if cfg.get('feature_layers') else ''}` "
                           f"to write it --to {to}")
    return cfg, layout, load_weights(src)


def export_speculators(src: str | os.PathLike, dst: str | os.PathLike, speculative_tokens: int | None = None) -> Path:
    """An EAGLE-3 head as a speculators ``eagle3`` checkpoint (config.json + model.safetensors); its
    proposal method drafts ``speculative_tokens`` per round (default: the steps the head was trained to
    unroll, as speculators' own trainer writes its ttt_steps)."""
    from safetensors.torch import save_file

    src, dst = Path(src), Path(dst)
    cfg, layout, state = _published(src, "speculators")
    if layout != "eagle3":
        raise UsageError(f"--to speculators: {src} is an EAGLE-1 head and speculators {SPECULATORS_VERSION} has only the "
                         "eagle3 EAGLE type (export it --to eagle)")
    layer, vocab, hidden = cfg["layer"], int(cfg["vocab_size"]), int(cfg["layer"]["hidden_size"])
    speculative_tokens = int(speculative_tokens or cfg.get("unroll") or 3)
    verifier = _verifier(src)
    ids = state.pop("draft_ids", None)  # integers; float32 in artifacts written before they were kept as integers
    d2t, sorted_ids = _sorted_vocab(state, None if ids is None else ids.round().long())
    out = {k: v.float().contiguous() for k, v in state.items()}
    if "embed_tokens.weight" not in out:  # speculators' loader reads the embedding from the checkpoint
        emb = _target_embedding(verifier, vocab, hidden)
        if emb is None:
            raise SpecdecError(f"--to speculators writes the target's embedding beside the head (speculators reads it from the "
                               f"checkpoint); {src}'s training config names target {verifier!r}, which is no folder with "
                               "safetensors weights here")
        out["embed_tokens.weight"] = emb.contiguous()
    if d2t is not None:
        t2d = torch.zeros(vocab, dtype=torch.bool)
        t2d[sorted_ids] = True
        out["d2t"], out["t2d"] = d2t.contiguous(), t2d
    dst.mkdir(parents=True, exist_ok=True)
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    tl = {**layer, "num_hidden_layers": 1, "vocab_size": vocab, "tie_word_embeddings": False}
    write_json(dst / "config.json", {
        "architectures": ["Eagle3DraftModel"], "speculators_model_type": "eagle3", "speculators_version": SPECULATORS_VERSION,
        "transformer_layer_config": tl, "draft_vocab_size": int(cfg["draft_vocab_size"]),
        "eagle_aux_hidden_state_layer_ids": list(cfg["feature_layers"]),
        "norm_before_residual": bool(cfg.get("norm_before_residual")), "norm_before_fc": bool(cfg.get("norm_before_fc")),
        "fc_norm": bool(cfg.get("fc_norm")), "norm_output": bool(cfg.get("norm_output")), "embed_requires_grad": False,
        "target_hidden_size": int(cfg.get("target_hidden_size") or hidden), "tie_word_embeddings": False,
        "speculators_config": {
            "algorithm": "eagle3", "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": int(speculative_tokens), "verifier_accept_k": 1,
                                  "accept_tolerance": 0.0}],
            "verifier": {"name_or_path": verifier, "architectures": ["LlamaForCausalLM"] if verifier is None else _archs(verifier)},
        },
        "specdec_target": cfg.get("target"),
    })
    return dst


def _target_output_rows(verifier: str | None, vocab: int, hidden: int) -> torch.Tensor | None:
    """The target's output layer [vocab, hidden] from its folder (its input embedding where the two are tied)."""
    if not verifier or not Path(verifier).is_dir():
        return None
    from safetensors import safe_open

    for f in sorted(Path(verifier).glob("*.safetensors")):
        with safe_open(str(f), "pt") as fh:
            if "lm_head.weight" in fh.keys() and tuple(fh.get_slice("lm_head.weight").get_shape()) == (vocab, hidden):
                w = fh.get_tensor("lm_head.weight")
                if w.is_floating_point():  # a converted GGUF target's folder also holds its quantised blocks (uint8)
                    return w.float()
    return _target_embedding(verifier, vocab, hidden)


def export_dflash(src: str | os.PathLike, dst: str | os.PathLike) -> Path:
    """A block drafter of the published layout (``models.block``, ``layout: published``) as a speculators ``dflash``
    checkpoint, the format vLLM's and speculators' DFlash drafts load: ``fc`` / ``hidden_norm`` (the context map and
    its norm), ``layers.{i}.*`` (Qwen3 decoder layers with q/k norms), ``norm``, ``lm_head`` (its rows of the
    draft vocabulary, ascending target ids, with ``d2t`` offsets and the ``t2d`` mask), the target's embedding, and
    ``block_size`` = the drafted tokens + 1 (the root's slot, ``sample_from_anchor`` false)."""
    from safetensors.torch import save_file

    src, dst = Path(src), Path(dst)
    cfg = read_config(src)
    if cfg.get("kind") != "block" or cfg.get("layout") != "published":
        raise UsageError(f"--to speculators: {src} is no block drafter of the published (DFlash) layout; train one with "
                         "`specdec train-heads --kind block` (its default layout)")
    layer, vocab, hidden = cfg["layer"], int(cfg["vocab_size"]), int(cfg["hidden_size"])
    verifier = _verifier(src)
    state = load_weights(src)
    out = {"fc.weight": state.pop("fuse.weight"), "hidden_norm.weight": state.pop("context_norm.weight")}
    out |= {k: v for k, v in state.items() if k.startswith("layers.") or k == "norm.weight"}
    rows = _target_output_rows(verifier, vocab, hidden)
    emb = _target_embedding(verifier, vocab, hidden)
    if rows is None or emb is None:
        raise SpecdecError(f"--to speculators writes the target's embedding and output rows beside the drafter (speculators "
                           f"reads them from the checkpoint); {src}'s training config names target {verifier!r}, which is "
                           "no folder with safetensors weights here")
    out["embed_tokens.weight"] = emb
    size = vocab
    d2t_file = src / "draft_vocab.safetensors"
    if d2t_file.is_file():
        from specdec.models import vocab as draft_vocab

        ids = draft_vocab.load(src).d2t[:-1].long()  # the last entry is the unk stand-in, never drafted
        out["lm_head.weight"] = rows[ids]
        out["d2t"], ids = _sorted_vocab(out, ids)
        size = len(ids)
        t2d = torch.zeros(vocab, dtype=torch.bool)
        t2d[ids] = True
        out["t2d"] = t2d
    else:
        out["lm_head.weight"] = rows
    dst.mkdir(parents=True, exist_ok=True)
    save_file({k: (v.float() if v.is_floating_point() else v).contiguous() for k, v in out.items()},
              str(dst / "model.safetensors"), metadata={"format": "pt"})
    tl = {**layer, "num_hidden_layers": int(cfg["num_layers"]), "vocab_size": vocab, "tie_word_embeddings": False,
          "layer_types": ["full_attention"] * int(cfg["num_layers"])}
    write_json(dst / "config.json", {
        "architectures": ["DFlashSpeculator"], "speculators_model_type": "dflash", "speculators_version": SPECULATORS_VERSION,
        "transformer_layer_config": tl, "draft_vocab_size": size, "block_size": int(cfg["num_heads"]) + 1,
        "target_hidden_size": hidden, "aux_hidden_state_layer_ids": list(cfg["feature_layers"]),
        "mask_token_id": int(cfg["mask_token_id"]), "sliding_window_non_causal": False, "sample_from_anchor": False,
        "speculators_config": {
            "algorithm": "dflash", "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": int(cfg["num_heads"]), "verifier_accept_k": 1,
                                  "accept_tolerance": 0.0}],
            "verifier": {"name_or_path": verifier, "architectures": _archs(verifier)},
        },
        "specdec_target": cfg.get("target"),
    })
    return dst


def _archs(verifier: str) -> list[str]:
    f = Path(verifier) / "config.json"
    if f.is_file():
        return list(json.loads(f.read_text()).get("architectures") or [])
    return []


def export_eagle(src: str | os.PathLike, dst: str | os.PathLike) -> Path:
    """An EAGLE-1 head in SafeAILab/EAGLE's layout, or an EAGLE-3 head in EAGLE-3's / SpecForge's
    (``LlamaForCausalLMEagle3``, ``midlayer.*``)."""
    from safetensors.torch import save_file

    src, dst = Path(src), Path(dst)
    cfg, layout, state = _published(src, "eagle")
    layer, vocab = cfg["layer"], int(cfg["vocab_size"])
    llama = {**{k: v for k, v in layer.items() if k != "model_type"}, "model_type": "llama", "num_hidden_layers": 1,
             "vocab_size": vocab, "tie_word_embeddings": False}
    rope = layer.get("rope_parameters") or {}
    # transformers-4 keys too: EAGLE's and SpecForge's loaders read rope_theta / rope_scaling
    llama["rope_theta"] = float(rope.get("rope_theta", 10000.0))
    scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
    llama["rope_scaling"] = None if scaling.get("rope_type", "default") == "default" else {**scaling, "type": scaling["rope_type"]}
    if layout == "eagle1":
        out = {}
        for k, v in state.items():
            out[k[len("decoder."):] if k.startswith("decoder.") else k] = v.float().contiguous()
        conf = {**llama, "architectures": ["LlamaForCausalLM"], "bias": "fc.bias" in out}
    else:
        if layer.get("model_type") == "qwen3":
            raise UsageError("--to eagle writes Llama draft layers; this head's layer is Qwen3 (export it --to speculators)")
        if cfg.get("norm_before_fc") or cfg.get("norm_output"):
            raise UsageError("--to eagle: EAGLE-3 / SpecForge have no norm_before_fc or fed-back output norm (export it --to speculators)")
        ids = state.pop("draft_ids", None)
        d2t, sorted_ids = _sorted_vocab(state, None if ids is None else ids.round().long())
        out = {("midlayer." + k[len("layers.0."):] if k.startswith("layers.0.") else k): v.float().contiguous() for k, v in state.items()}
        size = int(cfg["draft_vocab_size"])
        out["d2t"] = (d2t if d2t is not None else torch.zeros(size, dtype=torch.long)).contiguous()
        t2d = torch.zeros(vocab, dtype=torch.bool)
        t2d[sorted_ids if sorted_ids is not None else torch.arange(vocab)] = True
        out["t2d"] = t2d
        conf = {**llama, "architectures": ["LlamaForCausalLMEagle3"], "draft_vocab_size": size,
                "target_hidden_size": int(cfg.get("target_hidden_size") or layer["hidden_size"]),
                "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(cfg["feature_layers"]), "use_aux_hidden_state": True},
                "norm_before_residual": bool(cfg.get("norm_before_residual")), "fc_norm": bool(cfg.get("fc_norm")),
                "norm_output": cfg.get("logits_norm", True) is not False}
    dst.mkdir(parents=True, exist_ok=True)
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    conf["specdec_target"] = cfg.get("target")
    write_json(dst / "config.json", conf)
    return dst
