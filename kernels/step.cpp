// A decoder stack's decode step in one call (Gemma 3; Llama, Mistral, Qwen2, Qwen3): the same ATen operations,
// in the same order and on the same shapes, as transformers' modules run from Python, so the same floats (decode.engine.direct checks
// this against transformers' forward before using it, and keeps transformers' forward wherever it differs).
//
// Why: at one to a few positions a small model's step on a CPU pays per operation. Gemma 3 270M runs about
// a thousand small operations a token; called from Python each costs the interpreter, the module machinery
// and the argument parsing on top of the operation itself, about half of a token's time outside the
// matrix products. Called from here, only the operation itself remains.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include <cmath>
#include <cstdlib>
#include <memory>
#include <optional>
#include <vector>

at::Tensor specdec_qmatmul(const at::Tensor& x, const at::Tensor& blocks, int64_t qtype, int64_t K);
bool specdec_use512();  // qmatmul.cpp: AVX-512 here, and not switched off (set_isa)

namespace {

constexpr int64_t LINEARS = 7;  // q, k, v, o, gate, up, down
constexpr int64_t NORMS = 6;    // input, query, key, after attention, before the MLP, after the MLP (absent: None)

// how a family's layers differ (decode.engine.direct.FAMILIES)
struct Style {
  bool gemma_norm;  // models.norms' Gemma RMSNorm (1 + w, epsilon and count as tensors); else Llama's RMSNorm
  int64_t qk_norm;  // 0: none, 1: on (b, heads, t, d) after the transpose (Gemma 3), 2: on (b, t, heads, d) before (Qwen3)
  bool gelu;        // the MLP's activation: GELU (tanh approximation), else SiLU
};

struct Layer {
  const at::Tensor* linear;  // LINEARS weights: a GGUF file's blocks (qtype > 0) or a dense [N, K]
  const c10::List<std::optional<at::Tensor>>* biases;
  int64_t first;             // this layer's first index into biases and the per-linear lists
  const int64_t* qtype;
  const int64_t* in_features;
  const c10::List<std::optional<at::Tensor>>* norms;  // NORMS x 3 per layer
  const double* eps;                                   // NORMS per layer (Llama's RMSNorm)
  int64_t norm_first;
};

// nn.Linear's forward, or models.blocks' route of it to the quantised-block kernel (the bias added after)
at::Tensor linear(const Layer& l, int j, const at::Tensor& x) {
  const std::optional<at::Tensor> bias = l.biases->get(l.first + j);
  if (l.qtype[j] == 0) return at::linear(x, l.linear[j], bias);
  const int64_t k = l.in_features[j];
  const int64_t rows = x.numel() / k;
  at::Tensor y = specdec_qmatmul(x.reshape({rows, k}), l.linear[j], l.qtype[j], k);
  if (bias.has_value()) y = y + *bias;
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end() - 1);
  shape.push_back(y.size(1));
  return y.reshape(shape);
}

// Each row of the float32 x (last dimension contiguous; out has x's strides) as f(row's offset in x, in out, its
// index in logical order); the rows of a [..., n] tensor in logical order, whatever its strides.
template <typename F>
void for_rows(const at::Tensor& x, F f) {
  const int64_t dims = x.dim() - 1, rows = x.numel() / x.size(-1);
  for (int64_t r = 0; r < rows; ++r) {
    int64_t rest = r, off = 0;
    for (int64_t d = dims - 1; d >= 0; --d) {
      off += (rest % x.size(d)) * x.stride(d);
      rest /= x.size(d);
    }
    f(off, r);
  }
}

// dense (so empty_like gives the output x's strides, and a row's offset is the same in both) float32 on a CPU
bool fusable(const at::Tensor& x) {
  return x.scalar_type() == at::kFloat && x.device().is_cpu() && x.stride(-1) == 1 && x.numel() > 0 &&
         x.is_non_overlapping_and_dense() && !at::GradMode::is_enabled();
}

// models.norms' Gemma RMSNorm after its sum of squares, in one pass: per row s = sum / count + eps, r = 1 / sqrt(s)
// (what rsqrt computes: both correctly rounded), then (x * r) * (1 + w), and with a residual, residual + that:
// every operation a float32 rounding of its own, in ATen's order (built without fused multiply-adds), so the
// same floats as the separate operations, without their dispatch, allocation and passes over memory.
at::Tensor gemma_norm_tail(const at::Tensor& x, const at::Tensor& sums, const at::Tensor& count, const at::Tensor& eps,
                           const at::Tensor& w, const at::Tensor* residual) {
  at::Tensor out = at::empty_like(x);
  const int64_t n = x.size(-1);
  const float c = *count.data_ptr<float>(), e = *eps.data_ptr<float>();
  const float* xp = x.data_ptr<float>();
  const float* sp = sums.contiguous().data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  const float* rp = residual ? residual->data_ptr<float>() : nullptr;
  float* op = out.data_ptr<float>();
  for_rows(x, [&](int64_t off, int64_t row) {
    const float s = sp[row] / c + e;
    const float r = 1.0f / std::sqrt(s);
    const float* xr = xp + off;
    float* orow = op + off;
    if (rp) {
      const float* res = rp + off;
      for (int64_t j = 0; j < n; ++j) orow[j] = res[j] + (xr[j] * r) * wp[j];
    } else {
      for (int64_t j = 0; j < n; ++j) orow[j] = (xr[j] * r) * wp[j];
    }
  });
  return out;
}

// models.norms' Gemma RMSNorm: sum(x * x) / count, + epsilon, rsqrt, times x, times (1 + weight);
// Llama's RMSNorm: in float32, pow(2).mean(), + epsilon, rsqrt, times x, back to x's dtype, times weight
at::Tensor norm(const Layer& l, const Style& style, int j, const at::Tensor& x, const at::Tensor* residual = nullptr) {
  const int64_t i = l.norm_first + 3 * j;
  const at::Tensor w = *l.norms->get(i);
  if (style.gemma_norm) {
    const at::Tensor eps = *l.norms->get(i + 1), count = *l.norms->get(i + 2);
    if (fusable(x) && w.is_contiguous() && w.scalar_type() == at::kFloat && w.numel() == x.size(-1) &&
        count.numel() == 1 && eps.numel() == 1 && count.scalar_type() == at::kFloat &&
        eps.scalar_type() == at::kFloat && (!residual || (residual->sizes() == x.sizes() && residual->strides() == x.strides())))
      return gemma_norm_tail(x, at::sum(x * x, {-1}, true), count, eps, w, residual);
    at::Tensor square = at::sum(x * x, {-1}, true).div_(count);
    at::Tensor y = x * at::rsqrt(square.add_(eps)) * w;
    return residual ? *residual + y : y;
  }
  at::Tensor h = x.to(at::kFloat);
  at::Tensor variance = h.pow(2).mean({-1}, true);
  h = h * at::rsqrt(variance + l.eps[j]);
  at::Tensor y = w * h.to(x.scalar_type());
  return residual ? *residual + y : y;
}

bool has_norm(const Layer& l, int j) { return l.norms->get(l.norm_first + 3 * j).has_value(); }

// transformers' rotate_half and apply_rotary_pos_emb (cos, sin already unsqueezed at dim 1): x * cos + turned * sin,
// turned = (-x[half:], x[:half]); in one pass where x is (b, heads, t, d) float32 and cos, sin are (b, 1, t, d)
// contiguous: the two products and the sum each rounded on their own (no fused multiply-add), -a * b being
// exactly -(a * b), so the same floats as the five operations
at::Tensor rotate(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  const int64_t d = x.size(-1), half = d / 2;
  if (fusable(x) && x.dim() == 4 && d % 2 == 0 && cos.is_contiguous() && sin.is_contiguous() &&
      cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.sizes() == sin.sizes() &&
      cos.dim() == 4 && cos.size(0) == x.size(0) && cos.size(1) == 1 && cos.size(2) == x.size(2) && cos.size(3) == d) {
    at::Tensor out = at::empty_like(x);
    const float* xp = x.data_ptr<float>();
    const float* cp = cos.data_ptr<float>();
    const float* sp = sin.data_ptr<float>();
    float* op = out.data_ptr<float>();
    const int64_t heads = x.size(1), t = x.size(2);
    for_rows(x, [&](int64_t off, int64_t row) {
      const int64_t tb = (row / (heads * t)) * t + row % t;  // the row's (batch, position) in cos and sin
      const float* xr = xp + off;
      const float* cr = cp + tb * d;
      const float* sr = sp + tb * d;
      float* o = op + off;
      for (int64_t j = 0; j < half; ++j) o[j] = xr[j] * cr[j] + (-xr[j + half]) * sr[j];
      for (int64_t j = half; j < d; ++j) o[j] = xr[j] * cr[j] + xr[j - half] * sr[j];
    });
    return out;
  }
  at::Tensor turned = at::cat({-x.slice(-1, half), x.slice(-1, 0, half)}, -1);
  return (x * cos) + (turned * sin);
}

// The step's attention, once per instruction set (small_attention.h over each namespace's Vec: its registers and
// the few operations whose instructions differ).
namespace avx2 {
struct Vec {
  using V = __m256;
  using Mask = __m256;
  static constexpr int64_t W = 8;
  static V zero() { return _mm256_setzero_ps(); }
  static V load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, V v) { _mm256_storeu_ps(p, v); }
  static V set1(float x) { return _mm256_set1_ps(x); }
  static V add(V a, V b) { return _mm256_add_ps(a, b); }
  static V sub(V a, V b) { return _mm256_sub_ps(a, b); }
  static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
  static V div(V a, V b) { return _mm256_div_ps(a, b); }
  static V max(V a, V b) { return _mm256_max_ps(a, b); }
  static V fmadd(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static V fnmadd(V a, V b, V c) { return _mm256_fnmadd_ps(a, b, c); }
  static V round(V x) { return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  static V pow2(V n) {  // 2^n for integral n in the normal range, built in the exponent bits
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
  }
  static Mask less(V a, V b) { return _mm256_cmp_ps(a, b, _CMP_LT_OQ); }
  static V zero_where(Mask m, V v) { return _mm256_andnot_ps(m, v); }
  static float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }
};
#include "small_attention.h"
}  // namespace avx2

// The same attention on AVX-512's 16 lanes: half the multiply-adds and loads of the 8-lane build, and the
// registers for 8 query rows' accumulators. Its floats differ from the 8-lane build's (a dot product's partial sums
// fall in other lanes), so a CPU takes one build for every width (attend).
#pragma GCC push_options
#pragma GCC target("avx512f")
namespace avx512 {
struct Vec {
  using V = __m512;
  using Mask = __mmask16;
  static constexpr int64_t W = 16;
  static V zero() { return _mm512_setzero_ps(); }
  static V load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, V v) { _mm512_storeu_ps(p, v); }
  static V set1(float x) { return _mm512_set1_ps(x); }
  static V add(V a, V b) { return _mm512_add_ps(a, b); }
  static V sub(V a, V b) { return _mm512_sub_ps(a, b); }
  static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
  static V div(V a, V b) { return _mm512_div_ps(a, b); }
  static V max(V a, V b) { return _mm512_max_ps(a, b); }
  static V fmadd(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static V fnmadd(V a, V b, V c) { return _mm512_fnmadd_ps(a, b, c); }
  static V round(V x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  static V pow2(V n) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23));
  }
  static Mask less(V a, V b) { return _mm512_cmp_ps_mask(a, b, _CMP_LT_OQ); }
  static V zero_where(Mask m, V v) { return _mm512_maskz_mov_ps(static_cast<__mmask16>(~m), v); }
  static float hsum(V v) {  // the halves added, then the 8-lane build's own sum
    const __m256 high = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));  // AVX-512F alone
    return avx2::Vec::hsum(_mm256_add_ps(_mm512_castps512_ps256(v), high));
  }
};
#include "small_attention.h"
}  // namespace avx512
#pragma GCC pop_options

// which build of the step's attention this CPU runs (models.blocks' own switch: 0 the fastest here, 1 AVX2)
bool attention512(int64_t d) { return specdec_use512() && d % 16 == 0; }

// query rows (heads of a group x positions) a key/value head's attention takes here, beyond which SDPA's matrix
// products reuse each key better than these register blocks do: 16 with 8-lane registers; 64 with 16-lane ones,
// which at 32 rows (a Gemma 3 270M verification of 8 positions, 264 keys out of cache) took 101 us a call against
// SDPA's 107, and unlike SDPA's give each position the floats it gets alone
int64_t small_rows(int64_t d) { return attention512(d) ? 64 : 16; }

// Attention of a few positions over a cache, for a step: softmax(q k^T * scaling + mask) v computed directly.
// ATen's SDPA on a CPU splits the work into blocks sized for long queries: for the 4 query rows of one Gemma 3
// 270M position over 257 keys it took about 230 us a layer inside the decode step (torch's profiler), where the
// arithmetic is half a million multiply-adds. Here each task reads its keys and values once, in place and in
// order, for a block of query rows, and the rows' scores, softmax and weighted values stay in registers and
// small buffers. A step finds each layer's keys and values out of cache (the weights streamed through since),
// so the walks are sequential and prefetched: about 100 us a layer on those shapes with the cache cold, two
// threads, where 128-key chunks and a value walk by column blocks took about 170 (scratch measurements on a
// 2-core EPYC, noisy host).
bool small_attention_ok(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const std::optional<at::Tensor>& mask,
                        int64_t groups) {
  auto dense_f32 = [](const at::Tensor& t) {
    return t.scalar_type() == at::kFloat && t.device().is_cpu() && t.dim() == 4 && t.stride(3) == 1;
  };
  if (at::GradMode::is_enabled() || !dense_f32(q) || !dense_f32(k) || !dense_f32(v)) return false;
  const int64_t b = q.size(0), heads = q.size(1), t = q.size(2), d = q.size(3), kv_heads = k.size(1), s = k.size(2);
  if (d % 8 != 0 || k.size(3) != d || v.size(3) != d || k.size(0) != b || v.size(0) != b || v.size(1) != kv_heads ||
      v.size(2) != s || heads != kv_heads * groups || groups * t > small_rows(d) || s == 0)
    return false;
  if (!mask.has_value()) return t == 1;  // several positions without a mask: SDPA's causal flag, left to SDPA
  const at::Tensor& m = *mask;
  return m.device().is_cpu() && (m.scalar_type() == at::kFloat || m.scalar_type() == at::kBool) && m.dim() == 4 &&
         (m.size(0) == b || m.size(0) == 1) && (m.size(1) == heads || m.size(1) == 1) && m.size(2) == t && m.size(3) == s;
}

// transformers' sdpa_attention_forward for a module with key/value groups, no dropout and no position bias
at::Tensor attend(at::Tensor q, at::Tensor k, at::Tensor v, const std::optional<at::Tensor>& mask, int64_t groups,
                  double scaling, bool causal, bool own = false) {
  if (own && small_attention_ok(q, k, v, mask, groups))
  {
    if (attention512(q.size(3)))
      return groups * q.size(2) <= 4 ? avx512::small_attention<4>(q, k, v, mask, groups, scaling)
                                     : avx512::small_attention<8>(q, k, v, mask, groups, scaling);
    return groups * q.size(2) <= 4 ? avx2::small_attention<4>(q, k, v, mask, groups, scaling)
                                   : avx2::small_attention<8>(q, k, v, mask, groups, scaling);
  }
  std::optional<at::Tensor> m = mask;
  bool gqa = false;
  const int64_t q_len = q.size(2);
  if (groups > 1) {
    if (!m.has_value() && k.size(-1) == v.size(-1) && k.size(-1) <= 256) {
      gqa = true;
    } else if (q_len == 1) {  // pack_gqa: (b, heads, 1, d) -> (b, kv heads, groups, d)
      if (q.size(1) != 1) q = q.reshape({q.size(0), q.size(1) / groups, groups, q.size(3)});
      if (m.has_value() && m->size(1) != 1) m = m->reshape({m->size(0), m->size(1) / groups, groups, m->size(3)});
    } else {  // repeat_kv
      auto repeat = [groups](const at::Tensor& t) {
        return t.unsqueeze(2).expand({t.size(0), t.size(1), groups, t.size(2), t.size(3)})
            .reshape({t.size(0), t.size(1) * groups, t.size(2), t.size(3)});
      };
      k = repeat(k);
      v = repeat(v);
    }
  }
  const bool is_causal = q_len > 1 && !m.has_value() && causal;
  if (is_causal && k.size(2) > q_len) {
    k = k.slice(2, 0, q_len);
    v = v.slice(2, 0, q_len);
  }
  at::Tensor out = at::scaled_dot_product_attention(q, k, v, m, 0.0, is_causal, scaling, gqa);
  out = out.reshape({out.size(0), -1, q_len, v.size(-1)});
  return out.transpose(1, 2).contiguous();
}

// the projection of one of q, k, v to (b, heads, t, d), with its norm where the family has one
at::Tensor project(const Layer& l, const Style& style, int j, const at::Tensor& h, int64_t b, int64_t t, int64_t head_dim) {
  at::Tensor y = linear(l, j, h).view({b, t, -1, head_dim});
  const bool normed = j < 2 && style.qk_norm != 0 && has_norm(l, 1 + j);
  if (normed && style.qk_norm == 2) return norm(l, style, 1 + j, y).transpose(1, 2);
  y = y.transpose(1, 2);
  return normed ? norm(l, style, 1 + j, y) : y;
}

// x [B, T, H] after the embedding; per layer its weights, norms, key/value buffers [B, Hkv, S, D] and the
// rotary tables and attention mask of its kind (``kinds`` indexes them: rope holds cos, sin per kind). The
// segment's keys and values are written at slots [start, start + T) and attention reads [offset, start + T).
at::Tensor decoder_layers(const at::Tensor& x_in, at::TensorList linears, const c10::List<std::optional<at::Tensor>>& biases,
                          at::IntArrayRef qtypes, at::IntArrayRef in_features,
                          const c10::List<std::optional<at::Tensor>>& norms, at::ArrayRef<double> eps, at::TensorList keys,
                          at::TensorList values, at::TensorList rope, const c10::List<std::optional<at::Tensor>>& masks,
                          at::IntArrayRef kinds, at::IntArrayRef style_flags, int64_t head_dim, int64_t groups,
                          double scaling, bool causal, int64_t start, int64_t offset, bool own_attention) {
  const int64_t layers = static_cast<int64_t>(kinds.size());
  TORCH_CHECK(static_cast<int64_t>(linears.size()) == LINEARS * layers && static_cast<int64_t>(biases.size()) == LINEARS * layers &&
                  static_cast<int64_t>(norms.size()) == 3 * NORMS * layers && static_cast<int64_t>(eps.size()) == NORMS * layers &&
                  static_cast<int64_t>(keys.size()) == layers && static_cast<int64_t>(values.size()) == layers &&
                  style_flags.size() == 3,
              "decoder_layers: per-layer arguments do not match the layer count");
  const Style style{style_flags[0] != 0, style_flags[1], style_flags[2] != 0};
  at::Tensor x = x_in;
  const int64_t b = x.size(0), t = x.size(1);
  const int64_t end = start + t;
  std::vector<at::Tensor> cos, sin;
  for (size_t i = 0; i + 1 < rope.size(); i += 2) {
    cos.push_back(rope[i].unsqueeze(1));
    sin.push_back(rope[i + 1].unsqueeze(1));
  }
  for (int64_t i = 0; i < layers; ++i) {
    const Layer l{linears.data() + LINEARS * i, &biases, LINEARS * i, qtypes.data() + LINEARS * i,
                  in_features.data() + LINEARS * i, &norms, eps.data() + NORMS * i, 3 * NORMS * i};
    const int64_t kind = kinds[i];
    at::Tensor residual = x;
    at::Tensor h = norm(l, style, 0, x);
    at::Tensor q = rotate(project(l, style, 0, h, b, t, head_dim), cos[kind], sin[kind]);
    at::Tensor k = rotate(project(l, style, 1, h, b, t, head_dim), cos[kind], sin[kind]);
    at::Tensor v = project(l, style, 2, h, b, t, head_dim);
    keys[i].slice(2, start, end).copy_(k);
    values[i].slice(2, start, end).copy_(v);
    at::Tensor o = attend(q, keys[i].slice(2, offset, end), values[i].slice(2, offset, end), masks.get(kind), groups,
                          scaling, causal, own_attention);
    o = linear(l, 3, o.reshape({b, t, -1}).contiguous());
    x = has_norm(l, 3) ? norm(l, style, 3, o, &residual) : residual + o;
    residual = x;
    h = norm(l, style, 4, x);
    at::Tensor gate = linear(l, 4, h);
    gate = style.gelu ? at::gelu(gate, "tanh") : at::silu(gate);
    h = linear(l, 6, gate * linear(l, 5, h));
    x = has_norm(l, 5) ? norm(l, style, 5, h, &residual) : residual + h;
  }
  return x;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(specdec_q, m) {
  m.def("attention(Tensor q, Tensor k, Tensor v, Tensor? mask, int groups, float scaling, bool causal) -> Tensor",
        [](const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const std::optional<at::Tensor>& mask, int64_t groups,
           double scaling, bool causal) { return attend(q, k, v, mask, groups, scaling, causal, true); });
  m.def("decoder_layers(Tensor x, Tensor[] linears, Tensor?[] biases, int[] qtypes, int[] in_features, Tensor?[] norms, "
        "float[] eps, Tensor[] keys, Tensor[] values, Tensor[] rope, Tensor?[] masks, int[] kinds, int[] style, int head_dim, "
        "int groups, float scaling, bool causal, int start, int offset, bool own_attention) -> Tensor",
        decoder_layers);
}
