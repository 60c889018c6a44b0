"""The embedded corpus: the Python standard library source found on this machine.

Files are split into train / held-out by a hash of their relative path, so the split is fixed
for a given Python installation and recorded in the artifact (held-out files are never trained on).
"""

from __future__ import annotations

import hashlib
import sysconfig
from dataclasses import dataclass
from pathlib import Path


@dataclass
class Corpus:
    root: Path
    train_files: list[Path]
    heldout_files: list[Path]

    def read(self, path: Path) -> str:
        return path.read_text(encoding="utf-8", errors="replace")

    def manifest(self) -> dict:
        return {
            "root": str(self.root),
            "train_files": len(self.train_files),
            "heldout": [str(p.relative_to(self.root)) for p in self.heldout_files],
        }


def stdlib_corpus(heldout_fraction: float = 0.03, max_bytes: int | None = None) -> Corpus:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts and p.is_file())
    train, heldout = [], []
    for path in files:
        rel = str(path.relative_to(root))
        bucket = int(hashlib.sha256(rel.encode()).hexdigest()[:8], 16) / 0xFFFFFFFF
        (heldout if bucket < heldout_fraction else train).append(path)
    if max_bytes is not None:
        train = _cap(train, max_bytes)
    return Corpus(root=root, train_files=train, heldout_files=heldout)


def _cap(files: list[Path], max_bytes: int) -> list[Path]:
    # keep a deterministic, spread-out subset: every file in hash order until the cap
    ordered = sorted(files, key=lambda p: hashlib.sha256(str(p).encode()).hexdigest())
    out, total = [], 0
    for path in ordered:
        size = path.stat().st_size
        if total + size > max_bytes:
            continue
        out.append(path)
        total += size
    return sorted(out)
