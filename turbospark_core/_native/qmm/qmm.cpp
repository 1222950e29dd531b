// MLX custom primitive: y = x @ dequantize(w, scales, biases).T for MLX's
// affine layout, computed on the CPU without unpacking the whole weight.
#include <dlfcn.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include "mlx/backend/cpu/encoder.h"
#include "mlx/mlx.h"
#include "mlx/primitives.h"
#include "mlx/scheduler.h"

#include "kernels.h"
#include "placement.h"
#include "pool.h"

namespace nb = nanobind;
namespace mx = mlx::core;

namespace tsq {
namespace {

using sgemm_fn = void (*)(int, int, int, int, int, int, float, const float*, int, const float*, int, float, float*, int);

// One kernel set: what the CPU runs (chosen once, at first use).
struct Kernels {
  RowsFn rows;
  RowsFn gemm;  // many rows of x (nullptr: dequantized panels through sgemm)
  DequantFn dequant;
  AttendManyFn attend_many;
  RmsNormFn rms_norm;
  GatedFn silu_mul, gelu_tanh_mul;
  KVRowFn kv_row;
  const char* kernel;
  ArgMaxFn argmax = argmax_scalar;
  AttendScoresFn attend_scores = nullptr;  // null: no split attention (attention_rows)
  AttendValuesFn attend_values = nullptr;
};

constexpr Kernels SCALAR{rows_scalar, nullptr, dequant_scalar, attend_each<attend_scalar>, rms_norm_scalar, silu_mul_scalar,
                         gelu_tanh_mul_scalar, kv_row_scalar, "scalar"};
#if defined(__x86_64__)
constexpr Kernels AVX2{rows_avx2, nullptr, dequant_avx2, attend_each<attend_avx2>, rms_norm_avx2, silu_mul_avx2, gelu_tanh_mul_avx2, kv_row_scalar,
                       "avx2"};
// AVX-512 dequantizes panels with the AVX2 kernel (panels go to sgemm; the unpack is not the cost)
constexpr Kernels AVX512{rows_avx512, gemm_avx512, dequant_avx512, attend_many_avx512, rms_norm_avx512, silu_mul_avx512,
                         gelu_tanh_mul_avx512, kv_row_avx512, "avx512", argmax_avx512, attend_scores_avx512,
                         attend_values_avx512};
#endif
#if defined(__aarch64__)
constexpr Kernels NEON{rows_neon, gemm_neon, dequant_neon, attend_each<attend_neon>, rms_norm_neon, silu_mul_neon,
                       gelu_tanh_mul_neon, kv_row_neon, "neon"};
#endif

struct Runtime : Kernels {
  Runtime() : Kernels(SCALAR) {}
  sgemm_fn sgemm = nullptr;
  // M at or above which panels go through sgemm (single-threaded OpenBLAS per
  // panel measured 3-4x the row kernel's throughput at M = 64..256 here).
  int64_t gemm_min_rows = 17;
  bool blas_gemm = false;  // TURBOSPARK_QMM_GEMM=blas: panels through sgemm even where the native GEMM runs
  std::unique_ptr<Pool> pool;
};

int default_threads() {
  if (const char* env = std::getenv("TURBOSPARK_THREADS")) {
    int n = std::atoi(env);
    if (n > 0) return n;
  }
#if defined(__linux__)
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof set, &set) == 0) return std::max(1, CPU_COUNT(&set));
#endif
  return std::max(1u, std::thread::hardware_concurrency());
}

Runtime& runtime() {
  static Runtime* rt = [] {
    auto* r = new Runtime();
#if defined(__x86_64__)
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c")) {
      const bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
                          !std::getenv("TURBOSPARK_NATIVE_NO_AVX512");
      static_cast<Kernels&>(*r) = avx512 ? AVX512 : AVX2;
    }
#elif defined(__aarch64__)
    static_cast<Kernels&>(*r) = NEON;  // every aarch64 CPU has Advanced SIMD
#endif
    if (std::getenv("TURBOSPARK_NATIVE_SCALAR")) static_cast<Kernels&>(*r) = SCALAR;
    if (const char* env = std::getenv("TURBOSPARK_QMM_PANEL_ROWS")) r->gemm_min_rows = std::max(1, std::atoi(env));
    if (const char* env = std::getenv("TURBOSPARK_QMM_GEMM")) r->blas_gemm = std::string(env) == "blas";
    // a decode step's jobs come tens of microseconds apart: polling 200 us for the next one (yielding
    // the core to any runnable thread meanwhile) measured 10-25% more decode tok/s than sleeping at once
    const char* spin = std::getenv("TURBOSPARK_POOL_SPIN_US");
    r->pool = std::make_unique<Pool>(default_threads(), spin ? std::max(0, std::atoi(spin)) : 200);
    return r;
  }();
  return *rt;
}

// Weight rows per chunk: enough work per chunk to pay for the hand-off, four chunks a thread, and
// at most ~2M multiply-adds (~0.1 ms): a thread held off its core (by the Python thread building
// the next step's graph, or another process) leaves the other waiting at most for the chunk it
// holds. Gemma 3's 262144-row head: 8 chunks -> 80, decode 64.7 -> 68.9 tok/s (six runs each).
// Chunks of one size, as many for each thread (where each still holds half the least work): a
// product of 256 rows had gone as 204 + 52 rows, one of 1024 as five of 204 and one of 4.
int64_t chunk_rows(int64_t N, int64_t K, int64_t M, int threads) {
  const int64_t work_per_row = std::max<int64_t>(K * std::max<int64_t>(M, 1), 1);
  // ~128k multiply-adds per chunk: a hand-off costs a wake-up (microseconds), not more
  const int64_t min_rows = std::max<int64_t>(1, (1 << 17) / work_per_row);
  const int64_t max_rows = std::max<int64_t>(1, (1 << 21) / work_per_row);
  int64_t chunks = std::max<int64_t>(std::min<int64_t>(threads * 4, N / min_rows), (N + max_rows - 1) / max_rows);
  chunks = std::max<int64_t>(chunks, 1);
  const int64_t even = (chunks + threads - 1) / threads * threads;
  if (N / even >= std::max<int64_t>(min_rows / 2, 4)) chunks = even;
  const int64_t rows = (N + chunks - 1) / chunks;
  return std::max<int64_t>(1, std::min(N, (rows + 3) / 4 * 4));  // whole blocks of four rows
}

// y[:, n0:n1] += r[:, n0:n1] (r null: nothing): a residual added as each chunk of y is written,
// the same rounding as adding it after the product
void add_columns(const float* r, float* y, int64_t M, int64_t N, int64_t n0, int64_t n1) {
  if (r == nullptr) return;
  for (int64_t m = 0; m < M; m++) {
    for (int64_t n = n0; n < n1; n++) y[m * N + n] += r[m * N + n];
  }
}

// Ask for the first rows of each chunk of `q`'s product with M rows of x (its weights and their
// scales and biases) into the cache, the chunks j = c mod `of`: where a chunk of a product starts, its
// data comes from memory before any prefetch of its own has run. Rows ahead within a chunk the row
// kernels prefetch themselves.
void prefetch_starts(const QMat& q, int64_t M, int64_t c, int64_t of) {
  const int64_t step = chunk_rows(q.N, q.K, M, runtime().pool->threads());
  const int64_t row_bytes = q.K * q.bits / 8, groups = q.K / q.group;
  const int64_t esize = scale_bytes(q.scale_type);
  const int64_t rows = std::max<int64_t>(1, std::min<int64_t>(step, 4096 / std::max<int64_t>(row_bytes, 1)));
  auto fetch = [](const void* p, int64_t bytes) {
    const char* b = static_cast<const char*>(p);
    for (int64_t i = 0; i < bytes; i += 64) __builtin_prefetch(b + i, 0, 2);  // into L2
  };
  for (int64_t j = c; j * step < q.N; j += of) {
    const int64_t n0 = j * step, n = std::min(rows, q.N - n0), span = std::min<int64_t>(64, q.N - n0);
    fetch(q.w + n0 * row_bytes, n * row_bytes);
    fetch(static_cast<const char*>(q.scales) + n0 * groups * esize, span * groups * esize);
    if (q.biases != nullptr) fetch(static_cast<const char*>(q.biases) + n0 * groups * esize, span * groups * esize);
  }
}

// next: the product that follows (M rows of x too): each chunk, once done, prefetches some of its chunks' starts
void run_rows(const QMat& q, const float* x, int64_t M, float* y, const float* r = nullptr,
              const QMat* next = nullptr) {
  Runtime& rt = runtime();
  const int64_t step = chunk_rows(q.N, q.K, M, rt.pool->threads());
  const int64_t chunks = (q.N + step - 1) / step;
  rt.pool->run(chunks, [&](int64_t c) {
    const int64_t n0 = c * step, n1 = std::min(q.N, n0 + step);
    rt.rows(q, x, M, y, q.N, n0, n1);
    add_columns(r, y, M, q.N, n0, n1);
    if (next != nullptr) prefetch_starts(*next, M, c, chunks);
  });
}

// Large M: each chunk dequantizes a panel of weight rows into its own small
// scratch and multiplies it with sgemm. OpenBLAS runs single-threaded here
// (turbospark_core.native sets it so): this pool spreads the panels, and no
// BLAS thread spins waiting for work on a shared core.
void run_panels(const QMat& q, const float* x, int64_t M, float* y, const float* r) {
  Runtime& rt = runtime();
  const int64_t cap = std::max<int64_t>(16, ((int64_t)1 << 18) / q.K);  // ~1 MiB of floats
  const int64_t even = (q.N + rt.pool->threads() * 2 - 1) / (rt.pool->threads() * 2);
  const int64_t panel = std::max<int64_t>(16, (std::min(cap, even) + 15) / 16 * 16);
  rt.pool->run((q.N + panel - 1) / panel, [&](int64_t c) {
    const int64_t p0 = c * panel, rows = std::min(panel, q.N - p0);
    std::vector<float> scratch((size_t)rows * q.K);
    rt.dequant(q, scratch.data(), p0, p0 + rows);
    // row-major (101), no-trans A (111), trans B (112)
    rt.sgemm(101, 111, 112, (int)M, (int)rows, (int)q.K, 1.0f, x, (int)q.K, scratch.data(), (int)q.K, 0.0f, y + p0,
             (int)q.N);
    add_columns(r, y, M, q.N, p0, p0 + rows);
  });
}

// Many rows of x with the native GEMM: panels of its width spread over the pool.
constexpr int64_t GEMM_PANEL = 64;  // the kernel's panel
int64_t gemm_chunk_rows(int64_t N, int threads) {
  const int64_t panels = (N + GEMM_PANEL - 1) / GEMM_PANEL;
  return std::max<int64_t>(1, panels / (threads * 4)) * GEMM_PANEL;  // a few chunks per thread
}

void run_gemm(const QMat& q, const float* x, int64_t M, float* y, const float* r) {
  Runtime& rt = runtime();
  const int64_t step = gemm_chunk_rows(q.N, rt.pool->threads());
  rt.pool->run((q.N + step - 1) / step, [&](int64_t c) {
    const int64_t n0 = c * step, n1 = std::min(q.N, n0 + step);
    rt.gemm(q, x, M, y, q.N, n0, n1);
    add_columns(r, y, M, q.N, n0, n1);
  });
}

bool native_gemm(const QMat& q, int64_t M) {
  const Runtime& rt = runtime();
  return M >= rt.gemm_min_rows && rt.gemm != nullptr && q.K % 16 == 0 && !rt.blas_gemm;
}

// y = x @ W.T (+ r, a residual of y's shape, when given)
void compute(const QMat& q, const float* x, int64_t M, float* y, const float* r, const QMat* next = nullptr) {
  Runtime& rt = runtime();
  if (native_gemm(q, M)) return run_gemm(q, x, M, y, r);
  if (rt.sgemm != nullptr && M >= rt.gemm_min_rows) return run_panels(q, x, M, y, r);
  run_rows(q, x, M, y, r, next);
}

// ys[j] = x @ mats[j].T for a few matrices of the same x (a layer's q, k and v held apart: Gemma 3's
// mixed layouts) as one pool job: each matrix's chunks as compute() makes them, all handed out at
// once (one hand-off where there were three, and the small k and v products wait on no straggler of
// their own); the same kernels over the same rows, so the same bits.
void compute_each(const QMat* mats, int count, const float* x, int64_t M, float* const* ys, const QMat* next) {
  Runtime& rt = runtime();
  const bool gemm = std::all_of(mats, mats + count, [M](const QMat& q) { return native_gemm(q, M); });
  if (!gemm && rt.sgemm != nullptr && M >= rt.gemm_min_rows) {  // BLAS panels: each product its own job
    for (int j = 0; j < count; j++) compute(mats[j], x, M, ys[j], nullptr, j + 1 < count ? &mats[j + 1] : next);
    return;
  }
  struct Part {
    int j;
    int64_t n0, n1;
  };
  std::vector<Part> parts;
  for (int j = 0; j < count; j++) {
    const QMat& q = mats[j];
    const int64_t step = gemm ? gemm_chunk_rows(q.N, rt.pool->threads()) : chunk_rows(q.N, q.K, M, rt.pool->threads());
    for (int64_t n0 = 0; n0 < q.N; n0 += step) parts.push_back({j, n0, std::min(q.N, n0 + step)});
  }
  const int64_t chunks = (int64_t)parts.size();
  rt.pool->run(chunks, [&](int64_t c) {
    const Part& p = parts[c];
    const QMat& q = mats[p.j];
    (gemm ? rt.gemm : rt.rows)(q, x, M, ys[p.j], q.N, p.n0, p.n1);
    if (!gemm && next != nullptr) prefetch_starts(*next, M, c, chunks);
  });
}

int scale_type(mx::Dtype d) {
  if (d == mx::float32) return kF32;
  if (d == mx::float16) return kF16;
  if (d == mx::bfloat16) return kBF16;
  if (d == mx::uint8) return kE8M0;
  throw std::invalid_argument("quantized_matmul: scales/biases must be float32, float16 or bfloat16 (uint8 for mxfp4)");
}

// Fresh memory for `out` (row-contiguous) whose data starts on a cache line: the native ops'
// outputs and cache buffers. MLX's CPU allocator hands out memory 8 bytes past malloc's (24 bytes
// past a line for large buffers), where every 64-byte load of a row straddles two lines: the
// attention kernels' multiply-adds from key and value rows ran at 28 against 43 GMAC/s there (one
// core of Zen 4, heads of 256).
void set_aligned_data(mx::array& out) {
  mx::allocator::Data data = mx::allocator::malloc(out.nbytes() + 64);
  const auto p = reinterpret_cast<uintptr_t>(data.buffer().raw_ptr());
  mx::Strides strides(out.ndim(), 1);
  for (int d = (int)out.ndim() - 2; d >= 0; d--) strides[d] = strides[d + 1] * out.shape(d + 1);
  int wide = 0;  // dims longer than one: a single one is also column-contiguous
  for (int d : out.shape()) wide += d > 1;
  mx::array::Flags flags;
  flags.contiguous = flags.row_contiguous = true;
  flags.col_contiguous = wide <= 1;
  out.set_data(std::move(data), out.size(), std::move(strides), flags, (int64_t)((64 - p % 64) % 64));
}

inline bool on_line(const mx::array& a) { return reinterpret_cast<uintptr_t>(a.data<uint8_t>()) % 64 == 0; }

// The output allocated and the stream's encoder told what a primitive's task reads and writes.
mx::cpu::CommandEncoder& encoder_for(mx::Stream s, const std::vector<mx::array>& inputs, mx::array& out) {
  set_aligned_data(out);
  auto& enc = mx::cpu::get_command_encoder(s);
  for (const auto& a : inputs) enc.set_input_array(a);
  enc.set_output_array(out);
  return enc;
}

// Floats of scratch from MLX's allocator (its cache of freed buffers: no fresh pages to fault in
// and zero on every call, as a large std::vector would cost), handed back when done. It starts on
// a cache line, where the row kernels read x as it is (elsewhere they copy it first).
class Scratch {
 public:
  explicit Scratch(size_t floats) : buf_(mx::allocator::allocator().malloc(floats * sizeof(float) + 64)) {}
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;
  ~Scratch() { mx::allocator::allocator().free(buf_); }
  float* data() {
    const uintptr_t p = reinterpret_cast<uintptr_t>(buf_.raw_ptr());
    return reinterpret_cast<float*>((p + 63) / 64 * 64);
  }

 private:
  mx::allocator::Buffer buf_;
};

// An input as its task reads it: its own buffer when row-contiguous, else a
// dense copy made inside the task (inputs are traced without their layout
// under mx.compile, so the layout is only known at eval).
class Dense {
 public:
  explicit Dense(const mx::array& a)
      : src_(a.data<uint8_t>()), shape_(a.shape()), strides_(a.strides()), item_(a.itemsize()),
        contiguous_(a.flags().row_contiguous) {}

  const uint8_t* get() {
    if (contiguous_) return src_;
    int64_t n = 1;
    for (int d : shape_) n *= d;
    buf_.resize((size_t)(n * item_));
    copy(0, src_, buf_.data());
    return buf_.data();
  }

 private:
  uint8_t* copy(size_t dim, const uint8_t* src, uint8_t* dst) const {
    if (dim == shape_.size()) {
      std::memcpy(dst, src, item_);
      return dst + item_;
    }
    for (int i = 0; i < shape_[dim]; i++) dst = copy(dim + 1, src + i * strides_[dim] * (int64_t)item_, dst);
    return dst;
  }

  const uint8_t* src_;
  mx::Shape shape_;
  mx::Strides strides_;
  size_t item_;
  bool contiguous_;
  std::vector<uint8_t> buf_;
};

// What the dense and the gathered product share: the layout (group, bits, mxfp4 or affine).
class QuantizedPrimitive : public mx::UnaryPrimitive {
 public:
  QuantizedPrimitive(mx::Stream s, int group, int bits, bool fp4)
      : mx::UnaryPrimitive(s), group_(group), bits_(bits), fp4_(fp4) {}

  // MLX compares primitives of one type only
  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const QuantizedPrimitive&>(other);
    return group_ == o.group_ && bits_ == o.bits_ && fp4_ == o.fp4_;
  }

 protected:
  int bits() const { return bits_; }

  // A matrix of N rows and K columns in this layout, its scales stored as `scales` (pointers unset)
  QMat layout(const mx::array& scales, int64_t N, int64_t K) const {
    QMat q;
    q.scale_type = scale_type(scales.dtype());
    q.N = N;
    q.K = K;
    q.group = group_;
    q.bits = bits_;
    q.fp4 = fp4_;
    return q;
  }

 private:
  int group_, bits_;
  bool fp4_;
};

void over_rows(int64_t rows, int64_t n, const std::function<void(int64_t, int64_t)>& body);

// rms_norm() of `rows` rows of n values (x's rows xs floats apart) into y [rows, n], spread over the pool.
void normalize_rows(const float* x, int64_t xs, const float* w, float* y, int64_t rows, int64_t n, float eps) {
  over_rows(rows, n, [&](int64_t r0, int64_t r1) {
    runtime().rms_norm(x + r0 * xs, xs, w, y + r0 * n, r1 - r0, n, eps);
  });
}

// What a product does to its rows of x first (the op that would feed it, folded in):
// RMS-normalize them (weight optional), or the gated activation of a fused gate/up row [2K].
enum Prologue : int { kNoPrologue = 0, kRmsNormed = 1, kSiluMul = 2, kGeluTanhMul = 3 };

// The optional inputs of a product after x, w, scales, in this order: biases (none: a symmetric
// matrix, every bias -2^(bits-1) * its scale), a residual r of y's shape (y = x @ W.T + r: the
// residual stream's add folded into the product that feeds it), the prologue's weight, the post
// norm's weight. A post norm RMS-normalizes each row of the product before the residual is added
// (y = r + rms_norm(x @ W.T): a "sandwich" norm after attention's output or the MLP's down).
struct Extras {
  bool biases = false, residual = false;
  int prologue = kNoPrologue;
  bool weight = false;  // the prologue RMS norm's weight
  float eps = 0.0f;
  bool post = false, post_weight = false;
  float post_eps = 0.0f;
  bool operator==(const Extras&) const = default;
};

// y = r + post(prologue(x) @ W.T) for M rows of x (see Extras; r, pre_w, post_w optional): a product
// with the ops folded into it, as QuantizedMatmul and DecoderLayer run it.
void run_product(const QMat& q, const float* xp, int64_t M, float* yp, const float* rp, const Extras& e,
                 const float* pre_w, const float* post_w, const QMat* next = nullptr) {
  std::optional<Scratch> pre;  // x after the prologue: the same kernels as the ops it stands for
  if (e.prologue != kNoPrologue) {
    const int64_t K = q.K;
    pre.emplace((size_t)(M * K));
    if (e.prologue == kRmsNormed) {
      normalize_rows(xp, K, pre_w, pre->data(), M, K, e.eps);
    } else {
      GatedFn gated = e.prologue == kSiluMul ? runtime().silu_mul : runtime().gelu_tanh_mul;
      over_rows(M, K, [&](int64_t r0, int64_t r1) {
        gated(xp + r0 * 2 * K, 2 * K, xp + r0 * 2 * K + K, 2 * K, pre->data() + r0 * K, r1 - r0, K);
      });
    }
    xp = pre->data();
  }
  compute(q, xp, M, yp, e.post ? nullptr : rp, next);
  if (e.post) {  // each row normalized (the same kernel as rms_norm()), then the residual added
    const int64_t N = q.N;
    Scratch normed((size_t)(M * N));
    float* const np = normed.data();
    over_rows(M, N, [&](int64_t r0, int64_t r1) {
      runtime().rms_norm(yp + r0 * N, N, post_w, np + r0 * N, r1 - r0, N, e.post_eps);
      // plain loops over plain pointers, which the compiler vectorizes (the scratch's data() per
      // element and the residual's test inside the loop had kept it scalar: ~2% of Gemma 3's prefill)
      if (rp != nullptr) {
        for (int64_t i = r0 * N; i < r1 * N; i++) yp[i] = rp[i] + np[i];
      } else {
        std::memcpy(yp + r0 * N, np + r0 * N, sizeof(float) * (r1 - r0) * N);
      }
    });
  }
}

class QuantizedMatmul : public QuantizedPrimitive {
 public:
  QuantizedMatmul(mx::Stream s, int group, int bits, bool fp4, Extras e)
      : QuantizedPrimitive(s, group, bits, fp4), e_(e) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    const auto& x = inputs[0];
    const auto& w = inputs[1];
    const auto& scales = inputs[2];
    auto& enc = encoder_for(stream(), inputs, out);
    QMat q = layout(scales, w.shape(0), (int64_t)w.shape(1) * 32 / bits());
    const int64_t M = x.size() / x.shape(-1);
    size_t next = 3;
    std::optional<Dense> bd, rd, pw, qw;
    if (e_.biases) bd.emplace(inputs[next++]);
    if (e_.residual) rd.emplace(inputs[next++]);
    if (e_.weight) pw.emplace(inputs[next++]);
    if (e_.post_weight) qw.emplace(inputs[next++]);
    enc.dispatch([q, xd = Dense(x), wd = Dense(w), sd = Dense(scales), bd = std::move(bd), rd = std::move(rd),
                  pw = std::move(pw), qw = std::move(qw), yp = out.data<float>(), M, e = e_]() mutable {
      q.w = wd.get();
      q.scales = sd.get();
      q.biases = bd ? bd->get() : nullptr;
      const float* pre_w = pw ? reinterpret_cast<const float*>(pw->get()) : nullptr;
      const float* post_w = qw ? reinterpret_cast<const float*>(qw->get()) : nullptr;
      const float* rp = rd ? reinterpret_cast<const float*>(rd->get()) : nullptr;
      run_product(q, reinterpret_cast<const float*>(xd.get()), M, yp, rp, e, pre_w, post_w);
    });
  }

  bool is_equivalent(const mx::Primitive& other) const override {
    return QuantizedPrimitive::is_equivalent(other) && e_ == static_cast<const QuantizedMatmul&>(other).e_;
  }

  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("turbospark quantized_matmul runs on the CPU only");
  }

  const char* name() const override { return "TurbosparkQuantizedMatmul"; }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    auto shape = inputs[0].shape();
    shape.back() = inputs[1].shape(0);
    return {shape};
  }

 private:
  Extras e_;
};

void check(bool ok, const std::string& msg) {
  if (!ok) throw std::invalid_argument("quantized_matmul: " + msg);
}

// The same with the message made only on failure, for the checks a decode step makes every time
void check(bool ok, const std::string& what, const char* msg) {
  if (!ok) throw std::invalid_argument("quantized_matmul: " + what + msg);
}

// The arguments' layout, as the dense and the gathered product both take it; whether it is mxfp4.
bool check_layout(const mx::array& scales, const std::optional<mx::array>& biases, int group_size, int bits,
                  const std::string& mode) {
  check(mode == "affine" || mode == "mxfp4", "mode must be 'affine' or 'mxfp4', got '" + mode + "'");
  const bool fp4 = mode == "mxfp4";
  check(!fp4 || (bits == 4 && group_size == 32 && scales.dtype() == mx::uint8 && !biases),
        "mxfp4 takes 4-bit codes in groups of 32, uint8 scales and no biases");
  check(fp4 || scales.dtype() != mx::uint8, "uint8 scales are mxfp4's; affine scales are floats");
  check(bits == 2 || bits == 3 || bits == 4 || bits == 5 || bits == 6 || bits == 8,
        "bits must be 2, 3, 4, 5, 6 or 8, got " + std::to_string(bits));
  check(group_size >= 8 && group_size % 8 == 0, "group_size must be a multiple of 8, got " + std::to_string(group_size));
  return fp4;
}

// Scales (and biases) of shape `sshape` (named `what` in the refusal), one dtype the kernels read.
void check_scales(const mx::array& scales, const std::optional<mx::array>& biases, const mx::Shape& sshape,
                  const std::string& what) {
  check(scales.shape() == sshape && (!biases || biases->shape() == sshape), "scales/biases must have shape " + what);
  check(!biases || scales.dtype() == biases->dtype(), "scales and biases must share a dtype");
  scale_type(scales.dtype());
}

// x as the kernels take it: float32 (the result goes back to x's dtype)
mx::array float32_input(const mx::array& x, mx::Stream s) {
  check(mx::issubdtype(x.dtype(), mx::floating), "x must be a floating-point array");
  return x.dtype() == mx::float32 ? x : mx::astype(x, mx::float32, s);
}

mx::array quantized_matmul(const mx::array& x_in, const mx::array& w, const mx::array& scales,
                           const std::optional<mx::array>& biases, int group_size, int bits, const std::string& mode,
                           const std::optional<mx::array>& residual, const std::string& prologue,
                           const std::optional<mx::array>& prologue_weight, float eps, bool post_norm,
                           const std::optional<mx::array>& post_weight, float post_eps) {
  const bool fp4 = check_layout(scales, biases, group_size, bits, mode);
  check(w.dtype() == mx::uint32 && w.ndim() == 2, "w must be a 2-D uint32 array");
  check(x_in.ndim() >= 1, "x must have at least one dimension");
  const int64_t N = w.shape(0), K = (int64_t)w.shape(1) * 32 / bits;
  Extras e;
  e.biases = biases.has_value();
  e.residual = residual.has_value();
  e.eps = eps;
  if (prologue == "rms_norm") e.prologue = kRmsNormed;
  else if (prologue == "silu_mul") e.prologue = kSiluMul;
  else if (prologue == "gelu_tanh_mul") e.prologue = kGeluTanhMul;
  else check(prologue.empty(), "prologue must be '', 'rms_norm', 'silu_mul' or 'gelu_tanh_mul', got '" + prologue + "'");
  const bool gated = e.prologue == kSiluMul || e.prologue == kGeluTanhMul;
  check(!prologue_weight || e.prologue == kRmsNormed, "only the rms_norm prologue takes a weight");
  check(e.prologue == kNoPrologue || x_in.dtype() == mx::float32, "a prologue needs float32 x");
  check(!prologue_weight || (prologue_weight->dtype() == mx::float32 && prologue_weight->shape() == mx::Shape{(int)K}),
        "the rms_norm prologue's weight must be float32 [K]");
  std::ostringstream shape_msg;
  shape_msg << "x's last dimension " << x_in.shape(-1) << " does not match the weight's " << K << " columns"
            << (gated ? " (twice them: a fused gate/up input)" : "");
  check(x_in.shape(-1) == (gated ? 2 * K : K), shape_msg.str());
  check(K % group_size == 0, "the weight's columns must be a multiple of group_size");
  check_scales(scales, biases, {(int)N, (int)(K / group_size)}, "[N, K / group_size]");
  auto s = mx::default_stream(mx::Device::cpu);
  const mx::Dtype out_dtype = x_in.dtype();
  auto x = float32_input(x_in, s);
  auto out_shape = x.shape();
  out_shape.back() = (int)N;
  std::vector<mx::array> inputs = {x, w, scales};
  if (biases) inputs.push_back(*biases);
  if (residual) {
    check(x_in.dtype() == mx::float32 && residual->dtype() == mx::float32 && residual->shape() == out_shape,
          "a residual needs float32 x and a float32 residual of the product's shape");
    inputs.push_back(*residual);
  }
  if (prologue_weight) {
    e.weight = true;
    inputs.push_back(*prologue_weight);
  }
  check(!post_weight || post_norm, "a post_weight needs post_norm");
  check(!post_norm || x_in.dtype() == mx::float32, "a post norm needs float32 x");
  check(!post_weight || (post_weight->dtype() == mx::float32 && post_weight->shape() == mx::Shape{(int)N}),
        "the post norm's weight must be float32 [N]");
  e.post = post_norm;
  e.post_eps = post_eps;
  if (post_weight) {
    e.post_weight = true;
    inputs.push_back(*post_weight);
  }
  auto y = mx::array(out_shape, mx::float32, std::make_shared<QuantizedMatmul>(s, group_size, bits, fp4, e), inputs);
  return out_dtype == mx::float32 ? y : mx::astype(y, out_dtype, s);
}


// Routed experts: y[b] = x[b] @ dequantize(w[indices[b]]).T for every batch element b
// (x's and indices' batch axes broadcast), MLX's gather_qmm with transpose=True. Each
// (rows of x, expert) task runs the row kernels on that expert's matrix; consecutive
// elements routed to one expert whose rows of x follow each other (the sorted path of a
// prefill) are one task of many rows, whose tiles share each decoded weight.
class GatherQuantizedMatmul : public QuantizedPrimitive {
 public:
  using QuantizedPrimitive::QuantizedPrimitive;

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    const auto& x = inputs[0];
    const auto& w = inputs[1];
    const auto& scales = inputs[2];
    const auto& indices = inputs[3];
    auto& enc = encoder_for(stream(), inputs, out);
    const QMat q = layout(scales, w.shape(1), x.shape(-1));
    const int64_t M = x.shape(-2), E = w.shape(0);
    // batch element b (row-major over out's batch axes) -> its x matrix and its expert
    const int nb = (int)out.ndim() - 2;
    std::vector<int64_t> bshape(nb), xstep(nb, 0), istep(nb, 0);
    int64_t batch = 1;
    for (int d = nb - 1, xs = 1, is = 1; d >= 0; d--) {
      bshape[d] = out.shape(d);
      batch *= bshape[d];
      const int xd = d - (nb - ((int)x.ndim() - 2)), id = d - (nb - (int)indices.ndim());
      if (xd >= 0) {
        if (x.shape(xd) != 1) xstep[d] = xs;
        xs *= x.shape(xd);
      }
      if (id >= 0) {
        if (indices.shape(id) != 1) istep[d] = is;
        is *= indices.shape(id);
      }
    }
    std::optional<Dense> bd;
    if (inputs.size() > 4) bd.emplace(inputs[4]);
    enc.dispatch([q, xd = Dense(x), wd = Dense(w), sd = Dense(scales), bd = std::move(bd), id = Dense(indices),
                  itype = indices.dtype(), yp = out.data<float>(), M, E, batch, bshape, xstep, istep]() mutable {
      const auto* xp = reinterpret_cast<const float*>(xd.get());
      const uint8_t* wp = wd.get();
      const uint8_t* sp = sd.get();
      const uint8_t* bp = bd ? bd->get() : nullptr;
      const uint8_t* ip = id.get();
      const int64_t groups = q.K / q.group, row_bytes = q.K * q.bits / 8;
      const int64_t ssize = scale_bytes(q.scale_type);
      auto locate = [&](int64_t b, int64_t& xi, int64_t& ii) {
        xi = ii = 0;
        for (int d = (int)bshape.size() - 1; d >= 0; d--) {
          const int64_t c = b % bshape[d];
          b /= bshape[d];
          xi += c * xstep[d];
          ii += c * istep[d];
        }
      };
      auto expert_at = [&](int64_t i) -> int64_t {
        return itype == mx::uint32 ? (int64_t)reinterpret_cast<const uint32_t*>(ip)[i]
                                   : (int64_t)reinterpret_cast<const int32_t*>(ip)[i];
      };
      for (int64_t b = 0; b < batch;) {
        int64_t xi, ii;
        locate(b, xi, ii);
        const int64_t e = expert_at(ii);
        int64_t end = b + 1;  // following elements of the same expert with the following rows of x
        for (int64_t xn, in; end < batch; end++) {
          locate(end, xn, in);
          if (expert_at(in) != e || xn != xi + (end - b)) break;
        }
        if (e < 0 || e >= E) {  // no such expert (a router's bug, checked by the banks): zeros, never a stray read
          std::fill(yp + b * M * q.N, yp + end * M * q.N, 0.0f);
          b = end;
          continue;
        }
        QMat qe = q;
        qe.w = wp + e * q.N * row_bytes;
        qe.scales = sp + e * q.N * groups * ssize;
        qe.biases = bp ? bp + e * q.N * groups * ssize : nullptr;
        // the row kernels at any count of rows (never the GEMM): an element's result is the same bits however
        // the elements are grouped (the streamed bank's slot-fulls equal the resident bank's prefill)
        run_rows(qe, xp + xi * M * q.K, (end - b) * M, yp + b * M * q.N);
        b = end;
      }
    });
  }

  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("turbospark gather_quantized_matmul runs on the CPU only");
  }

  const char* name() const override { return "TurbosparkGatherQuantizedMatmul"; }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {gather_shape(inputs[0], inputs[3], inputs[1].shape(1))};
  }

  static mx::Shape gather_shape(const mx::array& x, const mx::array& indices, int n) {
    const mx::Shape xb(x.shape().begin(), x.shape().end() - 2);
    auto shape = mx::broadcast_shapes(xb, indices.shape());
    shape.push_back(x.shape(-2));
    shape.push_back(n);
    return shape;
  }
};

mx::array gather_quantized_matmul(const mx::array& x_in, const mx::array& w, const mx::array& scales,
                                  const std::optional<mx::array>& biases, const mx::array& indices, int group_size,
                                  int bits, const std::string& mode) {
  const bool fp4 = check_layout(scales, biases, group_size, bits, mode);
  check(w.dtype() == mx::uint32 && w.ndim() == 3, "w must be a 3-D uint32 array [experts, rows, words]");
  check(x_in.ndim() >= 2, "x must have at least two dimensions [..., rows, K]");
  check(indices.dtype() == mx::uint32 || indices.dtype() == mx::int32, "indices must be uint32 or int32");
  const int64_t N = w.shape(1), K = (int64_t)w.shape(2) * 32 / bits;
  check(x_in.shape(-1) == K, "x's last dimension does not match the experts' columns");
  check(K % group_size == 0, "the experts' columns must be a multiple of group_size");
  check_scales(scales, biases, {w.shape(0), (int)N, (int)(K / group_size)}, "[experts, rows, K / group_size]");
  auto s = mx::default_stream(mx::Device::cpu);
  const mx::Dtype out_dtype = x_in.dtype();
  auto x = float32_input(x_in, s);
  std::vector<mx::array> inputs = {x, w, scales, indices};
  if (biases) inputs.push_back(*biases);
  auto shape = GatherQuantizedMatmul::gather_shape(x, indices, (int)N);
  auto y = mx::array(shape, mx::float32, std::make_shared<GatherQuantizedMatmul>(s, group_size, bits, fp4), inputs);
  return out_dtype == mx::float32 ? y : mx::astype(y, out_dtype, s);
}

// The rotation of one position (Hugging Face half-split layout, as mx.fast.rope computes it):
// angle_i = (position * scale) * (1 / freqs[i]) for the first dims / 2 frequencies.
class Angles {
 public:
  Angles(const float* freqs, int dims, float scale) : half_(dims / 2), scale_(scale), inv_(half_), c_(half_), s_(half_) {
    for (int i = 0; i < half_; i++) inv_[i] = 1.0f / freqs[i];
  }
  void set(int64_t position) {
    const float pos = (float)position * scale_;
    for (int i = 0; i < half_; i++) {
      const float theta = pos * inv_[i];
      c_[i] = std::cos(theta);
      s_[i] = std::sin(theta);
    }
  }
  // dst[0, D) = src (stride sd) with its first dims features times m, then rotated; the rest copied
  void rotate(const float* src, int64_t sd, float* dst, int64_t D, float m) const {
    for (int i = 0; i < half_; i++) {
      const float a = src[i * sd] * m, z = src[(i + half_) * sd] * m;
      dst[i] = a * c_[i] - z * s_[i];
      dst[i + half_] = a * s_[i] + z * c_[i];
    }
    for (int64_t i = 2 * half_; i < D; i++) dst[i] = src[i * sd];
  }

 private:
  int half_;
  float scale_;
  std::vector<float> inv_, c_, s_;
};

// RoPE (Hugging Face half-split layout) over the first `dims` features of each
// head of x [B, H, L, D], position of query l in row b = offsets[b or 0] + l;
// angle = (position * scale) * (1 / freqs[i]), as mx.fast.rope computes it.
class Rope : public mx::UnaryPrimitive {
 public:
  Rope(mx::Stream s, int dims, float scale) : mx::UnaryPrimitive(s), dims_(dims), scale_(scale) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    const auto& x = inputs[0];
    const auto& offsets = inputs[1];
    const auto& freqs = inputs[2];
    auto& enc = encoder_for(stream(), inputs, out);
    const int64_t B = x.shape(0), H = x.shape(1), L = x.shape(2), D = x.shape(3);
    const int64_t sb = x.strides()[0], sh = x.strides()[1], sl = x.strides()[2], sd = x.strides()[3];
    const int64_t n_off = offsets.size();
    enc.dispatch([xp = x.data<float>(), od = Dense(offsets), fd = Dense(freqs), yp = out.data<float>(), B, H, L, D, sb,
                  sh, sl, sd, n_off, dims = dims_, scale = scale_]() mutable {
      const auto* op = reinterpret_cast<const int32_t*>(od.get());
      const auto* fp = reinterpret_cast<const float*>(fd.get());
      Angles at(fp, dims, scale);
      for (int64_t b = 0; b < B; b++) {
        const int32_t off = op[n_off == 1 ? 0 : b];
        for (int64_t l = 0; l < L; l++) {
          at.set(off + l);
          for (int64_t h = 0; h < H; h++) {
            at.rotate(xp + b * sb + h * sh + l * sl, sd, yp + ((b * H + h) * L + l) * D, D, 1.0f);
          }
        }
      }
    });
  }

  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("turbospark rope runs on the CPU only");
  }

  const char* name() const override { return "TurbosparkRope"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const Rope&>(other);
    return dims_ == o.dims_ && scale_ == o.scale_;
  }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override { return {inputs[0].shape()}; }

 private:
  int dims_;
  float scale_;
};

mx::array rope(const mx::array& x_in, int dims, float scale, const mx::array& offset, const mx::array& freqs) {
  check(x_in.ndim() == 4 && x_in.dtype() == mx::float32, "rope: x must be a float32 [B, H, L, D] array");
  check(dims > 0 && dims % 2 == 0 && dims <= x_in.shape(3), "rope: dims must be even and at most the head size");
  check(freqs.dtype() == mx::float32 && freqs.size() == (size_t)(dims / 2), "rope: freqs must be float32 [dims / 2]");
  check(offset.size() == 1 || offset.size() == (size_t)x_in.shape(0), "rope: offset must be a scalar or one per row");
  auto s = mx::default_stream(mx::Device::cpu);
  const mx::array& x = x_in;  // read through its strides at eval (transposed heads are not copied)
  auto off = offset.dtype() == mx::int32 ? offset : mx::astype(offset, mx::int32, s);
  return mx::array(x.shape(), mx::float32, std::make_shared<Rope>(s, dims, scale), {x, off, freqs});
}

// One query whose key or value rows are not dense (elements ksd / vsd floats apart; a.ks / a.vs
// between rows): the scalar composition.
void strided(const AttnRow& a, int64_t ksd, int64_t vsd, float* p, float* y) {
  float top = -INFINITY;
  for (int64_t t = 0; t < a.T; t++) {
    if (a.hidden(t)) {
      p[t] = -INFINITY;
      continue;
    }
    const float* kr = a.k + t * a.ks;
    float acc = 0.0f;
    for (int64_t d = 0; d < a.D; d++) acc += a.q[d] * a.scale * kr[d * ksd];
    p[t] = acc;
    top = std::max(top, acc);
  }
  float sum = 0.0f;
  for (int64_t t = 0; t < a.T; t++) {
    p[t] = p[t] == -INFINITY ? 0.0f : std::exp(p[t] - top);
    sum += p[t];
  }
  for (int64_t d = 0; d < a.Dv; d++) y[d] = 0.0f;
  for (int64_t t = 0; t < a.T; t++) {
    const float* vr = a.v + t * a.vs;
    const float w = p[t];
    if (w == 0.0f) continue;  // masked (or underflowed): adds exact zeros
    for (int64_t d = 0; d < a.Dv; d++) y[d] += w * vr[d * vsd];
  }
  const float inv = 1.0f / sum;
  for (int64_t d = 0; d < a.Dv; d++) y[d] *= inv;
}

// An array as attention reads it: a base pointer and strides of [B, H, T, D].
struct View {
  const float* p;
  int64_t sb, sh, st, sd;
};
View view_of(const mx::array& a) {
  return View{a.data<float>(), a.strides()[0], a.strides()[1], a.strides()[2], a.strides()[3]};
}

// Optional boolean mask [B, Hq, L, T] (any strides, broadcasts included): false keys get no weight.
struct MaskView {
  const bool* p = nullptr;
  int64_t sb = 0, sh = 0, sl = 0, st = 0;
};
MaskView mask_of(const mx::array& a) {
  return MaskView{a.data<bool>(), a.strides()[0], a.strides()[1], a.strides()[2], a.strides()[3]};
}

// keys x head dims x queries from which a group is split (attention_rows)
constexpr int64_t SPLIT_MIN_WORK = int64_t(1) << 17;

// Whether attention_rows splits each group's keys and value dims over the threads (attend_scores,
// attend_values) rather than its queries: where the groups do not share out evenly (Gemma 3's decode:
// one kv head on two threads, each of two tasks had read every key and value: its attention 50-58 ->
// 43-48 us a layer at ~300 keys, 154-170 -> 139-150 us at ~1000, in place), there are keys
// enough to pay for a second hand-off, and each part of the value dims is 128 wide or more (a key's
// weight costs the same however few dims it multiplies: SmolLM2's heads of 64, three kv heads on two
// threads, went 89-95 -> 111-135 us a layer at 1000 keys when split).
bool tasks_split(bool dense, int64_t blocks, int64_t groups, int64_t threads, int64_t queries, int64_t T, int64_t D,
                 int64_t Dv) {
  const Runtime& rt = runtime();
  return dense && rt.attend_scores != nullptr && threads > 1 && blocks == 1 && groups % threads != 0 &&
         queries <= 64 && Dv >= 128 * threads && std::max(D, Dv) <= 512 && T * (D + Dv) * queries >= SPLIT_MIN_WORK;
}

// Each group's queries: first every part of the keys scored (a task a group and part), then every
// part of the value dims summed from them (likewise), as many parts as threads; the results are
// those of attend_many bit for bit. False (nothing written) where the kernels decline the head's sizes.
template <class Gather>
bool split_attention(Gather& gather, int64_t n, int64_t groups, int64_t T, int64_t Dv, int64_t parts) {
  Runtime& rt = runtime();
  thread_local Floats score_room, top_room;
  score_room.resize(groups * n * T);
  top_room.resize(groups * parts * n);
  float *const scores = score_room.data(), *const tops = top_room.data();  // the tasks' shared buffers
  std::atomic<bool> ok{true};
  auto boundary = [parts](int64_t size, int64_t j) { return j == parts ? size : size / 16 * j / parts * 16; };
  rt.pool->run(groups * parts, [&](int64_t c) {
    thread_local Floats qs;
    thread_local std::vector<AttnRow> rows;
    thread_local std::vector<float*> ys;
    const int64_t at = c / parts, part = c % parts;
    gather(at, 0, n, qs, rows, ys);
    if (!rt.attend_scores(rows.data(), n, boundary(T, part), boundary(T, part + 1), scores + at * n * T, tops + c * n))
      ok = false;
  });
  if (!ok) return false;
  rt.pool->run(groups * parts, [&](int64_t c) {
    thread_local Floats qs, e, top;
    thread_local std::vector<AttnRow> rows;
    thread_local std::vector<float*> ys;
    const int64_t at = c / parts, part = c % parts;
    gather(at, 0, n, qs, rows, ys);
    top.assign(n, -INFINITY);
    for (int64_t k = 0; k < parts; k++)
      for (int64_t i = 0; i < n; i++) top[i] = std::max(top[i], tops[(at * parts + k) * n + i]);
    e.resize(n * T);
    if (!rt.attend_values(rows.data(), ys.data(), n, scores + at * n * T, top.data(), boundary(Dv, part),
                          boundary(Dv, part + 1), e.data()))
      ok = false;
  });
  // the value kernels take every head the score kernels took (a failure here is a bug, not a refusal)
  if (!ok) throw std::logic_error("turbospark split attention: the value kernels declined a head its scores took");
  return true;
}

// softmax(scale * q . k) v for every query l of head h in row b over the first T keys,
// grouped-query heads sharing keys; causal: query l sees keys t <= T - L + l. k/v are read
// through their strides (a cache's buffer is not copied). Output merged ([B, L, Hq * Dv]) or not.
void attention_rows(View qv, View kv, View vv, MaskView m, float* yp, int64_t B, int64_t Hq, int64_t L, int64_t D,
                    int64_t Hkv, int64_t T, int64_t Dv, bool causal, float scale, bool merge) {
  const bool dense = kv.sd == 1 && vv.sd == 1;  // rows of keys and values are dense: the SIMD kernels
  // query l of head h in row b: its key row and visible range; q copied dense when strided
  auto row = [&](int64_t b, int64_t h, int64_t l, float* qs) {
    const int64_t g = h / (Hq / Hkv);
    for (int64_t d = 0; d < D; d++) qs[d] = qv.p[b * qv.sb + h * qv.sh + l * qv.st + d * qv.sd];
    return AttnRow{qs, kv.p + b * kv.sb + g * kv.sh, vv.p + b * vv.sb + g * vv.sh,
                   m.p ? m.p + b * m.sb + h * m.sh + l * m.sl : nullptr, kv.st, vv.st, m.st, T, D, Dv,
                   causal ? T - L + l + 1 : T, scale};
  };
  // merged heads: [B, L, Hq * Dv] (what the output projection reads), else [B, Hq, L, Dv]
  auto output = [&](int64_t b, int64_t h, int64_t l) {
    return yp + (merge ? (b * L + l) * Hq + h : (b * Hq + h) * L + l) * Dv;
  };
  const int64_t group = Hq / Hkv;
  // a task is the queries of `span` positions of every head that shares a kv head (GQA): they read
  // each block of keys and values from memory once (the scores of span * group queries fit the
  // core's cache); with fewer such groups than threads, each group's queries are split between
  // `parts` tasks (Gemma 3's decode, one kv head: two tasks of two queries where each query had been
  // a task of its own, reading every key itself; its attention 64-74 -> 46-58 us a layer in place)
  const int64_t span = std::clamp<int64_t>((int64_t(1) << 18) / std::max<int64_t>(T * group, 1), 1, 16);
  const int64_t blocks = (L + span - 1) / span, threads = runtime().pool->threads();
  const int64_t groups = B * Hkv * blocks, parts = groups >= threads ? 1 : (threads + groups - 1) / groups;
  // queries [i0, i1) of group `at` (at most span * group) as rows, q copied dense into qs
  auto gather = [&](int64_t at, int64_t i0, int64_t i1, Floats& qs, std::vector<AttnRow>& rows,
                    std::vector<float*>& ys) {
    rows.clear();
    ys.clear();
    qs.resize((i1 - i0) * D);
    const int64_t l0 = (at % blocks) * span, g = (at / blocks) % Hkv, b = at / (blocks * Hkv);
    for (int64_t i = i0; i < i1; i++) {
      const int64_t l = l0 + i / group, h = g * group + i % group;
      rows.push_back(row(b, h, l, qs.data() + rows.size() * D));
      ys.push_back(output(b, h, l));
    }
  };
  auto queries = [&](int64_t at) { return std::min(span, L - (at % blocks) * span) * group; };
  if (tasks_split(dense, blocks, groups, threads, queries(0), T, D, Dv) &&
      split_attention(gather, queries(0), groups, T, Dv, threads))
    return;
  const int64_t tasks = groups * parts;
  auto task = [&](int64_t c) {
    thread_local Floats qs, p;
    thread_local std::vector<AttnRow> rows;
    thread_local std::vector<float*> ys;
    const int64_t part = c % parts, at = c / parts, n = queries(at);
    gather(at, n * part / parts, n * (part + 1) / parts, qs, rows, ys);
    if (rows.empty()) return;  // more parts than queries
    p.resize(rows.size() * T);
    if (dense) return runtime().attend_many(rows.data(), ys.data(), (int64_t)rows.size(), p.data());
    for (size_t i = 0; i < rows.size(); i++) strided(rows[i], kv.sd, vv.sd, p.data(), ys[i]);
  };
  if (tasks > 1 && T * (D + Dv) * B * Hq * L >= (1 << 16)) {
    runtime().pool->run(tasks, task);
  } else {
    for (int64_t c = 0; c < tasks; c++) task(c);
  }
}

// One query per row and head (decode): attention_rows over all T keys of k and v.
class DecodeAttention : public mx::UnaryPrimitive {
 public:
  DecodeAttention(mx::Stream s, float scale, bool causal, bool merge)
      : mx::UnaryPrimitive(s), scale_(scale), causal_(causal), merge_(merge) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    const auto& q = inputs[0];
    const auto& k = inputs[1];
    const auto& v = inputs[2];
    auto& enc = encoder_for(stream(), inputs, out);
    const MaskView m = inputs.size() > 3 ? mask_of(inputs[3]) : MaskView{};
    enc.dispatch([qv = view_of(q), kv = view_of(k), vv = view_of(v), yp = out.data<float>(), m, B = q.shape(0),
                  Hq = q.shape(1), L = q.shape(2), D = q.shape(3), Hkv = k.shape(1), T = k.shape(2), Dv = v.shape(3),
                  causal = causal_, scale = scale_, merge = merge_]() {
      attention_rows(qv, kv, vv, m, yp, B, Hq, L, D, Hkv, T, Dv, causal, scale, merge);
    });
  }

  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("turbospark decode attention runs on the CPU only");
  }

  const char* name() const override { return "TurbosparkDecodeAttention"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const DecodeAttention&>(other);
    return scale_ == o.scale_ && causal_ == o.causal_ && merge_ == o.merge_;
  }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {shape(inputs[0], inputs[2], merge_)};
  }

  static mx::Shape shape(const mx::array& q, const mx::array& v, bool merge) {
    if (merge) return {q.shape(0), q.shape(2), q.shape(1) * v.shape(3)};
    return {q.shape(0), q.shape(1), q.shape(2), v.shape(3)};
  }

 private:
  float scale_;
  bool causal_, merge_;
};

mx::array decode_attention(const mx::array& q, const mx::array& k, const mx::array& v, float scale,
                           const std::optional<mx::array>& mask, bool causal, bool merge_heads) {
  check(q.ndim() == 4 && k.ndim() == 4 && v.ndim() == 4, "decode_attention: q, k, v must be [B, H, L, D]");
  check(q.dtype() == mx::float32 && k.dtype() == mx::float32 && v.dtype() == mx::float32,
        "decode_attention: q, k, v must be float32");
  check(q.shape(2) >= 1 && q.shape(2) <= 65536, "decode_attention: 1 to 65536 queries per row and head");
  check(q.shape(2) <= k.shape(2), "decode_attention: more queries than keys");
  check(!(causal && mask), "decode_attention: a mask array or causal, not both");
  check(k.shape(0) == q.shape(0) && v.shape(0) == q.shape(0) && k.shape(1) == v.shape(1) && k.shape(2) == v.shape(2),
        "decode_attention: k and v must share batch, heads and length with each other and q's batch");
  check(k.shape(1) > 0 && q.shape(1) % k.shape(1) == 0, "decode_attention: query heads must be a multiple of kv heads");
  check(k.shape(3) == q.shape(3) && k.shape(2) > 0, "decode_attention: k must have q's head size and a key");
  auto s = mx::default_stream(mx::Device::cpu);
  std::vector<mx::array> inputs = {q, k, v};
  if (mask) {
    check(mask->dtype() == mx::bool_ && mask->ndim() >= 2 && mask->ndim() <= 4,
          "decode_attention: the mask must be boolean [L, T], [1|H, L, T] or [B, 1|H, L, T]");
    inputs.push_back(mx::broadcast_to(*mask, {q.shape(0), q.shape(1), q.shape(2), k.shape(2)}, s));
  }
  return mx::array(DecodeAttention::shape(q, v, merge_heads), mx::float32,
                   std::make_shared<DecodeAttention>(s, scale, causal, merge_heads), std::move(inputs));
}

// A full KV cache's step in one op: the L new key and value rows are written into the cache's
// buffers at `offset` (in place when MLX can hand the buffers over, else into copies), and the L
// queries attend causally to the buffers' first offset + L rows. Outputs: the attention (as
// DecodeAttention's), then the key and value buffers. Replaces two slice updates, two slices
// and the attention of a layer's decode step with one node.
std::atomic<int64_t> cache_copies{0};  // buffers copied because MLX could not hand them over (tests read it)
std::atomic<int64_t> cache_realigned{0};  // buffers moved once onto a cache line (tests read it)

// A cache buffer input taken over by `out`: its memory itself (written in place) where MLX can hand it
// over and it starts on a cache line, else fresh memory on a line; then the buffer to copy from
// first is returned (and counted).
std::optional<View> take_buffer(const mx::array& buf, mx::array& out) {
  // A step evaluated while the previous one still runs finds the buffer also held by that step's
  // pending task (MLX holds a task's inputs and outputs until it has run): wait for the stream to
  // catch up first, as MLX's own throttle of tasks in flight would (without it, a generation's
  // pipelined steps copied most buffers). A buffer held elsewhere (a checkpoint) is still held once
  // the tasks in flight are done, and is copied; the wait is bounded if other streams keep busy.
  for (int i = 0; i < 64 && !buf.is_donatable() && mx::scheduler::n_active_tasks() > 0; i++)
    mx::scheduler::wait_for_one();
  const bool donatable = buf.is_donatable() && buf.flags().row_contiguous;
  if (donatable && on_line(buf)) {
    out.copy_shared_buffer(buf);
    return std::nullopt;
  }
  // copied: into memory on a cache line, which later steps take over (a buffer MLX allocated,
  // a new cache's or a grown one's, is moved once)
  set_aligned_data(out);
  (donatable ? cache_realigned : cache_copies)++;
  return view_of(buf);
}

// Rows [0, n) of src [B, H, n, width] (any strides) into rows [at, at + n) of the row-contiguous dst [B, H, S, width].
void copy_rows(const View& src, int64_t B, int64_t H, int64_t n, float* dst, int64_t S, int64_t at, int64_t width) {
  for (int64_t b = 0; b < B; b++)
    for (int64_t h = 0; h < H; h++)
      for (int64_t t = 0; t < n; t++) {
        float* row = dst + ((b * H + h) * S + at + t) * width;
        const float* from = src.p + b * src.sb + h * src.sh + t * src.st;
        for (int64_t d = 0; d < width; d++) row[d] = from[d * src.sd];
      }
}

class CacheAttention : public mx::Primitive {
 public:
  CacheAttention(mx::Stream s, int64_t offset, float scale, bool merge)
      : mx::Primitive(s), offset_(offset), scale_(scale), merge_(merge) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    const auto& q = inputs[0];
    auto& enc = mx::cpu::get_command_encoder(stream());
    for (const auto& a : inputs) enc.set_input_array(a);
    set_aligned_data(outputs[0]);
    // Every output of a multi-output primitive holds its own list of the inputs, so a buffer nothing
    // else holds counts once per output here. The lists of the outputs MLX is not evaluating through
    // go now (MLX drops them all once this returns), so is_donatable() sees only the one it passed.
    for (auto& o : outputs)
      if (&o.inputs() != &inputs) o.inputs().clear();
    std::optional<View> copy_from[2] = {take_buffer(inputs[3], outputs[1]), take_buffer(inputs[4], outputs[2])};
    for (auto& o : outputs) enc.set_output_array(o);
    const auto& kn = inputs[1];
    const auto& vn = inputs[2];
    enc.dispatch([qv = view_of(q), knv = view_of(kn), vnv = view_of(vn), kb = outputs[1].data<float>(),
                  vb = outputs[2].data<float>(), yp = outputs[0].data<float>(), B = q.shape(0), Hq = q.shape(1),
                  L = q.shape(2), D = q.shape(3), Hkv = kn.shape(1), Dv = vn.shape(3), S = outputs[1].shape(2),
                  copy_from_k = copy_from[0], copy_from_v = copy_from[1], offset = offset_, scale = scale_,
                  merge = merge_]() {
      if (copy_from_k) copy_rows(*copy_from_k, B, Hkv, S, kb, S, 0, D);
      if (copy_from_v) copy_rows(*copy_from_v, B, Hkv, S, vb, S, 0, Dv);
      copy_rows(knv, B, Hkv, L, kb, S, offset, D);  // the new rows
      copy_rows(vnv, B, Hkv, L, vb, S, offset, Dv);
      const View kv{kb, Hkv * S * D, S * D, D, 1}, vv{vb, Hkv * S * Dv, S * Dv, Dv, 1};
      attention_rows(qv, kv, vv, MaskView{}, yp, B, Hq, L, D, Hkv, offset + L, Dv, true, scale, merge);
    });
  }

  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("turbospark cache attention runs on the CPU only");
  }

  const char* name() const override { return "TurbosparkCacheAttention"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const CacheAttention&>(other);
    return offset_ == o.offset_ && scale_ == o.scale_ && merge_ == o.merge_;
  }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {DecodeAttention::shape(inputs[0], inputs[2], merge_), inputs[3].shape(), inputs[4].shape()};
  }

 private:
  int64_t offset_;
  float scale_;
  bool merge_;
};

std::vector<mx::array> cache_attention(const mx::array& q, const mx::array& k, const mx::array& v,
                                       const mx::array& k_buf, const mx::array& v_buf, int64_t offset, float scale,
                                       bool merge_heads) {
  for (const auto* a : {&q, &k, &v, &k_buf, &v_buf}) {
    check(a->ndim() == 4 && a->dtype() == mx::float32, "cache_attention: q, k, v and the buffers must be float32 [B, H, L, D]");
  }
  const int64_t L = q.shape(2);
  check(L >= 1 && L <= 65536, "cache_attention: 1 to 65536 queries per row and head");
  check(k.shape(2) == L && v.shape(2) == L, "cache_attention: one new key and value row per query");
  check(k.shape(0) == q.shape(0) && v.shape(0) == q.shape(0) && k.shape(1) == v.shape(1),
        "cache_attention: k and v must share q's batch and each other's heads");
  check(k.shape(1) > 0 && q.shape(1) % k.shape(1) == 0, "cache_attention: query heads must be a multiple of kv heads");
  check(k.shape(3) == q.shape(3), "cache_attention: k must have q's head size");
  check(k_buf.shape(0) == k.shape(0) && k_buf.shape(1) == k.shape(1) && k_buf.shape(3) == k.shape(3) &&
            v_buf.shape(0) == v.shape(0) && v_buf.shape(1) == v.shape(1) && v_buf.shape(3) == v.shape(3),
        "cache_attention: the buffers must hold rows like k and v");
  check(offset >= 0 && offset + L <= k_buf.shape(2) && offset + L <= v_buf.shape(2),
        "cache_attention: the buffers must have room for the new rows at offset");
  auto s = mx::default_stream(mx::Device::cpu);
  auto prim = std::make_shared<CacheAttention>(s, offset, scale, merge_heads);
  std::vector<mx::Shape> shapes = {DecodeAttention::shape(q, v, merge_heads), k_buf.shape(), v_buf.shape()};
  return mx::array::make_arrays(std::move(shapes), {mx::float32, mx::float32, mx::float32}, prim,
                                {q, k, v, k_buf, v_buf});
}

// Rows of the last axis as a task reads them: a base pointer and one row stride
// when the array allows it (a slice of a wider array, e.g. half of a fused
// gate/up product), else a dense copy.
class Rows {
 public:
  explicit Rows(const mx::array& a) : dense_(a), n_(a.shape(-1)), rows_(n_ ? (int64_t)a.size() / n_ : 0) {
    const auto& sh = a.shape();
    const auto& st = a.strides();
    strided_ = a.ndim() >= 1 && (a.ndim() == 1 || sh.back() == 1 || st.back() == 1);
    stride_ = a.ndim() >= 2 ? st[a.ndim() - 2] : n_;
    for (int d = 0; strided_ && d + 2 < (int)a.ndim(); d++) strided_ = sh[d] == 1 || st[d] == st[d + 1] * sh[d + 1];
    if (strided_) ptr_ = a.data<float>();
  }
  // (pointer, row stride) in floats
  std::pair<const float*, int64_t> get() {
    if (strided_) return {ptr_, stride_};
    return {reinterpret_cast<const float*>(dense_.get()), n_};
  }
  int64_t rows() const { return rows_; }
  int64_t n() const { return n_; }

 private:
  Dense dense_;
  int64_t n_, rows_;
  bool strided_ = false;
  int64_t stride_ = 0;
  const float* ptr_ = nullptr;
};

// Chunks of rows over the pool when there is enough work to pay for the hand-off.
void over_rows(int64_t rows, int64_t n, const std::function<void(int64_t, int64_t)>& body) {
  Runtime& rt = runtime();
  const int64_t per = std::max<int64_t>(1, (1 << 15) / std::max<int64_t>(n, 1));
  const int64_t chunks = (rows + per - 1) / per;
  if (chunks <= 1) return body(0, rows);
  rt.pool->run(chunks, [&](int64_t c) { body(c * per, std::min(rows, (c + 1) * per)); });
}

class RmsNorm : public mx::UnaryPrimitive {
 public:
  RmsNorm(mx::Stream s, float eps) : mx::UnaryPrimitive(s), eps_(eps) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    auto& enc = encoder_for(stream(), inputs, out);
    std::optional<Dense> w;
    if (inputs.size() > 1) w.emplace(inputs[1]);
    enc.dispatch([x = Rows(inputs[0]), w, yp = out.data<float>(), eps = eps_]() mutable {
      auto [xp, xs] = x.get();
      const float* wp = w ? reinterpret_cast<const float*>(w->get()) : nullptr;
      normalize_rows(xp, xs, wp, yp, x.rows(), x.n(), eps);
    });
  }

  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("turbospark rms_norm runs on the CPU only");
  }

  const char* name() const override { return "TurbosparkRmsNorm"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    return eps_ == static_cast<const RmsNorm&>(other).eps_;
  }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override { return {inputs[0].shape()}; }

 private:
  float eps_;
};

// mx.argmax(x, axis=-1) for float32 x [..., V]: uint32 [...], each row's first NaN, else the first
// index of its largest value (0 where all are -inf), long rows split over the pool. MLX's scan took
// 0.28 ms for Gemma 3's 262144 logits (2% of a decode step); this 0.035 ms.
class ArgMaxRows : public mx::UnaryPrimitive {
 public:
  explicit ArgMaxRows(mx::Stream s) : mx::UnaryPrimitive(s) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    auto& enc = encoder_for(stream(), inputs, out);
    enc.dispatch([x = Rows(inputs[0]), yp = out.data<uint32_t>()]() mutable {
      auto [xp, xs] = x.get();
      const int64_t rows = x.rows(), V = x.n();
      const int64_t per = std::max<int64_t>(V / 4, 1 << 15), parts = (V + per - 1) / per;
      std::vector<ArgMax> found((size_t)(rows * parts));
      auto part = [&](int64_t c) {
        const int64_t r = c / parts, i0 = (c % parts) * per;
        ArgMax a = runtime().argmax(xp + r * xs + i0, std::min(per, V - i0));
        if (a.index >= 0) a.index += i0;
        found[c] = a;
      };
      if (rows * parts > 1) {
        runtime().pool->run(rows * parts, part);
      } else if (rows > 0) {
        part(0);
      }
      for (int64_t r = 0; r < rows; r++) {
        ArgMax best{-INFINITY, -1};
        for (int64_t c = r * parts; c < (r + 1) * parts; c++)
          if (found[c].index >= 0 && argmax_takes(found[c].value, best.value)) best = found[c];
        yp[r] = best.index < 0 ? 0u : (uint32_t)best.index;
      }
    });
  }

  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("turbospark argmax runs on the CPU only");
  }

  const char* name() const override { return "TurbosparkArgMax"; }

  bool is_equivalent(const mx::Primitive&) const override { return true; }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    const auto& sh = inputs[0].shape();
    return {mx::Shape(sh.begin(), sh.end() - 1)};
  }
};

mx::array argmax(const mx::array& x) {
  check(x.ndim() >= 1 && x.dtype() == mx::float32 && x.shape(-1) > 0,
        "argmax: x must be a float32 array with a non-empty last axis");
  const auto& sh = x.shape();
  return mx::array(mx::Shape(sh.begin(), sh.end() - 1), mx::uint32,
                   std::make_shared<ArgMaxRows>(mx::default_stream(mx::Device::cpu)), {x});
}

// Rows of an array (all axes but the last) read through its strides: a cache's rows are a
// slice of a larger buffer. An array whose last axis is not one run of values is copied
// dense first (layouts are only known at eval).
class RowIndex {
 public:
  explicit RowIndex(const mx::array& a) : item_(a.itemsize()) {
    const bool runs = a.ndim() == 0 || a.strides().back() == 1 || a.shape(-1) == 1;
    if (!runs) dense_.emplace(a);
    int64_t stride = a.ndim() ? a.shape(-1) : 1;
    for (int d = (int)a.ndim() - 2; d >= 0; d--) {
      shape_.insert(shape_.begin(), a.shape(d));
      strides_.insert(strides_.begin(), runs ? (int64_t)a.strides()[d] : stride);
      stride *= a.shape(d);
    }
    base_ = runs ? a.data<uint8_t>() : nullptr;
  }
  // call once, in the task, before row()
  void ready() {
    if (dense_) base_ = dense_->get();
  }
  const uint8_t* row(int64_t r) const {
    int64_t off = 0;
    for (int d = (int)shape_.size() - 1; d >= 0; d--) {
      off += (r % shape_[d]) * strides_[d];
      r /= shape_[d];
    }
    return base_ + off * (int64_t)item_;
  }

 private:
  std::optional<Dense> dense_;
  const uint8_t* base_ = nullptr;
  size_t item_;
  std::vector<int64_t> shape_, strides_;
};

// Quantized KV rows back to float32 (and rotated back), one native op: MLX composes the
// dequantization from about ten ops and its CPU hadamard_transform is scalar.
class KVRows : public mx::UnaryPrimitive {
 public:
  KVRows(mx::Stream s, int bits, bool rotate) : mx::UnaryPrimitive(s), bits_(bits), rotate_(rotate) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    const auto& w = inputs[0];
    const auto& scales = inputs[1];
    auto& enc = encoder_for(stream(), inputs, out);
    const int64_t D = out.shape(-1), rows = D ? out.size() / D : 0;
    const int group = (int)(D / scales.shape(-1));
    std::optional<RowIndex> bi;
    if (inputs.size() > 2) bi.emplace(inputs[2]);
    enc.dispatch([wi = RowIndex(w), si = RowIndex(scales), bi = std::move(bi), st = scale_type(scales.dtype()),
                  yp = out.data<float>(), D, rows, group, bits = bits_, rotate = rotate_,
                  fn = runtime().kv_row]() mutable {
      wi.ready();
      si.ready();
      if (bi) bi->ready();
      over_rows(rows, D, [&](int64_t r0, int64_t r1) {
        for (int64_t r = r0; r < r1; r++) fn(wi.row(r), si.row(r), bi ? bi->row(r) : nullptr, st, D, group, bits, rotate, yp + r * D);
      });
    });
  }

  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("turbospark kv_rows runs on the CPU only");
  }

  const char* name() const override { return "TurbosparkKVRows"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const KVRows&>(other);
    return bits_ == o.bits_ && rotate_ == o.rotate_;
  }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    auto shape = inputs[0].shape();
    shape.back() = shape.back() * 32 / bits_;
    return {shape};
  }

 private:
  int bits_;
  bool rotate_;
};

mx::array kv_rows(const mx::array& w, const mx::array& scales, const std::optional<mx::array>& biases, int bits,
                  bool rotate) {
  check(bits == 2 || bits == 3 || bits == 4 || bits == 5 || bits == 6 || bits == 8,
        "kv_rows: bits must be 2, 3, 4, 5, 6 or 8, got " + std::to_string(bits));
  check(w.dtype() == mx::uint32 && w.ndim() >= 1, "kv_rows: w must be a uint32 array");
  const int64_t D = (int64_t)w.shape(-1) * 32 / bits;
  check(scales.ndim() == w.ndim() && scales.shape(-1) > 0 && D % scales.shape(-1) == 0 && (D / scales.shape(-1)) % 8 == 0,
        "kv_rows: scales must hold one value per group (a multiple of 8 values) of each row");
  for (int d = 0; d + 1 < (int)w.ndim(); d++) check(scales.shape(d) == w.shape(d), "kv_rows: scales and w disagree");
  check(!biases || (biases->shape() == scales.shape() && biases->dtype() == scales.dtype()),
        "kv_rows: biases must match scales");
  check(!rotate || (D >= 2 && (D & (D - 1)) == 0), "kv_rows: rotated rows need a power-of-two length");
  scale_type(scales.dtype());
  auto s = mx::default_stream(mx::Device::cpu);
  std::vector<mx::array> inputs = {w, scales};
  if (biases) inputs.push_back(*biases);
  auto out_shape = w.shape();
  out_shape.back() = (int)D;
  return mx::array(out_shape, mx::float32, std::make_shared<KVRows>(s, bits, rotate), std::move(inputs));
}

// ------------------------------------------------------------ batch cache layouts
// A batch's float32 key or value buffer [R, H, C, D] laid out anew (a row joining, the buffer
// growing, rows leaving, rewound columns compacted): moves copy columns [begin, end) of a source
// buffer's row to columns from dst of a row, every other value is zero. The zeros are not written
// where they span whole pages: those pages go back to the kernel (MADV_DONTNEED, Linux), which
// maps them zero when first read and gives a page only when first written, so a batch's left
// padding (short rows beside a long one) and its room to grow cost neither time nor memory.
// Writing them had: on this VM fresh pages fault in at ~0.15 GB/s, and a 2,000-token prompt
// joining four short rows of SmolLM2 wrote ~0.5 GB of padding, stalling every row for ~4 s.
struct KvMove {
  int64_t to, part, row, begin, end, dst;
};

std::atomic<int64_t> kv_place_unwritten{0};  // bytes of zeros handed back as pages (tests read it)

// Zero [p, p + bytes): whole pages handed back (a run of at least 16), the ends written.
void zero_bytes(uint8_t* p, int64_t bytes) {
#ifdef __linux__
  static const int64_t page = sysconf(_SC_PAGESIZE);
  const auto a = reinterpret_cast<uintptr_t>(p), b = a + (uintptr_t)bytes;
  const uintptr_t pa = (a + page - 1) / page * page, pb = b / page * page;
  if (pb >= pa + 16 * (uintptr_t)page && madvise(reinterpret_cast<void*>(pa), pb - pa, MADV_DONTNEED) == 0) {
    std::memset(p, 0, pa - a);
    std::memset(reinterpret_cast<uint8_t*>(pb), 0, b - pb);
    kv_place_unwritten += (int64_t)(pb - pa);
    return;
  }
#endif
  std::memset(p, 0, (size_t)bytes);
}

class KvPlace : public mx::UnaryPrimitive {
 public:
  // moves sorted by (to, dst), none overlapping another of its row
  KvPlace(mx::Stream s, std::vector<KvMove> moves, int rows, int capacity)
      : mx::UnaryPrimitive(s), moves_(std::move(moves)), rows_(rows), capacity_(capacity) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    auto& enc = encoder_for(stream(), inputs, out);
    // the task holds the output's memory by pointer only: a copy of `out` held there would keep the
    // next step's op from taking the buffer over (MLX hands over only a buffer nothing else holds)
    const std::array<int64_t, 4> shape = {rows_, out.shape(1), out.shape(2), out.shape(3)};
    if (out.itemsize() == 2) {
      enc.dispatch([inputs, moves = moves_, shape, yp = out.data<uint16_t>()]() { place(inputs, moves, shape, yp); });
    } else {
      enc.dispatch([inputs, moves = moves_, shape, yp = out.data<uint32_t>()]() { place(inputs, moves, shape, yp); });
    }
  }

  // the values are copied as bits (T: an unsigned integer of the element's size); zero bits are zero
  template <class T>
  static void place(const std::vector<mx::array>& inputs, const std::vector<KvMove>& moves,
                    const std::array<int64_t, 4>& shape, T* yp) {
    const auto [R, H, C, D] = shape;
    int64_t zero_from = 0;  // the zeros gathered into runs (a row's end and the next one's padding)
    auto live = [&](int64_t at, int64_t n) {
      if (at > zero_from) zero_bytes(reinterpret_cast<uint8_t*>(yp + zero_from), (at - zero_from) * sizeof(T));
      zero_from = at + n;
    };
    size_t first = 0;  // the row's first move
    for (int64_t r = 0; r < R; r++) {
      size_t last = first;
      while (last < moves.size() && moves[last].to == r) last++;
      for (int64_t h = 0; h < H; h++) {
        for (size_t i = first; i < last; i++) {
          const KvMove& e = moves[i];
          const mx::array& src = inputs[e.part];
          const auto& st = src.strides();
          const int64_t n = e.end - e.begin;
          T* dst = yp + ((r * H + h) * C + e.dst) * D;
          const T* from = src.data<T>() + e.row * st[0] + h * st[1] + e.begin * st[2];
          live((r * H + h) * C * D + e.dst * D, n * D);
          if (st[3] == 1 && st[2] == D) {
            std::memcpy(dst, from, sizeof(T) * n * D);
          } else {
            for (int64_t c = 0; c < n; c++)
              for (int64_t d = 0; d < D; d++) dst[c * D + d] = from[c * st[2] + d * st[3]];
          }
        }
      }
      first = last;
    }
    live(R * H * C * D, 0);
  }

  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("turbospark kv_place runs on the CPU only");
  }

  const char* name() const override { return "TurbosparkKvPlace"; }

  bool is_equivalent(const mx::Primitive&) const override { return false; }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {{rows_, inputs[0].shape(1), capacity_, inputs[0].shape(3)}};
  }

 private:
  std::vector<KvMove> moves_;
  int rows_, capacity_;
};

mx::array kv_place(const std::vector<mx::array>& parts,
                   const std::vector<std::tuple<int64_t, int64_t, int64_t, int64_t, int64_t, int64_t>>& moves,
                   int rows, int capacity) {
  check(!parts.empty(), "kv_place: give at least one source buffer");
  const mx::Dtype dtype = parts[0].dtype();
  check(dtype.size() == 2 || dtype.size() == 4, "kv_place: sources must hold 2- or 4-byte values (e.g. float32, "
        "a quantized row's uint32 codes, float16)");
  for (const auto& a : parts)
    check(a.dtype() == dtype && a.ndim() == 4 && a.shape(1) == parts[0].shape(1) && a.shape(3) == parts[0].shape(3),
          "kv_place: sources must be [rows, heads, columns, dim] of one dtype and the same heads and dim");
  check(rows >= 0 && capacity >= 0, "kv_place: rows and capacity must be >= 0");
  std::vector<KvMove> plan;
  for (const auto& [to, part, row, begin, end, dst] : moves) {
    check(to >= 0 && to < rows, "kv_place: a move goes to a row past `rows`");
    check(part >= 0 && part < (int64_t)parts.size(), "kv_place: a move names a source that is not given");
    const auto& a = parts[part];
    check(row >= 0 && row < a.shape(0) && 0 <= begin && begin <= end && end <= a.shape(2),
          "kv_place: a move's source row or columns lie outside its buffer");
    check(dst >= 0 && dst + (end - begin) <= capacity, "kv_place: a move's columns do not fit the capacity");
    plan.push_back({to, part, row, begin, end, dst});
  }
  std::stable_sort(plan.begin(), plan.end(), [](const KvMove& a, const KvMove& b) {
    return a.to != b.to ? a.to < b.to : a.dst < b.dst;
  });
  for (size_t i = 1; i < plan.size(); i++)
    check(plan[i].to != plan[i - 1].to || plan[i].dst >= plan[i - 1].dst + (plan[i - 1].end - plan[i - 1].begin),
          "kv_place: two moves write the same columns of a row");
  mx::Shape shape = {rows, parts[0].shape(1), capacity, parts[0].shape(3)};
  return mx::array(shape, dtype,
                   std::make_shared<KvPlace>(mx::default_stream(mx::Device::cpu), std::move(plan), rows, capacity), parts);
}

mx::array rms_norm(const mx::array& x, const std::optional<mx::array>& w, float eps) {
  check(x.ndim() >= 1 && x.dtype() == mx::float32, "rms_norm: x must be a float32 array");
  check(!w || (w->dtype() == mx::float32 && w->ndim() == 1 && w->shape(0) == x.shape(-1)),
        "rms_norm: the weight must be float32 [D] with D x's last dimension");
  auto s = mx::default_stream(mx::Device::cpu);
  std::vector<mx::array> inputs = {x};
  if (w) inputs.push_back(*w);
  return mx::array(x.shape(), mx::float32, std::make_shared<RmsNorm>(s, eps), std::move(inputs));
}

// Attention's heads from B * L token rows of its projections (src[i] + r * stride[i]: q's, k's and
// v's parts of row r), as RopeHeads computes them: q into yq [B, hq, L, D]; k and v into rows
// [at, at + L) of yk / yv [B, hkv, S, D or Dv] (a cache's buffers, or S = L and at = 0).
void rope_heads_rows(const float* const src[3], const int64_t stride[3], const int32_t* op, int64_t n_off,
                     const float* fp, const float* qw, const float* kw, float eps, float* yq, float* yk, float* yv,
                     int64_t S, int64_t at_row, int64_t B, int64_t L, int64_t D, int64_t Dv, int64_t hq, int64_t hkv,
                     int dims, float scale, float m) {
  over_rows(B * L, (hq + 2 * hkv) * D, [&](int64_t r0, int64_t r1) {
    Angles at(fp, dims, scale);
    std::vector<float> normed(qw ? (size_t)(std::max(hq, hkv) * D) : 0);
    // heads of one row (token): normalized into scratch first where asked, then rotated into place
    auto heads = [&](const float* row, int64_t H, const float* w, float* out, int64_t rows, int64_t l) {
      if (w != nullptr) {
        runtime().rms_norm(row, D, w, normed.data(), H, D, eps);
        row = normed.data();
      }
      for (int64_t h = 0; h < H; h++) at.rotate(row + h * D, 1, out + (h * rows + l) * D, D, m);
    };
    for (int64_t r = r0; r < r1; r++) {
      const int64_t b = r / L, l = r % L;
      at.set((int64_t)op[n_off == 1 ? 0 : b] + l);
      heads(src[0] + r * stride[0], hq, qw, yq + b * hq * L * D, L, l);
      heads(src[1] + r * stride[1], hkv, kw, yk + b * hkv * S * D, S, at_row + l);
      for (int64_t h = 0; h < hkv; h++) {
        std::memcpy(yv + ((b * hkv + h) * S + at_row + l) * Dv, src[2] + r * stride[2] + h * Dv, Dv * sizeof(float));
      }
    }
  });
}

// Attention's heads from its projections, one op: q, k and v [B, H, L, D] (row-contiguous) from
// the fused product [B, L, (Hq + 2 Hkv) * D] (or q, k, v [B, L, H * D] apart), q's and k's heads
// optionally RMS-normalized with their own weight [D] first, then their first `dims` features
// times mscale and rotated (as Rope) at position offsets[b or 0] + l; v's heads copied. What
// MLX composes from a split, three reshapes and transposes, two norms and two RoPEs.
class RopeHeads : public mx::Primitive {
 public:
  RopeHeads(mx::Stream s, int hq, int hkv, int dims, float scale, float mscale, bool norm, float eps)
      : mx::Primitive(s), hq_(hq), hkv_(hkv), dims_(dims), scale_(scale), mscale_(mscale), norm_(norm), eps_(eps) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    const bool fused = inputs.size() == (norm_ ? 5u : 3u);
    const int np = fused ? 1 : 3;  // projection inputs
    auto& enc = mx::cpu::get_command_encoder(stream());
    for (const auto& a : inputs) enc.set_input_array(a);
    for (auto& o : outputs) {
      set_aligned_data(o);
      enc.set_output_array(o);
    }
    const int64_t B = outputs[0].shape(0), L = outputs[0].shape(2), D = outputs[0].shape(3), Dv = outputs[2].shape(3);
    std::vector<Rows> proj;
    for (int i = 0; i < np; i++) proj.emplace_back(inputs[i]);
    std::optional<Dense> qn, kn;
    if (norm_) {
      qn.emplace(inputs[np + 2]);
      kn.emplace(inputs[np + 3]);
    }
    enc.dispatch([proj = std::move(proj), od = Dense(inputs[np]), n_off = (int64_t)inputs[np].size(),
                  fd = Dense(inputs[np + 1]), qn = std::move(qn), kn = std::move(kn), yq = outputs[0].data<float>(),
                  yk = outputs[1].data<float>(), yv = outputs[2].data<float>(), B, L, D, Dv, hq = (int64_t)hq_,
                  hkv = (int64_t)hkv_, dims = dims_, scale = scale_, m = mscale_, eps = eps_]() mutable {
      // each projection's rows (one row per token) and where q, k and v start in them
      const float* src[3];
      int64_t stride[3];
      for (size_t i = 0; i < proj.size(); i++) std::tie(src[i], stride[i]) = proj[i].get();
      if (proj.size() == 1) {
        src[1] = src[0] + hq * D;
        src[2] = src[0] + (hq + hkv) * D;
        stride[1] = stride[2] = stride[0];
      }
      const float* qw = qn ? reinterpret_cast<const float*>(qn->get()) : nullptr;
      const float* kw = kn ? reinterpret_cast<const float*>(kn->get()) : nullptr;
      rope_heads_rows(src, stride, reinterpret_cast<const int32_t*>(od.get()), n_off,
                      reinterpret_cast<const float*>(fd.get()), qw, kw, eps, yq, yk, yv, L, 0, B, L, D, Dv, hq, hkv,
                      dims, scale, m);
    });
  }

  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("turbospark rope_heads runs on the CPU only");
  }

  const char* name() const override { return "TurbosparkRopeHeads"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const RopeHeads&>(other);
    return hq_ == o.hq_ && hkv_ == o.hkv_ && dims_ == o.dims_ && scale_ == o.scale_ && mscale_ == o.mscale_ &&
           norm_ == o.norm_ && eps_ == o.eps_;
  }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return shapes(inputs, inputs.size() == (norm_ ? 5u : 3u) ? 1 : 3, hq_, hkv_);
  }

  // q, k and v's [B, H, L, D] from the projection inputs (the first np)
  static std::vector<mx::Shape> shapes(const std::vector<mx::array>& inputs, int np, int hq, int hkv) {
    const auto& x = inputs[0];
    const int B = x.shape(0), L = x.shape(1);
    if (np == 1) {
      const int D = x.shape(2) / (hq + 2 * hkv);
      return {{B, hq, L, D}, {B, hkv, L, D}, {B, hkv, L, D}};
    }
    return {{B, hq, L, x.shape(2) / hq}, {B, hkv, L, inputs[1].shape(2) / hkv}, {B, hkv, L, inputs[2].shape(2) / hkv}};
  }

 private:
  int hq_, hkv_, dims_;
  float scale_, mscale_;
  bool norm_;
  float eps_;
};

std::vector<mx::array> rope_heads(const std::vector<mx::array>& projections, int heads, int kv_heads, int dims,
                                  float scale, float mscale, const mx::array& offset, const mx::array& freqs,
                                  const std::optional<mx::array>& q_norm, const std::optional<mx::array>& k_norm,
                                  float eps) {
  const std::string what = "rope_heads: ";
  check(projections.size() == 1 || projections.size() == 3, what + "pass the fused q/k/v product or q, k and v");
  check(heads > 0 && kv_heads > 0, what + "heads and kv_heads must be positive");
  const auto& x = projections[0];
  for (const auto& p : projections) {
    check(p.ndim() == 3 && p.dtype() == mx::float32 && p.shape(0) == x.shape(0) && p.shape(1) == x.shape(1),
          what + "projections must be float32 [B, L, heads * head_dim] of one B and L");
  }
  const int np = (int)projections.size();
  const int n_heads[3] = {heads, kv_heads, kv_heads};
  if (np == 1) {
    check(x.shape(2) % (heads + 2 * kv_heads) == 0, what + "the fused product's width must be (heads + 2 kv_heads) * D");
  } else {
    for (int i = 0; i < 3; i++) check(projections[i].shape(2) % n_heads[i] == 0, what + "a projection's width is not heads * D");
  }
  auto shapes = RopeHeads::shapes(projections, np, heads, kv_heads);
  const int D = shapes[0][3];
  check(shapes[1][3] == D && D > 0, what + "q and k must share their head size");
  check(dims > 0 && dims % 2 == 0 && dims <= D, what + "dims must be even and at most the head size");
  check(freqs.dtype() == mx::float32 && freqs.size() == (size_t)(dims / 2), what + "freqs must be float32 [dims / 2]");
  check(offset.size() == 1 || offset.size() == (size_t)x.shape(0), what + "offset must be a scalar or one per row");
  check(!q_norm == !k_norm, what + "normalize both q and k heads or neither");
  for (const auto* w : {&q_norm, &k_norm}) {
    check(!*w || ((*w)->dtype() == mx::float32 && (*w)->ndim() == 1 && (*w)->shape(0) == D),
          what + "a head norm's weight must be float32 [head_dim]");
  }
  auto s = mx::default_stream(mx::Device::cpu);
  std::vector<mx::array> inputs = projections;
  inputs.push_back(offset.dtype() == mx::int32 ? offset : mx::astype(offset, mx::int32, s));
  inputs.push_back(freqs);
  if (q_norm) {
    inputs.push_back(*q_norm);
    inputs.push_back(*k_norm);
  }
  auto prim = std::make_shared<RopeHeads>(s, heads, kv_heads, dims, scale, mscale, q_norm.has_value(), eps);
  return mx::array::make_arrays(std::move(shapes), {mx::float32, mx::float32, mx::float32}, prim, inputs);
}

// One pre-norm decoder layer's step as one op, where a layer's parts are ~6 ops:
//   h = x + post_attn(o(attention(heads(qkv(rms_norm(x, in_norm))), cache)))
//   y = h + post_mlp(down(act(gate_up(rms_norm(h, mlp_norm)))))
// (post norms optional: Gemma's sandwich norms). The q/k/v projection is one fused matrix or three
// (q, k and v of the normalized x). Every part runs the code of its own op: the products as
// QuantizedMatmul with its prologue, residual and post norm (three projections: rms_norm once, then
// plain products), the heads as RopeHeads (q/k head norms optional), the attention as
// CacheAttention; so the result is theirs, bit for bit. The step's key and value rows go straight
// into the cache's buffers at `offset` (taken over, or copied, as CacheAttention takes them). Each
// product prefetches the starts of the next one's chunks; an optional last matrix (the next layer's
// first) is only prefetched. Outputs: y, then the key and value buffers.
struct MatLayout {
  int group = 0, bits = 0;
  bool fp4 = false, biases = false;
  bool operator==(const MatLayout&) const = default;
};

constexpr int kMaxLayerMats = 7;  // q, k, v, o, gate_up, down, the next layer's first

// A step as one primitive (kWholeStep: y and the buffers), or as two (steps of kApartFrom tokens and
// more: prefill chunks): its rows (q, k and v projected and rotated, k's and v's written: q and the
// buffers) and the rest (attention over the written buffers, o and the MLP: y). MLX evaluates only
// what is read: a prefill chunk reads only the caches, so its last layer's rest never runs (Gemma 3,
// 18 layers: about a twentieth of a prefill's products), as llama.cpp skips the outputs a prompt does
// not need. The parts run the whole step's code, so they give its bits.
enum LayerPart : int { kWholeStep = 0, kStepRows = 1, kStepRest = 2 };
constexpr int64_t kApartFrom = 32;  // shorter steps (decode, verify) read y anyway: one primitive, one hand-off
std::atomic<int64_t> layer_parts_run[3];  // steps run of each part (tests read it)

struct LayerConfig {
  int hq = 0, hkv = 0, dims = 0;
  float rope_scale = 1.0f, mscale = 1.0f, eps = 0.0f, scale = 1.0f;
  int64_t offset = 0;
  int activation = kSiluMul;
  int projections = 1;  // the fused q/k/v matrix, or q, k and v
  int mats = 4;         // projections + o, gate_up, down (+ 1: the next layer's first, prefetched)
  bool post_attn = false, post_mlp = false, qk_norm = false;
  bool rows = false;  // per-row positions and a mask (a batch's rows): inputs before the buffers
  int part = 0;       // LayerPart: what the step's primitive computes
  MatLayout layout[kMaxLayerMats];
  bool operator==(const LayerConfig&) const = default;
};

// A layer's own arrays (in_norm, mlp_norm, [post_attn], [post_mlp], [q_norm, k_norm], freqs, then each
// matrix's w, scales, [biases]), held by its op and by every step's primitive rather than passed as
// inputs: each input of a step's graph had cost MLX's async_eval ~1.2 us on the thread building the
// next step (0.6 ms a SmolLM2 step). Evaluated (row-contiguous) at the layer's first step, then read
// through the pointers set here: a step makes no views of them. (The open moves weights onto huge
// pages before any step, placement.py, so the pointers stay those of the arrays' data.)
struct LayerArrays {
  std::vector<mx::array> arrays;
  const float *in_norm = nullptr, *mlp_norm = nullptr, *post_attn = nullptr, *post_mlp = nullptr;
  const float *q_norm = nullptr, *k_norm = nullptr, *freqs = nullptr;
  std::array<QMat, kMaxLayerMats> mats{};

  // evaluate the arrays and set the pointers (once, before the first step's primitive is made)
  void ready(const LayerConfig& c) {
    mx::eval(arrays);
    for (auto& a : arrays)
      if (!a.flags().row_contiguous) a = mx::contiguous(a);
    mx::eval(arrays);
    size_t i = 0;
    auto next = [&] { return arrays[i++].data<float>(); };
    in_norm = next();
    mlp_norm = next();
    post_attn = c.post_attn ? next() : nullptr;
    post_mlp = c.post_mlp ? next() : nullptr;
    q_norm = c.qk_norm ? next() : nullptr;
    k_norm = c.qk_norm ? next() : nullptr;
    freqs = next();
    for (int m = 0; m < c.mats; m++) {
      const MatLayout& l = c.layout[m];
      const mx::array &w = arrays[i], &scales = arrays[i + 1];
      QMat& q = mats[m];
      q.w = w.data<uint8_t>();
      q.scales = scales.data<void>();
      q.biases = l.biases ? arrays[i + 2].data<void>() : nullptr;
      q.scale_type = scale_type(scales.dtype());
      q.N = w.shape(0);
      q.K = (int64_t)w.shape(1) * 32 / l.bits;
      q.group = l.group;
      q.bits = l.bits;
      q.fp4 = l.fp4;
      i += l.biases ? 3 : 2;
    }
  }
};

class DecoderLayer : public mx::Primitive {
 public:
  DecoderLayer(mx::Stream s, LayerConfig c, std::shared_ptr<const LayerArrays> held)
      : mx::Primitive(s), c_(c), held_(std::move(held)) {}

  // inputs: x, [each row's position int32 [B] and the mask bool [B, Hq, L, T]], [q (kStepRest)], then
  // the key and value buffers (the layer's own arrays are held: LayerArrays). Outputs: y (kWholeStep)
  // or the rotated q [B, Hq, L, D] (kStepRows), then the buffers taken over; or y alone (kStepRest,
  // from q and the buffers as given: the rows' outputs, only read)
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    auto& enc = mx::cpu::get_command_encoder(stream());
    for (const auto& a : inputs) enc.set_input_array(a);
    const size_t nb = inputs.size() - 2;
    set_aligned_data(outputs[0]);
    float *qo = outputs[0].data<float>(), *kb, *vb;
    std::optional<View> from[2];
    if (c_.part == kStepRest) {
      qo = const_cast<float*>(inputs[nb - 1].data<float>());
      kb = const_cast<float*>(inputs[nb].data<float>());
      vb = const_cast<float*>(inputs[nb + 1].data<float>());
    } else {
      for (auto& o : outputs)  // as CacheAttention: only the evaluated output's list may hold the buffers
        if (&o.inputs() != &inputs) o.inputs().clear();
      from[0] = take_buffer(inputs[nb], outputs[1]);
      from[1] = take_buffer(inputs[nb + 1], outputs[2]);
      kb = outputs[1].data<float>();
      vb = outputs[2].data<float>();
    }
    for (auto& o : outputs) enc.set_output_array(o);
    layer_parts_run[c_.part]++;
    const MaskView mask = c_.rows ? mask_of(inputs[2]) : MaskView{};  // read through its (broadcast) strides
    std::optional<Dense> positions;
    if (c_.rows) positions.emplace(inputs[1]);
    const auto& x = inputs[0];
    enc.dispatch([held = held_, xd = Dense(x), c = c_, from_k = from[0], from_v = from[1], mask, positions,
                  y = outputs[0].data<float>(), qo, kb, vb, B = (int64_t)x.shape(0), L = (int64_t)x.shape(1),
                  Dm = (int64_t)x.shape(2), S = (int64_t)inputs[nb].shape(2), D = (int64_t)inputs[nb].shape(3),
                  Dv = (int64_t)inputs[nb + 1].shape(3)]() mutable {
      const auto& mats = held->mats;
      const float* xp = reinterpret_cast<const float*>(xd.get());
      const int np = c.projections;
      const QMat &o = mats[np], &gu = mats[np + 1], &down = mats[np + 2];
      const QMat* next = c.mats > np + 3 ? &mats[np + 3] : nullptr;
      const int64_t M = B * L, hq = c.hq, hkv = c.hkv;
      Extras normed;
      normed.prologue = kRmsNormed;
      normed.weight = true;
      normed.eps = c.eps;
      std::optional<Scratch> q;  // the whole step's rotated q (the rows' is their output)
      if (c.part == kWholeStep) {
        q.emplace((size_t)(M * hq * D));
        qo = q->data();
      }
      if (c.part != kStepRest) {
        // the heads' projections: rows of proj, q's, k's and v's parts at src[j] (row strides stride[j])
        int64_t width = 0;
        for (int j = 0; j < np; j++) width += mats[j].N;
        Scratch proj((size_t)(M * width));
        const float* src[3];
        int64_t stride[3];
        if (np == 1) {
          run_product(mats[0], xp, M, proj.data(), nullptr, normed, held->in_norm, nullptr, &o);
          src[0] = proj.data(), src[1] = src[0] + hq * D, src[2] = src[0] + (hq + hkv) * D;
          stride[0] = stride[1] = stride[2] = width;
        } else {
          Scratch xn((size_t)(M * Dm));  // rms_norm()'s rows, then three plain products (one job)
          normalize_rows(xp, Dm, held->in_norm, xn.data(), M, Dm, c.eps);
          float* dst[3] = {proj.data(), proj.data() + M * mats[0].N, proj.data() + M * (mats[0].N + mats[1].N)};
          compute_each(mats.data(), 3, xn.data(), M, dst, &o);
          for (int j = 0; j < 3; j++) {
            src[j] = dst[j];
            stride[j] = mats[j].N;
          }
        }
        if (from_k) copy_rows(*from_k, B, hkv, S, kb, S, 0, D);
        if (from_v) copy_rows(*from_v, B, hkv, S, vb, S, 0, Dv);
        // positions: the column written (a single sequence's), or each row's own (a batch's, then masked)
        const int32_t column = (int32_t)c.offset;
        const int32_t* pos = positions ? reinterpret_cast<const int32_t*>(positions->get()) : &column;
        rope_heads_rows(src, stride, pos, c.rows ? B : 1, held->freqs, held->q_norm, held->k_norm, c.eps, qo, kb, vb,
                        S, c.offset, B, L, D, Dv, hq, hkv, c.dims, c.rope_scale, c.mscale);
        if (c.part == kStepRows) return;
      }
      Scratch att((size_t)(M * hq * Dv)), h((size_t)(M * Dm)), gate_up((size_t)(M * gu.N));
      const View qv{qo, hq * L * D, L * D, D, 1}, kv{kb, hkv * S * D, S * D, D, 1}, vv{vb, hkv * S * Dv, S * Dv, Dv, 1};
      attention_rows(qv, kv, vv, mask, att.data(), B, hq, L, D, hkv, c.offset + L, Dv, !c.rows, c.scale, true);
      Extras plus;
      plus.residual = true;
      plus.post = plus.post_weight = c.post_attn;
      plus.post_eps = c.eps;
      run_product(o, att.data(), M, h.data(), xp, plus, nullptr, held->post_attn, &gu);
      run_product(gu, h.data(), M, gate_up.data(), nullptr, normed, held->mlp_norm, nullptr, &down);
      plus.prologue = c.activation;
      plus.post = plus.post_weight = c.post_mlp;
      run_product(down, gate_up.data(), M, y, h.data(), plus, nullptr, held->post_mlp, next);
    });
  }

  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("turbospark decoder_layer runs on the CPU only");
  }

  const char* name() const override { return "TurbosparkDecoderLayer"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const DecoderLayer&>(other);
    return c_ == o.c_ && held_ == o.held_;  // one layer's op (its arrays are not inputs)
  }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    const auto& k_buf = inputs[inputs.size() - 2];
    if (c_.part == kStepRest) return {inputs[0].shape()};
    mx::Shape first = inputs[0].shape();  // y, or the rows' q [B, Hq, L, D]
    if (c_.part == kStepRows) first = {first[0], c_.hq, first[1], k_buf.shape(3)};
    return {first, k_buf.shape(), inputs.back().shape()};
  }

 private:
  LayerConfig c_;
  std::shared_ptr<const LayerArrays> held_;
};

// A layer's DecoderLayer steps: its weights and settings checked and held once, then each step made
// from x, the cache's buffers and the offset (a decode step builds its graph with one call a layer).
class DecoderLayerOp {
 public:
  DecoderLayerOp(const std::vector<std::optional<mx::array>>& norms, const std::vector<mx::array>& weights,
                 const std::vector<mx::array>& scales, const std::vector<std::optional<mx::array>>& biases,
                 const std::vector<int>& group_sizes, const std::vector<int>& bits,
                 const std::vector<std::string>& modes, int projections, const mx::array& freqs, int heads,
                 int kv_heads, int dims, float rope_scale, float mscale, float eps, float scale,
                 const std::string& activation) {
    check(projections == 1 || projections == 3, what_ + "projections must be 1 (a fused q/k/v matrix) or 3 (q, k, v)");
    check(norms.size() == 6, what_ + "norms are [in, mlp, post_attn, post_mlp, q_norm, k_norm] (None where absent)");
    const size_t nm = weights.size(), need = (size_t)projections + 3;
    check((nm == need || nm == need + 1) && scales.size() == nm && biases.size() == nm && group_sizes.size() == nm &&
              bits.size() == nm && modes.size() == nm,
          what_ + "pass the q/k/v, o, gate_up and down matrices (and optionally the next layer's first) as weights, "
                  "scales, biases, group sizes, bits and modes");
    check(heads > 0 && kv_heads > 0 && heads % kv_heads == 0, what_ + "heads must be a positive multiple of kv_heads");
    check(norms[0].has_value() && norms[1].has_value(), what_ + "the input and MLP norms need weights");
    check(activation == "silu_mul" || activation == "gelu_tanh_mul",
          what_ + "activation must be 'silu_mul' or 'gelu_tanh_mul'");
    check(!norms[4] == !norms[5], what_ + "normalize both q and k heads or neither");
    for (size_t m = 0; m < nm; m++)
      check(weights[m].dtype() == mx::uint32 && weights[m].ndim() == 2 && bits[m] > 0,
            what_ + "each matrix's weight must be a 2-D uint32 array");
    // the sizes the matrices imply: hidden from the input norm, head sizes from o and the projections
    auto cols = [&](size_t m) { return (int64_t)weights[m].shape(1) * 32 / bits[m]; };
    Dm_ = norms[0]->ndim() == 1 ? norms[0]->shape(0) : 0;
    Dv_ = cols(projections) / heads;
    D_ = projections == 3 ? weights[0].shape(0) / heads
                          : (weights[0].shape(0) - kv_heads * Dv_) / (heads + kv_heads);
    check(Dv_ > 0 && D_ > 0, what_ + "o and the q/k/v projection do not give positive head sizes");
    check(dims > 0 && dims % 2 == 0 && dims <= D_, what_ + "dims must be even and at most the head size");
    check(freqs.dtype() == mx::float32 && freqs.size() == (size_t)(dims / 2), what_ + "freqs must be float32 [dims / 2]");
    const int64_t widths[6] = {Dm_, Dm_, Dm_, Dm_, D_, D_};
    for (int i = 0; i < 6; i++)
      check(!norms[i] || (norms[i]->dtype() == mx::float32 && norms[i]->shape() == mx::Shape{(int)widths[i]}),
            what_ + "a norm's weight must be float32 [its rows' width]");
    c_.hq = heads;
    c_.hkv = kv_heads;
    c_.dims = dims;
    c_.rope_scale = rope_scale;
    c_.mscale = mscale;
    c_.eps = eps;
    c_.scale = scale;
    c_.activation = activation == "silu_mul" ? kSiluMul : kGeluTanhMul;
    c_.projections = projections;
    c_.mats = (int)nm;
    c_.post_attn = norms[2].has_value();
    c_.post_mlp = norms[3].has_value();
    c_.qk_norm = norms[4].has_value();
    // each matrix's [rows, columns] (0: set from gate_up below; anything for the prefetched one)
    std::vector<std::pair<int64_t, int64_t>> want;
    std::vector<std::string> names;
    if (projections == 1) {
      want.push_back({heads * D_ + kv_heads * (D_ + Dv_), Dm_});
      names.push_back("qkv");
    } else {
      want.insert(want.end(), {{heads * D_, Dm_}, {kv_heads * D_, Dm_}, {kv_heads * Dv_, Dm_}});
      names.insert(names.end(), {"q", "k", "v"});
    }
    want.insert(want.end(), {{Dm_, heads * Dv_}, {0, Dm_}, {Dm_, 0}, {0, 0}});
    names.insert(names.end(), {"o", "gate_up", "down", "the next layer's first matrix"});
    for (size_t m = 0; m < nm; m++) {
      c_.layout[m].fp4 = check_layout(scales[m], biases[m], group_sizes[m], bits[m], modes[m]);
      c_.layout[m].group = group_sizes[m];
      c_.layout[m].bits = bits[m];
      c_.layout[m].biases = biases[m].has_value();
      const int64_t N = weights[m].shape(0), K = cols(m);
      if (m == (size_t)projections + 1) {  // gate_up [2 F, hidden]: down takes F columns
        check(N % 2 == 0, what_ + "gate_up must have an even number of rows (gate's, then up's)");
        want[m].first = N;
        want[m + 1].second = N / 2;
      }
      check(m == need || (N == want[m].first && K == want[m].second),
            what_ + names[m] + " has the wrong shape for these heads, kv_heads and head sizes");
      check(K % group_sizes[m] == 0, what_ + names[m] + "'s columns must be a multiple of its group_size");
      check_scales(scales[m], biases[m], {(int)N, (int)(K / group_sizes[m])}, "[N, K / group_size]");
    }
    std::vector<mx::array> held = {*norms[0], *norms[1]};
    for (int i = 2; i < 6; i++)
      if (norms[i]) held.push_back(*norms[i]);
    held.push_back(freqs);
    for (size_t m = 0; m < nm; m++) {
      held.push_back(weights[m]);
      held.push_back(scales[m]);
      if (biases[m]) held.push_back(*biases[m]);
    }
    held_->arrays = std::move(held);
  }

  // The step of x [B, L, hidden] with the cache's buffers [B, kv_heads, S, D], its rows going to column
  // `offset`: causal over the first offset + L columns; or, given `positions` (each row's first new
  // token's, int32 [B]) and `mask` (bool, broadcastable to [B, heads, L, offset + L]), RoPE at each
  // row's positions and attention under the mask (a batch's rows)
  std::vector<mx::array> operator()(const mx::array& x, const mx::array& k_buf, const mx::array& v_buf,
                                    int64_t offset, const std::optional<mx::array>& positions,
                                    const std::optional<mx::array>& mask) const {
    check(x.ndim() == 3 && x.dtype() == mx::float32 && x.shape(2) == Dm_, what_, "x must be float32 [B, L, hidden]");
    const int64_t heads[2] = {D_, Dv_};
    for (int i = 0; i < 2; i++) {
      const auto& a = i == 0 ? k_buf : v_buf;
      check(a.ndim() == 4 && a.dtype() == mx::float32 && a.shape(0) == x.shape(0) && a.shape(1) == c_.hkv &&
                a.shape(3) == heads[i],
            what_, "the cache buffers must be float32 [B, kv_heads, S, head_dim]");
    }
    const int64_t L = x.shape(1);
    check(L >= 1 && L <= 65536, what_, "1 to 65536 tokens per row");
    check(offset >= 0 && offset + L <= k_buf.shape(2) && k_buf.shape(2) == v_buf.shape(2),
          what_, "the buffers must have room for the new rows at offset");
    check(!positions == !mask, what_, "pass a batch's positions and mask together, or neither");
    LayerConfig c = c_;
    c.offset = offset;
    c.rows = positions.has_value();
    std::call_once(*evaluated_, [&] { held_->ready(c_); });
    std::vector<mx::array> inputs = {x};
    if (positions) {
      auto s = mx::default_stream(mx::Device::cpu);
      const int B = x.shape(0), T = (int)(offset + L);
      check(positions->dtype() == mx::int32 && positions->ndim() == 1 && positions->shape(0) == B,
            what_, "positions must be int32 [B]");
      check(mask->dtype() == mx::bool_ && mask->ndim() == 4 && mask->shape(-1) == T && mask->shape(-2) == L,
            what_, "the mask must be boolean [B, 1 or heads, L, offset + L]");
      inputs.push_back(*positions);
      inputs.push_back(mx::broadcast_to(*mask, {B, c.hq, (int)L, T}, s));
    }
    inputs.push_back(k_buf);
    inputs.push_back(v_buf);
    const auto s = mx::default_stream(mx::Device::cpu);
    // a batch's rows stay one op: apart, serving slowed (8 clients 178 against 228 tok/s, the stall check's
    // gap 5.2 s against 1.5: not yet understood)
    if (L < kApartFrom || c.rows)
      return mx::array::make_arrays({x.shape(), k_buf.shape(), v_buf.shape()}, {mx::float32, mx::float32, mx::float32},
                                    std::make_shared<DecoderLayer>(s, c, held_), inputs);
    c.part = kStepRows;
    const mx::Shape q_shape = {x.shape(0), c.hq, (int)L, (int)D_};
    auto rows = mx::array::make_arrays({q_shape, k_buf.shape(), v_buf.shape()}, {mx::float32, mx::float32, mx::float32},
                                       std::make_shared<DecoderLayer>(s, c, held_), inputs);
    c.part = kStepRest;
    inputs.pop_back();
    inputs.pop_back();
    inputs.insert(inputs.end(), rows.begin(), rows.end());
    mx::array y(x.shape(), mx::float32, std::make_shared<DecoderLayer>(s, c, held_), std::move(inputs));
    return {y, rows[1], rows[2]};
  }

 private:
  inline static const std::string what_ = "decoder_layer: ";
  LayerConfig c_;
  std::shared_ptr<LayerArrays> held_ = std::make_shared<LayerArrays>();  // ready at the first step
  std::shared_ptr<std::once_flag> evaluated_ = std::make_shared<std::once_flag>();
  int64_t Dm_ = 0, D_ = 0, Dv_ = 0;
};

// act(gate) * up for a gated MLP's activation: silu (SwiGLU) or the tanh GELU (GeGLU).
class GatedActivation : public mx::UnaryPrimitive {
 public:
  GatedActivation(mx::Stream s, bool gelu) : mx::UnaryPrimitive(s), gelu_(gelu) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    auto& enc = encoder_for(stream(), inputs, out);
    GatedFn fn = gelu_ ? runtime().gelu_tanh_mul : runtime().silu_mul;
    // one input: the fused product [..., 2n], gate its first half and up its second
    const bool fused = inputs.size() == 1;
    enc.dispatch([g = Rows(inputs[0]), u = Rows(inputs[fused ? 0 : 1]), yp = out.data<float>(), fn, fused]() mutable {
      auto [gp, gs] = g.get();
      auto [up, us] = u.get();
      const int64_t n = fused ? g.n() / 2 : g.n();
      if (fused) up += n;
      over_rows(g.rows(), n, [&](int64_t r0, int64_t r1) { fn(gp + r0 * gs, gs, up + r0 * us, us, yp + r0 * n, r1 - r0, n); });
    });
  }

  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("turbospark gated activations run on the CPU only");
  }

  const char* name() const override { return gelu_ ? "TurbosparkGeluTanhMul" : "TurbosparkSiluMul"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    return gelu_ == static_cast<const GatedActivation&>(other).gelu_;
  }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {shape(inputs[0], inputs.size() == 1)};
  }

  static mx::Shape shape(const mx::array& gate, bool fused) {
    auto shape = gate.shape();
    if (fused) shape.back() /= 2;
    return shape;
  }

 private:
  bool gelu_;
};

// up absent: gate is the fused product [..., 2n] (gate's half, then up's)
mx::array gated(const mx::array& gate, const std::optional<mx::array>& up, bool gelu, const char* what) {
  if (up) {
    check(gate.dtype() == mx::float32 && up->dtype() == mx::float32 && gate.shape() == up->shape() && gate.ndim() >= 1,
          std::string(what) + ": gate and up must be float32 arrays of one shape");
  } else {
    check(gate.dtype() == mx::float32 && gate.ndim() >= 1 && gate.shape(-1) % 2 == 0,
          std::string(what) + ": a fused gate/up product must be float32 [..., 2n]");
  }
  auto s = mx::default_stream(mx::Device::cpu);
  std::vector<mx::array> inputs = {gate};
  if (up) inputs.push_back(*up);
  return mx::array(GatedActivation::shape(gate, !up), mx::float32, std::make_shared<GatedActivation>(s, gelu),
                   std::move(inputs));
}

mx::array silu_mul(const mx::array& gate, const std::optional<mx::array>& up) {
  return gated(gate, up, false, "silu_mul");
}
mx::array gelu_tanh_mul(const mx::array& gate, const std::optional<mx::array>& up) {
  return gated(gate, up, true, "gelu_tanh_mul");
}

bool bind_blas(const std::string& path, const std::string& prefix) {
  void* lib = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (lib == nullptr) return false;
  auto fn = reinterpret_cast<sgemm_fn>(dlsym(lib, (prefix + "cblas_sgemm").c_str()));
  if (fn == nullptr) return false;
  runtime().sgemm = fn;
  return true;
}

}  // namespace
}  // namespace tsq

NB_MODULE(_qmm, m) {
  m.doc() = "turbospark native quantized matmul (MLX custom primitive)";
  m.def("quantized_matmul", &tsq::quantized_matmul, nb::arg("x"), nb::arg("w"), nb::arg("scales"),
        nb::arg("biases").none(), nb::kw_only(), nb::arg("group_size"), nb::arg("bits"), nb::arg("mode") = "affine",
        nb::arg("residual") = nb::none(), nb::arg("prologue") = "", nb::arg("prologue_weight") = nb::none(),
        nb::arg("eps") = 0.0f, nb::arg("post_norm") = false, nb::arg("post_weight") = nb::none(),
        nb::arg("post_eps") = 0.0f,
        "x @ dequantize(w, scales, biases).T for MLX's affine layout (transpose=True), float32 compute; "
        "biases None: a symmetric matrix, every bias -2^(bits-1) * its scale; mode 'mxfp4': e2m1 codes times "
        "uint8 exponent scales; residual (float32, the product's shape): added to the product, as one op; "
        "prologue 'rms_norm' (prologue_weight, eps), 'silu_mul' or 'gelu_tanh_mul' (x the fused gate/up "
        "[..., 2K]): applied to x first, as rms_norm()/silu_mul()/gelu_tanh_mul() would; post_norm: each row "
        "of the product RMS-normalized (post_weight, post_eps) before the residual is added.");
  m.def("gather_quantized_matmul", &tsq::gather_quantized_matmul, nb::arg("x"), nb::arg("w"), nb::arg("scales"),
        nb::arg("biases").none(), nb::arg("indices"), nb::kw_only(), nb::arg("group_size"), nb::arg("bits"),
        nb::arg("mode") = "affine",
        "mx.gather_qmm(x, w, scales, biases, rhs_indices=indices, transpose=True) for routed experts: each "
        "element's rows of x times its expert's matrix, float32 compute.");
  m.def("rope", &tsq::rope, nb::arg("x"), nb::arg("dims"), nb::arg("scale"), nb::arg("offset"), nb::arg("freqs"),
        "mx.fast.rope(x, dims, traditional=False, base=None, scale, offset, freqs) for float32 [B, H, L, D] as one op.");
  m.def("decode_attention", &tsq::decode_attention, nb::arg("q"), nb::arg("k"), nb::arg("v"), nb::arg("scale"),
        nb::arg("mask") = nb::none(), nb::arg("causal") = false, nb::arg("merge_heads") = false,
        "mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask) for float32 queries "
        "(mask: None or boolean), as one op; merge_heads: the result as [B, L, H * Dv] (heads side by side).");
  m.def("cache_attention", &tsq::cache_attention, nb::arg("q"), nb::arg("k"), nb::arg("v"), nb::arg("k_buf"),
        nb::arg("v_buf"), nb::arg("offset"), nb::arg("scale"), nb::arg("merge_heads"),
        "Write k, v into the cache buffers at offset and attend q causally to their first offset + L rows: "
        "(attention, k_buf, v_buf).");
  m.def("cache_attention_copies", [] { return tsq::cache_copies.load(); },
        "How many cache buffers cache_attention has copied (instead of writing them in place).");
  m.def("decoder_layer_parts_run", [] {
        return std::vector<int64_t>{tsq::layer_parts_run[0].load(), tsq::layer_parts_run[1].load(),
                                    tsq::layer_parts_run[2].load()};
      },
        "How many decoder_layer steps have run whole, as their rows, and as the rest (from 32 tokens on: apart).");
  m.def("cache_attention_realigned", [] { return tsq::cache_realigned.load(); },
        "How many cache buffers cache_attention has moved onto a cache line (once each).");
  m.def("kv_rows", &tsq::kv_rows, nb::arg("w"), nb::arg("scales"), nb::arg("biases").none(), nb::arg("bits"),
        nb::arg("rotate"),
        "Quantized rows (MLX's affine layout, any leading strides) back to float32; rotate: then the normalized "
        "Walsh-Hadamard transform of each row (mx.hadamard_transform).");
  m.def("kv_place", &tsq::kv_place, nb::arg("parts"), nb::arg("moves"), nb::arg("rows"), nb::arg("capacity"),
        "A batch cache buffer [rows, H, capacity, D] laid out anew: each move (to, part, row, begin, end, dst) "
        "copies columns [begin, end) of row `row` of parts[part] to row `to` from column dst; zeros elsewhere "
        "(whole pages of them left unwritten).");
  m.def("kv_place_unwritten", [] { return tsq::kv_place_unwritten.load(); },
        "Bytes of kv_place's zeros left as unwritten pages (tests read it).");
  m.def("argmax", &tsq::argmax, nb::arg("x"),
        "mx.argmax(x, axis=-1) for float32 x as one op (long rows split over the threads): uint32 indices.");
  m.def("rms_norm", &tsq::rms_norm, nb::arg("x"), nb::arg("weight").none(), nb::arg("eps"),
        "mx.fast.rms_norm(x, weight, eps) for float32 x as one op.");
  m.def("silu_mul", &tsq::silu_mul, nb::arg("gate"), nb::arg("up").none(),
        "gate * mx.sigmoid(gate) * up for float32 arrays of one shape, as one op; up None: gate is the fused "
        "product [..., 2n] (gate's half first).");
  m.def("gelu_tanh_mul", &tsq::gelu_tanh_mul, nb::arg("gate"), nb::arg("up").none(),
        "mlx.nn.gelu_approx(gate) * up for float32 arrays of one shape, as one op; up None: gate is the fused "
        "product [..., 2n] (gate's half first).");
  m.def("rope_heads", &tsq::rope_heads, nb::arg("projections"), nb::arg("heads"), nb::arg("kv_heads"),
        nb::arg("dims"), nb::arg("scale"), nb::arg("mscale"), nb::arg("offset"), nb::arg("freqs"),
        nb::arg("q_norm").none(), nb::arg("k_norm").none(), nb::arg("eps"),
        "q, k, v [B, H, L, D] from the fused q/k/v product [B, L, (heads + 2 kv_heads) * D] (or [q, k, v]): "
        "q's and k's heads RMS-normalized (weights given), their first dims features times mscale and rotated "
        "as rope(), as one op.");
  nb::class_<tsq::DecoderLayerOp>(
      m, "DecoderLayerOp",
      "A pre-norm decoder layer's step as one op, its weights held: op(x, k_buf, v_buf, offset) -> (y, k_buf, "
      "v_buf). norms: [in, mlp, post_attn, post_mlp, q_norm, k_norm] (None where absent); the q/k/v "
      "(projections: 1 fused or 3), o, gate_up and down matrices as quantized_matmul takes them, then optionally "
      "the next layer's first (only prefetched); the step's rows written into the buffers at offset, attended "
      "causally; each part as its own op computes it.")
      .def(nb::init<const std::vector<std::optional<mx::array>>&, const std::vector<mx::array>&,
                    const std::vector<mx::array>&, const std::vector<std::optional<mx::array>>&,
                    const std::vector<int>&, const std::vector<int>&, const std::vector<std::string>&, int,
                    const mx::array&, int, int, int, float, float, float, float, const std::string&>(),
           nb::arg("norms"), nb::arg("weights"), nb::arg("scales"), nb::arg("biases"), nb::arg("group_sizes"),
           nb::arg("bits"), nb::arg("modes"), nb::arg("projections"), nb::arg("freqs"), nb::kw_only(),
           nb::arg("heads"), nb::arg("kv_heads"), nb::arg("dims"), nb::arg("rope_scale"), nb::arg("mscale"),
           nb::arg("eps"), nb::arg("scale"), nb::arg("activation"))
      .def("__call__", &tsq::DecoderLayerOp::operator(), nb::arg("x"), nb::arg("k_buf"), nb::arg("v_buf"),
           nb::arg("offset"), nb::arg("positions") = nb::none(), nb::arg("mask") = nb::none());
  m.def("bind_blas", &tsq::bind_blas, nb::arg("path"), nb::arg("prefix"),
        "Use prefix+'cblas_sgemm' from the library at path for large-M products.");
  m.def(
      "place_on_huge_pages",
      [](std::vector<mx::array> arrays, int64_t batch_bytes, double budget_seconds, int64_t min_bytes) {
        const auto placed =
            tsq::place_on_huge_pages(std::move(arrays), batch_bytes, budget_seconds, min_bytes, *tsq::runtime().pool);
        return std::make_tuple(placed.bytes, placed.movable, placed.seconds);
      },
      nb::arg("arrays"), nb::arg("batch_bytes"), nb::arg("budget_seconds"), nb::arg("min_bytes"),
      "Move the evaluated arrays' buffers (those only they read, dense) onto transparent huge pages where the kernel "
      "gives them, unless fewer than min_bytes could move; the arrays keep their identity. The largest go first; "
      "once budget_seconds (> 0) have passed no further buffer starts after the first. Returns (bytes moved, bytes "
      "movable, seconds).");
  m.def("mlx_version", [] { return std::string(TSQ_MLX_VERSION); }, "The MLX version this module was built against.");
  m.def("kernel", [] { return tsq::runtime().kernel; }, "Which kernel set runs: 'avx512', 'avx2', 'neon' or 'scalar'.");
  m.def("threads", [] { return tsq::runtime().pool->threads(); }, "Threads the kernels use.");
  m.def("has_blas", [] { return tsq::runtime().sgemm != nullptr; }, "Whether sgemm is bound (for dequantized panels).");
  m.def(
      "gemm_path",
      [] {
        auto& rt = tsq::runtime();
        if (rt.gemm != nullptr && !rt.blas_gemm) return std::string("native");
        return std::string(rt.sgemm != nullptr ? "blas" : "rows");
      },
      "How products from gemm_min_rows() rows of x run: 'native' GEMM, 'blas' (dequantized panels through "
      "sgemm) or 'rows' (the row kernels).");
  m.def(
      "set_gemm_path", [](const std::string& path) { tsq::runtime().blas_gemm = path != "native"; }, nb::arg("path"),
      "Use the native GEMM ('native', where the kernel set has one) or sgemm panels ('blas').");
  m.def("gemm_min_rows", [] { return tsq::runtime().gemm_min_rows; }, "Rows of x from which the GEMM path is used.");
  m.def("set_gemm_min_rows", [](int64_t rows) { tsq::runtime().gemm_min_rows = rows; }, nb::arg("rows"),
        "Rows of x at or above which products dequantize panels and call sgemm.");
}
