/* Paged decode attention on CPU, fp32, each KV row read once in place (issue 26).

   Called by ops/paged/cpu_decode.py through ctypes (built at first use with `cc -O2`, no -march:
   the AVX2 + FMA code is selected at run time by __builtin_cpu_supports; on a CPU without
   them the entry point returns 1 and the caller uses the pure-torch kernel).

   One item = one request's KV head: its query rows (the GQA group's heads x the request's
   query tokens, padded to a multiple of 4) against the request's keys 0..lim-1, where
   lim is the largest key count of its rows. Keys are walked in blocks of TB positions
   through the block table (pointers per position: a shuffled table costs nothing extra);
   per block: scores (4 rows x 2 keys per register step), an online softmax per row,
   then acc += P @ V (4 rows x 16 columns per step), the next block's lines loaded ahead.
   Nothing at or past lim is read (look-ahead included), and a
   row's scores past its own key count are -inf before the exp (probability exactly 0), so
   NaN / inf in a slot no row may read never reaches a result (docs/decisions.md 41).
   A row with no key gets out 0 and lse -inf.

   Quantised pages (issue 39): with qtype 1 (int8) or 2 (float8_e4m3fn) the K / V rows are
   1-byte codes with one fp32 scale per (page, offset, head); each block's rows are
   dequantised (code * scale) into an fp32 buffer as their pointers are set up, and the block
   runs on the buffer as above: the same arithmetic as the fp32 path on the dequantised values. */
#include <stdint.h>
#include <math.h>
#include <string.h>
#include <stdlib.h>
#include <immintrin.h>

#define TB 32    /* tokens per block (K and V of a block stay in L1) */
#define MAXR 64  /* query rows per item, a multiple of 4 */

typedef union { float f; int32_t i; } fi;

static inline float exp_neg(float x) {
    float xc = x < -87.0f ? -87.0f : x;
    float fx = floorf(xc * 1.44269504088896341f + 0.5f);
    float r = xc - fx * 0.693359375f + fx * 2.12194440e-4f;
    float y = 1.9875691500e-4f;
    y = y * r + 1.3981999507e-3f; y = y * r + 8.3334519073e-3f; y = y * r + 4.1665795894e-2f;
    y = y * r + 1.6666665459e-1f; y = y * r + 5.0000001201e-1f;
    y = y * r * r + r + 1.0f;
    fi u; u.i = ((int32_t)fx + 127) << 23;
    return x < -87.0f ? 0.0f : y * u.f;
}

__attribute__((target("avx2,fma"))) static inline __m256 exp_neg8(__m256 x) {
    const __m256 lo = _mm256_set1_ps(-87.0f);
    __m256 keep = _mm256_cmp_ps(x, lo, _CMP_GE_OQ);  /* false for -inf / NaN / tiny */
    __m256 xc = _mm256_max_ps(x, lo);
    __m256 fx = _mm256_floor_ps(_mm256_fmadd_ps(xc, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
    __m256 r = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), xc);
    r = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(fx), _mm256_set1_epi32(127)), 23);
    return _mm256_and_ps(_mm256_mul_ps(y, _mm256_castsi256_ps(e)), keep);
}

__attribute__((target("avx2,fma"))) static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_hadd_ps(s, s); s = _mm_hadd_ps(s, s);
    return _mm_cvtss_f32(s);
}

/* One item (a request's KV head): q [Rp, D] (Rp % 4 == 0), rows' key counts rl [Rp];
   keys/values of position t at kp(t)/vp(t) -> acc [Rp, Dv] (normalised), lse [Rp]. */
/* The 256 float8_e4m3fn values (bias 7, no infinities, 0x7f / 0xff NaN), built once. */
static float fp8_lut[256];
static void build_fp8_lut(void) {
    for (int i = 0; i < 256; i++) {
        int sgn = i >> 7, e = (i >> 3) & 15, m = i & 7;
        float v = e == 0 ? ldexpf((float)m, -9) : ldexpf(1.0f + m / 8.0f, e - 7);
        if (e == 15 && m == 7) v = NAN;
        fp8_lut[i] = sgn ? -v : v;
    }
}

/* n codes at src (int8 or e4m3 bytes) times scale -> dst fp32 (n % 8 == 0). */
__attribute__((target("avx2,fma")))
static inline void dequant_row(float *dst, const uint8_t *src, int64_t n, float sc, int64_t qtype) {
    __m256 vs = _mm256_set1_ps(sc);
    for (int64_t i = 0; i < n; i += 8) {
        __m128i b = _mm_loadl_epi64((const __m128i *)(src + i));
        __m256 x = qtype == 1 ? _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b))
                              : _mm256_i32gather_ps(fp8_lut, _mm256_cvtepu8_epi32(b), 4);
        _mm256_storeu_ps(dst + i, _mm256_mul_ps(x, vs));
    }
}

__attribute__((target("avx2,fma")))
static void item_avx2(const float *q, const int64_t *rl, int64_t Rp, int64_t D, int64_t Dv, float scale,
                      const float *kc, const float *vc, int64_t ksp, int64_t kst, int64_t vsp, int64_t vst,
                      int64_t BS, const int64_t *pages, float *acc, float *lse, int64_t qtype,
                      const float *ksc, const float *vsc, int64_t kssp, int64_t ksst, int64_t vssp, int64_t vsst,
                      float *kbuf, float *vbuf) {
    float s[MAXR][TB] __attribute__((aligned(32)));
    float m[MAXR], l[MAXR];
    const float *kp[TB], *vp[TB];
    __m128 touch = _mm_setzero_ps();  /* the next block's lines, loaded ahead (below) */
    int64_t lim = 0;  /* the item's readable prefix: no position at or past it is read */
    for (int64_t r = 0; r < Rp; r++) { if (rl[r] > lim) lim = rl[r]; m[r] = -INFINITY; l[r] = 0.0f; }
    memset(acc, 0, sizeof(float) * Rp * Dv);
    for (int64_t t0 = 0; t0 < lim; t0 += TB) {
        int64_t n = lim - t0 < TB ? lim - t0 : TB;
        for (int64_t t = 0; t < n; t++) {
            int64_t pos = t0 + t, page = pages[pos / BS], off = pos % BS;
            if (qtype) {  /* codes (1 byte each; strides in elements = bytes) -> the fp32 buffer */
                const uint8_t *kb = (const uint8_t *)kc + page * ksp + off * kst;
                const uint8_t *vb = (const uint8_t *)vc + page * vsp + off * vst;
                dequant_row(kbuf + t * D, kb, D, ksc[page * kssp + off * ksst], qtype);
                dequant_row(vbuf + t * Dv, vb, Dv, vsc[page * vssp + off * vsst], qtype);
                kp[t] = kbuf + t * D;
                vp[t] = vbuf + t * Dv;
                continue;  /* the look-ahead below is for fp32 rows read in place */
            }
            kp[t] = kc + page * ksp + off * kst;
            vp[t] = vc + page * vsp + off * vst;
            /* The same position of the next block: one plain load per 64-byte line, now, so that
               the next block's misses are in flight together (and the hardware prefetcher sees
               a dense stream). Measured on Zen 3 (issue 26, session 5): 1.3x faster from DRAM than
               _mm_prefetch of the same lines, which ran the block's stream at ~5 GB/s. */
            if (pos + TB < lim) {
                int64_t p2 = pos + TB, pg2 = pages[p2 / BS], o2 = p2 % BS;
                const float *k2 = kc + pg2 * ksp + o2 * kst, *v2 = vc + pg2 * vsp + o2 * vst;
                for (int64_t i = 0; i < D; i += 16) touch = _mm_or_ps(touch, _mm_load_ss(k2 + i));
                for (int64_t i = 0; i < Dv; i += 16) touch = _mm_or_ps(touch, _mm_load_ss(v2 + i));
            }
        }
        int64_t np = (n + 1) & ~1;
        if (np > n) kp[n] = kp[0];
        /* scores: 4 rows x 2 tokens per step */
        for (int64_t r = 0; r < Rp; r += 4) {
            const float *q0 = q + r * D, *q1 = q0 + D, *q2 = q1 + D, *q3 = q2 + D;
            for (int64_t t = 0; t < np; t += 2) {
                const float *ka = kp[t], *kb = kp[t + 1];
                __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, b0 = a0, b1 = a0, b2 = a0, b3 = a0;
                for (int64_t i = 0; i < D; i += 8) {
                    __m256 x = _mm256_loadu_ps(ka + i), y = _mm256_loadu_ps(kb + i);
                    __m256 w = _mm256_loadu_ps(q0 + i);
                    a0 = _mm256_fmadd_ps(w, x, a0); b0 = _mm256_fmadd_ps(w, y, b0);
                    w = _mm256_loadu_ps(q1 + i);
                    a1 = _mm256_fmadd_ps(w, x, a1); b1 = _mm256_fmadd_ps(w, y, b1);
                    w = _mm256_loadu_ps(q2 + i);
                    a2 = _mm256_fmadd_ps(w, x, a2); b2 = _mm256_fmadd_ps(w, y, b2);
                    w = _mm256_loadu_ps(q3 + i);
                    a3 = _mm256_fmadd_ps(w, x, a3); b3 = _mm256_fmadd_ps(w, y, b3);
                }
                /* 8 horizontal sums at once: lanes [a0 a1 a2 a3 b0 b1 b2 b3] */
                __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
                __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(b0, b1), _mm256_hadd_ps(b2, b3));
                __m256 z = _mm256_mul_ps(_mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20),
                                                       _mm256_permute2f128_ps(u0, u1, 0x31)), _mm256_set1_ps(scale));
                float zz[8] __attribute__((aligned(32)));
                _mm256_store_ps(zz, z);
                s[r][t] = zz[0]; s[r + 1][t] = zz[1]; s[r + 2][t] = zz[2]; s[r + 3][t] = zz[3];
                s[r][t + 1] = zz[4]; s[r + 1][t + 1] = zz[5]; s[r + 2][t + 1] = zz[6]; s[r + 3][t + 1] = zz[7];
            }
        }
        int64_t n8 = (n + 7) & ~7;
        for (int64_t r = 0; r < Rp; r++) {
            int64_t vis = rl[r] - t0;  /* keys of this block the row sees */
            if (vis > n) vis = n;
            if (vis < 0) vis = 0;
            for (int64_t t = vis; t < n8; t++) s[r][t] = -INFINITY;
            if (vis == 0) { for (int64_t t = 0; t < n8; t++) s[r][t] = 0.0f; continue; }
            float mx = m[r];
            for (int64_t t = 0; t < vis; t++) mx = s[r][t] > mx ? s[r][t] : mx;
            __m256 vm = _mm256_set1_ps(mx), sum = _mm256_setzero_ps();
            for (int64_t t = 0; t < n8; t += 8) {
                __m256 p = exp_neg8(_mm256_sub_ps(_mm256_load_ps(&s[r][t]), vm));
                _mm256_store_ps(&s[r][t], p);
                sum = _mm256_add_ps(sum, p);
            }
            float alpha = exp_neg(m[r] - mx);
            l[r] = l[r] * alpha + hsum8(sum);
            if (alpha != 1.0f) {
                float *a = acc + r * Dv;
                __m256 va = _mm256_set1_ps(alpha);
                for (int64_t i = 0; i < Dv; i += 8) _mm256_storeu_ps(a + i, _mm256_mul_ps(_mm256_loadu_ps(a + i), va));
            }
            m[r] = mx;
        }
        /* acc += P @ V: 4 rows x 16 columns per step */
        for (int64_t r = 0; r < Rp; r += 4) {
            float *c0 = acc + r * Dv, *c1 = c0 + Dv, *c2 = c1 + Dv, *c3 = c2 + Dv;
            int64_t i = 0;
            for (; i + 16 <= Dv; i += 16) {
                __m256 x0 = _mm256_loadu_ps(c0 + i), y0 = _mm256_loadu_ps(c0 + i + 8);
                __m256 x1 = _mm256_loadu_ps(c1 + i), y1 = _mm256_loadu_ps(c1 + i + 8);
                __m256 x2 = _mm256_loadu_ps(c2 + i), y2 = _mm256_loadu_ps(c2 + i + 8);
                __m256 x3 = _mm256_loadu_ps(c3 + i), y3 = _mm256_loadu_ps(c3 + i + 8);
                for (int64_t t = 0; t < n; t++) {
                    __m256 v0 = _mm256_loadu_ps(vp[t] + i), v1 = _mm256_loadu_ps(vp[t] + i + 8);
                    __m256 p = _mm256_broadcast_ss(&s[r][t]);
                    x0 = _mm256_fmadd_ps(p, v0, x0); y0 = _mm256_fmadd_ps(p, v1, y0);
                    p = _mm256_broadcast_ss(&s[r + 1][t]);
                    x1 = _mm256_fmadd_ps(p, v0, x1); y1 = _mm256_fmadd_ps(p, v1, y1);
                    p = _mm256_broadcast_ss(&s[r + 2][t]);
                    x2 = _mm256_fmadd_ps(p, v0, x2); y2 = _mm256_fmadd_ps(p, v1, y2);
                    p = _mm256_broadcast_ss(&s[r + 3][t]);
                    x3 = _mm256_fmadd_ps(p, v0, x3); y3 = _mm256_fmadd_ps(p, v1, y3);
                }
                _mm256_storeu_ps(c0 + i, x0); _mm256_storeu_ps(c0 + i + 8, y0);
                _mm256_storeu_ps(c1 + i, x1); _mm256_storeu_ps(c1 + i + 8, y1);
                _mm256_storeu_ps(c2 + i, x2); _mm256_storeu_ps(c2 + i + 8, y2);
                _mm256_storeu_ps(c3 + i, x3); _mm256_storeu_ps(c3 + i + 8, y3);
            }
            for (; i < Dv; i += 8) {
                __m256 x0 = _mm256_loadu_ps(c0 + i), x1 = _mm256_loadu_ps(c1 + i);
                __m256 x2 = _mm256_loadu_ps(c2 + i), x3 = _mm256_loadu_ps(c3 + i);
                for (int64_t t = 0; t < n; t++) {
                    __m256 v0 = _mm256_loadu_ps(vp[t] + i);
                    x0 = _mm256_fmadd_ps(_mm256_broadcast_ss(&s[r][t]), v0, x0);
                    x1 = _mm256_fmadd_ps(_mm256_broadcast_ss(&s[r + 1][t]), v0, x1);
                    x2 = _mm256_fmadd_ps(_mm256_broadcast_ss(&s[r + 2][t]), v0, x2);
                    x3 = _mm256_fmadd_ps(_mm256_broadcast_ss(&s[r + 3][t]), v0, x3);
                }
                _mm256_storeu_ps(c0 + i, x0); _mm256_storeu_ps(c1 + i, x1);
                _mm256_storeu_ps(c2 + i, x2); _mm256_storeu_ps(c3 + i, x3);
            }
        }
    }
    __asm__ __volatile__("" : : "x"(touch));  /* keeps the look-ahead loads (their value is unused) */
    for (int64_t r = 0; r < Rp; r++) {
        float *a = acc + r * Dv;
        if (l[r] > 0.0f) {
            float inv = 1.0f / l[r];
            for (int64_t i = 0; i < Dv; i++) a[i] *= inv;
            lse[r] = m[r] + logf(l[r]);
        } else {
            for (int64_t i = 0; i < Dv; i++) a[i] = 0.0f;
            lse[r] = -INFINITY;
        }
    }
}

/* q [B, H, Rp, D] contiguous, rl [B, Rp] key count per row, table [B, width] page ids, cache strides
   in elements (page, token, head; last dim contiguous) -> out [B, H, Rp, Dv], lse [B, H, Rp].
   Returns 1 (nothing written) when this CPU or shape is not supported. */
int cp_decode_attention(int64_t nthreads, const float *q, const int64_t *rl, int64_t B, int64_t H, int64_t Rp, int64_t D, int64_t Dv,
                        float scale, const float *kc, const float *vc, int64_t ksp, int64_t kst, int64_t ksh,
                        int64_t vsp, int64_t vst, int64_t vsh, int64_t BS, const int64_t *table, int64_t width,
                        float *out, float *lse, int64_t qtype, const float *ksc, const float *vsc,
                        int64_t kssp, int64_t ksst, int64_t kssh, int64_t vssp, int64_t vsst, int64_t vssh) {
    (void)nthreads;
    __builtin_cpu_init();
    if (Rp % 4 || Rp > MAXR || D % 8 || Dv % 8 || !__builtin_cpu_supports("avx2") || !__builtin_cpu_supports("fma"))
        return 1;
    if (qtype == 2) build_fp8_lut();
    int failed = 0;
#ifdef _OPENMP
    #pragma omp parallel for collapse(2) schedule(static) num_threads(nthreads)
#endif
    for (int64_t b = 0; b < B; b++)
        for (int64_t h = 0; h < H; h++) {
            /* Quantised: one block's dequantised K / V rows, per item (TB x D + TB x Dv floats). */
            float *kbuf = NULL, *vbuf = NULL;
            if (qtype) {
                kbuf = (float *)malloc(sizeof(float) * TB * (D + Dv));
                if (!kbuf) { failed = 1; continue; }
                vbuf = kbuf + TB * D;
            }
            const char *kcb = (const char *)kc + h * ksh * (qtype ? 1 : 4);
            const char *vcb = (const char *)vc + h * vsh * (qtype ? 1 : 4);
            item_avx2(q + (b * H + h) * Rp * D, rl + b * Rp, Rp, D, Dv, scale, (const float *)kcb, (const float *)vcb,
                      ksp, kst, vsp, vst, BS, table + b * width, out + (b * H + h) * Rp * Dv, lse + (b * H + h) * Rp,
                      qtype, qtype ? ksc + h * kssh : NULL, qtype ? vsc + h * vssh : NULL, kssp, ksst, vssp, vsst,
                      kbuf, vbuf);
            free(kbuf);
        }
    return failed ? 2 : 0;
}

/* The FMA rate of this core, for the bandwidth benchmark's compute floor: `iters` steps of 10
   independent 8-lane FMA chains (160 FLOP a step, enough chains to cover the FMA latency). */
__attribute__((target("avx2,fma"))) static float fma_avx2(int64_t iters) {
    /* Ten named accumulators, not an array: gcc -O2 keeps an array of __m256 on the stack,
       and a load + FMA + store per step ran the chains at a quarter of this core's FMA rate
       (21.7 vs 91.2 GFLOP/s measured here, Zen 3), a floor four times too high. */
    __m256 a0 = _mm256_set1_ps(0.0f), a1 = _mm256_set1_ps(0.1f), a2 = _mm256_set1_ps(0.2f),
           a3 = _mm256_set1_ps(0.3f), a4 = _mm256_set1_ps(0.4f), a5 = _mm256_set1_ps(0.5f),
           a6 = _mm256_set1_ps(0.6f), a7 = _mm256_set1_ps(0.7f), a8 = _mm256_set1_ps(0.8f),
           a9 = _mm256_set1_ps(0.9f);
    const __m256 x = _mm256_set1_ps(0.999f), y = _mm256_set1_ps(0.001f);
    for (int64_t k = 0; k < iters; k++) {
        a0 = _mm256_fmadd_ps(a0, x, y); a1 = _mm256_fmadd_ps(a1, x, y); a2 = _mm256_fmadd_ps(a2, x, y);
        a3 = _mm256_fmadd_ps(a3, x, y); a4 = _mm256_fmadd_ps(a4, x, y); a5 = _mm256_fmadd_ps(a5, x, y);
        a6 = _mm256_fmadd_ps(a6, x, y); a7 = _mm256_fmadd_ps(a7, x, y); a8 = _mm256_fmadd_ps(a8, x, y);
        a9 = _mm256_fmadd_ps(a9, x, y);
    }
    __m256 s = _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)),
                             _mm256_add_ps(_mm256_add_ps(a4, a5), _mm256_add_ps(_mm256_add_ps(a6, a7),
                                                                                 _mm256_add_ps(a8, a9))));
    return hsum8(s);
}

float cp_fma_chains(int64_t iters) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") ? fma_avx2(iters) : -1.0f;
}
