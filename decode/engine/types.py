"""Requests and results: what the job runner hands a generator (the engine, or a diffusion generator)
and gets back; and the verification schemes a proposal names. Imports nothing heavy (the CLI reads
``Scheme``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum


class Scheme(StrEnum):
    """How drafted tokens are verified (``decode.engine.verify``): ``standard``, a chain, or a tree of
    candidates the draft took as they are (greedy, or one-hot q: ``verify_chain`` / ``verify_tree``); or a
    tree of siblings sampled from the draft's q, each level tested so the target's distribution stays
    exact (``verify_tree_drafted``): ``rsd``, siblings drawn without replacement (recursive rejection),
    or ``spectr``, i.i.d. chains (k-sequential selection)."""

    standard = "standard"
    rsd = "rsd"
    spectr = "spectr"


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
    # the request's identity in the race (verify.race_noise) that draws its tokens at T>0: a job names it
    # by input line and sample, so a resumed job draws what an uninterrupted one would; None = its index
    key: int | None = None


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
    # a method that returns several outputs for one request (beams, superposed drafts): the others, best first
    alternatives: list["GenResult"] = field(default_factory=list)
    score: float | None = None  # the method's score of this output (a beam's length-normalised log-probability)

