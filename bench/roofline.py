"""How far a decoding method runs from the hardware's limit.

Decoding a few rows at a time is bound by memory bandwidth: every forward reads all the weights
once and each row's KV cache. A method's achieved bandwidth is the bytes its forwards had to read
(target weights per batch forward, KV per row and forward, and a draft model's weights per draft
forward) over its wall time; ``peak_bandwidth`` measures what a plain copy reaches on the device at
the start of the run, beside the nominal figure of known GPUs. The fraction of the two says how
much room a faster engine has left; it cannot exceed 1 by much (caches can serve part of the reads
of a small model on a CPU, so small CPU models may show more than the copy's figure).
"""

from __future__ import annotations

import statistics
import time

import torch

from specdec.decode.jobs.memory import kv_bytes_per_token, param_bytes

# nominal HBM bandwidth, bytes/s, of GPUs by their device name (a substring)
NOMINAL_BANDWIDTH = {
    "H200": 4.8e12,
    "H100 SXM": 3.35e12,
    "H100 NVL": 3.9e12,
    "H100 PCIe": 2.0e12,
    "H100": 3.35e12,
    "A100-SXM4-80GB": 2.039e12,
    "A100-SXM4-40GB": 1.555e12,
    "A100": 1.555e12,
    "L40S": 8.64e11,
    "A10G": 6.0e11,
    "L4": 3.0e11,
}


def nominal_bandwidth(device) -> float | None:
    if torch.device(device).type != "cuda":
        return None
    name = torch.cuda.get_device_name(torch.device(device))
    return next((bw for key, bw in NOMINAL_BANDWIDTH.items() if key in name), None)


def peak_bandwidth(device, megabytes: int = 512, repeats: int = 5) -> float:
    """Bytes/s of a large device-to-device copy (each byte read once and written once), the median of
    ``repeats``: the bandwidth a bandwidth-bound forward can hope for on this device."""
    device = torch.device(device)
    n = megabytes * (1 << 20) // 4
    src = torch.ones(n, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    dst.copy_(src)
    sync()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        sync()
        times.append(time.perf_counter() - t0)
    del src, dst
    return 2 * n * 4 / statistics.median(times)


def weight_bytes_read(model, blocks: bool = True) -> int:
    """Bytes of the weights a forward reads: all of them but the input embedding table, of which a
    forward reads only its tokens' rows (a table tied to the output projection is read whole there).
    With ``blocks``, layers a GGUF target multiplies from the file's blocks count their blocks' bytes."""
    total = param_bytes(model)  # parameters() counts a tied table once
    embed = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    out = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if embed is not None and (out is None or out.weight is not embed.weight):
        total -= embed.weight.numel() * embed.weight.element_size()
    state = getattr(model, "_specdec_blocks", None) if model is not None else None
    if blocks and state is not None:
        total += state.bytes - state.dense_bytes
    return total


def bytes_read(stats: list[dict], prompt_lens: list[int], batch_size: int, model, draft=None, blocks: bool = True) -> dict:
    """Bytes the forwards of one pass had to read: the target's weights once per batch forward (a
    batch runs as many forwards as its longest row needs), each row's cache once per forward it took
    part in (at its average context length), and a draft model's weights once per drafted position."""
    weights, kv_token = weight_bytes_read(model, blocks), kv_bytes_per_token(model)
    forwards = kv = drafts = 0
    for lo in range(0, len(stats), batch_size):
        chunk = range(lo, min(lo + batch_size, len(stats)))
        forwards += max(stats[i].get("target_calls", 0) for i in chunk)
        drafts += max(stats[i].get("drafted_tokens", 0) for i in chunk)
        for i in chunk:
            context = prompt_lens[i] + stats[i].get("new_tokens", 0) / 2
            kv += stats[i].get("target_calls", 0) * context * kv_token
    total = forwards * weights + kv + (drafts * weight_bytes_read(draft) if draft is not None else 0)
    return {"target_forwards": forwards, "bytes": total, "weight_bytes": weights}


def roofline(stats, prompt_lens, batch_size, wall_s: float, peak: float, model, draft=None, blocks: bool = True) -> dict:
    """The report's roofline fields for one method: bytes per target forward, achieved bandwidth
    (GB/s) and its fraction of the measured peak."""
    read = bytes_read(stats, prompt_lens, batch_size, model, draft, blocks)
    achieved = read["bytes"] / wall_s if wall_s > 0 else 0.0
    return {
        "target_forwards": read["target_forwards"],
        "bytes_per_forward": round(read["bytes"] / max(read["target_forwards"], 1)),
        "achieved_gbps": round(achieved / 1e9, 3),
        "peak_fraction": round(achieved / peak, 4) if peak else None,
    }
