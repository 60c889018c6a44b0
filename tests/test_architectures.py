"""Architectures beyond Llama: every drafter decodes greedy-identically to transformers' ``generate`` on
tiny random-init models of twelve architectures, with sliding windows far shorter than prompt + output
(all-sliding Mistral and Phi-3, hybrid Qwen2 / Gemma-2 / Gemma-3), eager and SDPA attention; the
architecture table, layer-skip views and draft construction on each."""

from __future__ import annotations

import pytest
import torch
import transformers as tf
from conftest import ByteTokenizer

from specdec.decode.engine.cache import KVState
from specdec.decode.drafters.draft_model import ModelDrafter
from specdec.decode.drafters.model_free import NgramDrafter, RecycleDrafter
from specdec.decode.drafters.base import NoDrafter
from specdec.decode.drafters.self_speculation import layer_skip_view, middle_layers, parse_layerskip
from specdec.decode.drafters.trimmed import TrimmedDrafter
from specdec.decode.engine.loop import SpecEngine
from specdec.decode.engine.types import GenRequest
from specdec.models import arch
from specdec.models.errors import SpecdecError, UsageError
from specdec.train.trainers.draft import new_draft

VOCAB, EOS, WINDOW, NEW = 128, 2, 8, 24
SLIDING, FULL = arch.SLIDING, arch.FULL


def _common(**kw):
    return dict(vocab_size=VOCAB, bos_token_id=1, eos_token_id=EOS, pad_token_id=0, tie_word_embeddings=False, **kw)


def _llama_like(cls, **kw):
    sizes = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4,
             "num_key_value_heads": 4, "max_position_embeddings": 256}
    return cls(**_common(**{**sizes, **kw}))


CONFIGS = {
    "llama": lambda: _llama_like(tf.LlamaConfig),
    "llama-gqa": lambda: _llama_like(tf.LlamaConfig, num_key_value_heads=2),
    "qwen2": lambda: _llama_like(tf.Qwen2Config, num_key_value_heads=2, use_sliding_window=True, sliding_window=WINDOW,
                                 layer_types=[SLIDING, FULL, SLIDING, SLIDING]),
    "qwen3": lambda: _llama_like(tf.Qwen3Config, head_dim=8, num_key_value_heads=2),
    "mistral": lambda: _llama_like(tf.MistralConfig, num_key_value_heads=2, sliding_window=WINDOW),
    "gemma": lambda: _llama_like(tf.GemmaConfig, head_dim=8),
    "gemma2": lambda: _llama_like(tf.Gemma2Config, head_dim=8, query_pre_attn_scalar=8, sliding_window=WINDOW),
    "gemma3": lambda: _llama_like(tf.Gemma3TextConfig, head_dim=8, query_pre_attn_scalar=8, sliding_window=WINDOW,
                                  layer_types=[SLIDING, SLIDING, FULL, SLIDING]),
    "phi3": lambda: _llama_like(tf.Phi3Config, sliding_window=WINDOW + 2),
    "gpt2": lambda: tf.GPT2Config(**_common(n_embd=32, n_layer=4, n_head=4, n_positions=256)),
    "gpt_neox": lambda: tf.GPTNeoXConfig(**_common(hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                                   num_attention_heads=4, max_position_embeddings=256)),
    "opt": lambda: tf.OPTConfig(**_common(hidden_size=32, ffn_dim=64, num_hidden_layers=4, num_attention_heads=4,
                                          word_embed_proj_dim=32, max_position_embeddings=256)),
}
ARCHS = list(CONFIGS)
# each target's draft: another architecture (and model type), same vocabulary
DRAFT_OF = {name: ARCHS[(i + 2) % len(ARCHS)] for i, name in enumerate(ARCHS)}
DRAFTERS = ["ar", "ngram", "recycle", "layerskip", "trimmed", "draft"]


def build(name: str, seed: int = 0, attn: str | None = None):
    """float64 (greedy comparisons are exact), the model's default attention unless ``attn``."""
    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(CONFIGS[name](), **({"attn_implementation": attn} if attn else {}))
    model = model.double().eval()
    with torch.no_grad():  # sharpen the random logits so greedy text is not uniform noise
        model.get_output_embeddings().weight.mul_(8.0)
    return model


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    # a repeated motif so n-gram drafters find matches; lengths differ, so rows are left-padded
    return [(torch.randint(3, VOCAB, (n,), generator=g).tolist() * 2)[: n + 3] for n in (6, 12, 9)]


PROMPTS = _prompts()


class _Zoo:
    """Models and reference continuations, built once per module and only when first asked for."""

    def __init__(self):
        self.models, self.refs = {}, {}

    def model(self, name):
        if name not in self.models:
            self.models[name] = build(name)
        return self.models[name]

    def reference(self, name):
        """transformers' greedy generate, one prompt at a time."""
        if name not in self.refs:
            m = self.model(name)
            self.refs[name] = [
                m.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long), max_new_tokens=NEW,
                           do_sample=False, eos_token_id=EOS, pad_token_id=0)[0, len(p):].tolist()
                for p in PROMPTS
            ]
        return self.refs[name]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Models this small run faster on one thread, and far faster on a shared machine, where a second
    thread spins waiting for a core that another process holds."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def zoo():
    return _Zoo()


def make_drafter(kind: str, name: str, zoo: _Zoo):
    target = zoo.model(name)
    if kind == "ar":
        return NoDrafter()
    if kind == "ngram":
        return NgramDrafter()
    if kind == "recycle":
        return RecycleDrafter()
    if kind == "layerskip":
        return ModelDrafter(layer_skip_view(target, middle_layers(target.config.num_hidden_layers)))
    if kind == "trimmed":  # half the vocabulary and the text's tokens: drafts the set misses are rejected
        return TrimmedDrafter(target, torch.arange(0, VOCAB, 2))
    return ModelDrafter(zoo.model(DRAFT_OF[name]))


def decode(target, drafter, prompts):
    engine = SpecEngine(target, ByteTokenizer(), drafter, eos_ids=[EOS])
    return [r.token_ids for r in engine.generate([GenRequest(p, NEW) for p in prompts])]


@pytest.mark.parametrize("bsz", [1, 3])
@pytest.mark.parametrize("kind", DRAFTERS)
@pytest.mark.parametrize("name", ARCHS)
def test_greedy_decoding_equals_generate(zoo, name, kind, bsz):
    rows = [1] if bsz == 1 else [0, 1, 2]  # batch size 1: the longest prompt
    ref = zoo.reference(name)
    got = decode(zoo.model(name), make_drafter(kind, name, zoo), [PROMPTS[r] for r in rows])
    assert got == [ref[r] for r in rows]


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("name", ["mistral", "qwen2", "gemma3"])
def test_sliding_masks_under_eager_and_sdpa(zoo, name, attn):
    """Tree verification (the richest mask) under both attention implementations."""
    model = build(name, attn=attn)
    assert model.config._attn_implementation == attn
    assert decode(model, RecycleDrafter(), PROMPTS) == zoo.reference(name)


def test_the_window_matters(zoo):
    """Without the window in the mask these models decode differently: the tests above see it."""
    model = zoo.model("gemma3")
    original = KVState.__init__

    def no_window(self, *a, **kw):
        original(self, *a, **kw)
        self._window, self._mixed = None, False

    KVState.__init__ = no_window
    try:
        assert decode(model, NoDrafter(), PROMPTS) != zoo.reference("gemma3")
    finally:
        KVState.__init__ = original


def test_sliding_state_keeps_every_slot_and_its_position(zoo):
    """After decoding past the window, each row's positions are 0..n-1 over its valid slots, and no
    cache layer dropped a key."""
    model = zoo.model("gemma2")
    engine = SpecEngine(model, ByteTokenizer(), RecycleDrafter(), eos_ids=[])
    captured = {}
    original = engine._verify

    def spy(state, batch, proposal, *joining):
        out = original(state, batch, proposal, *joining)
        captured["state"] = state
        return out

    engine._verify = spy
    engine.generate([GenRequest(p, NEW) for p in PROMPTS])
    state = captured["state"]
    for row in range(state.valid.shape[0]):
        assert state.positions[row][state.valid[row]].tolist() == list(range(int(state.pos[row])))
    # every layer, sliding ones included, holds every committed slot (none kept only the last window)
    assert len(state._committed()) == model.config.num_hidden_layers
    assert all(layer.keys.shape[2] >= state.length > model.config.sliding_window for layer in state.cache.layers)


# ---------------------------------------------------------------------------------------------
# The architecture table


LAYER_PATHS = {"gpt2": "transformer.h", "gpt_neox": "gpt_neox.layers", "opt": "model.decoder.layers"}


@pytest.mark.parametrize("name", ARCHS)
def test_decoder_layers_and_attention(zoo, name, monkeypatch):
    model = zoo.model(name)
    parent, attr, layers = arch.decoder_layers(model)
    assert layers is model.get_submodule(LAYER_PATHS.get(name, "model.layers")) and getattr(parent, attr) is layers
    assert [arch.attention_module(layer, model.config)[1].layer_idx for layer in layers] == [0, 1, 2, 3]
    # a model type missing from the table is introspected to the same layers
    monkeypatch.setattr(arch, "ADAPTERS", {})
    assert arch.decoder_layers(model)[2] is layers
    assert arch.attention_module(layers[0])[0] == {"gpt2": "attn", "gpt_neox": "attention"}.get(name, "self_attn")


def test_unknown_layout_is_a_clear_error():
    class Toy(torch.nn.Module):
        config = tf.PretrainedConfig(num_hidden_layers=2)
        config.model_type = "toy"

        def __init__(self):
            super().__init__()
            self.blocks = torch.nn.ModuleList([torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)])

    with pytest.raises(SpecdecError, match="'toy'"):
        arch.decoder_layers(Toy())


def test_layer_types():
    types = {name: arch.layer_types(CONFIGS[name]()) for name in ARCHS}
    assert types["mistral"] == [SLIDING] * 4 and types["phi3"] == [SLIDING] * 4
    assert types["gemma2"] == [SLIDING, FULL, SLIDING, FULL]
    assert types["qwen2"] == [SLIDING, FULL, SLIDING, SLIDING]
    assert all(types[n] == [FULL] * 4 for n in ("llama", "qwen3", "gemma", "gpt2", "gpt_neox", "opt"))
    assert arch.sliding_window(CONFIGS["mistral"]()) == WINDOW and arch.sliding_window(CONFIGS["llama"]()) is None
    # Qwen2 without use_sliding_window sets no window: its layers attend fully whatever layer_types says
    assert arch.sliding_window(tf.Qwen2Config(num_hidden_layers=2, layer_types=[SLIDING, FULL])) is None


# ---------------------------------------------------------------------------------------------
# layerskip


@pytest.mark.parametrize("name", ["gemma3", "gpt2", "gpt_neox", "opt"])
def test_layer_skip_view_leaves_the_target_alone(zoo, name):
    target = zoo.model(name)
    before = target.config.to_dict()
    view = layer_skip_view(target, [1, 2])
    _, _, kept = arch.decoder_layers(view)
    assert len(kept) == 2 and view.config.num_hidden_layers == 2
    assert [arch.attention_module(layer, view.config)[1].layer_idx for layer in kept] == [0, 1]
    if getattr(target.config, "layer_types", None):
        assert view.config.layer_types == [target.config.layer_types[i] for i in (0, 3)]
    assert target.config.to_dict() == before and len(arch.decoder_layers(target)[2]) == 4
    assert [arch.attention_module(layer, target.config)[1].layer_idx for layer in arch.decoder_layers(target)[2]] == [0, 1, 2, 3]
    assert view.get_output_embeddings() is target.get_output_embeddings()  # weights shared, not copied


@pytest.mark.parametrize(
    "spec, layers, message",
    [
        ("layerskip", 2, "at least 3 decoder layers"),
        ("layerskip:1", 2, "at least 3 decoder layers"),
        ("layerskip:0,1,2,3", 4, "some but not all"),
        ("layerskip:,", 4, "some but not all"),
        ("layerskip:4", 4, "no layer 4"),
        ("layerskip:-1", 4, "no layer -1"),
        ("layerskip:a,b", 4, "integer"),
    ],
)
def test_bad_layerskip_is_a_usage_error(spec, layers, message):
    with pytest.raises(UsageError, match=message) as err:
        parse_layerskip(spec, layers)
    assert "\n" not in str(err.value)


def test_layerskip_defaults_and_view_refuses_nothing_or_everything(zoo):
    assert middle_layers(4) == [1, 2] and middle_layers(3) == [1] and parse_layerskip("layerskip", 4) == []
    assert parse_layerskip("layerskip:3,1,1", 4) == [1, 3]
    with pytest.raises(UsageError):
        layer_skip_view(zoo.model("llama"), [])
    with pytest.raises(UsageError):
        layer_skip_view(zoo.model("llama"), [0, 1, 2, 3])


# ---------------------------------------------------------------------------------------------
# Drafts of the target's own architecture


@pytest.mark.parametrize("name", ["qwen2", "gemma3", "phi3", "gpt2", "gpt_neox", "opt"])
def test_new_draft_has_the_targets_architecture(name):
    target = CONFIGS[name]()
    draft = new_draft(target, "layers=2,hidden=64,heads=4")
    cfg = draft.config
    assert cfg.model_type == target.model_type and cfg.num_hidden_layers == 2 and cfg.hidden_size == 64
    assert (cfg.vocab_size, cfg.eos_token_id, cfg.bos_token_id) == (VOCAB, EOS, 1)
    assert getattr(cfg, "rope_parameters", None) == getattr(target, "rope_parameters", None)
    assert arch.sliding_window(cfg) == arch.sliding_window(target)
    if getattr(target, "layer_types", None):
        assert len(cfg.layer_types) == 2 and FULL in cfg.layer_types
    if getattr(target, "head_dim", None):
        assert cfg.head_dim == 16
    assert next(draft.parameters()).dtype == torch.float32
    assert arch.attention_projections(draft)  # LoRA has something to adapt, by this architecture's names
    draft(torch.tensor([[3, 4, 5]]))


def test_new_draft_falls_back_to_llama_with_the_targets_rope():
    # GPT-NeoX has no grouped-query attention: the draft is a Llama, rotating the whole head at the target's theta
    target = tf.GPTNeoXConfig(**_common(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                        rope_parameters={"rope_type": "default", "rope_theta": 5000.0, "partial_rotary_factor": 0.5}))
    draft = new_draft(target, "layers=1,hidden=32,heads=4,kv_heads=2")
    assert draft.config.model_type == "llama" and draft.config.num_key_value_heads == 2
    assert draft.config.rope_parameters == {"rope_type": "default", "rope_theta": 5000.0}
    assert draft.config.vocab_size == VOCAB
    draft(torch.tensor([[3, 4, 5]]))


def test_attention_projections(zoo):
    names = {name: arch.attention_projections(zoo.model(name)) for name in ("llama", "phi3", "gpt2", "gpt_neox", "opt")}
    assert names["llama"] == ["q_proj", "k_proj", "v_proj", "o_proj"]
    assert sorted(names["phi3"]) == ["o_proj", "qkv_proj"]
    assert names["gpt2"] == ["c_attn", "c_proj"]
    assert names["gpt_neox"] == ["query_key_value", "dense"]
    assert sorted(names["opt"]) == ["k_proj", "out_proj", "q_proj", "v_proj"]
