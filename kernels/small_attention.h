// The decode step's attention of a few positions over a cache (step.cpp), written once over a vector type: step.cpp
// includes this file twice, in namespace avx2 with 8-lane registers and in namespace avx512 under
// `#pragma GCC target("avx512f")` with 16-lane ones, so the one algorithm is compiled for each instruction set and
// the CPU's picks at run time (by the CPU alone, never by the width: a row's floats must not depend on how many
// positions share its forward). No include guard: that is the point. The includer defines `struct Vec`: V (the
// register), Mask (a comparison's result), W (its lanes), zero, load, store, set1, add, sub, mul, div, max, fmadd,
// fnmadd, round (to nearest), pow2 (2^n of an integral n), less, zero_where (zero the lanes a mask holds) and hsum (the
// lanes' sum).

// e^x for x <= 0 (a score minus its row's maximum), a register at a time: Cephes' expf (range reduction by ln 2 in
// two parts, a degree-6 polynomial, then 2^n), within 2 ulp; below -87 (masked slots among them) exactly 0
inline Vec::V exp_nonpositive(Vec::V x) {
  const Vec::Mask tiny = Vec::less(x, Vec::set1(-87.0f));
  x = Vec::max(x, Vec::set1(-87.0f));
  const Vec::V n = Vec::round(Vec::mul(x, Vec::set1(1.44269504088896341f)));
  Vec::V r = Vec::fnmadd(n, Vec::set1(0.693359375f), x);
  r = Vec::fnmadd(n, Vec::set1(-2.12194440e-4f), r);
  Vec::V y = Vec::set1(1.9875691500e-4f);
  y = Vec::fmadd(y, r, Vec::set1(1.3981999507e-3f));
  y = Vec::fmadd(y, r, Vec::set1(8.3334519073e-3f));
  y = Vec::fmadd(y, r, Vec::set1(4.1665795894e-2f));
  y = Vec::fmadd(y, r, Vec::set1(1.6666665459e-1f));
  y = Vec::fmadd(y, r, Vec::set1(5.0000001201e-1f));
  y = Vec::add(Vec::fmadd(y, Vec::mul(r, r), r), Vec::set1(1.0f));
  return Vec::zero_where(tiny, Vec::mul(y, Vec::pow2(n)));
}

constexpr int64_t PREFETCH = 8;  // key and value rows requested this many rows ahead of their use
// keys a task reads: fixed, so a row's floats depend on neither the thread count nor the width; 64 rather than 128
// splits a few hundred keys evenly enough over two threads (260 keys: 192 and 68 rather than 256 and 4)
constexpr int64_t KEY_CHUNK = 64;

// out [B, T, heads, D] (the layout attend returns), from q [B, heads, T, D], k and v [B, kv heads, S, D], D a
// multiple of W. Tasks are (a key/value head's block of R query rows) x (a chunk of KEY_CHUNK keys), so even one
// position's 4 rows spread over the threads; each task keeps its chunk's maximum, sum of exponentials and
// unnormalised output, and the chunks are merged in key order, as split-key (flash-decoding) attention does. Every
// step of a row's arithmetic is the same whatever R, the row's block and its neighbours: its floats are its own.
template <int64_t R>
at::Tensor small_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const std::optional<at::Tensor>& mask,
                           int64_t groups, double scaling) {
  using V = Vec::V;
  constexpr int64_t W = Vec::W;
  const int64_t b = q.size(0), heads = q.size(1), t = q.size(2), d = q.size(3), kv_heads = k.size(1), s = k.size(2);
  const int64_t rows = groups * t, blocks = (rows + R - 1) / R, chunks = (s + KEY_CHUNK - 1) / KEY_CHUNK;
  const int64_t tasks = b * kv_heads * blocks * chunks;
  at::Tensor out = at::empty({b, t, heads, d}, q.options());
  std::unique_ptr<float[]> part_o(new float[tasks * R * d]);  // every element written by its task: not zeroed first
  std::vector<float> part_m(tasks * R), part_l(tasks * R);
  const float* mf = nullptr;
  const bool* mb = nullptr;
  int64_t ms0 = 0, ms1 = 0, ms2 = 0, ms3 = 0;
  if (mask.has_value()) {
    const at::Tensor& m = *mask;
    ms0 = m.size(0) == 1 ? 0 : m.stride(0);
    ms1 = m.size(1) == 1 ? 0 : m.stride(1);
    ms2 = m.stride(2);
    ms3 = m.stride(3);
    if (m.scalar_type() == at::kFloat) mf = m.data_ptr<float>();
    else mb = m.data_ptr<bool>();
  }
  const float* qp = q.data_ptr<float>();
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  const int64_t qs0 = q.stride(0), qs1 = q.stride(1), qs2 = q.stride(2), ks0 = k.stride(0), ks1 = k.stride(1),
                ks2 = k.stride(2), vs0 = v.stride(0), vs1 = v.stride(1), vs2 = v.stride(2);
  const float scale = static_cast<float>(scaling);
  // query row r of a key/value head: head hk * groups + r / t, position r % t
  auto head_of = [&](int64_t hk, int64_t r) { return hk * groups + r / t; };
  // Each thread takes a run of (key/value head, chunk) units holding about its share of the keys, and every row
  // block of each: its keys and values come from memory once, the other blocks reading them from cache. The runs
  // follow the keys, not the unit count (260 keys: chunks 0-1 and 2-4, where an even split of the 5 chunks gave
  // 3 and 2; of 20 (block, chunk) tasks at 8 positions, 10 and 10 left one thread 2.5 chunks' keys). The results
  // go where (block, chunk) puts them: the merge and the floats do not depend on the split.
  const int64_t units = b * kv_heads * chunks, keys = b * kv_heads * s;
  const int64_t parts = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), units));
  std::vector<int64_t> start(units + 1, 0), first_unit(parts + 1, units);  // start[u]: keys before unit u
  for (int64_t u = 0; u < units; ++u) start[u + 1] = start[u] + std::min<int64_t>(KEY_CHUNK, s - (u % chunks) * KEY_CHUNK);
  first_unit[0] = 0;
  for (int64_t part = 1; part < parts; ++part) {  // the unit boundary nearest the part's share of the keys
    const int64_t share = part * keys / parts;
    int64_t u = first_unit[part - 1];
    while (u < units && std::llabs(start[u + 1] - share) <= std::llabs(start[u] - share)) ++u;
    first_unit[part] = u;
  }
  at::parallel_for(0, parts, 1, [&](int64_t part0, int64_t part1) {
    alignas(64) float scores[R][KEY_CHUNK];
    for (int64_t task = first_unit[part0] * blocks; task < first_unit[part1] * blocks; ++task) {
      const int64_t blk = task % blocks, chunk = (task / blocks) % chunks, bh = task / (chunks * blocks);
      const int64_t slot = (bh * blocks + blk) * chunks + chunk;
      const int64_t bi = bh / kv_heads, hk = bh % kv_heads, r0 = R * blk, n = std::min<int64_t>(R, rows - r0);
      const int64_t j0 = chunk * KEY_CHUNK, len = std::min<int64_t>(KEY_CHUNK, s - j0);
      const float* qrow[R];
      int64_t moff[R];
      for (int64_t i = 0; i < R; ++i) {
        const int64_t r = r0 + std::min<int64_t>(i, n - 1), h = head_of(hk, r), ti = r % t;  // padding rows repeat the last
        qrow[i] = qp + bi * qs0 + h * qs1 + ti * qs2;
        moff[i] = bi * ms0 + h * ms1 + ti * ms2;
      }
      const float* kb = kp + bi * ks0 + hk * ks1 + j0 * ks2;
      const float* vb = vp + bi * vs0 + hk * vs1 + j0 * vs2;
      // scores: each key read once for the block's rows; KP keys at a time where registers allow, so that KP * R
      // chains of multiply-adds hide FMA's latency (each key's dot product keeps its order: the floats do not
      // change), and the keys PREFETCH rows ahead requested early, the cache being cold at every layer
      constexpr int64_t KP = R <= 4 ? 2 : 1;
      for (int64_t j = 0; j < len; j += KP) {
        const int64_t kn = std::min<int64_t>(KP, len - j);
        const float* kj = kb + j * ks2;
        if (j + PREFETCH < len)
          for (int64_t u = 0; u < KP; ++u)
            for (int64_t c = 0; c < d; c += 16) _mm_prefetch(reinterpret_cast<const char*>(kj + (PREFETCH + u) * ks2 + c), _MM_HINT_T0);
        V acc[KP][R];
        for (int64_t u = 0; u < KP; ++u)
          for (int64_t i = 0; i < R; ++i) acc[u][i] = Vec::zero();
        if (kn == KP) {
          for (int64_t c = 0; c < d; c += W) {
            V kv[KP];
            for (int64_t u = 0; u < KP; ++u) kv[u] = Vec::load(kj + u * ks2 + c);
            for (int64_t i = 0; i < R; ++i) {
              const V qv = Vec::load(qrow[i] + c);
              for (int64_t u = 0; u < KP; ++u) acc[u][i] = Vec::fmadd(qv, kv[u], acc[u][i]);
            }
          }
        } else {
          for (int64_t c = 0; c < d; c += W) {
            const V kv = Vec::load(kj + c);
            for (int64_t i = 0; i < R; ++i) acc[0][i] = Vec::fmadd(Vec::load(qrow[i] + c), kv, acc[0][i]);
          }
        }
        for (int64_t u = 0; u < kn; ++u)
          for (int64_t i = 0; i < R; ++i) {
            float x = Vec::hsum(acc[u][i]) * scale;
            if (mf) x = x + mf[moff[i] + (j0 + j + u) * ms3];
            if (mb && !mb[moff[i] + (j0 + j + u) * ms3]) x = -INFINITY;
            scores[i][j + u] = x;
          }
      }
      float* po = part_o.get() + slot * R * d;
      float* pm = part_m.data() + slot * R;
      float* pl = part_l.data() + slot * R;
      const int64_t padded = (len + W - 1) / W * W;
      for (int64_t i = 0; i < R; ++i) {  // the chunk's softmax numerators (padding and masked slots exactly 0)
        float* sc = scores[i];
        for (int64_t j = len; j < padded; ++j) sc[j] = -INFINITY;
        float top = -INFINITY;
        for (int64_t j = 0; j < len; ++j) top = std::max(top, sc[j]);
        pm[i] = top;
        if (top == -INFINITY) {
          for (int64_t j = 0; j < padded; ++j) sc[j] = 0.0f;
          pl[i] = 0.0f;
          continue;
        }
        const V mx = Vec::set1(top);
        V sum = Vec::zero();
        for (int64_t j = 0; j < padded; j += W) {
          const V e = exp_nonpositive(Vec::sub(Vec::load(sc + j), mx));
          Vec::store(sc + j, e);
          sum = Vec::add(sum, e);
        }
        pl[i] = Vec::hsum(sum);
      }
      // unnormalised outputs: a block of columns at a time (4 or 2 registers a row with 16 lanes, 2 or 1 with 8), every
      // key of the chunk in order into accumulators held in registers, each element's sum in key order. Loading and
      // storing every row's outputs for each 4 keys (the previous walk) spent more on the stores than on the
      // multiply-adds; the next block's lines of every key are requested while one block is summed
      auto columns = [&](auto registers, int64_t c) {
        constexpr int64_t NV = decltype(registers)::value;
        V acc[R][NV];
        for (int64_t i = 0; i < R; ++i)
          for (int64_t u = 0; u < NV; ++u) acc[i][u] = Vec::zero();
        if (c + NV * W < d)
          for (int64_t j = 0; j < len; ++j)
            for (int64_t u = 0; u < NV * W; u += 16) _mm_prefetch(reinterpret_cast<const char*>(vb + j * vs2 + c + NV * W + u), _MM_HINT_T0);
        for (int64_t j = 0; j < len; ++j) {
          const float* vj = vb + j * vs2 + c;
          V vv[NV];
          for (int64_t u = 0; u < NV; ++u) vv[u] = Vec::load(vj + u * W);
          for (int64_t i = 0; i < R; ++i) {
            const V pi = Vec::set1(scores[i][j]);
            for (int64_t u = 0; u < NV; ++u) acc[i][u] = Vec::fmadd(pi, vv[u], acc[i][u]);
          }
        }
        for (int64_t i = 0; i < R; ++i)
          for (int64_t u = 0; u < NV; ++u) Vec::store(po + i * d + c + u * W, acc[i][u]);
      };
      constexpr int64_t CV = W == 16 ? (R <= 4 ? 4 : 2) : (R <= 4 ? 2 : 1);
      for (int64_t j = 0; j < len; ++j)
        for (int64_t u = 0; u < std::min<int64_t>(CV * W, d); u += 16) _mm_prefetch(reinterpret_cast<const char*>(vb + j * vs2 + u), _MM_HINT_T0);
      int64_t c = 0;
      for (; c + CV * W <= d; c += CV * W) columns(std::integral_constant<int64_t, CV>{}, c);
      for (; c < d; c += W) columns(std::integral_constant<int64_t, 1>{}, c);
    }
  });
  // merge the chunks of each row in key order: out = sum_c e^(m_c - M) o_c / sum_c e^(m_c - M) l_c
  float* op = out.data_ptr<float>();
  std::vector<float> w(chunks);
  for (int64_t bh = 0; bh < b * kv_heads; ++bh) {
    const int64_t bi = bh / kv_heads, hk = bh % kv_heads;
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t blk = r / R, i = r % R, h = head_of(hk, r), ti = r % t;
      const int64_t first = (bh * blocks + blk) * chunks;
      float top = -INFINITY;
      for (int64_t c = 0; c < chunks; ++c) top = std::max(top, part_m[(first + c) * R + i]);
      float* o = op + ((bi * t + ti) * heads + h) * d;
      if (top == -INFINITY) {  // a row with every key masked
        for (int64_t x = 0; x < d; ++x) o[x] = 0.0f;
        continue;
      }
      float total = 0.0f;
      for (int64_t c = 0; c < chunks; ++c) {
        const float m = part_m[(first + c) * R + i];
        w[c] = m == -INFINITY ? 0.0f : std::exp(m - top);
        total = total + w[c] * part_l[(first + c) * R + i];
      }
      // a register of columns at a time, each element's products and sums in chunk order as one at a time (the merge
      // of 32 rows of 256 columns one float at a time took a fifth of the kernel's time at 8 positions, on one thread)
      const V div = Vec::set1(total);
      for (int64_t x = 0; x < d; x += W) {
        V acc = Vec::zero();
        for (int64_t c = 0; c < chunks; ++c) acc = Vec::add(acc, Vec::mul(Vec::set1(w[c]), Vec::load(part_o.get() + ((first + c) * R + i) * d + x)));
        Vec::store(o + x, Vec::div(acc, div));
      }
    }
  }
  return out;
}
