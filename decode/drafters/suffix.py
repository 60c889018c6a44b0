"""SuffixDecoding: drafts from the texts of finished outputs, kept across jobs.

Every finished row's text (prompt and output) joins one corpus; a row's drafts are what followed the
longest suffix of its text that occurs there (or earlier in the row's own text), as a tree of the most
frequent continuations (``retrieval.Trie``: best first by occurrences). The longer the match, the
more a round proposes (``alpha`` nodes per matched token, up to ``num_draft``), and a continuation
seen in fewer than ``min_share`` of the occurrences is not proposed: a wide tree of rare guesses
widens the verify forward for little.

With ``--suffix-cache DIR`` the corpus persists: the folder holds the tokenizer's fingerprint
(``config.json``) and one JSON line per finished text (``texts.jsonl``, appended and flushed to disk
as each row finishes, a text seen before skipped by its hash). A job killed mid-line leaves at most a
torn last line, which the next job skips; a resumed job's re-decoded records find their texts there
already. Drafts are proposals the target verifies, so the cache changes speed, never the text.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from array import array
from pathlib import Path

from specdec.decode.drafters.base import Drafter, Segment, tree_proposal
from specdec.decode.drafters.retrieval import SEPARATOR, Trie
from specdec.models.artifacts import check_fingerprint, read_config, tokenizer_fingerprint, write_json
from specdec.models.errors import UsageError

KEY_LENGTHS = (32, 16, 8, 4, 2)  # suffix lengths looked up, longest first: the match length is the longest found
TEXTS = "texts.jsonl"


class SuffixCache:
    """The finished texts of earlier jobs in ``folder``, and where this job's are appended."""

    def __init__(self, folder: str | os.PathLike, fingerprint: dict):
        self.folder = Path(folder)
        if self.folder.exists() and not self.folder.is_dir():
            raise UsageError(f"--suffix-cache {folder} is a file, not a folder")
        self.folder.mkdir(parents=True, exist_ok=True)
        if (self.folder / "config.json").is_file():
            check_fingerprint(read_config(self.folder)["tokenizer"], fingerprint, f"the suffix cache {folder}")
        else:
            write_json(self.folder / "config.json", {"kind": "suffix-cache", "tokenizer": fingerprint})
        self.seen: set[str] = set()  # the digests of the texts held
        self.texts: list[list[int]] = []
        path = self.folder / TEXTS
        torn = False  # the file's last line lacks its end: a job was killed writing it
        if path.is_file():
            with open(path, encoding="utf-8") as f:
                for line in f:
                    torn = not line.endswith("\n")
                    try:
                        entry = json.loads(line)
                        tokens = [int(t) for t in entry["tokens"]]
                    except (ValueError, KeyError, TypeError):
                        continue  # a line torn by a killed job
                    if entry.get("hash") == _digest(tokens) and entry["hash"] not in self.seen:
                        self.seen.add(entry["hash"])
                        self.texts.append(tokens)
        self._file = open(path, "a", encoding="utf-8")
        if torn:  # end the torn line, so that the next text starts a line of its own
            self._file.write("\n")

    def add(self, tokens: list[int], digest: str | None = None) -> bool:
        """Append a finished text (``digest``: its ``_digest``, where the caller has it) unless it is there
        already; True when it was new."""
        digest = digest or _digest(tokens)
        if digest in self.seen:
            return False
        self.seen.add(digest)
        self._file.write(json.dumps({"hash": digest, "tokens": tokens}) + "\n")
        self._file.flush()
        os.fsync(self._file.fileno())
        return True


def _digest(tokens: list[int]) -> str:
    return hashlib.sha256(array("q", tokens).tobytes()).hexdigest()[:24]


class _Joined:
    """The corpus followed by one row's own text, indexed as one sequence (what ``Trie`` reads)."""

    def __init__(self, corpus: array, own: list[int]):
        self.corpus, self.own, self.base = corpus, own, len(corpus)

    def __getitem__(self, p: int) -> int:
        if p < self.base:
            return self.corpus[p]
        p -= self.base
        return self.own[p] if p < len(self.own) else SEPARATOR


class SuffixDrafter(Drafter):
    """Suffix-matched continuations of finished texts (this job's, and with a cache earlier jobs') and of
    the row's own text, drafted as a frequency-ranked tree sized by the match length."""

    default_k = 16  # tree nodes at the longest matches: each widens the verify forward
    proposes_trees = True

    def __init__(self, cache: SuffixCache | None = None, alpha: float = 2.0, min_share: float = 0.1,
                 max_occurrences: int = 64, max_depth: int = 16):
        self.cache, self.alpha, self.min_share = cache, alpha, min_share
        self.max_occurrences, self.max_depth = max_occurrences, max_depth
        self.corpus = array("q")
        self.keys: dict[tuple[int, int], list[int]] = {}  # (length, hash of the suffix) -> positions after it
        # the texts indexed, by digest (a text met again adds no weight): with a cache, the cache's own set,
        # which holds what it loaded and what it appends
        self.seen: set[str] = cache.seen if cache is not None else set()
        for tokens in cache.texts if cache is not None else ():
            self._index(tokens)

    def _index(self, tokens: list[int]) -> None:
        start = len(self.corpus)
        self.corpus.extend(tokens)
        self.corpus.append(SEPARATOR)
        keep = 4 * self.max_occurrences  # the occurrences a lookup reads: the most recent
        for n in KEY_LENGTHS:
            for end in range(n, len(tokens)):  # a suffix with a token after it
                found = self.keys.setdefault((n, hash(tuple(tokens[end - n : end]))), [])
                found.append(start + end)
                if len(found) > 2 * keep:  # a frequent suffix keeps its recent occurrences, not every one
                    del found[:-keep]

    def retire(self, seqs: list[list[int]]) -> None:
        for seq in map(list, seqs):
            digest = _digest(seq)
            if digest in self.seen:
                continue
            self._index(seq)
            if self.cache is not None:
                self.cache.add(seq, digest)
            else:
                self.seen.add(digest)

    def admit(self, batch, seg: Segment) -> None:
        pass  # drafts come from the corpus and each row's own text

    def _matches(self, seq: list[int]) -> tuple[int, list[int], _Joined]:
        """(match length, positions after each occurrence, the corpus they index) of the longest suffix of
        ``seq`` found in the corpus or earlier in ``seq``; length 0 when none is."""
        joined = _Joined(self.corpus, seq)
        for n in KEY_LENGTHS:
            if len(seq) <= n:
                continue
            suffix = seq[-n:]
            found = [p for p in self.keys.get((n, hash(tuple(suffix))), ())[-4 * self.max_occurrences :]
                     if self.corpus[p - n : p].tolist() == suffix]
            # the row's own text: occurrences that end before its last token, the most recent last
            last = suffix[-1]
            found += [joined.base + end for end in range(n, len(seq)) if seq[end - 1] == last and seq[end - n : end] == suffix]
            if found:
                return n, found[-self.max_occurrences :], joined
        return 0, [], joined

    def tree(self, seq: list[int], budget: int) -> tuple[list[int], list[int]]:
        n, starts, joined = self._matches(seq)
        if not n:
            return [], []
        budget = min(budget, max(1, math.ceil(self.alpha * n)))
        trie = Trie(joined, starts, self.max_depth)
        slot: dict[int, int] = {}
        tokens, parents = [], []
        while len(tokens) < budget and (node := trie.take()) is not None:
            if trie.count[node] < self.min_share * trie.occurrences:
                break  # taken best first: every node left is rarer still
            slot[node] = len(tokens)
            tokens.append(trie.token[node])
            parents.append(slot[trie.parent[node]] if trie.parent[node] >= 0 else -1)
            trie.expand(node)
        return tokens, parents

    def propose(self, batch):
        if batch.num_draft <= 0:
            return None
        return tree_proposal([self.tree(seq, batch.num_draft) for seq in batch.seqs], batch.device)


def build_suffix(spec: str, target, tokenizer, options) -> SuffixDrafter:
    """``suffix``: the registry's factory; ``--suffix-cache DIR`` keeps the finished texts across jobs."""
    folder = options.drafting.suffix_cache
    return SuffixDrafter(SuffixCache(folder, tokenizer_fingerprint(tokenizer)) if folder else None)
