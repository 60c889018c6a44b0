"""``specdec index``: retrieval datastores for ``retrieval:INDEX`` and ``draft+retrieval=INDEX``.

``index build`` tokenizes JSONL (a ``text`` field, or ``prompt`` + ``completion``) or plain-text files
with the target's tokenizer and writes an index folder (decode/drafters/retrieval.py). Exit codes: 2 for a
missing data file or an --out that exists without --overwrite (or is no index), 1 when the files hold
no text or the tokenizer cannot load.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from specdec.cli import options as o
from specdec.models.errors import SpecdecError, UsageError

index_app = typer.Typer(help="Retrieval datastores: drafts looked up in a corpus (retrieval:INDEX, draft+retrieval=INDEX).",
                        no_args_is_help=True)


def register(app: typer.Typer) -> None:
    app.add_typer(index_app, name="index")


@index_app.command("build")
def build(
    data: Annotated[list[Path], typer.Option("--data", help="JSONL (a text field, or prompt + completion) or plain-text file; repeat for more.")],
    out: Annotated[Path, typer.Option("--out", help="Index folder to write.")],
    target: Annotated[str, typer.Option("--target", help="Model folder, hub id or default-family member whose tokenizer the index uses.")] = "target",
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace an existing index at --out.")] = False,
    trust_remote_code: o.TrustRemoteCode = False,
) -> None:
    """Build a suffix-array datastore over a corpus's token ids."""
    from specdec.decode.drafters.retrieval import check_output_dir, save_datastore
    from specdec.models.artifacts import tokenizer_fingerprint
    from specdec.models.loading import Placement, load_tokenizer, resolve_source
    from specdec.train.data import load_texts

    missing = [str(p) for p in data if not p.is_file()]
    if missing:
        raise UsageError(f"--data {missing[0]}: no such file")
    check_output_dir(out, overwrite)
    tokenizer = load_tokenizer(resolve_source(target), Placement(trust_remote_code=trust_remote_code))
    try:
        texts = load_texts(data)
    except SpecdecError:
        raise SpecdecError(f"no text to index in {', '.join(map(str, data))}") from None
    docs = [ids for ids in tokenizer(texts, add_special_tokens=False)["input_ids"] if ids]
    if not docs:
        raise SpecdecError(f"no text to index in {', '.join(map(str, data))}")
    config = save_datastore(out, docs, tokenizer_fingerprint(tokenizer), [str(p) for p in data], overwrite=overwrite)
    typer.echo(f"indexed {config['tokens']} tokens in {config['documents']} documents: {out}")
