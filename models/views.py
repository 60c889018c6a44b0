"""Views of a model that share its weights: the target with some decoder layers left out.

Self-speculation (``layerskip``, SWIFT) drafts with the target minus some layers, SkipDecode decodes later
positions with the top layers only, and a sorted draft (S2D) serves a target with its first layers: all
of them are ``layer_skip_view``s.
"""

from __future__ import annotations

import copy

import torch

from specdec.models import arch
from specdec.models.errors import UsageError


def layer_skip_view(model, skip: list[int]):
    """The target with some decoder layers skipped, sharing all weights (SWIFT / Draft&Verify).

    Shallow copies only: the modules from the model down to its layer list, and each kept layer and
    its attention, which is re-indexed so the view has a cache of its own. The view's config (every
    copied module's) lists only the kept layers, their layer types included.
    """
    parent, name, layers = arch.decoder_layers(model)
    keep = [i for i in range(len(layers)) if i not in set(skip)]
    if not keep or len(keep) == len(layers):
        raise UsageError(f"layerskip must skip some but not all of the {len(layers)} layers (asked to skip {sorted(set(skip))})")
    config = copy.deepcopy(model.config)
    config.num_hidden_layers = len(keep)
    if getattr(config, "layer_types", None):
        config.layer_types = [config.layer_types[i] for i in keep]
    index_attr = arch.layer_index_attr(config)
    new_layers = []
    for new_idx, old_idx in enumerate(keep):
        layer = _shallow(layers[old_idx])
        attn_name, attn = arch.attention_module(layer, config)
        attn = _shallow(attn)
        setattr(attn, index_attr, new_idx)
        setattr(layer, attn_name, attn)
        if isinstance(getattr(layer, index_attr, None), int):  # some layers carry their index too (Gemma-3)
            setattr(layer, index_attr, new_idx)
        new_layers.append(layer)
    # copy the chain model -> ... -> parent, so the original model keeps its layers and config
    path = next(q for q, m in model.named_modules() if m is parent)
    chain = [_shallow(model)]
    for part in filter(None, path.split(".")):
        child = _shallow(getattr(chain[-1], part))
        setattr(chain[-1], part, child)
        chain.append(child)
    setattr(chain[-1], name, torch.nn.ModuleList(new_layers))
    for module in chain:
        if getattr(module, "config", None) is not None:
            module.config = config
    return chain[0]


def _shallow(module: torch.nn.Module) -> torch.nn.Module:
    clone = copy.copy(module)
    clone._modules = dict(module._modules)
    clone._parameters = dict(module._parameters)
    clone._buffers = dict(module._buffers)
    return clone
