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
// On a CPU with AVX-512 (checked at run time: the build stays the portable AVX2 one) the float32 products and the
// output layer's integer screen take 512-bit paths (rows_kernel512, screen_rows_vnni) of the same arithmetic.
// A decode step's matrices and the output layer's screen read their blocks 16 rows interleaved
// (rows16_kernel*, screen16_vnni): one register holds a column of 16 rows, so a row's sum is one
// lane and is never reduced.
// Each row walk asks for the bytes PF_DIST ahead of the block it reads (software prefetch): the
// hardware's own stream prefetcher alone left one thread waiting on memory most of the time, at a
// third of the bandwidth a plain float32 sum reaches on the same bytes out of cache.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <atomic>
#include <cstdint>
#include <cmath>
#include <cstring>
#include <tuple>
#include <type_traits>
#include <vector>

namespace {

// ggml's type ids, and layouts of specdec's own (ids far from ggml's): Q4_K and Q6_K blocks unpacked at
// load (models.blocks) into groups of 32 weights whose scales are already float32, so that a group costs
// no scalar decoding of packed 6-bit scales; each rebuilds the very same float32 weights in the same order.
// Q8_0_R16: Q8_0 blocks of 16 rows interleaved (rows16_kernel), [N / 16, 17 K] bytes, the file's bytes reordered;
// Q5_0_R16: Q5_0 blocks the same way, [N / 16, 11 K] bytes; Q4_K_R16 and Q6_K_R16: the groups of Q4_K_X and Q6_K_X the
// same way, [N / 16, 12 K] and [N / 16, 20 K]
enum QType : int64_t { Q8_0 = 8, Q5_0 = 6, Q4_K = 12, Q6_K = 14, Q4_K_X = 1012, Q6_K_X = 1014, Q8_0_R16 = 1008, Q5_0_R16 = 1006,
                       Q4_K_R16 = 1112, Q6_K_R16 = 1114 };

// bytes a block of 32 columns takes for 16 rows of an interleaved layout (0: not one)
constexpr int r16_bytes(int64_t t) {
  return t == Q8_0_R16 ? 544 : t == Q5_0_R16 ? 352 : t == Q4_K_R16 ? 384 : t == Q6_K_R16 ? 640 : 0;
}
constexpr bool is_r16(int64_t t) { return r16_bytes(t) != 0; }

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

// how far ahead of a row walk's block its prefetch reaches: 2 KiB, the best of 1, 2 and 4 KiB on a
// 50 MB Q8_0 matrix out of cache (the distance covers memory's latency at the kernel's pace)
#ifndef PF_DIST
#define PF_DIST 2048
#endif

// A independent accumulators per position: FMA's latency would otherwise chain every product of a row
constexpr int accumulators(int P) { return P <= 2 ? 4 : (P <= 4 ? 2 : 1); }

// rows [n0, n1) of y for P (1..8) positions starting at x (row stride K). A position's sums depend on A
// only, not on the other positions: rows_kernel<T, 1, accumulators(P)> gives one position's floats bit for bit
template <int64_t T, int P, int A = accumulators(P)>
void rows_kernel(const uint8_t* wq, int64_t row_bytes, const float* x, int64_t K, float* y, int64_t N,
                 int64_t n0, int64_t n1) {
  const int bw = block_weights(T), bb = block_bytes(T);
  const int groups = bw / 32;
  const int64_t nblocks = K / bw;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = wq + n * row_bytes;
    __m256 acc[P][A];
    for (int p = 0; p < P; ++p)
      for (int a = 0; a < A; ++a) acc[p][a] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nblocks; ++b) {
      const uint8_t* blk = row + b * bb;
      _mm_prefetch(reinterpret_cast<const char*>(blk + PF_DIST), _MM_HINT_T0);
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

// The same products with AVX-512 where the CPU has it: each group's 32 weights in two 512-bit registers
// (group32x2: the very same float32 weights as group32's), so a position's 32 products take two 512-bit
// multiply-adds instead of four 256-bit ones, and a group is rebuilt in fewer operations. Only the accumulation
// order differs from the AVX2 path (16 lanes, A512 accumulators); qrows follows the path qmatmul takes.
// Two accumulators a position at every width (32 registers hold 8 positions' 16): a position's floats are then the
// same whether it is multiplied alone or among up to 48 (the AVX2 kernels, 16 registers, trade that for 4 chains at
// one position and 1 at eight), so a verification's products are plain decoding's bit for bit.
constexpr int accumulators512(int) { return 2; }

__attribute__((target("avx512f"))) inline __m512 join(__m256 lo, __m256 hi) {
  return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castpd256_pd512(_mm256_castps_pd(lo)), _mm256_castps_pd(hi), 1));
}

// a group's 32 weights as two 512-bit registers: Q8_0 and Q6_K_X widen their signed bytes sixteen at a time and
// Q4_K_X its nibbles (the same products d * q, and fmsub, as group32's); the other formats join group32's registers
template <int64_t T>
__attribute__((target("avx512f"))) inline void group32x2(const uint8_t* blk, int g, __m512 w[2]) {
  if constexpr (T == Q8_0 || T == Q6_K_X) {
    const int8_t* qs = reinterpret_cast<const int8_t*>(blk + (T == Q8_0 ? 2 : 8));
    __m512 d0, d1;
    if constexpr (T == Q8_0) {
      d0 = d1 = _mm512_set1_ps(fp16(blk));
    } else {
      float f[2];
      std::memcpy(f, blk, 8);
      d0 = _mm512_set1_ps(f[0]);
      d1 = _mm512_set1_ps(f[1]);
    }
    w[0] = _mm512_mul_ps(d0, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs)))));
    w[1] = _mm512_mul_ps(d1, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs + 16)))));
  } else if constexpr (T == Q4_K_X) {  // 16 bytes: weights 0..15 in the low nibbles, 16..31 in the high ones
    float f[2];
    std::memcpy(f, blk, 8);
    const __m512 ds = _mm512_set1_ps(f[0]), dm = _mm512_set1_ps(f[1]);
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 8));
    const __m128i mask = _mm_set1_epi8(0x0F);
    w[0] = _mm512_fmsub_ps(ds, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(b, mask))), dm);
    w[1] = _mm512_fmsub_ps(ds, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(b, 4), mask))), dm);
  } else {
    __m256 v[4];
    group32<T>(blk, g, v);
    w[0] = join(v[0], v[1]);
    w[1] = join(v[2], v[3]);
  }
}

template <int64_t T, int P, int A = accumulators512(P)>
__attribute__((target("avx512f")))
void rows_kernel512(const uint8_t* wq, int64_t row_bytes, const float* x, int64_t K, float* y, int64_t N,
                    int64_t n0, int64_t n1) {
  const int bw = block_weights(T), bb = block_bytes(T);
  const int groups = bw / 32;
  const int64_t nblocks = K / bw;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = wq + n * row_bytes;
    __m512 acc[P][A];
    for (int p = 0; p < P; ++p)
      for (int a = 0; a < A; ++a) acc[p][a] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nblocks; ++b) {
      const uint8_t* blk = row + b * bb;
      _mm_prefetch(reinterpret_cast<const char*>(blk + PF_DIST), _MM_HINT_T0);
      for (int g = 0; g < groups; ++g) {
        __m512 w[2];
        group32x2<T>(blk, g, w);
        const __m512 w01 = w[0], w23 = w[1];
        const int64_t k0 = b * bw + g * 32;
        for (int p = 0; p < P; ++p) {
          const float* xp = x + p * K + k0;
          acc[p][0] = _mm512_fmadd_ps(w01, _mm512_loadu_ps(xp), acc[p][0]);
          acc[p][1 % A] = _mm512_fmadd_ps(w23, _mm512_loadu_ps(xp + 16), acc[p][1 % A]);
        }
      }
    }
    for (int p = 0; p < P; ++p) {
      __m512 s = acc[p][0];
      for (int a = 1; a < A; ++a) s = _mm512_add_ps(s, acc[p][a]);
      y[p * N + n] = _mm512_reduce_add_ps(s);
    }
  }
}

// Matrices of 16 rows interleaved at load (models.blocks), for each group of 16 rows and block of 32 columns:
// - Q8_0_R16 (544 bytes): the rows' 16 half-precision scales (32 bytes), then column by column the 16 rows' signed
//   bytes (32 x 16 bytes);
// - Q5_0_R16 (352 bytes, where Q8_0_R16 takes 544): the 16 scales; for each column c, its 16 rows' fifth bits as a
//   16-bit mask (bit r: row r, 64 bytes); then for each column pair (c, c + 16) the 16 rows' bytes as the file holds
//   them (column c in the low nibble, c + 16 in the high one, 256 bytes).
// A column's 16 weights are rebuilt in one register as the very float32 values group32 rebuilds: d * q, or for Q5_0
// d * nibble - 16 d (one rounding of a representable value: none) plus 16 d in the lanes whose fifth bit is set, two
// more operations a column for a third fewer bytes. Each position's multiply-add takes them with its activation
// broadcast, so a row's sum is one lane from its first product to its last: a block's 16 scales take one conversion
// where rows_kernel512 rebuilds each row's (four operations), and no row's register is reduced at the end. A chains
// of multiply-adds a position (accumulators512(P) with AVX-512, accumulators(P) with AVX2: each chain must wait out
// FMA's latency between its products).
// - Q4_K_R16 (384 bytes): the rows' 16 float32 scales d * scale, their 16 d * min, then for each column pair (c, c + 16)
//   the 16 rows' bytes (c in the low nibble, c + 16 in the high one); a column's weights d * q - m in one fmsub, as
//   group32x2 rebuilds Q4_K_X's;
// - Q6_K_R16 (640 bytes): the 16 rows' scales of columns 0..15, of 16..31 (float32), then column by column the 16 rows'
//   signed bytes; a column's weights d * q, as Q6_K_X's.
// The K-quants in file order took a row at a time the whole of each position's activations through L1 (8 positions of
// a 2048-column matrix: 64 KiB a row), which held 8 positions of Gemma 3's down projections at 3x one position's time.
template <int64_t T>
constexpr int r16_block_bytes() { return r16_bytes(T); }

// the interleaved layouts ask for every line of a block 4 KiB ahead, into L2 (T1): a row-at-a-time walk's 2 KiB into
// L1 left a column of 16 rows waiting on memory more often (scratch timings of 2048 x 640 matrices out of cache:
// 0.62 ms against 0.73 at one position, the best of 1, 2, 4 and 8 KiB and of the two hints)
#ifndef R16_PF_DIST
#define R16_PF_DIST 4096
#endif
template <int64_t T, int P, int A = accumulators512(P)>
__attribute__((target("avx512f")))
void rows16_kernel512(const uint8_t* u, const float* x, int64_t K, float* y, int64_t N, int64_t g0, int64_t g1) {
  constexpr int bb = r16_block_bytes<T>();
  const int64_t nb = K / 32;
  const __m128i low4 = _mm_set1_epi8(0x0F);
  for (int64_t g = g0; g < g1; ++g) {
    const uint8_t* wg = u + g * nb * bb;
    __m512 acc[P][A];
    for (int p = 0; p < P; ++p)
      for (int a = 0; a < A; ++a) acc[p][a] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* blk = wg + b * bb;
      for (int l = 0; 64 * l < bb; ++l) _mm_prefetch(reinterpret_cast<const char*>(blk + R16_PF_DIST + 64 * l), _MM_HINT_T1);
      const float* xb = x + 32 * b;
      if constexpr (T == Q4_K_R16) {
        const __m512 ds = _mm512_loadu_ps(reinterpret_cast<const float*>(blk)), dm = _mm512_loadu_ps(reinterpret_cast<const float*>(blk + 64));
#pragma GCC unroll 2
        for (int c0 = 0; c0 < 16; c0 += 2) {
#pragma GCC unroll 2
          for (int c = c0; c < c0 + 2; ++c) {
            const __m128i pair = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 128 + 16 * c));
            const __m128i nib[2] = {_mm_and_si128(pair, low4), _mm_and_si128(_mm_srli_epi16(pair, 4), low4)};
#pragma GCC unroll 2
            for (int h = 0; h < 2; ++h) {
              const int col = c + 16 * h;
              const __m512 w = _mm512_fmsub_ps(ds, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(nib[h])), dm);
#pragma GCC unroll 8
              for (int p = 0; p < P; ++p) acc[p][col % A] = _mm512_fmadd_ps(w, _mm512_set1_ps(xb[p * K + col]), acc[p][col % A]);
            }
          }
        }
        continue;
      }
      if constexpr (T == Q6_K_R16) {
        const __m512 dh[2] = {_mm512_loadu_ps(reinterpret_cast<const float*>(blk)), _mm512_loadu_ps(reinterpret_cast<const float*>(blk + 64))};
        for (int c0 = 0; c0 < 32; c0 += 4) {
#pragma GCC unroll 4
          for (int c = c0; c < c0 + 4; ++c) {
            const __m512 w = _mm512_mul_ps(dh[c / 16], _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 128 + 16 * c)))));
#pragma GCC unroll 8
            for (int p = 0; p < P; ++p) acc[p][c % A] = _mm512_fmadd_ps(w, _mm512_set1_ps(xb[p * K + c]), acc[p][c % A]);
          }
        }
        continue;
      }
      const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk)));
      if constexpr (T == Q8_0_R16) {
        for (int c0 = 0; c0 < 32; c0 += 4) {  // four columns (a cache line of weights) a step, unrolled: acc stays in registers
#pragma GCC unroll 4
          for (int c = c0; c < c0 + 4; ++c) {
            const __m512 w = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 32 + 16 * c)))));
#pragma GCC unroll 8
            for (int p = 0; p < P; ++p) acc[p][c % A] = _mm512_fmadd_ps(w, _mm512_set1_ps(xb[p * K + c]), acc[p][c % A]);
          }
        }
      } else {
        const __m512 d16 = _mm512_mul_ps(d, _mm512_set1_ps(16.f));
        uint16_t fifth[32];
        std::memcpy(fifth, blk + 32, 64);
#pragma GCC unroll 2
        for (int c0 = 0; c0 < 16; c0 += 2) {
#pragma GCC unroll 2
          for (int c = c0; c < c0 + 2; ++c) {
            const __m128i pair = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 96 + 16 * c));
            const __m128i nib[2] = {_mm_and_si128(pair, low4), _mm_and_si128(_mm_srli_epi16(pair, 4), low4)};
#pragma GCC unroll 2
            for (int h = 0; h < 2; ++h) {
              const int col = c + 16 * h;
              __m512 w = _mm512_fmsub_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(nib[h])), d16);
              w = _mm512_mask_add_ps(w, _cvtu32_mask16(fifth[col]), w, d16);
#pragma GCC unroll 8
              for (int p = 0; p < P; ++p) acc[p][col % A] = _mm512_fmadd_ps(w, _mm512_set1_ps(xb[p * K + col]), acc[p][col % A]);
            }
          }
        }
      }
    }
    for (int p = 0; p < P; ++p) {
      __m512 s = acc[p][0];
      for (int a = 1; a < A; ++a) s = _mm512_add_ps(s, acc[p][a]);
      _mm512_storeu_ps(y + p * N + 16 * g, s);
    }
  }
}

// the same with AVX2: the group's rows 0..7, then 8..15, one 256-bit lane a row (the second pass finds the group's
// bytes in cache); the same products in the same order a lane as rows16_kernel512's
template <int64_t T, int P, int A = accumulators(P)>
void rows16_kernel(const uint8_t* u, const float* x, int64_t K, float* y, int64_t N, int64_t g0, int64_t g1) {
  constexpr int bb = r16_block_bytes<T>();
  const int64_t nb = K / 32;
  const __m128i low4 = _mm_set1_epi8(0x0F);
  const __m256i bits = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  for (int64_t g = g0; g < g1; ++g) {
    const uint8_t* wg = u + g * nb * bb;
    for (int half = 0; half < 2; ++half) {
      __m256 acc[P][A];
      for (int p = 0; p < P; ++p)
        for (int a = 0; a < A; ++a) acc[p][a] = _mm256_setzero_ps();
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* blk = wg + b * bb;
        if (half == 0)
          for (int l = 0; 64 * l < bb; ++l) _mm_prefetch(reinterpret_cast<const char*>(blk + R16_PF_DIST + 64 * l), _MM_HINT_T1);
        const float* xb = x + 32 * b;
        if constexpr (T == Q4_K_R16) {
          const __m256 ds = _mm256_loadu_ps(reinterpret_cast<const float*>(blk + 32 * half));
          const __m256 dm = _mm256_loadu_ps(reinterpret_cast<const float*>(blk + 64 + 32 * half));
          for (int c = 0; c < 16; ++c) {
            const __m128i pair = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(blk + 128 + 16 * c + 8 * half));
            const __m128i nib[2] = {_mm_and_si128(pair, low4), _mm_and_si128(_mm_srli_epi16(pair, 4), low4)};
            for (int h = 0; h < 2; ++h) {
              const int col = c + 16 * h;
              const __m256 w = _mm256_fmsub_ps(ds, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(nib[h])), dm);
              for (int p = 0; p < P; ++p) acc[p][col % A] = _mm256_fmadd_ps(w, _mm256_set1_ps(xb[p * K + col]), acc[p][col % A]);
            }
          }
          continue;
        }
        if constexpr (T == Q6_K_R16) {
          const __m256 dh[2] = {_mm256_loadu_ps(reinterpret_cast<const float*>(blk + 32 * half)),
                                _mm256_loadu_ps(reinterpret_cast<const float*>(blk + 64 + 32 * half))};
          for (int c0 = 0; c0 < 32; c0 += 4) {
#pragma GCC unroll 4
            for (int c = c0; c < c0 + 4; ++c) {
              const __m256 w = _mm256_mul_ps(dh[c / 16], cvt8_epi8(reinterpret_cast<const int8_t*>(blk + 128 + 16 * c + 8 * half)));
#pragma GCC unroll 8
              for (int p = 0; p < P; ++p) acc[p][c % A] = _mm256_fmadd_ps(w, _mm256_set1_ps(xb[p * K + c]), acc[p][c % A]);
            }
          }
          continue;
        }
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 16 * half)));
        if constexpr (T == Q8_0_R16) {
          for (int c0 = 0; c0 < 32; c0 += 4) {
#pragma GCC unroll 4
            for (int c = c0; c < c0 + 4; ++c) {
              const __m256 w = _mm256_mul_ps(d, cvt8_epi8(reinterpret_cast<const int8_t*>(blk + 32 + 16 * c + 8 * half)));
#pragma GCC unroll 8
              for (int p = 0; p < P; ++p) acc[p][c % A] = _mm256_fmadd_ps(w, _mm256_set1_ps(xb[p * K + c]), acc[p][c % A]);
            }
          }
        } else {
          const __m256 d16 = _mm256_mul_ps(d, _mm256_set1_ps(16.f));
          uint16_t fifth[32];
          std::memcpy(fifth, blk + 32, 64);
          for (int c = 0; c < 16; ++c) {
            const __m128i pair = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 96 + 16 * c + 8 * half));
            const __m128i nib[2] = {_mm_and_si128(pair, low4), _mm_and_si128(_mm_srli_epi16(pair, 4), low4)};
            for (int h = 0; h < 2; ++h) {
              const int col = c + 16 * h;
              __m256 w = _mm256_fmsub_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(nib[h])), d16);
              const __m256i set = _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32(fifth[col] >> (8 * half)), bits), bits);
              w = _mm256_add_ps(w, _mm256_and_ps(_mm256_castsi256_ps(set), d16));
              for (int p = 0; p < P; ++p) acc[p][col % A] = _mm256_fmadd_ps(w, _mm256_set1_ps(xb[p * K + col]), acc[p][col % A]);
            }
          }
        }
      }
      for (int p = 0; p < P; ++p) {
        __m256 s = acc[p][0];
        for (int a = 1; a < A; ++a) s = _mm256_add_ps(s, acc[p][a]);
        _mm256_storeu_ps(y + p * N + 16 * g + 8 * half, s);
      }
    }
  }
}

bool has_avx512() {
  static const bool yes = __builtin_cpu_supports("avx512f");
  return yes;
}

// which instruction set the float32 products and the screen run with: 0 the fastest this CPU has, 1 AVX2 (tests
// hold the paths against each other; the screen's candidates are recomputed by the path that made the products)
std::atomic<int> forced_isa{0};
bool use512() { return forced_isa.load() != 1 && has_avx512(); }

// f(std::integral_constant<int, P>) for a width P of 1..8 (more: 8), so a kernel templated on its width runs
// with the width known at compile time
template <typename F>
void with_width(int P, F&& f) {
  switch (P) {
    case 1: return f(std::integral_constant<int, 1>{});
    case 2: return f(std::integral_constant<int, 2>{});
    case 3: return f(std::integral_constant<int, 3>{});
    case 4: return f(std::integral_constant<int, 4>{});
    case 5: return f(std::integral_constant<int, 5>{});
    case 6: return f(std::integral_constant<int, 6>{});
    case 7: return f(std::integral_constant<int, 7>{});
    default: return f(std::integral_constant<int, 8>{});
  }
}

template <int64_t T>
void dispatch_p(int P, const uint8_t* wq, int64_t row_bytes, const float* x, int64_t K, float* y, int64_t N,
                int64_t n0, int64_t n1) {
  if (use512())
    with_width(P, [&](auto p) { rows_kernel512<T, decltype(p)::value>(wq, row_bytes, x, K, y, N, n0, n1); });
  else
    with_width(P, [&](auto p) { rows_kernel<T, decltype(p)::value>(wq, row_bytes, x, K, y, N, n0, n1); });
}

// one row times one position, with the accumulators qmatmul gives a position in a group of P
template <int64_t T>
void one_row(int P, const uint8_t* row, int64_t row_bytes, const float* x, int64_t K, float* y) {
  if (use512()) return rows_kernel512<T, 1, accumulators512(1)>(row, row_bytes, x, K, y, 1, 0, 1);  // any P's
  switch (accumulators(P)) {
    case 4: return rows_kernel<T, 1, 4>(row, row_bytes, x, K, y, 1, 0, 1);
    case 2: return rows_kernel<T, 1, 2>(row, row_bytes, x, K, y, 1, 0, 1);
    default: return rows_kernel<T, 1, 1>(row, row_bytes, x, K, y, 1, 0, 1);
  }
}

void check(const at::Tensor& blocks, int64_t qtype, int64_t K) {
  TORCH_CHECK(blocks.device().is_cpu() && blocks.scalar_type() == at::kByte && blocks.dim() == 2 && blocks.is_contiguous(),
              "qmatmul: blocks must be a contiguous uint8 [N, row_bytes] CPU tensor");
  if (is_r16(qtype)) {
    TORCH_CHECK(K % 32 == 0 && blocks.size(1) == r16_bytes(qtype) / 32 * K,
                "qmatmul: rows interleaved by 16 are [N / 16, 17 K] (Q8_0), [N / 16, 11 K] (Q5_0), [N / 16, 12 K] (Q4_K) or "
                "[N / 16, 20 K] (Q6_K) bytes");
    return;
  }
  TORCH_CHECK(block_bytes(qtype) > 0, "qmatmul: unsupported block type ", qtype);
  TORCH_CHECK(K % block_weights(qtype) == 0 && blocks.size(1) == K / block_weights(qtype) * block_bytes(qtype),
              "qmatmul: row of ", blocks.size(1), " bytes does not hold ", K, " weights of type ", qtype);
}

// x [M, K] float32, blocks [N, row_bytes] uint8 -> y [M, N] float32
at::Tensor qmatmul(const at::Tensor& x_in, const at::Tensor& blocks, int64_t qtype, int64_t K) {
  check(blocks, qtype, K);
  TORCH_CHECK(x_in.scalar_type() == at::kFloat && x_in.dim() == 2 && x_in.size(1) == K, "qmatmul: x must be float32 [M, K]");
  const at::Tensor x = x_in.contiguous();
  const bool r16 = is_r16(qtype);
  const int64_t M = x.size(0), N = r16 ? 16 * blocks.size(0) : blocks.size(0), row_bytes = blocks.size(1);
  at::Tensor y = at::empty({M, N}, x.options());
  const uint8_t* wq = blocks.data_ptr<uint8_t>();
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  if (r16) {  // groups of 16 rows over the threads
    const bool wide = use512();
    at::parallel_for(0, N / 16, 4, [&](int64_t g0, int64_t g1) {
      for (int64_t m = 0; m < M; m += 8) {
        const int P = int(std::min<int64_t>(8, M - m));
        with_width(P, [&](auto p) {
          constexpr int W = decltype(p)::value;
          const float* xm = xp + m * K;
          float* ym = yp + m * N;
          switch (qtype) {
            case Q5_0_R16: return wide ? rows16_kernel512<Q5_0_R16, W>(wq, xm, K, ym, N, g0, g1) : rows16_kernel<Q5_0_R16, W>(wq, xm, K, ym, N, g0, g1);
            case Q4_K_R16: return wide ? rows16_kernel512<Q4_K_R16, W>(wq, xm, K, ym, N, g0, g1) : rows16_kernel<Q4_K_R16, W>(wq, xm, K, ym, N, g0, g1);
            case Q6_K_R16: return wide ? rows16_kernel512<Q6_K_R16, W>(wq, xm, K, ym, N, g0, g1) : rows16_kernel<Q6_K_R16, W>(wq, xm, K, ym, N, g0, g1);
            default: return wide ? rows16_kernel512<Q8_0_R16, W>(wq, xm, K, ym, N, g0, g1) : rows16_kernel<Q8_0_R16, W>(wq, xm, K, ym, N, g0, g1);
          }
        });
      }
    });
    return y;
  }
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
  if (qtype == Q8_0_R16) {  // d * q, row 16 g + r of column 32 b + c
    const int64_t G = blocks.size(0);
    at::Tensor w = at::empty({16 * G, K}, at::TensorOptions().dtype(at::kFloat));
    const uint8_t* u = blocks.data_ptr<uint8_t>();
    float* out = w.data_ptr<float>();
    for (int64_t g = 0; g < G; ++g)
      for (int64_t b = 0; b < K / 32; ++b) {
        const uint8_t* blk = u + g * 17 * K + b * 544;
        for (int r = 0; r < 16; ++r)
          for (int c = 0; c < 32; ++c)
            out[(16 * g + r) * K + 32 * b + c] = fp16(blk + 2 * r) * float(int8_t(blk[32 + 16 * c + r]));
      }
    return w;
  }
  if (qtype == Q4_K_R16 || qtype == Q6_K_R16) {  // Q4_K: d * q - m in one rounding (fmsub's); Q6_K: d * q
    const int64_t G = blocks.size(0), bb = r16_bytes(qtype);
    at::Tensor w = at::empty({16 * G, K}, at::TensorOptions().dtype(at::kFloat));
    const uint8_t* u = blocks.data_ptr<uint8_t>();
    float* out = w.data_ptr<float>();
    for (int64_t g = 0; g < G; ++g)
      for (int64_t b = 0; b < K / 32; ++b) {
        const uint8_t* blk = u + (g * (K / 32) + b) * bb;
        float f[32];
        std::memcpy(f, blk, 128);
        for (int r = 0; r < 16; ++r)
          for (int c = 0; c < 32; ++c) {
            float v;
            if (qtype == Q4_K_R16)
              v = std::fma(f[r], float((blk[128 + 16 * (c % 16) + r] >> (4 * (c / 16))) & 0x0F), -f[16 + r]);
            else
              v = f[16 * (c / 16) + r] * float(int8_t(blk[128 + 16 * c + r]));
            out[(16 * g + r) * K + 32 * b + c] = v;
          }
      }
    return w;
  }
  if (qtype == Q5_0_R16) {  // d * (q - 16), q the nibble plus 16 times the fifth bit
    const int64_t G = blocks.size(0);
    at::Tensor w = at::empty({16 * G, K}, at::TensorOptions().dtype(at::kFloat));
    const uint8_t* u = blocks.data_ptr<uint8_t>();
    float* out = w.data_ptr<float>();
    for (int64_t g = 0; g < G; ++g)
      for (int64_t b = 0; b < K / 32; ++b) {
        const uint8_t* blk = u + g * 11 * K + b * 352;
        for (int r = 0; r < 16; ++r)
          for (int c = 0; c < 32; ++c) {
            uint16_t fifth;
            std::memcpy(&fifth, blk + 32 + 2 * c, 2);
            const int nib = (blk[96 + 16 * (c % 16) + r] >> (4 * (c / 16))) & 0x0F;
            const int q = nib | (((fifth >> r) & 1) << 4);
            out[(16 * g + r) * K + 32 * b + c] = fp16(blk + 2 * r) * float(q - 16);
          }
      }
    return w;
  }
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

// The screen of a Q8_0 output layer (models.head): each position's activations as 8-bit integers a with one
// float32 scale s (x ~ s * a), and every product of a row's 8-bit weights with them summed exactly in integers
// (maddubs on |q| and a signed as q, then madd: each 32-bit lane holds 4 products, at most 4 * 128 * 127).
// A logit is then s * sum over blocks of d * (lane sums), float32 from there on. Per position and block this
// is five integer and float operations against four multiply-adds of the float32 kernel, on more of the
// core's pipes, so from four positions on it runs 1.2-1.6x faster than the exact kernel on the same bytes.
// The caller bounds the screen's distance from the exact logits and recomputes the few that can win (qrows).
template <int P>
void screen_rows(const uint8_t* wq, int64_t row_bytes, const int8_t* xq, const float* xs, int64_t K, float* y,
                 int64_t N, int64_t n0, int64_t n1) {
  const int64_t nblocks = K / 32;
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = wq + n * row_bytes;
    __m256 acc[P];
    for (int p = 0; p < P; ++p) acc[p] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nblocks; ++b) {
      const uint8_t* blk = row + b * 34;
      _mm_prefetch(reinterpret_cast<const char*>(blk + PF_DIST), _MM_HINT_T0);
      const __m256 d = _mm256_set1_ps(fp16(blk));
      const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 2));
      const __m256i aq = _mm256_sign_epi8(q, q);  // |q| as unsigned bytes (-128 becomes 128)
      for (int p = 0; p < P; ++p) {
        const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + p * K + b * 32));
        const __m256i lanes = _mm256_madd_epi16(_mm256_maddubs_epi16(aq, _mm256_sign_epi8(a, q)), ones);
        acc[p] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(lanes), d, acc[p]);
      }
    }
    for (int p = 0; p < P; ++p) y[p * N + n] = hsum(acc[p]) * xs[p];
  }
}

// The same screen with AVX-512 VNNI, two blocks a 512-bit register: vpdpbusd multiplies unsigned by signed bytes
// and sums each four products into a 32-bit lane in one instruction, without the 16-bit step maddubs saturates.
// The weights go in as unsigned bytes q + 128 (one xor a block pair, shared by every position); each lane then
// starts from -128 times the sum of its four activations (``corr``, once a call), so it ends holding the very
// integer sum of q * a that the AVX2 screen's lane holds. Per block pair and position this is one vpdpbusd,
// one conversion and one multiply-add, against ten operations of the AVX2 screen; the float chain of a lane is
// shorter (half the blocks), within the same bound (models.head: g_b covers any order of at most K/32 + 4).
template <int P>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni")))
void screen_rows_vnni(const uint8_t* wq, int64_t row_bytes, const int8_t* xq, const int32_t* corr, const float* xs,
                      int64_t K, float* y, int64_t N, int64_t n0, int64_t n1) {
  const int64_t pairs = K / 64;
  const __m512i flip = _mm512_set1_epi8(char(0x80));
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = wq + n * row_bytes;
    __m512 acc[P];
    for (int p = 0; p < P; ++p) acc[p] = _mm512_setzero_ps();
    for (int64_t b = 0; b < pairs; ++b) {
      const uint8_t* blk = row + b * 68;
      _mm_prefetch(reinterpret_cast<const char*>(blk + PF_DIST), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(blk + PF_DIST + 64), _MM_HINT_T0);
      const __m256i q0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 2));
      const __m256i q1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 36));
      const __m512i u = _mm512_xor_si512(_mm512_inserti64x4(_mm512_castsi256_si512(q0), q1, 1), flip);
      const __m512 d = _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castps_pd(_mm512_castps256_ps512(_mm256_set1_ps(fp16(blk)))),
                                                           _mm256_castps_pd(_mm256_set1_ps(fp16(blk + 34))), 1));
      for (int p = 0; p < P; ++p) {
        const __m512i a = _mm512_loadu_si512(xq + p * K + b * 64);
        const __m512i c = _mm512_loadu_si512(corr + p * (K / 4) + b * 16);
        acc[p] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_dpbusd_epi32(c, u, a)), d, acc[p]);
      }
    }
    for (int p = 0; p < P; ++p) y[p * N + n] = _mm512_reduce_add_ps(acc[p]) * xs[p];
  }
}

// The same screen with the Q8_0 blocks of 16 rows interleaved (qpack16, once at load): for each block of 32 columns,
// the 16 rows' half-precision scales (32 bytes) and then their weights as unsigned bytes q + 128, four columns of a
// row at a time, row after row (8 x 16 x 4 bytes): the very bytes of the file, as many of them, in another order.
// One vpdpbusd with a position's four activations broadcast then adds four products to each of 16 rows' lanes, so
// a lane holds one row's integer sum of the block (started from -128 times the block's activation sum, which takes
// the unsigned offset back), and one conversion and multiply-add by the 16 scales ends the block: ten operations per
// position for 16 rows' block, where screen_rows_vnni takes 24 and a reduction across each row's register. The
// integers are the block screen's own; each lane's float chain is one multiply-add a block and the scale, within
// the same bound (models.head).
template <int P>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni")))
void screen16_vnni(const uint8_t* u, const int8_t* xq, const int32_t* corr, const float* xs, int64_t K, float* y,
                   int64_t N, int64_t g0, int64_t g1) {
  constexpr int C = P <= 2 ? 2 : 1;  // integer chains a position: vpdpbusd's latency would otherwise chain a block
  const int64_t nb = K / 32;
  for (int64_t g = g0; g < g1; ++g) {
    const uint8_t* wg = u + g * 17 * K;
    __m512 acc[P];
    for (int p = 0; p < P; ++p) acc[p] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* blk = wg + b * 544;
      const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk)));
      __m512i ip[P][C];
      for (int p = 0; p < P; ++p) {
        ip[p][0] = _mm512_set1_epi32(corr[p * nb + b]);
        for (int c = 1; c < C; ++c) ip[p][c] = _mm512_setzero_si512();
      }
      for (int j = 0; j < 8; ++j) {
        const uint8_t* w64 = blk + 32 + 64 * j;
        _mm_prefetch(reinterpret_cast<const char*>(w64 + PF_DIST), _MM_HINT_T0);
        const __m512i w = _mm512_loadu_si512(w64);
        for (int p = 0; p < P; ++p) {
          int32_t four;
          std::memcpy(&four, xq + p * K + 32 * b + 4 * j, 4);
          ip[p][j % C] = _mm512_dpbusd_epi32(ip[p][j % C], w, _mm512_set1_epi32(four));
        }
      }
      for (int p = 0; p < P; ++p) {
        __m512i s = ip[p][0];
        for (int c = 1; c < C; ++c) s = _mm512_add_epi32(s, ip[p][c]);
        acc[p] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), d, acc[p]);
      }
    }
    for (int p = 0; p < P; ++p) _mm512_storeu_ps(y + p * N + g * 16, _mm512_mul_ps(acc[p], _mm512_set1_ps(xs[p])));
  }
}

bool has_vnni512() {
  static const bool yes = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
  return yes;
}

// AMX (tile registers, int8 tile products; Intel Sapphire Rapids on): the CPU has it and Linux lets this process use
// it (the tile data is a state each process asks for once, arch_prctl ARCH_REQ_XCOMP_PERM)
bool has_amx() {
  static const bool yes = [] {
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (!has_vnni512() || !__get_cpuid_count(7, 0, &a, &b, &c, &d) || !((d >> 24) & 1) || !((d >> 25) & 1)) return false;
    constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
  }();
  return yes;
}

// The same screen with AMX: for each block of 16 rows and 32 columns, one tile product (TDPBSUD: the positions' signed
// activations times the rows' unsigned bytes, qpack16's order being the tile's, 8 quads of 16 rows) gives every
// position's 16 integer sums at once, where screen16_vnni takes 8 vpdpbusd a position; the sums are the same integers
// (exact: at most 32 * 127 * 255), so with the same -128 correction, conversion and multiply-add a block, and the same
// final scale, every screen value is screen16_vnni's bit for bit. Gemma 3's 262k x 640 layer on a 2-core Xeon: 8
// positions 6.9 ms against VNNI's 8.2, 4 positions 6.5 against 7.4; one position 6.3 against 6.0, so it stays on VNNI.
struct TileConfig {
  uint8_t palette, start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// GR groups of rows a pass (3: one activation tile and three weight and sum tiles of the eight), so that three tile
// products are in flight at once: one alone waits out the product's latency before its sums can be stored
template <int P, int GR>
__attribute__((target("avx512f,avx512bw,avx512vl,amx-tile,amx-int8")))
inline void screen16_amx_groups(const uint8_t* u, const int8_t* xq, const int32_t* corr, const float* xs, int64_t K,
                                float* y, int64_t N, int64_t g) {
  const int64_t nb = K / 32;
  alignas(64) int32_t sums[GR][P][16];
  __m512 acc[GR][P];
  for (int r = 0; r < GR; ++r)
    for (int p = 0; p < P; ++p) acc[r][p] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    _tile_loadd(1, xq + 32 * b, K);
    const uint8_t* blk[GR];
    for (int r = 0; r < GR; ++r) {
      blk[r] = u + (g + r) * 17 * K + b * 544;
      for (int l = 0; l < 9; ++l) _mm_prefetch(reinterpret_cast<const char*>(blk[r] + PF_DIST + 64 * l), _MM_HINT_T0);
    }
    // tile numbers are immediates: sums in 2, 3, 4 and weights in 5, 6, 7
    _tile_zero(2);
    _tile_loadd(5, blk[0] + 32, 64);
    _tile_dpbsud(2, 1, 5);
    if constexpr (GR > 1) {
      _tile_zero(3);
      _tile_loadd(6, blk[1] + 32, 64);
      _tile_dpbsud(3, 1, 6);
    }
    if constexpr (GR > 2) {
      _tile_zero(4);
      _tile_loadd(7, blk[2] + 32, 64);
      _tile_dpbsud(4, 1, 7);
    }
    _tile_stored(2, sums[0], 64);
    if constexpr (GR > 1) _tile_stored(3, sums[GR > 1 ? 1 : 0], 64);
    if constexpr (GR > 2) _tile_stored(4, sums[GR > 2 ? 2 : 0], 64);
    for (int r = 0; r < GR; ++r) {
      const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk[r])));
      for (int p = 0; p < P; ++p) {
        const __m512i s = _mm512_add_epi32(_mm512_set1_epi32(corr[p * nb + b]), _mm512_load_si512(sums[r][p]));
        acc[r][p] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), d, acc[r][p]);
      }
    }
  }
  for (int r = 0; r < GR; ++r)
    for (int p = 0; p < P; ++p) _mm512_storeu_ps(y + p * N + (g + r) * 16, _mm512_mul_ps(acc[r][p], _mm512_set1_ps(xs[p])));
}

template <int P>
__attribute__((target("avx512f,avx512bw,avx512vl,amx-tile,amx-int8")))
void screen16_amx(const uint8_t* u, const int8_t* xq, const int32_t* corr, const float* xs, int64_t K, float* y,
                  int64_t N, int64_t g0, int64_t g1) {
  TileConfig cfg{};
  cfg.palette = 1;
  cfg.rows[1] = P, cfg.colsb[1] = 32;  // the activations: P positions x a block's 32
  for (int t = 2; t <= 4; ++t) cfg.rows[t] = P, cfg.colsb[t] = 64;  // the sums: P positions x 16 rows, int32
  for (int t = 5; t <= 7; ++t) cfg.rows[t] = 8, cfg.colsb[t] = 64;  // the weights: 8 column quads x 16 rows x 4 bytes
  _tile_loadconfig(&cfg);
  int64_t g = g0;
  for (; g + 3 <= g1; g += 3) screen16_amx_groups<P, 3>(u, xq, corr, xs, K, y, N, g);
  if (g1 - g == 2) screen16_amx_groups<P, 2>(u, xq, corr, xs, K, y, N, g);
  if (g1 - g == 1) screen16_amx_groups<P, 1>(u, xq, corr, xs, K, y, N, g);
  _tile_release();
}

// xq [M, K] int8 (each in -127..127), xs [M] float32, Q8_0 blocks [N, row_bytes] -> screen [M, N] float32.
// isa: 0 the fastest this CPU runs (AVX-512 VNNI where it has it and K is a whole number of block pairs), 1 AVX2,
// 2 AVX-512 VNNI (an error where the CPU lacks it): tests hold the two against each other
at::Tensor qscreen_isa(const at::Tensor& xq_in, const at::Tensor& xs_in, const at::Tensor& blocks, int64_t K, int64_t isa) {
  check(blocks, Q8_0, K);
  TORCH_CHECK(xq_in.scalar_type() == at::kChar && xq_in.dim() == 2 && xq_in.size(1) == K, "qscreen: xq must be int8 [M, K]");
  TORCH_CHECK(xs_in.scalar_type() == at::kFloat && xs_in.dim() == 1 && xs_in.size(0) == xq_in.size(0), "qscreen: xs must be float32 [M]");
  const at::Tensor xq = xq_in.contiguous(), xs = xs_in.contiguous();
  const int64_t M = xq.size(0), N = blocks.size(0), row_bytes = blocks.size(1);
  at::Tensor y = at::empty({M, N}, xs.options());
  const uint8_t* wq = blocks.data_ptr<uint8_t>();
  const int8_t* ap = xq.data_ptr<int8_t>();
  const float* sp = xs.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  TORCH_CHECK(isa >= 0 && isa <= 2, "qscreen: isa is 0 (auto), 1 (AVX2) or 2 (AVX-512 VNNI)");
  TORCH_CHECK(isa != 2 || (has_vnni512() && K % 64 == 0), "qscreen: AVX-512 VNNI needs the CPU's support and K a multiple of 64");
  const bool vnni = isa == 2 || (isa == 0 && forced_isa.load() != 1 && has_vnni512() && K % 64 == 0);
  if (vnni) {
    // each 4-activation lane's start: -128 times its activations' sum (the unsigned weights' offset taken back)
    std::vector<int32_t> corr(M * (K / 4));
    for (int64_t i = 0; i < M * (K / 4); ++i)
      corr[i] = -128 * (int32_t(ap[4 * i]) + ap[4 * i + 1] + ap[4 * i + 2] + ap[4 * i + 3]);
    at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) {
      for (int64_t m = 0; m < M; m += 8) {
        const int P = int(std::min<int64_t>(8, M - m));
        with_width(P, [&](auto p) {
          screen_rows_vnni<decltype(p)::value>(wq, row_bytes, ap + m * K, corr.data() + m * (K / 4), sp + m, K, yp + m * N, N, n0, n1);
        });
      }
    });
    return y;
  }
  at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) {
    for (int64_t m = 0; m < M; m += 8) {
      const int P = int(std::min<int64_t>(8, M - m));
      const int8_t* a = ap + m * K;
      const float* s = sp + m;
      float* ym = yp + m * N;
      with_width(P, [&](auto p) { screen_rows<decltype(p)::value>(wq, row_bytes, a, s, K, ym, N, n0, n1); });
    }
  });
  return y;
}

// xq [M, K] int8 (-127..127), xs [M] float32, u [G, 17 K] uint8 (a Q8_0 matrix as qpack16 lays it out) -> the
// screen [M, 16 G] float32, qscreen's values up to float32 rounding. Needs AVX-512 VNNI
at::Tensor qscreen16(const at::Tensor& xq_in, const at::Tensor& xs_in, const at::Tensor& u, int64_t K) {
  TORCH_CHECK(has_vnni512(), "qscreen16: needs a CPU with AVX-512 VNNI");
  TORCH_CHECK(xq_in.scalar_type() == at::kChar && xq_in.dim() == 2 && xq_in.size(1) == K && K % 32 == 0,
              "qscreen16: xq must be int8 [M, K], K a multiple of 32");
  TORCH_CHECK(xs_in.scalar_type() == at::kFloat && xs_in.dim() == 1 && xs_in.size(0) == xq_in.size(0), "qscreen16: xs must be float32 [M]");
  TORCH_CHECK(u.scalar_type() == at::kByte && u.dim() == 2 && u.size(1) == 17 * K && u.is_contiguous(), "qscreen16: u must be uint8 [G, 17 K]");
  const at::Tensor xq = xq_in.contiguous(), xs = xs_in.contiguous();
  const int64_t M = xq.size(0), G = u.size(0), N = 16 * G, nb = K / 32;
  at::Tensor y = at::empty({M, N}, xs.options());
  const int8_t* ap = xq.data_ptr<int8_t>();
  // each block's integer lanes start from -128 times the position's activations in that block
  std::vector<int32_t> corr(M * nb, 0);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t i = 0; i < K; ++i) corr[m * nb + i / 32] -= 128 * int32_t(ap[m * K + i]);
  const uint8_t* up = u.data_ptr<uint8_t>();
  const float* sp = xs.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const bool amx = forced_isa.load() == 0 && has_amx();
  at::parallel_for(0, G, 16, [&](int64_t g0, int64_t g1) {
    for (int64_t m = 0; m < M; m += 8) {
      const int P = int(std::min<int64_t>(8, M - m));
      with_width(P, [&](auto p) {
        if (amx && decltype(p)::value >= 2)  // one position: VNNI reads the bytes at least as fast (no tile overhead)
          screen16_amx<decltype(p)::value>(up, ap + m * K, corr.data() + m * nb, sp + m, K, yp + m * N, N, g0, g1);
        else
          screen16_vnni<decltype(p)::value>(up, ap + m * K, corr.data() + m * nb, sp + m, K, yp + m * N, N, g0, g1);
      });
    }
  });
  return y;
}

// A Q8_0 matrix's blocks [N, row_bytes] in qscreen16's layout, [G, 17 K] (G = N / 16 rounded up; missing rows are
// zero weights): per group of 16 rows and block of 32 columns, the rows' 16 scales, then 8 times 16 rows' next four
// weights, each q + 128
at::Tensor qpack16(const at::Tensor& blocks, int64_t K) {
  check(blocks, Q8_0, K);
  const int64_t N = blocks.size(0), G = (N + 15) / 16, nb = K / 32, row_bytes = blocks.size(1);
  at::Tensor u = at::zeros({G, 17 * K}, at::TensorOptions().dtype(at::kByte));
  const uint8_t* wq = blocks.data_ptr<uint8_t>();
  uint8_t* up = u.data_ptr<uint8_t>();
  at::parallel_for(0, G, 64, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g)
      for (int64_t r = 0; r < 16; ++r) {
        const int64_t n = 16 * g + r;
        for (int64_t b = 0; b < nb; ++b) {
          uint8_t* dst = up + g * 17 * K + b * 544;
          if (n >= N) {  // a zero weight: scale 0, q 0 (stored 128)
            for (int j = 0; j < 8; ++j) std::memset(dst + 32 + 64 * j + 4 * r, 0x80, 4);
            continue;
          }
          const uint8_t* blk = wq + n * row_bytes + b * 34;
          std::memcpy(dst + 2 * r, blk, 2);
          for (int j = 0; j < 8; ++j)
            for (int i = 0; i < 4; ++i) dst[32 + 64 * j + 4 * r + i] = blk[2 + 4 * j + i] ^ 0x80;
        }
      }
  });
  return u;
}

at::Tensor qscreen(const at::Tensor& xq, const at::Tensor& xs, const at::Tensor& blocks, int64_t K) {
  return qscreen_isa(xq, xs, blocks, K, 0);
}

// 0: every kernel takes the fastest path this CPU has; 1: AVX2 only; 2: AVX-512 without AMX. The previous setting.
int64_t set_isa(int64_t isa) {
  TORCH_CHECK(isa >= 0 && isa <= 2, "set_isa: 0 (the fastest here), 1 (AVX2) or 2 (AVX-512 without AMX)");
  return forced_isa.exchange(int(isa));
}

bool isa512() { return use512(); }

// The screen's inputs, one pass a position: q = round(h / s) in -127..127 with s = max |h| / 127 (1 where h
// is 0), and, in float64, |h - s q|, |s q| and |h| (the norms of the screen's error bound, models.head)
std::tuple<at::Tensor, at::Tensor, at::Tensor> qquant(const at::Tensor& h_in) {
  TORCH_CHECK(h_in.scalar_type() == at::kFloat && h_in.dim() == 2, "qquant: h must be float32 [M, K]");
  const at::Tensor h = h_in.contiguous();
  const int64_t M = h.size(0), K = h.size(1);
  at::Tensor q = at::empty({M, K}, h.options().dtype(at::kChar));
  at::Tensor s = at::empty({M}, h.options());
  at::Tensor norms = at::empty({M, 3}, h.options().dtype(at::kDouble));
  const float* hp = h.data_ptr<float>();
  int8_t* qp = q.data_ptr<int8_t>();
  float* sp = s.data_ptr<float>();
  double* np_ = norms.data_ptr<double>();
  for (int64_t m = 0; m < M; ++m) {
    const float* row = hp + m * K;
    float top = 0.f;
    for (int64_t i = 0; i < K; ++i) top = std::max(top, std::fabs(row[i]));
    const float scale = top > 0.f ? top / 127.f : 1.f;
    double r2 = 0, q2 = 0, h2 = 0;
    for (int64_t i = 0; i < K; ++i) {
      const float v = std::nearbyint(row[i] / scale);
      const int8_t qi = int8_t(std::min(127.f, std::max(-127.f, v)));
      qp[m * K + i] = qi;
      const double sq = double(scale) * double(qi), hi = double(row[i]);  // both exact in float64
      r2 += (hi - sq) * (hi - sq);
      q2 += sq * sq;
      h2 += hi * hi;
    }
    sp[m] = scale;
    np_[3 * m] = std::sqrt(r2);
    np_[3 * m + 1] = std::sqrt(q2);
    np_[3 * m + 2] = std::sqrt(h2);
  }
  return {q, s, norms};
}

// (positions, tokens) of the entries of z [M, N] within margin[m] of their row's maximum, row by row
std::tuple<at::Tensor, at::Tensor> qcandidates(const at::Tensor& z_in, const at::Tensor& margin_in) {
  TORCH_CHECK(z_in.scalar_type() == at::kFloat && z_in.dim() == 2, "qcandidates: z must be float32 [M, N]");
  TORCH_CHECK(margin_in.scalar_type() == at::kFloat && margin_in.numel() == z_in.size(0), "qcandidates: margin must be float32 [M]");
  const at::Tensor z = z_in.contiguous(), margin = margin_in.contiguous();
  const int64_t M = z.size(0), N = z.size(1);
  const float* zp = z.data_ptr<float>();
  const float* mp = margin.data_ptr<float>();
  std::vector<std::vector<int64_t>> found(M);
  at::parallel_for(0, M, 1, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      const float* row = zp + m * N;
      __m256 top8 = _mm256_set1_ps(-INFINITY);
      int64_t i = 0;
      for (; i + 8 <= N; i += 8) top8 = _mm256_max_ps(top8, _mm256_loadu_ps(row + i));
      float buf[8], top = -INFINITY;
      _mm256_storeu_ps(buf, top8);
      for (int j = 0; j < 8; ++j) top = std::max(top, buf[j]);
      for (; i < N; ++i) top = std::max(top, row[i]);
      const float cut = top - mp[m];
      const __m256 cut8 = _mm256_set1_ps(cut);
      for (i = 0; i + 8 <= N; i += 8) {
        int mask = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(row + i), cut8, _CMP_GE_OQ));
        while (mask) {
          const int j = __builtin_ctz(mask);
          found[m].push_back(i + j);
          mask &= mask - 1;
        }
      }
      for (; i < N; ++i)
        if (row[i] >= cut) found[m].push_back(i);
    }
  });
  int64_t total = 0;
  for (const auto& f : found) total += int64_t(f.size());
  at::Tensor rows = at::empty({total}, z.options().dtype(at::kLong)), cols = at::empty({total}, z.options().dtype(at::kLong));
  int64_t* rp = rows.data_ptr<int64_t>();
  int64_t* cp = cols.data_ptr<int64_t>();
  for (int64_t m = 0, c = 0; m < M; ++m)
    for (int64_t j : found[m]) {
      rp[c] = m;
      cp[c++] = j;
    }
  return {rows, cols};
}

// z.argmax(-1) of a float32 [M, N], as torch computes it: the first index of each row's largest value, and of
// its first NaN where it has one (torch ranks NaN above every number). Each row is cut into runs of ARGMAX_RUN
// columns so that one row's scan spreads over the threads too; the runs are merged in column order, a later
// one winning only with a strictly larger value. At memory speed, where torch's reduction compares a value at
// a time (a greedy verification of 8 positions of a 262k vocabulary: 1.6 ms on 2 cores).
constexpr int64_t ARGMAX_RUN = 16384;
struct Best {
  float value;
  int64_t index;
  bool nan;
};
Best argmax_run(const float* row, int64_t c0, int64_t c1) {
  // two passes over the run (it stays in cache between them): the largest value, then the first index that
  // holds it, which stops there (halfway on average); each is one vector operation a load
  __m256 top8 = _mm256_set1_ps(-INFINITY), nan8 = _mm256_setzero_ps();
  int64_t i = c0;
  for (; i + 8 <= c1; i += 8) {
    const __m256 v = _mm256_loadu_ps(row + i);
    top8 = _mm256_max_ps(top8, v);
    nan8 = _mm256_or_ps(nan8, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  }
  float buf[8], top = -INFINITY;
  bool nan = _mm256_movemask_ps(nan8) != 0;
  _mm256_storeu_ps(buf, top8);
  for (int j = 0; j < 8; ++j) top = std::max(top, buf[j]);
  for (; i < c1; ++i) {
    nan |= std::isnan(row[i]);
    top = std::max(top, row[i]);
  }
  if (nan) {  // torch ranks NaN above every number: the run's first NaN
    for (int64_t j = c0; j < c1; ++j)
      if (std::isnan(row[j])) return {row[j], j, true};
  }
  const __m256 want = _mm256_set1_ps(top);
  for (i = c0; i + 8 <= c1; i += 8) {
    const int mask = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(row + i), want, _CMP_EQ_OQ));
    if (mask) return {top, i + __builtin_ctz(mask), false};
  }
  for (; i < c1; ++i)
    if (row[i] == top) return {top, i, false};
  return {top, c0, false};  // not reached: the largest value is in the run
}

at::Tensor argmax_rows(const at::Tensor& z_in) {
  TORCH_CHECK(z_in.scalar_type() == at::kFloat && z_in.dim() == 2 && z_in.size(1) > 0 && z_in.size(1) < (int64_t(1) << 31),
              "argmax_rows: z must be float32 [M, N], 0 < N < 2^31");
  const at::Tensor z = z_in.contiguous();
  const int64_t M = z.size(0), N = z.size(1), runs = (N + ARGMAX_RUN - 1) / ARGMAX_RUN;
  const float* zp = z.data_ptr<float>();
  std::vector<Best> found(M * runs);
  at::parallel_for(0, M * runs, 1, [&](int64_t u0, int64_t u1) {
    for (int64_t u = u0; u < u1; ++u) {
      const int64_t m = u / runs, c0 = (u % runs) * ARGMAX_RUN;
      found[u] = argmax_run(zp + m * N, c0, std::min(N, c0 + ARGMAX_RUN));
    }
  });
  at::Tensor out = at::empty({M}, z.options().dtype(at::kLong));
  int64_t* op = out.data_ptr<int64_t>();
  for (int64_t m = 0; m < M; ++m) {
    Best best = found[m * runs];
    for (int64_t r = 1; r < runs && !best.nan; ++r) {
      const Best& b = found[m * runs + r];
      if (b.nan || b.value > best.value) best = b;
    }
    op[m] = best.index;
  }
  return out;
}

#ifndef QROWS_AHEAD
#define QROWS_AHEAD 6
#endif
// qmatmul(x, blocks)[pos[c], rows[c]] for each c, bit for bit: each value is computed by the very kernel
// instance (the same group of up to 8 positions, so the same accumulators) that qmatmul runs for it
at::Tensor qrows(const at::Tensor& x_in, const at::Tensor& blocks, int64_t qtype, int64_t K, const at::Tensor& rows_in,
                 const at::Tensor& pos_in) {
  check(blocks, qtype, K);
  TORCH_CHECK(!is_r16(qtype), "qrows: reads rows of a matrix in file order (an output layer's), not interleaved ones");
  TORCH_CHECK(x_in.scalar_type() == at::kFloat && x_in.dim() == 2 && x_in.size(1) == K, "qrows: x must be float32 [M, K]");
  TORCH_CHECK(rows_in.scalar_type() == at::kLong && pos_in.scalar_type() == at::kLong && rows_in.dim() == 1 &&
              pos_in.sizes() == rows_in.sizes(), "qrows: rows and pos must be int64 [C]");
  const at::Tensor x = x_in.contiguous(), rows = rows_in.contiguous(), pos = pos_in.contiguous();
  const int64_t M = x.size(0), N = blocks.size(0), row_bytes = blocks.size(1), C = rows.numel();
  const int64_t* rp = rows.data_ptr<int64_t>();
  const int64_t* pp = pos.data_ptr<int64_t>();
  for (int64_t c = 0; c < C; ++c)
    TORCH_CHECK(rp[c] >= 0 && rp[c] < N && pp[c] >= 0 && pp[c] < M, "qrows: index out of range");
  at::Tensor out = at::empty({C}, x.options());
  const uint8_t* wq = blocks.data_ptr<uint8_t>();
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, C, 16, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      // rows are scattered over the matrix: ask for a row a few candidates ahead, so that its memory's latency
      // overlaps the products of the rows before it instead of stalling each row in turn (a quarter less time a row)
      if (c + QROWS_AHEAD < c1)
        for (int64_t off = 0; off < row_bytes; off += 64)
          _mm_prefetch(reinterpret_cast<const char*>(wq + rp[c + QROWS_AHEAD] * row_bytes + off), _MM_HINT_T0);
      const int64_t m = pp[c] / 8 * 8;  // the group of positions qmatmul runs this one in, and so its accumulators
      const int P = int(std::min<int64_t>(8, M - m));
      const uint8_t* row = wq + rp[c] * row_bytes;
      const float* x1 = xp + pp[c] * K;
      switch (qtype) {
        case Q8_0: one_row<Q8_0>(P, row, row_bytes, x1, K, op + c); break;
        case Q5_0: one_row<Q5_0>(P, row, row_bytes, x1, K, op + c); break;
        case Q4_K: one_row<Q4_K>(P, row, row_bytes, x1, K, op + c); break;
        case Q4_K_X: one_row<Q4_K_X>(P, row, row_bytes, x1, K, op + c); break;
        case Q6_K_X: one_row<Q6_K_X>(P, row, row_bytes, x1, K, op + c); break;
        default: one_row<Q6_K>(P, row, row_bytes, x1, K, op + c); break;
      }
    }
  });
  return out;
}

}  // namespace

// for the decode step's own calls (step.cpp), without the dispatcher between
at::Tensor specdec_qmatmul(const at::Tensor& x, const at::Tensor& blocks, int64_t qtype, int64_t K) {
  return qmatmul(x, blocks, qtype, K);
}
bool specdec_use512() { return use512(); }

TORCH_LIBRARY(specdec_q, m) {
  m.def("qmatmul(Tensor x, Tensor blocks, int qtype, int K) -> Tensor", qmatmul);
  m.def("qdequant(Tensor blocks, int qtype, int K) -> Tensor", qdequant);
  m.def("qscreen(Tensor xq, Tensor xs, Tensor blocks, int K) -> Tensor", qscreen);
  m.def("qscreen_isa(Tensor xq, Tensor xs, Tensor blocks, int K, int isa) -> Tensor", qscreen_isa);
  m.def("qscreen16(Tensor xq, Tensor xs, Tensor u, int K) -> Tensor", qscreen16);
  m.def("qpack16(Tensor blocks, int K) -> Tensor", qpack16);
  m.def("has_vnni512() -> bool", has_vnni512);
  m.def("set_isa(int isa) -> int", set_isa);
  m.def("has_amx() -> bool", has_amx);
  m.def("isa512() -> bool", isa512);
  m.def("qquant(Tensor h) -> (Tensor, Tensor, Tensor)", qquant);
  m.def("qcandidates(Tensor z, Tensor margin) -> (Tensor, Tensor)", qcandidates);
  m.def("argmax_rows(Tensor z) -> Tensor", argmax_rows);
  m.def("qrows(Tensor x, Tensor blocks, int qtype, int K, Tensor rows, Tensor pos) -> Tensor", qrows);
}
