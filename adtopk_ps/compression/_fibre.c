/* Per-fibre top-k by magnitude, without the GIL.
 *
 * A tensor viewed as [lead, n, rest] has lead * rest fibres x[a, :, j] of
 * length n. For each fibre one vectorised pass finds the largest |x| of each
 * strided group of entries; the k-th largest group maximum bounds the k-th
 * largest entry from below, so only the groups reaching it are read again,
 * into a candidate buffer of 4k that a branch-free quickselect compacts.
 * Short fibres and fibres holding a NaN stream every entry through the buffer.
 *
 * The torch kernels this replaces (a scoring pass, two selections and their
 * gathers) allocate and read the tensor several times.
 * Positions are written as int64 into out[a, t, j] (t < k, unordered).
 * fibre_topk_feedback also does error feedback's compensation and update in
 * the same pass (see select_all).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef float v4f __attribute__((vector_size(16)));
typedef int32_t v4i __attribute__((vector_size(16)));

typedef struct {
    float *value;   /* |x| of a candidate */
    int64_t *pos;   /* its position in the fibre */
    float *scratch; /* a copy of value (or of maxima) for the selection */
    float *maxima;  /* the largest |x| of each group of the fibre */
    Py_ssize_t k, size, cap;
} Candidates;

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

/* Keep the k largest candidates (ties at the k-th broken by position); returns the
 * smallest value kept, the threshold later entries must beat. */
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

/* NaN counts as the largest magnitude, as in torch.topk, so it is never silently dropped */
static inline void add(Candidates *c, float v, int64_t pos, float *threshold)
{
    if (v <= *threshold)
        return;
    if (v != v)
        v = INFINITY;
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

/* Largest |x| of every group; group j holds entries j, j + m, ..., j + (g-1)m, so the
 * maxima are an elementwise max of g slices (vector ops, no reduction across lanes).
 * False if a NaN was seen, which a max would hide. */
static int group_maxima(const float *x, Py_ssize_t m, Py_ssize_t g, float *maxima)
{
    const v4i magnitude = {0x7fffffff, 0x7fffffff, 0x7fffffff, 0x7fffffff};
    v4i nan = {0, 0, 0, 0};
    int nan_tail = 0;
    Py_ssize_t j = 0;
    for (; j + 4 <= m; j += 4) {
        v4f best = {0, 0, 0, 0};
        for (Py_ssize_t q = 0; q < g; q++) {
            v4f b;
            memcpy(&b, x + q * m + j, sizeof b);
            b = (v4f)((v4i)b & magnitude);
            nan |= b != b;
            v4i up = b > best;
            best = (v4f)((up & (v4i)b) | (~up & (v4i)best));
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

/* The k largest |x| of one contiguous fibre of length n, positions into out.
 *
 * A group whose largest |x| is below the k-th largest group maximum t holds none of the
 * top k: at least k groups reach t, so at least k entries do. One vectorised pass finds
 * the group maxima and t, and only the groups reaching t (about k of them, still in
 * cache) are read again, entry by entry. */
static void select_fibre(const float *x, Py_ssize_t n, Candidates *c, int64_t *out,
                         Py_ssize_t out_stride)
{
    Py_ssize_t g = group_size(n, c->k), m = g ? n / g : 0, start = 0;
    float threshold = -1.0f;  /* below every |x|: every entry is a candidate */
    c->size = 0;
    if (g && group_maxima(x, m, g, c->maxima)) {
        memcpy(c->scratch, c->maxima, sizeof(float) * (size_t)m);
        float t = kth_largest(c->scratch, c->scratch + m, m, c->k);
        threshold = nextafterf(t, -INFINITY);  /* entries equal to t are candidates */
        for (Py_ssize_t j = 0; j < m; j++)
            if (c->maxima[j] >= t)
                for (Py_ssize_t i = j; i < g * m; i += m)
                    add(c, fabsf(x[i]), i, &threshold);
        start = m * g;  /* what fills no group is always read */
    }
    for (Py_ssize_t i = start; i < n; i++)
        add(c, fabsf(x[i]), i, &threshold);
    if (c->size > c->k)
        keep_largest(c);
    for (Py_ssize_t t = 0; t < c->k; t++)
        out[t * out_stride] = c->pos[t];
}

/* Every fibre of the [lead, n, rest] tensor x, slab x[a] by slab. With grad (error
 * feedback), x is the residual: each slab first becomes x + grad, then its selected entries
 * are copied into values ([lead, k, rest]) and zeroed, so x ends as what was not sent. The
 * slab is still in cache for the selection and for both writes, where separate torch
 * passes read the whole tensor from memory three times. */
static void select_all(float *x, const float *grad, float *values, Py_ssize_t lead, Py_ssize_t n,
                       Py_ssize_t rest, Candidates *c, float *fibre, int64_t *out)
{
    Py_ssize_t k = c->k;
    for (Py_ssize_t a = 0; a < lead; a++) {
        float *slab = x + a * n * rest;
        int64_t *dst = out + a * k * rest;
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
                values[a * k * rest + t * rest + j] = *e;
                *e = 0.0f;
            }
        }
    }
}

static PyObject *run(float *x, const float *grad, float *values, Py_ssize_t lead, Py_ssize_t n,
                     Py_ssize_t rest, Py_ssize_t k, int64_t *out)
{
    if (lead < 0 || rest < 1 || k < 1 || k > n) {
        PyErr_Format(PyExc_ValueError, "fibre_topk: bad sizes lead=%zd n=%zd rest=%zd k=%zd",
                     lead, n, rest, k);
        return NULL;
    }
    Candidates c = {NULL, NULL, NULL, NULL, k, 0, 4 * k};
    size_t groups = (size_t)(n / 4) + 1;  /* at most this many maxima */
    c.value = malloc(sizeof(float) * (size_t)c.cap);
    c.scratch = malloc(2 * sizeof(float) * (groups > (size_t)c.cap ? groups : (size_t)c.cap));
    c.maxima = malloc(sizeof(float) * groups);
    c.pos = malloc(sizeof(int64_t) * (size_t)c.cap);
    float *fibre = rest > 1 ? malloc(sizeof(float) * (size_t)n) : NULL;
    PyObject *result = NULL;
    if (c.value == NULL || c.scratch == NULL || c.maxima == NULL || c.pos == NULL || (rest > 1 && fibre == NULL)) {
        PyErr_NoMemory();
    } else {
        Py_BEGIN_ALLOW_THREADS
        select_all(x, grad, values, lead, n, rest, &c, fibre, out);
        Py_END_ALLOW_THREADS
        result = Py_None;
        Py_INCREF(result);
    }
    free(c.value);
    free(c.scratch);
    free(c.maxima);
    free(c.pos);
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
               (int64_t *)(uintptr_t)out_addr);
}

static PyObject *fibre_topk_feedback(PyObject *self, PyObject *args)
{
    unsigned long long r_addr, g_addr, out_addr, values_addr;
    Py_ssize_t lead, n, rest, k;
    (void)self;
    if (!PyArg_ParseTuple(args, "KKnnnnKK", &r_addr, &g_addr, &lead, &n, &rest, &k, &out_addr,
                          &values_addr))
        return NULL;
    return run((float *)(uintptr_t)r_addr, (const float *)(uintptr_t)g_addr,
               (float *)(uintptr_t)values_addr, lead, n, rest, k, (int64_t *)(uintptr_t)out_addr);
}

static PyMethodDef methods[] = {
    {"fibre_topk", fibre_topk, METH_VARARGS,
     "fibre_topk(x_ptr, lead, n, rest, k, out_ptr): positions of the k largest |x| "
     "of every fibre of a contiguous float32 [lead, n, rest] tensor, as int64 [lead, k, rest]."},
    {"fibre_topk_feedback", fibre_topk_feedback, METH_VARARGS,
     "fibre_topk_feedback(r_ptr, g_ptr, lead, n, rest, k, out_ptr, values_ptr): r += g, then "
     "fibre_topk of r; the selected entries of r go to values [lead, k, rest] and become 0."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_fibre", NULL, -1, methods};

PyMODINIT_FUNC PyInit__fibre(void)
{
    return PyModule_Create(&module);
}
