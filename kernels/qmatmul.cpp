// y = x @ W^T for a weight W kept as a GGUF file's quantised blocks (Q8_0, Q5_0, Q4_K, Q6_K).
//
// Exactness: each weight is rebuilt in registers as the very float32 value that gguf's dequantisation
// (and so the float32 model transformers loads from the file) holds. Every block format is a product
// or a fused multiply-subtract of small integers and half-precision scales whose partial products fit
// float32's 24-bit significand, so the products are exact and the one rounding (Q4_K's subtraction)
// is the same one FMA does. The dot products then accumulate in float32 with FMA, as MKL's GEMM does,
// in another order: results differ from torch's float32 matmul by accumulation rounding only, as
// torch's own GEMMs of different widths differ from each other.
//
// Speed: a decode step of a small model reads every weight once per forward; the blocks are 4.5-8.5
// bits a weight instead of 32, and one dequantised register serves every position of the forward
// (up to 8 positions at a time), so a forward of 4 or 8 positions costs little more than one.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>
#include <cstdint>
#include <cstring>

namespace {

// ggml's type ids, and two layouts of specdec's own (ids far from ggml's): Q4_K and Q6_K blocks unpacked at
// load (models.blocks) into groups of 32 weights whose scales are already float32, so that a group costs
// no scalar decoding of packed 6-bit scales; each rebuilds the very same float32 weights in the same order
enum QType : int64_t { Q8_0 = 8, Q5_0 = 6, Q4_K = 12, Q6_K = 14, Q4_K_X = 1012, Q6_K_X = 1014 };

inline float fp16(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

// weights per block and bytes per block
inline int block_weights(int64_t t) { return (t == Q4_K || t == Q6_K) ? 256 : 32; }
inline int block_bytes(int64_t t) {
  switch (t) {
    case Q8_0: return 34;
    case Q5_0: return 22;
    case Q4_K: return 144;
    case Q6_K: return 210;
    case Q4_K_X: return 24;  // float d * scale, float dmin * min, 16 bytes: weight i in the low nibble of byte i, weight 16 + i in its high one
    case Q6_K_X: return 40;  // float d * scale of weights 0..15, of 16..31, then the 32 weights as signed bytes
  }
  return 0;
}

inline __m256 cvt8_epi8(const int8_t* p) {  // 8 signed bytes -> 8 floats
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline __m256 cvt8_u8(const uint8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

// 32 signed bytes times d -> 4 x 8 floats (each product exact)
inline void widen32(__m256i q, __m256 d, __m256 w[4]) {
  const __m128i q0 = _mm256_castsi256_si128(q), q1 = _mm256_extracti128_si256(q, 1);
  w[0] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q0)));
  w[1] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(q0, 8))));
  w[2] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q1)));
  w[3] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(q1, 8))));
}

// Dequantise one group of 32 weights (index g within its block) into w[0..3]; exact float32 values.
template <int64_t T>
inline void group32(const uint8_t* blk, int g, __m256 w[4]) {
  if constexpr (T == Q8_0) {
    const __m256 d = _mm256_set1_ps(fp16(blk));
    const int8_t* qs = reinterpret_cast<const int8_t*>(blk + 2);
    for (int i = 0; i < 4; ++i) w[i] = _mm256_mul_ps(d, cvt8_epi8(qs + 8 * i));
  } else if constexpr (T == Q5_0) {
    const __m256 d = _mm256_set1_ps(fp16(blk));
    uint32_t qh;
    std::memcpy(&qh, blk + 2, 4);
    const __m128i qs = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 6));
    const __m128i low4 = _mm_set1_epi8(0x0F);
    // bytes 0..15: low nibbles (weights 0..15), 16..31: high nibbles (weights 16..31)
    const __m256i nib = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(qs, 4), low4), _mm_and_si128(qs, low4));
    // byte j gets bit j of qh: spread each qh byte over 8 bytes, keep one bit of each
    const __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32(int(qh)),
        _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0x0000000000000000));
    const __m256i bit = _mm256_set1_epi64x(0x8040201008040201);
    const __m256i high = _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit), _mm256_set1_epi8(0x10));
    const __m256i q = _mm256_sub_epi8(_mm256_or_si256(nib, high), _mm256_set1_epi8(16));
    widen32(q, d, w);
  } else if constexpr (T == Q4_K_X) {
    float f[2];
    std::memcpy(f, blk, 8);
    const __m256 ds = _mm256_set1_ps(f[0]), dm = _mm256_set1_ps(f[1]);
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 8));
    const __m128i mask = _mm_set1_epi8(0x0F);
    const __m128i lo = _mm_and_si128(b, mask), hi = _mm_and_si128(_mm_srli_epi16(b, 4), mask);
    w[0] = _mm256_fmsub_ps(ds, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo)), dm);
    w[1] = _mm256_fmsub_ps(ds, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8))), dm);
    w[2] = _mm256_fmsub_ps(ds, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi)), dm);
    w[3] = _mm256_fmsub_ps(ds, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8))), dm);
  } else if constexpr (T == Q6_K_X) {
    float f[2];
    std::memcpy(f, blk, 8);
    const __m256 d0 = _mm256_set1_ps(f[0]), d1 = _mm256_set1_ps(f[1]);
    const int8_t* qs = reinterpret_cast<const int8_t*>(blk + 8);
    w[0] = _mm256_mul_ps(d0, cvt8_epi8(qs));
    w[1] = _mm256_mul_ps(d0, cvt8_epi8(qs + 8));
    w[2] = _mm256_mul_ps(d1, cvt8_epi8(qs + 16));
    w[3] = _mm256_mul_ps(d1, cvt8_epi8(qs + 24));
  } else if constexpr (T == Q4_K) {
    const float d = fp16(blk), dmin = fp16(blk + 2);
    const uint8_t* sc = blk + 4;
    int s, m;
    if (g < 4) {
      s = sc[g] & 63;
      m = sc[g + 4] & 63;
    } else {
      s = (sc[g + 4] & 0x0F) | ((sc[g - 4] >> 6) << 4);
      m = (sc[g + 4] >> 4) | ((sc[g] >> 6) << 4);
    }
    const __m256 ds = _mm256_set1_ps(d * float(s));
    const __m256 dm = _mm256_set1_ps(dmin * float(m));
    const uint8_t* qs = blk + 16 + 32 * (g / 2);
    const __m128i mask = _mm_set1_epi8(0x0F);
    for (int half = 0; half < 2; ++half) {
      __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs + 16 * half));
      if (g & 1) b = _mm_srli_epi16(b, 4);
      b = _mm_and_si128(b, mask);
      w[2 * half] = _mm256_fmsub_ps(ds, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(b)), dm);
      w[2 * half + 1] = _mm256_fmsub_ps(ds, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(b, 8))), dm);
    }
  } else {  // Q6_K: ql[128] qh[64] scales[16] d
    const uint8_t* ql = blk;
    const uint8_t* qh = blk + 128;
    const int8_t* sc = reinterpret_cast<const int8_t*>(blk + 192);
    const float d = fp16(blk + 208);
    const int h = g / 4, r = g % 4;  // half of the block, quarter of the half
    const __m256i lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ql + 64 * h + 32 * (r & 1)));
    const __m256i hi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qh + 32 * h));
    const __m256i l4 = _mm256_and_si256(_mm256_srl_epi16(lo, _mm_cvtsi32_si128(4 * (r >> 1))), _mm256_set1_epi8(0x0F));
    const __m256i h2 = _mm256_and_si256(_mm256_srl_epi16(hi, _mm_cvtsi32_si128(2 * r)), _mm256_set1_epi8(0x03));
    const __m256i q = _mm256_sub_epi8(_mm256_or_si256(l4, _mm256_slli_epi16(h2, 4)), _mm256_set1_epi8(32));
    const __m256 d0 = _mm256_set1_ps(d * float(sc[2 * g])), d1 = _mm256_set1_ps(d * float(sc[2 * g + 1]));
    const __m128i q0 = _mm256_castsi256_si128(q), q1 = _mm256_extracti128_si256(q, 1);
    w[0] = _mm256_mul_ps(d0, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q0)));
    w[1] = _mm256_mul_ps(d0, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(q0, 8))));
    w[2] = _mm256_mul_ps(d1, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q1)));
    w[3] = _mm256_mul_ps(d1, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(q1, 8))));
  }
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// rows [n0, n1) of y for P (1..8) positions starting at x (row stride K)
template <int64_t T, int P>
void rows_kernel(const uint8_t* wq, int64_t row_bytes, const float* x, int64_t K, float* y, int64_t N,
                 int64_t n0, int64_t n1) {
  const int bw = block_weights(T), bb = block_bytes(T);
  const int groups = bw / 32;
  const int64_t nblocks = K / bw;
  // A independent accumulators per position: FMA's latency would otherwise chain every product of a row
  constexpr int A = P <= 2 ? 4 : (P <= 4 ? 2 : 1);
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = wq + n * row_bytes;
    __m256 acc[P][A];
    for (int p = 0; p < P; ++p)
      for (int a = 0; a < A; ++a) acc[p][a] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nblocks; ++b) {
      const uint8_t* blk = row + b * bb;
      for (int g = 0; g < groups; ++g) {
        __m256 w[4];
        group32<T>(blk, g, w);
        const int64_t k0 = b * bw + g * 32;
        for (int p = 0; p < P; ++p) {
          const float* xp = x + p * K + k0;
          for (int i = 0; i < 4; ++i) acc[p][i % A] = _mm256_fmadd_ps(w[i], _mm256_loadu_ps(xp + 8 * i), acc[p][i % A]);
        }
      }
    }
    for (int p = 0; p < P; ++p) {
      __m256 s = acc[p][0];
      for (int a = 1; a < A; ++a) s = _mm256_add_ps(s, acc[p][a]);
      y[p * N + n] = hsum(s);
    }
  }
}

template <int64_t T>
void dispatch_p(int P, const uint8_t* wq, int64_t row_bytes, const float* x, int64_t K, float* y, int64_t N,
                int64_t n0, int64_t n1) {
  switch (P) {
    case 1: return rows_kernel<T, 1>(wq, row_bytes, x, K, y, N, n0, n1);
    case 2: return rows_kernel<T, 2>(wq, row_bytes, x, K, y, N, n0, n1);
    case 3: return rows_kernel<T, 3>(wq, row_bytes, x, K, y, N, n0, n1);
    case 4: return rows_kernel<T, 4>(wq, row_bytes, x, K, y, N, n0, n1);
    case 5: return rows_kernel<T, 5>(wq, row_bytes, x, K, y, N, n0, n1);
    case 6: return rows_kernel<T, 6>(wq, row_bytes, x, K, y, N, n0, n1);
    case 7: return rows_kernel<T, 7>(wq, row_bytes, x, K, y, N, n0, n1);
    default: return rows_kernel<T, 8>(wq, row_bytes, x, K, y, N, n0, n1);
  }
}

void check(const at::Tensor& blocks, int64_t qtype, int64_t K) {
  TORCH_CHECK(blocks.device().is_cpu() && blocks.scalar_type() == at::kByte && blocks.dim() == 2 && blocks.is_contiguous(),
              "qmatmul: blocks must be a contiguous uint8 [N, row_bytes] CPU tensor");
  TORCH_CHECK(block_bytes(qtype) > 0, "qmatmul: unsupported block type ", qtype);
  TORCH_CHECK(K % block_weights(qtype) == 0 && blocks.size(1) == K / block_weights(qtype) * block_bytes(qtype),
              "qmatmul: row of ", blocks.size(1), " bytes does not hold ", K, " weights of type ", qtype);
}

// x [M, K] float32, blocks [N, row_bytes] uint8 -> y [M, N] float32
at::Tensor qmatmul(const at::Tensor& x_in, const at::Tensor& blocks, int64_t qtype, int64_t K) {
  check(blocks, qtype, K);
  TORCH_CHECK(x_in.scalar_type() == at::kFloat && x_in.dim() == 2 && x_in.size(1) == K, "qmatmul: x must be float32 [M, K]");
  const at::Tensor x = x_in.contiguous();
  const int64_t M = x.size(0), N = blocks.size(0), row_bytes = blocks.size(1);
  at::Tensor y = at::empty({M, N}, x.options());
  const uint8_t* wq = blocks.data_ptr<uint8_t>();
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  // rows split over the intra-op threads; a grain that leaves each thread many rows of contiguous blocks
  at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) {
    for (int64_t m = 0; m < M; m += 8) {
      const int P = int(std::min<int64_t>(8, M - m));
      const float* xm = xp + m * K;
      float* ym = yp + m * N;
      switch (qtype) {
        case Q8_0: dispatch_p<Q8_0>(P, wq, row_bytes, xm, K, ym, N, n0, n1); break;
        case Q5_0: dispatch_p<Q5_0>(P, wq, row_bytes, xm, K, ym, N, n0, n1); break;
        case Q4_K: dispatch_p<Q4_K>(P, wq, row_bytes, xm, K, ym, N, n0, n1); break;
        case Q4_K_X: dispatch_p<Q4_K_X>(P, wq, row_bytes, xm, K, ym, N, n0, n1); break;
        case Q6_K_X: dispatch_p<Q6_K_X>(P, wq, row_bytes, xm, K, ym, N, n0, n1); break;
        default: dispatch_p<Q6_K>(P, wq, row_bytes, xm, K, ym, N, n0, n1); break;
      }
    }
  });
  return y;
}

// the float32 weights the kernel computes with, [N, K]: tests hold them against gguf's dequantisation
at::Tensor qdequant(const at::Tensor& blocks, int64_t qtype, int64_t K) {
  check(blocks, qtype, K);
  const int64_t N = blocks.size(0), row_bytes = blocks.size(1);
  const int bw = block_weights(qtype), bb = block_bytes(qtype);
  at::Tensor w = at::empty({N, K}, at::TensorOptions().dtype(at::kFloat));
  const uint8_t* wq = blocks.data_ptr<uint8_t>();
  float* out = w.data_ptr<float>();
  for (int64_t n = 0; n < N; ++n) {
    for (int64_t b = 0; b < K / bw; ++b) {
      const uint8_t* blk = wq + n * row_bytes + b * bb;
      for (int g = 0; g < bw / 32; ++g) {
        __m256 v[4];
        switch (qtype) {
          case Q8_0: group32<Q8_0>(blk, g, v); break;
          case Q5_0: group32<Q5_0>(blk, g, v); break;
          case Q4_K: group32<Q4_K>(blk, g, v); break;
          case Q4_K_X: group32<Q4_K_X>(blk, g, v); break;
          case Q6_K_X: group32<Q6_K_X>(blk, g, v); break;
          default: group32<Q6_K>(blk, g, v); break;
        }
        float* o = out + n * K + b * bw + g * 32;
        for (int i = 0; i < 4; ++i) _mm256_storeu_ps(o + 8 * i, v[i]);
      }
    }
  }
  return w;
}

}  // namespace

// for the decode step's own calls (step.cpp), without the dispatcher between
at::Tensor specdec_qmatmul(const at::Tensor& x, const at::Tensor& blocks, int64_t qtype, int64_t K) {
  return qmatmul(x, blocks, qtype, K);
}

TORCH_LIBRARY(specdec_q, m) {
  m.def("qmatmul(Tensor x, Tensor blocks, int qtype, int K) -> Tensor", qmatmul);
  m.def("qdequant(Tensor blocks, int qtype, int K) -> Tensor", qdequant);
}
