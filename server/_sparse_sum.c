/* Sparse pushes summed into a key's buffer, and the round's answer read back, in time
 * proportional to what was pushed.
 *
 * The buffer is all zeros when a sparse round starts, so a position is new to the round
 * exactly when its entry is still zero as a value lands there; add() lists those. Reading
 * the answer, take_nonzero() takes each listed entry that is nonzero, in ascending position
 * order, and zeroes it, which also skips a position listed twice (its sum went back to zero
 * and was touched again) and leaves the buffer clean for the next round. No scan of the whole
 * key.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "../adtopk_ps/core/_index_types.h"

/* add(buf, numel, idx, idx_size, lead, n, rest, k, values, new, rows) -> how many new positions.
 * values and idx are [lead, k, rest]; entry (a, t, j) lands at (row(a) * n + idx) * rest + j,
 * where row(a) is rows[a] (int64, increasing) if rows is not 0, else a and lead covers the
 * buffer (a COO payload is lead = rest = 1, n = numel, k = its count, rows = 0). */
static PyObject *add(PyObject *self, PyObject *args)
{
    unsigned long long buf_addr, idx_addr, values_addr, new_addr, rows_addr;
    Py_ssize_t numel, lead, n, rest, k;
    int size;
    (void)self;
    if (!PyArg_ParseTuple(args, "KnKinnnnKKK", &buf_addr, &numel, &idx_addr, &size, &lead, &n,
                          &rest, &k, &values_addr, &new_addr, &rows_addr))
        return NULL;
    if (size != 1 && size != 2 && size != 4 && size != 8) {
        PyErr_Format(PyExc_ValueError, "sparse add: index size %d is not 1, 2, 4 or 8", size);
        return NULL;
    }
    Py_ssize_t full = n >= 1 && rest >= 1 && numel % (n * rest) == 0 ? numel / (n * rest) : -1;
    if (lead < 0 || full < 0 || k < 0 || (rows_addr ? lead > full : lead != full)) {
        PyErr_Format(PyExc_ValueError, "sparse add: view [%zd, %zd, %zd] does not cover %zd entries",
                     lead, n, rest, numel);
        return NULL;
    }
    const int64_t *rows = (const int64_t *)(uintptr_t)rows_addr;
    for (Py_ssize_t a = 0; rows && a < lead; a++) {
        if (rows[a] < 0 || rows[a] >= full || (a && rows[a] <= rows[a - 1])) {
            PyErr_Format(PyExc_ValueError, "sparse add: row %lld at %zd is not increasing within "
                         "[0, %zd)", (long long)rows[a], a, full);
            return NULL;
        }
    }
    Py_ssize_t count = lead * k * rest, bad = -1;
    int64_t low = 0, high = 0;
    /* nothing lands unless every position is valid */
    FOR_INDEX_TYPE(size, {
        const index_t *idx = (const index_t *)(uintptr_t)idx_addr;
        for (Py_ssize_t t = 0; t < count; t++) {
            low = (int64_t)idx[t] < low ? (int64_t)idx[t] : low;
            high = (int64_t)idx[t] > high ? (int64_t)idx[t] : high;
        }
        if (low < 0 || high >= n)
            for (Py_ssize_t t = 0; t < count && bad < 0; t++)
                if ((int64_t)idx[t] < 0 || (int64_t)idx[t] >= n)
                    bad = t;
    })
    if (bad >= 0) {
        PyErr_Format(PyExc_ValueError, "sparse add: index at %zd is not within [0, %zd)", bad, n);
        return NULL;
    }
    float *buf = (float *)(uintptr_t)buf_addr;
    const float *values = (const float *)(uintptr_t)values_addr;
    int64_t *fresh = (int64_t *)(uintptr_t)new_addr;
    Py_ssize_t m = 0;
    Py_BEGIN_ALLOW_THREADS
    FOR_INDEX_TYPE(size, {
        const index_t *idx = (const index_t *)(uintptr_t)idx_addr;
        for (Py_ssize_t a = 0, t = 0; a < lead; a++) {
            int64_t base = (rows ? rows[a] : a) * n * rest;
            float *row = buf + base;
            for (Py_ssize_t s = 0; s < k; s++)
                for (Py_ssize_t j = 0; j < rest; j++, t++) {
                    int64_t at = (int64_t)idx[t] * rest + j;
                    float before = row[at];
                    fresh[t] = before == 0.0f ? base + at : -1;
                    row[at] = before + values[t];
                }
        }
    })
    /* compacted apart: a running count in the loop above made every entry wait for the
     * previous entry's (cache-missing) load, which measured 3x slower */
    for (Py_ssize_t t = 0; t < count; t++) {
        fresh[m] = fresh[t];
        m += fresh[t] >= 0;
    }
    Py_END_ALLOW_THREADS
    return PyLong_FromSsize_t(m);
}

static int ascending(const void *a, const void *b)
{
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return (x > y) - (x < y);
}

/* take_nonzero(buf, numel, listed, count, positions, values) -> how many nonzero sums were read.
 * They are read in ascending position order (a worker's scatter of the answer then walks its
 * buffer forwards): through a bitmap of the listed positions where its words are no more than
 * 4 per listed position (one pass setting bits, one walking them in order), else by sorting a
 * copy of the list, which is then short beside the key; either way in time proportional to
 * what was listed. */
static PyObject *take_nonzero(PyObject *self, PyObject *args)
{
    unsigned long long buf_addr, listed_addr, pos_addr, values_addr;
    Py_ssize_t numel, count;
    (void)self;
    if (!PyArg_ParseTuple(args, "KnKnKK", &buf_addr, &numel, &listed_addr, &count, &pos_addr,
                          &values_addr))
        return NULL;
    float *buf = (float *)(uintptr_t)buf_addr;
    const int64_t *listed = (const int64_t *)(uintptr_t)listed_addr;
    int64_t *positions = (int64_t *)(uintptr_t)pos_addr;
    float *values = (float *)(uintptr_t)values_addr;
    for (Py_ssize_t i = 0; i < count; i++) {
        if (listed[i] < 0 || listed[i] >= numel) {
            PyErr_Format(PyExc_ValueError, "sparse take_nonzero: position %lld is not within [0, %zd)",
                         (long long)listed[i], numel);
            return NULL;
        }
    }
    Py_ssize_t words = (numel + 63) / 64, m = 0;
    uint64_t *bits = NULL;
    if (count > 0 && words <= 4 * count && !(bits = calloc((size_t)words, sizeof *bits)))
        return PyErr_NoMemory();
    Py_BEGIN_ALLOW_THREADS
    /* branch-free: stores are kept for nonzero sums (NaN included); a position listed twice is
     * read once (bitmap), or reads zero the second time (sorted list) */
#define TAKE(at)                                  \
    do {                                          \
        int64_t p_ = (at);                        \
        float v_ = buf[p_];                       \
        positions[m] = p_;                        \
        values[m] = v_;                           \
        m += v_ != 0.0f;                          \
        buf[p_] = 0.0f;                           \
    } while (0)
    if (bits) {
        for (Py_ssize_t i = 0; i < count; i++)
            bits[listed[i] >> 6] |= (uint64_t)1 << (listed[i] & 63);
        for (Py_ssize_t w = 0; w < words; w++)
            for (uint64_t word = bits[w]; word; word &= word - 1)
                TAKE((int64_t)w * 64 + __builtin_ctzll(word));
    } else {
        memcpy(positions, listed, (size_t)count * sizeof *positions);
        qsort(positions, (size_t)count, sizeof *positions, ascending);
        for (Py_ssize_t i = 0; i < count; i++)  /* m <= i: the compaction overwrites what was read */
            TAKE(positions[i]);
    }
#undef TAKE
    Py_END_ALLOW_THREADS
    free(bits);
    return PyLong_FromSsize_t(m);
}

static PyMethodDef methods[] = {
    {"add", add, METH_VARARGS,
     "add(buf, numel, idx, idx_size, lead, n, rest, k, values, new, rows) -> count of new positions"},
    {"take_nonzero", take_nonzero, METH_VARARGS,
     "take_nonzero(buf, numel, listed, count, positions, values) -> count of nonzero sums read"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_sparse_sum", NULL, -1, methods};

PyMODINIT_FUNC PyInit__sparse_sum(void)
{
    return PyModule_Create(&module);
}
