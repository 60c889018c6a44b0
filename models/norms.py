"""Gemma's RMSNorms with the same arithmetic in fewer operations, bit for bit (``install``).

A decode step of a small model on a CPU pays per operation, not per byte: Gemma 3 270M runs 108 RMSNorms a
token (four a layer, and the query and key norms), and transformers' ``Gemma3RMSNorm`` spends each on ten
small operations, three of them conversions of Python numbers (``+ eps``, ``1.0 + weight``, the mean's
division) into tensors. The same function with the weight's ``1 + w`` kept, and the epsilon and the count
held as float32 tensors, is six operations: x*x (what ``pow(2)`` computes), its sum divided by the count
(what ``mean`` computes), plus epsilon, rsqrt, and the two products, in the same order, so the result is
the same floats.

That it is the same is not assumed: ``install`` compares both forwards with ``torch.equal`` on random
inputs of the norm's own width (and, for the query/key norms, of its head layout) and keeps transformers'
forward wherever they differ, or where the module is not what it expects (another class, a weight that is
not float32 on a CPU). Inputs it was not checked for (another dtype, or ones that need gradients) go to
transformers' forward, as do calls after the weight was written in place (its kept ``1 + w`` is renewed).
"""

from __future__ import annotations

import torch

NORM_CLASSES = ("Gemma3RMSNorm",)  # the layouts whose arithmetic ``_fast`` reproduces
PROBES = 8  # random inputs per norm compared with transformers' forward


def install(model) -> int:
    """Route each of ``model``'s Gemma RMSNorms through the shorter forward where it computes the same
    floats; returns how many were routed."""
    routed = 0
    for module in model.modules():
        if type(module).__name__ in NORM_CLASSES and _eligible(module) and _route(module):
            routed += 1
    return routed


def _eligible(module) -> bool:
    weight = getattr(module, "weight", None)
    return (isinstance(weight, torch.Tensor) and weight.dim() == 1 and weight.dtype == torch.float32
            and weight.device.type == "cpu" and isinstance(getattr(module, "eps", None), float))


def _route(module) -> bool:
    original = module.forward
    state = {"version": None, "scale": None}  # the weight (its identity and version) 1 + w was computed from
    eps = torch.tensor(module.eps, dtype=torch.float32)
    count = torch.tensor(float(module.weight.shape[0]), dtype=torch.float32)

    def scale() -> torch.Tensor:
        weight = module.weight
        if state["version"] != (id(weight), weight._version) or state["scale"] is None:
            with torch.no_grad():
                state["scale"] = 1.0 + weight.float()  # as transformers computes it, once per weight
            state["version"] = (id(weight), weight._version)
        return state["scale"]

    def fast(x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.float32 or x.device.type != "cpu" or (x.requires_grad and torch.is_grad_enabled()):
            return original(x)
        square = torch.sum(x * x, -1, keepdim=True).div_(count)
        return x * torch.rsqrt(square.add_(eps)) * scale()

    generator = torch.Generator().manual_seed(0)
    width = module.weight.shape[0]
    with torch.no_grad():
        for i in range(PROBES):
            shape = ((1, 1, width), (2, 5, width), (1, 4, 3, width))[i % 3]
            x = torch.randn(*shape, generator=generator) * float(10 ** (i % 4 - 1))
            if not torch.equal(fast(x), original(x)):
                return False
    module.forward = fast
    module._specdec_norm = (scale, eps, count)  # what a decode step run outside Python reads (decode.engine.direct)
    return True
