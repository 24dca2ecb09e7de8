// The 8-bit blockwise AdamW step on the CPU: the torch step (adamw8bit.py `_step_blocks`) operation
// for operation, in fp32 with every product and sum rounded separately (built with -ffp-contract=off,
// no -ffast-math; the AVX2 path uses separate multiply and add instructions, never FMA) and correctly
// rounded division and sqrt (vdivps/vsqrtps round exactly as the scalar operations), so its results
// are bit-identical to the torch step's.
//
// Speed: each block is handled in three passes over L1-resident buffers so every byte of the state,
// parameter and gradient is read once and written once per step:
//   1. decode m and v (code-book lookups), the Adam update, the parameter write, and the running
//      absmax of the new m and v;
//   2. encode m and v against their absmax (one packed bucket-table gather each, see `Book`)
//      and, with error feedback, the residuals x - decode(encode(x)) and their absmax;
//   3. (error feedback only) encode the residuals.
// Blocks are independent: threads take contiguous ranges of them (static split).
// The core below is plain C++ (no torch types) so it can be benchmarked and checked on its own;
// HF_GALORE_CORE_ONLY leaves out the torch binding.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>
#ifdef __AVX2__
#include <immintrin.h>
#endif

namespace hf_galore_cpu {

constexpr int kShift = 15, kBuckets = 33 << 8, kBase = (127 - 32) << 8;

// `packed[key]` (adamw8bit.py `_packed_lookup_table`) = first | threshold << 8 for the bucket `key` of y
// (see nearest_code_index): first = #(midpoints < smallest y of the bucket), and since a bucket holds
// at most one midpoint, which then shares y's sign, exponent and top 8 mantissa bits, `mid < y` is a
// comparison of the 15 low bits: z(y) > threshold, with z = low 15 bits of y, complemented for y < 0
// (a larger magnitude is a smaller y), and threshold 0x7FFF (never exceeded) where the bucket holds no
// midpoint. One gather per value instead of two dependent ones (table, then midpoints).
struct Book {
  const float* values;     // 256 code values, ascending
  const int32_t* packed;   // 2 * kBuckets entries
};

struct Scalars {
  float decay, beta1, omb1, beta2, omb2, step_size, bc2, sq_floor, eps;
};

struct State {
  float* p;
  const float* g;
  int8_t* mc;
  float* ms;
  uint8_t* vc;
  float* vs;
  int8_t* mrc;  // null without error feedback
  float* mrs;
  int8_t* vrc;
  float* vrs;
};

inline int32_t nearest(float y, const Book& book) {
  int32_t bits;
  std::memcpy(&bits, &y, 4);
  int32_t key = ((bits & 0x7FFFFFFF) >> kShift) - kBase;
  key = key < 0 ? 0 : (key > kBuckets - 1 ? kBuckets - 1 : key);
  key += bits < 0 ? kBuckets : 0;
  const int32_t entry = book.packed[key];
  const int32_t z = (bits & 0x7FFF) ^ (bits < 0 ? 0x7FFF : 0);
  return (entry & 0xFF) + (z > (entry >> 8) ? 1 : 0);
}

// One value of pass 1 (scalar form; the AVX2 loop does the same operations in the same order).
inline void update_one(const Scalars& s, float m, float v, float g, float& p, float& m_new, float& v_new) {
  v = v < 0.0f ? 0.0f : v;
  m = v > 0.0f ? m : 0.0f;
  m = s.beta1 * m + s.omb1 * g;
  v = s.beta2 * v + s.omb2 * (g * g);
  const float floor_v = s.sq_floor * (m * m);
  v = v < floor_v ? floor_v : v;
  const float denom = std::sqrt(v) / s.bc2 + s.eps;
  p = p * s.decay - s.step_size * (m / denom);
  m_new = m;
  v_new = v;
}

inline float divisor_of(float absmax) { return absmax > 0.0f ? absmax : 1.0f; }

#ifdef __AVX2__
// book[index[j]] for the 8 byte-sized indices packed in `index` (byte j = bits 8j..8j+7), as scalar
// loads: AVX2 gathers are microcoded on the AMD cores this runs on and cost more than eight loads
// (measured: the step 3.4 -> 3.0 ns per value with L1-resident data, 7% to 40% on whole steps).
inline __m256 lookup8(uint64_t index, const float* book) {
  const uint64_t k = index;
  const __m128 lo = _mm_setr_ps(book[k & 255], book[(k >> 8) & 255], book[(k >> 16) & 255], book[(k >> 24) & 255]);
  const __m128 hi = _mm_setr_ps(book[(k >> 32) & 255], book[(k >> 40) & 255], book[(k >> 48) & 255], book[k >> 56]);
  return _mm256_insertf128_ps(_mm256_castps128_ps256(lo), hi, 1);
}

inline __m256 decode8_signed(const int8_t* codes, const float* book, __m256 scale) {
  uint64_t k;
  std::memcpy(&k, codes, 8);
  // int8 code c is book index c + 128: flipping each byte's top bit adds 128 modulo 256.
  return _mm256_mul_ps(lookup8(k ^ 0x8080808080808080ULL, book), scale);
}

inline __m256 decode8_unsigned(const uint8_t* codes, const float* book, __m256 scale) {
  uint64_t k;
  std::memcpy(&k, codes, 8);
  return _mm256_mul_ps(lookup8(k, book), scale);
}

inline __m256 abs8(__m256 x) { return _mm256_andnot_ps(_mm256_set1_ps(-0.0f), x); }

// Index (0..255) of the nearest code value to each of y = x / divisor.
inline __m256i nearest8(__m256 x, __m256 divisor, const Book& book) {
  const __m256 y = _mm256_div_ps(x, divisor);
  const __m256i bits = _mm256_castps_si256(y);
  __m256i key = _mm256_sub_epi32(_mm256_srli_epi32(_mm256_and_si256(bits, _mm256_set1_epi32(0x7FFFFFFF)), kShift),
                                 _mm256_set1_epi32(kBase));
  key = _mm256_min_epi32(_mm256_max_epi32(key, _mm256_setzero_si256()), _mm256_set1_epi32(kBuckets - 1));
  key = _mm256_add_epi32(key, _mm256_and_si256(_mm256_srai_epi32(bits, 31), _mm256_set1_epi32(kBuckets)));
  const __m256i entry = _mm256_i32gather_epi32(book.packed, key, 4);
  const __m256i low = _mm256_set1_epi32(0x7FFF);
  const __m256i z = _mm256_xor_si256(_mm256_and_si256(bits, low), _mm256_and_si256(_mm256_srai_epi32(bits, 31), low));
  // (z > threshold) is all ones (-1) where true: first - mask adds 1.
  const __m256i first = _mm256_and_si256(entry, _mm256_set1_epi32(0xFF));
  return _mm256_sub_epi32(first, _mm256_cmpgt_epi32(z, _mm256_srli_epi32(entry, 8)));
}

// Store 8 indices in 0..255 as bytes (index - offset, offset 128 or 0, wraps as int8/uint8 do).
inline void store8(__m256i index, int offset, void* out) {
  const __m128i lo = _mm256_castsi256_si128(index), hi = _mm256_extracti128_si256(index, 1);
  __m128i bytes = _mm_packus_epi16(_mm_packus_epi32(lo, hi), _mm_setzero_si128());
  if (offset) bytes = _mm_xor_si128(bytes, _mm_set1_epi8(static_cast<char>(0x80)));
  _mm_storel_epi64(reinterpret_cast<__m128i*>(out), bytes);
}

inline float hmax8(__m256 x) {
  float lanes[8];
  _mm256_storeu_ps(lanes, x);
  float r = lanes[0];
  for (int j = 1; j < 8; ++j) r = lanes[j] > r ? lanes[j] : r;
  return r;
}
#endif

// Encode x[0..w) (absmax given) into codes; stored[i] (when not null) gets decode(code) = book * absmax,
// residual[i] = x[i] - stored[i] and *residual_absmax its absmax (when residual is not null).
template <typename Code>
void encode(const float* x, int64_t w, float absmax, Code* codes, const Book& book, int offset, float* residual,
            float* residual_absmax) {
  const float divisor = divisor_of(absmax);
  int64_t i = 0;
  float rmax = 0.0f;
#ifdef __AVX2__
  const __m256 vdiv = _mm256_set1_ps(divisor), vabs = _mm256_set1_ps(absmax);
  __m256 vrmax = _mm256_setzero_ps();
  for (; i + 8 <= w; i += 8) {
    const __m256 xi = _mm256_loadu_ps(x + i);
    const __m256i index = nearest8(xi, vdiv, book);
    store8(index, offset, codes + i);
    if (residual) {
      uint64_t stored;
      std::memcpy(&stored, codes + i, 8);
      if (offset) stored ^= 0x8080808080808080ULL;  // back from int8 codes to book indices
      const __m256 r = _mm256_sub_ps(xi, _mm256_mul_ps(lookup8(stored, book.values), vabs));
      _mm256_storeu_ps(residual + i, r);
      vrmax = _mm256_max_ps(vrmax, abs8(r));
    }
  }
  if (residual) rmax = hmax8(vrmax);
#endif
  for (; i < w; ++i) {
    const int32_t index = nearest(x[i] / divisor, book);
    codes[i] = static_cast<Code>(index - offset);
    if (residual) {
      const float r = x[i] - book.values[index] * absmax;
      residual[i] = r;
      rmax = std::fabs(r) > rmax ? std::fabs(r) : rmax;
    }
  }
  if (residual) *residual_absmax = rmax;
}

// Blocks [begin, end) of a tensor of n values. m, v, mr, vr: scratch of block_size floats each.
void step_blocks(const State& t, const Scalars& s, const Book& sb, const Book& ub, int64_t n, int64_t block_size,
                 int64_t begin, int64_t end, float* m, float* v, float* mr, float* vr) {
  const bool ef = t.mrc != nullptr;
  for (int64_t b = begin; b < end; ++b) {
    const int64_t start = b * block_size;
    const int64_t w = std::min(block_size, n - start);
    const int8_t* mc = t.mc + start;
    const uint8_t* vc = t.vc + start;
    const int8_t* mrc = ef ? t.mrc + start : nullptr;
    const int8_t* vrc = ef ? t.vrc + start : nullptr;
    float* p = t.p + start;
    const float* g = t.g + start;
    const float m_scale = t.ms[b], v_scale = t.vs[b];
    const float mr_scale = ef ? t.mrs[b] : 0.0f, vr_scale = ef ? t.vrs[b] : 0.0f;
    float m_max = 0.0f, v_max = 0.0f;
    int64_t i = 0;
#ifdef __AVX2__
    {
      const __m256 vms = _mm256_set1_ps(m_scale), vvs = _mm256_set1_ps(v_scale);
      const __m256 vmrs = _mm256_set1_ps(mr_scale), vvrs = _mm256_set1_ps(vr_scale);
      const __m256 zero = _mm256_setzero_ps(), beta1 = _mm256_set1_ps(s.beta1), omb1 = _mm256_set1_ps(s.omb1),
                   beta2 = _mm256_set1_ps(s.beta2), omb2 = _mm256_set1_ps(s.omb2),
                   sq_floor = _mm256_set1_ps(s.sq_floor), bc2 = _mm256_set1_ps(s.bc2), eps = _mm256_set1_ps(s.eps),
                   decay = _mm256_set1_ps(s.decay), step_size = _mm256_set1_ps(s.step_size);
      __m256 vm_max = zero, vv_max = zero;
      for (; i + 8 <= w; i += 8) {
        __m256 mi = decode8_signed(mc + i, sb.values, vms);
        __m256 vi = decode8_unsigned(vc + i, ub.values, vvs);
        if (ef) {
          mi = _mm256_add_ps(mi, decode8_signed(mrc + i, sb.values, vmrs));
          vi = _mm256_add_ps(vi, decode8_signed(vrc + i, sb.values, vvrs));
        }
        const __m256 gi = _mm256_loadu_ps(g + i);
        // v < 0 ? 0 : v, and m only where v > 0 (blends keep NaN where the scalar ternaries do).
        vi = _mm256_blendv_ps(vi, zero, _mm256_cmp_ps(vi, zero, _CMP_LT_OQ));
        mi = _mm256_and_ps(mi, _mm256_cmp_ps(vi, zero, _CMP_GT_OQ));
        mi = _mm256_add_ps(_mm256_mul_ps(beta1, mi), _mm256_mul_ps(omb1, gi));
        vi = _mm256_add_ps(_mm256_mul_ps(beta2, vi), _mm256_mul_ps(omb2, _mm256_mul_ps(gi, gi)));
        const __m256 floor_v = _mm256_mul_ps(sq_floor, _mm256_mul_ps(mi, mi));
        vi = _mm256_blendv_ps(vi, floor_v, _mm256_cmp_ps(vi, floor_v, _CMP_LT_OQ));
        const __m256 denom = _mm256_add_ps(_mm256_div_ps(_mm256_sqrt_ps(vi), bc2), eps);
        const __m256 pi = _mm256_loadu_ps(p + i);
        _mm256_storeu_ps(p + i, _mm256_sub_ps(_mm256_mul_ps(pi, decay),
                                              _mm256_mul_ps(step_size, _mm256_div_ps(mi, denom))));
        _mm256_storeu_ps(m + i, mi);
        _mm256_storeu_ps(v + i, vi);
        vm_max = _mm256_max_ps(vm_max, abs8(mi));
        vv_max = _mm256_max_ps(vv_max, abs8(vi));
      }
      m_max = hmax8(vm_max);
      v_max = hmax8(vv_max);
    }
#endif
    for (; i < w; ++i) {
      float mi = sb.values[mc[i] + 128] * m_scale;
      float vi = ub.values[vc[i]] * v_scale;
      if (ef) {
        mi = mi + sb.values[mrc[i] + 128] * mr_scale;
        vi = vi + sb.values[vrc[i] + 128] * vr_scale;
      }
      update_one(s, mi, vi, g[i], p[i], m[i], v[i]);
      m_max = std::fabs(m[i]) > m_max ? std::fabs(m[i]) : m_max;
      v_max = std::fabs(v[i]) > v_max ? std::fabs(v[i]) : v_max;
    }
    t.ms[b] = m_max;
    t.vs[b] = v_max;
    float mr_max = 0.0f, vr_max = 0.0f;
    encode(m, w, m_max, t.mc + start, sb, 128, ef ? mr : nullptr, &mr_max);
    encode(v, w, v_max, t.vc + start, ub, 0, ef ? vr : nullptr, &vr_max);
    if (ef) {
      t.mrs[b] = mr_max;
      t.vrs[b] = vr_max;
      encode(mr, w, mr_max, t.mrc + start, sb, 128, static_cast<float*>(nullptr), nullptr);
      encode(vr, w, vr_max, t.vrc + start, sb, 128, static_cast<float*>(nullptr), nullptr);
    }
  }
}

}  // namespace hf_galore_cpu

#ifndef HF_GALORE_CORE_ONLY
#include <torch/extension.h>
#include <ATen/Parallel.h>

// One step of every tensor of a list (one optimizer group): `lists` holds the op's ten tensor lists in
// its argument order (params, grads, then the state lists of adamw8bit.py `STATE_KEYS` and
// `RESIDUAL_KEYS`; the residual lists empty without error feedback), tensor i's scalars are row i of
// `scalars` [T, 9]. The blocks of all tensors form one range that the threads split, so a group of many
// small tensors costs one call and one parallel region, not one of each per tensor.
void adamw8bit_step_cpu(std::vector<std::vector<torch::Tensor>> lists, torch::Tensor scalars,
                        torch::Tensor signed_book, torch::Tensor signed_packed, torch::Tensor unsigned_book,
                        torch::Tensor unsigned_packed, int64_t block_size) {
  using namespace hf_galore_cpu;
  TORCH_CHECK(lists.size() == 10, "adamw8bit_step_cpu: give the op's ten tensor lists");
  const size_t count = lists[0].size();
  const bool ef = !lists[6].empty();
  for (size_t k = 1; k < 10; ++k)
    TORCH_CHECK(lists[k].size() == count || (k >= 6 && !ef && lists[k].empty()),
                "adamw8bit_step_cpu: every list needs one entry per parameter (the four residual lists: all "
                "empty or all full)");
  const auto& params = lists[0];
  const auto& grads = lists[1];
  TORCH_CHECK(scalars.dtype() == torch::kFloat32 && scalars.is_contiguous() && scalars.dim() == 2 &&
                  scalars.size(0) == static_cast<int64_t>(count) && scalars.size(1) == 9,
              "adamw8bit_step_cpu: scalars must be a contiguous fp32 [parameters, 9] tensor");
  std::vector<State> states;
  std::vector<Scalars> rows;
  std::vector<int64_t> sizes, first_block{0};
  for (size_t i = 0; i < count; ++i) {
    TORCH_CHECK(params[i].dtype() == torch::kFloat32 && grads[i].dtype() == torch::kFloat32 &&
                    params[i].is_contiguous() && grads[i].is_contiguous(),
                "adamw8bit_step_cpu: fp32 contiguous param and grad only");
    const int64_t n = params[i].numel();
    const float* f = scalars.data_ptr<float>() + 9 * i;
    rows.push_back(Scalars{f[0], f[1], f[2], f[3], f[4], f[5], f[6], f[7], f[8]});
    states.push_back(State{params[i].data_ptr<float>(), grads[i].data_ptr<float>(), lists[2][i].data_ptr<int8_t>(),
                           lists[3][i].data_ptr<float>(), lists[4][i].data_ptr<uint8_t>(), lists[5][i].data_ptr<float>(),
                           ef ? lists[6][i].data_ptr<int8_t>() : nullptr, ef ? lists[7][i].data_ptr<float>() : nullptr,
                           ef ? lists[8][i].data_ptr<int8_t>() : nullptr, ef ? lists[9][i].data_ptr<float>() : nullptr});
    sizes.push_back(n);
    first_block.push_back(first_block.back() + (n + block_size - 1) / block_size);
  }
  const Book sb{signed_book.data_ptr<float>(), signed_packed.data_ptr<int32_t>()};
  const Book ub{unsigned_book.data_ptr<float>(), unsigned_packed.data_ptr<int32_t>()};
  // A thread gets at least kMinValuesPerThread values: below that, waking a second thread costs more
  // than it saves (a parallel region waits for its slowest thread, which on a busy machine is one
  // scheduler time slice; measured 2.4 ms per 64K-value tensor under load vs ~0.3 ms inline).
  constexpr int64_t kMinValuesPerThread = 1 << 18;
  const int64_t grain = std::max<int64_t>(1, kMinValuesPerThread / block_size);
  at::parallel_for(0, first_block.back(), grain, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch(4 * block_size);
    float* base = scratch.data();
    // The first tensor with a block in [begin, end), then each one after it that starts before end.
    size_t i = std::upper_bound(first_block.begin(), first_block.end(), begin) - first_block.begin() - 1;
    for (; i < count && first_block[i] < end; ++i) {
      const int64_t lo = std::max(begin, first_block[i]) - first_block[i];
      const int64_t hi = std::min(end, first_block[i + 1]) - first_block[i];
      if (hi > lo)
        step_blocks(states[i], rows[i], sb, ub, sizes[i], block_size, lo, hi, base, base + block_size,
                    base + 2 * block_size, base + 3 * block_size);
    }
  });
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("adamw8bit_step_cpu", &adamw8bit_step_cpu); }
#endif
