"""Decode options and method specs.

A method spec is a drafter followed by ``+key=value`` options, e.g. ``draft+k=4``,
``draft+acceptance=acceptance``, ``eagle+tree=dynamic+tree-tokens=32``. The keys are the
``DecodeOptions`` fields (dashes or underscores), the same options ``specdec decode`` takes as flags.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from specdec.models.errors import UsageError
from specdec.models.loading import Placement

OPTION_ALIASES = {"k": "num_draft", "gamma": "num_draft"}
# how a job batches its records: auto = continuous for causal LMs, static for diffusion LMs
SCHEDULES = ("auto", "continuous", "static")


@dataclass
class DecodeOptions:
    drafter: str = "ar"
    num_draft: int | None = None
    max_new_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    # samples per record (T > 0 only), decoded as rows of one job that drafters may share state between
    num_samples: int = 1
    batch_size: int = 8
    # a memory budget as written ("4GiB"): decode fits batch size and draft width into it (decode/jobs/memory.py)
    max_memory: str | None = None
    schedule: str = "auto"  # one of SCHEDULES
    # continuous batching: prompt tokens an admitted record prefills per round inside the verify forwards
    # (SARATHI); 0 prefills it in a forward of its own
    prefill_chunk: int = 0
    # decode steps compiled against preallocated key/value buffers (decode/engine/compiled.py)
    compile: bool = False
    # a prompt prefix every record shares, prefilled once for the job: "auto" (detected), "off", or a file of its text
    shared_prefix: str = "auto"
    stop: list = field(default_factory=list)
    # adaptive draft length (SpecDec++)
    acceptance: str | None = None
    # None: the acceptance artifact's default policy for the decode mode (decode/drafters/adaptive.resolve_policies)
    stop_threshold: float | None = None
    min_draft: int | None = None
    max_draft: int | None = None
    # token trees (None: the drafter kind's default, dynamic for EAGLE, static for the others)
    tree: str | None = None
    tree_tokens: int | None = None
    top_k: int | None = None  # children per expanded node (static: per head/depth; dynamic: frontier width)
    # how a draft model's samples are verified: "standard" (a chain), "rsd" or "spectr" (a tree of
    # --top-k siblings per draft step; decode/engine/verify.verify_tree_drafted)
    verify: str = "standard"
    # online speculative decoding (decode/drafters/online.py): distil the draft model on the job's own rounds,
    # an update every online_every verification rounds
    online: bool = False
    online_every: int = 8
    # PEARL (decode/drafters/pearl.py): the draft model drafts the next block while the target verifies this one
    parallel: bool = False
    # with parallel: the target tests the first draft while the draft draws the rest (PEARL's pre-verify)
    pre_verify: bool = False
    # RASD: a retrieval index (specdec index build) whose drafts are fused into a draft model's tree
    retrieval: str | None = None
    # n-gram drafter
    max_ngram: int = 3
    # diffusion decoding
    strategy: str = "static"
    gen_length: int | None = None
    block_size: int = 32
    steps: int | None = None
    cache: str = "none"
    filter: str | None = None
    adablock: bool = False
    # execution: kernels, and where the models run (models.loading.Placement)
    kernels: str = "auto"
    device: str = "auto"
    dtype: str = "auto"
    device_map: str | None = None
    attn_implementation: str | None = None
    trust_remote_code: bool = False
    threads: int = 0

    @property
    def placement(self) -> Placement:
        return Placement(self.device, self.dtype, self.device_map, self.attn_implementation, self.trust_remote_code, self.threads)

    def with_overrides(self, overrides: dict) -> "DecodeOptions":
        types = {f.name: f.type for f in dataclasses.fields(self)}
        changes = {}
        for raw_key, raw in overrides.items():
            key = OPTION_ALIASES.get(raw_key, raw_key).replace("-", "_")
            if key not in types:
                raise UsageError(f"unknown option {raw_key!r} (known: {', '.join(sorted(types))})")
            changes[key] = _convert(raw, types[key], raw_key)
        return dataclasses.replace(self, **changes)


def _convert(raw, typ: str, key: str):
    if not isinstance(raw, str):
        return raw
    typ = str(typ)
    try:
        if typ.startswith("int"):
            return int(raw)
        if typ.startswith("float"):
            return float(raw)
        if typ.startswith("bool"):
            return raw.lower() in ("1", "true", "yes", "on")
        if typ.startswith("list"):
            return raw.split("|")
    except ValueError as exc:
        raise UsageError(f"option {key}={raw!r}: {exc}") from None
    return raw


def parse_method(spec: str) -> tuple[str, dict]:
    """``draft+k=4+tree-tokens=32`` -> ("draft", {"k": "4", "tree-tokens": "32"})."""
    head, *opts = spec.split("+")
    overrides = {}
    for opt in opts:
        key, eq, value = opt.partition("=")
        if not eq or not key:
            raise UsageError(f"method {spec!r}: option {opt!r} is not key=value")
        overrides[key] = value
    if not head:
        raise UsageError(f"method {spec!r} names no drafter")
    return head, overrides
