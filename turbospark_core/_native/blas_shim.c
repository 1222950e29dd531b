/* Route MLX's CPU matmuls to an optimized BLAS.
 *
 * MLX's Linux CPU wheel links a reference BLAS; it calls only cblas_sgemm,
 * cblas_dgemm and cblas_cgemm. Loaded RTLD_GLOBAL before MLX, this library's
 * definitions of those symbols win, and forward to an optimized BLAS whose
 * symbols carry a prefix (scipy-openblas32: "scipy_cblas_sgemm"), bound at
 * run time by turbospark_blas_bind(). A single-row product goes to sgemv,
 * which is several times faster than OpenBLAS's gemm on one row.
 */
#include <dlfcn.h>
#include <stdio.h>

typedef void (*sgemm_fn)(int, int, int, int, int, int, float, const float *, int, const float *, int, float, float *, int);
typedef void (*sgemv_fn)(int, int, int, int, float, const float *, int, const float *, int, float, float *, int);
typedef void (*dgemm_fn)(int, int, int, int, int, int, double, const double *, int, const double *, int, double, double *, int);
typedef void (*cgemm_fn)(int, int, int, int, int, int, const void *, const void *, int, const void *, int, const void *, void *, int);

static sgemm_fn real_sgemm;
static sgemv_fn real_sgemv;
static dgemm_fn real_dgemm;
static cgemm_fn real_cgemm;

enum { ROW_MAJOR = 101, NO_TRANS = 111, TRANS = 112 };

static void *find(void *lib, const char *prefix, const char *name) {
    char full[128];
    snprintf(full, sizeof full, "%s%s", prefix, name);
    return dlsym(lib, full);
}

int turbospark_blas_bind(const char *path, const char *prefix) {
    void *lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (!lib) return 0;
    real_sgemm = (sgemm_fn)find(lib, prefix, "cblas_sgemm");
    real_sgemv = (sgemv_fn)find(lib, prefix, "cblas_sgemv");
    real_dgemm = (dgemm_fn)find(lib, prefix, "cblas_dgemm");
    real_cgemm = (cgemm_fn)find(lib, prefix, "cblas_cgemm");
    return real_sgemm && real_sgemv && real_dgemm && real_cgemm;
}

void cblas_sgemm(int order, int ta, int tb, int m, int n, int k, float alpha, const float *a, int lda,
                 const float *b, int ldb, float beta, float *c, int ldc) {
    if (order == ROW_MAJOR && m == 1) {
        int inc = (ta == NO_TRANS) ? 1 : lda;
        if (tb == TRANS)
            real_sgemv(ROW_MAJOR, NO_TRANS, n, k, alpha, b, ldb, a, inc, beta, c, 1);
        else
            real_sgemv(ROW_MAJOR, TRANS, k, n, alpha, b, ldb, a, inc, beta, c, 1);
        return;
    }
    real_sgemm(order, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

void cblas_dgemm(int order, int ta, int tb, int m, int n, int k, double alpha, const double *a, int lda,
                 const double *b, int ldb, double beta, double *c, int ldc) {
    real_dgemm(order, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

void cblas_cgemm(int order, int ta, int tb, int m, int n, int k, const void *alpha, const void *a, int lda,
                 const void *b, int ldb, const void *beta, void *c, int ldc) {
    real_cgemm(order, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}
