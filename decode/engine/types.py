"""The contract between the JSONL job runner and whatever generates tokens for a batch."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol


@dataclass
class GenRequest:
    prompt_ids: list[int]
    max_new_tokens: int
    # requests of one group are samples of the same prompt (``--num-samples``): drafters may share
    # what they learn between them; None = a request on its own
    group: int | None = None
    # token ids the output is expected to follow (a record's ``source``: the text an edit rewrites),
    # which input-guided drafting copies from; None = the prompt
    reference: list[int] | None = None


def add_counts(total: list, counts: list) -> None:
    """Add per-position counters (``position_drafted``, ``position_accepted``) into ``total``, which
    grows to the longer of the two."""
    total.extend([0] * (len(counts) - len(total)))
    for i, v in enumerate(counts):
        total[i] += v


@dataclass
class GenResult:
    token_ids: list[int]  # new tokens only, stop string / EOS handling already applied
    finish_reason: str  # "stop" or "length"
    stats: dict = field(default_factory=dict)  # per-record counters: target_calls, drafted_tokens, ...


class BatchGenerator(Protocol):
    """One batch in, one result per request out, in the same order.

    Autoregressive/speculative decoding (decode/engine/loop.py) and diffusion decoding
    (decode/diffusion/generator.py) both implement this; the job runner does not care which.
    """

    def generate(self, requests: list[GenRequest]) -> list[GenResult]: ...
