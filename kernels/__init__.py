"""Triton kernels for the decode hot spots, each beside the PyTorch reference it must reproduce.

- ``verify.verify_chain_triton``: chain verification (greedy and exact sampling), two launches, no
  host sync; reference ``decode.engine.verify.verify_chain_core``.
- ``tree_attention.tree_attention`` and the transformers attention function ``specdec_tree``:
  attention of the tree tokens over the cache under a 4-D boolean mask.
- ``prefix_attention.prefix_attention``: attention of every row's stacked queries over a prefix the
  rows share, with its log-sum-exp (Hydragen, ``decode.engine.hydragen``); reference: two bmm's around a
  softmax, ``prefix_attention_reference``.
- ``diffusion_select.select_step``: top-1, confidence and the commit decision of one diffusion step;
  reference: the rule functions beside it, which ``decode.diffusion.strategies`` decodes with.

Importing this package never imports triton; the kernel modules get it through ``load_triton``,
which hands back stand-ins when triton is missing, so CPU-only installs still run every reference.
"""

from __future__ import annotations

import functools
import os

BACKENDS = ("auto", "triton", "torch")
ENV_VAR = "SPECDEC_KERNELS"


def backend(requested: str = "auto", device=None) -> str:
    """Resolve "auto" | "triton" | "torch" to the implementation to run.

    ``SPECDEC_KERNELS`` overrides ``requested`` (an operator's switch, e.g. to rule a kernel out
    while debugging). "auto" picks triton only for tensors on a CUDA device when triton imports;
    "triton" is honoured anywhere (on CPU that needs TRITON_INTERPRET=1, which the tests use).
    """
    choice = os.environ.get(ENV_VAR) or requested
    if choice not in BACKENDS:
        raise ValueError(f"kernel backend must be one of {BACKENDS}, got {choice!r}")
    if choice == "torch":
        return "torch"
    if choice == "triton":
        if not triton_imports():
            raise RuntimeError("the triton kernel backend was requested but triton does not import")
        return "triton"
    on_cuda = device is not None and str(device).startswith("cuda")
    return "triton" if on_cuda and triton_imports() else "torch"


@functools.cache
def triton_imports() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


class _NoTriton:
    """Stand-in for ``triton`` and ``triton.language`` when triton is not installed: ``jit`` leaves
    the kernel a plain (never called) function and ``constexpr`` only has to exist as an annotation."""

    constexpr = None

    @staticmethod
    def jit(fn):
        return fn


def load_triton():
    """(triton, triton.language), or stand-ins so kernel modules import without triton."""
    if not triton_imports():
        return _NoTriton, _NoTriton
    import triton
    import triton.language as tl

    return triton, tl
