// The native kernel sets against exact references and the portable (scalar) kernels, without
// MLX: built natively (x86-64: the AVX2 and AVX-512 sets, as far as the CPU has them) or
// cross-compiled for aarch64 and run under user-mode emulation (the NEON set). run.sh builds
// and runs it; see README.md here.
//
// For each set and kernel:
// - every result is within float32 rounding of an exact (double) reference, and so is the
//   scalar kernel's (the tolerances scale with the sum of the magnitudes of the terms; the
//   report gives the largest error as a fraction of its tolerance, for the set and for scalar);
// - quantized rows (affine and mxfp4): a row of x gets the same bits in every tile (1..17 rows of x), in any
//   chunk of weight rows, and a symmetric matrix without biases the same bits as with its
//   derived biases stored; the GEMM likewise for 17+ rows;
// - attention: a query's result does not depend on hidden keys inserted among its keys.
// Every input buffer ends at an unreadable page, so a kernel that reads past one crashes.
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "kernels.h"
#include "pool.h"

using namespace tsq;

namespace {

struct Set {
  const char* name;
  RowsFn rows;
  RowsFn gemm;  // nullptr: the set has none (its products from many rows go through sgemm)
  DequantFn dequant;
  AttendFn attend;
  AttendManyFn attend_many;
  RmsNormFn rms_norm;
  GatedFn silu_mul, gelu_tanh_mul;
  KVRowFn kv_row;
  AttendScoresFn attend_scores = nullptr;  // nullptr: no split attention
  AttendValuesFn attend_values = nullptr;
};

// The sets qmm.cpp chooses from on this CPU (the same entries as its tables).
std::vector<Set> kernel_sets() {
  std::vector<Set> sets;
#if defined(__aarch64__)
  sets.push_back({"neon", rows_neon, gemm_neon, dequant_neon, attend_neon, attend_each<attend_neon>, rms_norm_neon, silu_mul_neon,
                  gelu_tanh_mul_neon, kv_row_neon});
#elif defined(__x86_64__)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c")) {
    sets.push_back({"avx2", rows_avx2, nullptr, dequant_avx2, attend_avx2, attend_each<attend_avx2>, rms_norm_avx2, silu_mul_avx2,
                    gelu_tanh_mul_avx2, kv_row_scalar});
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq"))
      sets.push_back({"avx512", rows_avx512, gemm_avx512, dequant_avx512, attend_avx512, attend_many_avx512, rms_norm_avx512,
                      silu_mul_avx512, gelu_tanh_mul_avx512, kv_row_avx512, attend_scores_avx512, attend_values_avx512});
  }
#endif
  return sets;
}

// n elements that end exactly at a page no one may read (reads past them fault).
template <class T>
class Guarded {
 public:
  explicit Guarded(size_t n) : n_(n) {
    const size_t page = (size_t)sysconf(_SC_PAGESIZE);
    const size_t bytes = n * sizeof(T);
    span_ = (bytes + page - 1) / page * page + page;
    void* p = mmap(nullptr, span_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) std::abort();
    base_ = static_cast<uint8_t*>(p);
    mprotect(base_ + span_ - page, page, PROT_NONE);
    // at the end of the readable part, aligned for T (the kernels take any alignment of T)
    data_ = reinterpret_cast<T*>(base_ + (span_ - page - bytes) / alignof(T) * alignof(T));
  }
  ~Guarded() { munmap(base_, span_); }
  Guarded(const Guarded&) = delete;
  Guarded& operator=(const Guarded&) = delete;
  T* data() { return data_; }
  const T* data() const { return data_; }
  T& operator[](size_t i) { return data_[i]; }
  const T& operator[](size_t i) const { return data_[i]; }
  size_t size() const { return n_; }

 private:
  size_t n_, span_;
  uint8_t* base_;
  T* data_;
};

std::mt19937_64 rng(20261201);
float uniform(float lo, float hi) { return std::uniform_real_distribution<float>(lo, hi)(rng); }
int64_t pick(int64_t lo, int64_t hi) { return std::uniform_int_distribution<int64_t>(lo, hi)(rng); }

constexpr double U = 1.0 / (1 << 24);  // float32's unit roundoff

// ------------------------------------------------------------ results
struct Tally {
  long checks = 0, failures = 0;
  double worst = 0.0, worst_scalar = 0.0;  // largest error / tolerance seen
};
struct Report {
  std::deque<std::pair<std::string, Tally>> rows;  // references stay valid as rows are added
  Tally& at(const std::string& name) {
    for (auto& r : rows)
      if (r.first == name) return r.second;
    rows.push_back({name, Tally{}});
    return rows.back().second;
  }
  long failures() const {
    long f = 0;
    for (auto& r : rows) f += r.second.failures;
    return f;
  }
};
Report report;

void fail(Tally& t, const std::string& what) {
  t.failures++;
  if (t.failures <= 5) std::printf("FAIL %s\n", what.c_str());
}

// got (and the scalar kernel's value) against the exact value within tol
void near(Tally& t, const std::string& ctx, double got, double scalar, double exact, double tol) {
  t.checks++;
  const double e = std::fabs(got - exact) / tol, es = std::fabs(scalar - exact) / tol;
  t.worst = std::max(t.worst, e);
  t.worst_scalar = std::max(t.worst_scalar, es);
  if (!(e <= 1.0) || !(es <= 1.0)) {
    char buf[256];
    std::snprintf(buf, sizeof buf, ": got %.9g scalar %.9g exact %.9g tol %.3g", got, scalar, exact, tol);
    fail(t, ctx + buf);
  }
}

void same_bits(Tally& t, const std::string& ctx, const float* a, const float* b, size_t n) {
  t.checks++;
  if (std::memcmp(a, b, n * sizeof(float)) != 0) {
    size_t i = 0;
    while (i < n && std::memcmp(a + i, b + i, sizeof(float)) == 0) i++;
    char buf[160];
    std::snprintf(buf, sizeof buf, ": element %zu is %.9g, not %.9g", i, a[i], b[i]);
    fail(t, ctx + buf);
  }
}

std::string fmt(const char* f, ...) __attribute__((format(printf, 1, 2)));
std::string fmt(const char* f, ...) {
  char buf[256];
  va_list ap;
  va_start(ap, f);
  std::vsnprintf(buf, sizeof buf, f, ap);
  va_end(ap);
  return buf;
}

// ------------------------------------------------------------ quantized matrices
// A stored scale or bias of the given type near v (f16: some subnormal when v is tiny).
void store_scale(void* p, int type, int64_t i, float v) {
  if (type == kE8M0) {  // the nearest power of two at or below |v| (mxfp4 scales)
    static_cast<uint8_t*>(p)[i] = (uint8_t)std::clamp(127 + (int)std::floor(std::log2(std::fabs(v))), 0, 254);
    return;
  }
  if (type == kF32) {
    static_cast<float*>(p)[i] = v;
    return;
  }
  uint16_t h;
  if (type == kBF16) {
    uint32_t bits;
    std::memcpy(&bits, &v, 4);
    h = (uint16_t)(bits >> 16);
  } else {  // f16 by search: the nearest value below (exact enough for test data)
    h = 0;
    const uint16_t sign = v < 0 ? 0x8000 : 0;
    const float a = std::fabs(v);
    uint16_t lo = 0, hi = 0x7bff;
    while (lo < hi) {
      const uint16_t mid = (uint16_t)((lo + hi + 1) / 2);
      if (half_to_float(mid) <= a) lo = mid; else hi = (uint16_t)(mid - 1);
    }
    h = (uint16_t)(lo | sign);
  }
  static_cast<uint16_t*>(p)[i] = h;
}

constexpr int scale_bytes(int type) { return type == kF32 ? 4 : type == kE8M0 ? 1 : 2; }

// A quantized matrix: affine (scale and bias per group; a symmetric one's biases derived) or, with
// scale type kE8M0, mxfp4 (e2m1 codes times power-of-two scales, groups of 32, no biases).
struct Matrix {
  int64_t N, K;
  int group, bits, scale_type;
  bool symmetric, fp4;
  Guarded<uint8_t> w;
  Guarded<uint8_t> scales, biases;  // biases: stored even for a symmetric matrix (the derived values)
  std::vector<uint32_t> codes;

  Matrix(int64_t n, int64_t k, int g, int b, int st, bool sym)
      : N(n), K(k), group(g), bits(b), scale_type(st), symmetric(sym), fp4(st == kE8M0), w((size_t)(n * k * b / 8)),
        scales((size_t)(n * (k / g) * scale_bytes(st))), biases((size_t)(n * (k / g) * scale_bytes(st))),
        codes((size_t)(n * k)) {
    std::memset(w.data(), 0, w.size());
    for (int64_t i = 0; i < n * k; i++) {
      codes[i] = (uint32_t)pick(0, (1 << b) - 1);
      const int64_t row = i / k, col = i % k, bit = row * k * b + col * b;  // rows are whole bytes
      for (int j = 0; j < b; j++)
        if (codes[i] >> j & 1) w[(size_t)((bit + j) >> 3)] |= (uint8_t)(1u << ((bit + j) & 7));
    }
    for (int64_t i = 0; i < n * (k / g); i++) {
      if (fp4) {  // 2^-10 .. 2^3, and a few 2^-127 (a subnormal)
        static_cast<uint8_t*>(scales.data())[i] = pick(0, 15) == 0 ? 0 : (uint8_t)pick(117, 130);
        continue;
      }
      // a few tiny scales (f16 subnormals), the rest around what quantized checkpoints hold
      const float s = pick(0, 15) == 0 ? uniform(-2e-6f, 2e-6f) : uniform(-0.05f, 0.05f);
      store_scale(scales.data(), st, i, s);
      const float sv = load_scale(scales.data(), st, i);
      if (sym) {
        store_scale(biases.data(), st, i, -(float)(1 << (b - 1)) * sv);  // exact: a power of two
      } else {
        store_scale(biases.data(), st, i, uniform(-0.5f, 0.5f));
      }
    }
  }
  QMat q(bool with_biases) {
    QMat m{w.data(), scales.data(), with_biases && !fp4 ? biases.data() : nullptr, scale_type, N, K, group, bits};
    m.fp4 = fp4;
    return m;
  }
  double scale(int64_t n, int64_t k) const { return load_scale(scales.data(), scale_type, n * (K / group) + k / group); }
  double bias(int64_t n, int64_t k) const {
    return fp4 ? 0.0 : load_scale(biases.data(), scale_type, n * (K / group) + k / group);
  }
  double value(int64_t n, int64_t k) const { return fp4 ? kFp4[codes[n * K + k]] : codes[n * K + k]; }
  // the exact weight and its magnitude bound |q s| + |b|
  double weight(int64_t n, int64_t k) const { return value(n, k) * scale(n, k) + bias(n, k); }
  double size(int64_t n, int64_t k) const { return std::fabs(value(n, k) * scale(n, k)) + std::fabs(bias(n, k)); }
  std::string name() const {
    static const char* types[] = {"f32", "f16", "bf16", "mxfp4"};
    return fmt("bits %d group %d %s%s N %lld K %lld", bits, group, types[scale_type], symmetric ? " symmetric" : "",
               (long long)N, (long long)K);
  }
};

void random_fill(float* p, size_t n, float lo = -1.0f, float hi = 1.0f) {
  for (size_t i = 0; i < n; i++) p[i] = uniform(lo, hi);
}

// y = x @ w.T for the first M rows: the exact value and its tolerance for each product
struct Exact {
  std::vector<double> value, tol;
};
Exact exact_products(const Matrix& a, const float* x, int64_t M) {
  Exact e;
  e.value.resize(M * a.N);
  e.tol.resize(M * a.N);
  for (int64_t m = 0; m < M; m++) {
    for (int64_t n = 0; n < a.N; n++) {
      double v = 0.0, size = 0.0;
      for (int64_t k = 0; k < a.K; k++) {
        v += a.weight(n, k) * x[m * a.K + k];
        size += a.size(n, k) * std::fabs(x[m * a.K + k]);
      }
      e.value[m * a.N + n] = v;
      // float32 sums of K terms in partial sums of a few lanes, and each weight rounded once
      e.tol[m * a.N + n] = (a.K / 8.0 + 16.0) * U * size + 1e-30;
    }
  }
  return e;
}

void check_rows(const Set& set, Matrix& a) {
  constexpr int64_t MAXM = 17;
  Tally& t = report.at(fmt("%s rows", set.name));
  Tally& bits = report.at(fmt("%s rows: same bits in any tile", set.name));
  const std::string ctx = fmt("%s rows %s", set.name, a.name().c_str());
  Guarded<float> x((size_t)(MAXM * a.K));
  random_fill(x.data(), x.size());
  const Exact e = exact_products(a, x.data(), MAXM);
  const QMat q = a.q(!a.symmetric);
  std::vector<float> scalar(MAXM * a.N), alone(MAXM * a.N), y(MAXM * a.N);
  rows_scalar(a.q(true), x.data(), MAXM, scalar.data(), a.N, 0, a.N);
  for (int64_t m = 0; m < MAXM; m++) set.rows(q, x.data() + m * a.K, 1, alone.data() + m * a.N, a.N, 0, a.N);
  for (int64_t m = 0; m < MAXM * a.N; m++) near(t, ctx, alone[m], scalar[m], e.value[m], e.tol[m]);
  for (int64_t M = 2; M <= MAXM; M++) {
    std::fill(y.begin(), y.end(), NAN);
    set.rows(q, x.data(), M, y.data(), a.N, 0, a.N);
    same_bits(bits, fmt("%s M %lld", ctx.c_str(), (long long)M), y.data(), alone.data(), M * a.N);
  }
  // weight rows in two chunks (as the thread pool splits them), an odd split
  const int64_t split = std::min<int64_t>(a.N, 1 + a.N / 2);
  std::fill(y.begin(), y.end(), NAN);
  set.rows(q, x.data(), MAXM, y.data(), a.N, 0, split);
  set.rows(q, x.data(), MAXM, y.data(), a.N, split, a.N);
  same_bits(bits, ctx + " in two chunks", y.data(), alone.data(), MAXM * a.N);
  if (a.symmetric) {  // the derived biases equal the stored ones, bit for bit
    set.rows(a.q(true), x.data(), MAXM, y.data(), a.N, 0, a.N);
    same_bits(bits, ctx + " with its biases stored", y.data(), alone.data(), MAXM * a.N);
  }
}

void check_dequant(const Set& set, Matrix& a) {
  Tally& t = report.at(fmt("%s dequant", set.name));
  const std::string ctx = fmt("%s dequant %s", set.name, a.name().c_str());
  std::vector<float> got(a.N * a.K), scalar(a.N * a.K);
  const int64_t n0 = a.N / 3;  // a range that starts past row 0
  set.dequant(a.q(!a.symmetric), got.data(), n0, a.N);
  dequant_scalar(a.q(true), scalar.data(), n0, a.N);
  for (int64_t n = n0; n < a.N; n++)
    for (int64_t k = 0; k < a.K; k++) {
      const int64_t i = (n - n0) * a.K + k;
      near(t, ctx, got[i], scalar[i], a.weight(n, k), 2 * U * a.size(n, k) + 1e-40);
    }
#if defined(__x86_64__)
  if (set.dequant == dequant_avx512) {  // the AVX2 kernel's multiply-adds, sixteen at a time: its bits
    std::vector<float> avx2(got.size());
    dequant_avx2(a.q(!a.symmetric), avx2.data(), n0, a.N);
    same_bits(report.at("avx512 dequant: the avx2 kernel's bits"), ctx, got.data(), avx2.data(), got.size());
  }
#endif
}

void check_gemm(const Set& set, Matrix& a) {
  Tally& t = report.at(fmt("%s gemm", set.name));
  Tally& bits = report.at(fmt("%s gemm: same bits in any tile", set.name));
  const std::string ctx = fmt("%s gemm %s", set.name, a.name().c_str());
  constexpr int64_t M = 23;  // tiles of the widest kernel and a tail
  Guarded<float> x((size_t)(M * a.K));
  random_fill(x.data(), x.size());
  const Exact e = exact_products(a, x.data(), M);
  const QMat q = a.q(!a.symmetric);
  std::vector<float> scalar(M * a.N), y(M * a.N, NAN), alone(a.N), part(M * a.N, NAN);
  rows_scalar(a.q(true), x.data(), M, scalar.data(), a.N, 0, a.N);
  set.gemm(q, x.data(), M, y.data(), a.N, 0, a.N);
  for (int64_t i = 0; i < M * a.N; i++) near(t, ctx, y[i], scalar[i], e.value[i], e.tol[i]);
  for (int64_t m : {int64_t{0}, M / 2, M - 1}) {
    set.gemm(q, x.data() + m * a.K, 1, alone.data(), a.N, 0, a.N);
    same_bits(bits, fmt("%s row %lld alone", ctx.c_str(), (long long)m), y.data() + m * a.N, alone.data(), a.N);
  }
  const int64_t split = std::min<int64_t>(a.N, 5);  // panels that start off the kernel's panel width
  set.gemm(q, x.data(), M, part.data(), a.N, 0, split);
  set.gemm(q, x.data(), M, part.data(), a.N, split, a.N);
  same_bits(bits, ctx + " in two chunks", part.data(), y.data(), M * a.N);
}

void quantized(const std::vector<Set>& sets, bool quick) {
  const int bit_widths[] = {2, 3, 4, 5, 6, 8};
  const int groups[] = {8, 16, 32, 64, 128};
  const int64_t widths[] = {1, 3, 17};  // groups per row: one, a few, more than 16
  const int64_t heights[] = {13, 5, 22, 1, 7};  // weight rows: blocks of 4 and 2 and their tails
  int combo = 0;
  for (int bits : bit_widths)
    for (int group : groups)
      for (int st : {kF32, kF16, kBF16})
        for (bool sym : {false, true}) {
          combo++;
          if (quick && combo % 5 != 0) continue;
          const int64_t G = widths[combo % 3], N = heights[combo % 5];
          Matrix a(N, G * group, group, bits, st, sym);
          for (const Set& set : sets) {
            check_rows(set, a);
            check_dequant(set, a);
          }
          if (a.K % 16 == 0 && combo % 2 == 0) {  // the GEMM takes K % 16 == 0 (qmm.cpp's condition)
            Matrix b(37 + combo % 3 * 16, a.K, group, bits, st, sym);  // panels and a partial one
            for (const Set& set : sets)
              if (set.gemm != nullptr) check_gemm(set, b);
          }
        }
#if defined(__x86_64__)
  // AVX-512's 5/6-bit paths against the exact products: the multishift kernel (by default on a CPU
  // with AVX512-VBMI, rows of a multiple of 64 values) and, forced, lookup tables and converting
  for (const Set& set : sets) {
    if (std::string(set.name) != "avx512") continue;
    for (int path : {-1, 0, 1}) {
      avx512_force_path(path);
      for (int bits : {5, 6})
        for (int group : {16, 32, 64, 128})
          for (int st : {kF32, kF16})
            for (bool sym : {false, true}) {
              combo++;
              if (quick && combo % 3 != 0) continue;
              Matrix a(heights[combo % 5], 64 * (1 + combo / 3 % 3 * 2) * (group > 64 ? 2 : 1), group, bits, st, sym);
              check_rows(set, a);
            }
    }
    avx512_force_path(-1);
    // and the two forced paths for groups of 32k (the faster is measured at first use where there
    // is no multishift): the same bits, in every tile
    Tally& t = report.at("avx512 rows: tables = converting");
    for (int bits : {5, 6})
      for (int group : {32, 64, 128})
        for (bool sym : {false, true}) {
          Matrix a(heights[group % 5], 3 * group, group, bits, kF16, sym);
          constexpr int64_t M = 9;
          Guarded<float> x((size_t)(M * a.K));
          random_fill(x.data(), x.size());
          std::vector<float> tables(M * a.N, NAN), converted(M * a.N, NAN);
          avx512_force_path(0);
          set.rows(a.q(!sym), x.data(), M, tables.data(), a.N, 0, a.N);
          avx512_force_path(1);
          set.rows(a.q(!sym), x.data(), M, converted.data(), a.N, 0, a.N);
          avx512_force_path(-1);
          same_bits(t, "avx512 paths " + a.name(), tables.data(), converted.data(), M * a.N);
        }
  }
#endif
  for (int i = 0; i < (quick ? 2 : 6); i++) {  // mxfp4: groups of 32
    Matrix a(heights[i % 5], 32 * widths[i % 3], 32, 4, kE8M0, false);
    for (const Set& set : sets) {
      check_rows(set, a);
      check_dequant(set, a);
      if (set.gemm != nullptr) check_gemm(set, a);
    }
  }
}

// ------------------------------------------------------------ attention
struct Keys {
  int64_t T, D, Dv, ks, vs;
  Guarded<float> k, v;
  Keys(int64_t t, int64_t d, int64_t dv)
      : T(t), D(d), Dv(dv), ks(d + 3), vs(dv + 5), k((size_t)((t - 1) * (d + 3) + d)), v((size_t)((t - 1) * (dv + 5) + dv)) {
    random_fill(k.data(), k.size(), -2.0f, 2.0f);
    random_fill(v.data(), v.size());
  }
};

void check_attention(const std::vector<Set>& sets, int64_t D, int64_t Dv, int64_t T, int mode) {
  // mode 0: every key; 1: a mask; 2: causal (the last few keys hidden)
  static const char* modes[] = {"all keys", "mask", "causal"};
  Keys kv(T, D, Dv);
  Guarded<float> q((size_t)D);
  random_fill(q.data(), D, -2.0f, 2.0f);
  const int64_t ms = 2;
  Guarded<bool> mask((size_t)((T - 1) * ms + 1));
  for (int64_t t = 0; t < T; t++) mask[t * ms] = mode != 1 || pick(0, 3) != 0 || t == T / 2;
  const int64_t visible = mode == 2 ? std::max<int64_t>(1, T - pick(1, 3)) : T;
  const float scale = 1.0f / std::sqrt((float)D);
  const AttnRow row{q.data(), kv.k.data(), kv.v.data(), mode == 1 ? mask.data() : nullptr,
                    kv.ks, kv.vs, ms, T, D, Dv, visible, scale};
  // exact: softmax in double
  std::vector<double> s(T), want(Dv, 0.0);
  double top = -INFINITY, bound = 0.0;
  for (int64_t t = 0; t < T; t++) {
    if (row.hidden(t)) continue;
    double acc = 0.0, size = 0.0;
    for (int64_t d = 0; d < D; d++) {
      acc += (double)(q[d] * scale) * kv.k[t * kv.ks + d];
      size += std::fabs((double)q[d] * scale * kv.k[t * kv.ks + d]);
    }
    s[t] = acc;
    top = std::max(top, acc);
    bound = std::max(bound, size);
  }
  double sum = 0.0, vmax = 0.0;
  for (int64_t t = 0; t < T; t++) {
    s[t] = row.hidden(t) ? 0.0 : std::exp(s[t] - top);
    sum += s[t];
  }
  for (int64_t t = 0; t < T; t++)
    for (int64_t d = 0; d < Dv; d++) {
      want[d] += s[t] / sum * kv.v[t * kv.vs + d];
      vmax = std::max(vmax, (double)std::fabs(kv.v[t * kv.vs + d]));
    }
  // a score off by e moves the weights by about e; exponentials within a few ulp; sums of T terms
  const double tol = ((D / 4.0 + 8.0) * U * bound * 2.0 + (T / 4.0 + 16.0) * U) * vmax + 1e-30;
  std::vector<float> p(T + 64), scalar(Dv), got(Dv);
  attend_scalar(row, p.data(), scalar.data());
  // the same query with hidden keys inserted: before, between and after its keys
  const int64_t pad = 3, T2 = T + 3 * pad;
  Keys padded(T2, D, Dv);
  Guarded<bool> mask2((size_t)((T2 - 1) * ms + 1));
  std::vector<int64_t> where(T);
  for (int64_t t = 0, at = pad; t < T; t++, at++) {
    if (t == T / 2) at += pad;
    where[t] = at;
  }
  for (int64_t t = 0; t < T2; t++) mask2[t * ms] = false;
  for (int64_t t = 0; t < T; t++) {
    std::memcpy(padded.k.data() + where[t] * padded.ks, kv.k.data() + t * kv.ks, D * sizeof(float));
    std::memcpy(padded.v.data() + where[t] * padded.vs, kv.v.data() + t * kv.vs, Dv * sizeof(float));
    mask2[where[t] * ms] = !row.hidden(t);
  }
  const AttnRow row2{q.data(), padded.k.data(), padded.v.data(), mask2.data(), padded.ks, padded.vs, ms, T2, D, Dv,
                     T2, scale};
  std::vector<float> p2(T2), got2(Dv);
  for (const Set& set : sets) {
    Tally& t = report.at(fmt("%s attention", set.name));
    Tally& bits = report.at(fmt("%s attention: padding changes no bit", set.name));
    const std::string ctx = fmt("%s attention D %lld Dv %lld T %lld %s", set.name, (long long)D, (long long)Dv,
                                (long long)T, modes[mode]);
    set.attend(row, p.data(), got.data());
    for (int64_t d = 0; d < Dv; d++) near(t, ctx, got[d], scalar[d], want[d], tol);
    set.attend(row2, p2.data(), got2.data());
    same_bits(bits, ctx, got2.data(), got.data(), Dv);
  }
}

// The queries of rows split over threads as attention_rows splits them (their keys in kparts for the
// scores, their value dims in dparts for the sums; the parts run in reverse order): each query's
// result has the bits it gets alone, or the set declines the head's sizes and writes nothing.
void check_split(const Set& set, const std::vector<AttnRow>& rows, const std::vector<float>& alone,
                 const std::string& ctx) {
  const int64_t n = (int64_t)rows.size(), T = rows[0].T, Dv = rows[0].Dv;
  Tally& t = report.at(fmt("%s attention: split as each alone", set.name));
  for (int64_t kparts : {1, 2, 3})
    for (int64_t dparts : {1, 2, 3}) {
      if (dparts > 1 && Dv < 16 * dparts) continue;
      auto boundary = [](int64_t size, int64_t j, int64_t of) { return j == of ? size : size / 16 * j / of * 16; };
      std::vector<float> p((size_t)(n * T), NAN), tops((size_t)(kparts * n)), e((size_t)(n * T)),
          got((size_t)(n * Dv), NAN);
      std::vector<float*> ys;
      for (int64_t i = 0; i < n; i++) ys.push_back(got.data() + i * Dv);
      bool ok = true;
      for (int64_t k = kparts - 1; k >= 0; k--)
        ok = set.attend_scores(rows.data(), n, boundary(T, k, kparts), boundary(T, k + 1, kparts), p.data(),
                               tops.data() + k * n) && ok;
      if (!ok) {  // declined: heads over 512 only
        t.checks++;
        if (std::max(rows[0].D, Dv) <= 512) fail(t, ctx + ": split scores declined");
        continue;
      }
      std::vector<float> top((size_t)n, -INFINITY);
      for (int64_t k = 0; k < kparts; k++)
        for (int64_t i = 0; i < n; i++) top[i] = std::max(top[i], tops[k * n + i]);
      for (int64_t d = dparts - 1; d >= 0; d--)
        ok = set.attend_values(rows.data(), ys.data(), n, p.data(), top.data(), boundary(Dv, d, dparts),
                               boundary(Dv, d + 1, dparts), e.data()) && ok;
      same_bits(t, fmt("%s, keys in %lld, dims in %lld", ctx.c_str(), (long long)kparts, (long long)dparts),
                got.data(), alone.data(), n * Dv);
    }
}

// Queries sharing one head's keys (each its own query, causal limit, and for mode 1 the mask):
// answered together they get the bits each gets alone (70 queries: more than one pass of 64).
void check_attention_many(const std::vector<Set>& sets, int64_t D, int64_t Dv, int64_t T, int mode) {
  Keys kv(T, D, Dv);
  const int64_t n = T <= 9 ? 70 : 5, ms = 3;
  Guarded<float> q((size_t)(n * D));
  random_fill(q.data(), q.size(), -2.0f, 2.0f);
  Guarded<bool> mask((size_t)((T - 1) * ms + 1));
  for (int64_t t = 0; t < T; t++) mask[t * ms] = pick(0, 3) != 0 || t == 0;
  std::vector<AttnRow> rows;
  for (int64_t i = 0; i < n; i++) {
    const int64_t visible = mode == 2 ? std::max<int64_t>(1, T - i % T) : T;
    rows.push_back({q.data() + i * D, kv.k.data(), kv.v.data(), mode == 1 ? mask.data() : nullptr, kv.ks, kv.vs, ms,
                    T, D, Dv, visible, 1.0f / std::sqrt((float)D)});
  }
  std::vector<float> p((size_t)(n * T + 64)), alone((size_t)(n * Dv)), together((size_t)(n * Dv));
  std::vector<float*> ys;
  for (int64_t i = 0; i < n; i++) ys.push_back(together.data() + i * Dv);
  for (const Set& set : sets) {
    const std::string ctx = fmt("%s attention of %lld queries D %lld Dv %lld T %lld mode %d", set.name, (long long)n,
                                (long long)D, (long long)Dv, (long long)T, mode);
    for (int64_t i = 0; i < n; i++) set.attend(rows[i], p.data(), alone.data() + i * Dv);
    set.attend_many(rows.data(), ys.data(), n, p.data());
    same_bits(report.at(fmt("%s attention: many queries as each alone", set.name)), ctx, together.data(), alone.data(),
              n * Dv);
    if (set.attend_scores != nullptr && n <= 64) check_split(set, rows, alone, ctx);
  }
}

void attention(const std::vector<Set>& sets, bool quick) {
  const int64_t heads[] = {64, 128, 256, 80, 96, 3, 20, 37, 39, 65, 100, 257, 512, 600};
  const int64_t lengths[] = {1, 2, 5, 9, 31, 100};
  int combo = 0;
  for (int64_t D : heads)
    for (int64_t T : lengths)
      for (int mode = 0; mode < 3; mode++) {
        if (quick && ++combo % 4 != 0) continue;
        const int64_t Dv = (T + mode) % 3 == 0 && D > 8 ? D / 2 + 3 : D;  // some value heads of another size
        check_attention(sets, D, Dv, T, mode);
        check_attention_many(sets, D, Dv, T, mode);
      }
}

// ------------------------------------------------------------ rms norm, gated activations
void rows_of(const std::vector<Set>& sets) {
  const int64_t sizes[] = {1, 3, 4, 7, 16, 17, 64, 65, 576, 640, 2048, 2051};
  for (int64_t D : sizes) {
    const int64_t rows = 3, xs = D + 5;
    Guarded<float> x((size_t)((rows - 1) * xs + D)), w((size_t)D);
    random_fill(x.data(), x.size(), -3.0f, 3.0f);
    random_fill(w.data(), D, 0.5f, 1.5f);
    for (bool weighted : {false, true}) {
      const float* wp = weighted ? w.data() : nullptr;
      std::vector<float> scalar(rows * D), got(rows * D), one(D);
      rms_norm_scalar(x.data(), xs, wp, scalar.data(), rows, D, 1e-5f);
      for (const Set& set : sets) {
        Tally& t = report.at(fmt("%s rms_norm", set.name));
        const std::string ctx = fmt("%s rms_norm D %lld%s", set.name, (long long)D, weighted ? " weighted" : "");
        set.rms_norm(x.data(), xs, wp, got.data(), rows, D, 1e-5f);
        for (int64_t r = 0; r < rows; r++) {
          double ss = 0.0;
          for (int64_t d = 0; d < D; d++) ss += (double)x[r * xs + d] * x[r * xs + d];
          const double inv = 1.0 / std::sqrt(ss / D + 1e-5);
          for (int64_t d = 0; d < D; d++) {
            const double want = x[r * xs + d] * inv * (wp ? wp[d] : 1.0);
            near(t, ctx, got[r * D + d], scalar[r * D + d], want, (D / 16.0 + 8.0) * U * std::fabs(want) + 1e-30);
          }
          set.rms_norm(x.data() + r * xs, xs, wp, one.data(), 1, D, 1e-5f);
          same_bits(report.at(fmt("%s rms_norm: a row alone", set.name)), ctx, one.data(), got.data() + r * D, D);
        }
      }
    }
  }
  const int64_t widths[] = {1, 3, 4, 5, 8, 15, 16, 17, 100, 1001};
  for (int64_t n : widths) {
    const int64_t rows = 2, gs = n + 3, us = n + 1;
    Guarded<float> g((size_t)(gs + n)), u((size_t)(us + n));
    random_fill(g.data(), g.size(), -12.0f, 12.0f);
    random_fill(u.data(), u.size(), -2.0f, 2.0f);
    const float extremes[] = {0.0f, -0.0f, 88.0f, -88.0f, 100.0f, -100.0f, 1e-20f, -30.0f};
    for (int64_t i = 0; i < std::min<int64_t>(n, 8); i++) g[(size_t)(gs + i)] = extremes[i];
    for (bool gelu : {false, true}) {
      std::vector<float> scalar(rows * n), got(rows * n);
      (gelu ? gelu_tanh_mul_scalar : silu_mul_scalar)(g.data(), gs, u.data(), us, scalar.data(), rows, n);
      for (const Set& set : sets) {
        Tally& t = report.at(fmt("%s %s", set.name, gelu ? "gelu_tanh_mul" : "silu_mul"));
        const std::string ctx = fmt("%s %s n %lld", set.name, gelu ? "gelu_tanh_mul" : "silu_mul", (long long)n);
        (gelu ? set.gelu_tanh_mul : set.silu_mul)(g.data(), gs, u.data(), us, got.data(), rows, n);
        for (int64_t r = 0; r < rows; r++)
          for (int64_t i = 0; i < n; i++) {
            const double a = g[r * gs + i], z = 0.7978845608028654 * (a + 0.044715 * a * a * a);
            // 0.5 (1 + tanh z) as sigmoid(2 z): 1 + tanh z cancels for z << 0, even in double
            const double act = gelu ? a / (1.0 + std::exp(-2.0 * z)) : a / (1.0 + std::exp(-a));
            const double want = act * u[r * us + i];
            // a few ulp of the exponential and the divide (gelu: z is rounded to float first, and e^(2z)
            // moves by 2 |z| times z's relative error); results below ~1e-30 are noise
            const double ulps = 16.0 + (gelu ? 8.0 * std::fabs(z) : 0.0);
            near(t, ctx, got[r * n + i], scalar[r * n + i], want, ulps * U * std::fabs(want) + 1e-30);
          }
      }
    }
  }
}

// ------------------------------------------------------------ quantized KV rows
void kv_rows(const std::vector<Set>& sets, bool quick) {
  int combo = 0;
  for (int bits : {2, 3, 4, 5, 6, 8})
    for (int group : {8, 16, 32, 64, 128})
      for (int64_t D : {32, 64, 96, 128, 256, 512})
        for (int st : {kF32, kF16, kBF16}) {
          if (D % group != 0 || (quick && ++combo % 3 != 0)) continue;
          const bool sym = (D / group + st) % 2 == 0;
          Matrix a(1, D, group, bits, st, sym);
          const bool pow2 = (D & (D - 1)) == 0;
          for (bool rotate : {false, true}) {
            if (rotate && !pow2) continue;
            std::vector<double> want(D), size(D);
            for (int64_t k = 0; k < D; k++) {
              want[k] = a.weight(0, k);
              size[k] = a.size(0, k);
            }
            double total = 0.0;
            for (int64_t k = 0; k < D; k++) total += size[k];
            if (rotate) {
              for (int64_t h = 1; h < D; h <<= 1)
                for (int64_t i = 0; i < D; i += 2 * h)
                  for (int64_t j = i; j < i + h; j++) {
                    const double x = want[j], y = want[j + h];
                    want[j] = x + y;
                    want[j + h] = x - y;
                  }
              for (int64_t k = 0; k < D; k++) want[k] /= std::sqrt((double)D);
            }
            std::vector<float> scalar(D), got(D);
            const void* biases = sym ? nullptr : a.biases.data();
            kv_row_scalar(a.w.data(), a.scales.data(), biases, st, D, group, bits, rotate, scalar.data());
            for (const Set& set : sets) {
              Tally& t = report.at(fmt("%s kv_row", set.name));
              const std::string ctx = fmt("%s kv_row %s%s", set.name, a.name().c_str(), rotate ? " rotated" : "");
              set.kv_row(a.w.data(), a.scales.data(), biases, st, D, group, bits, rotate, got.data());
              for (int64_t k = 0; k < D; k++) {
                const double tol = rotate ? (std::log2((double)D) + 2.0) * 2 * U * total / std::sqrt((double)D)
                                          : 2 * U * size[k];
                near(t, ctx, got[k], scalar[k], want[k], tol + 1e-40);
              }
            }
          }
        }
}

}  // namespace


// ------------------------------------------------------------ thread pool
// Every chunk of every job runs exactly once, whether the workers are polling for the next job,
// asleep (a pause longer than the poll), or just woken; a pool is destroyed busy-idle and asleep.
void pool(bool quick) {
  Tally& t = report.at("pool: each chunk once");
  for (int spin : {0, 200}) {
    for (int threads : {2, 3}) {
      tsq::Pool p(threads, spin);
      const int jobs = quick ? 300 : 3000;
      for (int j = 0; j < jobs; j++) {
        const int64_t chunks = pick(0, 40);
        std::vector<std::atomic<int>> hits(chunks);
        p.run(chunks, [&](int64_t c) { hits[c].fetch_add(1); });
        t.checks++;
        for (int64_t c = 0; c < chunks; c++)
          if (hits[c].load() != 1) {
            fail(t, "pool spin " + std::to_string(spin) + " threads " + std::to_string(threads) + ": chunk " +
                        std::to_string(c) + " of " + std::to_string(chunks) + " ran " + std::to_string(hits[c].load()) +
                        " times");
            break;
          }
        if (j % 97 == 0) std::this_thread::sleep_for(std::chrono::microseconds(pick(0, 600)));
      }
      if (threads == 3) std::this_thread::sleep_for(std::chrono::milliseconds(2));  // destroyed asleep
    }
  }
}

int main(int argc, char** argv) {
  bool quick = false;
  std::string only;
  for (int i = 1; i < argc; i++) {
    const std::string arg = argv[i];
    if (arg == "--quick") {
      quick = true;
    } else if (arg.rfind("--set=", 0) == 0) {
      only = arg.substr(6);
    } else {
      std::fprintf(stderr, "usage: %s [--quick] [--set=NAME]\n", argv[0]);
      return 2;
    }
  }
  std::vector<Set> sets;
  for (const Set& s : kernel_sets())
    if (only.empty() || only == s.name) sets.push_back(s);
  if (sets.empty()) {
    std::printf("SKIPPED: no SIMD kernel set to check on this CPU%s\n", only.empty() ? "" : (" named " + only).c_str());
    return 77;  // run.sh: nothing checked
  }
  std::printf("kernel sets:");
  for (const Set& s : sets) std::printf(" %s", s.name);
  std::printf(" (against scalar and exact references%s)\n", quick ? ", quick" : "");
  quantized(sets, quick);
  attention(sets, quick);
  rows_of(sets);
  kv_rows(sets, quick);
  pool(quick);
  std::printf("%-44s %9s %8s %9s %9s\n", "check", "checks", "failed", "err/tol", "scalar");
  for (const auto& [name, t] : report.rows) {
    if (name.find("same bits") != std::string::npos || name.find("padding") != std::string::npos ||
        name.find("alone") != std::string::npos || name.find("pool") != std::string::npos) {
      std::printf("%-44s %9ld %8ld %9s %9s\n", name.c_str(), t.checks, t.failures, "exact", "");
    } else {
      std::printf("%-44s %9ld %8ld %9.3f %9.3f\n", name.c_str(), t.checks, t.failures, t.worst, t.worst_scalar);
    }
  }
  const long failures = report.failures();
  std::printf(failures ? "FAILED: %ld checks\n" : "all passed\n", failures);
  return failures ? 1 : 0;
}
