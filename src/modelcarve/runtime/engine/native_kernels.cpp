// The engine's native CPU kernels (runtime/engine/native.py builds and loads them):
//
// * mc_gemm_bf16: y = x W^T + b for bf16 x [m, k] and a bf16 weight W [n, k] packed by native.py,
//   with fp32 accumulation (AVX512-BF16 VDPBF16PS) and one rounding to bf16 at the end;
//   mc_gemm_f32 (below) is its fp32 twin.
// * mc_decode_attention (below): one decode step's attention over the paged KV cache.
//
// Packed layout: the rows of W in groups of 64 (the last group padded with zero rows), each group
// stored pair of columns by pair of columns: group g, pair p = (k 2p, k 2p + 1) is 64 rows x 2
// values = 256 contiguous bytes, so one group is read front to back as a single stream
// ([n_groups][k / 2][64][2] uint16). One VDPBF16PS multiplies 16 rows' pair by x's pair
// (broadcast) and adds both products into each row's fp32 accumulator: no horizontal sums.
//
// Tiles: 6 rows of x by one 64-row group (24 zmm accumulators, 4 of weights, 1 of x), the group's
// weights re-read from cache for each further tile of 6 rows. Groups are split over OpenMP
// threads (none are started for one thread).
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#include <vector>

namespace {

constexpr int GROUP = 64;   // weight rows per packed group (4 zmm of 16 fp32 accumulators)
constexpr int NB = GROUP / 16;
constexpr int MT_MAX = 6;   // x rows per tile

// The lanes of a 16-wide vector that hold one of the ``left`` values still to go (all 16 if more).
inline __mmask16 tail_mask(int64_t left) {
    return left >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << left) - 1u);
}

struct Bf16 {  // x, W, bias and y bf16 (uint16_t), W in column pairs: ``depth`` = k / 2 pairs
template <int MT>
static void tile(const uint16_t* x, int64_t ldx, int64_t pairs, const uint16_t* group, const uint16_t* bias,
                 uint16_t* y, int64_t ldy, int64_t col0, int64_t n) {
    __m512 acc[MT][NB];
#pragma GCC unroll 8
    for (int i = 0; i < MT; ++i)
#pragma GCC unroll 4
        for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_setzero_ps();
    const uint32_t* xr[MT];
#pragma GCC unroll 8
    for (int i = 0; i < MT; ++i) xr[i] = reinterpret_cast<const uint32_t*>(x + i * ldx);
    const uint16_t* w = group;
    for (int64_t p = 0; p < pairs; ++p, w += 2 * GROUP) {
        __m512bh wv[NB];
#pragma GCC unroll 4
        for (int j = 0; j < NB; ++j) wv[j] = (__m512bh)_mm512_loadu_si512(w + 32 * j);
#pragma GCC unroll 8
        for (int i = 0; i < MT; ++i) {
            __m512bh xv = (__m512bh)_mm512_set1_epi32(static_cast<int>(xr[i][p]));
#pragma GCC unroll 4
            for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], wv[j], xv);
        }
    }
#pragma GCC unroll 4
    for (int j = 0; j < NB; ++j) {
        const int64_t col = col0 + 16 * j;
        if (col >= n) break;
        const __mmask16 mask = tail_mask(n - col);
        const __m512 b = bias ? _mm512_cvtpbh_ps((__m256bh)_mm256_maskz_loadu_epi16(mask, bias + col)) : _mm512_setzero_ps();
#pragma GCC unroll 8
        for (int i = 0; i < MT; ++i) {
            const __m256bh r = _mm512_cvtneps_pbh(_mm512_add_ps(acc[i][j], b));
            _mm256_mask_storeu_epi16(y + i * ldy + col, mask, (__m256i)r);
        }
    }
}
};

// mc_gemm_f32's tile: W packed [n_groups][k][64] (each column k of a 64-row group is 256
// contiguous bytes), one FMA per 16 rows and column with x's value broadcast.
struct F32 {  // x, W, bias and y fp32, W column by column: ``depth`` = k
template <int MT>
static void tile(const float* x, int64_t ldx, int64_t k, const float* group, const float* bias, float* y,
                 int64_t ldy, int64_t col0, int64_t n) {
    __m512 acc[MT][NB];
#pragma GCC unroll 8
    for (int i = 0; i < MT; ++i)
#pragma GCC unroll 4
        for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_setzero_ps();
    const float* w = group;
    for (int64_t c = 0; c < k; ++c, w += GROUP) {
        __m512 wv[NB];
#pragma GCC unroll 4
        for (int j = 0; j < NB; ++j) wv[j] = _mm512_loadu_ps(w + 16 * j);
#pragma GCC unroll 8
        for (int i = 0; i < MT; ++i) {
            const __m512 xv = _mm512_set1_ps(x[i * ldx + c]);
#pragma GCC unroll 4
            for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_fmadd_ps(wv[j], xv, acc[i][j]);
        }
    }
#pragma GCC unroll 4
    for (int j = 0; j < NB; ++j) {
        const int64_t col = col0 + 16 * j;
        if (col >= n) break;
        const __mmask16 mask = tail_mask(n - col);
        const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + col) : _mm512_setzero_ps();
#pragma GCC unroll 8
        for (int i = 0; i < MT; ++i) _mm512_mask_storeu_ps(y + i * ldy + col, mask, _mm512_add_ps(acc[i][j], b));
    }
}
};

// y = x W^T + b for either kernel: the 64-row groups split over threads, each group's rows of x
// in tiles of MT_MAX (the last one shorter), each tile one ``K::tile<MT>``.
template <class K, typename T>
void gemm(const T* x, int64_t m, int64_t ldx, int64_t k, int64_t depth, const T* packed, int64_t n, const T* bias,
          T* y, int64_t ldy, int threads) {
    const int64_t groups = (n + GROUP - 1) / GROUP;
#pragma omp parallel for num_threads(threads) if (threads > 1) schedule(static)
    for (int64_t g = 0; g < groups; ++g) {
        const T* grp = packed + g * k * GROUP;  // a group is k x 64 values in either layout
        for (int64_t r = 0; r < m; r += MT_MAX) {
            const T* xr = x + r * ldx;
            T* yr = y + r * ldy;
            switch (m - r < MT_MAX ? m - r : MT_MAX) {
                case 1: K::template tile<1>(xr, ldx, depth, grp, bias, yr, ldy, g * GROUP, n); break;
                case 2: K::template tile<2>(xr, ldx, depth, grp, bias, yr, ldy, g * GROUP, n); break;
                case 3: K::template tile<3>(xr, ldx, depth, grp, bias, yr, ldy, g * GROUP, n); break;
                case 4: K::template tile<4>(xr, ldx, depth, grp, bias, yr, ldy, g * GROUP, n); break;
                case 5: K::template tile<5>(xr, ldx, depth, grp, bias, yr, ldy, g * GROUP, n); break;
                default: K::template tile<6>(xr, ldx, depth, grp, bias, yr, ldy, g * GROUP, n); break;
            }
        }
    }
}

}  // namespace

extern "C" {

int mc_native_group(void) { return GROUP; }

// x: [m, k] bf16 (row stride ldx elements), packed: see above, bias: bf16 [n] or null (added in fp32),
// y: [m, n] bf16 (row stride ldy elements). k must be even.
void mc_gemm_bf16(const uint16_t* x, int64_t m, int64_t ldx, int64_t k, const uint16_t* packed, int64_t n,
                  const uint16_t* bias, uint16_t* y, int64_t ldy, int threads) {
    gemm<Bf16>(x, m, ldx, k, k / 2, packed, n, bias, y, ldy, threads);
}

void mc_gemm_f32(const float* x, int64_t m, int64_t ldx, int64_t k, const float* packed, int64_t n, const float* bias,
                 float* y, int64_t ldy, int threads) {
    gemm<F32>(x, m, ldx, k, k, packed, n, bias, y, ldy, threads);
}

}  // extern "C"

// ---------------------------------------------------------------------------------------------
// mc_decode_attention: one decode step's attention over the paged KV cache, one query per sequence.
//
// q [n, heads, d] (row stride ldq elements between sequences), k / v caches [slots, kv_heads, d]
// (slot = block * block_size + offset), tables [n, width] int64 block ids, ctx [n] int64: sequence
// i attends keys 0 .. ctx[i] - 1 (those >= ctx[i] - window only, window > 0), out [n, heads, d].
// Per (sequence, kv head), in fp32: the scores of the group's query heads (q scaled first), their
// softmax (max subtracted, exp, sum), the values' weighted sum divided by the sum, then one rounding
// to the output dtype. dtype: 0 = fp32, 1 = bf16 (q, caches and out alike). d % 16 == 0.

namespace {

inline __m512 load16(const void* p, int bf16) {
    if (bf16) return _mm512_cvtpbh_ps((__m256bh)_mm256_loadu_si256(static_cast<const __m256i*>(p)));
    return _mm512_loadu_ps(static_cast<const float*>(p));
}

// e^x for x <= 0 (softmax after the max is subtracted): x = n ln2 + r, |r| <= ln2 / 2, e^r by the
// Cephes expf polynomial (relative error ~1e-7), times 2^n (scalef); below -87.3 the result is 0.
inline __m512 exp_nonpositive(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.3f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 y = _mm512_set1_ps(1.9875691500e-4f);
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.3981999507e-3f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(8.3334519073e-3f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(4.1665795894e-2f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.6666665459e-1f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(5.0000001201e-1f));
    y = _mm512_fmadd_ps(y, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(y, n);
}

constexpr int HB = 6;  // heads whose weighted sums stay in registers together (6 x 4 zmm at d = 64)

// acc[h] += sum_j scores[h][j] v_j (kv head of h) for heads h0 .. h0 + hb - 1; CH = d / 16 when the
// sums fit in registers (CH 4), 0 for any d (the sums in memory).
template <int CH>
inline void weigh(const void* vc, int64_t row, const int64_t* table, int64_t block_size, int64_t first, int64_t keys,
                  int64_t group, int64_t d, int64_t h0, int64_t hb, const float* scores, float* acc, int bf16,
                  int64_t es) {
    const int64_t chunks = d / 16;
    if constexpr (CH > 0) {
        __m512 a[HB][CH];
        for (int h = 0; h < HB; ++h)
            for (int c = 0; c < CH; ++c) a[h][c] = _mm512_setzero_ps();
        for (int64_t j = 0; j < keys; ++j) {
            const int64_t pos = first + j;
            const char* vp = static_cast<const char*>(vc) + (table[pos / block_size] * block_size + pos % block_size) * row * es;
#pragma GCC unroll 6
            for (int h = 0; h < HB; ++h) {
                if (h >= hb) break;
                const char* vh = vp + ((h0 + h) / group) * d * es;
                const __m512 w = _mm512_set1_ps(scores[(h0 + h) * keys + j]);
#pragma GCC unroll 4
                for (int c = 0; c < CH; ++c) a[h][c] = _mm512_fmadd_ps(w, load16(vh + 16 * c * es, bf16), a[h][c]);
            }
        }
        for (int h = 0; h < HB && h < hb; ++h)
            for (int c = 0; c < CH; ++c) _mm512_storeu_ps(acc + (h0 + h) * d + 16 * c, a[h][c]);
    } else {
        for (int64_t j = 0; j < keys; ++j) {
            const int64_t pos = first + j;
            const char* vp = static_cast<const char*>(vc) + (table[pos / block_size] * block_size + pos % block_size) * row * es;
            for (int64_t h = h0; h < h0 + hb; ++h) {
                const char* vh = vp + (h / group) * d * es;
                const __m512 w = _mm512_set1_ps(scores[h * keys + j]);
                for (int64_t c = 0; c < chunks; ++c) {
                    float* a = acc + h * d + 16 * c;
                    _mm512_storeu_ps(a, _mm512_fmadd_ps(w, load16(vh + 16 * c * es, bf16), _mm512_loadu_ps(a)));
                }
            }
        }
    }
}

inline void store16(void* p, __m512 v, int bf16) {
    if (bf16) _mm256_storeu_si256(static_cast<__m256i*>(p), (__m256i)_mm512_cvtneps_pbh(v));
    else _mm512_storeu_ps(static_cast<float*>(p), v);
}

}  // namespace

extern "C" void mc_decode_attention(const void* q, int64_t ldq, const void* kc, const void* vc, const int64_t* tables,
                                    int64_t width, const int64_t* ctx, int64_t n, int64_t heads, int64_t kv_heads,
                                    int64_t d, int64_t block_size, int64_t window, float scale, void* out,
                                    int64_t ldo, int dtype, int threads) {
    const int bf16 = dtype == 1;
    const int64_t es = bf16 ? 2 : 4;
    const int64_t group = heads / kv_heads;
    const int64_t chunks = d / 16;
    const int64_t row = kv_heads * d;  // one slot's keys (or values), all kv heads, contiguous
#pragma omp parallel for num_threads(threads) if (threads > 1) schedule(static)
    for (int64_t i = 0; i < n; ++i) {
        const int64_t len = ctx[i];
        const int64_t first = window > 0 && len > window ? len - window : 0;
        const int64_t keys = len - first;
        if (keys <= 0) continue;
        // one sequence, every head: its slots are read front to back, a block's slots contiguous
        std::vector<float> qf(heads * d), scores(heads * keys), acc(heads * d, 0.0f), total(heads);
        for (int64_t h = 0; h < heads; ++h) {
            const char* qp = static_cast<const char*>(q) + (i * ldq + h * d) * es;
            for (int64_t c = 0; c < chunks; ++c)
                _mm512_storeu_ps(&qf[h * d + 16 * c], _mm512_mul_ps(load16(qp + 16 * c * es, bf16), _mm512_set1_ps(scale)));
        }
        const int64_t* table = tables + i * width;
        for (int64_t j = 0; j < keys; ++j) {
            const int64_t pos = first + j;
            const char* kp = static_cast<const char*>(kc) + (table[pos / block_size] * block_size + pos % block_size) * row * es;
            for (int64_t h = 0; h < heads; ++h) {
                const char* kh = kp + (h / group) * d * es;
                __m512 s = _mm512_setzero_ps();
                for (int64_t c = 0; c < chunks; ++c)
                    s = _mm512_fmadd_ps(_mm512_loadu_ps(&qf[h * d + 16 * c]), load16(kh + 16 * c * es, bf16), s);
                scores[h * keys + j] = _mm512_reduce_add_ps(s);
            }
        }
        for (int64_t h = 0; h < heads; ++h) {
            float* sc = &scores[h * keys];
            __m512 top = _mm512_set1_ps(-INFINITY);
            for (int64_t j = 0; j < keys; j += 16) {
                const __mmask16 m = tail_mask(keys - j);
                top = _mm512_mask_max_ps(top, m, top, _mm512_maskz_loadu_ps(m, sc + j));
            }
            const __m512 peak = _mm512_set1_ps(_mm512_reduce_max_ps(top));
            __m512 sum = _mm512_setzero_ps();
            for (int64_t j = 0; j < keys; j += 16) {
                const __mmask16 m = tail_mask(keys - j);
                const __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, sc + j), peak));
                _mm512_mask_storeu_ps(sc + j, m, e);
                sum = _mm512_mask_add_ps(sum, m, sum, e);
            }
            total[h] = _mm512_reduce_add_ps(sum);
        }
        for (int64_t h0 = 0; h0 < heads; h0 += HB) {  // the weighted values, HB heads' sums in registers
            const int64_t hb = heads - h0 < HB ? heads - h0 : HB;
            if (chunks == 4) weigh<4>(vc, row, table, block_size, first, keys, group, d, h0, hb, scores.data(), acc.data(), bf16, es);
            else weigh<0>(vc, row, table, block_size, first, keys, group, d, h0, hb, scores.data(), acc.data(), bf16, es);
        }
        for (int64_t h = 0; h < heads; ++h) {
            char* op = static_cast<char*>(out) + (i * ldo + h * d) * es;
            const __m512 inv = _mm512_set1_ps(1.0f / total[h]);
            for (int64_t c = 0; c < chunks; ++c)
                store16(op + 16 * c * es, _mm512_mul_ps(_mm512_loadu_ps(&acc[h * d + 16 * c]), inv), bf16);
        }
    }
}
