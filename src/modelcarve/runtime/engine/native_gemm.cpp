// y = x W^T + b for bf16 x [m, k] and a bf16 weight W [n, k] packed by runtime/engine/native.py,
// with fp32 accumulation (AVX512-BF16 VDPBF16PS) and one rounding to bf16 at the end.
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
#include <stdint.h>

namespace {

constexpr int GROUP = 64;   // weight rows per packed group (4 zmm of 16 fp32 accumulators)
constexpr int NB = GROUP / 16;
constexpr int MT_MAX = 6;   // x rows per tile

template <int MT>
inline void tile(const uint16_t* x, int64_t ldx, int64_t pairs, const uint16_t* group, const uint16_t* bias,
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
        const int64_t left = n - col;
        const __mmask16 mask = left >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << left) - 1u);
        const __m512 b = bias ? _mm512_cvtpbh_ps((__m256bh)_mm256_maskz_loadu_epi16(mask, bias + col)) : _mm512_setzero_ps();
#pragma GCC unroll 8
        for (int i = 0; i < MT; ++i) {
            const __m256bh r = _mm512_cvtneps_pbh(_mm512_add_ps(acc[i][j], b));
            _mm256_mask_storeu_epi16(y + i * ldy + col, mask, (__m256i)r);
        }
    }
}

inline void rows_tile(int mt, const uint16_t* x, int64_t ldx, int64_t pairs, const uint16_t* group, const uint16_t* bias,
                      uint16_t* y, int64_t ldy, int64_t col0, int64_t n) {
    switch (mt) {
        case 1: tile<1>(x, ldx, pairs, group, bias, y, ldy, col0, n); break;
        case 2: tile<2>(x, ldx, pairs, group, bias, y, ldy, col0, n); break;
        case 3: tile<3>(x, ldx, pairs, group, bias, y, ldy, col0, n); break;
        case 4: tile<4>(x, ldx, pairs, group, bias, y, ldy, col0, n); break;
        case 5: tile<5>(x, ldx, pairs, group, bias, y, ldy, col0, n); break;
        default: tile<6>(x, ldx, pairs, group, bias, y, ldy, col0, n); break;
    }
}

}  // namespace

extern "C" {

int mc_native_group(void) { return GROUP; }

// x: [m, k] bf16 (row stride ldx elements), packed: see above, bias: bf16 [n] or null (added in fp32),
// y: [m, n] bf16 (row stride ldy elements). k must be even.
void mc_gemm_bf16(const uint16_t* x, int64_t m, int64_t ldx, int64_t k, const uint16_t* packed, int64_t n,
                  const uint16_t* bias, uint16_t* y, int64_t ldy, int threads) {
    const int64_t pairs = k / 2;
    const int64_t groups = (n + GROUP - 1) / GROUP;
    const int64_t group_elems = pairs * 2 * GROUP;
#pragma omp parallel for num_threads(threads) if (threads > 1) schedule(static)
    for (int64_t g = 0; g < groups; ++g) {
        const uint16_t* grp = packed + g * group_elems;
        for (int64_t r = 0; r < m; r += MT_MAX) {
            const int mt = static_cast<int>(m - r < MT_MAX ? m - r : MT_MAX);
            rows_tile(mt, x + r * ldx, ldx, pairs, grp, bias, y + r * ldy, ldy, g * GROUP, n);
        }
    }
}

}  // extern "C"
