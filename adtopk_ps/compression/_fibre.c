/* Per-fibre top-k by magnitude, without the GIL.
 *
 * A tensor viewed as [lead, n, rest] has lead * rest fibres x[a, :, j] of
 * length n. For each fibre one vectorised pass finds the largest |x| of each
 * strided group of entries; the k-th largest group maximum bounds the k-th
 * largest entry from below, so only the groups above it are read again (the
 * entries equal to it fill in after), into a candidate buffer of 4k that a
 * branch-free quickselect compacts.
 * Fibres too short for 4k groups of 4 are selected whole by a quickselect; fibres
 * holding a NaN stream every entry through the buffer.
 *
 * The torch kernels this replaces (a scoring pass, two selections and their
 * gathers) allocate and read the tensor several times.
 *
 * What is selected is fixed down to the last tie, so that the CUDA kernel (fibre_triton.py)
 * writes the same payload: the k entries of largest |x| (a NaN counts as an infinity), of
 * equal |x| the lower positions first, written as int64 into out[a, 0..k-1, j] in ascending
 * position (an order the GPU kernel can write as cheaply, unlike this search's scan order).
 * Candidates enter the buffer in position order and its compaction keeps their order, so
 * the first of the tied are the lowest positions and the positions come out sorted.
 * fibre_topk_feedback also does error feedback's compensation and update in
 * the same pass (see select_all).
 *
 * Where k is at most SMALL_K (ADTopk at 1% on fibres of up to 299 entries: most
 * convolutions and the hidden size of small Transformers), fibres are streamed side by
 * side instead (see stream_k).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef float v4f __attribute__((vector_size(16)));
typedef int32_t v4i __attribute__((vector_size(16)));
#ifdef __SSE__
#include <xmmintrin.h>
#endif

typedef struct {
    float *value;   /* |x| of a candidate */
    int64_t *pos;   /* its position in the fibre, ascending along the buffer */
    float *scratch; /* a copy of value (or of maxima) for the selection */
    float *maxima;  /* the largest |x| of each group of the fibre */
    Py_ssize_t *chosen; /* the groups read again (fewer than k) */
    Py_ssize_t *tied;   /* the groups whose largest |x| is at least t, where ties can lie */
    Py_ssize_t k, size, cap;
} Candidates;

/* |v|, a NaN's as an infinity: NaN counts as the largest magnitude, so that a selection
 * never silently drops one */
static inline float magnitude(float v)
{
    v = fabsf(v);
    return v != v ? INFINITY : v;
}

/* The k-th largest of v[0..size) (1 <= k <= size), using tmp (size floats); both are
 * overwritten. Partitions are branch-free (every entry is written to both ends, and only
 * the right end's cursor moves), which measured twice as fast as a swapping quickselect
 * on these short, random arrays. */
static float kth_largest(float *v, float *tmp, Py_ssize_t size, Py_ssize_t k)
{
    Py_ssize_t want = k - 1;
    while (size > 16) {
        float a = v[0], b = v[size / 2], c = v[size - 1];  /* median of three */
        float pivot = a > b ? (b > c ? b : (a > c ? c : a)) : (a > c ? a : (b > c ? c : b));
        Py_ssize_t above = 0, below = 0;
        for (Py_ssize_t i = 0; i < size; i++) {
            float e = v[i];
            tmp[above] = e;
            tmp[size - 1 - below] = e;
            above += e > pivot;
            below += e < pivot;
        }
        if (want < above) {
            size = above;
        } else if (want < size - below) {
            return pivot;
        } else {
            want -= size - below;
            memmove(tmp, tmp + size - below, sizeof(float) * (size_t)below);
            size = below;
        }
        float *swap_buffers = v;
        v = tmp;
        tmp = swap_buffers;
    }
    for (Py_ssize_t i = 1; i < size; i++) {  /* insertion sort, descending */
        float e = v[i];
        Py_ssize_t j = i;
        for (; j > 0 && v[j - 1] < e; j--)
            v[j] = v[j - 1];
        v[j] = e;
    }
    return v[want];
}

/* Keep the k largest candidates, in their order (ties at the k-th go to the first, the lower
 * positions); returns the smallest value kept, the threshold later entries must beat. */
static float keep_largest(Candidates *c)
{
    memcpy(c->scratch, c->value, sizeof(float) * (size_t)c->size);
    float least = kth_largest(c->scratch, c->scratch + c->cap, c->size, c->k);
    Py_ssize_t above = 0;
    for (Py_ssize_t i = 0; i < c->size; i++)
        above += c->value[i] > least;
    Py_ssize_t ties = c->k - above, kept = 0;
    for (Py_ssize_t i = 0; i < c->size; i++) {
        float v = c->value[i];
        if (v > least || (v == least && ties-- > 0)) {
            c->value[kept] = v;
            c->pos[kept++] = c->pos[i];
        }
    }
    c->size = kept;
    return least;
}

/* Candidates come in position order, so an entry equal to the threshold comes after every
 * kept entry it ties with, and loses to them. NaN counts as the largest magnitude, so that
 * it is never silently dropped. */
static inline void add(Candidates *c, float v, int64_t pos, float *threshold)
{
    if (v != v)  /* before the comparison: a NaN ties with an infinity at the threshold */
        v = INFINITY;
    if (v <= *threshold)
        return;
    c->value[c->size] = v;
    c->pos[c->size++] = pos;
    if (c->size == c->cap)
        *threshold = keep_largest(c);
}

/* Group size for a fibre: the largest whose group count leaves at least 4k groups, so the
 * threshold below is tight; 0 when even groups of 4 are too few (the caller sorts those
 * fibres by streaming every entry through the candidates). */
static Py_ssize_t group_size(Py_ssize_t n, Py_ssize_t k)
{
    for (Py_ssize_t g = 16; g >= 4; g /= 2)
        if (n / g >= 4 * k)
            return g;
    return 0;
}

/* Group maxima computed side by side: one chain of maxima waits on each max's latency */
#define LANES 4

/* The larger of a and b lane by lane (NaN in a gives b: the caller looks for NaN itself) */
static inline v4f larger(v4f a, v4f b)
{
#ifdef __SSE__
    return (v4f)_mm_max_ps((__m128)a, (__m128)b);
#else
    v4i up = a > b;
    return (v4f)((up & (v4i)a) | (~up & (v4i)b));
#endif
}

/* Largest |x| of every group; group j holds entries j, j + m, ..., j + (g-1)m, so the
 * maxima are an elementwise max of g slices (vector ops, no reduction across lanes).
 * False if a NaN was seen, which a max would hide. */
static int group_maxima(const float *x, Py_ssize_t m, Py_ssize_t g, float *maxima)
{
    const v4i magnitude = {0x7fffffff, 0x7fffffff, 0x7fffffff, 0x7fffffff};
    v4i nan = {0, 0, 0, 0};
    int nan_tail = 0;
    Py_ssize_t j = 0;
    for (; j + 4 * LANES <= m; j += 4 * LANES) {  /* LANES independent chains of maxima */
        v4f best[LANES];
        for (int l = 0; l < LANES; l++)
            best[l] = (v4f){0, 0, 0, 0};
        for (Py_ssize_t q = 0; q < g; q++) {
            for (int l = 0; l < LANES; l++) {
                v4f b;
                memcpy(&b, x + q * m + j + 4 * l, sizeof b);
                b = (v4f)((v4i)b & magnitude);
                nan |= b != b;
                best[l] = larger(b, best[l]);
            }
        }
        memcpy(maxima + j, best, sizeof best);
    }
    for (; j + 4 <= m; j += 4) {
        v4f best = {0, 0, 0, 0};
        for (Py_ssize_t q = 0; q < g; q++) {
            v4f b;
            memcpy(&b, x + q * m + j, sizeof b);
            b = (v4f)((v4i)b & magnitude);
            nan |= b != b;
            best = larger(b, best);
        }
        memcpy(maxima + j, &best, sizeof best);
    }
    for (; j < m; j++) {
        float best = 0;
        for (Py_ssize_t q = 0; q < g; q++) {
            float a = fabsf(x[q * m + j]);
            nan_tail |= a != a;
            best = a > best ? a : best;
        }
        maxima[j] = best;
    }
    return !(nan[0] | nan[1] | nan[2] | nan[3] | nan_tail);
}

/* Positions a[0..na) and b[0..nb), each ascending, into out in ascending order */
static void merge_into(const int64_t *a, Py_ssize_t na, const int64_t *b, Py_ssize_t nb,
                       int64_t *out, Py_ssize_t out_stride)
{
    Py_ssize_t i = 0, j = 0;
    for (Py_ssize_t t = 0; t < na + nb; t++)
        out[t * out_stride] = j == nb || (i < na && a[i] < b[j]) ? a[i++] : b[j++];
}

/* The k largest |x| of a fibre with no groups to search (k above n / 16), positions into
 * out (ascending): the k-th largest |x| t by a quickselect over a copy (scratch: 2n floats),
 * then one pass in position order takes every entry above t and the first of those equal
 * to it. Streaming every entry through the candidates measured slower, at a compaction per
 * 3k entries. */
static void select_whole(const float *x, Py_ssize_t n, Py_ssize_t k, float *scratch,
                         int64_t *out, Py_ssize_t out_stride)
{
    for (Py_ssize_t i = 0; i < n; i++)
        scratch[i] = magnitude(x[i]);
    float t = kth_largest(scratch, scratch + n, n, k);
    Py_ssize_t ties = k;
    for (Py_ssize_t i = 0; i < n; i++)
        ties -= magnitude(x[i]) > t;
    for (Py_ssize_t i = 0, w = 0; w < k; i++) {
        float v = magnitude(x[i]);
        if (v > t || (v == t && ties-- > 0))
            out[w++ * out_stride] = i;
    }
}

/* The k largest |x| of one contiguous fibre of length n, positions into out (ascending).
 *
 * A group whose largest |x| is below the k-th largest group maximum t holds none of the
 * top k: at least k groups reach t, so at least k entries do. One vectorised pass finds
 * the group maxima and t, and only the groups above t (fewer than k of them, still in
 * cache) are read again, entry by entry: a row of the groups at a time, which keeps the
 * candidates in position order. */
static void select_fibre(const float *x, Py_ssize_t n, Candidates *c, int64_t *out,
                         Py_ssize_t out_stride)
{
    Py_ssize_t g = group_size(n, c->k), m = g ? n / g : 0, start = 0;
    if (!g) {
        select_whole(x, n, c->k, c->scratch, out, out_stride);
        return;
    }
    float threshold = -1.0f;  /* below every |x|: every entry is a candidate */
    float t = -1.0f;
    Py_ssize_t ties = -1;  /* groups that can hold an entry equal to t (-1: any entry can) */
    c->size = 0;
    if (group_maxima(x, m, g, c->maxima)) {  /* else a NaN: every entry streams through */
        memcpy(c->scratch, c->maxima, sizeof(float) * (size_t)m);
        t = kth_largest(c->scratch, c->scratch + m, m, c->k);
        threshold = t;  /* entries above t first; ties at t fill in below */
        Py_ssize_t groups = 0;
        ties = 0;
        for (Py_ssize_t j = 0; j < m; j++) {
            c->chosen[groups] = j;
            c->tied[ties] = j;
            groups += c->maxima[j] > t;
            ties += c->maxima[j] >= t;
        }
        for (Py_ssize_t row = 0; row < g * m; row += m)
            for (Py_ssize_t q = 0; q < groups; q++)
                add(c, fabsf(x[row + c->chosen[q]]), row + c->chosen[q], &threshold);
        start = m * g;  /* what fills no group is always read */
    }
    for (Py_ssize_t i = start; i < n; i++)
        add(c, fabsf(x[i]), i, &threshold);
    if (c->size > c->k)
        keep_largest(c);
    /* Fewer than k entries above t: the rest are entries equal to t, the first ones by
     * position, merged in. Reading them one by one as candidates cost a buffer compaction
     * per 3k entries, and a fibre of zeros (a dead unit's gradient row) is all ties. Only
     * the groups whose largest |x| reaches t can hold one, and what fills no group: those
     * are read, a row of the groups at a time (in position order), then the rest. */
    Py_ssize_t above = c->size;
    if (ties >= 0) {
        for (Py_ssize_t row = 0; c->size < c->k && row < g * m; row += m)
            for (Py_ssize_t q = 0; c->size < c->k && q < ties; q++)
                if (fabsf(x[row + c->tied[q]]) == t)
                    c->pos[c->size++] = row + c->tied[q];
    }
    for (Py_ssize_t i = start; c->size < c->k && i < n; i++)
        if (magnitude(x[i]) == t)  /* a NaN past the groups ties with t = inf */
            c->pos[c->size++] = i;
    merge_into(c->pos, above, c->pos + above, c->size - above, out, out_stride);
}

#define SMALL_K 2  /* k = 3 and 4 measured slower streamed than searched */

static inline v4i pick(v4i mask, v4i yes, v4i no)
{
    return (mask & yes) | (~mask & no);
}

/* Insert v (at position `here`) into the sorted K best of 4 fibres: below every kept entry
 * at least as large, so that ties go to the lower position when positions only grow. */
static inline __attribute__((always_inline)) void
insert(v4f *b, v4i *p, const int K, v4f v, v4i here)
{
    for (int t = K - 1; t > 0; t--) {  /* from the bottom: slot t-1 is still old */
        v4i stay = b[t] >= v, shift = b[t - 1] < v;
        v4f moved = (v4f)pick(shift, (v4i)b[t - 1], (v4i)v);
        v4i moved_at = pick(shift, p[t - 1], here);
        b[t] = (v4f)pick(stay, (v4i)b[t], (v4i)moved);
        p[t] = pick(stay, p[t], moved_at);
    }
    v4i stay = b[0] >= v;
    b[0] = (v4f)pick(stay, (v4i)b[0], (v4i)v);
    p[0] = pick(stay, p[0], here);
}

static inline v4f magnitude_of(v4f v)
{
    const v4i magnitude = {0x7fffffff, 0x7fffffff, 0x7fffffff, 0x7fffffff};
    const v4f infinite = {INFINITY, INFINITY, INFINITY, INFINITY};
    v = (v4f)((v4i)v & magnitude);
    return (v4f)pick(v != v, (v4i)infinite, (v4i)v);  /* NaN: the largest, as in torch.topk */
}

/* The K largest |x| of `lanes` (at least 4) fibres stored side by side (entry i of fibre j
 * at src[i * stride + j]); their positions go to at ([K, lanes]). When lanes is not a
 * multiple of 4, the last 4 overlap the ones before (computed twice, the same).
 * Branch-free vector code, 4 fibres at a time: K selects an entry, where the group
 * search's fixed costs per fibre (a quickselect over the group maxima, candidate
 * compaction) dominate short fibres. Each fibre's two halves are streamed side by side
 * (two independent chains of selects, which the core overlaps), then the second half's
 * best, all at higher positions, are inserted into the first's. */
static inline __attribute__((always_inline)) void
stream_k(const float *src, Py_ssize_t n, Py_ssize_t stride, Py_ssize_t lanes, const int K,
         int32_t *at)
{
    Py_ssize_t half = n / 2;
    for (Py_ssize_t j0 = 0; j0 < lanes; j0 += 4) {
        Py_ssize_t j = j0 + 4 <= lanes ? j0 : lanes - 4;
        v4f b[SMALL_K], c[SMALL_K];
        v4i p[SMALL_K], q[SMALL_K];
        for (int t = 0; t < K; t++) {
            b[t] = c[t] = (v4f){-1.0f, -1.0f, -1.0f, -1.0f};  /* below every |x| */
            p[t] = q[t] = (v4i){0, 0, 0, 0};
        }
        for (Py_ssize_t i = 0; i < half; i++) {
            v4f u, v;
            memcpy(&u, src + i * stride + j, sizeof u);
            memcpy(&v, src + (i + half) * stride + j, sizeof v);
            const v4i lo = {(int32_t)i, (int32_t)i, (int32_t)i, (int32_t)i};
            insert(b, p, K, magnitude_of(u), lo);
            insert(c, q, K, magnitude_of(v), lo + (int32_t)half);
        }
        for (Py_ssize_t i = 2 * half; i < n; i++) {  /* an odd fibre's last entry */
            v4f v;
            memcpy(&v, src + i * stride + j, sizeof v);
            insert(c, q, K, magnitude_of(v), (v4i){(int32_t)i, (int32_t)i, (int32_t)i, (int32_t)i});
        }
        for (int t = 0; t < K; t++)  /* largest first, so equal ones keep their order */
            insert(b, p, K, c[t], q[t]);
        for (int t = 0; t < K; t++)
            memcpy(at + t * lanes + j, &p[t], sizeof p[t]);
    }
}

static void stream(const float *src, Py_ssize_t n, Py_ssize_t stride, Py_ssize_t lanes,
                   Py_ssize_t k, int32_t *at)
{
    if (k == 1)
        stream_k(src, n, stride, lanes, 1, at);
    else
        stream_k(src, n, stride, lanes, 2, at);
}

/* The k largest |x| of one contiguous fibre. Its entries i = 4q + l form 4 strided fibres
 * (l = 0..3) streamed side by side; the fibre's k largest are among their 4k, plus the
 * n % 4 entries left over, and are picked from those with ties to the lower position.
 * A fibre too short for k per strided fibre is picked from whole. */
static void select_row(const float *x, Py_ssize_t n, Py_ssize_t k, int32_t *at)
{
    int32_t strided[4 * SMALL_K];
    float best[SMALL_K];
    Py_ssize_t groups = n / 4 >= k ? n / 4 : 0, listed = groups ? 4 * k : 0;
    if (groups)
        stream(x, groups, 4, 4, k, strided);
    for (Py_ssize_t t = 0; t < k; t++)
        best[t] = -1.0f;  /* below every |x| */
    for (Py_ssize_t c = 0; c < listed + n - 4 * groups; c++) {
        int32_t pos = c < listed ? strided[c] * 4 + (int32_t)(c % 4) : (int32_t)(4 * groups + c - listed);
        float v = magnitude(x[pos]);
        Py_ssize_t t = k;  /* insert below every kept entry that is larger, or as large and before */
        while (t > 0 && (best[t - 1] < v || (best[t - 1] == v && at[t - 1] > pos)))
            t--;
        for (Py_ssize_t u = k - 1; u > t; u--) {
            best[u] = best[u - 1];
            at[u] = at[u - 1];
        }
        if (t < k) {
            best[t] = v;
            at[t] = pos;
        }
    }
}

/* How many lanes a slab's position list spans: its fibres, at least 4 of them (fewer are
 * copied into 4 lanes), or 1 for a contiguous fibre. */
static Py_ssize_t lane_span(Py_ssize_t rest)
{
    return rest >= 4 ? rest : rest > 1 ? 4 : 1;
}

/* With rows (error feedback only), slab a's selection, just written at row `written` of
 * values and out, stays there only if it holds a nonzero value (a NaN counts), and rows
 * lists the slabs kept; a slab of zeros (a dead unit) is overwritten by the next one.
 * Returns the rows written so far. */
static inline Py_ssize_t keep_row(const float *values, int64_t *rows, Py_ssize_t a,
                                  Py_ssize_t written, Py_ssize_t size)
{
    if (rows == NULL)
        return written + 1;
    const float *v = values + written * size;
    int live = 0;
    for (Py_ssize_t i = 0; i < size; i++)
        live |= v[i] != 0.0f;
    if (live)
        rows[written] = a;
    return written + live;
}

/* select_all for k <= SMALL_K, a slab at a time (error feedback's x += grad first): its
 * `rest` fibres lie side by side, and are streamed in place from 4 of them up (fewer are
 * copied into 4 lanes, the padding streamed and ignored). Positions go to out in ascending
 * order (streaming finds them largest first) and, with values, the selected entries to
 * values and then to zero. */
static Py_ssize_t select_small(float *x, const float *grad, float *values, Py_ssize_t lead,
                               Py_ssize_t n, Py_ssize_t rest, Py_ssize_t k, float *lanes,
                               int32_t *at, int64_t *out, int64_t *rows)
{
    Py_ssize_t w = lane_span(rest), written = 0;
    if (lanes != NULL)
        memset(lanes, 0, sizeof(float) * (size_t)(n * 4));
    for (Py_ssize_t a = 0; a < lead; a++) {
        float *slab = x + a * n * rest;
        if (grad != NULL) {
            const float *g = grad + a * n * rest;
            for (Py_ssize_t i = 0; i < n * rest; i++)
                slab[i] += g[i];
        }
        if (rest >= 4) {
            stream(slab, n, rest, rest, k, at);
        } else if (rest > 1) {
            for (Py_ssize_t i = 0; i < n; i++)
                for (Py_ssize_t j = 0; j < rest; j++)
                    lanes[i * 4 + j] = slab[i * rest + j];
            stream(lanes, n, 4, 4, k, at);
        } else {
            select_row(slab, n, k, at);
        }
        for (Py_ssize_t j = 0; j < rest; j++) {
            Py_ssize_t swap = k == 2 && at[j] > at[w + j];  /* t ^ swap: the t-th by position */
            for (Py_ssize_t t = 0; t < k; t++) {
                int64_t pos = at[(t ^ swap) * w + j];
                Py_ssize_t o = written * k * rest + t * rest + j;
                out[o] = pos;
                if (values != NULL) {
                    values[o] = slab[pos * rest + j];
                    slab[pos * rest + j] = 0.0f;
                }
            }
        }
        written = keep_row(values, rows, a, written, k * rest);
    }
    return written;
}

/* Every fibre of the [lead, n, rest] tensor x, slab x[a] by slab. With grad (error
 * feedback), x is the residual: each slab first becomes x + grad, then its selected entries
 * are copied into values ([lead, k, rest]) and zeroed, so x ends as what was not sent. The
 * slab is still in cache for the selection and for both writes, where separate torch
 * passes read the whole tensor from memory three times. */
static Py_ssize_t select_all(float *x, const float *grad, float *values, Py_ssize_t lead,
                             Py_ssize_t n, Py_ssize_t rest, Candidates *c, float *fibre,
                             int64_t *out, int64_t *rows)
{
    Py_ssize_t k = c->k, written = 0;
    for (Py_ssize_t a = 0; a < lead; a++) {
        float *slab = x + a * n * rest;
        int64_t *dst = out + written * k * rest;
        if (grad != NULL) {
            const float *g = grad + a * n * rest;
            for (Py_ssize_t i = 0; i < n * rest; i++)
                slab[i] += g[i];
        }
        for (Py_ssize_t j = 0; j < rest; j++) {
            const float *f = slab;
            if (rest > 1) {  /* gather the strided fibre first */
                for (Py_ssize_t i = 0; i < n; i++)
                    fibre[i] = slab[i * rest + j];
                f = fibre;
            }
            select_fibre(f, n, c, dst + j, rest);
            if (values == NULL)
                continue;
            for (Py_ssize_t t = 0; t < k; t++) {
                float *e = slab + dst[j + t * rest] * rest + j;
                values[written * k * rest + t * rest + j] = *e;
                *e = 0.0f;
            }
        }
        written = keep_row(values, rows, a, written, k * rest);
    }
    return written;
}

/* Returns how many rows of out (and values) were written: lead, or with rows the slabs
 * whose selection holds a nonzero value. */
static PyObject *run(float *x, const float *grad, float *values, Py_ssize_t lead, Py_ssize_t n,
                     Py_ssize_t rest, Py_ssize_t k, int64_t *out, int64_t *rows)
{
    Py_ssize_t written = 0;
    if (lead < 0 || rest < 1 || k < 1 || k > n) {
        PyErr_Format(PyExc_ValueError, "fibre_topk: bad sizes lead=%zd n=%zd rest=%zd k=%zd",
                     lead, n, rest, k);
        return NULL;
    }
    if (k <= SMALL_K && n <= INT32_MAX) {
        int needs_lanes = rest > 1 && rest < 4;
        float *lanes = needs_lanes ? malloc(sizeof(float) * (size_t)(n * 4)) : NULL;
        int32_t *at = malloc(sizeof(int32_t) * (size_t)(k * lane_span(rest)));
        PyObject *result = NULL;
        if (at == NULL || (needs_lanes && lanes == NULL)) {
            PyErr_NoMemory();
        } else {
            Py_BEGIN_ALLOW_THREADS
            written = select_small(x, grad, values, lead, n, rest, k, lanes, at, out, rows);
            Py_END_ALLOW_THREADS
            result = PyLong_FromSsize_t(written);
        }
        free(lanes);
        free(at);
        return result;
    }
    Candidates c = {NULL, NULL, NULL, NULL, NULL, NULL, k, 0, 4 * k};
    /* Fibres with groups need the candidates and at most n / 4 + 1 maxima; fibres without
     * (k above n / 16) only a copy of one fibre to select in (select_whole), where
     * candidates for every k would take several times the tensor's size. */
    size_t grouped = group_size(n, k) != 0, cap = grouped ? (size_t)c.cap : 1;
    size_t groups = grouped ? (size_t)(n / 4) + 1 : 1;
    size_t scratch = grouped ? (groups > cap ? groups : cap) : (size_t)n;
    c.value = malloc(sizeof(float) * cap);
    c.scratch = malloc(2 * sizeof(float) * scratch);
    c.maxima = malloc(sizeof(float) * groups);
    c.pos = malloc(sizeof(int64_t) * cap);
    c.chosen = malloc(sizeof(Py_ssize_t) * (grouped ? (size_t)k : 1));
    c.tied = malloc(sizeof(Py_ssize_t) * groups);
    float *fibre = rest > 1 ? malloc(sizeof(float) * (size_t)n) : NULL;
    PyObject *result = NULL;
    if (c.value == NULL || c.scratch == NULL || c.maxima == NULL || c.pos == NULL ||
            c.chosen == NULL || c.tied == NULL || (rest > 1 && fibre == NULL)) {
        PyErr_NoMemory();
    } else {
        Py_BEGIN_ALLOW_THREADS
        written = select_all(x, grad, values, lead, n, rest, &c, fibre, out, rows);
        Py_END_ALLOW_THREADS
        result = PyLong_FromSsize_t(written);
    }
    free(c.value);
    free(c.scratch);
    free(c.maxima);
    free(c.pos);
    free(c.chosen);
    free(c.tied);
    free(fibre);
    return result;
}

static PyObject *fibre_topk(PyObject *self, PyObject *args)
{
    unsigned long long x_addr, out_addr;
    Py_ssize_t lead, n, rest, k;
    (void)self;
    if (!PyArg_ParseTuple(args, "KnnnnK", &x_addr, &lead, &n, &rest, &k, &out_addr))
        return NULL;
    return run((float *)(uintptr_t)x_addr, NULL, NULL, lead, n, rest, k,
               (int64_t *)(uintptr_t)out_addr, NULL);
}

static PyObject *fibre_topk_feedback(PyObject *self, PyObject *args)
{
    unsigned long long r_addr, g_addr, out_addr, values_addr, rows_addr;
    Py_ssize_t lead, n, rest, k;
    (void)self;
    if (!PyArg_ParseTuple(args, "KKnnnnKKK", &r_addr, &g_addr, &lead, &n, &rest, &k, &out_addr,
                          &values_addr, &rows_addr))
        return NULL;
    return run((float *)(uintptr_t)r_addr, (const float *)(uintptr_t)g_addr,
               (float *)(uintptr_t)values_addr, lead, n, rest, k, (int64_t *)(uintptr_t)out_addr,
               (int64_t *)(uintptr_t)rows_addr);
}

static PyMethodDef methods[] = {
    {"fibre_topk", fibre_topk, METH_VARARGS,
     "fibre_topk(x_ptr, lead, n, rest, k, out_ptr): positions of the k largest |x| "
     "of every fibre of a contiguous float32 [lead, n, rest] tensor, as int64 [lead, k, rest]: "
     "NaN counts as an infinity, of equal |x| the lower positions are taken, and each fibre's "
     "positions are written in ascending order."},
    {"fibre_topk_feedback", fibre_topk_feedback, METH_VARARGS,
     "fibre_topk_feedback(r_ptr, g_ptr, lead, n, rest, k, out_ptr, values_ptr, rows_ptr): r += g, "
     "then fibre_topk of r; the selected entries of r go to values [lead, k, rest] and become 0. "
     "With rows_ptr (not 0), slabs r[a] whose values are all zero are left out, the others "
     "written in order and listed in rows (int64 [lead]); returns the rows written."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_fibre", NULL, -1, methods};

PyMODINIT_FUNC PyInit__fibre(void)
{
    return PyModule_Create(&module);
}
