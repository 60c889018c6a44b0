"""Option values checked before any model loads: one ``UsageError`` (exit 2) naming the flag.

A value outside its range would otherwise decode something else than asked (``--top-p 2`` samples
from everything, ``--batch-size 0`` decodes nothing) or fail minutes later, after the models load.
The checks read ``DecodeOptions`` attributes by name, so they work on any object carrying those fields.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from specdec.models.errors import UsageError

if TYPE_CHECKING:  # pragma: no cover
    from specdec.decode.options import DecodeOptions

MAX_NUM_DRAFT = 256  # drafted tokens per round; beyond this a round costs more than it can win


def validate_options(opts: DecodeOptions) -> None:
    """Raise ``UsageError`` for the first option value that cannot be meant; return None otherwise."""
    _positive_int(opts, "max_new_tokens", "--max-new-tokens")
    _positive_int(opts, "batch_size", "--batch-size")
    num_draft = getattr(opts, "num_draft", None)
    if num_draft is not None:
        _int(num_draft, "--num-draft")
        if not 1 <= num_draft <= MAX_NUM_DRAFT:
            hint = " (use --drafter ar to decode without drafting)" if num_draft == 0 else ""
            raise UsageError(f"--num-draft must be in 1..{MAX_NUM_DRAFT}, got {num_draft}{hint}")
    temperature = getattr(opts, "temperature", 0.0)
    if not _is_number(temperature) or not math.isfinite(temperature) or temperature < 0:
        raise UsageError(f"--temperature must be a finite number >= 0 (0 = greedy), got {temperature}")
    check_num_samples(getattr(opts, "num_samples", 1), temperature)
    top_p = getattr(opts, "top_p", 1.0)
    if not _is_number(top_p) or not (0 < top_p <= 1):  # NaN fails both comparisons
        raise UsageError(f"--top-p must be in (0, 1], got {top_p}")
    threads = getattr(opts, "threads", 0)
    if threads is not None:
        _int(threads, "--threads")
        if threads < 0:
            raise UsageError(f"--threads must be >= 0 (0: chosen by the model's size and the batch), got {threads}")
    threshold = getattr(opts, "stop_threshold", None)
    if threshold is not None and (not _is_number(threshold) or not (0 < threshold < 1)):
        raise UsageError(f"--stop-threshold must be in (0, 1), got {threshold}")
    min_draft = getattr(opts, "min_draft", None)
    if min_draft is not None:
        _int(min_draft, "--min-draft")
        if min_draft < 0:
            raise UsageError(f"--min-draft must be >= 0, got {min_draft}")
    for name, flag in (("tree_tokens", "--tree-tokens"), ("max_draft", "--max-draft"), ("top_k", "--top-k"),
                       ("gen_length", "--gen-length"), ("block_size", "--block-size"), ("steps", "--steps"),
                       ("max_ngram", "--max-ngram")):
        if getattr(opts, name, None) is not None:
            _positive_int(opts, name, flag)
    max_draft = getattr(opts, "max_draft", None)
    if min_draft is not None and max_draft is not None and min_draft > max_draft:
        raise UsageError(f"--min-draft ({min_draft}) must not exceed --max-draft ({max_draft})")
    chunk = getattr(opts, "prefill_chunk", 0)
    _int(chunk, "--prefill-chunk")
    if chunk < 0:
        raise UsageError(f"--prefill-chunk must be >= 0 (0: admitted prompts are prefilled on their own), got {chunk}")
    if chunk and getattr(opts, "schedule", "auto") == "static":
        raise UsageError("--prefill-chunk applies to continuous batching: static batches admit no records mid-way")
    kernels = getattr(opts, "kernels", "auto")
    from specdec.kernels import BACKENDS

    if kernels not in BACKENDS:
        raise UsageError(f"--kernels must be one of {', '.join(BACKENDS)}, got {kernels!r}")


def check_num_samples(num_samples, temperature) -> None:
    """N samples of a record at T = 0 would be N copies of one greedy output: refused, not decoded."""
    _int(num_samples, "--num-samples")
    if num_samples < 1:
        raise UsageError(f"--num-samples must be a positive integer, got {num_samples}")
    if num_samples > 1 and temperature <= 0:
        raise UsageError(f"--num-samples {num_samples} needs --temperature > 0: greedy decoding would give {num_samples} identical samples")


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _int(value, flag: str) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise UsageError(f"{flag} must be an integer, got {value!r}")


def _positive_int(opts, name: str, flag: str) -> None:
    value = getattr(opts, name, None)
    if value is None:
        return
    _int(value, flag)
    if value < 1:
        raise UsageError(f"{flag} must be a positive integer, got {value}")
