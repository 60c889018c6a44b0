"""Compiled decode steps over preallocated key/value buffers (``--compile``).

A decode step's cost on a GPU at small batch is launch overhead and weight reads, not arithmetic: the
eager forward launches hundreds of kernels per layer. With ``--compile`` a model's forwards run through
``torch.compile`` (CUDA graphs on a GPU: ``mode="reduce-overhead"``) against the preallocated
``decode.engine.cache.SlotBuffers``, written in place at a write offset held in a tensor and read whole (so a
step's shapes and addresses do not change from round to round), with the causal/tree/hole mask
spanning the whole capacity.

Shapes are bucketed so that a handful of graphs serve a job: a segment of ``t`` tokens (the root plus a
chain of drafts, a tree, one drafted token) is padded with holes to the next power of two up to
``MAX_BUCKET``, and the buffers' capacity grows in steps (``decode.engine.cache.CAPACITY_STEP``). Longer segments (prefills)
run the same modules eagerly against the same buffers: compiling a prompt's shape would cost more than
it saves. Holes (padding) are masked like every other hole of the slot axis, so outputs are the eager
forward's up to floating-point reassociation, and the lossless tests run with compiled steps too.
"""

from __future__ import annotations

import weakref

import torch

MAX_BUCKET = 64  # segments up to this many tokens run compiled; longer ones (prefills) eagerly
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
        # a job meets a graph per bucket, capacity and batch-size change, the draft's and the target's
        # under one code object: past dynamo's default limit (8) it would quietly run eager
        config = torch._dynamo.config
        config.recompile_limit = max(config.recompile_limit, 64)

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
