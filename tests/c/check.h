/* check.h: what the C test programs after test_core.c share (test_backward.c,
 * test_saved.c, test_options.c, test_sdpa.c, test_cache.c): the CHECK counter, a deterministic random stream, and the
 * comparison of a fast result with its reference.  Each program includes it
 * once and prints "N passed, N failed". */
#ifndef MHA_TEST_CHECK_H
#define MHA_TEST_CHECK_H
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "mha.h"

static int g_pass, g_fail;

#define CHECK(cond, ...)                                                  \
    do {                                                                  \
        if (cond) g_pass++;                                               \
        else {                                                            \
            g_fail++;                                                     \
            printf("FAIL %s:%d: ", __FILE__, __LINE__);                   \
            printf(__VA_ARGS__);                                          \
            printf("\n");                                                 \
        }                                                                 \
    } while (0)

/* uniform in [-1, 1) */
static inline double lcg_next(uint64_t *s)
{
    *s = *s * 6364136223846793005ULL + 1442695040888963407ULL;
    return (double)(*s >> 11) * 0x1.0p-53 * 2.0 - 1.0;
}

/* n random scalars of dtype (float32: values exactly representable, so
 * that float64 copies hold the same numbers) */
static inline void *rand_array(mha_dtype dt, int64_t n, uint64_t *s)
{
    int64_t i;
    void *x = malloc((size_t)(n + 1) * mha_dtype_size(dt));
    for (i = 0; i < n; i++) {
        double v = lcg_next(s);
        if (dt == MHA_FLOAT32) ((float *)x)[i] = (float)v;
        else ((double *)x)[i] = v;
    }
    return x;
}

static inline double get(mha_dtype dt, const void *x, int64_t i)
{
    return dt == MHA_FLOAT32 ? (double)((const float *)x)[i] : ((const double *)x)[i];
}

/* max |x - r| over n scalars where r is not NaN, relative to max(1, max |r|);
 * NaN positions must agree (counted in *nan_bad) */
static inline double rel_err(mha_dtype dt, const void *x, const void *r, int64_t n, int64_t *nan_bad)
{
    double err = 0, scale = 1;
    int64_t i;
    for (i = 0; i < n; i++) {
        double a = get(dt, x, i), b = get(dt, r, i);
        if (isnan(a) != isnan(b)) (*nan_bad)++;
        else if (!isnan(b)) {
            if (isinf(b) || isinf(a)) {
                if (a != b) (*nan_bad)++;
                continue;
            }
            err = fmax(err, fabs(a - b));
            scale = fmax(scale, fabs(b));
        }
    }
    return err / scale;
}

/* the tolerance of fast vs reference in dtype */
static inline double tol(mha_dtype dt)
{
    return dt == MHA_FLOAT32 ? 2e-5 : 1e-12;
}

static const char *const g_isas[4] = {"portable", "avx2", "avx512", "amx"};

#endif /* MHA_TEST_CHECK_H */
