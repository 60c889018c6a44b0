"""Hydragen's prefix attention kernel (kernels.prefix_attention) against its bmm reference, inside
``prefix_suffix_attention``, and decoding a prefix held once with it.

Without a GPU the kernel runs in Triton's interpreter on CPU tensors (TRITON_INTERPRET=1, conftest);
on a GPU machine the same tests run the compiled kernel on CUDA tensors. bf16 is checked on a GPU only:
the interpreter keeps bf16 as raw uint16 and multiplies those integers in ``tl.dot``.
"""

import pytest
import torch
from conftest import ByteTokenizer, tiny_llama
from test_shared_prefix import _prompts

from specdec.decode.engine import hydragen
from specdec.decode.engine.loop import SpecEngine
from specdec.decode.engine.types import GenRequest

pytest.importorskip("triton")

from specdec.kernels import prefix_attention as kernel  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOLERANCE = {torch.float64: 1e-6, torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


@pytest.fixture(autouse=True)
def _no_backend_override(monkeypatch):
    monkeypatch.delenv("SPECDEC_KERNELS", raising=False)


def _inputs(kv_heads, rows, length, dim, dtype, device=DEVICE, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(kv_heads, n, dim, generator=g) for n in (rows, length, length))
    return q.to(device, dtype), k.to(device, dtype), v.to(device, dtype)


def _assert_matches_reference(q, k, v, scale, num_splits=None):
    out, lse = kernel.prefix_attention(q, k, v, scale, backend="triton", num_splits=num_splits)
    want_out, want_lse = kernel.prefix_attention_reference(q, k, v, scale)
    assert out.dtype == want_out.dtype == torch.promote_types(q.dtype, torch.float32) and lse.dtype == out.dtype
    tol = TOLERANCE[q.dtype]
    torch.testing.assert_close(out, want_out, atol=tol, rtol=tol)
    torch.testing.assert_close(lse, want_lse, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.float64], ids=str)
@pytest.mark.parametrize(
    "kv_heads,rows,length,dim,num_splits",
    [
        (2, 1, 1, 16, None),  # one query, one key
        (2, 7, 70, 32, None),  # P not a multiple of the 64-key tile
        (1, 200, 150, 64, None),  # two blocks of queries
        (2, 33, 300, 128, 3),  # P split across programs, merged by log-sum-exp
        (3, 5, 129, 16, 2),  # splits of whole tiles: the last one holds one key
        pytest.param(2, 3, 0, 16, None, marks=pytest.mark.filterwarnings("ignore:divide by zero")),  # no prefix: out 0, lse -inf
    ],
)
def test_kernel_matches_the_reference(dtype, kv_heads, rows, length, dim, num_splits):
    _assert_matches_reference(*_inputs(kv_heads, rows, length, dim, dtype), scale=dim**-0.5, num_splits=num_splits)


def test_strided_inputs_are_read_as_they_are():
    q, k, v = _inputs(4, 9, 80, 32, torch.float32)
    # every other head: non-contiguous views the kernel reads through their strides
    _assert_matches_reference(q[::2], k[::2], v[::2], scale=0.3)
    _assert_matches_reference(q.transpose(0, 1).contiguous().transpose(0, 1), k, v, scale=0.3)


def test_auto_runs_the_reference_off_cuda(monkeypatch):
    def refuse(*args):
        raise AssertionError("the kernel ran on a CPU under 'auto'")

    monkeypatch.setattr(kernel, "_prefix_attention_triton", refuse)
    q, k, v = _inputs(2, 4, 20, 16, torch.float32, device="cpu")
    kernel.prefix_attention(q, k, v, 0.25, backend="auto")


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("boolean", [False, True])
def test_prefix_suffix_attention_with_the_kernel_matches_torch(dtype, boolean):
    g = torch.Generator().manual_seed(3)
    bsz, heads, kv_heads, t, p, s, d = 3, 6, 2, 4, 75, 9, 16  # 3 query heads per kv head
    q = torch.randn(bsz, heads, t, d, generator=g).to(dtype)
    pk, pv = (torch.randn(1, kv_heads, p, d, generator=g).to(dtype) for _ in range(2))
    k, v = (torch.randn(bsz, kv_heads, s, d, generator=g).to(dtype) for _ in range(2))
    seen = torch.rand(bsz, 1, t, s, generator=g) < 0.6
    seen[..., -1] = True
    mask = seen if boolean else torch.zeros(seen.shape, dtype=dtype).masked_fill(~seen, torch.finfo(dtype).min)
    args = tuple(x.to(DEVICE) for x in (q, k, v, mask, pk, pv)) + (0.3,)
    got = hydragen.prefix_suffix_attention(*args, kernels="triton")
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(got, hydragen.prefix_suffix_attention(*args, kernels="torch"), atol=tol, rtol=tol)


def test_enable_takes_the_backend_and_keeps_it_when_asked_again():
    model = tiny_llama(seed=8)
    assert hydragen.enable(model, kernels="triton")
    assert model.config._attn_implementation == hydragen.PREFIX + "triton_sdpa"
    assert hydragen.enable(model)  # None: the choice already made
    assert model.config._attn_implementation == hydragen.PREFIX + "triton_sdpa"
    assert hydragen.enable(model, kernels="torch")
    assert model.config._attn_implementation == hydragen.PREFIX + "torch_sdpa"
    with pytest.raises(ValueError, match="fast"):
        hydragen.enable(model, kernels="fast")


# float32 on a GPU for scripts/gpu-check, which runs only the tests marked cuda
@pytest.mark.parametrize("dtype", [torch.float64, pytest.param(torch.float32, marks=pytest.mark.cuda)], ids=str)
def test_a_prefix_held_once_decodes_with_the_kernel_as_whole_prompts_do(monkeypatch, dtype):
    """Greedy decoding with the prefix held once and its attention in the kernel is plain decoding's."""
    model = tiny_llama(seed=4).to(DEVICE, dtype)  # its own: enabling the kernel must not reach the shared fixtures
    _, prompts = _prompts(3, prefix_len=70)  # more than one 64-key tile
    reqs = [GenRequest(p, n) for p, n in zip(prompts, [6, 3, 8])]
    plain = SpecEngine(model, ByteTokenizer()).generate(reqs)
    calls = []
    run = kernel._prefix_attention_triton

    def counted(*args):
        calls.append(args[0].shape)
        return run(*args)

    monkeypatch.setattr(kernel, "_prefix_attention_triton", counted)
    engine = SpecEngine(model, ByteTokenizer(), kernels="triton", shared_prefix="auto", min_shared=8)
    assert [r.token_ids for r in engine.generate(reqs)] == [r.token_ids for r in plain]
    assert engine._hydragen() and len(calls) >= model.config.num_hidden_layers


def test_the_kernel_bench_runs_kernel_and_reference_on_the_same_inputs():
    from specdec.bench.kernel_bench import prefix_cases, same_result

    cases = prefix_cases([70], [1, 5], kv_heads=2, groups=3, head_dim=16, dtype=torch.float32, device=DEVICE)
    assert [c.shape for c in cases] == ["P=70 Hkv=2 g=3 B*T=1 D=16", "P=70 Hkv=2 g=3 B*T=5 D=16"]
    assert all(same_result(c.kernel(), c.reference()) for c in cases)


@pytest.mark.cuda
@pytest.mark.parametrize("rows,length", [(32, 1000), (256, 4000)])
def test_cuda_bf16_kernel_matches_the_reference(rows, length):
    """Decode-sized (P split across programs) and prefill-sized query blocks at Llama-3 8B's heads."""
    _assert_matches_reference(*_inputs(8, rows, length, 128, torch.bfloat16), scale=128**-0.5)
