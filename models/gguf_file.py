"""A GGUF file's header read directly: its scalar metadata and tensor table, without its arrays.

gguf's ``GGUFReader`` builds every field up front, which for a 262k-token vocabulary takes about 30 s;
reading the architecture and the tensors' places needs none of the arrays.
"""

from __future__ import annotations

import struct
from pathlib import Path

# GGUF value types: fixed sizes (struct formats), 8 = string, 9 = array
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}


def read_header(path: Path) -> tuple[dict, list[dict]]:
    """(metadata, tensors) of a GGUF file without reading its arrays: metadata holds the scalar and string
    values (arrays are skipped: a 262k-token vocabulary takes gguf's reader 30 s to build), each tensor
    {name, shape (rows first), type, offset (absolute), nbytes}. A malformed file raises ValueError."""
    import mmap

    with open(path, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        pos = 0

        def take(fmt: str):
            nonlocal pos
            value = struct.unpack_from("<" + fmt, buf, pos)
            pos += struct.calcsize("<" + fmt)
            return value[0]

        def string() -> str:
            nonlocal pos
            n = take("Q")
            pos += n
            return bytes(buf[pos - n : pos]).decode("utf-8", errors="replace")

        def skip_or_read(kind: int):
            nonlocal pos
            if kind in _SCALARS:
                return take(_SCALARS[kind])
            if kind == 8:
                return string()
            if kind == 9:
                item, count = take("I"), take("Q")
                if item in _SCALARS:
                    pos += count * struct.calcsize("<" + _SCALARS[item])
                else:
                    for _ in range(count):
                        skip_or_read(item)
                return None
            raise ValueError(f"unknown GGUF value type {kind}")

        if bytes(buf[:4]) != b"GGUF":
            raise ValueError("no GGUF magic number")
        pos = 4
        version, n_tensors, n_kv = take("I"), take("Q"), take("Q")
        if version < 2:
            raise ValueError(f"GGUF version {version} is not supported")
        meta = {}
        for _ in range(n_kv):
            key = string()
            value = skip_or_read(take("I"))
            if value is not None:
                meta[key] = value
        infos = []
        for _ in range(n_tensors):
            name = string()
            dims = [take("Q") for _ in range(take("I"))]
            infos.append({"name": name, "shape": tuple(reversed(dims)), "type": take("I"), "offset": take("Q")})
        align = int(meta.get("general.alignment", 32))
        start = (pos + align - 1) // align * align
        ends = sorted(t["offset"] for t in infos) + [len(buf) - start]
        for t in infos:
            t["offset"] += start
            t["nbytes"] = ends[ends.index(t["offset"] - start) + 1] - (t["offset"] - start)
    return meta, infos
