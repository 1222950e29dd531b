// Portable kernels: any CPU, any bits in {2,3,4,5,6,8}.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "kernels.h"

namespace tsq {

float half_to_float(uint16_t h) {
  uint32_t sign = (uint32_t)(h & 0x8000) << 16;
  uint32_t exp = (h >> 10) & 0x1f;
  uint32_t man = h & 0x3ff;
  uint32_t bits;
  if (exp == 0) {
    if (man == 0) {
      bits = sign;
    } else {  // subnormal: normalize
      int e = -1;
      do {
        e++;
        man <<= 1;
      } while ((man & 0x400) == 0);
      bits = sign | ((uint32_t)(127 - 15 - e) << 23) | ((man & 0x3ff) << 13);
    }
  } else if (exp == 31) {
    bits = sign | 0x7f800000 | (man << 13);
  } else {
    bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

float e8m0_to_float(uint8_t e) {
  const uint32_t bits = e == 0 ? 0x00400000u : (uint32_t)e << 23;  // 2^-127 is a subnormal
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

float load_scale(const void* p, int type, int64_t i) {
  if (type == kF32) return static_cast<const float*>(p)[i];
  if (type == kE8M0) return e8m0_to_float(static_cast<const uint8_t*>(p)[i]);
  uint16_t h = static_cast<const uint16_t*>(p)[i];
  if (type == kF16) return half_to_float(h);
  uint32_t bits = (uint32_t)h << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

static inline uint32_t value_at(const uint8_t* row, int64_t i, int bits) {
  int64_t bit = i * bits;
  uint32_t word = 0;
  int64_t byte = bit >> 3;
  int nbytes = ((bit & 7) + bits + 7) >> 3;
  for (int b = 0; b < nbytes; b++) word |= (uint32_t)row[byte + b] << (8 * b);
  return (word >> (bit & 7)) & ((1u << bits) - 1);
}

void dequant_scalar(const QMat& q, float* dst, int64_t n0, int64_t n1) {
  const int64_t row_bytes = q.K * q.bits / 8, groups = q.K / q.group;
  for (int64_t n = n0; n < n1; n++) {
    const uint8_t* row = q.w + n * row_bytes;
    float* out = dst + (n - n0) * q.K;
    for (int64_t g = 0; g < groups; g++) {
      float s = load_scale(q.scales, q.scale_type, n * groups + g);
      if (q.fp4) {
        for (int j = 0; j < q.group; j++) out[g * q.group + j] = kFp4[value_at(row, g * q.group + j, 4)] * s;
        continue;
      }
      float b = q.biases ? load_scale(q.biases, q.scale_type, n * groups + g) : symmetric_bias(q, s);
      for (int j = 0; j < q.group; j++) {
        int64_t i = g * q.group + j;
        out[i] = (float)value_at(row, i, q.bits) * s + b;
      }
    }
  }
}

void rows_scalar(const QMat& q, const float* x, int64_t M, float* y, int64_t ldy, int64_t n0, int64_t n1) {
  std::vector<float> w(q.K);
  for (int64_t n = n0; n < n1; n++) {
    dequant_scalar(q, w.data(), n, n + 1);
    for (int64_t m = 0; m < M; m++) {
      const float* xm = x + m * q.K;
      float acc = 0.0f;
      for (int64_t k = 0; k < q.K; k++) acc += w[k] * xm[k];
      y[m * ldy + n] = acc;
    }
  }
}

void attend_scalar(const AttnRow& a, float* p, float* y) {
  float m = -INFINITY;
  for (int64_t t = 0; t < a.T; t++) {
    if (a.hidden(t)) {
      p[t] = -INFINITY;
      continue;
    }
    const float* kr = a.k + t * a.ks;
    float acc = 0.0f;
    for (int64_t d = 0; d < a.D; d++) acc += a.q[d] * a.scale * kr[d];
    p[t] = acc;
    m = std::max(m, acc);
  }
  float sum = 0.0f;
  for (int64_t t = 0; t < a.T; t++) {
    p[t] = p[t] == -INFINITY ? 0.0f : std::exp(p[t] - m);
    sum += p[t];
  }
  for (int64_t d = 0; d < a.Dv; d++) y[d] = 0.0f;
  for (int64_t t = 0; t < a.T; t++) {
    if (p[t] == 0.0f) continue;  // masked (or underflowed): adds exact zeros
    const float* vr = a.v + t * a.vs;
    for (int64_t d = 0; d < a.Dv; d++) y[d] += p[t] * vr[d];
  }
  const float inv = 1.0f / sum;
  for (int64_t d = 0; d < a.Dv; d++) y[d] *= inv;
}

void rms_norm_scalar(const float* x, int64_t xs, const float* w, float* y, int64_t rows, int64_t D, float eps) {
  for (int64_t r = 0; r < rows; r++) {
    const float* xr = x + r * xs;
    float ss = 0.0f;
    for (int64_t d = 0; d < D; d++) ss += xr[d] * xr[d];
    const float inv = 1.0f / std::sqrt(ss / (float)D + eps);
    for (int64_t d = 0; d < D; d++) y[r * D + d] = xr[d] * inv * (w ? w[d] : 1.0f);
  }
}

void silu_mul_scalar(const float* g, int64_t gs, const float* u, int64_t us, float* y, int64_t rows, int64_t n) {
  for (int64_t r = 0; r < rows; r++) {
    for (int64_t i = 0; i < n; i++) {
      const float a = g[r * gs + i];
      y[r * n + i] = a / (1.0f + std::exp(-a)) * u[r * us + i];
    }
  }
}

void gelu_tanh_mul_scalar(const float* g, int64_t gs, const float* u, int64_t us, float* y, int64_t rows, int64_t n) {
  for (int64_t r = 0; r < rows; r++) {
    for (int64_t i = 0; i < n; i++) {
      const float a = g[r * gs + i];
      const float z = 0.7978845608028654f * (a + 0.044715f * a * a * a);
      y[r * n + i] = a / (1.0f + std::exp(-2.0f * z)) * u[r * us + i];  // 0.5 (1 + tanh z) = sigmoid(2 z)
    }
  }
}

void kv_row_scalar(const uint8_t* w, const void* scales, const void* biases, int scale_type, int64_t D, int group,
                   int bits, bool rotate, float* out) {
  for (int64_t g = 0; g < D / group; g++) {
    const float s = load_scale(scales, scale_type, g);
    const float b = biases ? load_scale(biases, scale_type, g) : -(float)(1 << (bits - 1)) * s;
    for (int j = 0; j < group; j++) out[g * group + j] = (float)value_at(w, g * group + j, bits) * s + b;
  }
  if (!rotate) return;
  for (int64_t h = 1; h < D; h <<= 1) {
    for (int64_t i = 0; i < D; i += 2 * h) {
      for (int64_t j = i; j < i + h; j++) {
        const float a = out[j], c = out[j + h];
        out[j] = a + c;
        out[j + h] = a - c;
      }
    }
  }
  const float norm = 1.0f / std::sqrt((float)D);
  for (int64_t i = 0; i < D; i++) out[i] *= norm;
}

ArgMax argmax_scalar(const float* x, int64_t n) {
  ArgMax best{-INFINITY, -1};
  for (int64_t i = 0; i < n; i++)
    if (argmax_takes(x[i], best.value)) best = {x[i], i};
  return best;
}

}  // namespace tsq
