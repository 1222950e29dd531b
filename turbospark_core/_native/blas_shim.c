/* Route MLX's CPU matmuls to an optimized BLAS.
 *
 * MLX's Linux CPU wheel links a reference BLAS; it calls only cblas_sgemm,
 * cblas_dgemm and cblas_cgemm. Loaded RTLD_GLOBAL before MLX, this library's
 * definitions of those symbols win, and forward to an optimized BLAS whose
 * symbols carry a prefix (scipy-openblas32: "scipy_cblas_sgemm"), bound at
 * run time by turbospark_blas_bind(). A single-row product goes to sgemv,
 * which is several times faster than OpenBLAS's gemm on one row.
 *
 * When MLX was loaded first, its calls are already bound to the reference
 * BLAS; turbospark_blas_patch() then rewrites the entries for those symbols
 * in the loaded libmlx's relocation slots (GOT) to point here.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <elf.h>
#include <link.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

typedef void (*sgemm_fn)(int, int, int, int, int, int, float, const float *, int, const float *, int, float, float *, int);
typedef void (*sgemv_fn)(int, int, int, int, float, const float *, int, const float *, int, float, float *, int);
typedef void (*dgemm_fn)(int, int, int, int, int, int, double, const double *, int, const double *, int, double, double *, int);
typedef void (*cgemm_fn)(int, int, int, int, int, int, const void *, const void *, int, const void *, int, const void *, void *, int);

static sgemm_fn real_sgemm;
static sgemv_fn real_sgemv;
static dgemm_fn real_dgemm;
static cgemm_fn real_cgemm;

static long sgemm_calls; /* products routed through this shim (for tests) */

long turbospark_blas_calls(void) { return __atomic_load_n(&sgemm_calls, __ATOMIC_RELAXED); }

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
    __atomic_fetch_add(&sgemm_calls, 1, __ATOMIC_RELAXED);
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

/* ---- patching an already loaded libmlx ---- */

struct patch_state {
    const char *needle; /* substring of the library path */
    int patched;        /* slots rewritten */
    int found;          /* libraries matched */
};

static void *replacement(const char *name) {
    if (strcmp(name, "cblas_sgemm") == 0) return (void *)cblas_sgemm;
    if (strcmp(name, "cblas_dgemm") == 0) return (void *)cblas_dgemm;
    if (strcmp(name, "cblas_cgemm") == 0) return (void *)cblas_cgemm;
    return NULL;
}

static uintptr_t dyn_ptr(uintptr_t base, uintptr_t value) {
    /* glibc relocates these in place on most targets; not on all */
    return value < base ? base + value : value;
}

static int patch_table(uintptr_t base, const ElfW(Rela) *rel, size_t size, const ElfW(Sym) *symtab, const char *strtab) {
    int n = 0;
    long page = sysconf(_SC_PAGESIZE);
    for (size_t i = 0; i < size / sizeof(ElfW(Rela)); i++) {
        size_t sym = ELF64_R_SYM(rel[i].r_info);
        if (sym == 0) continue;
        void *target = replacement(strtab + symtab[sym].st_name);
        if (target == NULL) continue;
        void **slot = (void **)(base + rel[i].r_offset);
        uintptr_t start = (uintptr_t)slot & ~(uintptr_t)(page - 1);
        if (mprotect((void *)start, (size_t)page, PROT_READ | PROT_WRITE) != 0) continue;
        *slot = target;
        n++;
    }
    return n;
}

static int patch_object(struct dl_phdr_info *info, size_t size, void *data) {
    struct patch_state *st = data;
    (void)size;
    if (info->dlpi_name == NULL || strstr(info->dlpi_name, st->needle) == NULL) return 0;
    st->found++;
    uintptr_t base = info->dlpi_addr;
    for (int p = 0; p < info->dlpi_phnum; p++) {
        if (info->dlpi_phdr[p].p_type != PT_DYNAMIC) continue;
        const ElfW(Dyn) *dyn = (const ElfW(Dyn) *)(base + info->dlpi_phdr[p].p_vaddr);
        const ElfW(Sym) *symtab = NULL;
        const char *strtab = NULL;
        const ElfW(Rela) *jmprel = NULL, *rela = NULL;
        size_t jmpsz = 0, relasz = 0;
        for (; dyn->d_tag != DT_NULL; dyn++) {
            switch (dyn->d_tag) {
                case DT_SYMTAB: symtab = (const ElfW(Sym) *)dyn_ptr(base, dyn->d_un.d_ptr); break;
                case DT_STRTAB: strtab = (const char *)dyn_ptr(base, dyn->d_un.d_ptr); break;
                case DT_JMPREL: jmprel = (const ElfW(Rela) *)dyn_ptr(base, dyn->d_un.d_ptr); break;
                case DT_PLTRELSZ: jmpsz = dyn->d_un.d_val; break;
                case DT_RELA: rela = (const ElfW(Rela) *)dyn_ptr(base, dyn->d_un.d_ptr); break;
                case DT_RELASZ: relasz = dyn->d_un.d_val; break;
                default: break;
            }
        }
        if (symtab == NULL || strtab == NULL) continue;
        if (jmprel != NULL) st->patched += patch_table(base, jmprel, jmpsz, symtab, strtab);
        if (rela != NULL) st->patched += patch_table(base, rela, relasz, symtab, strtab);
    }
    return 0;
}

/* Point the BLAS slots of every loaded library whose path contains `needle`
 * (e.g. "libmlx") at this shim. Returns the number of slots rewritten, or -1
 * when no such library is loaded. Call turbospark_blas_bind() first. */
int turbospark_blas_patch(const char *needle) {
    if (!real_sgemm) return 0;
    struct patch_state st = {needle, 0, 0};
    dl_iterate_phdr(patch_object, &st);
    return st.found ? st.patched : -1;
}
