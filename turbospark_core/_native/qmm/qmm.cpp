// MLX custom primitive: y = x @ dequantize(w, scales, biases).T for MLX's
// affine layout, computed on the CPU without unpacking the whole weight.
#include <dlfcn.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include "mlx/backend/cpu/encoder.h"
#include "mlx/mlx.h"
#include "mlx/primitives.h"

#include "kernels.h"
#include "pool.h"

namespace nb = nanobind;
namespace mx = mlx::core;

namespace tsq {
namespace {

using sgemm_fn = void (*)(int, int, int, int, int, int, float, const float*, int, const float*, int, float, float*, int);

struct Runtime {
  RowsFn rows = rows_scalar;
  DequantFn dequant = dequant_scalar;
  std::string kernel = "scalar";
  sgemm_fn sgemm = nullptr;
  // M at or above which panels go through sgemm (single-threaded OpenBLAS per
  // panel measured 3-4x the row kernel's throughput at M = 64..256 here).
  int64_t gemm_min_rows = 17;
  std::unique_ptr<Pool> pool;
};

int default_threads() {
  if (const char* env = std::getenv("TURBOSPARK_THREADS")) {
    int n = std::atoi(env);
    if (n > 0) return n;
  }
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof set, &set) == 0) return std::max(1, CPU_COUNT(&set));
  return std::max(1u, std::thread::hardware_concurrency());
}

Runtime& runtime() {
  static Runtime* rt = [] {
    auto* r = new Runtime();
#if defined(__x86_64__)
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c")) {
      r->rows = rows_avx2;
      r->dequant = dequant_avx2;
      r->kernel = "avx2";
    }
#endif
    if (std::getenv("TURBOSPARK_NATIVE_SCALAR")) {
      r->rows = rows_scalar;
      r->dequant = dequant_scalar;
      r->kernel = "scalar";
    }
    if (const char* env = std::getenv("TURBOSPARK_QMM_PANEL_ROWS")) r->gemm_min_rows = std::max(1, std::atoi(env));
    r->pool = std::make_unique<Pool>(default_threads());
    return r;
  }();
  return *rt;
}

// Weight rows per chunk: enough work per chunk to pay for the hand-off.
int64_t chunk_rows(int64_t N, int64_t K, int64_t M, int threads) {
  const int64_t work_per_row = K * std::max<int64_t>(M, 1);
  // ~128k multiply-adds per chunk: a hand-off costs a wake-up (microseconds), not more
  const int64_t min_rows = std::max<int64_t>(1, (1 << 17) / std::max<int64_t>(work_per_row, 1));
  const int64_t balanced = (N + threads * 4 - 1) / (threads * 4);
  return std::max(min_rows, balanced);
}

void run_rows(const QMat& q, const float* x, int64_t M, float* y) {
  Runtime& rt = runtime();
  const int64_t step = chunk_rows(q.N, q.K, M, rt.pool->threads());
  const int64_t chunks = (q.N + step - 1) / step;
  rt.pool->run(chunks, [&](int64_t c) {
    const int64_t n0 = c * step, n1 = std::min(q.N, n0 + step);
    rt.rows(q, x, M, y, q.N, n0, n1);
  });
}

// Large M: each chunk dequantizes a panel of weight rows into its own small
// scratch and multiplies it with sgemm. OpenBLAS runs single-threaded here
// (turbospark_core.native sets it so): this pool spreads the panels, and no
// BLAS thread spins waiting for work on a shared core.
void run_panels(const QMat& q, const float* x, int64_t M, float* y) {
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
  });
}

void compute(const QMat& q, const float* x, int64_t M, float* y) {
  Runtime& rt = runtime();
  if (rt.sgemm != nullptr && M >= rt.gemm_min_rows) return run_panels(q, x, M, y);
  run_rows(q, x, M, y);
}

int scale_type(mx::Dtype d) {
  if (d == mx::float32) return kF32;
  if (d == mx::float16) return kF16;
  if (d == mx::bfloat16) return kBF16;
  throw std::invalid_argument("quantized_matmul: scales/biases must be float32, float16 or bfloat16");
}

class QuantizedMatmul : public mx::UnaryPrimitive {
 public:
  QuantizedMatmul(mx::Stream s, int group, int bits) : mx::UnaryPrimitive(s), group_(group), bits_(bits) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    const auto& x = inputs[0];
    const auto& w = inputs[1];
    const auto& scales = inputs[2];
    const auto& biases = inputs[3];
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& enc = mx::cpu::get_command_encoder(stream());
    for (const auto& a : inputs) enc.set_input_array(a);
    enc.set_output_array(out);
    QMat q;
    q.w = w.data<uint8_t>();
    q.scales = scales.data<void>();
    q.biases = biases.data<void>();
    q.scale_type = scale_type(scales.dtype());
    q.N = w.shape(0);
    q.K = x.shape(-1);
    q.group = group_;
    q.bits = bits_;
    const int64_t M = x.size() / q.K;
    enc.dispatch([q, xp = x.data<float>(), yp = out.data<float>(), M]() { compute(q, xp, M, yp); });
  }

  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("turbospark quantized_matmul runs on the CPU only");
  }

  const char* name() const override { return "TurbosparkQuantizedMatmul"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const QuantizedMatmul&>(other);
    return group_ == o.group_ && bits_ == o.bits_;
  }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    auto shape = inputs[0].shape();
    shape.back() = inputs[1].shape(0);
    return {shape};
  }

 private:
  int group_, bits_;
};

void check(bool ok, const std::string& msg) {
  if (!ok) throw std::invalid_argument("quantized_matmul: " + msg);
}

// The kernels read dense row-major buffers; weights usually are already (no graph node then).
mx::array row_major(const mx::array& a, mx::Stream s) {
  if (a.is_available() && a.flags().row_contiguous) return a;
  return mx::contiguous(a, false, s);
}

mx::array quantized_matmul(const mx::array& x_in, const mx::array& w, const mx::array& scales, const mx::array& biases,
                           int group_size, int bits) {
  check(bits == 2 || bits == 3 || bits == 4 || bits == 5 || bits == 6 || bits == 8,
        "bits must be 2, 3, 4, 5, 6 or 8, got " + std::to_string(bits));
  check(group_size >= 8 && group_size % 8 == 0, "group_size must be a multiple of 8, got " + std::to_string(group_size));
  check(w.dtype() == mx::uint32 && w.ndim() == 2, "w must be a 2-D uint32 array");
  check(x_in.ndim() >= 1, "x must have at least one dimension");
  const int64_t N = w.shape(0), K = (int64_t)w.shape(1) * 32 / bits;
  std::ostringstream shape_msg;
  shape_msg << "x's last dimension " << x_in.shape(-1) << " does not match the weight's " << K << " columns";
  check(x_in.shape(-1) == K, shape_msg.str());
  check(K % group_size == 0, "the weight's columns must be a multiple of group_size");
  const mx::Shape sshape = {(int)N, (int)(K / group_size)};
  check(scales.shape() == sshape && biases.shape() == sshape, "scales/biases must have shape [N, K / group_size]");
  check(scales.dtype() == biases.dtype(), "scales and biases must share a dtype");
  scale_type(scales.dtype());
  auto s = mx::default_stream(mx::Device::cpu);
  const mx::Dtype out_dtype = x_in.dtype();
  check(mx::issubdtype(out_dtype, mx::floating), "x must be a floating-point array");
  auto x = row_major(mx::astype(x_in, mx::float32, s), s);
  auto out_shape = x.shape();
  out_shape.back() = (int)N;
  auto y = mx::array(out_shape, mx::float32, std::make_shared<QuantizedMatmul>(s, group_size, bits),
                     {x, row_major(w, s), row_major(scales, s), row_major(biases, s)});
  return out_dtype == mx::float32 ? y : mx::astype(y, out_dtype, s);
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
  m.def("quantized_matmul", &tsq::quantized_matmul, nb::arg("x"), nb::arg("w"), nb::arg("scales"), nb::arg("biases"),
        nb::kw_only(), nb::arg("group_size"), nb::arg("bits"),
        "x @ dequantize(w, scales, biases).T for MLX's affine layout (transpose=True), float32 compute.");
  m.def("bind_blas", &tsq::bind_blas, nb::arg("path"), nb::arg("prefix"),
        "Use prefix+'cblas_sgemm' from the library at path for large-M products.");
  m.def("mlx_version", [] { return std::string(TSQ_MLX_VERSION); }, "The MLX version this module was built against.");
  m.def("kernel", [] { return tsq::runtime().kernel; }, "Which kernel set runs: 'avx2' or 'scalar'.");
  m.def("threads", [] { return tsq::runtime().pool->threads(); }, "Threads the kernels use.");
  m.def("has_blas", [] { return tsq::runtime().sgemm != nullptr; }, "Whether large-M products go through sgemm.");
  m.def("gemm_min_rows", [] { return tsq::runtime().gemm_min_rows; }, "Rows of x from which sgemm panels are used.");
  m.def("set_gemm_min_rows", [](int64_t rows) { tsq::runtime().gemm_min_rows = rows; }, nb::arg("rows"),
        "Rows of x at or above which products dequantize panels and call sgemm.");
}
