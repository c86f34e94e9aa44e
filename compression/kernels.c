/* Fused single passes for the codecs' hottest loops (loaded by compression/native.py).
 *
 * numpy and torch make one pass over memory per operation, and a codec chains several: a
 * top-k selection (abs, compare, nonzero, packbits, take), a message added through its
 * positions (unpackbits or a Rice decode, nonzero, index_add_), the sign codec's difference,
 * scale, pack and fold, the consensus step's differences and sums: at 100M entries some four
 * copies of the tensor each. Each kernel here is one pass, eight entries at a time: a
 * compare gives an eight-bit mask, and a table indexed by the mask gives the permutation that
 * packs the kept values together (selection, gather) or spreads them back to their positions
 * (add) -- the table-driven left-packing of SIMD filtering code, written for our layouts
 * (positions as a bitmap, MSB first: bit 7 of byte i is position 8 i; or Rice coded as
 * bitpack.py codes them).
 *
 * Where peers must agree the results are numpy's bits: the same compare (|x| >= t in
 * float32), the same kept values in the same order, t + v * alpha rounded twice as
 * index_add_ does (built with -ffp-contract=off: no fused multiply-add), float16 sums taken
 * in float32 and rounded once. The vector kernels need x86-64 with AVX2 and F16C (gg_fast()
 * says whether this CPU has them); elsewhere the callers keep numpy's passes.
 */
#include <stdint.h>
#include <string.h>

/* The 64 bits of a big-endian (MSB first) bit stream from bit `at` on; the buffer has 8
 * readable bytes past its end. */
static inline uint64_t bits_at(const uint8_t *buf, int64_t at) {
    const uint8_t *p = buf + (at >> 3);
    uint64_t w;
    memcpy(&w, p, 8);
    w = __builtin_bswap64(w);
    int shift = (int)(at & 7);
    return shift ? (w << shift) | (uint64_t)(p[8] >> (8 - shift)) : w;
}

/* A sparse top-k's positions, held as a bitmap of n positions, Rice coded in bitpack.py's
 * layout (rice_encode): gaps idx_i - idx_{i-1} - 1; their quotients (gap >> rbits) in unary
 * (zeros, then a one) into `head`, which must be zeroed and hold head_room bytes; their
 * remainders, rbits wide, back to back into `rem`. Returns the head's bytes, or -1 where the
 * head would not fit or the bitmap holds other than `count` positions. */
int64_t gg_rice_encode_bitmap(const uint8_t *bits, int64_t n, int64_t count, int rbits,
                              uint8_t *head, int64_t head_room, uint8_t *rem) {
    const uint64_t mask = rbits ? ((uint64_t)1 << rbits) - 1 : 0;
    int64_t prev = -1, at = 0, held = 0, out = 0;
    uint64_t acc = 0;
    int pending = 0;
    int64_t nbytes = (n + 7) / 8;
    for (int64_t i = 0; i < nbytes; i += 8) {
        uint64_t w = 0;
        int64_t take = nbytes - i < 8 ? nbytes - i : 8;
        for (int64_t k = 0; k < 8; k++) {
            w = (w << 8) | (k < take ? bits[i + k] : 0);
        }
        while (w) {
            int lead = __builtin_clzll(w);
            w &= ~((uint64_t)1 << (63 - lead));
            int64_t pos = 8 * i + lead;
            uint64_t gap = (uint64_t)(pos - prev - 1);
            prev = pos;
            at += (int64_t)(gap >> rbits);
            if ((at >> 3) >= head_room || ++held > count) {
                return -1;
            }
            head[at >> 3] |= (uint8_t)(0x80 >> (at & 7));
            at++;
            if (rbits) {
                acc = (acc << rbits) | (gap & mask);
                pending += rbits;
                while (pending >= 8) {
                    rem[out++] = (uint8_t)(acc >> (pending - 8));
                    pending -= 8;
                }
            }
        }
    }
    if (pending) {
        rem[out++] = (uint8_t)(acc << (8 - pending));
    }
    return held == count ? (at + 7) / 8 : -1;
}

#if defined(__x86_64__)
#define WITH_POPCNT __attribute__((target("popcnt"))) /* every CPU that runs the kernels */
#else
#define WITH_POPCNT
#endif

/* The sum of `count` fields, rbits wide, packed back to back (a Rice stream's remainders:
 * with the head's last terminator it gives the last position before anything is added).
 * Up to 8 bits wide, 64 bits of the stream at a time: bit p is bit p mod rbits of its field
 * (weight 2^(rbits - 1 - p mod rbits)), so each weight's bits are counted with one popcount
 * under a mask, the masks picked by where the word begins in a field. */
WITH_POPCNT int64_t gg_field_sum(const uint8_t *rem, int rbits, int64_t count) {
    if (!rbits) {
        return 0;
    }
    int64_t total = 0, nbits = count * rbits, p = 0;
    if (rbits <= 8) {
        uint64_t masks[8][8] = {{0}}; /* [first bit's place][place]: that place's bits */
        for (int s = 0; s < rbits; s++) {
            for (int b = 0; b < 64; b++) {
                masks[s][(s + b) % rbits] |= (uint64_t)1 << (63 - b);
            }
        }
        for (int s = 0; p < nbits; p += 64, s = (s + 64) % rbits) {
            uint64_t w = bits_at(rem, p);
            if (nbits - p < 64) {
                w &= ~(~(uint64_t)0 >> (nbits - p)); /* the stream's last bits only */
            }
            for (int i = 0; i < rbits; i++) {
                total += (int64_t)__builtin_popcountll(w & masks[s][i]) << (rbits - 1 - i);
            }
        }
        return total;
    }
    const uint64_t mask = ((uint64_t)1 << rbits) - 1;
    for (int64_t j = 0; j < count; j++) {
        total += (int64_t)((bits_at(rem, j * rbits) >> (64 - rbits)) & mask);
    }
    return total;
}

/* target[idx_j] = target[idx_j] + values[j] * alpha for the next m positions of a Rice
 * stream (bitpack.py's layout), validated by the caller; head and rem have 8 readable bytes
 * past their ends. state: the head's bit, the remainders' bit and the last position, carried
 * from one call to the next (start: 0, 0, -1). */
void gg_rice_add_f32(const uint8_t *head, const uint8_t *rem, int rbits, int64_t m,
                     const float *values, float alpha, float *target, int64_t *state) {
    int64_t at = state[0], r_at = state[1], prev = state[2];
    const uint64_t mask = rbits ? ((uint64_t)1 << rbits) - 1 : 0;
    /* The head's bits from `at` on, MSB first, held in a register: `valid` of them, zeros
     * past them. A quotient is read off it with one clz and a shift, and it is read again
     * from memory only once used up (reading it at every position made each position wait
     * on the load, the byte swap and the shift of the one before). */
    uint64_t hw = bits_at(head, at);
    int valid = 64;
    for (int64_t j = 0; j < m; j++) {
        int64_t zeros = 0;
        while (!hw) {
            zeros += valid;
            at += valid;
            hw = bits_at(head, at);
            valid = 64;
        }
        int z = __builtin_clzll(hw);
        zeros += z;
        at += z + 1;
        valid -= z + 1;
        hw = z < 63 ? hw << (z + 1) : 0;
        uint64_t r = 0;
        if (rbits) {
            r = (bits_at(rem, r_at) >> (64 - rbits)) & mask;
            r_at += rbits;
        }
        int64_t pos = prev + 1 + (zeros << rbits) + (int64_t)r;
        target[pos] = target[pos] + values[j] * alpha;
        prev = pos;
    }
    state[0] = at, state[1] = r_at, state[2] = prev;
}

/* The set bits of each of the eight bytes of w (byte l of the result: bits[l]'s count) --
 * with w read little-endian from bits, byte l is bits[l]. */
static inline uint64_t byte_popcounts(uint64_t w) {
    uint64_t ones = w - ((w >> 1) & 0x5555555555555555ULL);
    ones = (ones & 0x3333333333333333ULL) + ((ones >> 2) & 0x3333333333333333ULL);
    return (ones + (ones >> 4)) & 0x0f0f0f0f0f0f0f0fULL;
}

#if defined(__x86_64__)
#include <immintrin.h>

static int32_t pack_perm[256][8];   /* mask (lane l = bit l) -> lanes of the kept, packed */
static int32_t spread_perm[256][8]; /* mask -> for lane l, the packed value it takes */
static int32_t lane_mask[256][8];   /* mask -> all ones in the lanes it keeps */
static uint8_t reversed[256];       /* bit order LSB first <-> MSB first */

static void build_tables(void) {
    for (int m = 0; m < 256; m++) {
        int packed = 0;
        for (int l = 0; l < 8; l++) {
            pack_perm[m][l] = 0;
        }
        for (int l = 0; l < 8; l++) {
            int kept = (m >> l) & 1;
            spread_perm[m][l] = packed;
            lane_mask[m][l] = kept ? -1 : 0;
            if (kept) {
                pack_perm[m][packed++] = l;
            }
        }
        int r = 0;
        for (int b = 0; b < 8; b++) {
            if (m & (1 << b)) {
                r |= 1 << (7 - b);
            }
        }
        reversed[m] = (uint8_t)r;
    }
}

/* Whether this CPU runs the kernels (AVX2, and F16C for float16 copies); builds the tables
 * on the first call. The caller calls it once, before any kernel, from one thread. */
int gg_fast(void) {
    __builtin_cpu_init();
    if (!__builtin_cpu_supports("avx2") || !__builtin_cpu_supports("f16c")) {
        return 0;
    }
    build_tables();
    return 1;
}

/* t with v[0..c) * alpha added at the lanes the mask m keeps (lane l = bit l), in order:
 * each kept lane t + v * alpha, rounded twice as index_add_ does; the others untouched (v
 * has 8 readable floats). */
__attribute__((target("avx2"))) static inline __m256 add_kept(__m256 t, const float *v, int m,
                                                              __m256 alpha) {
    __m256 spread = _mm256_permutevar8x32_ps(_mm256_loadu_ps(v),
                                             _mm256_loadu_si256((const __m256i *)spread_perm[m]));
    __m256 keep = _mm256_castsi256_ps(_mm256_loadu_si256((const __m256i *)lane_mask[m]));
    return _mm256_blendv_ps(t, _mm256_add_ps(t, _mm256_mul_ps(spread, alpha)), keep);
}

/* Eight entries v of a selection at threshold t: their byte of the bitmap into *bit, the
 * kept ones packed at values + kept. Returns the new kept count, or -1 where it would pass
 * `room` (values has 8 entries past room: the vector store's overrun). */
__attribute__((target("avx2"))) static inline int64_t keep_eight(__m256 v, __m256 t, uint8_t *bit,
                                                                 float *values, int64_t kept,
                                                                 int64_t room) {
    const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    int m = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_and_ps(v, magnitude), t, _CMP_GE_OQ));
    int count = __builtin_popcount(m);
    if (kept + count > room) {
        return -1;
    }
    *bit = reversed[m];
    __m256i perm = _mm256_loadu_si256((const __m256i *)pack_perm[m]);
    _mm256_storeu_ps(values + kept, _mm256_permutevar8x32_ps(v, perm));
    return kept + count;
}

/* The entries of x[0..n) with |x| >= threshold: their bitmap (ceil(n / 8) bytes, the last
 * zero-padded) and their values, packed in order. values has room for `room` kept values
 * plus 8 (a vector store may write past the last). Returns how many were kept, or -1 when
 * more than `room` were (the bitmap and values are then incomplete). */
__attribute__((target("avx2"))) int64_t gg_select_f32(const float *x, int64_t n, float threshold,
                                                      uint8_t *bits, float *values, int64_t room) {
    const __m256 t = _mm256_set1_ps(threshold);
    int64_t kept = 0;
    int64_t full = n / 8;
    for (int64_t i = 0; i < full; i++) {
        kept = keep_eight(_mm256_loadu_ps(x + 8 * i), t, bits + i, values, kept, room);
        if (kept < 0) {
            return -1;
        }
    }
    if (n % 8) {
        int byte = 0;
        for (int64_t p = 8 * full; p < n; p++) {
            float a = x[p] < 0 ? -x[p] : x[p];
            if (a >= threshold) {
                if (kept + 1 > room) {
                    return -1;
                }
                byte |= 0x80 >> (p - 8 * full);
                values[kept++] = x[p];
            }
        }
        bits[full] = (uint8_t)byte;
    }
    return kept;
}

/* target[p] = target[p] + values[j] * alpha for the j-th set bit p of the bitmap of n
 * positions, for the first `count` set bits (the caller has counted them: exactly count).
 * Returns the values used. */
__attribute__((target("avx2"))) int64_t gg_bitmap_add_f32(const uint8_t *bits, int64_t n,
                                                          const float *values, int64_t count,
                                                          float *target, float alpha) {
    const __m256 a = _mm256_set1_ps(alpha);
    int64_t used = 0;
    int64_t full = n / 8;
    for (int64_t i = 0; i < full; i++) {
        int m = reversed[bits[i]];
        int c = __builtin_popcount(m);
        if (used + c > count) {
            return -1;
        }
        if (used + 8 <= count) {
            __m256 old = _mm256_loadu_ps(target + 8 * i);
            _mm256_storeu_ps(target + 8 * i, add_kept(old, values + used, m, a));
        } else {
            int64_t j = used;
            for (int l = 0; l < 8; l++) {
                if ((m >> l) & 1) {
                    target[8 * i + l] = target[8 * i + l] + values[j++] * alpha;
                }
            }
        }
        used += c;
    }
    for (int64_t p = 8 * full; p < n; p++) {
        if (bits[full] & (0x80 >> (p - 8 * full))) {
            if (used + 1 > count) {
                return -1;
            }
            target[p] = target[p] + values[used++] * alpha;
        }
    }
    return used;
}

/* out[j] = src[p] for the j-th set bit p of the bitmap of n positions; out has room for
 * `count` values (the bitmap's set bits, counted by the caller). Returns the values
 * written, or -1 where the bitmap holds more than count. */
__attribute__((target("avx2"))) int64_t gg_bitmap_gather_f32(const uint8_t *bits, int64_t n,
                                                             const float *src, float *out,
                                                             int64_t count) {
    int64_t got = 0;
    int64_t full = n / 8;
    for (int64_t i = 0; i < full; i++) {
        int m = reversed[bits[i]];
        int c = __builtin_popcount(m);
        if (got + c > count) {
            return -1;
        }
        if (got + 8 <= count) {
            __m256 v = _mm256_loadu_ps(src + 8 * i);
            __m256i perm = _mm256_loadu_si256((const __m256i *)pack_perm[m]);
            _mm256_storeu_ps(out + got, _mm256_permutevar8x32_ps(v, perm));
        } else {
            int64_t j = got;
            for (int l = 0; l < 8; l++) {
                if ((m >> l) & 1) {
                    out[j++] = src[8 * i + l];
                }
            }
        }
        got += c;
    }
    for (int64_t p = 8 * full; p < n; p++) {
        if (bits[full] & (0x80 >> (p - 8 * full))) {
            if (got + 1 > count) {
                return -1;
            }
            out[got++] = src[p];
        }
    }
    return got;
}

/* The sign codec of a difference against a float16 copy, folded into the copy (CHOCO's
 * x-hat += q for diloco's anchors, compression/engine.py encode_difference): per block of
 * `block` entries (a power of two, 8 or more; the last may be shorter) d = a - b in float32,
 * scale = mean |d|, a sign bit per entry (d >= 0, MSB first) into `bits`, the scale into
 * `scales`; with `fold`, b = half(b + half(+-scale)) as the decoder adds it (float32 add,
 * one rounding to float16). left2[0] gets ||d - (+-scale)||^2 (what error feedback keeps).
 * Returns 0, or the index + 1 of the first block holding a non-finite difference (blocks
 * before it are folded already). */
__attribute__((target("avx2,f16c"))) int64_t gg_sign_encode_f16(const float *a, uint16_t *b,
                                                                int64_t n, int64_t block,
                                                                uint8_t *bits, float *scales,
                                                                int fold, double *left2) {
    const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    const __m256 zero = _mm256_setzero_ps();
    double total = 0.0;
    int64_t nblocks = (n + block - 1) / block;
    for (int64_t k = 0; k < nblocks; k++) {
        int64_t lo = k * block, m = n - lo < block ? n - lo : block;
        int64_t full = m / 8;
        const float *ak = a + lo;
        uint16_t *bk = b + lo;
        /* First read of the block (it stays in cache for the second): the scale. */
        __m256 sum = zero, bad = zero;
        for (int64_t i = 0; i < full; i++) {
            __m256 x = _mm256_sub_ps(_mm256_loadu_ps(ak + 8 * i),
                                     _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(bk + 8 * i))));
            bad = _mm256_or_ps(bad, _mm256_cmp_ps(_mm256_sub_ps(x, x), zero, _CMP_NEQ_UQ));
            sum = _mm256_add_ps(sum, _mm256_and_ps(x, magnitude));
        }
        float lanes[8];
        _mm256_storeu_ps(lanes, sum);
        float s = ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) +
                  ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
        int nonfinite = _mm256_movemask_ps(bad) != 0;
        for (int64_t p = 8 * full; p < m; p++) {
            float x = ak[p] - _cvtsh_ss(bk[p]);
            nonfinite |= !(x - x == 0.0f);
            s += x < 0 ? -x : x;
        }
        if (nonfinite) {
            left2[0] = total;
            return k + 1;
        }
        float scale = s / (float)m;
        scales[k] = scale;
        float step = _cvtsh_ss(_cvtss_sh(scale, _MM_FROUND_TO_NEAREST_INT));
        const __m256 up = _mm256_set1_ps(step), sc = _mm256_set1_ps(scale);
        __m256 kept = zero;
        /* Second: the signs, what stays of d, and the fold. */
        for (int64_t i = 0; i < full; i++) {
            __m128i *at = (__m128i *)(bk + 8 * i);
            __m256 old = _mm256_cvtph_ps(_mm_loadu_si128(at));
            __m256 x = _mm256_sub_ps(_mm256_loadu_ps(ak + 8 * i), old);
            __m256 positive = _mm256_cmp_ps(x, zero, _CMP_GE_OQ);
            bits[(lo >> 3) + i] = reversed[_mm256_movemask_ps(positive)];
            __m256 left = _mm256_sub_ps(x, _mm256_blendv_ps(_mm256_sub_ps(zero, sc), sc, positive));
            kept = _mm256_add_ps(kept, _mm256_mul_ps(left, left));
            if (fold) {
                __m256 add = _mm256_blendv_ps(_mm256_sub_ps(zero, up), up, positive);
                _mm_storeu_si128(at, _mm256_cvtps_ph(_mm256_add_ps(old, add),
                                                     _MM_FROUND_TO_NEAREST_INT));
            }
        }
        _mm256_storeu_ps(lanes, kept);
        double k2 = 0.0;
        for (int l = 0; l < 8; l++) {
            k2 += lanes[l];
        }
        if (m % 8) {
            int byte = 0;
            for (int64_t p = 8 * full; p < m; p++) {
                float old = _cvtsh_ss(bk[p]);
                float x = ak[p] - old;
                int positive = x >= 0.0f;
                byte |= positive << (7 - (p - 8 * full));
                float left = x - (positive ? scale : -scale);
                k2 += (double)left * left;
                if (fold) {
                    bk[p] = _cvtss_sh(old + (positive ? step : -step), _MM_FROUND_TO_NEAREST_INT);
                }
            }
            bits[(lo >> 3) + full] = (uint8_t)byte;
        }
        total += k2;
    }
    left2[0] = total;
    return 0;
}

/* target = half(target + half(+-scale)) per entry of a sign payload (its bits MSB first, a
 * float32 scale per block): the sign codec's decode_add_ into a float16 copy at alpha 1. */
__attribute__((target("avx2,f16c"))) void gg_sign_add_f16(const uint8_t *bits,
                                                          const float *scales, int64_t n,
                                                          int64_t block, uint16_t *target) {
    const __m256 zero = _mm256_setzero_ps();
    const __m256i lane_bit = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
    int64_t full = n / 8;
    __m256 up = zero;
    int64_t current = -1;
    for (int64_t i = 0; i < full; i++) {
        int64_t k = (8 * i) / block;
        if (k != current) {
            current = k;
            up = _mm256_set1_ps(_cvtsh_ss(_cvtss_sh(scales[k], _MM_FROUND_TO_NEAREST_INT)));
        }
        __m256i set = _mm256_and_si256(_mm256_set1_epi32(reversed[bits[i]]), lane_bit);
        __m256 positive = _mm256_castsi256_ps(_mm256_cmpeq_epi32(set, lane_bit));
        __m256 add = _mm256_blendv_ps(_mm256_sub_ps(zero, up), up, positive);
        __m128i *at = (__m128i *)(target + 8 * i);
        __m256 old = _mm256_cvtph_ps(_mm_loadu_si128(at));
        _mm_storeu_si128(at, _mm256_cvtps_ph(_mm256_add_ps(old, add), _MM_FROUND_TO_NEAREST_INT));
    }
    for (int64_t p = 8 * full; p < n; p++) {
        float step = _cvtsh_ss(_cvtss_sh(scales[p / block], _MM_FROUND_TO_NEAREST_INT));
        int positive = (bits[p >> 3] >> (7 - (p & 7))) & 1;
        target[p] = _cvtss_sh(_cvtsh_ss(target[p]) + (positive ? step : -step),
                              _MM_FROUND_TO_NEAREST_INT);
    }
}

/* gg_bitmap_add_f32 of several bitmaps over the same n positions, in one pass: for each
 * group of eight positions the terms are added in their order (term 0 first), so each entry
 * gets the bits that adding the terms one after another gives. counts[j]: term j's values
 * (its set bits, counted by the caller). Returns 0, or -1 where a bitmap holds more. */
__attribute__((target("avx2"))) int64_t gg_bitmap_add_many_f32(int64_t terms,
                                                               const uint8_t *const *bits,
                                                               const float *const *values,
                                                               const int64_t *counts,
                                                               const float *alphas, int64_t n,
                                                               float *target) {
    int64_t used[64];
    if (terms > 64) {
        return -1;
    }
    for (int64_t j = 0; j < terms; j++) {
        used[j] = 0;
    }
    int64_t full = n / 8, i = 0;
    /* Eight groups at a time while every term has eight values past them: each term's
     * first value in each group from the prefix sums of its eight bytes' popcounts (a term's
     * running count carried from group to group through memory made every group wait). */
    uint64_t words[64], before[64];
    int64_t totals[64];
    for (; i + 8 <= full; i += 8) {
        int ahead = 1;
        for (int64_t j = 0; j < terms; j++) {
            memcpy(&words[j], bits[j] + i, 8);
            uint64_t sums = byte_popcounts(words[j]) * 0x0101010101010101ULL;
            before[j] = sums << 8;
            totals[j] = (int64_t)(sums >> 56);
            ahead &= used[j] + totals[j] + 8 <= counts[j];
        }
        if (!ahead) {
            break;
        }
        for (int l = 0; l < 8; l++) {
            __m256 t = _mm256_loadu_ps(target + 8 * (i + l));
            for (int64_t j = 0; j < terms; j++) {
                int m = reversed[(words[j] >> (8 * l)) & 0xff];
                const float *v = values[j] + used[j] + ((before[j] >> (8 * l)) & 0xff);
                t = add_kept(t, v, m, _mm256_set1_ps(alphas[j]));
            }
            _mm256_storeu_ps(target + 8 * (i + l), t);
        }
        for (int64_t j = 0; j < terms; j++) {
            used[j] += totals[j];
        }
    }
    for (; i < full; i++) {
        __m256 t = _mm256_loadu_ps(target + 8 * i);
        for (int64_t j = 0; j < terms; j++) {
            int m = reversed[bits[j][i]];
            int c = __builtin_popcount(m);
            if (used[j] + c > counts[j]) {
                return -1;
            }
            if (used[j] + 8 <= counts[j]) {
                t = add_kept(t, values[j] + used[j], m, _mm256_set1_ps(alphas[j]));
            } else if (c) {
                float lanes[8];
                _mm256_storeu_ps(lanes, t);
                int64_t k = used[j];
                for (int l = 0; l < 8; l++) {
                    if ((m >> l) & 1) {
                        lanes[l] = lanes[l] + values[j][k++] * alphas[j];
                    }
                }
                t = _mm256_loadu_ps(lanes);
            }
            used[j] += c;
        }
        _mm256_storeu_ps(target + 8 * i, t);
    }
    for (int64_t p = 8 * full; p < n; p++) {
        for (int64_t j = 0; j < terms; j++) {
            if (bits[j][full] & (0x80 >> (p - 8 * full))) {
                if (used[j] + 1 > counts[j]) {
                    return -1;
                }
                target[p] = target[p] + values[j][used[j]++] * alphas[j];
            }
        }
    }
    return 0;
}

/* The last n - from (fewer than eight) entries of an accumulating selection: 1, nothing
 * written, where a sum e + (a - b) there is not finite; else each sum into e and, while
 * *held >= 0, those with |sum| >= threshold into *bit (MSB first) and values[*held...]
 * (*held = -1 past room, the byte then unwritten). */
static int accumulate_select_tail(float *e, const float *a, const float *b, int64_t from,
                                  int64_t n, float threshold, uint8_t *bit, float *values,
                                  int64_t *held, int64_t room) {
    for (int64_t p = from; p < n; p++) {
        float x = e[p] + (a[p] - b[p]);
        if (!(x - x == 0.0f)) {
            return 1;
        }
    }
    int byte = 0;
    for (int64_t p = from; p < n; p++) {
        float x = e[p] + (a[p] - b[p]);
        e[p] = x;
        if (*held >= 0 && (x < 0 ? -x : x) >= threshold) {
            if (*held + 1 > room) {
                *held = -1;
                continue;
            }
            byte |= 0x80 >> (p - from);
            values[(*held)++] = x;
        }
    }
    if (*held >= 0) {
        *bit = (uint8_t)byte;
    }
    return 0;
}

/* Error feedback's accumulation and a dense top-k's selection in one pass: e = e + (a - b)
 * (a - b rounded first, as torch's sub then add_), then gg_select_f32's bitmap and kept
 * values of e (|e| >= threshold). Every entry of e is accumulated even when more than `room`
 * are kept (then *kept = -1, and the bitmap and values are incomplete). Returns 0, or the
 * index + 1 of the first group of eight holding a non-finite sum (nothing from that group
 * on is written; the groups before it are accumulated). */
__attribute__((target("avx2"))) int64_t gg_accumulate_select_f32(float *e, const float *a,
                                                                 const float *b, int64_t n,
                                                                 float threshold, uint8_t *bits,
                                                                 float *values, int64_t room,
                                                                 int64_t *kept) {
    const __m256 t = _mm256_set1_ps(threshold), zero = _mm256_setzero_ps();
    int64_t held = 0, full = n / 8;
    for (int64_t i = 0; i < full; i++) {
        __m256 x = _mm256_add_ps(_mm256_loadu_ps(e + 8 * i),
                                 _mm256_sub_ps(_mm256_loadu_ps(a + 8 * i),
                                               _mm256_loadu_ps(b + 8 * i)));
        if (_mm256_movemask_ps(_mm256_cmp_ps(_mm256_sub_ps(x, x), zero, _CMP_NEQ_UQ))) {
            *kept = held;
            return i + 1;
        }
        _mm256_storeu_ps(e + 8 * i, x);
        if (held >= 0) {
            held = keep_eight(x, t, bits + i, values, held, room);
        }
    }
    if (n % 8 && accumulate_select_tail(e, a, b, 8 * full, n, threshold, bits + full, values,
                                        &held, room)) {
        *kept = held;
        return full + 1;
    }
    *kept = held;
    return 0;
}

/* The first int2 code 0 (never written: Int2.check refuses it) among count codes packed four
 * a byte, high bits first, or -1. A field is non-zero iff its high or low bit is set: each
 * byte's fields folded onto their low bits must be 0x55. */
__attribute__((target("avx2"))) int64_t gg_int2_first_zero(const uint8_t *codes, int64_t count) {
    int64_t whole = count / 4, i = 0;
    const __m256i low_bits = _mm256_set1_epi8(0x55);
    for (; i + 32 <= whole; i += 32) {
        __m256i v = _mm256_loadu_si256((const __m256i *)(codes + i));
        __m256i folded = _mm256_and_si256(_mm256_or_si256(v, _mm256_srli_epi16(v, 1)), low_bits);
        if ((unsigned)_mm256_movemask_epi8(_mm256_cmpeq_epi8(folded, low_bits)) != 0xffffffffu) {
            break;
        }
    }
    for (; i < whole; i++) {
        uint8_t f = (uint8_t)((codes[i] | (codes[i] >> 1)) & 0x55);
        if (f != 0x55) {
            for (int k = 0; k < 4; k++) {
                if (!((f >> (6 - 2 * k)) & 1)) {
                    return 4 * i + k;
                }
            }
        }
    }
    for (int64_t j = 4 * whole; j < count; j++) {
        if (!((codes[j >> 2] >> (6 - 2 * (j & 3))) & 3)) {
            return j;
        }
    }
    return -1;
}

/* out[j] = (code_j - 2^(bits-1)) * scales[j >> block_log2] for count codes of bits bits
 * (2: int2, four a byte; 4: int4, two a byte; high bits first; the block 8 or more, so eight
 * values from a multiple of 8 share a scale), as Int2 and Int4 dequantize them: the level
 * times the scale, one rounding. Eight codes are bits bytes (bits 2 or 4), read as one
 * big-endian word. Inlined with bits constant, so each width compiles to its own loop. */
static inline __attribute__((always_inline, target("avx2"))) void
dequantize_codes(const uint8_t *codes, const float *scales, int bits, int64_t block_log2,
                 int64_t count, float *out) {
    const int per_byte = 8 / bits, mask = (1 << bits) - 1;
    const __m256i shifts = _mm256_setr_epi32(7 * bits, 6 * bits, 5 * bits, 4 * bits, 3 * bits,
                                             2 * bits, bits, 0);
    const __m256i masks = _mm256_set1_epi32(mask), offset = _mm256_set1_epi32(1 << (bits - 1));
    int64_t j = 0;
    for (; j + 8 <= count; j += 8) {
        const uint8_t *b = codes + ((j * bits) >> 3);
        uint32_t word;
        if (bits == 4) {
            uint32_t w;
            memcpy(&w, b, 4);
            word = __builtin_bswap32(w);
        } else {
            uint16_t w;
            memcpy(&w, b, 2);
            word = __builtin_bswap16(w);
        }
        __m256i code =
            _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32((int)word), shifts), masks);
        __m256 level = _mm256_cvtepi32_ps(_mm256_sub_epi32(code, offset));
        __m256 scale = _mm256_set1_ps(scales[j >> block_log2]);
        _mm256_storeu_ps(out + j, _mm256_mul_ps(level, scale));
    }
    for (; j < count; j++) {
        int code = (codes[j / per_byte] >> (8 - bits - bits * (j % per_byte))) & mask;
        out[j] = (float)(code - (1 << (bits - 1))) * scales[j >> block_log2];
    }
}

__attribute__((target("avx2"))) void gg_int2_dequantize(const uint8_t *codes, const float *scales,
                                                        int64_t block_log2, int64_t count,
                                                        float *out) {
    dequantize_codes(codes, scales, 2, block_log2, count, out);
}

__attribute__((target("avx2"))) void gg_int4_dequantize(const uint8_t *codes, const float *scales,
                                                        int64_t block_log2, int64_t count,
                                                        float *out) {
    dequantize_codes(codes, scales, 4, block_log2, count, out);
}

/* Groups of eight entries the int2 selection below scans before it quantizes and writes
 * back what they kept (16 KB of e: the write-back finds it in cache). */
#define QUANT_TILE 512
/* Most values in a block of the fused int2 selection (its window of dequantized values). */
#define QUANT_MAX_BLOCK 1024

/* Int2 of m kept values v (compression/quantizers.py: round to nearest, qmax 1): the scale
 * max|v| / 1 into *scale, v / scale rounded half to even and clamped to -1..1, packed as
 * code = q + 2, four per byte, high bits first, into codes (m a multiple of 4 but for the
 * last block, whose last byte is zero-padded), and the dequantized q * scale into deq. */
__attribute__((target("avx2"))) static void quantize_int2(const float *v, int64_t m,
                                                          uint8_t *codes, float *scale,
                                                          float *deq) {
    const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    __m256 top = _mm256_setzero_ps();
    int64_t full = m / 8;
    for (int64_t i = 0; i < full; i++) {
        top = _mm256_max_ps(top, _mm256_and_ps(_mm256_loadu_ps(v + 8 * i), magnitude));
    }
    float lanes[8];
    _mm256_storeu_ps(lanes, top);
    float amax = 0.0f;
    for (int l = 0; l < 8; l++) {
        amax = lanes[l] > amax ? lanes[l] : amax;
    }
    for (int64_t j = 8 * full; j < m; j++) {
        float x = v[j] < 0 ? -v[j] : v[j];
        amax = x > amax ? x : amax;
    }
    float s = amax / 1.0f;
    *scale = s;
    const __m256 safe = _mm256_set1_ps(s > 0.0f ? s : 1.0f), sv = _mm256_set1_ps(s);
    const __m256 one = _mm256_set1_ps(1.0f), minus_one = _mm256_set1_ps(-1.0f);
    const __m256i two = _mm256_set1_epi32(2), shifts = _mm256_setr_epi32(6, 4, 2, 0, 6, 4, 2, 0);
    for (int64_t i = 0; i < full; i++) {
        __m256 y = _mm256_round_ps(_mm256_div_ps(_mm256_loadu_ps(v + 8 * i), safe),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        __m256i q = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(y, minus_one), one));
        _mm256_storeu_ps(deq + 8 * i, _mm256_mul_ps(_mm256_cvtepi32_ps(q), sv));
        __m256i fields = _mm256_sllv_epi32(_mm256_add_epi32(q, two), shifts);
        __m256i pairs = _mm256_hadd_epi32(fields, fields);
        __m256i quads = _mm256_hadd_epi32(pairs, pairs);
        codes[2 * i] = (uint8_t)_mm256_extract_epi32(quads, 0);
        codes[2 * i + 1] = (uint8_t)_mm256_extract_epi32(quads, 4);
    }
    float fs = s > 0.0f ? s : 1.0f;
    for (int64_t j = 8 * full; j < m; j++) {
        float y = __builtin_nearbyintf(v[j] / fs);
        int q = y < -1.0f ? -1 : (y > 1.0f ? 1 : (int)y);
        deq[j] = (float)q * s;
        if ((j & 3) == 0) {
            codes[j >> 2] = 0;
        }
        codes[j >> 2] |= (uint8_t)((q + 2) << (6 - 2 * (j & 3)));
    }
}

/* gg_accumulate_select_f32 with the kept values also quantized to int2 in blocks of
 * 2^block_log2 (at most QUANT_MAX_BLOCK; the last block shorter): their codes and scales,
 * and error feedback's e = e + deq * -1 at their positions (what bitmap_add gives), written
 * back a tile at a time while the tile is in cache -- so the encode's selection,
 * quantization and the residual's update are one pass over e instead of three. values
 * still gets the kept values (a fallback puts them back). out[0]: the kept count (-1: more
 * than room, then only the accumulation goes on), out[1]: how many of them, the first in
 * order, were written back (all when the pass ends with a selection). *left2: ||e||^2 once
 * the pass ends with a selection (the residual error feedback keeps, summed as the
 * write-back goes: no read of e of its own for the metric), else -1. Returns as
 * gg_accumulate_select_f32. */
__attribute__((target("avx2"))) int64_t gg_accumulate_select_int2(
    float *e, const float *a, const float *b, int64_t n, float threshold, uint8_t *bits,
    float *values, int64_t room, uint8_t *codes, float *scales, int64_t block_log2,
    int64_t *out, double *left2) {
    const __m256 t = _mm256_set1_ps(threshold), zero = _mm256_setzero_ps();
    double left_total = 0.0; /* ||e||^2 of the groups written back so far */
    *left2 = -1.0;
    const __m256 minus_one = _mm256_set1_ps(-1.0f);
    const int64_t block = (int64_t)1 << block_log2;
    /* The dequantized values of kept ones not yet written back: value j at deq[j - low]. */
    float deq[8 * QUANT_TILE + QUANT_MAX_BLOCK + 16];
    int64_t held = 0, quantized = 0, written = 0, low = 0, next_group = 0, full = n / 8;
    if (block > QUANT_MAX_BLOCK || block < 8) {
        out[0] = -1, out[1] = 0;
        return 0;
    }
    for (int64_t t0 = 0; t0 <= full; t0 += QUANT_TILE) {
        int64_t t1 = t0 + QUANT_TILE < full ? t0 + QUANT_TILE : full;
        for (int64_t i = t0; i < t1; i++) {
            __m256 x = _mm256_add_ps(_mm256_loadu_ps(e + 8 * i),
                                     _mm256_sub_ps(_mm256_loadu_ps(a + 8 * i),
                                                   _mm256_loadu_ps(b + 8 * i)));
            if (_mm256_movemask_ps(_mm256_cmp_ps(_mm256_sub_ps(x, x), zero, _CMP_NEQ_UQ))) {
                out[0] = held, out[1] = written;
                return i + 1;
            }
            _mm256_storeu_ps(e + 8 * i, x);
            if (held >= 0) {
                held = keep_eight(x, t, bits + i, values, held, room);
            }
        }
        int last = t1 == full;
        if (last && n % 8 &&
            accumulate_select_tail(e, a, b, 8 * full, n, threshold, bits + full, values, &held,
                                   room)) {
            out[0] = held, out[1] = written;
            return full + 1;
        }
        if (held < 0) {
            if (last) {
                break;
            }
            continue;
        }
        while (held - quantized >= block || (last && held > quantized)) {
            int64_t m = held - quantized < block ? held - quantized : block;
            quantize_int2(values + quantized, m, codes + (quantized >> 2),
                          scales + (quantized >> block_log2), deq + (quantized - low));
            quantized += m;
        }
        /* Write back through the groups scanned, as far as their values are quantized:
         * eight groups at a time where all their values are (each group's first value from
         * the prefix sums of the eight bytes' popcounts, so the groups do not wait on one
         * another), then one at a time. */
        __m256 squares = zero; /* of the residual's groups written back by this tile */
        while (next_group + 8 <= t1) {
            uint64_t w;
            memcpy(&w, bits + next_group, 8);
            uint64_t sums = byte_popcounts(w) * 0x0101010101010101ULL; /* byte l: groups <= l */
            uint64_t before = sums << 8;
            int64_t total = (int64_t)(sums >> 56);
            if (written + total > quantized) {
                break;
            }
            for (int l = 0; l < 8; l++) {
                int m = reversed[(w >> (8 * l)) & 0xff];
                int64_t at = written + (int64_t)((before >> (8 * l)) & 0xff) - low;
                float *at_e = e + 8 * (next_group + l);
                __m256 left = add_kept(_mm256_loadu_ps(at_e), deq + at, m, minus_one);
                _mm256_storeu_ps(at_e, left);
                squares = _mm256_add_ps(squares, _mm256_mul_ps(left, left));
            }
            written += total;
            next_group += 8;
        }
        for (; next_group < t1; next_group++) {
            int m = reversed[bits[next_group]];
            int c = __builtin_popcount(m);
            if (written + c > quantized) {
                break;
            }
            float *at_e = e + 8 * next_group;
            __m256 left = _mm256_loadu_ps(at_e);
            if (c) {
                left = add_kept(left, deq + (written - low), m, minus_one);
                _mm256_storeu_ps(at_e, left);
            }
            squares = _mm256_add_ps(squares, _mm256_mul_ps(left, left));
            written += c;
        }
        float lanes[8];
        _mm256_storeu_ps(lanes, squares);
        for (int l = 0; l < 8; l++) {
            left_total += lanes[l];
        }
        if (last) {
            for (int64_t p = 8 * full; p < n; p++) {
                if (bits[full] & (0x80 >> (p - 8 * full))) {
                    e[p] = e[p] + deq[written - low] * -1.0f;
                    written++;
                }
                left_total += (double)e[p] * e[p];
            }
            break;
        }
        memmove(deq, deq + (written - low), (size_t)(quantized - written) * sizeof(float));
        low = written;
    }
    out[0] = held, out[1] = written;
    if (held >= 0) {
        *left2 = left_total;
    }
    return 0;
}

/* x = x + (a - b), a - b rounded first (torch's sub into a buffer, then add_), in one pass:
 * diloco's parameters moved by a' - theta_r after a round in the background. */
__attribute__((target("avx2"))) void gg_add_difference_f32(float *x, const float *a,
                                                           const float *b, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 d = _mm256_sub_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i));
        _mm256_storeu_ps(x + i, _mm256_add_ps(_mm256_loadu_ps(x + i), d));
    }
    for (; i < n; i++) {
        x[i] = x[i] + (a[i] - b[i]);
    }
}

/* Eight (or one) entries of a copy as float32: float16 where `half`, else float32. */
__attribute__((target("avx2,f16c"))) static inline __m256 load_copy(const void *c, int64_t i,
                                                                    int half) {
    if (half) {
        return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)c + i)));
    }
    return _mm256_loadu_ps((const float *)c + i);
}

__attribute__((target("avx2,f16c"))) static inline float copy_at(const void *c, int64_t i,
                                                                  int half) {
    return half ? _cvtsh_ss(((const uint16_t *)c)[i]) : ((const float *)c)[i];
}

/* CHOCO's consensus step over copies of one dtype (float16 where `half`, else float32):
 * x += gamma * sum_j w_j (m_j - p_j), each edge's difference of its mirror and its public
 * copy taken in float32 before it is weighted (peer/algorithms/mixing.py consensus_step).
 * Returns ||sum_j w_j (m_j - p_j)||^2. With `also` (else NULL) the new x is also written
 * there, in the same pass: a tensor that is to equal x after the step (diloco's parameters
 * after the anchors' round) needs no copy of its own. */
__attribute__((target("avx2,f16c"))) double gg_consensus_f32(float *x,
                                                             const void *const *publics,
                                                             const void *const *mirrors,
                                                             const float *weights, int64_t count,
                                                             int64_t n, float gamma, int half,
                                                             float *also) {
    const __m256 g = _mm256_set1_ps(gamma);
    double total = 0.0;
    int64_t full = n / 8;
    for (int64_t lo = 0; lo < full; lo += 512) {
        int64_t hi = lo + 512 < full ? lo + 512 : full;
        __m256 dist = _mm256_setzero_ps();
        for (int64_t i = lo; i < hi; i++) {
            __m256 d = _mm256_mul_ps(_mm256_sub_ps(load_copy(mirrors[0], 8 * i, half),
                                                   load_copy(publics[0], 8 * i, half)),
                                     _mm256_set1_ps(weights[0]));
            for (int64_t j = 1; j < count; j++) {
                __m256 e = _mm256_sub_ps(load_copy(mirrors[j], 8 * i, half),
                                         load_copy(publics[j], 8 * i, half));
                d = _mm256_add_ps(d, _mm256_mul_ps(e, _mm256_set1_ps(weights[j])));
            }
            dist = _mm256_add_ps(dist, _mm256_mul_ps(d, d));
            __m256 moved = _mm256_add_ps(_mm256_loadu_ps(x + 8 * i), _mm256_mul_ps(d, g));
            _mm256_storeu_ps(x + 8 * i, moved);
            if (also) {
                _mm256_storeu_ps(also + 8 * i, moved);
            }
        }
        float lanes[8];
        _mm256_storeu_ps(lanes, dist);
        for (int l = 0; l < 8; l++) {
            total += lanes[l];
        }
    }
    for (int64_t i = 8 * full; i < n; i++) {
        float d = 0.0f;
        for (int64_t j = 0; j < count; j++) {
            d += (copy_at(mirrors[j], i, half) - copy_at(publics[j], i, half)) * weights[j];
        }
        total += (double)d * d;
        x[i] = x[i] + d * gamma;
        if (also) {
            also[i] = x[i];
        }
    }
    return total;
}

#else /* no AVX2 build: numpy's passes serve */

int gg_fast(void) { return 0; }

int64_t gg_select_f32(const float *x, int64_t n, float threshold, uint8_t *bits, float *values,
                      int64_t room) {
    (void)x, (void)n, (void)threshold, (void)bits, (void)values, (void)room;
    return -1;
}

int64_t gg_bitmap_add_f32(const uint8_t *bits, int64_t n, const float *values, int64_t count,
                          float *target, float alpha) {
    (void)bits, (void)n, (void)values, (void)count, (void)target, (void)alpha;
    return -1;
}

int64_t gg_bitmap_gather_f32(const uint8_t *bits, int64_t n, const float *src, float *out,
                             int64_t count) {
    (void)bits, (void)n, (void)src, (void)out, (void)count;
    return -1;
}

int64_t gg_sign_encode_f16(const float *a, uint16_t *b, int64_t n, int64_t block,
                           uint8_t *bits, float *scales, int fold, double *left2) {
    (void)a, (void)b, (void)n, (void)block, (void)bits, (void)scales, (void)fold, (void)left2;
    return -1;
}

void gg_sign_add_f16(const uint8_t *bits, const float *scales, int64_t n, int64_t block,
                     uint16_t *target) {
    (void)bits, (void)scales, (void)n, (void)block, (void)target;
}

int64_t gg_bitmap_add_many_f32(int64_t terms, const uint8_t *const *bits,
                               const float *const *values, const int64_t *counts,
                               const float *alphas, int64_t n, float *target) {
    (void)terms, (void)bits, (void)values, (void)counts, (void)alphas, (void)n, (void)target;
    return -1;
}

int64_t gg_accumulate_select_f32(float *e, const float *a, const float *b, int64_t n,
                                 float threshold, uint8_t *bits, float *values, int64_t room,
                                 int64_t *kept) {
    (void)e, (void)a, (void)b, (void)n, (void)threshold, (void)bits, (void)values, (void)room;
    *kept = -1;
    return -1;
}

int64_t gg_int2_first_zero(const uint8_t *codes, int64_t count) {
    (void)codes, (void)count;
    return -2;
}

void gg_int2_dequantize(const uint8_t *codes, const float *scales, int64_t block_log2,
                        int64_t count, float *out) {
    (void)codes, (void)scales, (void)block_log2, (void)count, (void)out;
}

void gg_int4_dequantize(const uint8_t *codes, const float *scales, int64_t block_log2,
                        int64_t count, float *out) {
    (void)codes, (void)scales, (void)block_log2, (void)count, (void)out;
}

int64_t gg_accumulate_select_int2(float *e, const float *a, const float *b, int64_t n,
                                  float threshold, uint8_t *bits, float *values, int64_t room,
                                  uint8_t *codes, float *scales, int64_t block_log2,
                                  int64_t *out, double *left2) {
    (void)e, (void)a, (void)b, (void)n, (void)threshold, (void)bits, (void)values, (void)room;
    (void)codes, (void)scales, (void)block_log2;
    out[0] = -1, out[1] = 0, *left2 = -1.0;
    return -1;
}

void gg_add_difference_f32(float *x, const float *a, const float *b, int64_t n) {
    (void)x, (void)a, (void)b, (void)n;
}

double gg_consensus_f32(float *x, const void *const *publics, const void *const *mirrors,
                        const float *weights, int64_t count, int64_t n, float gamma, int half,
                        float *also) {
    (void)x, (void)publics, (void)mirrors, (void)weights, (void)count, (void)n, (void)gamma;
    (void)half, (void)also;
    return -1.0;
}

#endif
