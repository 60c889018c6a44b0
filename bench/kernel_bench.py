"""Micro-benchmark of every kernel against its PyTorch reference.

    python -m specdec.bench.kernel_bench --bs 32 --vocab 32000 --k 8 --json out.json
    python -m specdec.bench.kernel_bench --prefix 1000 --prefix 4000 --prefix-tokens 8 --prefix-tokens 256

Times are medians of CUDA-event timings after a warm-up, with L2 flushed before every repeat (the
inputs, ~20 MB of logits, would otherwise sit in an H100's 50 MB L2 and flatter both sides).
Bandwidth is the bytes the kernel must move divided by its time, and its fraction of the device's
peak where the device is in ``PEAK_TBPS``. Each row also checks that the kernel reproduces the
reference on the benchmark's own inputs. Without CUDA only the references are timed.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Annotated, Callable

import torch
import typer

from specdec.decode.engine.verify import Sampling, verify_chain_accelerated, verify_chain_core
from specdec.kernels.diffusion_select import CreditState, select_reference, select_step
from specdec.kernels.prefix_attention import prefix_attention, prefix_attention_reference
from specdec.kernels.tree_attention import tree_attention, tree_attention_reference

# peak HBM bandwidth, TB/s, matched as substrings of torch.cuda.get_device_name() in this order
PEAK_TBPS = (
    ("H200", 4.8),
    ("H100 PCIe", 2.0),
    ("H100 80GB HBM3", 3.35),  # the SXM part's name
    ("H100 SXM", 3.35),
    ("A100 80GB", 2.0),
    ("A100-SXM4-80GB", 2.0),
)
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
L2_FLUSH_BYTES = 256 * 2**20


@dataclass
class Case:
    name: str
    shape: str
    bytes_moved: int  # what the kernel must read and write at least once
    reference: Callable[[], object]
    kernel: Callable[[], object]


@dataclass
class Row:
    name: str
    shape: str
    reference_ms: float
    kernel_ms: float | None = None
    speedup: float | None = None
    gbps: float | None = None
    peak_fraction: float | None = None
    match: bool | None = None


def peak_tbps(device_name: str) -> float | None:
    return next((tbps for key, tbps in PEAK_TBPS if key in device_name), None)


def verify_cases(bs: int, vocab: int, k: int, temperature: float, dtype, device) -> list[Case]:
    logits = torch.randn(bs, k + 1, vocab, device=device).mul_(4).to(dtype)
    draft_logits = logits[:, :k].float() + torch.randn(bs, k, vocab, device=device)
    draft_probs = torch.softmax(draft_logits / temperature, -1)
    tokens = torch.multinomial(draft_probs.flatten(0, 1), 1).view(bs, k)
    u = torch.rand(bs, k + 1, device=device)
    elt = logits.element_size()
    one_pass = bs * (k + 1) * vocab * elt
    cases = []
    for label, sampling, q, extra in (
        ("verify greedy", Sampling(), None, 0),
        ("verify sample one-hot", Sampling(temperature), None, 2 * bs * vocab * elt),
        ("verify sample q", Sampling(temperature), draft_probs, 2 * bs * vocab * (elt + 4)),
    ):
        ua, us = (None, None) if sampling.greedy else (u[:, :k], u[:, k])
        args = (logits, tokens, q, sampling, ua, us)
        cases.append(
            Case(
                name=label,
                shape=f"bs={bs} K={k} V={vocab}",
                bytes_moved=one_pass + extra,  # stage 2 re-reads one row (and its q row) twice
                reference=lambda args=args: verify_chain_core(*args),
                kernel=lambda args=args: verify_chain_accelerated(*args, backend="triton"),
            )
        )
    return cases


def tree_case(bs: int, heads: int, kv_heads: int, head_dim: int, tree: int, seq: int, dtype, device) -> Case:
    q = torch.randn(bs, heads, tree, head_dim, device=device, dtype=dtype)
    k = torch.randn(bs, kv_heads, seq, head_dim, device=device, dtype=dtype)
    v = torch.randn_like(k)
    mask = torch.ones(bs, 1, tree, seq, dtype=torch.bool, device=device)
    mask[..., seq - tree :] = torch.rand(tree, tree, device=device).lt(0.3).tril() | torch.eye(
        tree, dtype=torch.bool, device=device
    )
    elt = q.element_size()
    moved = 2 * k.numel() * elt + q.numel() * elt * 2 + mask.numel()
    return Case(
        name="tree attention",
        shape=f"bs={bs} H={heads}/{kv_heads} D={head_dim} T={tree} S={seq}",
        bytes_moved=moved,
        reference=lambda: tree_attention_reference(q, k, v, mask),
        kernel=lambda: tree_attention(q, k, v, mask, backend="triton"),
    )


def prefix_cases(
    lengths: list[int], tokens: list[int], kv_heads: int, groups: int, head_dim: int, dtype, device
) -> list[Case]:
    """Hydragen's prefix attention: every row's queries of a kv head's group (g x B*T of them, B*T the
    rows times their verify width) over a shared prefix of P keys, per prefix length and B*T."""
    scale = head_dim**-0.5
    cases = []
    for length in lengths:
        k = torch.randn(kv_heads, length, head_dim, device=device, dtype=dtype)
        v = torch.randn_like(k)
        for n in tokens:
            q = torch.randn(kv_heads, groups * n, head_dim, device=device, dtype=dtype)
            # the prefix and the queries read once; out and lse written once in float32
            moved = (2 * k.numel() + q.numel()) * q.element_size() + (q.numel() + q.shape[0] * q.shape[1]) * 4
            cases.append(
                Case(
                    name="prefix attention",
                    shape=f"P={length} Hkv={kv_heads} g={groups} B*T={n} D={head_dim}",
                    bytes_moved=moved,
                    reference=lambda q=q, k=k, v=v: prefix_attention_reference(q, k, v, scale),
                    kernel=lambda q=q, k=k, v=v: prefix_attention(q, k, v, scale, backend="triton"),
                )
            )
    return cases


def diffusion_cases(bs: int, block: int, vocab: int, dtype, device) -> list[Case]:
    logits = torch.randn(bs, block, vocab, device=device).mul_(3).to(dtype)
    masked = torch.rand(bs, block, device=device) < 0.7
    credit = CreditState.empty(bs, block, device=device)
    moved = logits.numel() * logits.element_size()
    cases = []
    for rule, threshold in (("threshold", 0.9), ("factor", 0.0), ("credit", 0.95)):
        state = credit if rule == "credit" else None
        cases.append(
            Case(
                name=f"diffusion {rule}",
                shape=f"bs={bs} L={block} V={vocab}",
                bytes_moved=moved,
                reference=lambda r=rule, t=threshold, c=state: select_reference(logits, masked, r, threshold=t, credit=c),
                kernel=lambda r=rule, c=state: select_step(logits, masked, r, credit=c, backend="triton"),
            )
        )
    return cases


def time_cuda(fn: Callable[[], object], warmup: int, repeats: int) -> float:
    """Median milliseconds, L2 flushed before each repeat."""
    flush = torch.empty(L2_FLUSH_BYTES, dtype=torch.int8, device="cuda")
    for _ in range(warmup):
        fn()
    events = []
    for _ in range(repeats):
        flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        events.append((start, end))
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in events)


def time_cpu(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def same_result(a, b) -> bool:
    """Integer outputs equal, float outputs close (attention: bf16 tolerance)."""
    if isinstance(a, torch.Tensor):
        if a.is_floating_point():
            return torch.allclose(a.float(), b.float(), atol=2e-2, rtol=2e-2)
        return torch.equal(a, b)
    if hasattr(a, "__dataclass_fields__"):
        return all(same_result(getattr(a, f), getattr(b, f)) for f in a.__dataclass_fields__)
    if isinstance(a, (tuple, list)):
        return all(same_result(x, y) for x, y in zip(a, b))
    return a == b


def measure(case: Case, on_cuda: bool, warmup: int, repeats: int, peak: float | None) -> Row:
    if not on_cuda:
        case.reference()  # warm-up
        return Row(case.name, case.shape, reference_ms=time_cpu(case.reference, repeats))
    ref_ms = time_cuda(case.reference, warmup, repeats)
    ker_ms = time_cuda(case.kernel, warmup, repeats)
    gbps = case.bytes_moved / (ker_ms * 1e-3) / 1e9
    return Row(
        case.name,
        case.shape,
        reference_ms=ref_ms,
        kernel_ms=ker_ms,
        speedup=ref_ms / ker_ms,
        gbps=gbps,
        peak_fraction=gbps / (peak * 1e3) if peak else None,
        match=same_result(case.kernel(), case.reference()),
    )


def print_table(rows: list[Row], device_name: str) -> None:
    from rich.console import Console
    from rich.table import Table

    fmt = lambda x, spec: "-" if x is None else format(x, spec)  # noqa: E731
    table = Table(title=f"specdec kernels on {device_name}")
    for col in ("kernel", "shape", "reference ms", "triton ms", "speedup", "GB/s", "% of peak", "matches"):
        table.add_column(col, justify="left" if col in ("kernel", "shape") else "right")
    for r in rows:
        pct = None if r.peak_fraction is None else 100 * r.peak_fraction
        table.add_row(
            r.name, r.shape, fmt(r.reference_ms, ".3f"), fmt(r.kernel_ms, ".3f"), fmt(r.speedup, ".2f"),
            fmt(r.gbps, ".0f"), fmt(pct, ".0f"), "-" if r.match is None else str(r.match),
        )  # fmt: skip
    Console().print(table)


def main(
    bs: Annotated[int, typer.Option(help="batch size")] = 32,
    vocab: Annotated[int, typer.Option(help="vocabulary size")] = 32000,
    k: Annotated[int, typer.Option(help="draft tokens per row")] = 8,
    temperature: Annotated[float, typer.Option(help="sampling temperature")] = 1.0,
    heads: Annotated[int, typer.Option(help="query heads")] = 32,
    kv_heads: Annotated[int, typer.Option(help="key/value heads")] = 8,
    head_dim: Annotated[int, typer.Option(help="head dimension")] = 128,
    tree: Annotated[int, typer.Option(help="tree tokens (<= 64)")] = 64,
    seq: Annotated[int, typer.Option(help="keys: cache plus tree")] = 2048,
    block: Annotated[int, typer.Option(help="diffusion block length")] = 32,
    prefix: Annotated[list[int], typer.Option(help="shared prefix lengths P (repeat the option)")] = [1000, 4000],
    prefix_tokens: Annotated[
        list[int], typer.Option(help="query tokens over the prefix per kv-group head, B*T (repeat the option)")
    ] = [8, 32, 64, 256],
    dtype: Annotated[str, typer.Option(help="bf16 | fp16 | fp32")] = "bf16",
    warmup: Annotated[int, typer.Option(help="warm-up calls")] = 10,
    repeats: Annotated[int, typer.Option(help="timed calls (median reported)")] = 50,
    json_out: Annotated[Path | None, typer.Option("--json", help="write the rows here")] = None,
) -> None:
    on_cuda = torch.cuda.is_available()
    device = torch.device("cuda" if on_cuda else "cpu")
    device_name = torch.cuda.get_device_name(device) if on_cuda else "cpu"
    peak = peak_tbps(device_name) if on_cuda else None
    if not on_cuda:
        typer.echo("The Triton kernels need CUDA: timing the PyTorch references only.")
        repeats = min(repeats, 3)
    torch.manual_seed(0)
    dt = DTYPES[dtype]
    cases = [
        *verify_cases(bs, vocab, k, temperature, dt, device),
        tree_case(bs, heads, kv_heads, head_dim, tree, seq, dt, device),
        *diffusion_cases(bs, block, vocab, dt, device),
        *prefix_cases(prefix, prefix_tokens, kv_heads, heads // kv_heads, head_dim, dt, device),
    ]
    rows = [measure(case, on_cuda, warmup, repeats, peak) for case in cases]
    print_table(rows, device_name)
    if on_cuda and peak is None:
        typer.echo(f"Peak bandwidth of {device_name!r} unknown: GB/s only.")
    if json_out is not None:
        json_out.write_text(json.dumps({"device": device_name, "peak_tbps": peak, "rows": [asdict(r) for r in rows]}, indent=2))


if __name__ == "__main__":
    typer.run(main)
