"""YAML recipes: each file's header shows the command that runs it."""

from __future__ import annotations

from pathlib import Path

RECIPES_DIR = Path(__file__).parent


def list_recipes() -> list[str]:
    return sorted(p.stem for p in RECIPES_DIR.glob("*.yaml"))


def recipe_path(name: str) -> Path:
    path = RECIPES_DIR / f"{name}.yaml"
    if not path.exists():
        from specdec.models.artifacts import UsageError

        raise UsageError(f"no recipe named {name!r}; known: {', '.join(list_recipes())}")
    return path
