"""The CPU kernel that multiplies by a GGUF file's quantised blocks (``qmatmul.cpp``), built on first use.

It is a C++ torch operator compiled once per source and torch version into a build folder (``$SPECDEC_HOME/ext/``, which
``models.blocks`` passes)
(about a minute on two cores; ``make venv`` builds it at install time). Where it cannot be built or
run (no compiler, no AVX2/FMA/F16C, ``SPECDEC_KERNELS=torch``), ``available()`` is False and every
caller keeps the float32 weights' ``nn.Linear``, which computes the same function.
"""

from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path

import torch

# ggml's type ids of the block formats the kernel reads, and (weights, bytes) per block
BLOCKS = {"Q8_0": (8, 32, 34), "Q5_0": (6, 32, 22), "Q4_K": (12, 256, 144), "Q6_K": (14, 256, 210)}
# specdec's own layouts of the K-quant blocks, unpacked at load (models.blocks): groups of 32 weights with float32 scales
# and Q8_0, Q5_0 blocks and those groups of 16 rows interleaved (``Q8_0_R16``: [N / 16, 17 K] bytes, ``Q5_0_R16``:
# [N / 16, 11 K], ``Q4_K_R16``: [N / 16, 12 K], ``Q6_K_R16``: [N / 16, 20 K], as many bytes as the uninterleaved ones)
UNPACKED = {"Q4_K_X": (1012, 32, 24), "Q6_K_X": (1014, 32, 40), "Q8_0_R16": (1008, 32, 34), "Q5_0_R16": (1006, 32, 22),
            "Q4_K_R16": (1112, 32, 24), "Q6_K_R16": (1114, 32, 40)}
ROWS16 = {UNPACKED[t][0] for t in ("Q8_0_R16", "Q5_0_R16", "Q4_K_R16", "Q6_K_R16")}  # layouts of 16 rows interleaved
QTYPES = {v[0]: k for k, v in {**BLOCKS, **UNPACKED}.items()}
SOURCES = (Path(__file__).with_name("qmatmul.cpp"), Path(__file__).with_name("step.cpp"))  # step.cpp: a decode step's layers in one call
HEADERS = (Path(__file__).with_name("small_attention.h"),)  # included by step.cpp (once per instruction set)


def row_bytes(qtype: int, k: int) -> int:
    _, weights, nbytes = {**BLOCKS, **UNPACKED}[QTYPES[qtype]]
    return k // weights * nbytes


_loaded: bool | None = None  # one answer a process: the operator can be registered only once


def available(build_root: Path) -> bool:
    """The operator is built (under ``build_root``, now if needed) and loaded."""
    global _loaded
    if _loaded is None:
        _loaded = _try_load(build_root)
    return _loaded


def _try_load(build_root: Path) -> bool:
    from specdec.kernels import ENV_VAR

    if os.environ.get(ENV_VAR) == "torch" or sys.platform != "linux":
        return False
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        return False  # the kernel is written with AVX2, FMA and F16C intrinsics
    try:
        _load(build_root)
    except Exception as exc:  # a missing compiler or ninja: the float32 layers compute the same function
        print(f"specdec: the quantised-weight kernel could not be built ({str(exc).strip().splitlines()[-1:]}); "
              "decoding reads float32 weights", file=sys.stderr)
        return False
    return True


# OpenMP: at::parallel_for's threads are torch's own (libgomp.so.1, already loaded by torch)
# no contraction of a * b + c into one rounding: the step's fused loops must round as ATen's separate operations do
CFLAGS, LDFLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-ffp-contract=off", "-fopenmp"], ["-fopenmp"]


def build_folder(build_root: Path) -> Path:
    """Where the operator of these sources, this torch and these flags is built."""
    code = b"".join(source.read_bytes() for source in (*SOURCES, *HEADERS))
    return build_root / f"qmatmul-{hashlib.sha256(code + torch.__version__.encode() + str(CFLAGS).encode()).hexdigest()[:12]}"


def _load(build_root: Path) -> None:
    import fcntl

    from torch.utils import cpp_extension

    build = build_folder(build_root)
    digest = build.name.split("-", 1)[1]
    build.mkdir(parents=True, exist_ok=True)
    # torch marks a build in progress with a file named "lock" and waits, without end, for it to go; a process killed
    # while building leaves it behind. Builders here take an flock first, which the kernel releases when its holder
    # dies, so a "lock" file found while holding it is such a leftover, and is removed
    with open(build / "specdec.flock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        (build / "lock").unlink(missing_ok=True)
        cpp_extension.load(name=f"specdec_qmatmul_{digest}", sources=[str(s) for s in SOURCES], build_directory=str(build),
                           extra_cflags=CFLAGS, extra_ldflags=LDFLAGS, is_python_module=False, verbose=False)


def qmatmul(x: torch.Tensor, blocks: torch.Tensor, qtype: int, k: int) -> torch.Tensor:
    """x [M, K] float32 @ W^T, W [N, K] held as ``blocks`` [N, row bytes] of ggml type ``qtype``."""
    return torch.ops.specdec_q.qmatmul(x, blocks, qtype, k)


def qdequant(blocks: torch.Tensor, qtype: int, k: int) -> torch.Tensor:
    """The float32 weights [N, K] the kernel multiplies by."""
    return torch.ops.specdec_q.qdequant(blocks, qtype, k)


def qscreen(xq: torch.Tensor, xs: torch.Tensor, blocks: torch.Tensor, k: int) -> torch.Tensor:
    """The integer screen of a Q8_0 matrix: ``xs[m] * sum_b d_b * sum_i q_i * xq[m, i]`` for every row, [M, N]
    float32, from 8-bit activations ``xq`` [M, K] (-127..127) and their scales ``xs`` [M]."""
    return torch.ops.specdec_q.qscreen(xq, xs, blocks, k)


def qscreen_isa(xq: torch.Tensor, xs: torch.Tensor, blocks: torch.Tensor, k: int, isa: int) -> torch.Tensor:
    """``qscreen`` by one instruction set: 1 AVX2, 2 AVX-512 VNNI (where ``has_vnni512()``), 0 the fastest here."""
    return torch.ops.specdec_q.qscreen_isa(xq, xs, blocks, k, isa)


def qscreen16(xq: torch.Tensor, xs: torch.Tensor, u: torch.Tensor, k: int) -> torch.Tensor:
    """``qscreen`` of a Q8_0 matrix laid out by ``qpack16`` ([M, rows rounded up to 16]), up to float32 rounding:
    the same integers, 16 rows a register (AVX-512 VNNI: ``has_vnni512()``)."""
    return torch.ops.specdec_q.qscreen16(xq, xs, u, k)


def qpack16(blocks: torch.Tensor, k: int) -> torch.Tensor:
    """A Q8_0 matrix's blocks [N, row bytes] as ``qscreen16`` reads them, [ceil(N / 16), 17 k] bytes: per 16 rows
    and block of 32 columns, their 16 scales, then 8 times the 16 rows' next four weights (each q + 128)."""
    return torch.ops.specdec_q.qpack16(blocks, k)


def set_isa(isa: int) -> int:
    """Every kernel's instruction set from now on: 0 the fastest this CPU has (AVX-512 products, the screen with AMX
    tiles or AVX-512 VNNI), 1 AVX2 alone, 2 AVX-512 without AMX; the previous setting. Tests hold the paths against
    each other."""
    return int(torch.ops.specdec_q.set_isa(isa))


def has_amx() -> bool:
    """This CPU has AMX's int8 tiles and the process may use them: the screen's fastest path (``qscreen16``)."""
    return bool(torch.ops.specdec_q.has_amx())


def isa512() -> bool:
    """The float32 products run with AVX-512 now."""
    return bool(torch.ops.specdec_q.isa512())


def has_vnni512() -> bool:
    """This CPU runs the screen's AVX-512 VNNI path."""
    return torch.ops.specdec_q.has_vnni512()


def qrows(x: torch.Tensor, blocks: torch.Tensor, qtype: int, k: int, rows: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """``qmatmul(x, blocks, qtype, k)[pos, rows]``, bit for bit, reading only those rows."""
    return torch.ops.specdec_q.qrows(x, blocks, qtype, k, rows, pos)


def qquant(h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A screen's inputs from float32 ``h`` [M, K]: 8-bit ``q`` [M, K], scales ``s`` [M] (h ~ s q), and the float64
    norms [M, 3] of h - s q, s q and h."""
    return torch.ops.specdec_q.qquant(h)


def argmax(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(-1)``, the same indices (the first of equal maxima; a row's first NaN where it has one), in one
    vector pass spread over the threads (``argmax_rows``) for a float32 CPU tensor whose operator is loaded (a
    GGUF target's); torch's own otherwise. A greedy verification of 8 positions of Gemma 3's 262k vocabulary
    spends 1.6 ms in torch's argmax on 2 cores."""
    if _loaded and x.dtype == torch.float32 and x.device.type == "cpu" and x.dim() >= 1 and x.is_contiguous() \
            and 0 < x.shape[-1] < 2 ** 31 and x.numel() >= 4096:
        return torch.ops.specdec_q.argmax_rows(x.view(-1, x.shape[-1])).view(x.shape[:-1])
    return x.argmax(-1)


def qcandidates(z: torch.Tensor, margin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(positions, tokens) of the entries of ``z`` [M, N] at least their row's maximum minus ``margin`` [M]."""
    return torch.ops.specdec_q.qcandidates(z, margin)
