"""specdec on a CUDA device: decode and bench in bf16 with each drafter kind, trainers' steps, and
big-model placement. Skipped where no GPU is visible (``cuda`` marker); ``scripts/gpu-check`` runs them."""

import json

import pytest
import torch
from conftest import invoke

pytestmark = pytest.mark.cuda


def _generate_reference(model, tok, prompts, n):
    out = []
    for p in prompts:
        ids = torch.tensor([p], device=model.device)
        gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                             pad_token_id=tok.pad_token_id, eos_token_id=None)
        out.append(gen[0, len(p):].tolist())
    return out


@pytest.mark.parametrize("drafter", ["ar", "ngram", "recycle", "layerskip:1", "draft"])
def test_cuda_bf16_decoding_is_identical_to_generate_in_the_same_dtype(tiny_family, drafter):
    from specdec.decode.engine.loop import SpecEngine
    from specdec.decode.options import DecodeOptions
    from specdec.decode.drafters.registry import build_drafter
    from specdec.decode.jobs.build import load_decode_target
    from specdec.decode.engine.types import GenRequest

    opts = DecodeOptions(device="cuda", dtype="bfloat16")
    target = tiny_family / "target"
    if drafter.startswith("layerskip"):  # layer skipping needs a target of 3 layers or more
        from conftest import save_tiny_lm, tiny_tokenizer

        target = tiny_family / "deep-target"
        if not target.exists():
            save_tiny_lm(target, tiny_tokenizer(), seed=0, layers=4)
    model, tok, _ = load_decode_target(str(target), opts)
    assert model.device.type == "cuda" and model.dtype == torch.bfloat16
    spec = str(tiny_family / "draft") if drafter == "draft" else drafter
    prompts = [tok(f"def f{i}(x, y):\n    return")["input_ids"] for i in range(3)]
    engine = SpecEngine(model, tok, build_drafter(spec, model, tok, opts), eos_ids=[])
    got = [r.token_ids for r in engine.generate([GenRequest(p, 16) for p in prompts])]
    assert got == _generate_reference(model, tok, prompts, 16)


def test_cuda_decode_and_bench_cli(tiny_family, tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"prompt": f"def g{i}(a):\n", "category": "code"}) + "\n" for i in range(4)))
    res = invoke(["decode", "--in", src, "--out", tmp_path / "o.jsonl", "--target", tiny_family / "target", "--device", "cuda",
                  "--dtype", "bfloat16", "--drafter", tiny_family / "draft", "--max-new-tokens", "12"])
    assert res.exit_code == 0, res.output
    res = invoke(["bench", "--in", src, "--target", tiny_family / "target", "--device", "cuda", "--dtype", "bfloat16",
                  "--methods", f"ar,ngram,{tiny_family / 'draft'}", "--max-new-tokens", "12", "--out", tmp_path / "r.json"])
    assert res.exit_code == 0, res.output
    report = json.loads((tmp_path / "r.json").read_text())
    assert all(m["identical_to_ar"] == 1.0 for m in report["methods"] if "identical_to_ar" in m)


@pytest.mark.parametrize("command", ["train-draft", "train-heads", "train-acceptance"])
def test_cuda_trainers_run_their_steps_on_the_gpu(tiny_family, tmp_path, command):
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"prompt": "def add(a, b):\n    return a + b\n" * 4}) + "\n" for _ in range(64)))
    common = ["--target", tiny_family / "target", "--data", data, "--max-steps", "3", "--batch-size", "4", "--seq-len", "32",
              "--device", "cuda", "--checkpoint-every", "0"]
    if command == "train-draft":
        args = [command, *common, "--out", tmp_path / "d", "--arch", "layers=1,hidden=32,heads=4"]
    elif command == "train-heads":
        args = [command, "--kind", "eagle", *common, "--out", tmp_path / "e"]
    else:
        args = [command, *common, "--draft", tiny_family / "draft", "--out", tmp_path / "a", "--budget-minutes", "0.5"]
    res = invoke(args)
    assert res.exit_code == 0, res.output


@pytest.mark.parametrize("kind", ["medusa", "clover", "eagle", "chimera", "ppd", "hidden-transfer"])
def test_cuda_each_head_kind_trained_on_the_gpu_decodes_as_generate_in_bf16(tiny_family, tmp_path, kind):
    """A few GPU training steps of each head kind, then bf16 decoding with the artifact through the
    registry: the tokens are ``generate``'s in bf16 (heads, trees and riding prompts verified on CUDA)."""
    from specdec.decode.drafters.registry import build_drafter
    from specdec.decode.engine.loop import SpecEngine
    from specdec.decode.engine.types import GenRequest
    from specdec.decode.jobs.build import load_decode_target
    from specdec.decode.options import DecodeOptions

    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"prompt": "def add(a, b):\n    return a + b\n" * 4}) + "\n" for _ in range(64)))
    res = invoke(["train-heads", "--kind", kind, "--target", tiny_family / "target", "--data", data, "--max-steps", "3",
                  "--batch-size", "4", "--seq-len", "32", "--device", "cuda", "--checkpoint-every", "0", "--out", tmp_path / kind])
    assert res.exit_code == 0, res.output
    opts = DecodeOptions(device="cuda", dtype="bfloat16")
    model, tok, _ = load_decode_target(str(tiny_family / "target"), opts)
    prompts = [tok(f"def f{i}(x, y):\n    return")["input_ids"] for i in range(3)]
    engine = SpecEngine(model, tok, build_drafter(str(tmp_path / kind), model, tok, opts), eos_ids=[])
    got = [r.token_ids for r in engine.generate([GenRequest(p, 16) for p in prompts])]
    assert got == _generate_reference(model, tok, prompts, 16)


def test_cuda_device_map_spreads_a_target_and_decodes_the_same(tiny_family):
    from specdec.decode.engine.loop import SpecEngine
    from specdec.decode.engine.types import GenRequest
    from specdec.models.loading import Placement, load_target

    plain, tok, _ = load_target(tiny_family / "target", Placement(device="cuda", dtype="float32"))
    mapped, _, _ = load_target(tiny_family / "target", Placement(device="cuda", dtype="float32", device_map="auto"))
    # one GPU: accelerate's map puts every layer on it (transformers records no map then); several: spread
    assert all(p.device.type == "cuda" for p in mapped.parameters())
    if torch.cuda.device_count() > 1:
        assert len(set(mapped.hf_device_map.values())) > 1
    prompts = [tok("class A:\n")["input_ids"]]
    outs = [SpecEngine(m, tok).generate([GenRequest(p, 12) for p in prompts]) for m in (plain, mapped)]
    assert outs[0][0].token_ids == outs[1][0].token_ids


def _cuda_float32(tiny_family):
    from specdec.decode.options import DecodeOptions
    from specdec.decode.jobs.build import load_decode_target

    opts = DecodeOptions(device="cuda", dtype="float32")  # float32: eager and compiled kernels agree token for token
    model, tok, _ = load_decode_target(str(tiny_family / "target"), opts)
    return model, tok, opts


@pytest.mark.parametrize("drafter", ["ar", "draft", "draft+parallel", "draft+parallel+pre-verify"])
def test_cuda_compiled_steps_and_parallel_drafts_decode_as_eager_ones_do(tiny_family, drafter):
    """Recorded CUDA graphs over the preallocated buffers (--compile graphs, the default on a GPU), and
    PEARL's draft on a stream of its own, give the tokens eager decoding gives, with rows joining a
    running batch; the graphs were recorded and replayed."""
    import dataclasses

    from specdec.decode.engine.loop import SpecEngine
    from specdec.decode.drafters.registry import build_drafter
    from specdec.decode.engine.types import GenRequest

    model, tok, opts = _cuda_float32(tiny_family)
    name, *flags = drafter.split("+")
    opts = dataclasses.replace(opts, parallel="parallel" in flags, pre_verify="pre-verify" in flags)
    spec = str(tiny_family / "draft") if name == "draft" else name
    reqs = [GenRequest(tok(f"def f{i}(x, y):\n    return")["input_ids"], 8 + 5 * i) for i in range(5)]
    from specdec.decode.engine import compiled

    eager = SpecEngine(model, tok, build_drafter(spec, model, tok, opts), eos_ids=[], compile="off")
    want = [r.token_ids for r in eager.generate(reqs)]
    engine = SpecEngine(model, tok, build_drafter(spec, model, tok, opts), eos_ids=[])
    assert engine.compile == "graphs"  # auto, on a GPU
    got = dict(engine.stream(iter(reqs), 2))
    assert [got[i].token_ids for i in range(len(reqs))] == want, drafter
    graphed = compiled.for_model(model, "graphs", engine.kernels)
    assert graphed.record and graphed.recorded > 0 and graphed.replays > graphed.recorded


def test_cuda_a_prefix_held_once_decodes_as_whole_prompts_do(tiny_family):
    from specdec.decode.engine.loop import SpecEngine
    from specdec.decode.engine.types import GenRequest

    model, tok, _ = _cuda_float32(tiny_family)
    head = tok("# a shared system prompt, long enough to be shared by every record of the job\n" * 2)["input_ids"]
    reqs = [GenRequest(head + tok(f"def g{i}(a):\n")["input_ids"], 12) for i in range(4)]
    whole = [r.token_ids for r in SpecEngine(model, tok, eos_ids=[], shared_prefix=None).generate(reqs)]
    engine = SpecEngine(model, tok, eos_ids=[], shared_prefix="auto", min_shared=8)
    assert [r.token_ids for r in engine.generate(reqs)] == whole
    assert engine._hydragen() and engine._prefix is not None
