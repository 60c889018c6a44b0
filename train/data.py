"""Training text through ``datasets``: JSONL (the output of ``specdec decode``), Parquet, plain text.

Self-distillation is a pipeline: ``specdec decode`` writes records with ``prompt`` and
``completion``; those records are training data here (prompt + completion is one document).
Error records (``{"id", "line", "error"}``) are skipped.
"""

from __future__ import annotations

from pathlib import Path

from specdec.models.artifacts import SpecdecError, UsageError

TEXT_FIELDS = ("text", "content")


def load_texts(files: list[str | Path]) -> list[str]:
    """One string per document, in file order."""
    import datasets
    from datasets import load_dataset

    datasets.disable_progress_bars()
    texts: list[str] = []
    for f in files:
        path = Path(f)
        if not path.exists():
            raise SpecdecError(f"no such data file: {path}")
        suffix = path.suffix.lower()
        if suffix in (".jsonl", ".json"):
            ds = load_dataset("json", data_files=str(path), split="train")
        elif suffix == ".parquet":
            ds = load_dataset("parquet", data_files=str(path), split="train")
        else:
            ds = load_dataset("text", data_files=str(path), split="train", sample_by="document")
        for rec in ds:
            text = record_text(rec)
            if text:
                texts.append(text)
    if not texts:
        raise SpecdecError(f"no usable training text in {', '.join(map(str, files))}")
    return texts


def record_text(rec: dict) -> str | None:
    """prompt + completion, or messages joined, or a text field; None for error records."""
    if rec.get("error"):
        return None
    prompt = rec.get("prompt")
    if isinstance(prompt, str) and prompt:
        completion = rec.get("completion") or ""
        return prompt + (completion if isinstance(completion, str) else "")
    msgs = rec.get("messages")
    if isinstance(msgs, list) and msgs:
        completion = rec.get("completion")
        turns = [str(m.get("content", "")) for m in msgs if isinstance(m, dict)]
        return "\n".join(turns + ([completion] if isinstance(completion, str) and completion else []))
    for key in TEXT_FIELDS:
        if isinstance(rec.get(key), str) and rec[key]:
            return rec[key]
    return None


def block_prefix(tokenizer) -> list[int]:
    """The special tokens the tokenizer puts in front of a prompt when it encodes one: Gemma's and Llama's
    BOS; nothing for a GPT-2 style tokenizer (its BOS is its EOS and it prepends nothing).

    Every decoded prompt starts with them (decode encodes with the tokenizer's defaults), and a target may
    read text without them far worse (Gemma 3 270M's next-token loss on code about doubles), so a drafter
    trained on blocks without them learns the target's answers to text no prompt looks like. Asked of the
    tokenizer itself rather than read from ``bos_token_id``, which many tokenizers set and never prepend."""
    plain = tokenizer("a", add_special_tokens=False)["input_ids"]
    with_special = tokenizer("a", add_special_tokens=True)["input_ids"]
    # a tokenizer may also append tokens (EOS): the prefix is what precedes the plain text
    for n in range(len(with_special) - len(plain) + 1):
        if with_special[n : n + len(plain)] == plain:
            return list(with_special[:n])
    return []


def cut_blocks(stream, seq_len: int, prefix: list[int]):
    """[n, seq_len] training blocks laid out as the target reads a prompt: ``prefix`` (``block_prefix``), then
    the next ``seq_len - len(prefix)`` tokens of ``stream`` (a 1-D tensor: documents' tokens, EOS between
    them), in the stream's dtype. The tail that fills no block is dropped. Every trainer's blocks are cut
    here, so none can leave the prefix out."""
    import torch

    body = seq_len - len(prefix)
    if body < 1:
        raise UsageError(f"seq_len {seq_len} leaves no room for text after the {len(prefix)} token(s) the tokenizer "
                         f"puts in front of a prompt; use a longer seq_len")
    n = len(stream) // body
    blocks = stream[: n * body].view(n, body)
    if prefix:
        blocks = torch.cat([torch.tensor(prefix, dtype=stream.dtype).expand(n, -1), blocks], 1)
    return blocks


def tokenize_blocks(texts: list[str], tokenizer, seq_len: int, heldout: float = 0.1, seed: int = 0):
    """Concatenate documents (EOS between them) and cut blocks of ``seq_len`` tokens (``cut_blocks``: each
    starts with the tokens the tokenizer puts in front of a prompt).

    Returns (train, heldout) ``datasets.Dataset`` with columns input_ids and idx (block index,
    used to look up cached teacher outputs), formatted as torch tensors.
    """
    import itertools

    import datasets
    import torch
    from datasets import Dataset

    datasets.disable_progress_bars()
    eos = tokenizer.eos_token_id
    prefix = block_prefix(tokenizer)

    def tok(batch):
        ids = tokenizer(batch["text"], add_special_tokens=False)["input_ids"]
        return {"ids": [x + ([eos] if eos is not None else []) for x in ids]}

    def blocks(batch):
        flat = torch.tensor(list(itertools.chain.from_iterable(batch["ids"])), dtype=torch.long)
        return {"input_ids": cut_blocks(flat, seq_len, prefix).tolist()}

    ds = Dataset.from_dict({"text": texts})
    ds = ds.map(tok, batched=True, remove_columns=["text"])
    # one map batch = the whole corpus so no tail is lost between map batches
    ds = ds.map(blocks, batched=True, batch_size=len(ds), remove_columns=["ids"])
    if len(ds) < 2:
        raise SpecdecError(f"too little text for blocks of {seq_len} tokens ({len(ds)} block(s)); lower seq_len")
    ds = ds.add_column("idx", list(range(len(ds))))
    n_held = max(1, int(round(len(ds) * heldout))) if heldout > 0 else 0
    if n_held:
        split = ds.train_test_split(test_size=n_held, seed=seed, shuffle=True)
        train, held = split["train"], split["test"]
        train = train.remove_columns("idx").add_column("idx", list(range(len(train))))
    else:
        train, held = ds, ds.select([])
    return train.with_format("torch"), held.with_format("torch")


def load_blocks(files: list[str | Path], tokenizer, seq_len: int, heldout: float = 0.1, seed: int = 0):
    return tokenize_blocks(load_texts(files), tokenizer, seq_len, heldout, seed)


def self_distill(target_dir: str | Path, prompts: list[str], out: str | Path, budget_s: float, max_new_tokens: int = 128,
                 batch_size: int = 32, drafter: str = "ngram") -> int:
    """Write the target's own greedy continuations of ``prompts`` to ``out`` (the `specdec decode` format,
    the same job code) until ``budget_s`` is spent; returns the records written.

    Drafters trained on them learn what the target says rather than what the corpus says (Medusa-2 and
    EAGLE's self-distillation). ``drafter`` is lossless at T=0, so it only makes the decode faster.
    """
    import itertools
    import time

    from specdec.decode.jobs.io import JsonlWriter, Record
    from specdec.decode.jobs.job import Decoder
    from specdec.decode.options import DecodeOptions

    decoder = Decoder(str(target_dir), DecodeOptions(drafter=drafter, max_new_tokens=max_new_tokens, batch_size=batch_size))
    deadline = time.perf_counter() + budget_s
    records = (Record(line=i + 1, id=f"regen-{i}", prompt=p) for i, p in enumerate(prompts))
    # checked as each record is taken, so the batch under way finishes and the file has no torn line
    records = itertools.takewhile(lambda _: time.perf_counter() < deadline, records)
    writer = JsonlWriter(out, overwrite=True)
    try:
        summary = decoder.run(records, writer)
    finally:
        writer.close()
    return summary.ok


def load_teacher(target: str | Path, placement, accelerator):
    """A trainer's frozen target and its tokenizer: on this process's device (or spread over the GPUs
    by ``--device-map auto``), in the placement's dtype (the checkpoint's on a GPU, float32 on a CPU)."""
    from specdec.models.loading import Placement, load_target

    placement = placement or Placement()
    model, tokenizer, _ = load_target(target, placement, device=None if placement.device_map else accelerator.device)
    return model, tokenizer


def trainable_draft(path: str | Path, placement):
    """A draft checkpoint to train further: float32 weights on the CPU (accelerate places it), with gradients."""
    from specdec.models.loading import Placement, load_draft

    trust = bool(placement and placement.trust_remote_code)
    return load_draft(path, Placement(device="cpu", dtype="float32", trust_remote_code=trust)).requires_grad_(True)
