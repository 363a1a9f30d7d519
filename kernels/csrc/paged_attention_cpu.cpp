// Paged attention on the CPU that reads K/V through the block table: no gathered copy.
//
// One task per query row: every head of the row scores every visible position, in block order
// (a position's kv heads lie together, so each block streams in as one piece; a kv head serves
// its group of query heads, GQA), then a softmax per head, then one pass over V. K and V are read
// once per row straight from the cache blocks, where the torch path first copied every context's
// blocks into a padded tensor and then read the copy. Sums are fp32 whatever the cache dtype.
//
// Shapes (kernels/paged_attention_cpu.py builds the row lists and checks the inputs first):
//   out, query:   [num_tokens, num_heads, head_size], head_size contiguous
//   kv_cache:     [2, num_blocks, block_size, num_kv_heads, head_size], head_size contiguous
//   block_tables: [num_seqs, width] int32, rows contiguous
//   row_token, row_seq, row_pos: [rows] int64: the query token of each row, its sequence (the
//                 block-table row) and its position (it sees positions <= pos, and > pos - window
//                 when window > 0)
// Logits are scale * q.k, then softcap * tanh(x / softcap) when softcap > 0.
//
// Built by kernels/cpu_build.py with -O3 -march=native on the machine that runs it: the loops
// over head_size are written lane-wise (kLanes independent sums) so the compiler vectorizes them
// without reassociating a reduction.

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "cpu_math.h"

namespace {

constexpr int64_t kLanes = 16;

template <typename T>
inline float dot(const float* q, const T* k, int64_t d_size) {
  float acc[kLanes] = {0.f};
  int64_t d = 0;
  for (; d + kLanes <= d_size; d += kLanes) {
    for (int64_t l = 0; l < kLanes; ++l) acc[l] += q[d + l] * static_cast<float>(k[d + l]);
  }
  for (int64_t w = kLanes / 2; w >= 1; w /= 2) {  // a tree, which vectorizes, not a chain
    for (int64_t l = 0; l < w; ++l) acc[l] += acc[l + w];
  }
  float s = acc[0];
  for (; d < d_size; ++d) s += q[d] * static_cast<float>(k[d]);
  return s;
}

template <typename T>
inline void axpy(float* acc, float w, const T* v, int64_t d_size) {
  for (int64_t d = 0; d < d_size; ++d) acc[d] += w * static_cast<float>(v[d]);
}

// exp(x - m) for x <= m, in place, returning the sum (kvpool::exp_approx: vectorized).
inline float exp_shifted(float* x, int64_t n, float m) {
  float part[kLanes] = {0.f};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int64_t l = 0; l < kLanes; ++l) {
      x[i + l] = kvpool::exp_approx(x[i + l] - m);
      part[l] += x[i + l];
    }
  }
  float sum = 0.f;
  for (int64_t l = 0; l < kLanes; ++l) sum += part[l];
  for (; i < n; ++i) {
    x[i] = kvpool::exp_approx(x[i] - m);
    sum += x[i];
  }
  return sum;
}

inline float max_of(const float* x, int64_t n) {
  float part[kLanes];
  std::fill(part, part + kLanes, -std::numeric_limits<float>::infinity());
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int64_t l = 0; l < kLanes; ++l) part[l] = x[i + l] > part[l] ? x[i + l] : part[l];
  }
  float m = -std::numeric_limits<float>::infinity();
  for (int64_t l = 0; l < kLanes; ++l) m = part[l] > m ? part[l] : m;
  for (; i < n; ++i) m = x[i] > m ? x[i] : m;
  return m;
}

struct Geometry {
  int64_t num_blocks, block_size, num_kv_heads, head_size, group, width;
  int64_t kv_stride, blk_stride, pos_stride, head_stride;  // cache strides (elements)
  int64_t q_tok, q_head, o_tok, o_head;  // query and out strides (elements)
};

// Calls f(p, pointer at position p's first head) for every position of [lo, pos], block by
// block; ``base`` is K or V of the cache. A position's heads are contiguous in the cache, so a
// block is read as one stream.
template <typename T, typename F>
inline void each_position(const Geometry& g, const T* base, const int32_t* table, int64_t lo,
                          int64_t pos, F&& f) {
  for (int64_t p = lo; p <= pos;) {
    const int64_t blk = table[p / g.block_size];
    TORCH_CHECK(blk >= 0 && blk < g.num_blocks, "block table names block ", blk, " outside [0, ",
                g.num_blocks, ")");
    const int64_t end = std::min(pos + 1, (p / g.block_size + 1) * g.block_size);
    const T* b = base + blk * g.blk_stride;
    // The next block lies anywhere in the cache, where no hardware prefetcher looks: ask for
    // its position rows while this block's are read, one row (all heads) per position.
    const int64_t next_p = (p / g.block_size + 1) * g.block_size;
    const T* next = next_p <= pos ? base + table[next_p / g.block_size] * g.blk_stride : nullptr;
    const int64_t row_bytes = g.num_kv_heads * g.head_stride * static_cast<int64_t>(sizeof(T));
    for (; p < end; ++p) {
      if (next != nullptr) {
        const char* ahead = reinterpret_cast<const char*>(next + (p % g.block_size) * g.pos_stride);
        for (int64_t off = 0; off < row_bytes; off += 64) __builtin_prefetch(ahead + off);
      }
      f(p, b + (p % g.block_size) * g.pos_stride);
    }
  }
}

// One query row, every head: q [heads][head_size] scaled fp32 in, acc [heads][head_size] out.
template <typename T>
void attend_row(const Geometry& g, const T* cache, const int32_t* table, int64_t lo, int64_t pos,
                const float* q, float softcap, float* scores, float* acc) {
  const int64_t n = pos - lo + 1, heads = g.num_kv_heads * g.group, d = g.head_size;
  each_position(g, cache, table, lo, pos, [&](int64_t p, const T* k) {
    for (int64_t hq = 0; hq < heads; ++hq) {
      float s = dot(q + hq * d, k + (hq / g.group) * g.head_stride, d);
      scores[hq * n + (p - lo)] = softcap > 0.f ? softcap * std::tanh(s / softcap) : s;
    }
  });
  std::vector<float> sums(heads);
  for (int64_t hq = 0; hq < heads; ++hq) {
    float* s = scores + hq * n;
    sums[hq] = exp_shifted(s, n, max_of(s, n));
  }
  std::fill(acc, acc + heads * d, 0.f);
  each_position(g, cache + g.kv_stride, table, lo, pos, [&](int64_t p, const T* v) {
    for (int64_t hq = 0; hq < heads; ++hq) {
      axpy(acc + hq * d, scores[hq * n + (p - lo)], v + (hq / g.group) * g.head_stride, d);
    }
  });
  for (int64_t hq = 0; hq < heads; ++hq) {
    const float inv = 1.f / sums[hq];
    for (int64_t i = 0; i < d; ++i) acc[hq * d + i] *= inv;
  }
}

template <typename T>
void attend_rows(const Geometry& g, T* out, const T* query, const T* cache, const int32_t* tables,
                 const int64_t* row_token, const int64_t* row_seq, const int64_t* row_pos,
                 int64_t rows, float scale, float softcap, int64_t window) {
  const int64_t heads = g.num_kv_heads * g.group, d = g.head_size;
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> q(heads * d), acc(heads * d), scores;
    for (int64_t r = begin; r < end; ++r) {
      const int64_t tok = row_token[r], pos = row_pos[r];
      const int64_t lo = window > 0 ? std::max<int64_t>(0, pos - window + 1) : 0;
      for (int64_t hq = 0; hq < heads; ++hq) {
        const T* src = query + tok * g.q_tok + hq * g.q_head;
        for (int64_t i = 0; i < d; ++i) q[hq * d + i] = static_cast<float>(src[i]) * scale;
      }
      scores.resize(heads * (pos - lo + 1));
      attend_row(g, cache, tables + row_seq[r] * g.width, lo, pos, q.data(), softcap, scores.data(),
                 acc.data());
      for (int64_t hq = 0; hq < heads; ++hq) {
        T* dst = out + tok * g.o_tok + hq * g.o_head;
        for (int64_t i = 0; i < d; ++i) dst[i] = static_cast<T>(acc[hq * d + i]);
      }
    }
  });
}

void paged_attention_rows(at::Tensor out, const at::Tensor& query, const at::Tensor& kv_cache,
                          const at::Tensor& block_tables, const at::Tensor& row_token,
                          const at::Tensor& row_seq, const at::Tensor& row_pos, double scale,
                          double softcap, int64_t window) {
  TORCH_CHECK(query.dim() == 3 && out.sizes() == query.sizes(), "query/out must be [tokens, heads, head]");
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2 && kv_cache.size(4) == query.size(2),
              "kv_cache must be [2, blocks, block_size, kv_heads, head_size]");
  TORCH_CHECK(query.scalar_type() == kv_cache.scalar_type() && out.scalar_type() == query.scalar_type(),
              "query, out and kv_cache must share a dtype");
  TORCH_CHECK(query.stride(2) == 1 && out.stride(2) == 1 && kv_cache.stride(4) == 1,
              "head_size must be contiguous");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.dim() == 2 &&
                  (block_tables.size(1) <= 1 || block_tables.stride(1) == 1),
              "block_tables must be int32 [seqs, width] with contiguous rows");
  for (const auto* t : {&row_token, &row_seq, &row_pos}) {
    TORCH_CHECK(t->scalar_type() == at::kLong && t->dim() == 1 && t->is_contiguous() &&
                    t->size(0) == row_token.size(0),
                "row_token, row_seq and row_pos must be contiguous int64 of one length");
  }
  const int64_t kv_heads = kv_cache.size(3);
  TORCH_CHECK(kv_heads > 0 && query.size(1) % kv_heads == 0, "heads must be a multiple of kv heads");
  Geometry g{kv_cache.size(1), kv_cache.size(2), kv_heads, query.size(2), query.size(1) / kv_heads,
             block_tables.size(1), kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2),
             kv_cache.stride(3), query.stride(0), query.stride(1), out.stride(0), out.stride(1)};
  const int64_t rows = row_token.size(0);
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int64_t *seq = row_seq.data_ptr<int64_t>(), *tok = row_token.data_ptr<int64_t>();
  const int64_t* pos = row_pos.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r) {  // before any thread reads: the tables' ids per block
    TORCH_CHECK(seq[r] >= 0 && seq[r] < block_tables.size(0), "row_seq out of range");
    TORCH_CHECK(tok[r] >= 0 && tok[r] < query.size(0), "row_token out of range");
    TORCH_CHECK(pos[r] >= 0 && pos[r] < g.width * g.block_size, "row position ", pos[r],
                " outside the block table");
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, query.scalar_type(), "paged_attention_rows", [&] {
    attend_rows<scalar_t>(g, out.data_ptr<scalar_t>(), query.data_ptr<scalar_t>(),
                          kv_cache.data_ptr<scalar_t>(), tables, tok, seq, pos, rows, static_cast<float>(scale),
                          static_cast<float>(softcap), window);
  });
}

}  // namespace

TORCH_LIBRARY(kvpool_cpu, m) {
  m.def(
      "paged_attention_rows(Tensor(a!) out, Tensor query, Tensor kv_cache, Tensor block_tables, "
      "Tensor row_token, Tensor row_seq, Tensor row_pos, float scale, float softcap, int window) -> ()");
}

TORCH_LIBRARY_IMPL(kvpool_cpu, CPU, m) {
  m.impl("paged_attention_rows", paged_attention_rows);
}
