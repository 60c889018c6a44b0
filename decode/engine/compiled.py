"""Compiled decode steps over preallocated key/value buffers (``--compile``).

A decode step's cost on a GPU at small batch is launch overhead and weight reads, not arithmetic: the
eager forward launches hundreds of kernels per layer. ``--compile`` takes a mode:

- ``graphs`` (the default on a GPU: ``auto``): each step's eager kernels are recorded once as a CUDA
  graph and replayed (``Graphed``), as serving engines do; recording costs one forward per shape, so a
  job warms up in seconds. With the Triton kernels (``--kernels auto`` on a GPU) a Llama-architecture
  target's steps record its fused forward (``decode.engine.lean.fused_step``: a dozen kernels a layer
  instead of HF's forty), where a probe at load finds it reproduces HF's;
- ``inductor``: the forwards run through ``torch.compile`` (CUDA graphs on a GPU:
  ``mode="reduce-overhead"``), fused kernels for a compile of a minute or more per shape;
- ``off`` (the default on a CPU): eager forwards.

Both compiled modes run against the preallocated ``decode.engine.cache.SlotBuffers``, written in place at a write offset held in a tensor and read whole (so a
step's shapes and addresses do not change from round to round), with the causal/tree/hole mask
spanning the whole capacity.

Shapes are bucketed so that a handful of graphs serve a job: a segment of ``t`` tokens (the root plus a
chain of drafts, a tree, one drafted token) is padded with holes to the next power of two up to
``MAX_BUCKET``, and the buffers' capacity grows in steps (``decode.engine.cache.CAPACITY_STEP``). Longer segments (prefills)
run the same modules eagerly against the same buffers: compiling a prompt's shape would cost more than
it saves. Holes (padding) are masked like every other hole of the slot axis, so outputs are the eager
forward's up to floating-point reassociation, and the lossless tests run with compiled steps too.
"""

from __future__ import annotations

import weakref

import torch

MAX_BUCKET = 64  # segments up to this many tokens run compiled; longer ones (prefills) eagerly
# the compiler backend; tests set "aot_eager", which traces and partitions the same graphs without
# generating code, so that capture is tested in seconds
BACKEND = "inductor"

MODES = ("auto", "off", "graphs", "inductor")
# keyword arguments a step is given by reference (held for a whole job): keyed by address, never copied
FIXED = ("shared_prefix",)
# where transformers' output-capturing forward hooks live (``output_hidden_states``): safe to record
TRANSFORMERS_HOOKS = ("transformers.utils.output_capturing", "transformers.utils.generic")

_COMPILED: "weakref.WeakKeyDictionary[torch.nn.Module, dict]" = weakref.WeakKeyDictionary()


def resolve(mode: str, device) -> str:
    """The mode a job runs: ``auto`` is ``graphs`` on a CUDA device and ``off`` elsewhere."""
    if mode == "auto":
        return "graphs" if torch.device(device).type == "cuda" else "off"
    return mode


class Compiled:
    """A model's compiled forward and how its outputs must be treated."""

    mode = "inductor"

    def __init__(self, model: torch.nn.Module, mode: str | None):
        self.torch_mode = mode
        # dynamic=None: a dimension seen at a second size (the batch, as rows finish) is traced as
        # symbolic from then on, instead of one graph per size up to dynamo's recompile limit
        self.forward = torch.compile(model, mode=mode, backend=BACKEND, dynamic=None)
        # a job meets a graph per bucket, capacity and batch-size change, the draft's and the target's
        # under one code object: past dynamo's default limit (8) it would quietly run eager
        config = torch._dynamo.config
        config.recompile_limit = max(config.recompile_limit, 64)

    @property
    def graphs(self) -> bool:
        """CUDA graphs replay into the same output buffers: results are cloned before the next call."""
        return self.torch_mode == "reduce-overhead"


def for_model(model: torch.nn.Module, mode: str = "inductor", kernels: str = "torch") -> "Compiled | Graphed":
    """``model``'s compiled forward in ``mode`` (``graphs`` or ``inductor``), made once per model and
    mode and shared by every state that runs it so (the graphs are the expensive part). ``kernels``: the
    engine's resolved kernel backend; with ``triton`` recorded steps run the fused forward
    (``decode.engine.lean.fused_step``) where it reproduces the model's."""
    if mode not in ("graphs", "inductor"):
        raise ValueError(f"no compiled forward for mode {mode!r}")
    made = _COMPILED.setdefault(model, {})
    key = (mode, kernels) if mode == "graphs" else mode
    if key not in made:
        if mode == "graphs":
            from specdec.decode.engine.lean import fused_step

            made[key] = Graphed(model, fused_step(model, kernels) if kernels == "triton" else None)
        else:
            made[key] = Compiled(model, "reduce-overhead" if next(model.parameters()).device.type == "cuda" else None)
    return made[key]


def bucket(t: int) -> int | None:
    """The padded length a segment of ``t`` tokens runs at, or None when it runs eagerly."""
    if t > MAX_BUCKET:
        return None
    return 1 << max(0, (t - 1).bit_length())


class Graphed:
    """A model's decode steps recorded as CUDA graphs of its eager kernels (``--compile graphs``).

    No compiler runs: the first call of each shape runs the forward eagerly (once, on a side stream, to
    warm cuBLAS and the allocator up), records it as a graph over static copies of its inputs, and
    replays it; later calls of that shape copy their inputs into those copies and replay. A step's key
    is everything a graph bakes in: the inputs' shapes and dtypes, the flags, and the addresses of the
    key/value buffers it reads and writes (a graph holds raw addresses). Graphs live as long as the
    buffers they were recorded against (``weakref``), and those of one cache share a memory pool.

    On a CPU (tests) nothing is recorded: a "replay" runs the same step function eagerly over the same
    static copies, so keys, copies and outputs are exercised where no GPU is.

    ``fused``: the model's fused forward (``decode.engine.lean.LeanStep.static``), recorded instead of HF's
    for the steps it takes (no extra keyword arguments, one mask tensor); None records HF's forward.
    """

    graphs = True
    mode = "graphs"
    STATIC_ARGS = frozenset({"input_ids", "attention_mask", "position_ids", "use_cache", "output_hidden_states"})

    def __init__(self, model: torch.nn.Module, fused=None):
        self.model = model
        self.fused = fused
        # a model spread over several GPUs (--device-map) runs its steps unrecorded: one graph records one device
        spread = len(set(getattr(model, "hf_device_map", {}).values())) > 1
        self.record = next(model.parameters()).device.type == "cuda" and not spread
        self._modules = list(model.modules())
        self._pools: "weakref.WeakKeyDictionary[object, tuple]" = weakref.WeakKeyDictionary()
        self._steps: "weakref.WeakKeyDictionary[object, dict]" = weakref.WeakKeyDictionary()
        self.recorded = 0  # graphs recorded (steps set up, on a CPU): tests and reports read it
        self.replays = 0

    def forward(self, **kwargs):
        cache = kwargs["past_key_values"]
        if not all(getattr(layer, "is_initialized", False) for layer in cache.layers):
            # the buffers are allocated by the first forward that writes them: nothing to record against yet
            return self.model(**kwargs)
        if self._hooked():
            # a forward hook's per-call inputs (the riding drafters' columns) are Python state a graph would
            # freeze at its recording: such steps run as they are, over the same buffers
            return self.model(**kwargs)
        kwargs = dict(kwargs)
        del kwargs["past_key_values"]
        fixed = {k: kwargs.pop(k) for k in FIXED if k in kwargs}
        leaves, spec = torch.utils._pytree.tree_flatten(kwargs)
        tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
        key = (
            str(spec),
            tuple(x if not isinstance(x, torch.Tensor) else (tuple(x.shape), x.dtype) for x in leaves),
            tuple(x.data_ptr() for x in torch.utils._pytree.tree_leaves(fixed) if isinstance(x, torch.Tensor)),
            _buffers(cache),
        )
        steps = self._steps.setdefault(cache, {})
        step = steps.get(key)
        if step is None:
            step = steps[key] = self._record(cache, fixed, leaves, spec)
        else:
            for static, x in zip(step.inputs, tensors):
                static.copy_(x)
            if self.record:
                step.graph.replay()
            else:
                step.out = _detached(step.run())
        self.replays += 1
        # a fresh container (callers replace its fields), holding the live cache the stored one leaves out
        return type(step.out)(**{**step.out, "past_key_values": cache})

    def _hooked(self) -> bool:
        """Whether a forward hook other than transformers' own output capture is registered on the model
        or any of its modules, or globally. transformers' hooks collect a forward's outputs for the
        output object, which a recording keeps as it is (its tensors are the graph's outputs)."""
        from torch.nn.modules import module as nn_module

        def foreign(hooks) -> bool:
            return any(not getattr(h, "__module__", "").startswith(TRANSFORMERS_HOOKS) for h in hooks.values())

        if foreign(nn_module._global_forward_hooks) or foreign(nn_module._global_forward_pre_hooks):
            return True
        return any(foreign(m._forward_hooks) or foreign(m._forward_pre_hooks) for m in self._modules)

    def _record(self, cache, fixed: dict, leaves: list, spec) -> "_Step":
        statics = [x.clone() if isinstance(x, torch.Tensor) else x for x in leaves]
        inputs = [x for x in statics if isinstance(x, torch.Tensor)]
        kwargs = torch.utils._pytree.tree_unflatten(statics, spec)
        # the steps of a cache live only as long as it does (``_steps`` holds it weakly): nothing they keep may
        # hold it, so the step function reaches it through a weak reference and stored outputs drop it
        buffers = weakref.ref(cache)
        takes = self.fused is not None and not fixed and set(kwargs) <= self.STATIC_ARGS
        forward = self.fused.static if takes and isinstance(kwargs.get("attention_mask"), torch.Tensor) else self.model
        run = lambda: forward(**kwargs, **fixed, past_key_values=buffers())  # noqa: E731
        self.recorded += 1
        if not self.record:
            return _Step(inputs, None, _detached(run()), run)
        # the warm-up is a real step: it advances the buffers' write offsets, which the replay below
        # must find where this step began
        offsets = [layer.cumulative_length.clone() for layer in cache.layers]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            run()
        torch.cuda.current_stream().wait_stream(side)
        # one memory pool per cache, shared by its graphs: a pool whose graphs have all died (their cache with
        # them) cannot take a new graph (the allocator asserts), so a new cache never reuses an old one's
        pool = self._pools.get(cache)
        if pool is None:
            pool = self._pools[cache] = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        # thread_local: work another thread issues meanwhile (a PEARL draft on its own stream) does not void
        # this capture, as it would in the default global mode
        with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
            out = run()
        for layer, offset in zip(cache.layers, offsets):
            layer.cumulative_length.copy_(offset)
        graph.replay()
        return _Step(inputs, graph, _detached(out), run)


def _detached(out):
    """A forward's output without its cache, to be stored beside the cache's steps (a new container:
    transformers' outputs keep a field set to None in their mapping)."""
    return type(out)(**{k: v for k, v in out.items() if k != "past_key_values"})


class _Step:
    __slots__ = ("inputs", "graph", "out", "run")

    def __init__(self, inputs, graph, out, run):
        self.inputs, self.graph, self.out, self.run = inputs, graph, out, run


def _buffers(cache) -> tuple:
    """The addresses and row counts of every layer's key/value buffers and write offset."""
    return tuple((layer.keys.data_ptr(), layer.values.data_ptr(), layer.cumulative_length.data_ptr(), layer.keys.shape[0])
                 for layer in cache.layers)
