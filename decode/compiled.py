"""Compiled decode steps over preallocated key/value buffers (``--compile``).

A decode step's cost on a GPU at small batch is launch overhead and weight reads, not arithmetic: the
eager forward launches hundreds of kernels per layer and HF's ``DynamicCache`` concatenates every
layer's keys and values on every step (a copy of the whole cache, and a new shape each time). With
``--compile`` a model's forwards run through ``torch.compile`` (CUDA graphs on a GPU:
``mode="reduce-overhead"``) against ``SlotBuffers``: every layer's keys and values preallocated to a
fixed capacity, written in place at a write offset held in a tensor (so a step's shapes and addresses
do not change from round to round), with the causal/tree/hole mask spanning the whole capacity.

Shapes are bucketed so that a handful of graphs serve a job: a segment of ``t`` tokens (the root plus a
chain of drafts, a tree, one drafted token) is padded with holes to the next power of two up to
``MAX_BUCKET``, and the capacity grows in steps of ``CAPACITY_STEP`` slots. Longer segments (prefills)
run the same modules eagerly against the same buffers: compiling a prompt's shape would cost more than
it saves. Holes (padding) are masked like every other hole of the slot axis, so outputs are the eager
forward's up to floating-point reassociation, and the lossless tests run with compiled steps too.
"""

from __future__ import annotations

import weakref

import torch
from transformers.cache_utils import Cache, StaticLayer

MAX_BUCKET = 64  # segments up to this many tokens run compiled; longer ones (prefills) eagerly
CAPACITY_STEP = 256  # the slot capacity grows in these steps (each capacity is one more graph per bucket)
# the compiler backend; tests set "aot_eager", which traces and partitions the same graphs without
# generating code, so that capture is tested in seconds
BACKEND = "inductor"

_COMPILED: "weakref.WeakKeyDictionary[torch.nn.Module, Compiled]" = weakref.WeakKeyDictionary()


class Compiled:
    """A model's compiled forward and how its outputs must be treated."""

    def __init__(self, model: torch.nn.Module, mode: str | None):
        self.mode = mode
        # dynamic=None: a dimension seen at a second size (the batch, as rows finish) is traced as
        # symbolic from then on, instead of one graph per size up to dynamo's recompile limit
        self.forward = torch.compile(model, mode=mode, backend=BACKEND, dynamic=None)

    @property
    def graphs(self) -> bool:
        """CUDA graphs replay into the same output buffers: results are cloned before the next call."""
        return self.mode == "reduce-overhead"


def for_model(model: torch.nn.Module) -> Compiled:
    """``model``'s compiled forward (CUDA graphs on a GPU), made once per model and shared by every
    state that runs it compiled (the graphs are the expensive part)."""
    step = _COMPILED.get(model)
    if step is None:
        mode = "reduce-overhead" if next(model.parameters()).device.type == "cuda" else None
        step = _COMPILED[model] = Compiled(model, mode)
    return step


def bucket(t: int) -> int | None:
    """The padded length a segment of ``t`` tokens runs at, or None when it runs eagerly."""
    if t > MAX_BUCKET:
        return None
    return 1 << max(0, (t - 1).bit_length())


def capacity_for(slots: int) -> int:
    return -(-slots // CAPACITY_STEP) * CAPACITY_STEP


class SlotBuffers(Cache):
    """Per layer, keys and values of ``capacity`` slots written in place at the layer's write offset (a
    tensor each layer advances as it writes). Slots past what the slot book committed hold stale values
    that every mask hides; dropping a tail is therefore only bookkeeping, and each forward starts by
    setting the offsets to the committed length."""

    def __init__(self, num_layers: int, capacity: int, device: torch.device):
        super().__init__(layers=[StaticLayer(capacity) for _ in range(num_layers)])
        self.capacity = capacity
        for layer in self.layers:
            # on the buffers' device from the start, so a layer's initialisation keeps this tensor
            layer.cumulative_length = torch.zeros((), dtype=torch.long, device=device)

    @classmethod
    def holding(cls, kv: list[tuple[torch.Tensor, torch.Tensor]], capacity: int) -> "SlotBuffers":
        """Buffers of ``capacity`` slots whose first slots hold ``kv`` (per layer keys, values [B, H, S, D])."""
        out = cls(len(kv), capacity, kv[0][0].device)
        for layer, (k, v) in zip(out.layers, kv):
            layer.lazy_initialization(k[:, :, :1], v[:, :, :1])
            layer.keys[:, :, : k.shape[2]] = k
            layer.values[:, :, : v.shape[2]] = v
        return out

    def set_length(self, n: int) -> None:
        for layer in self.layers:
            layer.cumulative_length.fill_(n)

    def committed(self, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Views of every layer's first ``n`` slots."""
        return [(layer.keys[:, :, :n], layer.values[:, :, :n]) for layer in self.layers]
