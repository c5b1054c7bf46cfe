/* _core_args.c: Python arguments to C scalars (ints, flags, is_causal,
 * scale, dropout, dtype), the memory checks' arithmetic and the status
 * errors; the arrays and call_parse are _core_parse.c's.  Every error names
 * the argument and what was expected. */
#include "_core.h"

#include <math.h>
#include <string.h>
#include <unistd.h>

/* ------------------------------------------------------------ scalars */

static int bool_like(PyObject *obj);
static int refuse_masked(PyObject *obj, const char *name);

/* Whether obj, not an int, carries dimensions (ndim > 0): a one-element
 * torch tensor, whose __index__ gives its value, is no scalar. */
static int has_dims(PyObject *obj)
{
    PyObject *nd;
    long n;
    if (PyLong_Check(obj) || PyArray_IsScalar(obj, Generic)) return 0;
    nd = PyObject_GetAttrString(obj, "ndim");
    if (!nd) {
        PyErr_Clear();
        return 0;
    }
    n = PyLong_Check(nd) ? PyLong_AsLong(nd) : 0;
    Py_DECREF(nd);
    if (n == -1 && PyErr_Occurred()) PyErr_Clear();
    return n != 0;
}

/* An integer (a Python int or anything with __index__, such as NumPy's
 * integers, a 0-d integer array or a 0-d integer torch tensor, as torch
 * reads its int arguments; not a bool of any kind, whose __index__ may give
 * 0 or 1, nor a float or an array with dimensions) as a new reference.
 * The rule of _convert.as_int in Python. */
static PyObject *as_index(PyObject *obj, const char *name, const char *want)
{
    PyObject *i;
    if (PyArray_Check(obj) && (PyArray_NDIM((PyArrayObject *)obj) != 0 ||
                               !PyArray_ISINTEGER((PyArrayObject *)obj)))
        goto type;
    if (bool_like(obj) || !PyIndex_Check(obj) || has_dims(obj)) goto type;
    if (refuse_masked(obj, name) < 0) return NULL;
    i = PyNumber_Index(obj);
    if (i) return i;
    PyErr_Clear();
type:
    PyErr_Format(PyExc_TypeError, "%s must be %s, not %.100s", name, want,
                 Py_TYPE(obj)->tp_name);
    return NULL;
}

int positive_int(PyObject *obj, const char *name, int64_t *out)
{
    PyObject *i = as_index(obj, name, "an int");
    long long v = 0;
    int overflow = 0, rc = -1;
    if (!i) return -1;
    v = PyLong_AsLongLongAndOverflow(i, &overflow);
    if (v == -1 && PyErr_Occurred()) goto fail;
    if (overflow > 0) {
        PyErr_Format(PyExc_ValueError, "%s is too large: %R", name, i);
        goto fail;
    }
    if (overflow < 0 || v <= 0) {
        PyErr_Format(PyExc_ValueError, "%s must be positive, got %R", name, i);
        goto fail;
    }
    *out = (int64_t)v;
    rc = 0;
fail:
    Py_DECREF(i);
    return rc;
}

/* n_kv_heads (grouped-query attention): a positive int dividing n_heads;
 * a ValueError names both numbers */
int kv_heads_arg(PyObject *obj, int64_t n_heads, int64_t *out)
{
    if (positive_int(obj, "n_kv_heads", out) < 0) {
        if (PyErr_ExceptionMatches(PyExc_ValueError)) {
            PyErr_Clear();
            PyErr_Format(PyExc_ValueError,
                         "n_kv_heads must be a positive int dividing n_heads (%lld), got %R",
                         (long long)n_heads, obj);
        }
        return -1;
    }
    if (n_heads % *out != 0) {
        PyErr_Format(PyExc_ValueError, "n_kv_heads (%lld) must divide n_heads (%lld)",
                     (long long)*out, (long long)n_heads);
        return -1;
    }
    return 0;
}

/* An int in [0, 2**64) (seed, counter, token). */
int parse_u64(PyObject *obj, const char *name, uint64_t *out)
{
    PyObject *i = as_index(obj, name, "an int in [0, 2**64)");
    unsigned long long v;
    long long sv;
    int rc = -1, overflow = 0;
    if (!i) return -1;
    sv = PyLong_AsLongLongAndOverflow(i, &overflow);
    if (sv == -1 && PyErr_Occurred()) goto fail;
    if (overflow < 0 || (overflow == 0 && sv < 0)) {
        PyErr_Format(PyExc_ValueError, "%s must be in [0, 2**64), got %R", name, i);
        goto fail;
    }
    v = PyLong_AsUnsignedLongLong(i);
    if (v == (unsigned long long)-1 && PyErr_Occurred()) {
        if (PyErr_ExceptionMatches(PyExc_OverflowError)) {
            PyErr_Clear();
            PyErr_Format(PyExc_ValueError, "%s must be in [0, 2**64), got %R", name, i);
        }
        goto fail;
    }
    *out = (uint64_t)v;
    rc = 0;
fail:
    Py_DECREF(i);
    return rc;
}

/* A NumPy masked array whose value is masked (np.ma.masked_array(0.5,
 * mask=True)) where one value is taken: its data is a hidden value, and
 * float() reads it as NaN.  A TypeError naming the argument, as wherever
 * arrays are read (_convert.unmasked); only an ndarray subclass is looked
 * at, and only when numpy.ma is imported. */
static int refuse_masked(PyObject *obj, const char *name)
{
    PyObject *mod_name, *ma, *r;
    int masked;
    if (!PyArray_Check(obj) || PyArray_CheckExact(obj)) return 0;
    if (!(mod_name = PyUnicode_FromString("numpy.ma"))) return -1;
    ma = PyImport_GetModule(mod_name);
    Py_DECREF(mod_name);
    if (!ma) return PyErr_Occurred() ? -1 : 0;
    r = PyObject_CallMethod(ma, "is_masked", "O", obj);
    Py_DECREF(ma);
    if (!r) return -1;
    masked = PyObject_IsTrue(r);
    Py_DECREF(r);
    if (masked < 0) return -1;
    if (masked)
        PyErr_Format(PyExc_TypeError, "%s is a NumPy masked array with its value masked: "
                     "mha_ext would read the hidden value (or NaN); fill it first "
                     "(.filled(value))", name);
    return masked ? -1 : 0;
}

/* A flag: one truth value (a bool, NumPy bool, number, 0-d array, None),
 * taken as Python's `if` takes it.  Arrays with dimensions, sequences and
 * strings are ambiguous: a TypeError naming the argument (NumPy's own
 * message does not say which).  The rule of _convert.flag in Python. */
int parse_flag(PyObject *obj, const char *name, int *out)
{
    int v, ambiguous = PyArray_Check(obj)
                           ? PyArray_NDIM((PyArrayObject *)obj) != 0
                           : PySequence_Check(obj) || PyUnicode_Check(obj) ||
                                 PyBytes_Check(obj) || PyAnySet_Check(obj) || PyDict_Check(obj);
    if (ambiguous) goto type;
    if (refuse_masked(obj, name) < 0) return -1;
    if ((v = PyObject_IsTrue(obj)) < 0) {
        PyErr_Clear();
        goto type;
    }
    *out = v;
    return 0;
type:
    PyErr_Format(PyExc_TypeError, "%s must be True or False, not %.100s", name,
                 Py_TYPE(obj)->tp_name);
    return -1;
}

int parse_causal(PyObject *obj, int *out)
{
    int v;
    if (PyUnicode_Check(obj)) {
        if (PyUnicode_CompareWithASCIIString(obj, "lower_right") == 0) {
            *out = MHA_CAUSAL_LOWER_RIGHT;
            return 0;
        }
        PyErr_Format(PyExc_TypeError, "is_causal must be True or False (top-left: query i "
                     "sees keys j <= i), or \"lower_right\" (query i sees keys j <= i + Sk - "
                     "Sq), got %R", obj);
        return -1;
    }
    if (refuse_masked(obj, "is_causal") < 0) return -1;
    if (parse_flag(obj, "is_causal", &v) < 0) {
        PyErr_Clear();
        PyErr_Format(PyExc_TypeError, "is_causal must be True or False, or \"lower_right\", "
                     "not %.100s", Py_TYPE(obj)->tp_name);
        return -1;
    }
    *out = v ? MHA_CAUSAL_TOP_LEFT : 0;
    return 0;
}

/* a Python or NumPy bool (a scalar or a 0-d array), or another library's
 * 0-d bool (a torch tensor: its dtype's name): no real number here */
static int bool_like(PyObject *obj)
{
    PyObject *dt, *name;
    int r;
    if (PyBool_Check(obj) || PyArray_IsScalar(obj, Bool)) return 1;
    if (PyArray_Check(obj))
        return PyArray_NDIM((PyArrayObject *)obj) == 0 &&
               PyArray_TYPE((PyArrayObject *)obj) == NPY_BOOL;
    if (PyFloat_Check(obj) || PyLong_Check(obj) || PyArray_IsScalar(obj, Number)) return 0;
    dt = PyObject_GetAttrString(obj, "dtype");
    if (!dt) {
        PyErr_Clear();
        return 0;
    }
    name = PyObject_Str(dt);
    Py_DECREF(dt);
    if (!name) {
        PyErr_Clear();
        return 0;
    }
    r = PyUnicode_CompareWithASCIIString(name, "torch.bool") == 0 ||
        PyUnicode_CompareWithASCIIString(name, "bool") == 0;
    Py_DECREF(name);
    return r;
}

int parse_scale(PyObject *obj, int *has, double *out)
{
    double s;
    *has = 0;
    if (obj == Py_None) return 0;
    if (refuse_masked(obj, "scale") < 0) return -1;
    if (bool_like(obj) || PyComplex_Check(obj) || PyUnicode_Check(obj) ||
        (PyArray_Check(obj) && PyArray_NDIM((PyArrayObject *)obj) != 0))
        goto type;
    s = PyFloat_AsDouble(obj);
    if (s == -1.0 && PyErr_Occurred()) {
        PyErr_Clear();
        goto type;
    }
    *has = 1;
    *out = s;
    return 0;
type:
    PyErr_Format(PyExc_TypeError, "scale must be None or a real number, not %.100s",
                 bool_like(obj) ? "a bool" : Py_TYPE(obj)->tp_name);
    return -1;
}

/* A value too large for a float (an int of over 1024 bits): the error the
 * Python layer gives for it (mha_ext._convert.too_large: a ValueError that
 * is also torch's OverflowError, docs/API.md §7), naming `name`. */
static void raise_too_large(PyObject *obj, const char *name, const char *what)
{
    PyObject *mod = PyImport_ImportModule("mha_ext._convert"), *exc = NULL;
    if (mod) exc = PyObject_CallMethod(mod, "too_large", "Oss", obj, name, what);
    if (exc) PyErr_SetObject((PyObject *)Py_TYPE(exc), exc);
    Py_XDECREF(exc);
    Py_XDECREF(mod);
}

int parse_dropout(PyObject *obj, const char *name, double *out)
{
    double p;
    if (refuse_masked(obj, name) < 0) return -1;
    if (bool_like(obj) || PyComplex_Check(obj) ||
        (PyArray_Check(obj) && PyArray_NDIM((PyArrayObject *)obj) != 0))
        goto type;
    p = PyFloat_AsDouble(obj);
    if (p == -1.0 && PyErr_Occurred()) {
        if (PyErr_ExceptionMatches(PyExc_OverflowError)) {
            PyErr_Clear();
            raise_too_large(obj, name, "a probability in [0, 1]");
            return -1;
        }
        PyErr_Clear();
        goto type;
    }
    if (!(p >= 0.0 && p <= 1.0)) {
        PyErr_Format(PyExc_ValueError, "%s must be in [0, 1], got %R", name, obj);
        return -1;
    }
    *out = p;
    return 0;
type: /* a ValueError too, as docs/API.md says of every value that is not a
         real number in [0, 1] (the SDPA function's dropout_p likewise) */
    PyErr_Format(PyExc_ValueError, "%s must be a real number in [0, 1], not %.100s", name,
                 bool_like(obj) ? "a bool" : Py_TYPE(obj)->tp_name);
    return -1;
}

int parse_dtype(PyObject *obj, mha_dtype *out)
{
    PyArray_Descr *descr = NULL;
    int t;
    if (obj == Py_None) {
        PyErr_SetString(PyExc_TypeError, "dtype must be \"float32\" or \"float64\", not None");
        return -1;
    }
    if (!PyArray_DescrConverter(obj, &descr)) {
        PyErr_Clear();
        PyErr_Format(PyExc_TypeError, "dtype must be \"float32\" or \"float64\", not %R", obj);
        return -1;
    }
    t = descr->type_num;
    Py_DECREF(descr);
    if (t == NPY_FLOAT32) *out = MHA_FLOAT32;
    else if (t == NPY_FLOAT64) *out = MHA_FLOAT64;
    else {
        PyErr_Format(PyExc_ValueError, "dtype must be \"float32\" or \"float64\", got %R", obj);
        return -1;
    }
    return 0;
}

/* The bytes of memory of this machine (INT64_MAX when unknown). */
int64_t physical_bytes(void)
{
    long pages = sysconf(_SC_PHYS_PAGES), size = sysconf(_SC_PAGE_SIZE);
    int64_t r;
    if (pages <= 0 || size <= 0 || __builtin_mul_overflow((int64_t)pages, (int64_t)size, &r))
        return INT64_MAX;
    return r;
}

/* n scalars of `size` bytes, added to *total; nonzero on overflow. */
int add_bytes(int64_t *total, int64_t n, size_t size)
{
    int64_t b;
    return n < 0 || __builtin_mul_overflow(n, (int64_t)size, &b) ||
           __builtin_add_overflow(*total, b, total);
}

void set_status_error(mha_status st, const char *what)
{
    if (st == MHA_ERR_INTERRUPTED) /* stopped with no handler's exception: a fork */
        PyErr_Format(PyExc_RuntimeError, "%s: this process was forked inside the call (by "
                     "a signal handler?), and in the child its result is lost: call again",
                     what);
    else if (st == MHA_ERR_NOMEM || st == MHA_ERR_OVERFLOW)
        PyErr_Format(PyExc_MemoryError, "%s: %s (the shapes are too large to allocate)",
                     what, mha_status_str(st));
    else
        PyErr_Format(PyExc_ValueError, "%s: %s", what, mha_status_str(st));
}
