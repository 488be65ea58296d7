/* The checks on a received payload's positions, in one pass each, without a tensor op per
 * check: a server runs them on every push, and a few hundred bytes of positions should not
 * cost a few dozen torch and numpy calls.
 *
 * span() reads positions (of any index type) and says their lowest, their highest and
 * whether they strictly increase; bitmap_rows() unpacks a row-set bitmap into the rows it
 * names, refusing before it writes anything when the bitmap names more or fewer rows than
 * were announced, or sets bits past the view's rows.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

#include "../core/_index_types.h"

/* span(addr, size, count) -> (low, high, increasing); count >= 1 */
static PyObject *span(PyObject *self, PyObject *args)
{
    unsigned long long addr;
    int size;
    Py_ssize_t count;
    (void)self;
    if (!PyArg_ParseTuple(args, "Kin", &addr, &size, &count))
        return NULL;
    if ((size != 1 && size != 2 && size != 4 && size != 8) || count < 1) {
        PyErr_Format(PyExc_ValueError, "span: index size %d and count %zd (size 1, 2, 4 or 8; "
                     "count at least 1)", size, count);
        return NULL;
    }
    int64_t low = 0, high = 0;
    int increasing = 1;
    FOR_INDEX_TYPE(size, {
        const index_t *idx = (const index_t *)(uintptr_t)addr;
        low = high = (int64_t)idx[0];
        for (Py_ssize_t t = 1; t < count; t++) {
            int64_t v = (int64_t)idx[t];
            increasing &= v > (int64_t)idx[t - 1];
            low = v < low ? v : low;
            high = v > high ? v : high;
        }
    });
    return Py_BuildValue("LLO", (long long)low, (long long)high, increasing ? Py_True : Py_False);
}

/* bitmap_rows(bitmap, lead, out_addr, live) -> rows named (-1: a bit set past row lead - 1).
 * Bit b of byte i names row 8i + b. The rows go to out (int64, room for live) only when
 * the bitmap names exactly live of them, and out_addr is not 0 (0: count only). */
static PyObject *bitmap_rows(PyObject *self, PyObject *args)
{
    Py_buffer bitmap;
    Py_ssize_t lead, live;
    unsigned long long out_addr;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*nKn", &bitmap, &lead, &out_addr, &live))
        return NULL;
    const uint8_t *bits = (const uint8_t *)bitmap.buf;
    Py_ssize_t nbytes = bitmap.len, named = 0;
    if (lead < 0 || nbytes != (lead + 7) / 8) {
        PyBuffer_Release(&bitmap);
        PyErr_Format(PyExc_ValueError, "bitmap_rows: %zd bytes for %zd rows", nbytes, lead);
        return NULL;
    }
    if (lead % 8 && nbytes && bits[nbytes - 1] >> (lead % 8)) {
        PyBuffer_Release(&bitmap);
        return PyLong_FromLong(-1);
    }
    for (Py_ssize_t i = 0; i < nbytes; i++)
        named += __builtin_popcount(bits[i]);
    if (named == live && out_addr) {
        int64_t *out = (int64_t *)(uintptr_t)out_addr;
        Py_ssize_t at = 0;
        for (Py_ssize_t i = 0; i < nbytes; i++)
            for (unsigned byte = bits[i]; byte; byte &= byte - 1)
                out[at++] = 8 * (int64_t)i + __builtin_ctz(byte);
    }
    PyBuffer_Release(&bitmap);
    return PyLong_FromSsize_t(named);
}

static PyMethodDef methods[] = {
    {"span", span, METH_VARARGS, "(low, high, increasing) of count positions at addr"},
    {"bitmap_rows", bitmap_rows, METH_VARARGS, "the rows a row-set bitmap names, into out"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_positions", NULL, -1, methods,
                                    NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__positions(void) { return PyModule_Create(&module); }
