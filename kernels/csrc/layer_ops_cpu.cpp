// The small per-layer ops of a decoder step on the CPU, each one pass over its rows where torch
// runs several ops (and allocates between them): RMSNorm (optionally adding the residual first),
// rotate-half RoPE in place, SiLU(gate) * up, and the K/V cache write. A decode step is a handful
// of rows, so per-op overhead, not arithmetic, is what these remove.
//
// Each computes in fp32 and rounds where the torch reference (kernels/reference.py) rounds, so
// fp16/bf16 results match it to the last bit but for fp32 sums taken in another order.
// Shapes: rows are dim 0 with the last dim contiguous; kernels/layer_ops.py checks the inputs.

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <cstring>
#include <optional>
#include <vector>

#include "cpu_math.h"

namespace {

constexpr int64_t kLanes = 16;

inline float sum_squares(const float* x, int64_t n) {
  float part[kLanes] = {0.f};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int64_t l = 0; l < kLanes; ++l) part[l] += x[i + l] * x[i + l];
  }
  for (int64_t w = kLanes / 2; w >= 1; w /= 2) {
    for (int64_t l = 0; l < w; ++l) part[l] += part[l + w];
  }
  float s = part[0];
  for (; i < n; ++i) s += x[i] * x[i];
  return s;
}

// out = weight * (r * rsqrt(mean(r^2) + eps)) with r = x (+ residual, which then holds r).
template <typename T>
void rms_norm_rows(T* out, int64_t out_stride, T* residual, int64_t res_stride, const T* x,
                   int64_t x_stride, const T* weight, int64_t rows, int64_t n, float eps) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> r(n);
    for (int64_t row = begin; row < end; ++row) {
      const T* xr = x + row * x_stride;
      T* res = residual ? residual + row * res_stride : nullptr;
      for (int64_t i = 0; i < n; ++i) {
        if (res) {
          const T summed = static_cast<T>(static_cast<float>(res[i]) + static_cast<float>(xr[i]));
          res[i] = summed;
          r[i] = static_cast<float>(summed);
        } else {
          r[i] = static_cast<float>(xr[i]);
        }
      }
      const float inv = 1.f / std::sqrt(sum_squares(r.data(), n) / static_cast<float>(n) + eps);
      T* o = out + row * out_stride;
      for (int64_t i = 0; i < n; ++i) {
        const T normed = static_cast<T>(r[i] * inv);
        o[i] = static_cast<T>(static_cast<float>(weight[i]) * static_cast<float>(normed));
      }
    }
  });
}

void rms_norm(at::Tensor out, std::optional<at::Tensor> residual, const at::Tensor& x,
              const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && out.sizes() == x.sizes() && weight.dim() == 1 && weight.size(0) == x.size(1),
              "rms_norm: x/out [rows, n], weight [n]");
  TORCH_CHECK(x.stride(1) == 1 && out.stride(1) == 1 && weight.is_contiguous(), "rms_norm: rows must be contiguous");
  TORCH_CHECK(x.scalar_type() == out.scalar_type() && x.scalar_type() == weight.scalar_type(), "rms_norm: one dtype");
  if (residual) {
    TORCH_CHECK(residual->sizes() == x.sizes() && residual->stride(1) == 1 &&
                    residual->scalar_type() == x.scalar_type(), "rms_norm: residual like x");
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "rms_norm", [&] {
    rms_norm_rows<scalar_t>(out.data_ptr<scalar_t>(), out.stride(0),
                            residual ? residual->data_ptr<scalar_t>() : nullptr,
                            residual ? residual->stride(0) : 0, x.data_ptr<scalar_t>(), x.stride(0),
                            weight.data_ptr<scalar_t>(), x.size(0), x.size(1), static_cast<float>(eps));
  });
}

// x [tokens, heads, head_size] in place: (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin), with
// cos/sin [max_position, head_size / 2] fp32 rows picked by positions [tokens] int64.
template <typename T>
void rope_rows(T* x, int64_t tok_stride, int64_t head_stride, int64_t tokens, int64_t heads,
               int64_t half, const int64_t* positions, const float* cos, const float* sin,
               int64_t max_pos) {
  at::parallel_for(0, tokens, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t p = positions[t];
      TORCH_CHECK(p >= 0 && p < max_pos, "rope: position ", p, " outside the table of ", max_pos);
      const float* c = cos + p * half;
      const float* s = sin + p * half;
      for (int64_t h = 0; h < heads; ++h) {
        T* a = x + t * tok_stride + h * head_stride;
        T* b = a + half;
        for (int64_t i = 0; i < half; ++i) {
          const float x1 = static_cast<float>(a[i]), x2 = static_cast<float>(b[i]);
          a[i] = static_cast<T>(x1 * c[i] - x2 * s[i]);
          b[i] = static_cast<T>(x2 * c[i] + x1 * s[i]);
        }
      }
    }
  });
}

void rope_(at::Tensor x, const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.size(2) % 2 == 0, "rope: x [tokens, heads, even head_size]");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.dim() == 1 && positions.is_contiguous() &&
                  positions.size(0) == x.size(0), "rope: positions int64 [tokens]");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && cos.is_contiguous() && sin.is_contiguous() &&
                  cos.sizes() == sin.sizes() && cos.dim() == 2 && cos.size(1) * 2 == x.size(2),
              "rope: cos/sin fp32 [max_position, head_size / 2]");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "rope", [&] {
    rope_rows<scalar_t>(x.data_ptr<scalar_t>(), x.stride(0), x.stride(1), x.size(0), x.size(1),
                        x.size(2) / 2, positions.data_ptr<int64_t>(), cos.data_ptr<float>(),
                        sin.data_ptr<float>(), cos.size(0));
  });
}

// gate_up [rows, 2n] (gate, then up) -> out [rows, n] = silu(gate) * up.
template <typename T>
void silu_mul_rows(T* out, int64_t out_stride, const T* gu, int64_t gu_stride, int64_t rows, int64_t n) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const T* g = gu + row * gu_stride;
      const T* u = g + n;
      T* o = out + row * out_stride;
      for (int64_t i = 0; i < n; ++i) {
        const float gf = static_cast<float>(g[i]);
        const T act = static_cast<T>(gf / (1.f + kvpool::exp_approx(-gf)));
        o[i] = static_cast<T>(static_cast<float>(act) * static_cast<float>(u[i]));
      }
    }
  });
}

void silu_mul(at::Tensor out, const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.size(1) % 2 == 0 && gate_up.stride(1) == 1,
              "silu_mul: gate_up [rows, 2n] with contiguous rows");
  TORCH_CHECK(out.dim() == 2 && out.size(0) == gate_up.size(0) && out.size(1) * 2 == gate_up.size(1) &&
                  out.stride(1) == 1 && out.scalar_type() == gate_up.scalar_type(), "silu_mul: out [rows, n]");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, out.scalar_type(), "silu_mul", [&] {
    silu_mul_rows<scalar_t>(out.data_ptr<scalar_t>(), out.stride(0), gate_up.data_ptr<scalar_t>(),
                            gate_up.stride(0), out.size(0), out.size(1));
  });
}

// key/value [tokens, kv_heads, head_size] into kv_cache [2, blocks, block_size, kv_heads,
// head_size] at slot_mapping [tokens] (block * block_size + offset; -1 skips the token).
void write_kv(const at::Tensor& key, const at::Tensor& value, at::Tensor kv_cache, const at::Tensor& slots) {
  TORCH_CHECK(key.dim() == 3 && key.sizes() == value.sizes() && kv_cache.dim() == 5 &&
                  kv_cache.size(3) == key.size(1) && kv_cache.size(4) == key.size(2),
              "write_kv: key/value [tokens, kv_heads, head_size], kv_cache [2, blocks, block_size, kv_heads, head_size]");
  TORCH_CHECK(key.scalar_type() == kv_cache.scalar_type() && value.scalar_type() == kv_cache.scalar_type(),
              "write_kv: one dtype");
  TORCH_CHECK(key.stride(2) == 1 && value.stride(2) == 1 && kv_cache.stride(4) == 1 && kv_cache.stride(3) == key.size(2),
              "write_kv: head_size contiguous, a slot's heads contiguous in the cache");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.dim() == 1 && slots.is_contiguous() &&
                  slots.size(0) == key.size(0), "write_kv: slot_mapping int64 [tokens]");
  const int64_t tokens = key.size(0), heads = key.size(1), d = key.size(2);
  const int64_t block_size = kv_cache.size(2), num_slots = kv_cache.size(1) * block_size;
  const int64_t elem = kv_cache.element_size();
  const int64_t* slot = slots.data_ptr<int64_t>();
  char* k_cache = static_cast<char*>(kv_cache.data_ptr());
  char* v_cache = k_cache + kv_cache.stride(0) * elem;
  const char* k = static_cast<const char*>(key.data_ptr());
  const char* v = static_cast<const char*>(value.data_ptr());
  for (int64_t t = 0; t < tokens; ++t) {
    const int64_t s = slot[t];
    if (s < 0) continue;
    TORCH_CHECK(s < num_slots, "write_kv: slot ", s, " outside the cache's ", num_slots);
    const int64_t at = ((s / block_size) * kv_cache.stride(1) + (s % block_size) * kv_cache.stride(2)) * elem;
    for (int64_t h = 0; h < heads; ++h) {
      std::memcpy(k_cache + at + h * d * elem, k + (t * key.stride(0) + h * key.stride(1)) * elem, d * elem);
      std::memcpy(v_cache + at + h * d * elem, v + (t * value.stride(0) + h * value.stride(1)) * elem, d * elem);
    }
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvpool_cpu, m) {
  m.def("rms_norm(Tensor(a!) out, Tensor(b!)? residual, Tensor x, Tensor weight, float eps) -> ()");
  m.def("rope_(Tensor(a!) x, Tensor positions, Tensor cos, Tensor sin) -> ()");
  m.def("silu_mul(Tensor(a!) out, Tensor gate_up) -> ()");
  m.def("write_kv(Tensor key, Tensor value, Tensor(a!) kv_cache, Tensor slot_mapping) -> ()");
}

TORCH_LIBRARY_IMPL(kvpool_cpu, CPU, m) {
  m.impl("rms_norm", rms_norm);
  m.impl("rope_", rope_);
  m.impl("silu_mul", silu_mul);
  m.impl("write_kv", write_kv);
}
