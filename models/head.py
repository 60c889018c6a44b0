"""The output layer of a large vocabulary, read as cheaply as each use allows (float32 models on a CPU).

A 262k-token output layer (Gemma 3) is 671 MB of float32 weights, most of what a decode step reads, and
MKL's float32 GEMM on it is badly uneven in the number of positions: on a 2-core Xeon, 25 ms for one
position, 50 ms for four, 82 ms for eight, 113 ms for twelve (``scripts/head-costs``). Inside specdec's
engine (``scope``), the layer runs as follows; outside it (transformers' own ``generate``, training)
it is the unchanged ``nn.Linear``.

- Exact logits (sampling, drafters that read distributions): MKL for up to ``ONEDNN_FROM - 1``
  positions, oneDNN's matmul from ``ONEDNN_FROM`` on (31 ms at four positions, 39 ms at eight).
- Greedy decoding (``scope(model, greedy=True)``) needs each position's argmax only. The layer is read
  in half precision (FBGEMM's fp16 GEMM, float32 accumulation: half the bytes) and screened: with
  ``h`` the position's hidden state, every fp16 logit is within ``eps = C * |h| * max_j |w_j| +
  D * |h|_1`` of the float32 one (relative rounding of each weight to fp16 at most 2^-11, float32
  accumulation in either order at most n * 2^-24 of the absolute sum each, and fp16's subnormal
  spacing for the absolute term), so only tokens whose fp16 logit is within 2 * eps of the best
  can be the float32 argmax. Those few (1.1 on average on Gemma 3's code) are recomputed in
  float32 and written over their fp16 values. The argmax of the returned row is the float32
  argmax: every token left at its fp16 value is below the recomputed winner. The other entries
  are approximations, good for drafting heuristics (top-k tables), never for probabilities.
- Sampling by the race (``racing``: ``decode.engine.verify.race_noise``) needs each position's argmax
  of logit / T + Gumbel noise only: the same screen on the noisy scores (the bound scaled by 1 / T,
  plus float32 rounding of the two added terms), the candidates recomputed as logit * (1 / T) + noise.
- A GGUF target's output layer read from its Q8_0 blocks (``models.blocks``): sampling rounds get the
  blocks kernel's exact logits; greedy rounds and races get an integer screen of the same bytes. Each
  position's activations become 8-bit integers q times one scale s (``kernels.qmatmul.qquant``), and
  each logit's screen is s * sum over blocks of d * (the block's integer products, summed exactly).
  It is within ``|w|max * (|h - s q| + g_b |s q| + g_k |h|)`` of the exact kernel's logit
  (Cauchy-Schwarz on the activations' rounding residual, then each float32 rounding chain); tokens
  within twice that of the best are recomputed by the exact kernel, bit for bit as the full product
  holds them (``qrows``). On Gemma 3 270M's held-out text a position keeps tens to a few hundred
  candidates (its hidden states carry a few large channels that set the scale), against 262k rows;
  a forward whose candidates pass 1/8 of the vocabulary computes every logit exactly instead, and
  forwards of more than ``SCREEN_UP_TO`` positions use the exact product alone.
  The screen's integer products run on more of the core's pipes than float32 multiply-adds, so a
  forward of 4 or 8 positions reads the layer 1.2-1.6x faster than the exact kernel; one position
  is bound by the bytes either way. On a CPU with AVX-512 VNNI one instruction multiplies and sums
  what takes three with AVX2, and the blocks are read interleaved 16 rows at a time (``qpack16``, the
  same bytes in another order, once at first use), so that each row's sum stays in one lane of a
  register: the layer's 8 positions then cost 1.3x one (8.7 ms against 6.8 on a 2-core Xeon, where
  the blocks in file order took 12.0 ms). Where the CPU has AMX tiles (and Linux grants them), the integer
  sums of 2 or more positions come from tile products instead: the same integers, so the same screen bit
  for bit, 8 positions in 6.9 ms against VNNI's 8.2.
"""

from __future__ import annotations

import contextlib
import threading

import torch

from specdec.models import blocks

MIN_VOCAB = 16384  # smaller output layers are a small part of a step: left as they are
ONEDNN_FROM = 4  # positions from which oneDNN's matmul beats MKL's on the output layer (scripts/head-costs)
SCREEN_UP_TO = 8  # positions up to which the fp16 screen beats exact float32 (FBGEMM fp16 is compute-bound past it)
# the share of the vocabulary beyond which a forward's screen candidates (all positions together) are computed
# by one exact product of every logit instead: a row recomputed alone costs about a microsecond (fetched from
# memory at random), the product of 8 positions about 28 ms on Gemma 3 270M's layer (2-core EPYC), so the two
# meet near 30k rows of its 262k
SCREEN_CANDIDATES = 1 / 8
PACK_ROWS = 16384  # vocabulary rows per FBGEMM pack: packing 262k rows whole takes 9 s, in pieces 3 s
_U16 = 2.0 ** -11  # fp16 unit roundoff
_U32 = 2.0 ** -24  # fp32 unit roundoff
_SUBNORMAL16 = 2.0 ** -25  # half of fp16's smallest subnormal spacing: the rounding error of tiny weights


class FastHead:
    """Replaces an ``nn.Linear`` output layer's forward; ``enabled`` and ``greedy`` are set by ``scope``."""

    def __init__(self, linear: torch.nn.Linear):
        self.linear = linear
        self.original = linear.forward
        self.enabled = False
        self.greedy = False
        self._packs: list | None = None
        self._lock = threading.Lock()
        weight = linear.weight.detach()
        self._max_norm = float(weight.norm(dim=1).max())
        n = weight.shape[1]
        # fp16 rounding of each weight, plus float32 accumulation error of both the fp16 GEMM and the
        # reference GEMM (n terms each), with a margin for the norms' own rounding
        self._rel = (_U16 + 2 * n * _U32) * 1.05
        self._fp16_ok = bool(weight.abs().max() < 6.0e4)  # beyond fp16's range a weight would become inf
        self.noise: torch.Tensor | None = None  # [rows, V] race noise for the next forward (``racing``)
        self.scale = 1.0  # 1 / T of the race
        self.raced = False  # the last forward added the noise itself
        self.screened = 0  # positions screened, and candidates recomputed: the screen's statistics
        self.candidates = 0
        self.unscreened = 0  # positions screened, then computed exactly for too many candidates
        self.blocks = None  # (blocks, ggml type) where the weight is a GGUF file's blocks (models.blocks)
        self._block_max_norm: float | None = None
        self._screen16 = None  # the blocks 16 rows interleaved (``_packed16``)
        self.block_state = None  # their switch (models.blocks.BlockLayers)
        linear.forward = self.forward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.enabled or x.dtype != torch.float32 or torch.compiler.is_compiling():
            return self.original(x)
        rows = x.numel() // x.shape[-1]
        noise = self.noise if self.noise is not None and self.noise.shape[0] == rows else None
        if self.blocks is not None and rows <= blocks.MAX_ROWS and not (self.block_state and self.block_state.suspended):
            if (self.greedy or noise is not None) and self.blocks[1] == blocks.Q8_0 and self.linear.bias is None \
                    and rows <= SCREEN_UP_TO:
                return self._int_screened(x, noise)
            # exact logits from the blocks read fewer bytes than the half-precision screen
            out = blocks.matmul(x.reshape(rows, -1), self.blocks)
            if self.linear.bias is not None:
                out = out + self.linear.bias
            if noise is not None:
                out = out * self.scale + noise
                self.raced = True
            return out.reshape(*x.shape[:-1], -1)
        if (self.greedy or noise is not None) and rows <= SCREEN_UP_TO and self._fp16_ok and self._pack() is not None:
            return self._screened(x, noise)
        out = self._onednn(x) if rows >= ONEDNN_FROM else self.original(x)
        if noise is not None:
            out = out.reshape(rows, -1) * self.scale + noise
            self.raced = True
            return out.reshape(*x.shape[:-1], -1)
        return out

    def _onednn(self, x: torch.Tensor) -> torch.Tensor:
        w, b = self.linear.weight, self.linear.bias
        flat = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, x.shape[-1]), w, b, "none", [], "")
        return flat.reshape(*x.shape[:-1], w.shape[0])

    def _pack(self):
        if self._packs is None:
            with self._lock:
                if self._packs is None:
                    self._packs = _fp16_packs(self.linear.weight, self.linear.bias)
        return self._packs or None

    def _screened(self, x: torch.Tensor, noise: torch.Tensor | None = None) -> torch.Tensor:
        w, b = self.linear.weight, self.linear.bias
        h = x.reshape(-1, x.shape[-1]).contiguous()
        z = torch.cat([torch.ops.quantized.linear_dynamic_fp16(h, p) for p in self._packs], dim=1)
        eps = self._rel * h.norm(dim=1) * self._max_norm + _SUBNORMAL16 * h.abs().sum(1)
        if b is not None:
            eps = eps + _U16 * b.abs().max()

        def exact_at(rows, cols):
            exact = (h[rows] * w[cols]).sum(-1)
            return exact + b[cols] if b is not None else exact

        return self._finish(x, z, eps, exact_at, noise)

    def _int_screened(self, x: torch.Tensor, noise: torch.Tensor | None = None) -> torch.Tensor:
        """The screen of a Q8_0 output layer read from its blocks (no bias): activations as 8-bit integers
        times one scale a position (``kernels.qmatmul.qscreen``), candidates recomputed by the exact kernel."""
        from specdec.kernels import qmatmul as kernel

        found, k = self.blocks, x.shape[-1]
        h = x.reshape(-1, k).contiguous()
        q, scale, norms = kernel.qquant(h)  # norms: |h - s q|, |s q|, |h| in float64
        packed = self._packed16(k)
        if packed is not None:  # the same integers and scales, 16 rows a register (kernels.qmatmul.qscreen16)
            z = kernel.qscreen16(q, scale, packed, k)[:, : found[0].shape[0]]
        else:
            z = kernel.qscreen(q, scale, found[0], k)
        # the screen is exactly sum_i w_i * s * q_i up to float32 rounding, the exact logit sum_i w_i * h_i up
        # to its own. Their distance: Cauchy-Schwarz on the residual h - s * q, plus each rounding chain
        # (the screen: one fused multiply-add per block of 32 in a lane, at most 3 in the lanes' sum, 1 by the
        # scale; the kernel: at most k) within gamma_n of its absolute sum, |w| . |s q| or |w| . |h|
        eps = self._block_norm() * (norms[:, 0] + _gamma(k // 32 + 4) * norms[:, 1] + _gamma(k) * norms[:, 2])
        eps = (eps * 1.01).float()

        def exact_at(rows, cols):
            return kernel.qrows(h, found[0], found[1], k, cols, rows)

        def exact_all():
            return blocks.matmul(h, found)

        return self._finish(x, z, eps, exact_at, noise, select=kernel.qcandidates, fallback=exact_all)

    def _packed16(self, k: int):
        """The layer's blocks interleaved 16 rows at a time for ``qscreen16`` (the same bytes, built once on first
        use: a fifth of a second for Gemma 3's 262k rows); None where the CPU lacks AVX-512 VNNI or the kernels
        are held to AVX2 (``kernels.qmatmul.set_isa``): the block screen then."""
        from specdec.kernels import qmatmul as kernel

        if not (kernel.isa512() and kernel.has_vnni512()):
            return None
        if self._screen16 is None:
            with self._lock:
                if self._screen16 is None:
                    self._screen16 = kernel.qpack16(self.blocks[0], k)
        return self._screen16

    def _block_norm(self) -> float:
        """The largest row norm of the weights the blocks hold, computed once (in float64, upward margin
        in the caller's bound)."""
        if self._block_max_norm is None:
            from specdec.kernels import qmatmul as kernel

            blocks_, qtype = self.blocks
            k = self.linear.in_features
            self._block_max_norm = max(
                float(kernel.qdequant(blocks_[i : i + PACK_ROWS], qtype, k).double().norm(dim=1).max())
                for i in range(0, blocks_.shape[0], PACK_ROWS)
            )
        return self._block_max_norm

    def _finish(self, x: torch.Tensor, z: torch.Tensor, eps: torch.Tensor, exact_at, noise: torch.Tensor | None,
                select=None, fallback=None) -> torch.Tensor:
        """Every screen's last step: tokens within 2 * eps of a position's best screened score recomputed
        exactly (``exact_at(positions, tokens)``) over their screened values; ``select(z, margin)`` finds
        them where given (one pass in C++), else torch's comparison. Where they are more than
        ``SCREEN_CANDIDATES`` of the vocabulary and ``fallback`` is given, every logit is computed
        exactly by it instead (hidden states the screen resolves badly: recomputing that many rows one
        by one would cost more than the whole product)."""
        if noise is not None:  # the race: the same screen on logit / T + noise
            z = z * self.scale + noise
            # each of the two float32 operations rounds by at most half a unit of the larger magnitude
            eps = eps * self.scale + 4 * _U32 * (z.abs().amax(dim=1) + noise.abs().amax(dim=1))
        if select is not None:
            rows, cols = select(z, (2 * eps).float())
        else:
            top = z.amax(dim=1)
            rows, cols = (z >= (top - 2 * eps)[:, None]).nonzero(as_tuple=True)
        if fallback is not None and rows.numel() > SCREEN_CANDIDATES * z.shape[1]:
            out = fallback()
            if noise is not None:
                out = out * self.scale + noise
                self.raced = True
            self.unscreened += z.shape[0]
            return out.reshape(*x.shape[:-1], z.shape[1])
        exact = exact_at(rows, cols)
        if noise is not None:
            exact = exact * self.scale + noise[rows, cols]
            self.raced = True
        z[rows, cols] = exact
        self.screened += z.shape[0]
        self.candidates += rows.numel()
        return z.reshape(*x.shape[:-1], z.shape[1])


def _gamma(n: int) -> float:
    """The classic bound on n float32 roundings in a chain: n u / (1 - n u)."""
    return n * _U32 / (1 - n * _U32)


def _fp16_packs(weight: torch.Tensor, bias: torch.Tensor | None) -> list:
    """FBGEMM fp16 packs of the weight, PACK_ROWS rows each; [] where the build has no FBGEMM fp16 GEMM."""
    try:
        probe = torch.ops.quantized.linear_prepack_fp16(weight[:8].contiguous(), None)
        torch.ops.quantized.linear_dynamic_fp16(torch.zeros(1, weight.shape[1]), probe)
    except (RuntimeError, AttributeError, NotImplementedError):
        return []
    packs = []
    for i in range(0, weight.shape[0], PACK_ROWS):
        part_bias = None if bias is None else bias[i : i + PACK_ROWS].contiguous()
        packs.append(torch.ops.quantized.linear_prepack_fp16(weight[i : i + PACK_ROWS].contiguous(), part_bias))
    return packs


def install(model) -> FastHead | None:
    """A ``FastHead`` over the model's output layer where it pays: a plain float32 ``nn.Linear`` on a CPU
    with a large vocabulary, and no logit soft-capping after it (a saturating cap could turn the
    screen's strict order into ties). Installed once; None where it does not apply."""
    existing = getattr(model, "_specdec_head", None)
    if existing is not None:
        return existing
    linear = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if (
        not isinstance(linear, torch.nn.Linear)
        or type(linear).forward is not torch.nn.Linear.forward
        or linear.weight.device.type != "cpu"
        or linear.weight.dtype != torch.float32
        or linear.out_features < MIN_VOCAB
        or getattr(text, "final_logit_softcapping", None)
        or not hasattr(torch.ops.mkldnn, "_linear_pointwise")
    ):
        return None
    head = FastHead(linear)
    model._specdec_head = head
    return head


@contextlib.contextmanager
def scope(model, greedy: bool):
    """Within: the model's output layer runs as ``FastHead`` dispatches (``greedy``: screened argmax
    logits); outside, as plain ``nn.Linear``. A no-op for models without a ``FastHead``."""
    head = getattr(model, "_specdec_head", None)
    layers = getattr(model, "_specdec_blocks", None)
    if head is None and layers is None:
        yield
        return
    before = (head.enabled, head.greedy) if head is not None else None
    outer = layers.enabled if layers is not None else None
    if head is not None:
        head.enabled, head.greedy = True, greedy
    if layers is not None:
        layers.enabled = True
    try:
        yield
    finally:
        if head is not None:
            head.enabled, head.greedy = before
        if layers is not None:
            layers.enabled = outer


@contextlib.contextmanager
def racing(model, noise: torch.Tensor, temperature: float):
    """Within (inside ``scope``): the output layer returns race scores, logit / T + ``noise`` [rows, V],
    for a forward of that many positions. Yields a dict whose ``applied`` says, after the block,
    whether the layer added the noise (else the caller adds it to exact logits: ``race_scores``)."""
    head = getattr(model, "_specdec_head", None)
    box = {"applied": False}
    if head is None or not head.enabled or noise is None:
        yield box
        return
    head.noise, head.scale, head.raced = noise, 1.0 / temperature, False
    try:
        yield box
    finally:
        box["applied"] = head.raced
        head.noise, head.raced = None, False
