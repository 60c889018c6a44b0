"""A GGUF target's linear layers multiplied straight from the file's quantised blocks, with the same weights.

A GGUF target is decoded as the float32 model transformers dequantises from the file (``models.gguf``).
That model's weights are, bit for bit, what gguf's dequantisation makes of each block, so the blocks
themselves are an exact, 4-8x smaller encoding of them. On a CPU a decode step is bound by the bytes
it reads (Gemma 3 270M: 400 MB of float32 body and a 671 MB output layer a token, against about
270 MB of blocks), so inside specdec's engine each such layer multiplies by its blocks with
``kernels.qmatmul`` (float32 arithmetic on the rebuilt weights) for forwards of up to ``MAX_ROWS``
positions; prefill, wide forwards, training and transformers' own ``generate`` use the float32
weights as before.

The blocks are found by content, not by name: a GGUF tensor whose dequantised bytes equal a float32
weight's bytes is that weight's encoding, and one whose rows are the weight's rows in another order
(transformers reorders Llama's query and key rows on load) encodes it with its block rows reordered; a
tensor transformed otherwise matches nothing and keeps its float32 path. They are kept beside the converted folder's weights in
``BLOCKS_FILE`` (``models.gguf`` writes it when it converts a file, or on first load for a folder
converted before, when the GGUF it came from is still at hand).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from pathlib import Path

import torch

from specdec.kernels import qmatmul as kernel

BLOCKS_FILE = "specdec_blocks.safetensors"
# positions up to which the blocks beat MKL's float32 GEMM: a Gemma 3 270M greedy forward of 24, 32 and 48 positions took
# 85, 115 and 170 ms on them against 125, 147 and 177 ms on the float32 weights (2-core Xeon, same process)
MAX_ROWS = 48


def kernel_ready() -> bool:
    """The kernel is built (building it under ``$SPECDEC_HOME/ext`` on first use) and runs here."""
    from specdec.models.env import specdec_home

    return kernel.available(specdec_home() / "ext")


def _digest(array) -> str:
    return hashlib.sha1(memoryview(array).cast("B")).hexdigest()


def extract(gguf_path: Path, weights: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, int]]:
    """(blocks by weight name [N, row bytes] uint8, ggml type by weight name) for every float32 2-D
    weight of ``weights`` that some block tensor of the file dequantises to exactly."""
    import numpy as np
    from gguf import GGMLQuantizationType, dequantize

    from specdec.models.gguf_file import read_header

    by_digest: dict[tuple, list[str]] = {}  # several weights may hold the same values (a tied copy)
    for name, w in weights.items():
        if w.dim() == 2 and w.dtype == torch.float32:
            by_digest.setdefault((tuple(w.shape), _digest(w.contiguous().numpy())), []).append(name)
    blocks, types = {}, {}
    unmatched = []
    fast = kernel_ready()
    file = np.memmap(str(gguf_path), dtype=np.uint8, mode="r")
    for t in read_header(Path(gguf_path))[1]:
        qtype = t["type"]
        if qtype not in FILE_TYPES or len(t["shape"]) != 2:
            continue
        n, k = t["shape"]
        if k % kernel.BLOCKS[kernel.QTYPES[qtype]][1]:
            continue
        size = n * kernel.row_bytes(qtype, k)
        raw = np.asarray(file[t["offset"] : t["offset"] + size]).reshape(n, -1)
        if fast:  # the kernel's own dequantisation: gguf's values bit for bit (tests/test_blocks.py), several times faster
            dense = kernel.qdequant(torch.from_numpy(raw.copy()), qtype, k).numpy()
        else:
            dense = np.ascontiguousarray(dequantize(raw, GGMLQuantizationType(qtype)), dtype=np.float32).reshape(n, k)
        names = [m for m in by_digest.get(((n, k), _digest(dense)), []) if m not in blocks]
        if not names:
            unmatched.append((raw, qtype, dense))
            continue
        for name in names:
            blocks[name] = torch.from_numpy(raw.copy())
            types[name] = qtype
    # transformers reorders the rows of some matrices on load (Llama's query and key rotary layout): a
    # weight whose rows are a file tensor's rows in another order is encoded by those rows' blocks
    taken = set(blocks)
    for raw, qtype, dense in unmatched:
        rows = {_digest(r): i for i, r in enumerate(dense)}
        for name, w in weights.items():
            if name in taken or tuple(w.shape) != dense.shape or w.dtype != torch.float32:
                continue
            order = [rows.get(_digest(r)) for r in w.contiguous().numpy()]
            if None not in order:
                blocks[name] = torch.from_numpy(raw[order].copy())
                types[name] = qtype
                taken.add(name)
                break
    return blocks, types


def write(gguf_path: Path, folder: Path, weights: dict[str, torch.Tensor]) -> int:
    """Write ``folder/BLOCKS_FILE`` (atomically); the number of weights it encodes."""
    from safetensors.torch import save_file

    blocks, types = extract(gguf_path, weights)
    tmp = folder / f".{BLOCKS_FILE}.partial"
    save_file(blocks, str(tmp), metadata={"qtypes": json.dumps(types)})
    os.replace(tmp, folder / BLOCKS_FILE)
    return len(blocks)


Q5_0, Q8_0, Q4_K, Q6_K = (kernel.BLOCKS[t][0] for t in ("Q5_0", "Q8_0", "Q4_K", "Q6_K"))
Q4_K_X, Q6_K_X = kernel.UNPACKED["Q4_K_X"][0], kernel.UNPACKED["Q6_K_X"][0]
Q8_0_R16, Q5_0_R16 = kernel.UNPACKED["Q8_0_R16"][0], kernel.UNPACKED["Q5_0_R16"][0]
Q4_K_R16, Q6_K_R16 = kernel.UNPACKED["Q4_K_R16"][0], kernel.UNPACKED["Q6_K_R16"][0]
FILE_TYPES = {v[0] for v in kernel.BLOCKS.values()}  # the ggml types a file's tensors may have (the others are specdec's own)


def _fp16(two_bytes: torch.Tensor) -> torch.Tensor:
    """[n, 2] uint8 little-endian half-precision numbers as float32 [n]."""
    return two_bytes.contiguous().view(torch.float16).float().reshape(-1)


def q4_k_unpacked(blocks: torch.Tensor) -> torch.Tensor:
    """Q4_K blocks as the kernel's Q4_K_X groups of the same weights: per 32 weights the float32 products
    d * scale and dmin * min (exact: an 11-bit and a 6-bit significand), then 16 bytes holding weight i in
    the low nibble of byte i and weight 16 + i in its high one. 24 bytes for 32 weights instead of 18, but
    the kernel no longer decodes each group's packed 6-bit scale and minimum, which bound it below the
    memory's rate."""
    rows = blocks.shape[0]
    b = blocks.reshape(-1, 144)
    d, dmin = _fp16(b[:, 0:2]), _fp16(b[:, 2:4])
    sc = b[:, 4:16].to(torch.int32)
    low = [sc[:, g] & 63 for g in range(4)], [sc[:, g + 4] & 63 for g in range(4)]
    high = ([(sc[:, g + 8] & 0x0F) | ((sc[:, g] >> 6) << 4) for g in range(4)],
            [(sc[:, g + 8] >> 4) | ((sc[:, g + 4] >> 6) << 4) for g in range(4)])
    scales = torch.stack(low[0] + high[0], 1).float()  # [n, 8], group g's scale and min, as llama.cpp's get_scale_min_k4
    mins = torch.stack(low[1] + high[1], 1).float()
    qs = b[:, 16:].reshape(-1, 4, 32)  # 32 bytes per pair of groups: the even group's low nibbles, the odd one's high
    nib = torch.stack([qs & 0x0F, qs >> 4], 2).reshape(-1, 8, 32)  # [n, group, weight]
    packed = nib[..., :16] | (nib[..., 16:] << 4)
    floats = torch.stack([d[:, None] * scales, dmin[:, None] * mins], -1).contiguous()  # [n, 8, 2]
    out = torch.cat([floats.view(torch.uint8), packed.to(torch.uint8)], -1)  # [n, 8, 24]
    return out.reshape(rows, -1).contiguous()


def q6_k_unpacked(blocks: torch.Tensor) -> torch.Tensor:
    """Q6_K blocks as the kernel's Q6_K_X groups of the same weights: per 32 weights the float32 products
    d * scale of their two halves (exact: an 11-bit and an 8-bit significand), then the 32 six-bit values
    minus 32 as signed bytes. 40 bytes for 32 weights instead of 26.25, read at about the rate of Q8_0's,
    where the bit gathering held Q6_K at a third of it."""
    rows = blocks.shape[0]
    b = blocks.reshape(-1, 210)
    ql, qh = b[:, :128].to(torch.int16), b[:, 128:192].to(torch.int16)
    sc = b[:, 192:208].view(torch.int8).float()
    d = _fp16(b[:, 208:210])
    groups = []
    for g in range(8):
        h, r = divmod(g, 4)
        lo = ql[:, 64 * h + 32 * (r & 1) : 64 * h + 32 * (r & 1) + 32]
        l4 = (lo >> (4 * (r >> 1))) & 0x0F
        h2 = (qh[:, 32 * h : 32 * h + 32] >> (2 * r)) & 0x03
        groups.append((l4 | (h2 << 4)) - 32)
    q = torch.stack(groups, 1).to(torch.int8).view(torch.uint8)  # [n, 8, 32]
    floats = (d[:, None] * sc).reshape(-1, 8, 2).contiguous()  # scales 2g and 2g + 1: the group's two halves
    out = torch.cat([floats.view(torch.uint8), q], -1)  # [n, 8, 40]
    return out.reshape(rows, -1).contiguous()


def q8_0_rows16(blocks: torch.Tensor) -> torch.Tensor:
    """Q8_0 blocks [N, row bytes] (N a multiple of 16) with 16 rows interleaved, as the kernel's ``Q8_0_R16`` reads
    them: per 16 rows and block of 32 columns, the 16 rows' scales, then column by column the 16 rows' bytes. The
    same bytes in another order, [N / 16, 17 K]: a column of 16 rows is one register of weights, so each row's
    products stay in one lane (no reduction a row), and a block's 16 scales are converted at once."""
    n = blocks.shape[0]
    b = blocks.reshape(n // 16, 16, -1, 34)  # [G, row, block, bytes]
    scales = b[..., :2].permute(0, 2, 1, 3).reshape(n // 16, -1, 32)  # [G, block, 16 x 2 bytes]
    cols = b[..., 2:].permute(0, 2, 3, 1).reshape(n // 16, -1, 512)  # [G, block, 32 columns x 16 rows]
    return torch.cat([scales, cols], -1).reshape(n // 16, -1).contiguous()


def q5_0_rows16(blocks: torch.Tensor) -> torch.Tensor:
    """Q5_0 blocks [N, row bytes] (N a multiple of 16) with 16 rows interleaved, as the kernel's ``Q5_0_R16`` reads
    them: per 16 rows and block of 32 columns, the 16 rows' scales, each column's 16 fifth bits as a 16-bit mask, then
    each column pair's 16 bytes of nibbles as the file holds them. The same 22 bytes a row's 32 weights, [N / 16, 11 K]."""
    n = blocks.shape[0]
    b = blocks.reshape(n // 16, 16, -1, 22)  # [G, row, block, bytes]
    scales = b[..., :2].permute(0, 2, 1, 3).reshape(n // 16, -1, 32)  # [G, block, 16 x 2 bytes]
    qh = b[..., 2:6].contiguous().view(torch.int32).to(torch.int64)[..., 0]  # [G, row, block]: bit j of weight j
    fifth = (qh[..., None] >> torch.arange(32)) & 1  # [G, row, block, column]
    masks = (fifth.permute(0, 2, 3, 1) << torch.arange(16)).sum(-1)  # [G, block, column]: bit r of row r
    masks = masks.to(torch.int16).view(torch.uint8).reshape(n // 16, -1, 64)
    pairs = b[..., 6:].permute(0, 2, 3, 1).reshape(n // 16, -1, 256)  # [G, block, 16 pairs x 16 rows]
    return torch.cat([scales, masks, pairs], -1).reshape(n // 16, -1).contiguous()


def k_quant_rows16(groups: torch.Tensor, qtype: int) -> torch.Tensor:
    """Q4_K_X or Q6_K_X groups [N, row bytes] (N a multiple of 16) with 16 rows interleaved, as the kernel's
    ``Q4_K_R16`` and ``Q6_K_R16`` read them: per 16 rows and group of 32 columns, the rows' first float scales, their
    second ones (Q4_K: d * scale, then d * min; Q6_K: the two halves' d * scale), then the 16 rows' bytes column by
    column (Q4_K: each column pair's byte of nibbles). The same bytes in another order."""
    n = groups.shape[0]
    width = 24 if qtype == Q4_K_X else 40
    b = groups.reshape(n // 16, 16, -1, width)  # [G, row, group, bytes]
    first = b[..., 0:4].permute(0, 2, 1, 3).reshape(n // 16, -1, 64)  # [G, group, 16 rows x 4 bytes]
    second = b[..., 4:8].permute(0, 2, 1, 3).reshape(n // 16, -1, 64)
    cols = b[..., 8:].permute(0, 2, 3, 1).reshape(n // 16, -1, 16 * (width - 8))  # [G, group, column x 16 rows]
    return torch.cat([first, second, cols], -1).reshape(n // 16, -1).contiguous()


def rows16(blocks: torch.Tensor, qtype: int) -> tuple[torch.Tensor, int]:
    """A matrix's blocks (a file's Q8_0 or Q5_0, or the K-quants' unpacked groups) interleaved 16 rows at a time, and
    the kernel's type of that layout."""
    if qtype == Q5_0:
        return q5_0_rows16(blocks), Q5_0_R16
    if qtype == Q8_0:
        return q8_0_rows16(blocks), Q8_0_R16
    return k_quant_rows16(blocks, qtype), Q4_K_R16 if qtype == Q4_K_X else Q6_K_R16


def q5_0_as_q8_0(blocks: torch.Tensor) -> torch.Tensor:
    """Q5_0 blocks rewritten as Q8_0 blocks of the same weights: each 5-bit value minus 16 as a byte, the
    same half-precision scale. 34 bytes for 32 weights instead of 22, for the matrices that keep their rows in
    order (an output layer's screen reads Q8_0; a row-at-a-time kernel unpacks 5-bit values at about half the
    rate it reads bytes). Matrices of rows a multiple of 16 read their own 22 bytes instead (``q5_0_rows16``)."""
    rows = blocks.shape[0]
    b = blocks.reshape(-1, 22)
    qh = b[:, 2:6].contiguous().view(torch.int32).to(torch.int64)  # 32 high bits, little-endian
    qs = b[:, 6:22].to(torch.int16)
    bits = (qh >> torch.arange(32)) & 1
    q = torch.cat([qs & 0x0F, qs >> 4], dim=1) | (bits.to(torch.int16) << 4)
    out = torch.cat([b[:, :2], (q - 16).to(torch.int8).view(torch.uint8)], dim=1)
    return out.reshape(rows, -1).contiguous()


class BlockLayers:
    """The blocks of a model's linear layers and the switch that routes their forwards to the kernel."""

    def __init__(self):
        self.enabled = False
        self.suspended = False  # ``suspended``: the float32 weights even inside the engine (a bench method's +weights=float32)
        self.layers = 0
        self.bytes = 0  # the blocks' bytes, and the float32 weights' they stand for (each read once a forward)
        self.dense_bytes = 0

    @property
    def active(self) -> bool:
        return self.enabled and not self.suspended

    def add(self, blocks: torch.Tensor, weight: torch.Tensor) -> None:
        """Count a layer whose float32 ``weight`` is read as ``blocks``."""
        self.layers += 1
        self.bytes += blocks.numel() * blocks.element_size()
        self.dense_bytes += weight.numel() * weight.element_size()


@contextlib.contextmanager
def suspended(model, on: bool = True):
    """Within (with ``on``): ``model``'s layers read their float32 weights inside the engine too."""
    state = getattr(model, "_specdec_blocks", None)
    if state is None or not on:
        yield
        return
    before, state.suspended = state.suspended, True
    try:
        yield
    finally:
        state.suspended = before


def install(model, source: str | os.PathLike) -> BlockLayers | None:
    """Route every float32 CPU ``nn.Linear`` of ``model`` whose weight the source folder's blocks encode
    through the kernel while ``scope`` is on; None where nothing applies (not a GGUF target, no blocks,
    no kernel, weights not float32 on a CPU)."""
    existing = getattr(model, "_specdec_blocks", None)
    if existing is not None:
        return existing
    folder = Path(source)
    if not (folder / BLOCKS_FILE).is_file() or not kernel_ready():
        return None
    from safetensors import safe_open

    with safe_open(str(folder / BLOCKS_FILE), "pt") as fh:
        types = json.loads((fh.metadata() or {}).get("qtypes", "{}"))
        params = dict(model.named_parameters(remove_duplicate=False))
        by_ptr: dict[int, tuple[torch.Tensor, int]] = {}
        for name, qtype in types.items():
            p = params.get(name)
            if p is None or p.dtype != torch.float32 or p.device.type != "cpu" or p.dim() != 2:
                continue
            blocks = fh.get_tensor(name).contiguous()
            if blocks.shape != (p.shape[0], kernel.row_bytes(qtype, p.shape[1])):
                continue
            if qtype == Q4_K:  # Q5_0 stays as it is here: a matrix read 16 rows at a time keeps its 22 bytes (below)
                blocks, qtype = q4_k_unpacked(blocks), Q4_K_X
            elif qtype == Q6_K:
                blocks, qtype = q6_k_unpacked(blocks), Q6_K_X
            by_ptr[p.data_ptr()] = (blocks, int(qtype))
    if not by_ptr:
        return None
    state = BlockLayers()
    head = getattr(model, "_specdec_head", None)
    output = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    for module in model.modules():
        if not isinstance(module, torch.nn.Linear) or type(module).forward is not torch.nn.Linear.forward:
            continue
        raw = by_ptr.get(module.weight.data_ptr())
        if raw is None:
            continue

        def in_order(raw=raw):  # the rows in file order: a Q5_0 weight widened to Q8_0 blocks
            return (q5_0_as_q8_0(raw[0]), Q8_0) if raw[1] == Q5_0 else raw

        is_head = head is not None and head.linear is module
        # every matrix is read 16 rows at a time (a Q5_0 one in its own 22 bytes per 32 weights), but the output
        # layer's rows stay in order for its screen and candidates (models.head)
        interleaved = not is_head and raw[0].shape[0] % 16 == 0
        found = rows16(*raw) if interleaved else in_order()
        state.add(found[0], module.weight)  # the bytes a forward reads
        if not interleaved or module is output:
            # for a drafter that reads some of its rows (models.heads._TargetHead): the output layer's, in order
            module._specdec_rows = (in_order() if interleaved else found, state)
        if is_head:
            head.blocks, head.block_state = found, state  # the output layer's own dispatcher reads them (models.head)
            continue
        _route(module, found[0], found[1], state)
    model._specdec_blocks = state
    return state


def quantize_layers(module: torch.nn.Module) -> BlockLayers | None:
    """Route ``module``'s float32 CPU ``nn.Linear`` layers (inputs a multiple of 32 wide) through the kernel on
    Q8_0 blocks of their weights, made by gguf's own quantisation (8-bit values and a half-precision scale per
    32 weights): a drafter's matrices in 34 bytes per 32 weights instead of 128, which a draft call on a CPU
    reads at a few rows each time. The drafter then computes a slightly different function (its drafts may
    change, never the output: verification decides). None without the kernel or such layers."""
    if not kernel_ready():
        return None
    from gguf import GGMLQuantizationType, quants

    state = BlockLayers()
    state.enabled = True
    for m in module.modules():
        w = getattr(m, "weight", None)
        if not isinstance(m, torch.nn.Linear) or type(m).forward is not torch.nn.Linear.forward or hasattr(m, "_specdec_blocks") \
                or w.dtype != torch.float32 or w.device.type != "cpu" or m.in_features % 32:
            continue
        blocks = torch.from_numpy(quants.quantize(w.detach().numpy(), GGMLQuantizationType.Q8_0).copy())
        state.add(blocks, w)
        _route(m, blocks, Q8_0, state)
    return state if state.layers else None


def _route(linear: torch.nn.Linear, blocks: torch.Tensor, qtype: int, state: BlockLayers) -> None:
    original = linear.forward
    k = linear.in_features

    def forward(x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // k
        if not state.active or rows > MAX_ROWS or x.dtype != torch.float32 or torch.compiler.is_compiling():
            return original(x)
        y = kernel.qmatmul(x.reshape(rows, k), blocks, qtype, k)
        if linear.bias is not None:
            y = y + linear.bias
        return y.reshape(*x.shape[:-1], y.shape[-1])

    linear.forward = forward
    linear._specdec_blocks = (blocks, qtype)  # what a decode step run outside Python reads (decode.engine.direct)


def matmul(x2d: torch.Tensor, found: tuple[torch.Tensor, int]) -> torch.Tensor:
    """x [M, K] @ W^T from W's blocks."""
    return kernel.qmatmul(x2d, found[0], found[1], x2d.shape[1])
