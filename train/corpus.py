"""The recipes' corpora: the Python source found on this machine.

``stdlib`` is the standard library; ``python`` adds every installed package's ``.py`` files
(site-packages, purelib and platlib). Identical contents are kept once (by sha256), files above a
size cap (generated tables) and files that are not UTF-8 are skipped. Files are split into train /
held-out by a hash of their path relative to the corpus root, so the split is fixed for a given
Python installation; since duplicates are gone before the split, no held-out text is trained on.
The manifest written beside the target records the held-out files with the sha256 of their bytes.
"""

from __future__ import annotations

import hashlib
import os
import site
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path

SOURCES = ("stdlib", "python")


@dataclass
class Corpus:
    root: Path  # every file's name is its path relative to the root
    train_files: list[Path]
    heldout_files: list[Path]
    source: str = "stdlib"
    roots: list[Path] = field(default_factory=list)
    sha256: dict[Path, str] = field(default_factory=dict)
    sizes: dict[Path, int] = field(default_factory=dict)
    skipped: dict[str, int] = field(default_factory=dict)

    def read(self, path: Path) -> str:
        return path.read_text(encoding="utf-8", errors="replace")

    def name(self, path: Path) -> str:
        return path.relative_to(self.root).as_posix()

    def manifest(self) -> dict:
        return {
            "source": self.source,
            "root": str(self.root),
            "roots": [str(r) for r in self.roots],
            "train_files": len(self.train_files),
            "train_bytes": sum(self.sizes.get(p, 0) for p in self.train_files),
            "heldout_files": len(self.heldout_files),
            "heldout_bytes": sum(self.sizes.get(p, 0) for p in self.heldout_files),
            "skipped": dict(self.skipped),
            "distributions": distributions(self),
            "heldout": [{"path": self.name(p), "sha256": self.sha256.get(p), "bytes": self.sizes.get(p)}
                        for p in self.heldout_files],
        }


def source_roots(source: str) -> list[Path]:
    """The folders a corpus source reads: the stdlib, then (``python``) every site-packages folder."""
    if source not in SOURCES:
        from specdec.models.errors import UsageError

        raise UsageError(f"corpus source must be one of {', '.join(SOURCES)}, not {source!r}")
    paths = sysconfig.get_paths()
    roots = [paths["stdlib"]]
    if source == "python":
        roots += [paths["purelib"], paths["platlib"], *site.getsitepackages()]
    out: list[Path] = []
    for r in roots:
        p = Path(r).resolve()
        if p.is_dir() and p not in out:
            out.append(p)
    return out


def load_corpus(source: str = "stdlib", heldout_fraction: float = 0.03, roots: list[Path] | None = None,
                max_file_bytes: int | None = None, max_bytes: int | None = None) -> Corpus:
    """The corpus of ``source`` (or of the folders ``roots``, which replace the source's own: the tests'
    handful of files). ``max_file_bytes`` skips larger files; ``max_bytes`` keeps a deterministic,
    spread-out subset of the training files up to that many bytes."""
    roots = [Path(r).resolve() for r in roots] if roots else source_roots(source)
    root = Path(os.path.commonpath([str(r) for r in roots]))
    files = sorted({path for r in roots for path in _py_files(r)}, key=lambda p: p.relative_to(root).as_posix())
    corpus = Corpus(root=root, train_files=[], heldout_files=[], source=source, roots=roots,
                    skipped={"duplicate": 0, "too_large": 0, "unreadable": 0})
    contents: set[str] = set()
    for path in files:
        try:
            data = path.read_bytes()
            data.decode("utf-8")
        except (OSError, UnicodeDecodeError):
            corpus.skipped["unreadable"] += 1
            continue
        if max_file_bytes is not None and len(data) > max_file_bytes:
            corpus.skipped["too_large"] += 1
            continue
        digest = hashlib.sha256(data).hexdigest()
        if digest in contents:  # the first copy in name order is kept, in whichever split its name falls
            corpus.skipped["duplicate"] += 1
            continue
        contents.add(digest)
        corpus.sha256[path], corpus.sizes[path] = digest, len(data)
        (corpus.heldout_files if _bucket(corpus.name(path)) < heldout_fraction else corpus.train_files).append(path)
    if max_bytes is not None:
        corpus.train_files = _cap(corpus, max_bytes)
    return corpus


def distributions(corpus: Corpus) -> dict:
    """{distribution: {files, bytes, licence}} over the corpus's files: the standard library (PSF-2.0)
    and each installed distribution that owns some of them (its licence from importlib.metadata)."""
    from importlib import metadata

    stdlib = Path(sysconfig.get_paths()["stdlib"]).resolve()
    owner: dict[Path, tuple[str, str]] = {}
    for dist in metadata.distributions():
        base = Path(dist.locate_file("")).resolve()
        if not any(base.is_relative_to(r) or r.is_relative_to(base) for r in corpus.roots):
            continue  # installed elsewhere: none of the corpus's files
        name, licence = dist.metadata.get("Name") or "unknown", _licence(dist.metadata)
        for f in dist.files or ():
            if f.suffix == ".py":
                owner[Path(os.path.normpath(base / f))] = (name, licence)
    out: dict[str, dict] = {}
    for path in corpus.train_files + corpus.heldout_files:
        stated = ("python-stdlib", "PSF-2.0") if path.is_relative_to(stdlib) else ("unknown", "not stated")
        name, licence = owner.get(path) or stated
        entry = out.setdefault(name, {"files": 0, "bytes": 0, "licence": licence})
        entry["files"] += 1
        entry["bytes"] += corpus.sizes.get(path, 0)
    return dict(sorted(out.items()))


def _licence(meta) -> str:
    expression = meta.get("License-Expression")
    if expression:
        return expression
    classifiers = [c.split(" :: ")[-1] for c in meta.get_all("Classifier") or [] if c.startswith("License ::")]
    text = (meta.get("License") or "").strip().splitlines()
    if classifiers:
        return "; ".join(classifiers)
    return text[0][:100] if text else "not stated"


def stdlib_corpus(heldout_fraction: float = 0.03, max_bytes: int | None = None) -> Corpus:
    return load_corpus("stdlib", heldout_fraction, max_bytes=max_bytes)


def _py_files(root: Path):
    # an installation's packages are a root of their own (``python``), never part of the stdlib's
    for folder, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if d not in ("__pycache__", "site-packages", "dist-packages")]
        for n in names:
            if n.endswith(".py"):
                path = Path(folder) / n
                if path.is_file():
                    yield path


def _bucket(name: str) -> float:
    return int(hashlib.sha256(name.encode()).hexdigest()[:8], 16) / 0xFFFFFFFF


def _cap(corpus: Corpus, max_bytes: int) -> list[Path]:
    # every file in hash order until the cap: a spread-out subset that does not depend on file order
    ordered = sorted(corpus.train_files, key=lambda p: corpus.sha256[p])
    out, total = [], 0
    for path in ordered:
        size = corpus.sizes[path]
        if total + size > max_bytes:
            continue
        out.append(path)
        total += size
    return sorted(out, key=corpus.name)


def prose_documents(heldout_fraction: float = 0.03, max_bytes: int | None = None) -> tuple[list[str], list[str]]:
    """English prose found offline: installed distributions' descriptions (their METADATA bodies, the
    README a package shows on its index page), Debian's package READMEs and the common licences.
    Deduplicated by content, split into (train, held-out) by a hash of the document's name, train capped
    at ``max_bytes`` (in hash order, so the subset is spread out and fixed)."""
    import gzip
    from importlib import metadata

    docs: dict[str, str] = {}
    for dist in metadata.distributions():
        body = dist.metadata.get_payload() if hasattr(dist.metadata, "get_payload") else None
        text = body if isinstance(body, str) else (dist.read_text("METADATA") or "").partition("\n\n")[2]
        if text and len(text) > 400:
            docs[f"dist/{dist.metadata.get('Name')}"] = text
    for base in (Path("/usr/share/doc"), Path("/usr/share/common-licenses")):
        if not base.is_dir():
            continue
        for path in sorted(base.rglob("*")):
            name = path.name.lower()
            if not path.is_file() or not (name.startswith("readme") or name.endswith((".md", ".md.gz", ".txt")) or base.name == "common-licenses"):
                continue
            try:
                data = gzip.decompress(path.read_bytes()) if name.endswith(".gz") else path.read_bytes()
                text = data.decode("utf-8")
            except (OSError, UnicodeDecodeError, EOFError, gzip.BadGzipFile):
                continue
            if len(text) > 400:
                docs[str(path)] = text
    seen: set[str] = set()
    train, held = [], []
    for name in sorted(docs, key=lambda n: hashlib.sha256(n.encode()).hexdigest()):
        digest = hashlib.sha256(docs[name].encode()).hexdigest()
        if digest in seen:
            continue
        seen.add(digest)
        (held if _bucket(name) < heldout_fraction else train).append(docs[name])
    if max_bytes is not None:
        out, total = [], 0
        for text in train:
            if total + len(text) > max_bytes:
                continue
            out.append(text)
            total += len(text)
        train = out
    return train, held
