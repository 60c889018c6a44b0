"""Tiny GGUF files written with the ``gguf`` package, as llama.cpp's converter lays them out."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch


def write_tiny_llama_gguf(path: Path, tokenizer, layers: int = 2, hidden: int = 48, heads: int = 4, kv_heads: int = 2,
                          ffn: int = 96, context: int = 256, seed: int = 0, dtype: str = "F32") -> Path:
    """A random Llama in GGUF with ``tokenizer``'s byte-level BPE vocabulary (``gpt2`` tokenizer model).
    dtype F32 or F16 tensors (transformers dequantises either), or "mixed": the matrices as quantised
    blocks of the types a Q4_K_M file mixes (Q8_0, Q5_0, Q4_K, Q6_K in turn; hidden and ffn multiples of 256)."""
    import gguf

    g = torch.Generator().manual_seed(seed)
    vocab = tokenizer.get_vocab()
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    merges = [" ".join(pair) if isinstance(pair, (tuple, list)) else pair for pair in _merges(tokenizer)]
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("tiny-llama")
    writer.add_context_length(context)
    writer.add_embedding_length(hidden)
    writer.add_block_count(layers)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_dimension_count(hidden // heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(len(tokens))
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    special = set(tokenizer.all_special_ids)
    writer.add_token_types([gguf.TokenType.CONTROL if i in special else gguf.TokenType.NORMAL for i in range(len(tokens))])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(tokenizer.bos_token_id)
    writer.add_eos_token_id(tokenizer.eos_token_id)
    writer.add_pad_token_id(tokenizer.pad_token_id)
    np_dtype = np.float16 if dtype == "F16" else np.float32
    head_dim = hidden // heads

    kinds = iter(["Q8_0", "Q5_0", "Q4_K", "Q6_K"] * 64)
    counter = iter(range(1 << 20))  # each matrix its own draws

    def tensor(name: str, *shape: int, scale: float = 0.08, one: bool = False):
        if dtype == "mixed" and not one:
            qtype = next(kinds)
            writer.add_tensor(name, random_blocks(qtype, shape[0], shape[1], seed=seed * 1000 + next(counter), scale=scale),
                              raw_dtype=getattr(gguf.GGMLQuantizationType, qtype))
            return
        data = torch.ones(shape) if one else torch.randn(shape, generator=g) * scale
        # norms stay float32, as llama.cpp writes them
        writer.add_tensor(name, data.numpy().astype(np.float32 if one else np_dtype))

    tensor("token_embd.weight", len(tokens), hidden, scale=0.5)
    for i in range(layers):
        tensor(f"blk.{i}.attn_norm.weight", hidden, one=True)
        tensor(f"blk.{i}.attn_q.weight", heads * head_dim, hidden)
        tensor(f"blk.{i}.attn_k.weight", kv_heads * head_dim, hidden)
        tensor(f"blk.{i}.attn_v.weight", kv_heads * head_dim, hidden)
        tensor(f"blk.{i}.attn_output.weight", hidden, heads * head_dim)
        tensor(f"blk.{i}.ffn_norm.weight", hidden, one=True)
        tensor(f"blk.{i}.ffn_gate.weight", ffn, hidden)
        tensor(f"blk.{i}.ffn_up.weight", ffn, hidden)
        tensor(f"blk.{i}.ffn_down.weight", hidden, ffn)
    tensor("output_norm.weight", hidden, one=True)
    tensor("output.weight", len(tokens), hidden, scale=0.6)  # sharp logits: greedy text is not noise
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def random_blocks(qtype: str, rows: int, k: int, seed: int = 0, scale: float = 0.08) -> np.ndarray:
    """[rows, row bytes] uint8: ``rows`` x ``k`` weights as blocks of ``qtype``. Q8_0 and Q5_0 quantise normal
    draws with gguf; gguf cannot quantise K-quants, so their quants and scales are random bytes under fp16
    super-scales sized to give weights of about ``scale``."""
    import gguf

    rng = np.random.default_rng(seed)
    if qtype in ("Q8_0", "Q5_0"):
        data = (rng.standard_normal((rows, k)) * scale).astype(np.float32)
        return gguf.quants.quantize(data, getattr(gguf.GGMLQuantizationType, qtype)).reshape(rows, -1)
    n = rows * k // 256

    def f16(lo, hi):
        return rng.uniform(lo, hi, (n, 1)).astype(np.float16).view(np.uint8)

    def raw(width):
        return rng.integers(0, 256, (n, width), dtype=np.uint8)

    if qtype == "Q4_K":  # d, dmin, 12 bytes of 6-bit scales and mins, 128 bytes of nibbles
        blocks = np.concatenate([f16(scale / 160, scale / 80), f16(scale / 80, scale / 40), raw(12), raw(128)], axis=1)
    elif qtype == "Q6_K":  # 128 bytes of low nibbles, 64 of high bits, 16 int8 scales, d
        blocks = np.concatenate([raw(128), raw(64), raw(16), f16(-scale / 900, scale / 900)], axis=1)
    else:
        raise ValueError(qtype)
    return blocks.reshape(rows, -1)


def _merges(tokenizer) -> list:
    import json

    model = json.loads(tokenizer.backend_tokenizer.to_str())["model"]
    return model["merges"]
