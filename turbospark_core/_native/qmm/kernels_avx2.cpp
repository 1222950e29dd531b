// AVX2/FMA kernels; this file alone is compiled with -mavx2 -mfma -mf16c and
// only called after a run-time check (__builtin_cpu_supports).
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "kernels.h"

namespace tsq {
namespace {

inline float scale_at(const void* p, int type, int64_t i);
// The bias of group i (see QMat: symmetric matrices store none).
inline float bias_at(const QMat& q, int64_t i) {
  return q.biases ? scale_at(q.biases, q.scale_type, i) : symmetric_bias(q, scale_at(q.scales, q.scale_type, i));
}
inline float scale_at(const void* p, int type, int64_t i) {
  if (type == kF32) return static_cast<const float*>(p)[i];
  if (type == kE8M0) return e8m0_to_float(static_cast<const uint8_t*>(p)[i]);
  uint16_t h = static_cast<const uint16_t*>(p)[i];
  if (type == kF16) return _cvtsh_ss(h);
  uint32_t bits = (uint32_t)h << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// Scales (or biases) [first, first + n) as float32 into out.
inline void to_float(const void* p, int type, int64_t first, int64_t n, float* out) {
  int64_t i = 0;
  if (type == kF16) {
    const uint16_t* h = static_cast<const uint16_t*>(p) + first;
    for (; i + 8 <= n; i += 8)
      _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h + i))));
  } else if (type == kF32) {
    std::memcpy(out, static_cast<const float*>(p) + first, sizeof(float) * n);
    return;
  }
  for (; i < n; i++) out[i] = scale_at(p, type, first + i);
}

// Row n's group scales and biases as float32, into sf and bf (groups each). Taken before a row's
// vector loops, never inside them: scale_at may call out of line (e8m0_to_float), and such a call
// inside made the compiler keep the accumulators on the stack across it (half the speed, measured).
inline void row_scales(const QMat& q, int64_t n, float* sf, float* bf) {
  const int64_t groups = q.K / q.group;
  to_float(q.scales, q.scale_type, n * groups, groups, sf);
  if (q.fp4) {
    std::fill(bf, bf + groups, 0.0f);  // e2m1 values times the scale, no bias
  } else if (q.biases != nullptr) {
    to_float(q.biases, q.scale_type, n * groups, groups, bf);
  } else {
    for (int64_t g = 0; g < groups; g++) bf[g] = symmetric_bias(q, sf[g]);
  }
}

// Per-thread room for one row's scales and biases (2 * groups floats).
inline float* scale_room(int64_t groups) {
  thread_local std::vector<float> room;
  if ((int64_t)room.size() < 2 * groups) room.resize(2 * groups);
  return room.data();
}

// Eight 4-bit codes from 4 bytes at p (value 2t in the low nibble) in the low 4 bits of 32-bit
// lanes (higher bits: the following codes).
inline __m256i nibbles8(const uint8_t* p) {
  uint32_t w;
  std::memcpy(&w, p, 4);
  return _mm256_srlv_epi32(_mm256_set1_epi32((int)w), _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28));
}

// Eight consecutive values starting at p (BITS bytes hold exactly eight); end
// is the end of the weight buffer (no load may pass it).
template <int BITS>
inline __m256 unpack8(const uint8_t* p, const uint8_t* end) {
  __m256i v;
  if constexpr (BITS == 8) {
    v = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  } else if constexpr (BITS == 4) {
    v = _mm256_and_si256(nibbles8(p), _mm256_set1_epi32(0xf));
  } else {
    // value i takes the 4 bytes from byte BITS * i / 8 and shifts them by BITS * i % 8: one 16-byte
    // load (both lanes), a byte shuffle, a variable shift and a mask (the last bytes of the buffer
    // through a copy, so no load passes its end)
    const __m256i shuf = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(Spread<BITS, 8>::shuf.data()));
    const __m256i shift = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(Spread<BITS, 8>::shift.data()));
    __m128i raw;
    if (p + 16 <= end) [[likely]] {
      raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    } else {
      alignas(16) uint8_t tail[16] = {};
      std::memcpy(tail, p, (size_t)BITS);  // eight values are BITS bytes
      raw = _mm_load_si128(reinterpret_cast<const __m128i*>(tail));
    }
    const __m256i spread = _mm256_shuffle_epi8(_mm256_broadcastsi128_si256(raw), shuf);
    v = _mm256_and_si256(_mm256_srlv_epi32(spread, shift), _mm256_set1_epi32((1 << BITS) - 1));
  }
  return _mm256_cvtepi32_ps(v);
}

// Eight mxfp4 values (e2m1 codes, 4 bytes, value 2t in the low nibble) as floats: the magnitude
// from an eight-entry table by the code's low 3 bits, the sign from its bit 3 (kFp4's order).
inline __m256 unpack8_fp4(const uint8_t* p) {
  const __m256i codes = nibbles8(p);
  const __m256 mag = _mm256_permutevar8x32_ps(_mm256_setr_ps(0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f), codes);
  const __m256i sign = _mm256_and_si256(_mm256_slli_epi32(codes, 28), _mm256_set1_epi32(INT32_MIN));
  return _mm256_xor_ps(mag, _mm256_castsi256_ps(sign));
}

template <int BITS, bool FP4>
inline __m256 values8(const uint8_t* p, const uint8_t* end) {
  if constexpr (FP4) {
    return unpack8_fp4(p);
  } else {
    return unpack8<BITS>(p, end);
  }
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

constexpr int64_t MAXC = 64;  // head sizes up to 512 in registers' worth of chunks

inline __m256i tail8(int64_t i, int64_t n) {
  const int64_t k = std::min<int64_t>(8, n - i);
  return _mm256_cmpgt_epi32(_mm256_set1_epi32((int)k), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
inline __m256 load8(const float* p, int64_t i, int64_t n) {
  return n - i >= 8 ? _mm256_loadu_ps(p + i) : _mm256_maskload_ps(p + i, tail8(i, n));
}
inline void store8(float* p, int64_t i, int64_t n, __m256 v) {
  if (n - i >= 8) {
    _mm256_storeu_ps(p + i, v);
  } else {
    _mm256_maskstore_ps(p + i, tail8(i, n), v);
  }
}

// e^x (Cephes' expf polynomial, within ~1 ulp; inputs clamped to +-88.3)
inline __m256 exp_ps(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-88.3762626647949f)), _mm256_set1_ps(88.3762626647949f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500E-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507E-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073E-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894E-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459E-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201E-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  // times 2^n: n (in [-128, 128]) added to the exponent in two halves so that 2^n never overflows
  const __m256i ni = _mm256_cvtps_epi32(n);
  const __m256i half = _mm256_srai_epi32(ni, 1);
  const __m256 a = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(half, _mm256_set1_epi32(127)), 23));
  const __m256 b = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_sub_epi32(ni, half), _mm256_set1_epi32(127)), 23));
  return _mm256_mul_ps(_mm256_mul_ps(p, a), b);
}

// y[m0..m0+MT, n] = sum_g scale_g * (q_g . x_g) + bias_g * sum(x_g): per group the integer values
// times x in two chains (alternate eights), then scaled once; one long chain of dependent FMAs
// along the row (as a multiply by the scale per eight values then an FMA had it) ran at a quarter
// of the FMA units' rate.
template <int BITS, int MT, bool FP4 = false>
void row_tile(const QMat& q, const float* x, const float* xsum, const float* sf, const float* bf, int64_t m0, float* y,
              int64_t ldy, int64_t n) {
  // the matrix's sizes as locals, the weights as a pointer that moves along the row (the compiler
  // reloaded q's fields and redid the divisions in the loop)
  const int64_t K = q.K, group = q.group, groups = K / group, row_bytes = K * BITS / 8;
  const uint8_t* wp = q.w + n * row_bytes;
  const uint8_t* end = q.w + q.N * row_bytes;
  const float* xm = x + m0 * K;
  __m256 acc[MT];
  float bsum[MT];
  for (int t = 0; t < MT; t++) {
    acc[t] = _mm256_setzero_ps();
    bsum[t] = 0.0f;
  }
  for (int64_t g = 0; g < groups; g++) {
    const float* xg = xm + g * group;
    __m256 ga[MT], gb[MT];
    for (int t = 0; t < MT; t++) ga[t] = gb[t] = _mm256_setzero_ps();
    int64_t j = 0;
    for (; j + 16 <= group; j += 16, wp += 2 * BITS) {
      const __m256 lo = values8<BITS, FP4>(wp, end), hi = values8<BITS, FP4>(wp + BITS, end);
      for (int t = 0; t < MT; t++) {
        ga[t] = _mm256_fmadd_ps(lo, _mm256_loadu_ps(xg + t * K + j), ga[t]);
        gb[t] = _mm256_fmadd_ps(hi, _mm256_loadu_ps(xg + t * K + j + 8), gb[t]);
      }
    }
    if (j < group) {  // groups of 8 (or 16k + 8): the last eight
      const __m256 lo = values8<BITS, FP4>(wp, end);
      wp += BITS;
      for (int t = 0; t < MT; t++) ga[t] = _mm256_fmadd_ps(lo, _mm256_loadu_ps(xg + t * K + j), ga[t]);
    }
    const __m256 s = _mm256_set1_ps(sf[g]);
    for (int t = 0; t < MT; t++) {
      acc[t] = _mm256_fmadd_ps(_mm256_add_ps(ga[t], gb[t]), s, acc[t]);
      bsum[t] += bf[g] * xsum[(m0 + t) * groups + g];
    }
  }
  for (int t = 0; t < MT; t++) y[(m0 + t) * ldy + n] = hsum(acc[t]) + bsum[t];
}

// Values j..j+15 of a group as two vectors of eight. 4-bit: each byte holds
// values 2t (low nibble) and 2t+1 (high nibble), so the first vector is the
// even values and the second the odd ones (x is permuted to match, see
// permute16); 8-bit: values j..j+7 and j+8..j+15 in order.
template <int BITS>
inline void unpack16(const uint8_t* p, __m256& lo, __m256& hi) {
  if constexpr (BITS == 4) {
    const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    lo = _mm256_cvtepi32_ps(_mm256_and_si256(b, _mm256_set1_epi32(0xf)));
    hi = _mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4));
  } else {
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    lo = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(b));
    hi = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(b, 8)));
  }
}

// Rows m0..m0+MT of x as the kernels read them: 4-bit splits each 16 values
// into evens then odds (the nibble order of unpack16); xsum holds per-group sums.
inline void prepare_rows(const float* x, int64_t M, int64_t K, int64_t group, int bits, float* xp, float* xsum) {
  const int64_t groups = K / group;
  for (int64_t m = 0; m < M; m++) {
    const float* xr = x + m * K;
    float* out = xp + m * K;
    if (bits == 4) {
      for (int64_t j = 0; j < K; j += 16) {
        for (int i = 0; i < 8; i++) {
          out[j + i] = xr[j + 2 * i];
          out[j + 8 + i] = xr[j + 2 * i + 1];
        }
      }
    } else {
      std::memcpy(out, xr, sizeof(float) * K);
    }
    for (int64_t g = 0; g < groups; g++) {
      __m256 a = _mm256_setzero_ps();
      for (int64_t j = 0; j < group; j += 8) a = _mm256_add_ps(a, _mm256_loadu_ps(xr + g * group + j));
      xsum[m * groups + g] = hsum(a);
    }
  }
}

// y[m0..m0+MT, n] for 4- or 8-bit weights, groups a multiple of 16: per group
// the integer values are multiplied with x first and scaled once (one FMA per
// value and row), and each weight vector is unpacked once for all MT rows.
template <int BITS, int MT>
void small_tile(const QMat& q, const float* xp, const float* xsum, int64_t m0, float* y, int64_t ldy, int64_t n0,
                int64_t n1) {
  const int64_t groups = q.K / q.group, row_bytes = q.K * BITS / 8;
  float* sf = scale_room(groups);
  float* bf = sf + groups;
  for (int64_t n = n0; n < n1; n++) {
    const uint8_t* row = q.w + n * row_bytes;
    row_scales(q, n, sf, bf);
    __m256 acc[MT];
    float bsum[MT];
    for (int t = 0; t < MT; t++) {
      acc[t] = _mm256_setzero_ps();
      bsum[t] = 0.0f;
    }
    for (int64_t g = 0; g < groups; g++) {
      const int64_t k0 = g * q.group;
      __m256 ga[MT], gb[MT];
      for (int t = 0; t < MT; t++) {
        ga[t] = _mm256_setzero_ps();
        gb[t] = _mm256_setzero_ps();
      }
      for (int j = 0; j < q.group; j += 16) {
        __m256 lo, hi;
        unpack16<BITS>(row + (k0 + j) * BITS / 8, lo, hi);
        for (int t = 0; t < MT; t++) {
          const float* xr = xp + (m0 + t) * q.K + k0 + j;
          ga[t] = _mm256_fmadd_ps(lo, _mm256_loadu_ps(xr), ga[t]);
          gb[t] = _mm256_fmadd_ps(hi, _mm256_loadu_ps(xr + 8), gb[t]);
        }
      }
      const __m256 s = _mm256_set1_ps(sf[g]);
      const float b = bf[g];
      for (int t = 0; t < MT; t++) {
        acc[t] = _mm256_fmadd_ps(_mm256_add_ps(ga[t], gb[t]), s, acc[t]);
        bsum[t] += b * xsum[(m0 + t) * groups + g];
      }
    }
    for (int t = 0; t < MT; t++) y[(m0 + t) * ldy + n] = hsum(acc[t]) + bsum[t];
  }
}

template <int BITS>
void small_rows(const QMat& q, const float* x, int64_t M, float* y, int64_t ldy, int64_t n0, int64_t n1) {
  const int64_t groups = q.K / q.group;
  std::vector<float> xp(M * q.K), xsum(M * groups);
  prepare_rows(x, M, q.K, q.group, BITS, xp.data(), xsum.data());
  // weight rows in blocks that stay in L1 while every 4-row tile of x passes over them
  const int64_t block = std::max<int64_t>(1, (16 << 10) / std::max<int64_t>(1, q.K * BITS / 8));
  for (int64_t b0 = n0; b0 < n1; b0 += block) {
    const int64_t b1 = std::min(n1, b0 + block);
    int64_t m = 0;
    for (; m + 4 <= M; m += 4) small_tile<BITS, 4>(q, xp.data(), xsum.data(), m, y, ldy, b0, b1);
    if (M - m >= 2) {
      small_tile<BITS, 2>(q, xp.data(), xsum.data(), m, y, ldy, b0, b1);
      m += 2;
    }
    if (M - m >= 1) small_tile<BITS, 1>(q, xp.data(), xsum.data(), m, y, ldy, b0, b1);
  }
}

// 4-bit, one activation row: each byte holds values 2t (low nibble) and 2t+1
// (high nibble), so x is split into even/odd halves per 16 values once, and
// the weights need one widening load, a mask and a shift per 16 values.
void gemv4(const QMat& q, const float* x, float* y, int64_t n0, int64_t n1) {
  const int64_t groups = q.K / q.group, row_bytes = q.K / 2;
  std::vector<float> xp(q.K), xsum(groups);
  for (int64_t j = 0; j < q.K; j += 16) {
    for (int i = 0; i < 8; i++) {
      xp[j + i] = x[j + 2 * i];
      xp[j + 8 + i] = x[j + 2 * i + 1];
    }
  }
  for (int64_t g = 0; g < groups; g++) {  // as prepare_rows sums them (a batched row gets the same result)
    __m256 a = _mm256_setzero_ps();
    for (int64_t j = 0; j < q.group; j += 8) a = _mm256_add_ps(a, _mm256_loadu_ps(x + g * q.group + j));
    xsum[g] = hsum(a);
  }
  const __m256i low = _mm256_set1_epi32(0xf);
  float* sf = scale_room(groups);
  float* bf = sf + groups;
  for (int64_t n = n0; n < n1; n++) {
    const uint8_t* row = q.w + n * row_bytes;
    row_scales(q, n, sf, bf);
    __m256 acc = _mm256_setzero_ps();
    float bsum = 0.0f;
    for (int64_t g = 0; g < groups; g++) {
      const int64_t k0 = g * q.group;
      __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
      for (int j = 0; j < q.group; j += 16) {
        const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + (k0 + j) / 2)));
        a0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(b, low)), _mm256_loadu_ps(xp.data() + k0 + j), a0);
        a1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4)), _mm256_loadu_ps(xp.data() + k0 + j + 8), a1);
      }
      acc = _mm256_fmadd_ps(_mm256_add_ps(a0, a1), _mm256_set1_ps(sf[g]), acc);
      bsum += bf[g] * xsum[g];
    }
    y[n] = hsum(acc) + bsum;
  }
}

// Rows [n0, n1) by row_tile: tiles of 4, 2 and 1 rows of x over each weight row.
template <int BITS, bool FP4 = false>
void tile_rows(const QMat& q, const float* x, int64_t M, float* y, int64_t ldy, int64_t n0, int64_t n1) {
  const int64_t groups = q.K / q.group;
  std::vector<float> xsum(M * groups);
  for (int64_t m = 0; m < M; m++) {
    for (int64_t g = 0; g < groups; g++) {
      const float* p = x + m * q.K + g * q.group;
      __m256 a = _mm256_setzero_ps();
      for (int j = 0; j < q.group; j += 8) a = _mm256_add_ps(a, _mm256_loadu_ps(p + j));
      xsum[m * groups + g] = hsum(a);
    }
  }
  float* sf = scale_room(groups);
  float* bf = sf + groups;
  for (int64_t n = n0; n < n1; n++) {
    row_scales(q, n, sf, bf);
    int64_t m = 0;
    for (; m + 4 <= M; m += 4) row_tile<BITS, 4, FP4>(q, x, xsum.data(), sf, bf, m, y, ldy, n);
    if (M - m >= 2) {
      row_tile<BITS, 2, FP4>(q, x, xsum.data(), sf, bf, m, y, ldy, n);
      m += 2;
    }
    if (M - m >= 1) row_tile<BITS, 1, FP4>(q, x, xsum.data(), sf, bf, m, y, ldy, n);
  }
}

template <int BITS>
void rows_bits(const QMat& q, const float* x, int64_t M, float* y, int64_t ldy, int64_t n0, int64_t n1) {
  if constexpr (BITS == 4) {
    if (q.fp4) return tile_rows<4, true>(q, x, M, y, ldy, n0, n1);
    if (M == 1 && q.group % 16 == 0) return gemv4(q, x, y, n0, n1);
  }
  if constexpr (BITS == 4 || BITS == 8) {
    if (q.group % 16 == 0) return small_rows<BITS>(q, x, M, y, ldy, n0, n1);
  }
  tile_rows<BITS>(q, x, M, y, ldy, n0, n1);
}

template <int BITS>
void dequant_bits(const QMat& q, float* dst, int64_t n0, int64_t n1) {
  const int64_t groups = q.K / q.group, row_bytes = q.K * BITS / 8;
  const uint8_t* end = q.w + q.N * row_bytes;
  for (int64_t n = n0; n < n1; n++) {
    const uint8_t* row = q.w + n * row_bytes;
    float* out = dst + (n - n0) * q.K;
    for (int64_t g = 0; g < groups; g++) {
      const __m256 s = _mm256_set1_ps(scale_at(q.scales, q.scale_type, n * groups + g));
      const __m256 b = _mm256_set1_ps(bias_at(q, n * groups + g));
      const int64_t k0 = g * q.group;
      for (int j = 0; j < q.group; j += 8)
        _mm256_storeu_ps(out + k0 + j, _mm256_fmadd_ps(unpack8<BITS>(row + (k0 + j) * BITS / 8, end), s, b));
    }
  }
}

}  // namespace

void rows_avx2(const QMat& q, const float* x, int64_t M, float* y, int64_t ldy, int64_t n0, int64_t n1) {
  if (q.fp4) return rows_bits<4>(q, x, M, y, ldy, n0, n1);  // mxfp4: e2m1 codes, 4 bits each
  switch (q.bits) {
    case 2: return rows_bits<2>(q, x, M, y, ldy, n0, n1);
    case 3: return rows_bits<3>(q, x, M, y, ldy, n0, n1);
    case 4: return rows_bits<4>(q, x, M, y, ldy, n0, n1);
    case 5: return rows_bits<5>(q, x, M, y, ldy, n0, n1);
    case 6: return rows_bits<6>(q, x, M, y, ldy, n0, n1);
    default: return rows_bits<8>(q, x, M, y, ldy, n0, n1);
  }
}

void dequant_avx2(const QMat& q, float* dst, int64_t n0, int64_t n1) {
  if (q.fp4) return dequant_scalar(q, dst, n0, n1);
  switch (q.bits) {
    case 2: return dequant_bits<2>(q, dst, n0, n1);
    case 3: return dequant_bits<3>(q, dst, n0, n1);
    case 4: return dequant_bits<4>(q, dst, n0, n1);
    case 5: return dequant_bits<5>(q, dst, n0, n1);
    case 6: return dequant_bits<6>(q, dst, n0, n1);
    default: return dequant_bits<8>(q, dst, n0, n1);
  }
}

// ------------------------------------------------------------ attention (one query)
void attend_avx2(const AttnRow& a, float* p, float* y) {
  const int64_t D = a.D, Dv = a.Dv;
  // the query, scaled, in registers' worth of chunks (masked tail)
  __m256 qv[MAXC];
  const int64_t qc = (D + 8 - 1) / 8;
  if (qc > MAXC) return attend_scalar(a, p, y);
  for (int64_t c = 0; c < qc; c++) qv[c] = _mm256_mul_ps(load8(a.q, c * 8, D), _mm256_set1_ps(a.scale));
  float m = -INFINITY;
  for (int64_t t = 0; t < a.T; t++) {
    if (a.hidden(t)) {
      p[t] = -INFINITY;
      continue;
    }
    const float* kr = a.k + t * a.ks;
    __m256 acc = _mm256_setzero_ps();
    for (int64_t c = 0; c < qc; c++) acc = _mm256_fmadd_ps(qv[c], load8(kr, c * 8, D), acc);
    const float s = hsum(acc);
    p[t] = s;
    m = std::max(m, s);
  }
  float sum = 0.0f;
  for (int64_t t = 0; t < a.T; t++) {
    p[t] = p[t] == -INFINITY ? 0.0f : std::exp(p[t] - m);
    sum += p[t];
  }
  const int64_t vc = (Dv + 8 - 1) / 8;
  if (vc > MAXC) return attend_scalar(a, p, y);
  __m256 yv[MAXC];
  for (int64_t c = 0; c < vc; c++) yv[c] = _mm256_setzero_ps();
  for (int64_t t = 0; t < a.T; t++) {
    if (p[t] == 0.0f) continue;  // masked (or underflowed): adds exact zeros
    const float* vr = a.v + t * a.vs;
    const __m256 w = _mm256_set1_ps(p[t]);
    for (int64_t c = 0; c < vc; c++) yv[c] = _mm256_fmadd_ps(w, load8(vr, c * 8, Dv), yv[c]);
  }
  const __m256 inv = _mm256_set1_ps(1.0f / sum);
  for (int64_t c = 0; c < vc; c++) store8(y, c * 8, Dv, _mm256_mul_ps(yv[c], inv));
}

// ------------------------------------------------------------ rms norm, silu * up
void rms_norm_avx2(const float* x, int64_t xs, const float* w, float* y, int64_t rows, int64_t D, float eps) {
  for (int64_t r = 0; r < rows; r++) {
    const float* xr = x + r * xs;
    __m256 acc = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; d += 8) {
      const __m256 v = load8(xr, d, D);
      acc = _mm256_fmadd_ps(v, v, acc);
    }
    const __m256 inv = _mm256_set1_ps(1.0f / std::sqrt(hsum(acc) / (float)D + eps));
    for (int64_t d = 0; d < D; d += 8) {
      const __m256 v = _mm256_mul_ps(load8(xr, d, D), inv);
      store8(y + r * D, d, D, w ? _mm256_mul_ps(v, load8(w, d, D)) : v);
    }
  }
}

void silu_mul_avx2(const float* g, int64_t gs, const float* u, int64_t us, float* y, int64_t rows, int64_t n) {
  const __m256 one = _mm256_set1_ps(1.0f);
  for (int64_t r = 0; r < rows; r++) {
    for (int64_t i = 0; i < n; i += 8) {
      const __m256 a = load8(g + r * gs, i, n);
      const __m256 e = exp_ps(_mm256_sub_ps(_mm256_setzero_ps(), a));
      store8(y + r * n, i, n, _mm256_mul_ps(_mm256_div_ps(a, _mm256_add_ps(one, e)), load8(u + r * us, i, n)));
    }
  }
}

void gelu_tanh_mul_avx2(const float* g, int64_t gs, const float* u, int64_t us, float* y, int64_t rows, int64_t n) {
  const __m256 one = _mm256_set1_ps(1.0f), two = _mm256_set1_ps(2.0f);
  const __m256 c = _mm256_set1_ps(0.7978845608028654f), k = _mm256_set1_ps(0.044715f);
  for (int64_t r = 0; r < rows; r++) {
    for (int64_t i = 0; i < n; i += 8) {
      const __m256 a = load8(g + r * gs, i, n);
      const __m256 z = _mm256_mul_ps(c, _mm256_fmadd_ps(_mm256_mul_ps(k, a), _mm256_mul_ps(a, a), a));
      // 0.5 (1 + tanh(z)) = sigmoid(2 z): no cancellation for either sign of z
      const __m256 t = _mm256_div_ps(one, _mm256_add_ps(one, exp_ps(_mm256_mul_ps(two, _mm256_sub_ps(_mm256_setzero_ps(), z)))));
      store8(y + r * n, i, n, _mm256_mul_ps(_mm256_mul_ps(a, t), load8(u + r * us, i, n)));
    }
  }
}

}  // namespace tsq
