"""The fused decode step of recorded targets (``decode.engine.lean.LeanStep.static``, ``kernels.decode_step``):
each Triton kernel against its PyTorch reference (in the interpreter), the fused forward against HF's in the
compiled buffers, a probe that refuses a forward it does not reproduce, and decoding through recorded steps
(on a CPU: replayed by rerunning the step function) that stays token-identical to plain greedy decoding."""

from __future__ import annotations

import pytest
import torch
from conftest import ByteTokenizer, make_prompts, tiny_llama
from test_continuous import _heads, make_drafter

from specdec.decode.engine import cache as cache_module
from specdec.decode.engine import compiled, lean
from specdec.decode.engine.cache import KVState, SlotBuffers
from specdec.decode.engine.loop import SpecEngine
from specdec.decode.drafters.heads import DRAFTERS
from specdec.decode.engine.types import GenRequest
from specdec.kernels import decode_step

DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
# the kernels compiled on a GPU (scripts/gpu-check), in the interpreter elsewhere
DEVICES = pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])


@pytest.fixture(autouse=True)
def fresh(monkeypatch):
    monkeypatch.setattr(cache_module, "CAPACITY_STEP", 16)
    compiled._COMPILED.clear()
    yield
    compiled._COMPILED.clear()


@pytest.fixture()
def target():
    """A target of this module's own: the shared fixture may carry another test's attention implementation
    (a prefix held once), which the fused forward does not take."""
    return tiny_llama(seed=0)


def _same(a, b):
    """Equal where each op rounds once as its reference does: float32 on a CPU. A GPU's compiler fuses a
    multiply and an add (float32: one rounding fewer) and the interpreter (no bfloat16 in numpy) truncates
    where torch rounds to nearest, so otherwise a result may sit a step off after each of its roundings
    (rotary rounds three times)."""
    if a.dtype == torch.float32 and not a.is_cuda:
        assert torch.equal(a, b)
    else:
        step = 2**-7 if a.dtype == torch.bfloat16 else 2**-22
        torch.testing.assert_close(a, b, rtol=3 * step, atol=3 * step)


def _exact(a, b, dtype):
    """Equal but for rounding: the norm sums in another order, and a flipped rounding of the normed value
    is rounded again after the weight (two bfloat16 steps: 2 ** -6 relative)."""
    tol = {torch.float32: 2e-5, torch.bfloat16: 2**-6}[dtype]
    torch.testing.assert_close(a, b, rtol=tol, atol=tol)


@DEVICES
@DTYPES
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_kernel_matches_its_reference(dtype, with_residual, device):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 2, 40, generator=g).to(device, dtype)  # a width off the power of two the kernel tiles at
    r = torch.randn(3, 2, 40, generator=g).to(device, dtype) if with_residual else None
    w = (1 + 0.1 * torch.randn(40, generator=g)).to(device, dtype)
    total, normed = decode_step.rms_norm(x, w, 1e-6, residual=r)
    ref_total, ref_normed = decode_step.rms_norm_reference(x, w, 1e-6, residual=r)
    if with_residual:
        _same(total, ref_total)
    else:
        assert total is None and ref_total is None
    _exact(normed, ref_normed, dtype)


@DEVICES
@DTYPES
@pytest.mark.parametrize("t", [1, 3])
def test_rope_write_kernel_rotates_groups_and_writes_the_cache(dtype, t, device):
    b, heads, kv_heads, d, slots = 2, 6, 2, 12, 9
    g = torch.Generator().manual_seed(1)
    qkv = torch.randn(b, t, (heads + 2 * kv_heads) * d, generator=g).to(device, dtype)
    angle = torch.rand(b, t, d, generator=g).to(device) * 6
    cos, sin = angle.cos().to(dtype), angle.sin().to(dtype)
    offset = torch.tensor(4, device=device)
    caches = []
    for fn in (decode_step.rope_write, decode_step.rope_write_reference):
        keys, values = (torch.zeros(b, kv_heads, slots, d, dtype=dtype, device=device) for _ in range(2))
        caches.append((fn(qkv, cos, sin, keys, values, offset, heads, kv_heads), keys, values))
    (q, k, v), (q_ref, k_ref, v_ref) = caches
    assert q.shape == (b, kv_heads, (heads // kv_heads) * t, d)
    _same(q, q_ref)
    _same(k, k_ref)
    assert torch.equal(v, v_ref)  # copied, not computed
    # only slots offset .. offset + t - 1 were written, and the values are the projection's own
    assert not k[:, :, :4].any() and not k[:, :, 4 + t :].any()
    torch.testing.assert_close(v[:, :, 4 : 4 + t], qkv[..., (heads + kv_heads) * d :].view(b, t, kv_heads, d).transpose(1, 2))
    # query head h = kv * G + j at token i sits at row j * t + i of its key/value head
    plain = decode_step.rotate(qkv[..., : heads * d].view(b, t, heads, d), cos[:, :, None], sin[:, :, None])
    _same(q[:, 1, 2 * t + (t - 1)], plain[:, t - 1, 1 * 3 + 2])


@DEVICES
@DTYPES
def test_silu_mul_kernel_matches_its_reference(dtype, device):
    gu = torch.randn(4, 2 * 1500, generator=torch.Generator().manual_seed(2)).to(device, dtype)  # two column blocks
    _exact(decode_step.silu_mul(gu), decode_step.silu_mul_reference(gu), dtype)


@DEVICES
@DTYPES
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_the_fused_step_reproduces_hf_in_compiled_buffers(dtype, backend, device):
    model = tiny_llama(layers=2, heads=4, kv_heads=2).to(device, dtype)
    step = lean.fused_step(model, backend)
    assert step is not None and step.backend == backend
    # a target's projections are the fused weights' rows, not a second copy
    qkv = step.layers[0][2]
    q_proj = model.model.layers[0].self_attn.q_proj.weight
    assert q_proj.data_ptr() == qkv.data_ptr() and q_proj.shape[0] < qkv.shape[0]
    assert lean.fused_step(model, backend) is step  # checked once
    errors = lean.fused_errors(model, backend)
    assert ("float32 copy" in errors) == (dtype == torch.bfloat16)
    assert errors.get("float32 copy", 0) <= 1e-3 and errors[str(dtype).removeprefix("torch.")] <= (1e-3 if dtype == torch.float32 else 0.1)


def test_the_probe_refuses_a_forward_that_differs(monkeypatch):
    """A fused step that maps query heads to the wrong key/value head is found out and not used, in float32
    and in bfloat16 (where the probe allows rounding)."""
    model = tiny_llama(layers=2, heads=4, kv_heads=2).float()
    half = tiny_llama(layers=2, heads=4, kv_heads=2).bfloat16()
    right = decode_step.rope_write_reference

    def swapped(qkv, cos, sin, keys, values, offset, heads, kv_heads):
        return right(qkv, cos, sin, keys, values, offset, heads, kv_heads).flip(1)

    monkeypatch.setattr(decode_step, "rope_write_reference", swapped)
    assert lean.fused_step(model, "torch") is None
    assert lean.fused_step(half, "torch") is None


def test_the_fused_step_is_not_built_where_it_cannot_run():
    assert lean.fused_step(tiny_llama(layers=1), "torch") is not None
    biased = tiny_llama(layers=1)
    biased.config.attention_bias = True
    assert lean.fused_step(biased, "torch") is None
    spread = tiny_llama(layers=2)
    spread.hf_device_map = {"model.layers.0": 0, "model.layers.1": 1}  # as accelerate's placement records it
    assert lean.fused_step(spread, "torch") is None


def test_a_fused_compiled_state_matches_the_eager_one(target):
    torch.manual_seed(0)
    ids = torch.randint(3, 96, (2, 9))
    valid = torch.ones_like(ids, dtype=torch.bool)
    valid[1, :3] = False
    states = [KVState(target, 2, ids.device), KVState(target, 2, ids.device, compile="graphs", kernels="triton")]
    assert states[1]._compiled.fused is not None
    outs = [s.forward(ids, valid).logits for s in states]
    torch.testing.assert_close(outs[0], outs[1])
    for s in states:
        s.commit_prefix(9, valid)
    step = torch.randint(3, 96, (2, 5))
    outs = [s.forward(step, hidden=True) for s in states]  # a bucket of 8, holes included
    torch.testing.assert_close(outs[0].logits, outs[1].logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(outs[0].hidden_states[-1], outs[1].hidden_states[-1], rtol=1e-5, atol=1e-5)
    assert isinstance(states[1].cache, SlotBuffers)


@DEVICES
@pytest.mark.parametrize("name", ["ar", "draft", "eagle-dynamic"])
@pytest.mark.parametrize("bsz", [1, 3])
def test_greedy_through_fused_recorded_steps_is_plain_greedy(target, draft_model, monkeypatch, name, bsz, device):
    """In float32; on a GPU the steps are recorded CUDA graphs of the compiled kernels."""
    target, draft_model = target.to(device), draft_model.to(device)
    used = []
    static = lean.LeanStep.static

    def counted(self, *args, **kwargs):
        used.append(kwargs["input_ids"].shape)
        return static(self, *args, **kwargs)

    monkeypatch.setattr(lean.LeanStep, "static", counted)
    prompts = make_prompts(bsz, seed=11, lo=3, hi=35)
    reqs = [GenRequest(p, n) for p, n in zip(prompts, [30, 7, 19][:bsz])]
    plain = SpecEngine(target, ByteTokenizer()).generate(reqs)
    if name == "eagle-dynamic":  # heads on the target's device
        drafter = DRAFTERS["eagle"](_heads("eagle", target).to(device), target, tree="dynamic", tree_tokens=10, top_k=3)
    else:
        drafter = make_drafter(name, target, draft_model)
    fast = SpecEngine(target, ByteTokenizer(), drafter, compile="graphs", kernels="triton").generate(reqs)
    assert [r.token_ids for r in fast] == [r.token_ids for r in plain]
    assert len(used) > 0  # the target's steps ran the fused forward


def test_torch_kernels_record_hf_forward(target):
    state = KVState(target, 1, torch.device("cpu"), compile="graphs", kernels="torch")
    assert state._compiled.fused is None
