"""A GGUF target's layers multiplied from the file's quantised blocks (``models.blocks``, ``kernels.qmatmul``):
the kernel's weights are gguf's dequantisation bit for bit, its products are float32 matmuls of them, and
decoding through it is generate's text on the converted float32 model."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest
import torch
from conftest import invoke, tiny_tokenizer
from gguf_files import random_blocks, write_tiny_llama_gguf

from specdec.kernels import qmatmul as kernel
from specdec.models import blocks, head

pytestmark = pytest.mark.skipif(not blocks.kernel_ready(), reason="the quantised-weight kernel needs AVX2 and a compiler")

TYPES = ["Q8_0", "Q5_0", "Q4_K", "Q6_K"]
PROMPTS = ["def add(a, b):\n", "class Point:\n    def __init__(self, x, y):\n", "for i in range(10):\n"]


@pytest.fixture(params=["fastest", "avx2"])
def isa(request):
    """The kernels' instruction set: the fastest this CPU has (AVX-512 products and the AVX-512 VNNI screen
    where it has them), then AVX2 alone, so that a machine with AVX-512 tests both paths."""
    before = kernel.set_isa(0 if request.param == "fastest" else 1)
    yield request.param
    kernel.set_isa(before)


def _dense(raw: np.ndarray, qtype: str, k: int) -> torch.Tensor:
    import gguf

    w = gguf.dequantize(raw, getattr(gguf.GGMLQuantizationType, qtype)).astype(np.float32)
    return torch.from_numpy(np.ascontiguousarray(w)).reshape(raw.shape[0], k)


@pytest.mark.parametrize("qtype", TYPES)
def test_the_kernels_weights_are_ggufs_dequantisation_bit_for_bit(qtype):
    raw = random_blocks(qtype, 24, 512, seed=3)
    ref = _dense(raw, qtype, 512)
    got = kernel.qdequant(torch.from_numpy(raw), kernel.BLOCKS[qtype][0], 512)
    assert torch.equal(got.view(torch.int32), ref.view(torch.int32))


@pytest.mark.parametrize("qtype", TYPES)
def test_the_kernels_products_are_float32_matmuls_of_those_weights(qtype, isa):
    raw = torch.from_numpy(random_blocks(qtype, 70, 512, seed=5))
    ref = _dense(raw.numpy(), qtype, 512)
    g = torch.Generator().manual_seed(0)
    for rows in (1, 2, 3, 5, 8, 9, 17):  # every register tiling, and more positions than one pass holds
        x = torch.randn(rows, 512, generator=g)
        got = kernel.qmatmul(x, raw, kernel.BLOCKS[qtype][0], 512)
        want = (x.double() @ ref.double().T).float()
        # float32 accumulation in another order: within n * u of the sum of |x_i w_i|
        bound = 512 * 2.0 ** -24 * (x.abs().double() @ ref.abs().double().T).float()
        assert got.shape == (rows, 70) and bool(((got - want).abs() <= bound + 1e-30).all())


@pytest.mark.parametrize("qtype", TYPES)
def test_a_positions_product_does_not_depend_on_the_forwards_width(qtype, isa):
    """Bit for bit: each chunk of 8 positions of a wide forward (a verify forward of a tree) gets what a
    forward of that chunk alone gets, and with AVX-512 (two accumulators a position at every width) what each
    position gets alone, so a position's logits do not depend on how many rode with it."""
    raw = torch.from_numpy(random_blocks(qtype, 33, 512, seed=7))
    g = torch.Generator().manual_seed(1)
    t = kernel.BLOCKS[qtype][0]
    for rows in (3, 9, 13, 16, 21):
        x = torch.randn(rows, 512, generator=g)
        got = kernel.qmatmul(x, raw, t, 512)
        for m in range(0, rows, 8):
            assert torch.equal(got[m : m + 8], kernel.qmatmul(x[m : m + 8].contiguous(), raw, t, 512))
        _alone_if_avx512(got, x, lambda one: kernel.qmatmul(one, raw, t, 512))


def _alone_if_avx512(got, x, product):
    """With AVX-512 each position's row of ``got`` is its product alone, bit for bit."""
    if kernel.isa512():
        for i in range(x.shape[0]):
            assert torch.equal(got[i : i + 1], product(x[i : i + 1].contiguous())), i


@pytest.mark.parametrize("qtype", ["Q8_0", "Q5_0", "Q4_K", "Q6_K"])
def test_rows_interleaved_by_16_are_the_same_weights_and_float32_products_of_them(qtype, isa):
    """``Q8_0_R16``, ``Q5_0_R16``, ``Q4_K_R16`` and ``Q6_K_R16`` (models.blocks.rows16: the layouts a decode step's
    matrices take at load; the K-quants from their unpacked groups): the bytes reordered, the same float32 weights bit
    for bit, products within float32 accumulation of the exact ones at every width, and each chunk of 8 positions of a
    wide forward what that chunk alone gets."""
    raw = torch.from_numpy(random_blocks(qtype, 48, 512, seed=5))
    t_raw = kernel.BLOCKS[qtype][0]
    if qtype in ("Q4_K", "Q6_K"):
        raw, t_raw = (blocks.q4_k_unpacked(raw), blocks.Q4_K_X) if qtype == "Q4_K" else (blocks.q6_k_unpacked(raw), blocks.Q6_K_X)
    packed, t = blocks.rows16(raw, t_raw)
    assert t == kernel.UNPACKED[f"{qtype}_R16"][0] and t in kernel.ROWS16
    assert packed.shape == (3, 16 * raw.shape[1]) and packed.numel() == raw.numel()  # as many bytes as the rows'
    if qtype != "Q5_0":  # the very bytes, reordered (Q5_0's fifth bits are regrouped a column at a time)
        assert torch.equal(packed.flatten().sort().values, raw.flatten().sort().values)
    ref = kernel.qdequant(raw, t_raw, 512)
    assert torch.equal(kernel.qdequant(packed, t, 512).view(torch.int32), ref.view(torch.int32))
    g = torch.Generator().manual_seed(0)
    for rows in (1, 2, 3, 5, 8, 9, 17):
        x = torch.randn(rows, 512, generator=g)
        got = kernel.qmatmul(x, packed, t, 512)
        want = (x.double() @ ref.double().T).float()
        bound = 512 * 2.0 ** -24 * (x.abs().double() @ ref.abs().double().T).float()
        assert got.shape == (rows, 48) and bool(((got - want).abs() <= bound + 1e-30).all())
        for m in range(0, rows, 8):
            assert torch.equal(got[m : m + 8], kernel.qmatmul(x[m : m + 8].contiguous(), packed, t, 512))
        _alone_if_avx512(got, x, lambda one: kernel.qmatmul(one, packed, t, 512))
    with pytest.raises(RuntimeError, match="file order"):  # an output layer's screen candidates read rows in order
        kernel.qrows(x, packed, t, 512, torch.tensor([0]), torch.tensor([0]))


@pytest.mark.parametrize("qtype, unpack", [("Q4_K", blocks.q4_k_unpacked), ("Q6_K", blocks.q6_k_unpacked)])
def test_unpacked_k_quants_are_the_same_weights_and_the_same_products(qtype, unpack, isa):
    """The layouts the K-quant blocks are unpacked into at load rebuild the same float32 weights, and the kernel
    runs the same products in the same order on them: every output bit for bit as from the file's blocks."""
    raw = torch.from_numpy(random_blocks(qtype, 37, 768, seed=11))
    t, tx = kernel.BLOCKS[qtype][0], kernel.UNPACKED[f"{qtype}_X"][0]
    un = unpack(raw)
    assert un.shape == (37, kernel.row_bytes(tx, 768))
    assert torch.equal(kernel.qdequant(un, tx, 768).view(torch.int32), _dense(raw.numpy(), qtype, 768).view(torch.int32))
    g = torch.Generator().manual_seed(2)
    for rows in (1, 2, 3, 4, 5, 8, 11):
        x = torch.randn(rows, 768, generator=g)
        got = kernel.qmatmul(x, un, tx, 768)
        assert torch.equal(got.view(torch.int32), kernel.qmatmul(x, raw, t, 768).view(torch.int32))
        _alone_if_avx512(got, x, lambda one: kernel.qmatmul(one, un, tx, 768))


def test_blocks_are_found_by_content_not_by_name(tmp_path):
    import gguf

    path = tmp_path / "w.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    raws = {t: random_blocks(t, 8, 256, seed=i) for i, t in enumerate(TYPES)}
    for t, raw in raws.items():
        writer.add_tensor(f"t.{t}", raw, raw_dtype=getattr(gguf.GGMLQuantizationType, t))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    weights = {f"layer.{t}.weight": _dense(raw, t, 256) for t, raw in raws.items()}
    off = weights["layer.Q6_K.weight"].clone()
    off.view(torch.int32)[0, 0] += 1  # one ulp away: no longer that tensor's encoding
    weights["layer.Q6_K.weight"] = off
    weights["layer.norm.weight"] = torch.ones(256)
    found, types = blocks.extract(path, weights)
    assert sorted(found) == ["layer.Q4_K.weight", "layer.Q5_0.weight", "layer.Q8_0.weight"]
    for t in ("Q8_0", "Q5_0", "Q4_K"):
        assert types[f"layer.{t}.weight"] == kernel.BLOCKS[t][0]
        assert np.array_equal(found[f"layer.{t}.weight"].numpy(), raws[t])


def _q8_0_output_layer(raw: np.ndarray, hidden: int):
    """A model whose large output layer holds ``raw``'s Q8_0 weights, with models.head's dispatcher installed
    and reading the blocks: (model, its nn.Linear, the dispatcher)."""
    linear = torch.nn.Linear(hidden, raw.shape[0], bias=False)
    with torch.no_grad():
        linear.weight.copy_(_dense(raw, "Q8_0", hidden))

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lm = linear

        def get_output_embeddings(self):
            return self.lm

    model = Model()
    fast = head.install(model)
    assert fast is not None
    fast.blocks = (torch.from_numpy(raw), kernel.BLOCKS["Q8_0"][0])
    return model, linear, fast


def test_the_output_layer_reads_its_blocks_inside_the_engine_and_is_plain_outside():
    """A 16k-vocabulary output layer (models.head's dispatcher) with Q8_0 blocks: exact logits of the same
    weights for sampling rounds, the exact argmax through the integer screen for greedy rounds and the race;
    outside the engine, the float32 layer."""
    vocab, hidden = 16384, 64
    raw = random_blocks("Q8_0", vocab, hidden, seed=2, scale=0.5)
    model, linear, fast = _q8_0_output_layer(raw, hidden)
    calls = []
    real, real_screen, real_rows16 = kernel.qmatmul, kernel.qscreen, kernel.qscreen16
    x = torch.randn(3, hidden)
    want = x @ linear.weight.T
    try:
        kernel.qmatmul = lambda *a: calls.append("exact") or real(*a)
        kernel.qscreen = lambda *a: calls.append("screen") or real_screen(*a)
        kernel.qscreen16 = lambda *a: calls.append("screen") or real_rows16(*a)
        assert torch.equal(linear(x), want) and not calls  # outside the engine: nn.Linear
        for greedy in (True, False):
            with head.scope(model, greedy=greedy):
                got = linear(x)
            assert torch.equal(got.argmax(-1), want.argmax(-1))
            if not greedy:
                assert torch.allclose(got, want, atol=1e-5)
        noise = torch.rand(3, vocab)
        with head.scope(model, greedy=False), head.racing(model, noise, 0.7) as box:
            raced = linear(x)
        assert box["applied"] and torch.equal(raced.argmax(-1), (want / 0.7 + noise).argmax(-1))
        assert calls == ["screen", "exact", "screen"]
    finally:
        kernel.qmatmul, kernel.qscreen, kernel.qscreen16 = real, real_screen, real_rows16


@pytest.fixture()
def quantised_target(tmp_path, monkeypatch):
    """A tiny Llama GGUF whose matrices are Q8_0 / Q5_0 / Q4_K / Q6_K blocks, converted as any GGUF target."""
    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path / "home"))
    path = write_tiny_llama_gguf(tmp_path / "q.gguf", tiny_tokenizer(), hidden=256, heads=4, kv_heads=2, ffn=512,
                                 dtype="mixed")
    from specdec.models.gguf import gguf_target

    return path, gguf_target(path)


def test_a_quantised_gguf_target_keeps_its_blocks_and_routes_every_matrix(quantised_target):
    from specdec.models.loading import Placement, load_target

    path, folder = quantised_target
    assert (folder / blocks.BLOCKS_FILE).is_file()
    model, _, _ = load_target(folder, Placement(device="cpu"))
    state = model._specdec_blocks
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert state.layers == len(linears) == 2 * 7 + 1
    # every matrix (here rows a multiple of 16) is read 16 rows at a time, Q5_0 in its own 5-bit values, the K-quants
    # in their unpacked groups
    body = [m for m in linears if m is not model.get_output_embeddings()]
    routed = {getattr(m, "_specdec_blocks", (None, None))[1] for m in body}
    assert routed == {blocks.Q8_0_R16, blocks.Q5_0_R16, blocks.Q4_K_R16, blocks.Q6_K_R16}, routed
    # a folder converted before blocks were kept gets them from the file it came from
    (folder / blocks.BLOCKS_FILE).unlink()
    info = json.loads((folder / "specdec_gguf.json").read_text())
    assert info["sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()
    from specdec.models.gguf import ensure_blocks

    assert ensure_blocks(folder) and (folder / blocks.BLOCKS_FILE).is_file()


@pytest.mark.parametrize("drafter,batch", [("ar", 1), ("ngram", 3), ("ar", 3)])
def test_decoding_through_the_blocks_is_generates_text(quantised_target, tmp_path, drafter, batch, isa):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path, folder = quantised_target
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    out = tmp_path / "out.jsonl"
    res = invoke(["decode", "--in", src, "--out", out, "--target", path, "--max-new-tokens", "16", "--device", "cpu",
                  "--drafter", drafter, "--batch-size", str(batch)])
    assert res.exit_code == 0, res.output
    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    for rec, prompt in zip((json.loads(line) for line in out.read_text().splitlines()), PROMPTS):
        ids = tok(prompt, return_tensors="pt")["input_ids"]
        ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False,
                             pad_token_id=tok.pad_token_id)
        assert rec["completion"] == tok.decode(ref[0, ids.shape[1]:], skip_special_tokens=True)
        assert rec["stats"]["new_tokens"] > 0


def test_sampling_through_the_blocks_draws_what_the_float32_weights_draw(quantised_target, tmp_path):
    """T=0.8 with a seed: the blocks' logits are the float32 weights' (up to accumulation order), so the
    seeded text is the one decoded with the kernel switched off."""
    path, _ = quantised_target
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    texts = []
    for off in (False, True):
        out = tmp_path / f"out-{off}.jsonl"
        blocks.MAX_ROWS, saved = (0 if off else blocks.MAX_ROWS), blocks.MAX_ROWS
        try:
            res = invoke(["decode", "--in", src, "--out", out, "--target", path, "--max-new-tokens", "16", "--device", "cpu",
                          "--drafter", "ngram", "--temperature", "0.8", "--seed", "7"])
        finally:
            blocks.MAX_ROWS = saved
        assert res.exit_code == 0, res.output
        texts.append([json.loads(line)["completion"] for line in out.read_text().splitlines()])
    assert texts[0] == texts[1] and any(texts[0])


def test_weights_float32_keeps_the_float32_layers_and_bad_values_are_refused(quantised_target):
    from specdec.models.errors import UsageError
    from specdec.models.loading import Placement, load_target

    _, folder = quantised_target
    model, _, _ = load_target(folder, Placement(device="cpu", weights="float32"))
    assert getattr(model, "_specdec_blocks", None) is None
    model, _, _ = load_target(folder, Placement(device="cpu"))
    calls = []
    real = kernel.qmatmul
    try:
        kernel.qmatmul = lambda *a: calls.append(1) or real(*a)
        ids = torch.tensor([[1, 2, 3]])
        with head.scope(model, greedy=True), blocks.suspended(model):  # a bench method's +weights=float32
            model(ids)
        assert not calls
        with head.scope(model, greedy=True):
            model(ids)
        assert len(calls) == model._specdec_blocks.layers
    finally:
        kernel.qmatmul = real
    with pytest.raises(UsageError, match="--weights"):
        Placement(weights="int4")


def test_q5_0_blocks_rewritten_as_q8_0_hold_the_same_weights():
    raw = random_blocks("Q5_0", 16, 256, seed=9)
    as_q8 = blocks.q5_0_as_q8_0(torch.from_numpy(raw))
    assert as_q8.shape == (16, 256 // 32 * 34)
    got = kernel.qdequant(as_q8, kernel.BLOCKS["Q8_0"][0], 256)
    assert torch.equal(got.view(torch.int32), _dense(raw, "Q5_0", 256).view(torch.int32))


def test_the_roofline_counts_the_blocks_bytes_a_forward_reads(quantised_target):
    from specdec.bench.roofline import weight_bytes_read
    from specdec.models.loading import Placement, load_target

    _, folder = quantised_target
    model, _, _ = load_target(folder, Placement(device="cpu"))
    state = model._specdec_blocks
    dense = weight_bytes_read(model, blocks=False)
    assert state.bytes < state.dense_bytes / 3  # 4.5-8.5 bits a weight against 32
    assert weight_bytes_read(model) == dense - state.dense_bytes + state.bytes


def test_a_drafter_reads_its_rows_of_the_output_layer_from_the_blocks(quantised_target):
    """A head over a reduced vocabulary (models.heads._TargetHead) reads the GGUF target's output-layer blocks at its
    rows: the same weights, so the same logits as the float32 rows; training (gradients) and +weights=float32 read
    the float32 rows."""
    from specdec.models.head_artifacts import build_heads
    from specdec.models.loading import Placement, load_target
    from specdec.models.vocab import DraftVocab

    _, folder = quantised_target
    model, _, _ = load_target(folder, Placement(device="cpu"))
    vocab = model.config.vocab_size
    heads = build_heads("block", model, {"num_heads": 2, "feature_layers": "last"}).attach(model)
    d2t = torch.randperm(vocab, generator=torch.Generator().manual_seed(0))[:40]
    heads.set_vocab(DraftVocab(d2t, vocab))
    f = torch.randn(1, 3, model.config.hidden_size)
    want = f @ model.get_output_embeddings().weight[d2t[:-1]].T
    calls = []
    real = kernel.qmatmul
    try:
        kernel.qmatmul = lambda *a: calls.append(1) or real(*a)
        with torch.no_grad():
            got = heads.lm_logits(f)
        assert calls and got.shape == want.shape and torch.allclose(got, want, atol=1e-4)
        calls.clear()
        assert torch.allclose(heads.lm_logits(f), want, atol=1e-5) and not calls  # with gradients: the float32 rows
        with torch.no_grad(), blocks.suspended(model):
            heads.lm_logits(f)
        assert not calls
    finally:
        kernel.qmatmul = real


@pytest.mark.parametrize("bs", [1, 3])
def test_a_drafters_layers_on_q8_0_blocks_draft_through_the_kernel_and_the_output_stays_plain_decodings(monkeypatch, bs):
    """models.blocks.quantize_layers: a head drafter's float32 matrices as gguf's Q8_0 blocks, read by the kernel in
    every draft call; the weights move by at most Q8_0's rounding, and the output is still plain decoding's."""
    from conftest import ByteTokenizer, make_prompts, tiny_llama

    from specdec.decode.drafters.heads import DRAFTERS
    from specdec.decode.engine.loop import SpecEngine
    from specdec.decode.engine.types import GenRequest
    from specdec.models.head_artifacts import build_heads

    target = tiny_llama(hidden=64, seed=4).float()  # the kernel multiplies float32
    torch.manual_seed(0)
    heads = build_heads("eagle", target, {}).attach(target, init_from_lm_head=True).eval()
    dense = {n: m.weight.detach().clone() for n, m in heads.named_modules() if isinstance(m, torch.nn.Linear)}
    state = blocks.quantize_layers(heads)
    routed = {n for n, m in heads.named_modules() if hasattr(m, "_specdec_blocks")}
    assert state is not None and routed and routed == {n for n, w in dense.items() if w.shape[1] % 32 == 0}
    for n in routed:
        m = heads.get_submodule(n)
        rebuilt = kernel.qdequant(*m._specdec_blocks, m.in_features)
        # 8-bit values of a half-precision scale max|w| / 127 per 32 weights: half a step, and the scale's rounding
        assert (rebuilt - dense[n]).abs().max() <= dense[n].abs().max() * (1 / 254 + 2.0**-11) and not torch.equal(rebuilt, dense[n])
    calls = []
    real = kernel.qmatmul
    monkeypatch.setattr(kernel, "qmatmul", lambda *a: calls.append(1) or real(*a))
    prompts = make_prompts(bs, seed=12)
    reqs = [GenRequest(prompt_ids=p, max_new_tokens=24) for p in prompts]
    out = SpecEngine(target, ByteTokenizer(), DRAFTERS["eagle"](heads, target, tree="dynamic", tree_tokens=8, top_k=2)).generate(reqs)
    assert calls
    assert [r.token_ids for r in out] == [r.token_ids for r in SpecEngine(target, ByteTokenizer(), None).generate(reqs)]


def test_a_build_marker_left_by_a_killed_build_does_not_hang_the_next_load():
    """torch marks a build in progress with a file named "lock" in the build folder and waits for it to go, without
    end; a process killed while building leaves it. The next process removes it under its own flock (which the
    kernel releases when a builder dies) and loads the operator."""
    import subprocess
    import sys

    from specdec.models.env import specdec_home

    folder = kernel.build_folder(specdec_home() / "ext")
    (folder / "lock").touch()
    code = "from specdec.models import blocks; assert blocks.kernel_ready(); print('loaded')"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "loaded" in done.stdout, done.stderr[-2000:]
    assert not (folder / "lock").exists()


@pytest.mark.parametrize("n", [1, 7, 8, 9, 100, 16384, 16385, 40000, 262144])
def test_the_kernels_argmax_is_torchs_argmax_index_for_index(n):
    """The verification's argmax (``kernel.argmax``, one vector pass over runs of columns) returns torch's
    indices: the first of equal maxima (within a lane, across lanes and across runs), a row's first NaN where
    it has one, rows of -inf alone; a comparison that kept the last of equal maxima fails the ties rows."""
    g = torch.Generator().manual_seed(n)
    z = torch.randn(12, n, generator=g)
    z[1] = 0.5  # all equal: index 0
    z[2] = float("-inf")
    if n > 1:
        z[3, n // 3] = z[3, n - 1] = 9.0  # the same maximum twice, possibly in other runs and lanes
        z[4, n // 2] = float("nan")
        z[4, n - 1] = float("nan")
        z[5, : n // 2] = -0.0  # -0.0 and 0.0 are equal maxima
        z[5, n // 2 :] = 0.0
        z[6, n - 1] = float("inf")
        z[7, ::2] = 3.0  # every other column tied
    z[8, 0] = float("nan")
    z[9] = torch.randint(-2, 3, (n,), generator=g).float()  # many ties in many lanes
    got = torch.ops.specdec_q.argmax_rows(z)
    assert got.dtype == torch.long and torch.equal(got, z.argmax(-1))
    assert torch.equal(kernel.argmax(z.view(3, 4, n)), z.view(3, 4, n).argmax(-1))  # the operator from 4096 values
    assert torch.equal(kernel.argmax(z[:1]), z[:1].argmax(-1))


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_K_X", "Q6_K_X"])
def test_a_few_rows_recomputed_are_the_kernels_own_values_bit_for_bit(qtype, isa):
    """``qrows`` (a screen's candidates) runs the very kernel instance ``qmatmul`` runs for each position, so
    a recomputed logit is the one the full product holds, to the last bit, at every width."""
    source = {"Q8_0": ("Q8_0", None), "Q4_K_X": ("Q4_K", blocks.q4_k_unpacked), "Q6_K_X": ("Q6_K", blocks.q6_k_unpacked)}[qtype]
    raw = torch.from_numpy(random_blocks(source[0], 40, 512, seed=9))
    if source[1] is not None:
        raw = source[1](raw)
    t = {**kernel.BLOCKS, **kernel.UNPACKED}[qtype][0]
    g = torch.Generator().manual_seed(2)
    for width in (1, 3, 8, 9, 13):
        x = torch.randn(width, 512, generator=g)
        full = kernel.qmatmul(x, raw, t, 512)
        pos = torch.randint(0, width, (50,), generator=g)
        rows = torch.randint(0, 40, (50,), generator=g)
        assert torch.equal(kernel.qrows(x, raw, t, 512, rows, pos), full[pos, rows])


NEAR = {11: ((3, 1), (17, 1)), 12: ((20, 1),), 13: ((25, -1),), 14: ((3, 1), (25, -1))}  # token: (index, step)


def _near_tie_layer(vocab: int = 16384, hidden: int = 64):
    """Q8_0 blocks of an output layer in which tokens 11-14 are token 7's row with one or two 8-bit values
    (all in its first block) moved by one step: their logits differ from 7's by a step times activations
    below what 8-bit activations resolve."""
    raw = random_blocks("Q8_0", vocab, hidden, seed=2, scale=0.5)
    for j, moves in NEAR.items():
        raw[j] = raw[7]
        for i, step in moves:
            value = int(raw[j, 2 + i].astype(np.int8))
            raw[j, 2 + i] = np.int8(max(-127, min(127, value + step))).view(np.uint8)
    return raw


def test_the_integer_screen_of_a_q8_0_output_layer_returns_the_exact_argmax_under_near_ties(isa):
    """Greedy rounds and the race on a Q8_0 output layer read by the integer screen: each position's argmax
    is the exact kernel's, though the screen alone misranks the near-ties; sampling rounds get exact logits."""
    from specdec.decode.engine.verify import race_noise, race_scores

    vocab, hidden = 16384, 64
    raw = _near_tie_layer(vocab, hidden)
    model, linear, fast = _q8_0_output_layer(raw, hidden)
    t = kernel.BLOCKS["Q8_0"][0]
    g = torch.Generator().manual_seed(4)
    w7 = linear.weight[7].detach()
    # hidden states along token 7's row (7 and its near-copies on top), some with one outlier activation
    h = torch.randn(120, hidden, generator=g) * 0.5 + 30 * w7 / w7.norm()
    h[::5, 5] += 60
    # which near-copy wins varies by row: activations of a fraction of one 8-bit step (s), rounded to 0 or
    # 1 step by the screen, so that 11 (two moves of 0.45 s: 0.9 s, screened 0) loses to 12 (0.55 s,
    # screened s) in the screen only
    s = h.abs().amax(1) / 127
    fractions = torch.tensor([0.45, 0.55, -0.3, 1.45, -0.55, 0.2])
    h[:, [3, 17, 20, 25]] = fractions[torch.randint(0, 6, (120, 4), generator=g)] * s[:, None]
    exact = torch.cat([kernel.qmatmul(h[i : i + 8].contiguous(), fast.blocks[0], t, hidden) for i in range(0, 120, 8)])
    with head.scope(model, greedy=True):
        got = torch.cat([linear(h[i : i + 8]) for i in range(0, 120, 8)])
    assert torch.equal(got.argmax(-1), exact.argmax(-1))
    assert set(exact.argmax(-1).tolist()) & {11, 12, 13, 14}, "the near-ties decide some rows"
    # what the integer screen alone ranks first is wrong in some rows: the recomputation makes it exact
    scale = h.abs().amax(1) / 127
    screen = kernel.qscreen(torch.round(h / scale[:, None]).to(torch.int8), scale, fast.blocks[0], hidden)
    assert not torch.equal(screen.argmax(-1), exact.argmax(-1))
    assert fast.screened == 120 and 120 <= fast.candidates < 120 * 64
    # on a CPU with AVX-512 VNNI the fastest path reads the blocks interleaved 16 rows at a time
    assert (fast._screen16 is not None) == (kernel.isa512() and kernel.has_vnni512())
    # the winners' returned values are the exact kernel's, bit for bit
    idx = exact.argmax(-1)
    assert torch.equal(got[torch.arange(120), idx], exact[torch.arange(120), idx])
    # sampling rounds: exact logits
    with head.scope(model, greedy=False):
        assert torch.equal(linear(h[:5]), kernel.qmatmul(h[:5].contiguous(), fast.blocks[0], t, hidden))
    # the race: the argmax of exact logit / T + noise
    noise = race_noise(11, list(range(6)), torch.zeros(6, 1, dtype=torch.long), vocab, "cpu")[:, 0]
    with head.scope(model, greedy=False), head.racing(model, noise, 0.7) as box:
        raced = linear(h[:6])
    assert box["applied"] and torch.equal(raced.argmax(-1), race_scores(exact[:6], noise, 0.7).argmax(-1))


@pytest.mark.skipif(not blocks.kernel_ready() or not kernel.has_vnni512(), reason="the screen's AVX-512 VNNI path needs a CPU with it")
@pytest.mark.parametrize("positions", [1, 3, 8, 11])
def test_the_screens_avx512_vnni_path_is_the_avx2_screen_up_to_float_rounding(positions):
    """Both paths sum the same integers (q * a, exactly) and scale them in float32; each is within the float
    rounding bound the head's screen allows (models.head: g_b for K/32 + 4 roundings) of the exact value in
    float64, and so are the blocks interleaved 16 rows a register (qpack16, qscreen16). A lane that kept
    vpdpbusd's unsigned offset (128 times its activations) would miss by far more."""
    k, rows = 640, 3000
    raw = random_blocks("Q8_0", rows, k, seed=5, scale=0.5)
    g = torch.Generator().manual_seed(6)
    xq = torch.randint(-127, 128, (positions, k), generator=g, dtype=torch.int8)
    xq[:, :7] = 127  # extremes: the 16-bit step of the AVX2 path is at its largest there
    xq[:, 7:13] = -127
    xs = torch.rand(positions, generator=g) + 0.1
    b = torch.from_numpy(raw)
    d = torch.from_numpy(np.ascontiguousarray(raw.reshape(rows, k // 32, 34)[:, :, 0:2]).view(np.float16)
                         .reshape(rows, k // 32).astype(np.float64))
    q = torch.from_numpy(np.ascontiguousarray(raw.reshape(rows, k // 32, 34)[:, :, 2:]).view(np.int8).astype(np.int64))
    ints = torch.einsum("rbi,pbi->prb", q, xq.long().reshape(positions, k // 32, 32))  # [P, rows, blocks], exact
    exact = xs.double()[:, None] * (ints.double() * d[None]).sum(-1)
    bound = head._gamma(k // 32 + 4) * xs.double()[:, None] * (ints.double().abs() * d.abs()[None]).sum(-1) + 1e-30
    avx2 = kernel.qscreen_isa(xq, xs, b, k, 1).double()
    vnni = kernel.qscreen_isa(xq, xs, b, k, 2).double()
    assert ((avx2 - exact).abs() <= bound).all() and ((vnni - exact).abs() <= bound).all()
    # the blocks interleaved 16 rows at a time (3000 rows: the last group padded with zero rows)
    packed = kernel.qscreen16(xq, xs, kernel.qpack16(b, k), k).double()
    assert packed.shape == (positions, 3008) and (packed[:, rows:] == 0).all()
    assert ((packed[:, :rows] - exact).abs() <= bound).all()
    assert torch.equal(kernel.qscreen(xq, xs, b, k), kernel.qscreen_isa(xq, xs, b, k, 2))  # the default here
    offset = 128 * xq.long().reshape(positions, k // 32, 32).sum(-1).double()  # what a forgotten correction adds
    assert ((xs.double()[:, None] * (offset[:, None, :] * d[None]).sum(-1)).abs() > 100 * bound).float().mean() > 0.9
    with pytest.raises(RuntimeError, match="multiple of 64"):
        kernel.qscreen_isa(xq[:, :608].contiguous(), xs, torch.from_numpy(random_blocks("Q8_0", 8, 608, seed=1)), 608, 2)


@pytest.mark.skipif(not blocks.kernel_ready() or not kernel.has_amx(), reason="the screen's AMX path needs a CPU with AMX tiles")
@pytest.mark.parametrize("positions", [1, 2, 7, 8, 11, 16])
def test_the_screens_amx_path_is_the_vnni_screen_bit_for_bit(positions):
    """With AMX the interleaved screen (qscreen16) takes each block's integer sums of 2 or more positions from tile
    products (one position stays on VNNI); they are the VNNI path's integers and the floats after them the same
    operations, so every value is the same bits, at every width, for groups of rows taken three, two and one at a time
    and with the last group padded; an AMX path that dropped the -128 correction (the weights' unsigned offset) fails."""
    k, rows = 640, 3000
    b = torch.from_numpy(random_blocks("Q8_0", rows, k, seed=7, scale=0.5))
    packed = kernel.qpack16(b, k)
    g = torch.Generator().manual_seed(8)
    xq = torch.randint(-127, 128, (positions, k), generator=g, dtype=torch.int8)
    xq[:, :5] = 127
    xq[:, 5:9] = -127
    xs = torch.rand(positions, generator=g) + 0.1
    before = kernel.set_isa(2)
    try:
        vnni = kernel.qscreen16(xq, xs, packed, k)
    finally:
        kernel.set_isa(before)
    kernel.set_isa(0)
    try:
        amx = kernel.qscreen16(xq, xs, packed, k)
    finally:
        kernel.set_isa(before)
    assert amx.shape == (positions, 3008) and torch.equal(amx.view(torch.int32), vnni.view(torch.int32))
    # against the exact screen in float64: within the head's bound
    d = torch.from_numpy(np.ascontiguousarray(b.numpy().reshape(rows, k // 32, 34)[:, :, 0:2]).view(np.float16)
                         .reshape(rows, k // 32).astype(np.float64))
    q = torch.from_numpy(np.ascontiguousarray(b.numpy().reshape(rows, k // 32, 34)[:, :, 2:]).view(np.int8).astype(np.int64))
    ints = torch.einsum("rbi,pbi->prb", q, xq.long().reshape(positions, k // 32, 32))
    exact = xs.double()[:, None] * (ints.double() * d[None]).sum(-1)
    bound = head._gamma(k // 32 + 4) * xs.double()[:, None] * (ints.double().abs() * d.abs()[None]).sum(-1) + 1e-30
    assert ((amx[:, :rows].double() - exact).abs() <= bound).all()


def test_hidden_states_the_integer_screen_resolves_badly_get_every_logit_exactly(monkeypatch):
    """One huge activation sets the 8-bit scale, so the screen's bound keeps most of the vocabulary: the forward
    computes every logit with the exact kernel instead of recomputing thousands of rows one by one; the argmax is
    the exact one either way."""
    vocab, hidden = 16384, 64
    raw = random_blocks("Q8_0", vocab, hidden, seed=6, scale=0.5)
    raw[:, 2 + 9] = 0  # channel 9 sets the scale and adds nothing to the logits
    model, linear, fast = _q8_0_output_layer(raw, hidden)
    t = kernel.BLOCKS["Q8_0"][0]
    g = torch.Generator().manual_seed(8)
    # every other activation just below half an 8-bit step: all of it is the screen's rounding residual
    h = torch.randint(0, 2, (4, hidden), generator=g).float().mul_(2).sub_(1) * 0.49 * 1000.0 / 127
    h[:, 9] = 1000.0
    exact = kernel.qmatmul(h, fast.blocks[0], t, hidden)
    with head.scope(model, greedy=True):
        got = linear(h)
    assert fast.unscreened == 4 and fast.candidates == 0 and torch.equal(got, exact)
    monkeypatch.setattr(head, "SCREEN_CANDIDATES", 4.0)  # no fallback: every candidate recomputed one by one
    with head.scope(model, greedy=True):
        screened = linear(h)
    assert fast.unscreened == 4 and fast.candidates > vocab / 8  # more than the fallback allows
    assert torch.equal(screened.argmax(-1), exact.argmax(-1))
