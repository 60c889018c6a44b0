// A Gemma-3 decoder stack's decode step in one call: the same ATen operations, in the same order and on the
// same shapes, as transformers' modules run from Python, so the same floats (decode.engine.direct checks
// this against transformers' forward before using it, and keeps transformers' forward wherever it differs).
//
// Why: at one to a few positions a small model's step on a CPU pays per operation. Gemma 3 270M runs about
// a thousand small operations a token; called from Python each costs the interpreter, the module machinery
// and the argument parsing on top of the operation itself, about half of a token's time outside the
// matrix products. Called from here, only the operation itself remains.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <optional>
#include <vector>

at::Tensor specdec_qmatmul(const at::Tensor& x, const at::Tensor& blocks, int64_t qtype, int64_t K);

namespace {

constexpr int64_t LINEARS = 7;  // q, k, v, o, gate, up, down
constexpr int64_t NORMS = 6;    // input, q, k, post-attention, pre-feedforward, post-feedforward

struct Layer {
  const at::Tensor* linear;  // LINEARS weights: a GGUF file's blocks (qtype > 0) or float32 [N, K]
  const int64_t* qtype;
  const int64_t* in_features;
  const at::Tensor* norm;    // NORMS x (1 + weight, epsilon, count), each float32
};

// nn.Linear's forward, or models.blocks' route of it to the quantised-block kernel
at::Tensor linear(const Layer& l, int j, const at::Tensor& x) {
  if (l.qtype[j] == 0) return at::linear(x, l.linear[j]);
  const int64_t k = l.in_features[j];
  const int64_t rows = x.numel() / k;
  at::Tensor y = specdec_qmatmul(x.reshape({rows, k}), l.linear[j], l.qtype[j], k);
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end() - 1);
  shape.push_back(y.size(1));
  return y.reshape(shape);
}

// models.norms' Gemma RMSNorm: sum(x * x) / count, + epsilon, rsqrt, times x, times (1 + weight)
at::Tensor norm(const Layer& l, int j, const at::Tensor& x) {
  const at::Tensor& scale = l.norm[3 * j];
  const at::Tensor& eps = l.norm[3 * j + 1];
  const at::Tensor& count = l.norm[3 * j + 2];
  at::Tensor square = at::sum(x * x, {-1}, true).div_(count);
  return x * at::rsqrt(square.add_(eps)) * scale;
}

// transformers' rotate_half and apply_rotary_pos_emb (cos, sin already unsqueezed at dim 1)
at::Tensor rotate(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  const int64_t half = x.size(-1) / 2;
  at::Tensor turned = at::cat({-x.slice(-1, half), x.slice(-1, 0, half)}, -1);
  return (x * cos) + (turned * sin);
}

// transformers' sdpa_attention_forward for a module with key/value groups, no dropout and no position bias
at::Tensor attend(at::Tensor q, at::Tensor k, at::Tensor v, const std::optional<at::Tensor>& mask, int64_t groups,
                  double scaling, bool causal) {
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

// x [B, T, H] after the embedding; per layer its weights, norms, key/value buffers [B, Hkv, S, D] and the
// attention mask of its kind (full / sliding: rope and masks are indexed by ``kinds``). The segment's keys
// and values are written at slots [start, start + T) and attention reads slots [offset, start + T).
at::Tensor gemma_layers(const at::Tensor& x_in, at::TensorList linears, at::IntArrayRef qtypes, at::IntArrayRef in_features,
                        at::TensorList norms, at::TensorList keys, at::TensorList values, at::TensorList rope,
                        const c10::List<std::optional<at::Tensor>>& masks, at::IntArrayRef kinds, int64_t head_dim,
                        int64_t groups, double scaling, bool causal, int64_t start, int64_t offset) {
  const int64_t layers = static_cast<int64_t>(kinds.size());
  TORCH_CHECK(static_cast<int64_t>(linears.size()) == LINEARS * layers && static_cast<int64_t>(norms.size()) == 3 * NORMS * layers &&
                  static_cast<int64_t>(keys.size()) == layers && static_cast<int64_t>(values.size()) == layers,
              "gemma_layers: per-layer arguments do not match the layer count");
  at::Tensor x = x_in;
  const int64_t b = x.size(0), t = x.size(1);
  const int64_t end = start + t;
  std::vector<at::Tensor> cos, sin;
  for (size_t i = 0; i < rope.size(); i += 2) {
    cos.push_back(rope[i].unsqueeze(1));
    sin.push_back(rope[i + 1].unsqueeze(1));
  }
  for (int64_t i = 0; i < layers; ++i) {
    const Layer l{linears.data() + LINEARS * i, qtypes.data() + LINEARS * i, in_features.data() + LINEARS * i,
                  norms.data() + 3 * NORMS * i};
    const int64_t kind = kinds[i];
    at::Tensor residual = x;
    at::Tensor h = norm(l, 0, x);
    at::Tensor q = linear(l, 0, h).view({b, t, -1, head_dim}).transpose(1, 2);
    at::Tensor k = linear(l, 1, h).view({b, t, -1, head_dim}).transpose(1, 2);
    at::Tensor v = linear(l, 2, h).view({b, t, -1, head_dim}).transpose(1, 2);
    q = rotate(norm(l, 1, q), cos[kind], sin[kind]);
    k = rotate(norm(l, 2, k), cos[kind], sin[kind]);
    keys[i].slice(2, start, end).copy_(k);
    values[i].slice(2, start, end).copy_(v);
    at::Tensor o = attend(q, keys[i].slice(2, offset, end), values[i].slice(2, offset, end), masks.get(kind), groups,
                          scaling, causal);
    o = linear(l, 3, o.reshape({b, t, -1}).contiguous());
    x = residual + norm(l, 3, o);
    residual = x;
    h = norm(l, 4, x);
    h = linear(l, 6, at::gelu(linear(l, 4, h), "tanh") * linear(l, 5, h));
    x = residual + norm(l, 5, h);
  }
  return x;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(specdec_q, m) {
  m.def("gemma_layers(Tensor x, Tensor[] linears, int[] qtypes, int[] in_features, Tensor[] norms, Tensor[] keys, "
        "Tensor[] values, Tensor[] rope, Tensor?[] masks, int[] kinds, int head_dim, int groups, float scaling, "
        "bool causal, int start, int offset) -> Tensor",
        gemma_layers);
}
