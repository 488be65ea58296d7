/* A sparse payload written into a dense tensor in one pass: ``out[:] = decompress(p) / divisor``.
 *
 * torch's path zeroes the whole of ``out`` and then scatters the values into it: two passes
 * over memory. Where the positions ascend (a server's answers, ADTopk's fibres) one walk does
 * both: it zeroes ``out`` a block at a time just ahead of where the values land, so the block is
 * still in cache when they do, and stores each position's sum as it goes. A position behind the
 * last one ends the walk, and the caller takes torch's path instead (the call returns False).
 *
 * The arithmetic is torch's, so that the bits are the same: each value is converted to the
 * output's dtype and divided by the divisor in it (a 16-bit float in float32, rounded back);
 * a position's values are summed, in the order listed, onto zero in the output's dtype, or,
 * for a 16-bit output, in float32 and rounded once, as scatter_add_ sums them.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#include "_index_types.h"

/* dtype codes, shared with sparse_write.py */
enum { F32 = 0, F64 = 1, F16 = 2, BF16 = 3 };

static inline float bf16_load(uint16_t h)
{
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* torch's rounding to bfloat16: to nearest even, a NaN to a quiet NaN */
static inline uint16_t bf16_round(float f)
{
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if (f != f)
        return 0x7FC0;
    return (uint16_t)((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16);
}

static inline float f16_load(uint16_t h)
{
    _Float16 x;
    memcpy(&x, &h, sizeof x);
    return (float)x;
}

static inline uint16_t f16_round(float f)
{
    _Float16 x = (_Float16)f;
    uint16_t h;
    memcpy(&h, &x, sizeof h);
    return h;
}


/* What went wrong, for the message torch's scatter_add_ gives for the same position. */
typedef struct {
    int64_t index, size;
    int dim;
} bad_t;

/* Entries zeroed at a time, ahead of the walk: one memset per gap between positions cost more
 * than the walk (a call per few entries), while a block this size is still in cache when the
 * values land in it. */
#define AHEAD 2048

/* One walk, for one output type OUT_T summed in MATH_T. VALUE(t) is entry t's value in MATH_T,
 * already in the output's dtype (divided where the divisor is not 1); ROUND(x) rounds a MATH_T
 * to an OUT_T. Entry (a, s, j) of the [lead, k, rest] values lands at (row(a) * n + idx) * rest
 * + j; row(a) is rows[a] where rows is not NULL. */
#define WALK(OUT_T, MATH_T, VALUE, ROUND)                                                     \
    do {                                                                                     \
        OUT_T *o = (OUT_T *)out;                                                             \
        MATH_T sum = 0;                                                                      \
        FOR_INDEX_TYPE(index_size, {                                                         \
            const index_t *idx = (const index_t *)indices;                                   \
            for (int64_t a = 0, t = 0; a < lead && ok; a++) {                                \
                int64_t row = rows ? rows[a] : a;                                            \
                int row_ok = row >= 0 && row < full;                                         \
                for (int64_t s = 0; s < k && ok; s++)                                        \
                    for (int64_t j = 0; j < rest; j++, t++) {                                \
                        int64_t at = (int64_t)idx[t];                                        \
                        /* (wrapping, for the message of a row out of range) */              \
                        int64_t p = (int64_t)(((uint64_t)row * n + at) * rest + j);          \
                        if (at < 0 || at >= n || !row_ok) {                                  \
                            bad = at < 0 || at >= n ? (bad_t){at, n, fibre}                  \
                                                    : (bad_t){p, numel, 0};                  \
                            ok = 0;                                                          \
                            break;                                                           \
                        }                                                                    \
                        MATH_T v = VALUE(t);                                                 \
                        if (p > last) {                                                      \
                            if (p >= zeroed) {                                               \
                                int64_t to = p + AHEAD < numel ? p + AHEAD : numel;          \
                                memset(o + zeroed, 0, (size_t)(to - zeroed) * sizeof *o);    \
                                zeroed = to;                                                 \
                            }                                                                \
                            sum = (MATH_T)0 + v;                                             \
                            last = p;                                                        \
                        } else if (p == last) {                                              \
                            sum += v;                                                        \
                        } else {                                                             \
                            ok = 0;                                                          \
                            break;                                                           \
                        }                                                                    \
                        o[p] = ROUND(sum);                                                   \
                    }                                                                        \
            }                                                                                \
        })                                                                                   \
        memset(o + zeroed, 0, (size_t)(numel - zeroed) * sizeof *o);                         \
    } while (0)

#define SAME(x) (x)
#define F32_VALUE(t) (divisor == 1 ? vals32[t] : vals32[t] / (float)divisor)
#define F64_VALUE(t) (divisor == 1 ? vals64[t] : vals64[t] / (double)divisor)
#define F16_IN_F32(t) (divisor == 1 ? f16_load(vals16[t]) : f16_load(vals16[t]) / (float)divisor)
#define BF16_IN_F32(t) (divisor == 1 ? bf16_load(vals16[t]) : bf16_load(vals16[t]) / (float)divisor)
#define F16_VALUE(t) (divisor == 1 ? f16_load(vals16[t]) : f16_load(f16_round(f16_load(vals16[t]) / (float)divisor)))
#define BF16_VALUE(t) (divisor == 1 ? bf16_load(vals16[t]) : bf16_load(bf16_round(bf16_load(vals16[t]) / (float)divisor)))

/* write(out, numel, out_type, values, value_type, indices, index_size, rows, lead, n, rest, k,
 *       divisor, fibre) -> whether it wrote (False: the positions went back). value_type is out_type, or a 16-bit type into float32. */
static PyObject *write_sparse(PyObject *self, PyObject *args)
{
    unsigned long long out_addr, values_addr, indices_addr, rows_addr;
    Py_ssize_t numel_, lead_, n_, rest_, k_, divisor;
    int out_type, value_type, index_size, fibre;
    (void)self;
    if (!PyArg_ParseTuple(args, "KniKiKiKnnnnnp", &out_addr, &numel_, &out_type, &values_addr,
                          &value_type, &indices_addr, &index_size, &rows_addr, &lead_, &n_, &rest_,
                          &k_, &divisor, &fibre))
        return NULL;
    int64_t numel = numel_, lead = lead_, n = n_, rest = rest_, k = k_;
    int known = out_type == value_type ? out_type >= F32 && out_type <= BF16
                                       : out_type == F32 && (value_type == F16 || value_type == BF16);
    if (!known || (index_size != 1 && index_size != 2 && index_size != 4 && index_size != 8)
        || divisor < 1 || numel < 0 || lead < 0 || n < 0 || rest < 0 || k < 0) {
        PyErr_SetString(PyExc_ValueError, "sparse write: unsupported types or a negative size");
        return NULL;
    }
    int64_t full = n > 0 && rest > 0 ? numel / (n * rest) : 0;  /* rows in the view */
    if (full * n * rest != numel || (!rows_addr && lead != full) || (rows_addr && lead > full)) {
        PyErr_Format(PyExc_ValueError, "sparse write: view [%lld, %lld, %lld] does not cover %lld "
                     "entries", (long long)lead, (long long)n, (long long)rest, (long long)numel);
        return NULL;
    }
    void *out = (void *)(uintptr_t)out_addr;
    const void *indices = (const void *)(uintptr_t)indices_addr;
    const int64_t *rows = (const int64_t *)(uintptr_t)rows_addr;
    const float *vals32 = (const float *)(uintptr_t)values_addr;
    const double *vals64 = (const double *)(uintptr_t)values_addr;
    const uint16_t *vals16 = (const uint16_t *)(uintptr_t)values_addr;
    bad_t bad = {0, 0, -1};
    int64_t last = -1;  /* the last position written to */
    int64_t zeroed = 0;  /* out is zeros, or written, below this */
    int ok = 1;
    Py_BEGIN_ALLOW_THREADS
    if (out_type == F32 && value_type == F32)
        WALK(float, float, F32_VALUE, SAME);
    else if (out_type == F32 && value_type == F16)
        WALK(float, float, F16_IN_F32, SAME);
    else if (out_type == F32)
        WALK(float, float, BF16_IN_F32, SAME);
    else if (out_type == F64)
        WALK(double, double, F64_VALUE, SAME);
    else if (out_type == F16)
        WALK(uint16_t, float, F16_VALUE, f16_round);
    else
        WALK(uint16_t, float, BF16_VALUE, bf16_round);
    Py_END_ALLOW_THREADS
    if (bad.dim >= 0) {  /* out is zeros but for what landed before it, as torch leaves it */
        PyErr_Format(PyExc_RuntimeError, "index %lld is out of bounds for dimension %d with size %lld",
                     (long long)bad.index, bad.dim, (long long)bad.size);
        return NULL;
    }
    return PyBool_FromLong(ok);
}

static PyMethodDef methods[] = {
    {"write", write_sparse, METH_VARARGS,
     "write(out, numel, out_type, values, value_type, indices, index_size, rows, lead, n, rest, k, "
     "divisor, fibre) -> whether it wrote"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_sparse_write", NULL, -1, methods};

PyMODINIT_FUNC PyInit__sparse_write(void)
{
    return PyModule_Create(&module);
}
