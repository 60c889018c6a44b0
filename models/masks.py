"""Attention masks: a boolean visibility mask as the additive mask attention adds to its scores."""

from __future__ import annotations

import torch


def additive_mask(visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``visible`` (True where a query may attend to a key) as an additive mask of ``dtype``, same shape
    and device: 0 where visible, the dtype's most negative value elsewhere. Materialised, not broadcast:
    CPU attention takes a very slow path for broadcast masks and converts a boolean one on every call."""
    return torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill_(~visible, torch.finfo(dtype).min)
