"""Example inputs shipped with specdec (package data): held-out prompts for ``specdec bench``."""

from __future__ import annotations

from pathlib import Path


def example_path(name: str) -> Path:
    return Path(__file__).resolve().parent / name
