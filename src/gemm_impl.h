/* gemm_impl.h: the portable matrix-multiply kernels, written once for
 * T = float and T = double (included twice by gemm.c with T, SUF and LANES).
 *
 * gemm_nt: C (M, N) = A (M, K) · B (N, K)ᵀ: rows of A and B are both
 *   contiguous, so each output is a dot product.  LANES partial sums per
 *   output run along k (an explicit, fixed reassociation the compiler can
 *   vectorise without -ffast-math) and are added in a fixed order: the
 *   result never depends on threads or tiling.
 * gemm_nn: C (M, N) = A (M, K) · B (K, N): rows of B are contiguous, so the
 *   kernel broadcasts A[i][k] and runs along j (axpy form). */

#define NT_MR 2
#define NT_NR 4
#define NN_MR 4
#define NN_NR (4 * LANES)

static inline T SUF(reduce_lanes)(const T *v)
{
    T s[LANES];
    int l, w;
    for (l = 0; l < LANES; l++) s[l] = v[l];
    for (w = LANES / 2; w > 0; w /= 2)
        for (l = 0; l < w; l++) s[l] += s[l + w];
    return s[0];
}

/* one output: the same summation order as the tiled kernel below */
static inline T SUF(dot)(int64_t K, const T *a, const T *b)
{
    T acc[LANES] = {0};
    int64_t k = 0;
    int l;
    for (; k + LANES <= K; k += LANES)
        for (l = 0; l < LANES; l++) acc[l] += a[k + l] * b[k + l];
    T s = SUF(reduce_lanes)(acc);
    for (; k < K; k++) s += a[k] * b[k];
    return s;
}

static void SUF(nt_tile)(int64_t K, const T *A, int64_t lda, const T *B, int64_t ldb,
                         T out[NT_MR][NT_NR])
{
    T acc[NT_MR][NT_NR][LANES];
    int64_t k = 0;
    int r, c, l;
    for (r = 0; r < NT_MR; r++)
        for (c = 0; c < NT_NR; c++)
            for (l = 0; l < LANES; l++) acc[r][c][l] = 0;
    for (; k + LANES <= K; k += LANES)
        for (r = 0; r < NT_MR; r++)
            for (c = 0; c < NT_NR; c++)
                for (l = 0; l < LANES; l++)
                    acc[r][c][l] += A[r * lda + k + l] * B[c * ldb + k + l];
    for (r = 0; r < NT_MR; r++)
        for (c = 0; c < NT_NR; c++) {
            T s = SUF(reduce_lanes)(acc[r][c]);
            int64_t kk;
            for (kk = k; kk < K; kk++) s += A[r * lda + kk] * B[c * ldb + kk];
            out[r][c] = s;
        }
}

void SUF(mha_gemm_nt)(int64_t M, int64_t N, int64_t K, const T *A, int64_t lda,
                      const T *B, int64_t ldb, const T *bias, T *C, int64_t ldc,
                      int accumulate)
{
    int64_t i, j;
    T tile[NT_MR][NT_NR];
    for (i = 0; i < M; i += NT_MR) {
        int64_t mr = M - i < NT_MR ? M - i : NT_MR;
        for (j = 0; j < N; j += NT_NR) {
            int64_t nr = N - j < NT_NR ? N - j : NT_NR;
            int64_t r, c;
            if (mr == NT_MR && nr == NT_NR) {
                SUF(nt_tile)(K, A + i * lda, lda, B + j * ldb, ldb, tile);
            } else {
                for (r = 0; r < mr; r++)
                    for (c = 0; c < nr; c++)
                        tile[r][c] = SUF(dot)(K, A + (i + r) * lda, B + (j + c) * ldb);
            }
            for (r = 0; r < mr; r++) {
                T *c_row = C + (i + r) * ldc + j;
                for (c = 0; c < nr; c++) {
                    T v = tile[r][c];
                    if (bias) v += bias[j + c];
                    c_row[c] = accumulate ? c_row[c] + v : v;
                }
            }
        }
    }
}

void SUF(mha_gemm_nn)(int64_t M, int64_t N, int64_t K, const T *A, int64_t lda,
                      const T *B, int64_t ldb, const T *bias, T *C, int64_t ldc,
                      int accumulate)
{
    int64_t i, j, k;
    T acc[NN_MR][NN_NR];
    for (i = 0; i < M; i += NN_MR) {
        int64_t mr = M - i < NN_MR ? M - i : NN_MR;
        for (j = 0; j < N; j += NN_NR) {
            int64_t nr = N - j < NN_NR ? N - j : NN_NR;
            int64_t r, c;
            if (mr == NN_MR && nr == NN_NR) {
                for (r = 0; r < NN_MR; r++)
                    for (c = 0; c < NN_NR; c++) acc[r][c] = 0;
                for (k = 0; k < K; k++) {
                    const T *b_k = B + k * ldb + j;
                    for (r = 0; r < NN_MR; r++) {
                        T a = A[(i + r) * lda + k];
                        for (c = 0; c < NN_NR; c++) acc[r][c] += a * b_k[c];
                    }
                }
            } else {
                for (r = 0; r < mr; r++)
                    for (c = 0; c < nr; c++) acc[r][c] = 0;
                for (k = 0; k < K; k++) {
                    const T *b_k = B + k * ldb + j;
                    for (r = 0; r < mr; r++) {
                        T a = A[(i + r) * lda + k];
                        for (c = 0; c < nr; c++) acc[r][c] += a * b_k[c];
                    }
                }
            }
            for (r = 0; r < mr; r++) {
                T *c_row = C + (i + r) * ldc + j;
                for (c = 0; c < nr; c++) {
                    T v = acc[r][c];
                    if (bias) v += bias[j + c];
                    c_row[c] = accumulate ? c_row[c] + v : v;
                }
            }
        }
    }
}

#undef NT_MR
#undef NT_NR
#undef NN_MR
#undef NN_NR
