"""Decode methods with a loop of their own, beside the speculative loop (``decode.engine.loop``).

Beam search (``decode.engine.beams``) and the approximate modes (``decode.approx``: superposed decoding,
entropy-adaptive decoding, lexical units, SkipDecode) do not propose tokens for the target to verify,
so they are not drafters. They take the same ``GenRequest``s and return the same ``GenResult``s as
``SpecEngine`` (``generate`` for a static batch, ``stream`` for the job's continuous schedule), so the
job runner, the bench and ``decode.jobs.build.build_engine`` handle them as they handle the engine.

An approximate mode's output may differ from the target's own decoding: each of its results says
``"approximate": true`` in its stats, and the job writes it into the record.
"""

from __future__ import annotations

import itertools
import time
from typing import Iterable, Iterator

from specdec.decode.engine.types import GenRequest, GenResult


class OwnLoop:
    """The base of a decode method with a loop of its own; subclasses implement ``generate``.

    ``approximate``: its output may differ from the target's greedy decoding or sampling (records say so).
    ``expands_samples``: it makes a record's ``--num-samples`` outputs itself from one request (its
    result's ``alternatives``), rather than decoding each sample as a row of its own.
    ``model``: a second model it runs beside the target (EAD's draft), for the bench's reports.
    ``argmax_only``: it reads each position's argmax of the target's logits, and the other logits at most as
    heuristics (a confidence, a candidate's rank): ``output_layer`` then screens the output layer in half
    precision as greedy rounds of the engine do (``models.head``: the argmax exact, every other logit within
    the screen's bound of its float32 value), which on a 262k-token vocabulary is most of a step's cost."""

    approximate = False
    argmax_only = False
    expands_samples = False
    compile = "off"  # its forwards run eagerly (the engine's --compile mode, for bench's warm-up)
    model = None
    admits = True  # the job's continuous schedule hands it requests as they come (in batches here)

    def __init__(self, target, tokenizer, options):
        self.target = target
        self.tokenizer = tokenizer
        self.options = options
        self.eos_ids = set(eos_ids(target, tokenizer))
        self.stop = [s for s in options.sampling.stop if s]
        self.device = next(target.parameters()).device

    def generate(self, requests: list[GenRequest]) -> list[GenResult]:
        raise NotImplementedError

    def stream(self, requests: Iterable[GenRequest], batch_size: int) -> Iterator[tuple[int, GenResult]]:
        """Batches of ``batch_size`` requests in order, each decoded whole before the next is read; yields
        (index of the request, its result)."""
        requests = iter(requests)
        taken = 0
        while chunk := list(itertools.islice(requests, batch_size)):
            start = time.perf_counter()
            results = self.generate(chunk)
            wall = time.perf_counter() - start
            for j, result in enumerate(results):
                result.stats.setdefault("row_wall_s", wall)  # the job's wall_s: where a method times no row, its batch's
                yield taken + j, result
            taken += len(chunk)

    def output_layer(self, model=None):
        """Within: ``model``'s (the target's) output layer as ``models.head`` runs it inside the engine,
        screened where ``argmax_only``, else exact."""
        from specdec.models import head

        return head.scope(model if model is not None else self.target, greedy=self.argmax_only)

    def append(self, tokens: list[int], new: list[int], max_new: int) -> str | None:
        """Append ``new`` to an output's ``tokens`` as the engine does (``append_tokens``); its finish
        reason once it has one."""
        return append_tokens(tokens, new, max_new, self.eos_ids, self.stop, self.tokenizer)


def append_tokens(tokens: list[int], new: list[int], max_new: int, eos_ids, stop: list[str], tokenizer) -> str | None:
    """Append ``new`` to ``tokens`` up to the first end-of-sequence token or the budget ``max_new``;
    returns "stop" (EOS, or a stop string in the last 32 tokens' text), "length", or None (going on).
    The stop string's cut is the job's (``Decoder.output``)."""
    for tok in new:
        tokens.append(tok)
        if tok in eos_ids:
            return "stop"
        if len(tokens) >= max_new:
            return "length"
    if stop and any(s in tokenizer.decode(tokens[-32:]) for s in stop):
        return "stop"
    return None


def eos_ids(model, tokenizer) -> list[int]:
    """The ids that end an output: the model's generation config's, else the tokenizer's."""
    ids = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if ids is None:
        ids = getattr(tokenizer, "eos_token_id", None)
    if ids is None:
        return []
    return list(ids) if isinstance(ids, (list, tuple)) else [int(ids)]
