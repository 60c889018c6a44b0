"""Where specdec keeps what it builds, and how quiet transformers is while specdec loads: the leaf every
model-layer module may import."""

from __future__ import annotations

import os
import sys
from pathlib import Path


def specdec_home() -> Path:
    return Path(os.environ.get("SPECDEC_HOME", Path.home() / ".cache" / "specdec"))


def quiet_progress() -> None:
    """transformers' per-load progress bars stay on a terminal; in logs and pipelines they are noise
    around specdec's own progress and its one-line errors."""
    if not sys.stderr.isatty():
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
