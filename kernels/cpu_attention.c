/* Paged decode attention over several KV pools (HIGH float32, INT8, packed INT4), fused, for the CPU.
 *
 * One call per layer attends every pool a sequence keeps, plus optionally its new token at full
 * precision, reading each kept entry once in its stored precision: quantized keys and values are
 * converted in registers (score = scale * (q . k_int), acc += p * scale * v_int), never expanded
 * into a float32 buffer. That is the point of a quantized KV cache on a machine whose decode step
 * reads the cache from memory: an INT8 entry is a quarter of a float32 one's bytes.
 *
 * Work is split as flash-decoding does (Dao et al., "Flash-Decoding for long-context inference",
 * 2023): items of (sequence, range of its entries), each computing a partial softmax (running max,
 * sum, weighted values) for every query head, merged per sequence by log-sum-exp. Threads are
 * OpenMP's; the library is loaded after PyTorch, whose libgomp.so.1 it then shares (one pool).
 *
 * Layouts (all contiguous, row-major):
 *   q      [B, Hq, D] float32; query head j reads KV head j / (Hq / Hkv) (grouped-query attention).
 *   k, v   pool p: [pages, bs, Hkv, Dk] with Dk = D (float32 or int8) or D / 2 (uint8, two INT4 per
 *          byte: element 2i in the low nibble, 2i + 1 in the high one, both two's complement).
 *   scale  pool p (quantized): [pages, bs, Hkv] float32.
 *   table  pool p: [B, W_p] int32 page ids; lens pool p: [B] int32 entries in slot order.
 *   out    [B, Hq, D] float32 (zeros for a row with no entry).
 * (The step's own token, attended at full precision, comes as one more HIGH pool of one-slot pages:
 * the operator builds it, so the kernel has no special case for it.)
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define STRUCTKV_AVX2 1
#endif

/* Tokens whose scores one vector step computes (the AVX2 path); the row buffer holds this many. */
#define GROUP 8

typedef struct {
    const void *k, *v;
    const float *k_scale, *v_scale;
    const int32_t *table;
    const int32_t *lens;
    int64_t width;      /* W_p: columns of the block table */
    int32_t bits;       /* 0, 8 or 4 */
    int32_t block_size;
} pool_t;

static inline __attribute__((always_inline)) float dot_f32(const float *a, const float *b, int d) {
    float s = 0.f;
#pragma omp simd reduction(+:s)
    for (int i = 0; i < d; i++) s += a[i] * b[i];
    return s;
}

static inline __attribute__((always_inline)) void axpy_f32(float *acc, float w, const float *x, int d) {
#pragma omp simd
    for (int i = 0; i < d; i++) acc[i] += w * x[i];
}

/* A token's K or V row for every KV head as float32 ``[Hkv, D]``: a pointer into the pool for HIGH,
 * else converted once into ``buf`` (scales in ``scale[Hkv]``, applied by the caller; 1 for HIGH). */
static inline __attribute__((always_inline)) const float *load_row(const pool_t *p, const void *base, const float *scales, int64_t slot, int hkv,
                                    int d, float *buf, float *scale) {
    const int64_t n = (int64_t)hkv * d;
    if (p->bits == 0) {
        for (int h = 0; h < hkv; h++) scale[h] = 1.f;
        return (const float *)base + slot * n;
    }
    for (int h = 0; h < hkv; h++) scale[h] = scales[slot * hkv + h];
    if (p->bits == 8) {
        const int8_t *x = (const int8_t *)base + slot * n;
#pragma omp simd
        for (int64_t i = 0; i < n; i++) buf[i] = (float)x[i];
        return buf;
    }
    const uint8_t *x = (const uint8_t *)base + slot * (n / 2);
#pragma omp simd
    for (int64_t i = 0; i < n / 2; i++) {
        int8_t c = (int8_t)x[i];
        buf[2 * i] = (float)((int8_t)(c << 4) >> 4);
        buf[2 * i + 1] = (float)(c >> 4);
    }
    return buf;
}

/* exp(x) for x <= 0 in a form that vectorizes (glibc's vector expf needs -ffast-math, whose
 * finite-math assumption the -inf handling here cannot take): Cephes' expf, range reduction by
 * ln 2 in two parts and a degree-5 polynomial, within 2 ulp of expf; inputs below -87.3 give
 * exp(-87.3) ~ 1e-38 (against the row's maximum's 1: nothing a float32 sum keeps). */
static inline __attribute__((always_inline)) float exp_nonpositive(float x) {
    x = x < -87.3f ? -87.3f : x;
    float n = floorf(x * 1.44269504088896341f + 0.5f);
    float r = x - n * 0.693359375f + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    union { int32_t i; float f; } e;
    e.i = ((int32_t)n + 127) << 23;
    return p * e.f;
}

#ifdef STRUCTKV_AVX2
/* Eight dot products q . r[u][off : off + d] (d a multiple of 8), reduced together: eight
 * accumulators, then one transpose-and-add tree (hadd, hadd, a 128-bit swap) instead of a
 * horizontal sum per product. Returns [dot_0, ..., dot_7]. */
static inline __attribute__((always_inline)) __m256 dot8(const float *q, const float *const *r, int64_t off, int d) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
    for (int i = 0; i < d; i += 8) {
        __m256 qv = _mm256_loadu_ps(q + i);
        a0 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(r[0] + off + i), a0);
        a1 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(r[1] + off + i), a1);
        a2 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(r[2] + off + i), a2);
        a3 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(r[3] + off + i), a3);
        a4 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(r[4] + off + i), a4);
        a5 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(r[5] + off + i), a5);
        a6 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(r[6] + off + i), a6);
        a7 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(r[7] + off + i), a7);
    }
    __m256 s0 = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));   /* [0..3 low | 0..3 high] */
    __m256 s1 = _mm256_hadd_ps(_mm256_hadd_ps(a4, a5), _mm256_hadd_ps(a6, a7));   /* [4..7 low | 4..7 high] */
    return _mm256_add_ps(_mm256_permute2f128_ps(s0, s1, 0x20), _mm256_permute2f128_ps(s0, s1, 0x31));
}
#endif

#ifdef STRUCTKV_AVX2
/* dot8 over INT8 rows, each eight values converted in registers (the caller applies the scales). */
static inline __attribute__((always_inline)) __m256 dot8_i8(const float *q, const int8_t *const *r, int64_t off, int d) {
    __m256 a[GROUP];
    for (int u = 0; u < GROUP; u++) a[u] = _mm256_setzero_ps();
    for (int i = 0; i < d; i += 8) {
        __m256 qv = _mm256_loadu_ps(q + i);
        for (int u = 0; u < GROUP; u++)
            a[u] = _mm256_fmadd_ps(qv, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                       _mm_loadl_epi64((const __m128i *)(r[u] + off + i)))), a[u]);
    }
    __m256 s0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    __m256 s1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(s0, s1, 0x20), _mm256_permute2f128_ps(s0, s1, 0x31));
}

static inline __attribute__((always_inline)) __m256 reduce8(const __m256 *a) {
    __m256 s0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    __m256 s1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(s0, s1, 0x20), _mm256_permute2f128_ps(s0, s1, 0x31));
}

/* dot8_i8 for two query heads at once: each key vector is converted once for both. */
static inline __attribute__((always_inline)) void dot8x2_i8(const float *q0, const float *q1, const int8_t *const *r,
                                                            int64_t off, int d, __m256 *out0, __m256 *out1) {
    __m256 a[GROUP], b[GROUP];
    for (int u = 0; u < GROUP; u++) a[u] = b[u] = _mm256_setzero_ps();
    for (int i = 0; i < d; i += 8) {
        __m256 qa = _mm256_loadu_ps(q0 + i), qb = _mm256_loadu_ps(q1 + i);
        for (int u = 0; u < GROUP; u++) {
            __m256 x = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(r[u] + off + i))));
            a[u] = _mm256_fmadd_ps(qa, x, a[u]);
            b[u] = _mm256_fmadd_ps(qb, x, b[u]);
        }
    }
    *out0 = reduce8(a);
    *out1 = reduce8(b);
}

/* exp_nonpositive on eight lanes (the same approximation, with fused multiply-adds: a value may
 * differ from the scalar form's in the last bit). */
static inline __attribute__((always_inline)) __m256 exp8_nonpositive(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.3f));
    __m256 n = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fmadd_ps(n, _mm256_set1_ps(2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_add_ps(_mm256_fmadd_ps(_mm256_mul_ps(p, r), r, r), _mm256_set1_ps(1.0f));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}
#endif

/* Row b's entries are its pools' in order. Sets [lo, hi): pool pi's own indices that fall in the
 * range [i0, i1) of the row's entries, and moves *at (the pool's first index in the row) past it. */
static inline void part_range(const pool_t *pools, int b, int pi, int64_t i0, int64_t i1, int64_t *at, int64_t *lo,
                              int64_t *hi) {
    const int64_t len = pools[pi].lens[b];
    *lo = i0 > *at ? i0 - *at : 0;
    *hi = i1 - *at < len ? i1 - *at : len;
    *at += len;
}

/* Walks a row's slots in order, page by page (no division per entry). On entering a page it
 * prefetches the page PREFETCH_PAGES ahead in the walk (its K or V rows, and their scales): a
 * row's pages may lie anywhere in the pool, where the hardware prefetcher, which follows
 * addresses within a 4 KiB page, cannot guess the next one. Measured (PASK at 0.33, 2,048-token
 * prompts, batch 8, its INT8 pages scattered): 5.4 -> 4.1 ms of attention a decode step; 1 to 6
 * pages ahead gave the same within noise. (Always inlined: GCC deletes a call to a function
 * that only prefetches, as it has no effect it can see.) */
#ifndef PREFETCH_PAGES
#define PREFETCH_PAGES 2
#endif
typedef struct {
    const int32_t *page, *last;   /* the current and the walk's last table entry */
    int64_t slot, end;
    const char *data, *scale;     /* what is prefetched: rows of ``page_bytes``, scales of ``scale_bytes`` per page */
    int64_t page_bytes, scale_bytes;
} cursor_t;

static inline __attribute__((always_inline)) void prefetch_page(const cursor_t *c, int64_t page) {
    const char *x = c->data + page * c->page_bytes;
    for (int64_t o = 0; o < c->page_bytes; o += 64) __builtin_prefetch(x + o, 0, 3);
    if (c->scale) {
        const char *s = c->scale + page * c->scale_bytes;
        for (int64_t o = 0; o < c->scale_bytes; o += 64) __builtin_prefetch(s + o, 0, 3);
    }
}

/* A cursor at the row's entry t of pool p, for a walk up to entry hi (excluded) that reads
 * ``data`` (p->k or p->v) and ``scale`` (their scales; NULL for HIGH). */
static inline __attribute__((always_inline)) cursor_t cursor_at(const pool_t *p, int b, int64_t t, int64_t hi, const void *data,
                                 const float *scale, int hkv, int d) {
    cursor_t c;
    const int64_t row = (int64_t)b * p->width;
    c.page = p->table + row + t / p->block_size;
    c.last = p->table + row + (hi > t ? (hi - 1) / p->block_size : t / p->block_size);
    c.slot = (int64_t)*c.page * p->block_size + t % p->block_size;
    c.end = ((int64_t)*c.page + 1) * p->block_size;
    const int64_t bytes = p->bits == 0 ? 4 * (int64_t)d : p->bits == 8 ? d : d / 2;
    c.data = (const char *)data;
    c.page_bytes = (int64_t)p->block_size * hkv * bytes;
    c.scale = p->bits ? (const char *)scale : NULL;
    c.scale_bytes = (int64_t)p->block_size * hkv * 4;
    for (int k = 1; k <= PREFETCH_PAGES && c.page + k <= c.last; k++) prefetch_page(&c, c.page[k]);
    return c;
}

static inline __attribute__((always_inline)) int64_t cursor_next(const pool_t *p, cursor_t *c) {
    if (c->slot == c->end) {
        c->page++;
        c->slot = (int64_t)*c->page * p->block_size;
        c->end = c->slot + p->block_size;
        if (c->page + PREFETCH_PAGES <= c->last) prefetch_page(c, c->page[PREFETCH_PAGES]);
    }
    return c->slot++;
}

#ifdef STRUCTKV_AVX2
/* Eight values of a V row from ``x`` (float32, int8, or four bytes of packed int4) as floats. */
static inline __attribute__((always_inline)) __m256 load8(const void *x, int bits) {
    if (bits == 0) return _mm256_loadu_ps((const float *)x);
    if (bits == 8) return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)x)));
    int32_t packed;
    memcpy(&packed, x, 4);
    /* byte i -> lanes 2i (low nibble) and 2i + 1 (high nibble), sign-extended by shifts */
    __m256i bytes = _mm256_cvtepu8_epi32(_mm_cvtsi32_si128(packed));                  /* [b0 b1 b2 b3 0 0 0 0] */
    __m256i dup = _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3));
    __m256i shift = _mm256_setr_epi32(28, 24, 28, 24, 28, 24, 28, 24);   /* nibble to the top, then back */
    return _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_sllv_epi32(dup, shift), 28));
}

/* Pass 2 of one (KV head h, 32 columns from dc, query heads j and j + 1 when ``two``): the
 * weighted sum of the range's values held in eight registers over the whole range, written to
 * ``acc``. (Per entry and head the row slice is read once for both query heads.) */
static inline __attribute__((always_inline)) void value_sweep(
        int b, int hkv, int d, const pool_t *pools, int num_pools, int64_t i0, int64_t i1, const float *scores,
        int64_t n, int h, int dc, int j, int two, float *acc) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, c0 = a0, c1 = a0, c2 = a0, c3 = a0;
    const float *s0 = scores + j * n, *s1 = two ? scores + (j + 1) * n : s0;
    int64_t at = 0, idx = 0;
    for (int pi = 0; pi < num_pools; pi++) {
        int64_t lo, hi;
        part_range(pools, b, pi, i0, i1, &at, &lo, &hi);
        if (lo >= hi) continue;
        const pool_t *p = &pools[pi];
        const int bits = p->bits;
        const int64_t dk = bits == 4 ? d / 2 : d, ck = bits == 4 ? dc / 2 : dc;
        const int64_t step = bits == 0 ? 8 : bits == 8 ? 8 : 4;                 /* bytes-or-floats per 8 values */
        cursor_t c = cursor_at(p, b, lo, hi, p->v, p->v_scale, hkv, d);
        for (int64_t t = lo; t < hi; t++, idx++) {
            int64_t r = cursor_next(p, &c) * hkv + h;
            float sc = bits ? p->v_scale[r] : 1.f;
            const char *x = (const char *)p->v + (r * dk + ck) * (bits == 0 ? 4 : 1);
            const int64_t sb = step * (bits == 0 ? 4 : 1);
            __m256 w0 = _mm256_set1_ps(sc * s0[idx]), w1 = _mm256_set1_ps(sc * s1[idx]);
            __m256 x0 = load8(x, bits), x1 = load8(x + sb, bits), x2 = load8(x + 2 * sb, bits),
                   x3 = load8(x + 3 * sb, bits);
            a0 = _mm256_fmadd_ps(w0, x0, a0); a1 = _mm256_fmadd_ps(w0, x1, a1);
            a2 = _mm256_fmadd_ps(w0, x2, a2); a3 = _mm256_fmadd_ps(w0, x3, a3);
            c0 = _mm256_fmadd_ps(w1, x0, c0); c1 = _mm256_fmadd_ps(w1, x1, c1);
            c2 = _mm256_fmadd_ps(w1, x2, c2); c3 = _mm256_fmadd_ps(w1, x3, c3);
        }
    }
    float *o = acc + (int64_t)j * d + dc;
    _mm256_storeu_ps(o, a0); _mm256_storeu_ps(o + 8, a1); _mm256_storeu_ps(o + 16, a2); _mm256_storeu_ps(o + 24, a3);
    if (two) {
        o += d;
        _mm256_storeu_ps(o, c0); _mm256_storeu_ps(o + 8, c1); _mm256_storeu_ps(o + 16, c2); _mm256_storeu_ps(o + 24, c3);
    }
}
#endif

/* One work item: entries [i0, i1) of row b (its pools' in order). Writes the
 * partial max m[Hq], sum l[Hq] and unnormalized acc[Hq, D]. */
static inline __attribute__((always_inline)) void attend_range(const float *q, int b, int hq, int hkv, int d, const pool_t *pools, int num_pools,
                         int64_t i0, int64_t i1, float sm_scale,
                         float *scores, float *m, float *l, float *acc, float *row, float *rscale) {
    const int g = hq / hkv;
    const int64_t n = i1 - i0;
    const float *qb = q + (int64_t)b * hq * d;
    /* Pass 1: scores [Hq, n]. */
    int64_t at = 0, idx = 0;
    for (int pi = 0; pi < num_pools; pi++) {
        int64_t lo, hi;
        part_range(pools, b, pi, i0, i1, &at, &lo, &hi);
        const pool_t *p = &pools[pi];
        cursor_t c = cursor_at(p, b, lo, hi, p->k, p->k_scale, hkv, d);
        int64_t t = lo;
#ifdef STRUCTKV_AVX2
        if (d % 8 == 0 && p->bits == 8 && hkv <= 8) {   /* INT8 keys converted in registers, no row buffer */
            const int64_t stride = (int64_t)hkv * d;
            for (; t + GROUP <= hi; t += GROUP, idx += GROUP) {
                const int8_t *rows[GROUP];
                float rs[GROUP * 8];
                for (int u = 0; u < GROUP; u++) {
                    int64_t slot = cursor_next(p, &c);
                    rows[u] = (const int8_t *)p->k + slot * stride;
                    for (int h = 0; h < hkv; h++) rs[h * GROUP + u] = sm_scale * p->k_scale[slot * hkv + h];
                }
                for (int h = 0; h < hkv; h++) {
                    __m256 scv = _mm256_loadu_ps(rs + h * GROUP);
                    int jj = 0;
                    for (; jj + 2 <= g; jj += 2) {   /* two query heads per conversion of the keys */
                        int j = h * g + jj;
                        __m256 s0, s1;
                        dot8x2_i8(qb + j * d, qb + (j + 1) * d, rows, h * d, d, &s0, &s1);
                        _mm256_storeu_ps(scores + j * n + idx, _mm256_mul_ps(scv, s0));
                        _mm256_storeu_ps(scores + (j + 1) * n + idx, _mm256_mul_ps(scv, s1));
                    }
                    for (; jj < g; jj++) {
                        int j = h * g + jj;
                        _mm256_storeu_ps(scores + j * n + idx, _mm256_mul_ps(scv, dot8_i8(qb + j * d, rows, h * d, d)));
                    }
                }
            }
        } else if (d % 8 == 0) {
            const int64_t stride = (int64_t)hkv * d;
            for (; t + GROUP <= hi; t += GROUP, idx += GROUP) {
                const float *rows[GROUP];
                for (int u = 0; u < GROUP; u++)
                    rows[u] = load_row(p, p->k, p->k_scale, cursor_next(p, &c), hkv, d, row + u * stride,
                                       rscale + u * hkv);
                for (int h = 0; h < hkv; h++) {
                    float sc[GROUP];
                    for (int u = 0; u < GROUP; u++) sc[u] = sm_scale * rscale[u * hkv + h];
                    __m256 scv = _mm256_loadu_ps(sc);
                    for (int jj = 0; jj < g; jj++) {
                        int j = h * g + jj;
                        _mm256_storeu_ps(scores + j * n + idx, _mm256_mul_ps(scv, dot8(qb + j * d, rows, h * d, d)));
                    }
                }
            }
        }
#endif
        for (; t < hi; t++, idx++) {
            int64_t slot = cursor_next(p, &c);
            const float *kr = load_row(p, p->k, p->k_scale, slot, hkv, d, row, rscale);
            for (int h = 0; h < hkv; h++) {
                float sc = sm_scale * rscale[h];
                for (int jj = 0; jj < g; jj++) {
                    int j = h * g + jj;
                    scores[j * n + idx] = sc * dot_f32(qb + j * d, kr + h * d, d);
                }
            }
        }
    }
    /* Softmax pieces per query head. */
    for (int j = 0; j < hq; j++) {
        float *s = scores + j * n, mx = -INFINITY, sum = 0.f;
        int64_t i = 0;
#ifdef STRUCTKV_AVX2
        __m256 mv = _mm256_set1_ps(-INFINITY), sv = _mm256_setzero_ps();
        for (; i + 8 <= n; i += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(s + i));
        float lanes[8];
        _mm256_storeu_ps(lanes, mv);
        for (int u = 0; u < 8; u++) mx = lanes[u] > mx ? lanes[u] : mx;
#endif
        for (; i < n; i++) mx = s[i] > mx ? s[i] : mx;
        i = 0;
#ifdef STRUCTKV_AVX2
        mv = _mm256_set1_ps(mx);
        for (; i + 8 <= n; i += 8) {
            __m256 e = exp8_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(s + i), mv));
            _mm256_storeu_ps(s + i, e);
            sv = _mm256_add_ps(sv, e);
        }
        _mm256_storeu_ps(lanes, sv);
        for (int u = 0; u < 8; u++) sum += lanes[u];
#endif
        for (; i < n; i++) { s[i] = exp_nonpositive(s[i] - mx); sum += s[i]; }
        m[j] = mx;
        l[j] = sum;
    }
    memset(acc, 0, sizeof(float) * hq * d);
#ifdef STRUCTKV_AVX2
    if (d % 32 == 0) {
        for (int h = 0; h < hkv; h++)
            for (int dc = 0; dc < d; dc += 32)
                for (int j = h * g; j < (h + 1) * g; j += 2)
                    value_sweep(b, hkv, d, pools, num_pools, i0, i1, scores, n, h, dc, j, j + 1 < (h + 1) * g, acc);
        return;
    }
#endif
    /* Pass 2: weighted values. */
    at = 0, idx = 0;
    for (int pi = 0; pi < num_pools; pi++) {
        int64_t lo, hi;
        part_range(pools, b, pi, i0, i1, &at, &lo, &hi);
        const pool_t *p = &pools[pi];
        cursor_t c = cursor_at(p, b, lo, hi, p->v, p->v_scale, hkv, d);
        for (int64_t t = lo; t < hi; t++, idx++) {
            int64_t slot = cursor_next(p, &c);
            const float *vr = load_row(p, p->v, p->v_scale, slot, hkv, d, row, rscale);
            for (int h = 0; h < hkv; h++) {
                for (int jj = 0; jj < g; jj++) {
                    int j = h * g + jj;
                    axpy_f32(acc + j * d, rscale[h] * scores[j * n + idx], vr + h * d, d);
                }
            }
        }
    }
}

/* attend_range with the head dimension known at compile time for the common sizes (the dot
 * products and row conversions unroll into whole vectors), else at run time. */
#define ATTEND_D(D) attend_range(q, b, hq, hkv, D, pools, num_pools, i0, i1, sm_scale, \
                                 scores, m, l, acc, row, rscale)
static void attend_range_any(const float *q, int b, int hq, int hkv, int d, const pool_t *pools, int num_pools,
                             int64_t i0, int64_t i1, float sm_scale,
                             float *scores, float *m, float *l, float *acc, float *row, float *rscale) {
    switch (d) {
    case 32: ATTEND_D(32); break;
    case 64: ATTEND_D(64); break;
    case 128: ATTEND_D(128); break;
    default: ATTEND_D(d);
    }
}

/* Entry point (see the header comment for layouts). ``splits``: work items per row (>= 1); each row's
 * entries are cut into that many contiguous ranges of at least ``min_split`` entries. ``num_threads``:
 * OpenMP threads (the caller's torch.get_num_threads(): the calling thread's own setting may differ).
 * Returns 0, 1 for a bad shape, 2 when out of memory. */
int structkv_paged_decode_attention_pools(const float *q, int32_t batch, int32_t hq, int32_t hkv, int32_t d,
                                          const pool_t *pools, int32_t num_pools, float sm_scale, int32_t splits,
                                          int32_t min_split,
                                          int32_t num_threads, float *out) {
    if (batch <= 0) return 0;
    if (hq % hkv || d % 2 || splits < 1) return 1;
    int64_t *total = (int64_t *)malloc(sizeof(int64_t) * batch);
    int32_t *nsplit = (int32_t *)malloc(sizeof(int32_t) * batch);
    int64_t *first = (int64_t *)malloc(sizeof(int64_t) * (batch + 1));
    if (!total || !nsplit || !first) { free(total); free(nsplit); free(first); return 2; }
    first[0] = 0;
    for (int b = 0; b < batch; b++) {
        int64_t n = 0;
        for (int p = 0; p < num_pools; p++) n += pools[p].lens[b];
        total[b] = n;
        int64_t s = splits;
        if (min_split > 0 && s > n / min_split) s = n / min_split;
        nsplit[b] = (int32_t)(s < 1 ? 1 : s);
        first[b + 1] = first[b] + nsplit[b];
    }
    const int64_t items = first[batch];
    /* Per item: m[Hq], l[Hq], acc[Hq, D]. */
    float *part = (float *)malloc(sizeof(float) * items * hq * (d + 2));
    if (!part) { free(total); free(nsplit); free(first); return 2; }
    int err = 0;
#pragma omp parallel num_threads(num_threads > 0 ? num_threads : 1)
    {
        float *scores = NULL;
        int64_t cap = 0;
        float *row = (float *)malloc(sizeof(float) * GROUP * ((int64_t)hkv * d + hkv));
        float *rscale = row ? row + GROUP * (int64_t)hkv * d : NULL;
        if (!row) err = 2;
#pragma omp for schedule(dynamic, 1)
        for (int64_t it = 0; it < items; it++) {
            int b = 0;
            while (first[b + 1] <= it) b++;
            int64_t s = it - first[b], n = total[b], ns = nsplit[b];
            int64_t i0 = n * s / ns, i1 = n * (s + 1) / ns;
            float *m = part + it * hq * (d + 2), *l = m + hq, *acc = l + hq;
            if (i1 <= i0) {
                for (int j = 0; j < hq; j++) { m[j] = -INFINITY; l[j] = 0.f; }
                memset(acc, 0, sizeof(float) * hq * d);
                continue;
            }
            if ((i1 - i0) * hq > cap) {
                free(scores);
                cap = (i1 - i0) * hq;
                scores = (float *)malloc(sizeof(float) * cap);
                if (!scores) { cap = 0; err = 2; continue; }
            }
            if (!row) continue;
            attend_range_any(q, b, hq, hkv, d, pools, num_pools, i0, i1, sm_scale, scores, m, l, acc, row, rscale);
        }
        free(scores);
        free(row);
    }
    if (!err) {
        for (int b = 0; b < batch; b++) {
            float *o = out + (int64_t)b * hq * d;
            for (int j = 0; j < hq; j++) {
                float mx = -INFINITY, sum = 0.f;
                for (int64_t it = first[b]; it < first[b + 1]; it++) {
                    float mi = part[it * hq * (d + 2) + j];
                    mx = mi > mx ? mi : mx;
                }
                float *oj = o + j * d;
                memset(oj, 0, sizeof(float) * d);
                if (mx == -INFINITY) continue;
                for (int64_t it = first[b]; it < first[b + 1]; it++) {
                    const float *m = part + it * hq * (d + 2), *l = m + hq, *acc = l + hq;
                    if (m[j] == -INFINITY) continue;
                    float w = expf(m[j] - mx);
                    sum += w * l[j];
                    axpy_f32(oj, w, acc + j * d, d);
                }
                float inv = 1.f / sum;
                for (int i = 0; i < d; i++) oj[i] *= inv;
            }
        }
    }
    free(part); free(total); free(nsplit); free(first);
    return err;
}
