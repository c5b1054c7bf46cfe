/* _core_masks.c: masks from Python to the core's mha_mask: (kind, array)
 * pairs converted and broadcast (NumPy's rules) onto (B, H, Sq, Sk), for
 * the module's calls (_core_parse.c) and _sdpa (_core_sdpa.c).  Every error
 * names what was wrong. */
#include "_core.h"

/* Convert mask `obj` of `kind` and broadcast it (NumPy's rules) onto
 * (B, H, Sq, Sk), filling m.  The array holding the data is kept in *keep. */
static int convert_mask(int typenum, PyObject *obj, int kind, const int64_t dim[4],
                        mha_mask *m, PyArrayObject **keep)
{
    static const char *names[4] = {"batch", "heads", "query length", "key length"};
    int tn = kind == MHA_MASK_ADD ? typenum : NPY_UINT8;
    PyArrayObject *arr = (PyArrayObject *)PyArray_FROM_OTF(
        obj, tn, NPY_ARRAY_ALIGNED | NPY_ARRAY_FORCECAST);
    int nd, d;
    if (!arr) return -1;
    nd = PyArray_NDIM(arr);
    if (nd > 4) {
        PyErr_Format(PyExc_ValueError, "a mask must have at most 4 dimensions "
                     "(batch, heads, query, key), got %d", nd);
        Py_DECREF(arr);
        return -1;
    }
    m->kind = (mha_mask_kind)kind;
    m->data = PyArray_DATA(arr);
    for (d = 0; d < 4; d++) {
        int ad = d - (4 - nd); /* the mask's own axis, right-aligned */
        npy_intp n;
        if (ad < 0) {
            m->stride[d] = 0;
            continue;
        }
        n = PyArray_DIM(arr, ad);
        if (n == 1) {
            m->stride[d] = 0;
        } else if ((int64_t)n == dim[d]) {
            m->stride[d] = (int64_t)(PyArray_STRIDE(arr, ad) / (npy_intp)PyArray_ITEMSIZE(arr));
        } else {
            PyObject *s = shape_str(arr);
            if (s) {
                PyErr_Format(PyExc_ValueError,
                             "a mask of shape %U does not broadcast to (B, H, Sq, Sk) = "
                             "(%lld, %lld, %lld, %lld): its %s axis is %lld",
                             s, (long long)dim[0], (long long)dim[1], (long long)dim[2],
                             (long long)dim[3], names[d], (long long)n);
                Py_DECREF(s);
            }
            Py_DECREF(arr);
            return -1;
        }
    }
    *keep = arr;
    return 0;
}

int convert_masks(PyObject *seq, int typenum, const int64_t dim[4], mha_mask *masks,
                  PyArrayObject **arrs, int *n)
{
    PyObject *fast = PySequence_Fast(seq, "masks must be a sequence of (kind, array) pairs");
    Py_ssize_t i;
    if (!fast) return -1;
    if (PySequence_Fast_GET_SIZE(fast) > MHA_MAX_MASKS) {
        PyErr_Format(PyExc_ValueError, "masks: at most %d masks", MHA_MAX_MASKS);
        goto fail;
    }
    for (i = 0; i < PySequence_Fast_GET_SIZE(fast); i++) {
        PyObject *item = PySequence_Fast_GET_ITEM(fast, i);
        long kind;
        if (!PyTuple_Check(item) || PyTuple_GET_SIZE(item) != 2) {
            PyErr_SetString(PyExc_TypeError, "masks: each mask must be a (kind, array) pair");
            goto fail;
        }
        kind = PyLong_AsLong(PyTuple_GET_ITEM(item, 0));
        if (kind == -1 && PyErr_Occurred()) goto fail;
        if (kind != MHA_MASK_BLOCK && kind != MHA_MASK_ADD) {
            PyErr_SetString(PyExc_ValueError, "masks: kind must be 0 (blocking) or 1 (additive)");
            goto fail;
        }
        if (convert_mask(typenum, PyTuple_GET_ITEM(item, 1), (int)kind, dim, &masks[*n],
                         &arrs[*n]) < 0)
            goto fail;
        (*n)++;
    }
    Py_DECREF(fast);
    return 0;
fail:
    Py_DECREF(fast);
    return -1;
}


/* one bound of a window: None (-1: unbounded) or an int >= 0 (clamped to
 * 2**62: wider than any length is the same window) */
static int window_bound(PyObject *obj, const char *side, int64_t *out)
{
    long long v;
    int overflow = 0;
    if (obj == Py_None) {
        *out = -1;
        return 0;
    }
    if (PyBool_Check(obj) || !PyIndex_Check(obj)) goto bad;
    {
        PyObject *i = PyNumber_Index(obj);
        if (!i) return -1;
        v = PyLong_AsLongLongAndOverflow(i, &overflow);
        Py_DECREF(i);
    }
    if (v == -1 && PyErr_Occurred()) return -1;
    if (overflow < 0 || (overflow == 0 && v < 0)) goto bad;
    *out = overflow > 0 || v > ((long long)1 << 62) ? (int64_t)1 << 62 : (int64_t)v;
    return 0;
bad:
    PyErr_Format(PyExc_ValueError, "window's %s bound must be None (unbounded) or an int >= 0, "
                 "got %R", side, obj);
    return -1;
}

int parse_window(PyObject *obj, int *has, int64_t *left, int64_t *right)
{
    *has = 0;
    *left = *right = -1;
    if (!obj || obj == Py_None) return 0;
    if (!PyTuple_Check(obj) || PyTuple_GET_SIZE(obj) != 2) {
        PyErr_Format(PyExc_TypeError, "window must be None or a tuple (left, right) of ints >= 0 "
                     "or None (query i sees keys i - left .. i + right), got %R", obj);
        return -1;
    }
    if (window_bound(PyTuple_GET_ITEM(obj, 0), "left", left) < 0 ||
        window_bound(PyTuple_GET_ITEM(obj, 1), "right", right) < 0)
        return -1;
    *has = 1;
    return 0;
}

/* layout: None (ly->keep = NULL) or a tuple (keep, q_block, k_block): keep
 * a 4-D array of bool or uint8 (nonzero = the block is KEPT, computed) of
 * shape (1 or B, 1 or H, ceil(Sq / q_block), ceil(Sk / k_block)), the
 * block sizes ints > 0.  On success *arr holds the data (a new reference). */
int parse_layout(PyObject *obj, const int64_t dim[4], mha_block_layout *ly, PyArrayObject **arr)
{
    PyArrayObject *a;
    int64_t qb, kb, want[4];
    int d;
    memset(ly, 0, sizeof *ly);
    *arr = NULL;
    if (!obj || obj == Py_None) return 0;
    if (!PyTuple_Check(obj) || PyTuple_GET_SIZE(obj) != 3) {
        PyErr_Format(PyExc_TypeError, "layout must be None or a tuple (keep, q_block, k_block), "
                     "got %R", obj);
        return -1;
    }
    if (positive_int(PyTuple_GET_ITEM(obj, 1), "layout's q_block", &qb) < 0 ||
        positive_int(PyTuple_GET_ITEM(obj, 2), "layout's k_block", &kb) < 0)
        return -1;
    a = (PyArrayObject *)PyArray_FROM_O(PyTuple_GET_ITEM(obj, 0));
    if (!a) return -1;
    if (PyArray_TYPE(a) != NPY_BOOL && PyArray_TYPE(a) != NPY_UINT8) {
        PyErr_SetString(PyExc_TypeError, "layout's keep must be an array of bool or uint8 "
                        "(nonzero = the block is kept)");
        Py_DECREF(a);
        return -1;
    }
    want[0] = dim[0]; want[1] = dim[1];
    want[2] = dim[2] / qb + (dim[2] % qb != 0);
    want[3] = dim[3] / kb + (dim[3] % kb != 0);
    for (d = 0; d < 4 && PyArray_NDIM(a) == 4; d++)
        if (PyArray_DIM(a, d) != want[d] && !(d < 2 && PyArray_DIM(a, d) == 1)) break;
    if (PyArray_NDIM(a) != 4 || d < 4) {
        PyObject *s = shape_str(a);
        if (s) {
            PyErr_Format(PyExc_ValueError,
                         "layout's keep of shape %U does not fit (1 or B, 1 or H, "
                         "ceil(Sq / q_block), ceil(Sk / k_block)) = (%lld, %lld, %lld, %lld) "
                         "for Sq %lld, Sk %lld, blocks (%lld, %lld)",
                         s, (long long)want[0], (long long)want[1], (long long)want[2],
                         (long long)want[3], (long long)dim[2], (long long)dim[3],
                         (long long)qb, (long long)kb);
            Py_DECREF(s);
        }
        Py_DECREF(a);
        return -1;
    }
    Py_SETREF(a, (PyArrayObject *)PyArray_FROM_OTF((PyObject *)a, NPY_UINT8,
                                                   NPY_ARRAY_IN_ARRAY | NPY_ARRAY_FORCECAST));
    if (!a) return -1;
    ly->keep = (const uint8_t *)PyArray_DATA(a);
    ly->nqb = want[2];
    ly->nkb = want[3];
    ly->q_block = qb;
    ly->k_block = kb;
    ly->stride[0] = PyArray_DIM(a, 0) == 1 ? 0 : (int64_t)(PyArray_STRIDE(a, 0));
    ly->stride[1] = PyArray_DIM(a, 1) == 1 ? 0 : (int64_t)(PyArray_STRIDE(a, 1));
    *arr = a;
    return 0;
}
