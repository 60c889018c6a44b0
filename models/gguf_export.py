"""A published EAGLE-3 head as a llama.cpp draft: one GGUF file that ``llama-server -m TARGET.gguf -md
DRAFT.gguf --spec-type draft-eagle3`` (and ``llama-speculative-simple``) run beside the target's GGUF.

What llama.cpp reads (llama.cpp's own sources, commit 0c1e570 as vendored by llama-cpp-python 0.3.36:
src/llama-arch.cpp for the names, src/models/eagle3.cpp for the shapes and the graph,
conversion/llama.py for what its converter writes, common/speculative.cpp for the runtime):

  general.architecture        ``eagle3``
  eagle3.*                    the draft layer's Llama hyper-parameters (context_length, embedding_length,
                              block_count 1, feed_forward_length, attention.head_count / head_count_kv /
                              key_length / value_length / layer_norm_rms_eps, rope.freq_base /
                              dimension_count, vocab_size) and, for EAGLE-3: ``target_layers`` (int32
                              array, exactly three target layers whose *inputs* are fused, as
                              HF's ``hidden_states[i]``), ``target_hidden_size``, ``norm_before_residual``,
                              ``norm_before_fc``
  tokenizer.*                 copied from the target's GGUF file: the draft's logits are over the
                              target's vocabulary (``d2t`` maps the draft rows into it)

  tensors (torch [out, in] is GGUF {in, out}):
    fc.weight                 [H, 3*T]    fc                                         F16
    enc.output_norm.weight    [3*T]       input_norm (only with norm_before_fc)      F32
    blk.0.attn_norm.weight    [H]         layers.0.input_layernorm (the embedding's)  F32
    blk.0.attn_norm_2.weight  [H]         layers.0.hidden_norm (the feature's)        F32
    blk.0.attn_{q,k,v}.weight [n*d, 2*H]  layers.0.self_attn.{q,k,v}_proj; q and k rows permuted per
                                          head from rotate-half to llama.cpp's pairwise RoPE
    blk.0.attn_output.weight  [H, n*d]    layers.0.self_attn.o_proj
    blk.0.ffn_norm.weight     [H]         layers.0.post_attention_layernorm
    blk.0.ffn_{gate,up,down}  ...         layers.0.mlp.{gate,up,down}_proj
    output_norm.weight        [H]         norm (before the LM head)
    output.weight             [N, H]      lm_head (the draft vocabulary's N rows)
    d2t                       [N]         int64 *absolute* target ids of the rows (llama.cpp's converter
                                          turns EAGLE's offsets into ids; absent for the whole vocabulary)
    token_embd.weight         [V, H]      embed_tokens, only for a head with its own embedding (otherwise
                                          llama.cpp reads the target's)
    rope_freqs.weight         [d/2]       per-frequency divisors for a non-default RoPE (Llama 3's)

llama.cpp's EAGLE-3 graph has no per-layer norms before fc (``fc_norm``), no fed-back output norm
(speculators' ``norm_output``), no q/k norms (Qwen3 layers) and no biases: heads with those are
refused. Its draft reads the target's token embedding unscaled where Gemma's HF embedding multiplies
by sqrt(hidden); the embedding only enters through ``input_layernorm`` (an RMSNorm), so the two differ
by the norm's epsilon alone.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import torch

from specdec.models.artifacts import load_weights, read_config
from specdec.models.errors import SpecdecError, UsageError

ARCH = "eagle3"  # src/llama-arch.cpp: { LLM_ARCH_EAGLE3, "eagle3" }; the installed gguf package may predate it

# src/llama-arch.cpp LLM_KV_NAMES (gguf-py/gguf/constants.py Keys.LLM in newer gguf releases)
KEY_TARGET_LAYERS = f"{ARCH}.target_layers"
KEY_TARGET_HIDDEN_SIZE = f"{ARCH}.target_hidden_size"
KEY_NORM_BEFORE_RESIDUAL = f"{ARCH}.norm_before_residual"
KEY_NORM_BEFORE_FC = f"{ARCH}.norm_before_fc"

# specdec's Eagle3Head parameter -> llama.cpp tensor (src/llama-arch.cpp LLM_TENSOR_NAMES: fc, d2t,
# enc.output_norm, blk.%d.attn_norm_2 and the Llama names)
TENSORS = {
    "fc.weight": "fc.weight",
    "input_norm.weight": "enc.output_norm.weight",
    "layers.0.input_layernorm.weight": "blk.0.attn_norm.weight",
    "layers.0.hidden_norm.weight": "blk.0.attn_norm_2.weight",
    "layers.0.self_attn.q_proj.weight": "blk.0.attn_q.weight",
    "layers.0.self_attn.k_proj.weight": "blk.0.attn_k.weight",
    "layers.0.self_attn.v_proj.weight": "blk.0.attn_v.weight",
    "layers.0.self_attn.o_proj.weight": "blk.0.attn_output.weight",
    "layers.0.post_attention_layernorm.weight": "blk.0.ffn_norm.weight",
    "layers.0.mlp.gate_proj.weight": "blk.0.ffn_gate.weight",
    "layers.0.mlp.up_proj.weight": "blk.0.ffn_up.weight",
    "layers.0.mlp.down_proj.weight": "blk.0.ffn_down.weight",
    "norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
    "embed_tokens.weight": "token_embd.weight",
}
D2T = "d2t"
ROPE_FREQS = "rope_freqs.weight"

# GGUF architectures whose llama.cpp graph (at the commit above) never records its layers' inputs
# (``res->t_layer_inp``), which draft-eagle3 reads from the target: llama.cpp aborts on such a target in
# llm_graph_result::set_outputs ("layer input tensor is null"); src/models/<arch>.cpp
NO_LAYER_INPUTS = ("gemma", "gemma2", "gemma3", "gemma3n")
F16_MAX = 65504.0


def _refuse(src: Path, cfg: dict) -> None:
    """One ``UsageError`` naming everything of the head llama.cpp's EAGLE-3 draft cannot hold."""
    kind, layout = cfg.get("kind"), cfg.get("layout")
    if kind != "eagle":
        raise UsageError(f"--to gguf writes EAGLE-3 heads for llama.cpp's draft-eagle3; {src} is a {kind!r} head")
    if layout != "eagle3":
        what = ("an EAGLE-1 head (llama.cpp runs EAGLE-3 drafts only)" if layout == "eagle1" else
                f"specdec's own EAGLE{'-3' if cfg.get('feature_layers') else ''} architecture, which llama.cpp does not run")
        raise UsageError(f"--to gguf: {src} is {what}; train it with `specdec train-heads --kind eagle --eagle3 --layout "
                         "published` to export it --to gguf")
    layer = cfg.get("layer") or {}
    missing = []
    if len(cfg.get("feature_layers") or []) != 3:
        missing.append(f"{len(cfg.get('feature_layers') or [])} fused target layers (llama.cpp fuses exactly 3)")
    if cfg.get("fc_norm"):
        missing.append("fc_norm (a norm per fused layer before fc; llama.cpp has only norm_before_fc, one norm over all "
                       "three: train with norm_before_fc instead)")
    if cfg.get("norm_output"):
        missing.append("norm_output (the normalised state fed back; llama.cpp feeds back the pre-norm state)")
    if cfg.get("logits_norm", True) is False:
        missing.append("an LM head without its norm (llama.cpp always normalises before it)")
    if layer.get("model_type") == "qwen3":
        missing.append("a Qwen3 layer's q/k norms")
    if layer.get("attention_bias") or layer.get("mlp_bias"):
        missing.append("biases in the draft layer")
    if missing:
        raise UsageError(f"--to gguf: llama.cpp's EAGLE-3 draft cannot hold {src}'s " + "; ".join(missing) +
                         " (export it --to speculators, or train without these for llama.cpp)")


def target_gguf_of(src: Path) -> Path:
    """The GGUF file of the target a head was trained on (its training config's ``target``: a GGUF file
    or the default model, converted by specdec; the default model's file is assembled from its package)."""
    from specdec.models.interop import _verifier

    verifier = _verifier(src)
    if verifier and Path(verifier).is_file() and verifier.lower().endswith(".gguf"):
        return Path(verifier)
    if verifier and Path(verifier).is_dir():
        from specdec.models.gguf import source_file

        path = source_file(Path(verifier))
        if path is not None:
            return path
    raise UsageError(f"--to gguf copies the target's tokenizer from its GGUF file; {src}'s target "
                     f"{verifier or '(unknown: no training_config.yaml)'} came from no GGUF file specdec knows: "
                     "pass --target TARGET.gguf")


def _permute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Rows of q/k from HF's rotate-half RoPE layout (pairs j, j + d/2) to llama.cpp's pairwise one (2j, 2j+1)."""
    rows = w.shape[0]
    return w.reshape(heads, 2, rows // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _array(w: torch.Tensor) -> np.ndarray:
    """Matrices in float16 (float32 where a value would overflow it), vectors in float32, as llama.cpp's
    converter writes norms."""
    w = w.detach().to("cpu", torch.float32).contiguous()
    if w.dim() >= 2 and float(w.abs().max()) <= F16_MAX:
        return w.numpy().astype(np.float16)
    return w.numpy()


def _rope(layer: dict, writer) -> np.ndarray | None:
    """Writes the RoPE keys; returns llama.cpp's per-frequency divisors for a non-default RoPE (None for
    the default): the base frequencies over the ones transformers' initialiser gives (Llama 3's)."""
    from specdec.models.heads import rope_frequencies
    from specdec.models.heads import layer_hf_config

    rope = dict(layer.get("rope_parameters") or {})
    rope_type, theta, d = rope.get("rope_type", "default"), float(rope.get("rope_theta", 10000.0)), int(layer["head_dim"])
    writer.add_rope_freq_base(theta)
    writer.add_rope_dimension_count(d)
    if rope_type == "default":
        return None
    if rope_type in ("dynamic", "yarn", "longrope"):
        raise UsageError(f"--to gguf: the draft layer's RoPE is {rope_type!r}; the export writes default, linear and "
                         "llama3 RoPE (export it --to speculators)")
    inv_freq, scaling = rope_frequencies(layer_hf_config(layer), d)
    if abs(scaling - 1.0) > 1e-6:
        raise UsageError(f"--to gguf: the draft layer's {rope_type!r} RoPE scales attention by {scaling}; llama.cpp's "
                         "EAGLE-3 draft does not")
    base = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    return (base / inv_freq).float().numpy()


def _copy_tokenizer(reader, writer) -> int:
    """Every ``tokenizer.*`` field of the target's file, byte for byte; the vocabulary's size."""
    import gguf

    size = 0
    for name, field in reader.fields.items():
        if not name.startswith("tokenizer."):
            continue
        vtype, sub = field.types[0], field.types[-1]
        if vtype == gguf.GGUFValueType.ARRAY:
            if len(field.types) != 2:
                raise SpecdecError(f"the target's {name} is a nested array, which the export does not copy")
            if sub == gguf.GGUFValueType.STRING:  # raw bytes: a token need not be valid UTF-8
                value = [bytes(field.parts[i]) for i in field.data]
            else:
                value = field.contents()
            if not value:
                continue
            writer.add_key_value(name, value, vtype, sub_type=sub)
            if name == "tokenizer.ggml.tokens":
                size = len(value)
        else:
            value = bytes(field.parts[-1]) if vtype == gguf.GGUFValueType.STRING else field.contents()
            writer.add_key_value(name, value, vtype)
    if not size:
        raise SpecdecError("the target's GGUF file has no tokenizer.ggml.tokens: llama.cpp's draft needs its vocabulary")
    return size


def _target_field(reader, key: str):
    field = reader.fields.get(key)
    return None if field is None else field.contents()


def export_gguf(src: str | os.PathLike, dst: str | os.PathLike, target: str | os.PathLike | None = None,
                announce=None) -> Path:
    """A published EAGLE-3 head (``train-heads --kind eagle --eagle3 --layout published``) as one GGUF
    file of llama.cpp's ``eagle3`` architecture. ``target``: the target's GGUF file (default: the file the
    head's training target was converted from)."""
    import gguf

    src, dst = Path(src), Path(dst)
    cfg = read_config(src)
    _refuse(src, cfg)
    target = Path(target) if target is not None else target_gguf_of(src)
    if not target.is_file():
        raise UsageError(f"--to gguf: no such target GGUF file: {target}")
    if dst.is_dir():
        dst = dst / f"{src.name}.gguf"
    layer = cfg["layer"]
    hidden, heads, kv_heads = int(layer["hidden_size"]), int(layer["num_attention_heads"]), int(layer["num_key_value_heads"])
    vocab, feature_layers = int(cfg["vocab_size"]), [int(i) for i in cfg["feature_layers"]]
    target_hidden = int(cfg.get("target_hidden_size") or hidden)

    try:
        reader = gguf.GGUFReader(str(target))
    except (ValueError, OSError) as exc:
        raise SpecdecError(f"{target}: not a readable GGUF file ({exc})") from None
    arch = str(_target_field(reader, "general.architecture"))
    t_hidden, t_layers = _target_field(reader, f"{arch}.embedding_length"), _target_field(reader, f"{arch}.block_count")
    if t_hidden is not None and int(t_hidden) != target_hidden:
        raise UsageError(f"--to gguf: {target} is a model of hidden size {t_hidden}; {src} fuses features of {target_hidden}")
    if t_layers is not None and max(feature_layers) >= int(t_layers):
        raise UsageError(f"--to gguf: {src} fuses target layers {feature_layers}; {target} has {t_layers} layers")

    weights = load_weights(src)
    ids = weights.pop("draft_ids", None)
    state = {"lm_head.weight": weights["lm_head.weight"]}
    d2t = None
    if ids is not None:
        from specdec.models.interop import _sorted_vocab

        _, d2t = _sorted_vocab(state, ids.round().long())  # rows in ascending target order, as EAGLE's tools
        if int(d2t.min()) < 0 or int(d2t.max()) >= vocab or len(set(d2t.tolist())) != len(d2t):
            raise SpecdecError(f"{src}: its draft vocabulary maps outside the target's {vocab} tokens or twice onto one")
    weights.update(state)
    rows = weights["lm_head.weight"].shape[0]
    if d2t is None and rows != vocab:
        raise SpecdecError(f"{src}: an LM head of {rows} rows without a draft vocabulary map (target vocabulary {vocab})")

    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_name(f".{dst.name}.partial")
    writer = gguf.GGUFWriter(str(tmp), ARCH)
    try:
        writer.add_type("model")
        writer.add_name(f"{src.name} (specdec EAGLE-3 draft)")
        writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
        writer.add_context_length(int(layer.get("max_position_embeddings") or 2048))
        writer.add_embedding_length(hidden)
        writer.add_block_count(1)
        writer.add_feed_forward_length(int(layer["intermediate_size"]))
        writer.add_head_count(heads)
        writer.add_head_count_kv(kv_heads)
        writer.add_key_length(int(layer["head_dim"]))
        writer.add_value_length(int(layer["head_dim"]))
        writer.add_layer_norm_rms_eps(float(layer["rms_norm_eps"]))
        rope_freqs = _rope(layer, writer)
        writer.add_vocab_size(vocab)
        writer.add_key_value(KEY_TARGET_LAYERS, feature_layers, gguf.GGUFValueType.ARRAY, sub_type=gguf.GGUFValueType.INT32)
        writer.add_uint32(KEY_TARGET_HIDDEN_SIZE, target_hidden)
        writer.add_bool(KEY_NORM_BEFORE_RESIDUAL, bool(cfg.get("norm_before_residual")))
        writer.add_bool(KEY_NORM_BEFORE_FC, bool(cfg.get("norm_before_fc")))
        tokens = _copy_tokenizer(reader, writer)
        if tokens != vocab:
            raise UsageError(f"--to gguf: {target}'s tokenizer has {tokens} tokens; {src} was trained on a target "
                             f"vocabulary of {vocab}")

        for name, w in weights.items():
            if name not in TENSORS:
                raise SpecdecError(f"{src}: no llama.cpp EAGLE-3 tensor holds {name!r}")
            if name == "input_norm.weight" and not cfg.get("norm_before_fc"):
                continue
            if name == "layers.0.self_attn.q_proj.weight":
                w = _permute(w, heads)
            elif name == "layers.0.self_attn.k_proj.weight":
                w = _permute(w, kv_heads)
            writer.add_tensor(TENSORS[name], _array(w))
        if d2t is not None:
            writer.add_tensor(D2T, d2t.to(torch.int64).numpy())
        if rope_freqs is not None:
            writer.add_tensor(ROPE_FREQS, rope_freqs.astype(np.float32))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        os.replace(tmp, dst)
    finally:
        writer.close()
        tmp.unlink(missing_ok=True)
    if arch in NO_LAYER_INPUTS:
        _say(announce, f"note: llama.cpp (at 0c1e570) does not record a {arch} target's layer inputs, which draft-eagle3 "
                       f"reads (src/models/{arch}.cpp sets no t_layer_inp): it aborts with 'layer input tensor is null' "
                       "until its graph does")
    return dst


def _say(announce, message: str) -> None:
    if announce is not None:
        announce(message)
    else:
        print(message, file=sys.stderr, flush=True)
