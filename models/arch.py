"""What specdec needs to know about a causal LM's architecture, in one place.

One adapter table keyed by ``config.model_type`` says where a model keeps its decoder layers, what a
layer calls its self-attention, and which config keys size a draft of the same architecture. A model
type that is not in the table is introspected (the ModuleList of ``num_hidden_layers`` layers holding
the most parameters; the child attention module that carries a ``layer_idx``); where neither finds
them, a ``SpecdecError`` names the model type. Which layers attend through a sliding window is read
from the config as transformers' own cache reads it (``layer_types``, else ``sliding_window``), so
specdec's masks agree with what the model was trained with.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdec.models.errors import SpecdecError

FULL = "full_attention"
SLIDING = "sliding_attention"


@dataclass(frozen=True)
class Adapter:
    layers: str = "model.layers"  # dotted path from the *ForCausalLM module to its decoder ModuleList
    attention: str = "self_attn"  # a decoder layer's self-attention child
    layer_index: str = "layer_idx"  # the attention's attribute naming its cache layer
    ffn: str = "intermediate_size"  # config key of the MLP width
    # config keys that equal hidden_size / head_dim in a model and must follow them when a draft is resized
    follows_hidden: tuple[str, ...] = ()
    follows_head_dim: tuple[str, ...] = ()


_LLAMA_LIKE = Adapter()
_GEMMA_LIKE = Adapter(follows_head_dim=("query_pre_attn_scalar",))

ADAPTERS: dict[str, Adapter] = {
    "llama": _LLAMA_LIKE,
    "mistral": _LLAMA_LIKE,
    "mixtral": _LLAMA_LIKE,
    "qwen2": _LLAMA_LIKE,
    "qwen3": _LLAMA_LIKE,
    "gemma": _LLAMA_LIKE,
    "gemma2": _GEMMA_LIKE,
    "gemma3_text": _GEMMA_LIKE,
    "phi3": _LLAMA_LIKE,
    "gpt2": Adapter(layers="transformer.h", attention="attn", ffn="n_inner"),
    "gpt_neox": Adapter(layers="gpt_neox.layers", attention="attention"),
    "opt": Adapter(layers="model.decoder.layers", ffn="ffn_dim", follows_hidden=("word_embed_proj_dim",)),
}

# what introspection accepts as a layer's self-attention, in order (cross-attention names excluded)
_ATTENTION_NAMES = ("self_attn", "attn", "attention", "self_attention")


def text_config(config):
    """The decoder's config (a multimodal config nests it)."""
    get = getattr(config, "get_text_config", None)
    return get(decoder=True) if get is not None else config


def output_logits(model, states: torch.Tensor) -> torch.Tensor:
    """The logits of final (normed) hidden states: the output layer, then the soft-capping the config asks for
    (Gemma 2), as the model's forward applies them."""
    logits = model.get_output_embeddings()(states)
    cap = getattr(text_config(model.config), "final_logit_softcapping", None)
    return torch.tanh(logits / cap) * cap if cap is not None else logits


def model_type(config) -> str:
    return getattr(text_config(config), "model_type", None) or "unknown"


def adapter(config) -> Adapter:
    """The table's entry for this model type; the Llama layout where the type is not in the table."""
    return ADAPTERS.get(model_type(config), _LLAMA_LIKE)


def decoder_layers(model) -> tuple[torch.nn.Module, str, torch.nn.ModuleList]:
    """(parent module, attribute name, the decoder layers): ``setattr(parent, name, ...)`` swaps them."""
    config = model.config
    entry = ADAPTERS.get(model_type(config))
    if entry is not None:
        *path, name = entry.layers.split(".")
        parent = model
        for part in path:
            parent = getattr(parent, part, None)
        layers = getattr(parent, name, None) if parent is not None else None
        if isinstance(layers, torch.nn.ModuleList):
            return parent, name, layers
    found = _find_layers(model, getattr(text_config(config), "num_hidden_layers", None))
    if found is None:
        raise SpecdecError(
            f"specdec does not know where a {model_type(config)!r} model keeps its decoder layers "
            f"(no ModuleList of num_hidden_layers layers with a self-attention module)"
        )
    return found


def _find_layers(model, n_layers):
    best, best_size = None, -1
    for qualified, module in model.named_modules():
        if n_layers is None or not isinstance(module, torch.nn.ModuleList) or len(module) != n_layers:
            continue
        if not all(_attention_child(layer) is not None for layer in module):
            continue
        size = sum(p.numel() for p in module.parameters())
        if size > best_size:
            parent_name, _, name = qualified.rpartition(".")
            best, best_size = (model.get_submodule(parent_name), name, module), size
    return best


def _attention_child(layer) -> str | None:
    for name in _ATTENTION_NAMES:
        child = getattr(layer, name, None)
        if isinstance(child, torch.nn.Module) and isinstance(getattr(child, "layer_idx", None), int):
            return name
    return None


def attention_module(layer, config=None) -> tuple[str, torch.nn.Module]:
    """(attribute name, module) of a decoder layer's self-attention; its ``layer_index_attr`` names its cache layer."""
    entry = ADAPTERS.get(model_type(config)) if config is not None else None
    name = entry.attention if entry is not None and hasattr(layer, entry.attention) else _attention_child(layer)
    if name is None:
        kind = model_type(config) if config is not None else type(layer).__name__
        raise SpecdecError(f"specdec does not know which module of a {kind!r} decoder layer is its self-attention")
    return name, getattr(layer, name)


def layer_index_attr(config=None) -> str:
    """The attention module's attribute holding its layer index (the cache layer it writes)."""
    entry = ADAPTERS.get(model_type(config)) if config is not None else None
    return entry.layer_index if entry is not None else "layer_idx"


def sliding_window(config) -> int | None:
    """The window of the sliding layers (a key is visible iff query_pos - key_pos < window); None: none slide."""
    window = getattr(text_config(config), "sliding_window", None)
    return int(window) if window else None


def layer_types(config) -> list[str]:
    """Per decoder layer, ``full_attention`` or ``sliding_attention``: ``config.layer_types`` where the
    model has them, else every layer slides when the config sets ``sliding_window`` (Mistral, Phi-3).
    A layer listed as sliding while the config sets no window attends fully (Qwen2 without
    ``use_sliding_window``); the names stay, as a model reads its masks by them."""
    cfg = text_config(config)
    n = cfg.num_hidden_layers
    types = getattr(cfg, "layer_types", None)
    if types:
        types = list(types)[:n]
    elif getattr(cfg, "attention_chunk_size", None):
        types = ["chunked_attention"] * n
    else:
        types = [SLIDING if sliding_window(cfg) else FULL] * n
    unknown = sorted(set(types) - {FULL, SLIDING})
    if unknown:
        raise SpecdecError(f"specdec supports full and sliding-window attention; {model_type(config)!r} has {', '.join(unknown)} layers")
    return types


def attention_projections(model) -> list[str]:
    """Names of the projections in a decoder layer's self-attention (q/k/v/o, fused qkv, GPT-2's
    c_attn/c_proj): what LoRA adapts in a draft, whatever the architecture calls them."""
    _, _, layers = decoder_layers(model)
    _, attn = attention_module(layers[0], model.config)
    return [name for name, child in attn.named_children() if isinstance(child, torch.nn.Linear) or type(child).__name__ == "Conv1D"]


# config keys a resized config never carries over: provenance, the target's storage and loading
_NOT_COPIED = ("architectures", "_name_or_path", "transformers_version", "dtype", "torch_dtype", "auto_map",
               "quantization_config", "_attn_implementation", "_attn_implementation_autoset")


def resized_config(config, num_hidden_layers: int, hidden_size: int, num_attention_heads: int,
                   intermediate_size: int, num_key_value_heads: int | None = None):
    """A config of the same architecture with these sizes; everything else (rope settings, sliding
    window, vocabulary, special tokens, norms, activations) as in ``config``. ``head_dim`` becomes
    hidden / heads; ``layer_types`` keeps the target's mix, sampled evenly over its depth (first and
    last layer included, and a full layer where the target has one). Raises SpecdecError where the
    architecture cannot express the sizes."""
    cfg = text_config(config)
    entry = adapter(cfg)
    names = getattr(cfg, "attribute_map", {}) or {}
    d = {k: v for k, v in cfg.to_dict().items() if k not in _NOT_COPIED}

    def put(name, value):
        key = names.get(name, name)
        if key not in d:
            raise SpecdecError(f"a {model_type(cfg)!r} config has no {name}")
        d[key] = value

    old_hidden, old_heads = cfg.hidden_size, cfg.num_attention_heads
    old_head_dim = getattr(cfg, "head_dim", None) or old_hidden // old_heads
    head_dim = hidden_size // num_attention_heads
    put("num_hidden_layers", num_hidden_layers)
    put("hidden_size", hidden_size)
    put("num_attention_heads", num_attention_heads)
    put(entry.ffn, intermediate_size)
    kv = num_attention_heads if num_key_value_heads is None else num_key_value_heads
    if names.get("num_key_value_heads", "num_key_value_heads") in d:
        put("num_key_value_heads", kv)
    elif kv != num_attention_heads:
        raise SpecdecError(f"a {model_type(cfg)!r} model has no grouped-query attention (kv_heads)")
    if "head_dim" in d:
        d["head_dim"] = head_dim
    for key in entry.follows_hidden:
        if d.get(key) == old_hidden:
            d[key] = hidden_size
    for key in entry.follows_head_dim:
        if d.get(key) == old_head_dim:
            d[key] = head_dim
    if d.get("layer_types"):
        types = list(d["layer_types"])
        last = len(types) - 1
        picked = [types[round(i * last / max(num_hidden_layers - 1, 1))] for i in range(num_hidden_layers)]
        if FULL in types and FULL not in picked:
            picked[-1] = FULL  # only a full layer sees past the window
        d["layer_types"] = picked
    return type(cfg).from_dict(d)
