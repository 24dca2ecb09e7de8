// The 8-bit blockwise AdamW step on the CPU, one block at a time: the torch twin
// (adamw8bit.py `_step_blocks`) operation for operation, in fp32 with every product and sum
// rounded separately (built with -ffp-contract=off, no -ffast-math) and a correctly rounded sqrt,
// so its results are bit-identical to the twin's. Code-book gathers hit 256-entry tables in L1.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <cstring>
#include <vector>

namespace {

constexpr int kShift = 15, kBuckets = 33 << 8, kBase = (127 - 32) << 8;

struct Book {
  const float* values;
  const int32_t* table;
  const float* midpoints;
};

inline int32_t nearest(float y, const Book& book) {
  int32_t bits;
  std::memcpy(&bits, &y, 4);
  int32_t key = ((bits & 0x7FFFFFFF) >> kShift) - kBase;
  key = key < 0 ? 0 : (key > kBuckets - 1 ? kBuckets - 1 : key);
  key += bits < 0 ? kBuckets : 0;
  const int32_t first = book.table[key];
  return first + (book.midpoints[first] < y ? 1 : 0);
}

// Quantize value[0..w) to codes (offset 128 when signed) + absmax; stored[i] gets the dequantized value.
// Loops are split so the compiler can vectorize each (lane-wise max, division, table gathers).
template <typename Code>
void quantize(const float* value, int64_t w, Code* codes, float* scale, const Book& book, int offset,
              float* stored, int32_t* index) {
  float lanes[8] = {0, 0, 0, 0, 0, 0, 0, 0};  // the max is exact, so lane order does not matter
  int64_t i = 0;
  for (; i + 8 <= w; i += 8)
    for (int j = 0; j < 8; ++j) {
      const float a = std::fabs(value[i + j]);
      lanes[j] = a > lanes[j] ? a : lanes[j];
    }
  float absmax = 0.0f;
  for (; i < w; ++i) absmax = std::fabs(value[i]) > absmax ? std::fabs(value[i]) : absmax;
  for (int j = 0; j < 8; ++j) absmax = lanes[j] > absmax ? lanes[j] : absmax;
  const float divisor = absmax > 0.0f ? absmax : 1.0f;
  for (int64_t k = 0; k < w; ++k) index[k] = nearest(value[k] / divisor, book);
  for (int64_t k = 0; k < w; ++k) codes[k] = static_cast<Code>(index[k] - offset);
  if (stored)
    for (int64_t k = 0; k < w; ++k) stored[k] = book.values[index[k]] * absmax;
  *scale = absmax;
}

}  // namespace

void adamw8bit_step_cpu(
    torch::Tensor param, torch::Tensor grad, torch::Tensor m_codes, torch::Tensor m_scales,
    torch::Tensor v_codes, torch::Tensor v_scales, c10::optional<torch::Tensor> mr_codes,
    c10::optional<torch::Tensor> mr_scales, c10::optional<torch::Tensor> vr_codes,
    c10::optional<torch::Tensor> vr_scales, torch::Tensor scalars, torch::Tensor signed_book,
    torch::Tensor signed_table, torch::Tensor signed_mid, torch::Tensor unsigned_book,
    torch::Tensor unsigned_table, torch::Tensor unsigned_mid, int64_t block_size) {
  TORCH_CHECK(param.dtype() == torch::kFloat32 && grad.dtype() == torch::kFloat32, "fp32 param and grad only");
  const int64_t n = param.numel();
  const int64_t n_blocks = (n + block_size - 1) / block_size;
  const bool ef = mr_codes.has_value();
  const float* s = scalars.data_ptr<float>();
  const float decay = s[0], beta1 = s[1], omb1 = s[2], beta2 = s[3], omb2 = s[4], step_size = s[5],
              bc2 = s[6], sq_floor = s[7], eps = s[8];
  const Book sb{signed_book.data_ptr<float>(), signed_table.data_ptr<int32_t>(), signed_mid.data_ptr<float>()};
  const Book ub{unsigned_book.data_ptr<float>(), unsigned_table.data_ptr<int32_t>(), unsigned_mid.data_ptr<float>()};
  float* p = param.data_ptr<float>();
  const float* g = grad.data_ptr<float>();
  int8_t* mc = m_codes.data_ptr<int8_t>();
  uint8_t* vc = v_codes.data_ptr<uint8_t>();
  float* ms = m_scales.data_ptr<float>();
  float* vs = v_scales.data_ptr<float>();
  int8_t* mrc = ef ? mr_codes->data_ptr<int8_t>() : nullptr;
  int8_t* vrc = ef ? vr_codes->data_ptr<int8_t>() : nullptr;
  float* mrs = ef ? mr_scales->data_ptr<float>() : nullptr;
  float* vrs = ef ? vr_scales->data_ptr<float>() : nullptr;
  at::parallel_for(0, n_blocks, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> m(block_size), v(block_size), m_out(block_size), v_out(block_size);
    std::vector<int32_t> index(block_size);
    for (int64_t b = begin; b < end; ++b) {
      const int64_t start = b * block_size;
      const int64_t w = std::min(block_size, n - start);
      const float m_scale = ms[b], v_scale = vs[b];
      float* __restrict mb = m.data();
      float* __restrict vb = v.data();
      for (int64_t i = 0; i < w; ++i) mb[i] = sb.values[mc[start + i] + 128] * m_scale;
      for (int64_t i = 0; i < w; ++i) vb[i] = ub.values[vc[start + i]] * v_scale;
      if (ef) {
        const float mr_scale = mrs[b], vr_scale = vrs[b];
        for (int64_t i = 0; i < w; ++i) mb[i] = mb[i] + sb.values[mrc[start + i] + 128] * mr_scale;
        for (int64_t i = 0; i < w; ++i) vb[i] = vb[i] + sb.values[vrc[start + i] + 128] * vr_scale;
      }
      float* __restrict pb = p + start;
      const float* __restrict gb = g + start;
      for (int64_t i = 0; i < w; ++i) {
        float vi = vb[i] < 0.0f ? 0.0f : vb[i];
        float mi = vi > 0.0f ? mb[i] : 0.0f;
        const float gi = gb[i];
        mi = beta1 * mi + omb1 * gi;
        vi = beta2 * vi + omb2 * (gi * gi);
        const float floor_v = sq_floor * (mi * mi);
        vi = vi < floor_v ? floor_v : vi;
        const float denom = std::sqrt(vi) / bc2 + eps;
        pb[i] = pb[i] * decay - step_size * (mi / denom);
        mb[i] = mi;
        vb[i] = vi;
      }
      quantize(mb, w, mc + start, ms + b, sb, 128, ef ? m_out.data() : nullptr, index.data());
      quantize(vb, w, vc + start, vs + b, ub, 0, ef ? v_out.data() : nullptr, index.data());
      if (ef) {
        for (int64_t i = 0; i < w; ++i) mb[i] = mb[i] - m_out[i];
        for (int64_t i = 0; i < w; ++i) vb[i] = vb[i] - v_out[i];
        quantize(mb, w, mrc + start, mrs + b, sb, 128, nullptr, index.data());
        quantize(vb, w, vrc + start, vrs + b, sb, 128, nullptr, index.data());
      }
    }
  });
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("adamw8bit_step_cpu", &adamw8bit_step_cpu); }
