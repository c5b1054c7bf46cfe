/* _core.c: the CPython/NumPy binding of the C core in src/.
 *
 * The only C file that includes Python.h.  It owns the module's parameter
 * memory, checks and converts arguments, and runs the core with the GIL
 * released.  Everything easier in Python (mask semantics, torch interop,
 * state dicts, traces) lives in mha_ext/module.py, which subclasses the
 * type defined here.
 *
 * Legend: B batch, Sq/Sk query/key lengths, E d_model, H heads, Dk = E/H. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#define NPY_NO_DEPRECATED_API NPY_1_25_API_VERSION
#define NPY_TARGET_VERSION NPY_1_25_API_VERSION
#include <numpy/arrayobject.h>

#include <pthread.h>
#include <string.h>
#include <sys/random.h>
#include <time.h>
#include <unistd.h>

#include "mha.h"

typedef struct {
    PyTypeObject *mha_type;
} module_state;

typedef struct {
    PyObject_HEAD
    mha_config cfg;
    void *block;                        /* the parameters, mha_param_layout order */
    int64_t total;                      /* scalars in block */
    int64_t offset[MHA_NPARAM], size[MHA_NPARAM];
    double dropout;
    int training;
    uint64_t seed;
    uint64_t counter;                   /* dropout streams used so far */
    pthread_rwlock_t lock;              /* read: a forward; write: _load, _write_lock */
    int lock_ready;
    unsigned long writer;               /* thread holding the write lock through
                                           _write_lock (0: none); under the GIL */
    long writer_depth;                  /* its nested _write_lock calls */
} MHAObject;

static int typenum_of(const MHAObject *self)
{
    return self->cfg.dtype == MHA_FLOAT64 ? NPY_FLOAT64 : NPY_FLOAT32;
}

/* ---------------------------------------------------------------- helpers */

/* A positive Python int that is not a bool, for argument `name`. */
static int positive_int(PyObject *obj, const char *name, int64_t *out)
{
    long long v;
    if (!PyLong_Check(obj) || PyBool_Check(obj)) {
        PyErr_Format(PyExc_TypeError, "%s must be an int, not %.100s", name,
                     Py_TYPE(obj)->tp_name);
        return -1;
    }
    v = PyLong_AsLongLong(obj);
    if (v == -1 && PyErr_Occurred()) {
        PyErr_Clear();
        PyErr_Format(PyExc_ValueError, "%s is too large: %R", name, obj);
        return -1;
    }
    if (v <= 0) {
        PyErr_Format(PyExc_ValueError, "%s must be positive, got %lld", name, v);
        return -1;
    }
    *out = (int64_t)v;
    return 0;
}

static int parse_dropout(PyObject *obj, double *out)
{
    double p;
    if (PyBool_Check(obj) || PyComplex_Check(obj)) {
        PyErr_Format(PyExc_TypeError, "dropout must be a real number in [0, 1], not %.100s",
                     Py_TYPE(obj)->tp_name);
        return -1;
    }
    p = PyFloat_AsDouble(obj);
    if (p == -1.0 && PyErr_Occurred()) {
        PyErr_Clear();
        PyErr_Format(PyExc_TypeError, "dropout must be a real number in [0, 1], not %.100s",
                     Py_TYPE(obj)->tp_name);
        return -1;
    }
    if (!(p >= 0.0 && p <= 1.0)) {
        PyErr_Format(PyExc_ValueError, "dropout must be in [0, 1], got %R", obj);
        return -1;
    }
    *out = p;
    return 0;
}

static int parse_dtype(PyObject *obj, mha_dtype *out)
{
    PyArray_Descr *descr = NULL;
    if (obj == Py_None) {
        PyErr_SetString(PyExc_TypeError, "dtype must be \"float32\" or \"float64\", not None");
        return -1;
    }
    if (!PyArray_DescrConverter(obj, &descr)) {
        PyErr_Clear();
        PyErr_Format(PyExc_TypeError, "dtype must be \"float32\" or \"float64\", not %R", obj);
        return -1;
    }
    int t = descr->type_num;
    Py_DECREF(descr);
    if (t == NPY_FLOAT32) *out = MHA_FLOAT32;
    else if (t == NPY_FLOAT64) *out = MHA_FLOAT64;
    else {
        PyErr_Format(PyExc_ValueError, "dtype must be \"float32\" or \"float64\", got %R", obj);
        return -1;
    }
    return 0;
}

static uint64_t random_seed(void)
{
    uint64_t s = 0;
    if (getrandom(&s, sizeof s, GRND_NONBLOCK) != (ssize_t)sizeof s) {
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        s = (uint64_t)ts.tv_nsec * 0x9e3779b97f4a7c15ULL ^ (uint64_t)ts.tv_sec ^ (uint64_t)(uintptr_t)&s;
    }
    return s;
}

/* The bytes of memory of this machine (INT64_MAX when unknown). */
static int64_t physical_bytes(void)
{
    long pages = sysconf(_SC_PHYS_PAGES), size = sysconf(_SC_PAGE_SIZE);
    int64_t r;
    if (pages <= 0 || size <= 0 || __builtin_mul_overflow((int64_t)pages, (int64_t)size, &r))
        return INT64_MAX;
    return r;
}

/* n scalars of `size` bytes, added to *total; nonzero on overflow. */
static int add_bytes(int64_t *total, int64_t n, size_t size)
{
    int64_t b;
    return n < 0 || __builtin_mul_overflow(n, (int64_t)size, &b) ||
           __builtin_add_overflow(*total, b, total);
}

/* Take the module's write lock for the calling thread, waiting for running
 * calls without holding the GIL.  Nested calls by the owning thread only
 * count.  While a thread owns it, calls from other threads wait, and calls
 * from the owner itself run without the lock (it already excludes others). */
static int write_lock(MHAObject *self)
{
    unsigned long me = PyThread_get_thread_ident();
    int rc;
    if (self->writer == me) {
        self->writer_depth++;
        return 0;
    }
    Py_BEGIN_ALLOW_THREADS
    rc = pthread_rwlock_wrlock(&self->lock);
    Py_END_ALLOW_THREADS
    if (rc != 0) {
        PyErr_Format(PyExc_RuntimeError, "cannot lock the module's parameters (error %d)", rc);
        return -1;
    }
    self->writer = me;
    self->writer_depth = 1;
    return 0;
}

static void write_unlock(MHAObject *self)
{
    if (--self->writer_depth == 0) {
        self->writer = 0;
        pthread_rwlock_unlock(&self->lock);
    }
}

static void set_status_error(mha_status st, const char *what)
{
    if (st == MHA_ERR_NOMEM || st == MHA_ERR_OVERFLOW)
        PyErr_Format(PyExc_MemoryError, "%s: %s (the shapes are too large to allocate)",
                     what, mha_status_str(st));
    else
        PyErr_Format(PyExc_ValueError, "%s: %s", what, mha_status_str(st));
}

/* ------------------------------------------------------------ the type */

static PyObject *mha_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"d_model", "n_heads", "dropout", "bias", "kdim", "vdim",
                             "dtype", "seed", NULL};
    PyObject *o_e = NULL, *o_h = NULL, *o_p = NULL, *o_bias = Py_True, *o_kdim = Py_None,
             *o_vdim = Py_None, *o_dtype = NULL, *o_seed = Py_None;
    MHAObject *self = NULL;
    mha_config cfg;
    double p = 0.0;
    uint64_t seed;
    mha_status st;
    int b;

    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OO|O$OOOOO:MultiHeadAttention", kwlist,
                                     &o_e, &o_h, &o_p, &o_bias, &o_kdim, &o_vdim,
                                     &o_dtype, &o_seed))
        return NULL;
    memset(&cfg, 0, sizeof cfg);
    if (positive_int(o_e, "d_model", &cfg.d_model) < 0) return NULL;
    if (positive_int(o_h, "n_heads", &cfg.n_heads) < 0) return NULL;
    if (cfg.d_model % cfg.n_heads != 0) {
        PyErr_Format(PyExc_ValueError,
                     "d_model (%lld) must be divisible by n_heads (%lld)",
                     (long long)cfg.d_model, (long long)cfg.n_heads);
        return NULL;
    }
    cfg.kdim = cfg.d_model;
    cfg.vdim = cfg.d_model;
    if (o_kdim != Py_None && positive_int(o_kdim, "kdim", &cfg.kdim) < 0) return NULL;
    if (o_vdim != Py_None && positive_int(o_vdim, "vdim", &cfg.vdim) < 0) return NULL;
    if (o_p && parse_dropout(o_p, &p) < 0) return NULL;
    if ((b = PyObject_IsTrue(o_bias)) < 0) return NULL;
    cfg.bias = b;
    cfg.dtype = MHA_FLOAT32;
    if (o_dtype && parse_dtype(o_dtype, &cfg.dtype) < 0) return NULL;
    if (o_seed == Py_None) {
        seed = random_seed();
    } else {
        if (!PyLong_Check(o_seed) || PyBool_Check(o_seed)) {
            PyErr_Format(PyExc_TypeError, "seed must be an int or None, not %.100s",
                         Py_TYPE(o_seed)->tp_name);
            return NULL;
        }
        seed = (uint64_t)PyLong_AsUnsignedLongLongMask(o_seed);
        if (PyErr_Occurred()) return NULL;
    }

    self = (MHAObject *)type->tp_alloc(type, 0);
    if (!self) return NULL;
    self->cfg = cfg;
    self->dropout = p;
    self->training = 1;
    self->seed = seed;
    st = mha_param_layout(&cfg, self->offset, self->size, &self->total);
    if (st != MHA_OK) {
        PyErr_Format(PyExc_MemoryError,
                     "the parameters of d_model=%lld, kdim=%lld, vdim=%lld are too large: %s",
                     (long long)cfg.d_model, (long long)cfg.kdim, (long long)cfg.vdim,
                     mha_status_str(st));
        goto fail;
    }
    {
        int64_t need = 0;
        if (add_bytes(&need, self->total, mha_dtype_size(cfg.dtype)) || need > physical_bytes()) {
            PyErr_Format(PyExc_MemoryError,
                         "the %lld parameters of d_model=%lld, kdim=%lld, vdim=%lld need more "
                         "memory than this machine has", (long long)self->total,
                         (long long)cfg.d_model, (long long)cfg.kdim, (long long)cfg.vdim);
            goto fail;
        }
    }
    self->block = malloc((size_t)self->total * mha_dtype_size(cfg.dtype) + 64);
    if (!self->block) {
        PyErr_Format(PyExc_MemoryError, "cannot allocate %lld parameters",
                     (long long)self->total);
        goto fail;
    }
    {
        /* writers first: a steady stream of calls must not starve _load */
        pthread_rwlockattr_t attr;
        int rc = pthread_rwlockattr_init(&attr);
        if (rc == 0) {
            pthread_rwlockattr_setkind_np(&attr, PTHREAD_RWLOCK_PREFER_WRITER_NONRECURSIVE_NP);
            rc = pthread_rwlock_init(&self->lock, &attr);
            pthread_rwlockattr_destroy(&attr);
        }
        if (rc != 0) {
            PyErr_SetString(PyExc_MemoryError, "cannot create the module's lock");
            goto fail;
        }
    }
    self->lock_ready = 1;
    mha_params_init(&cfg, self->block, seed);
    return (PyObject *)self;
fail:
    Py_XDECREF(self);
    return NULL;
}

static void mha_dealloc(MHAObject *self)
{
    PyTypeObject *tp = Py_TYPE(self);
    free(self->block);
    self->block = NULL;
    if (self->lock_ready) pthread_rwlock_destroy(&self->lock);
    tp->tp_free((PyObject *)self);
    Py_DECREF(tp);
}

/* A view of the whole parameter block, shape (total,), whose base is self. */
static PyObject *mha_block(MHAObject *self, PyObject *Py_UNUSED(ignored))
{
    npy_intp dims[1] = {(npy_intp)self->total};
    PyObject *arr = PyArray_SimpleNewFromData(1, dims, typenum_of(self), self->block);
    if (!arr) return NULL;
    Py_INCREF(self);
    if (PyArray_SetBaseObject((PyArrayObject *)arr, (PyObject *)self) < 0) {
        Py_DECREF(arr);
        return NULL;
    }
    return arr;
}

/* (offset, size) of every tensor in the block, in mha_param_layout order. */
static PyObject *mha_layout(MHAObject *self, PyObject *Py_UNUSED(ignored))
{
    PyObject *t = PyTuple_New(MHA_NPARAM);
    int i;
    if (!t) return NULL;
    for (i = 0; i < MHA_NPARAM; i++) {
        PyObject *pair = Py_BuildValue("(LL)", (long long)self->offset[i],
                                       (long long)self->size[i]);
        if (!pair) {
            Py_DECREF(t);
            return NULL;
        }
        PyTuple_SET_ITEM(t, i, pair);
    }
    return t;
}

/* _load(block): replace every parameter at once with a 1-D array of
 * `total` scalars, under the write lock, so no forward sees half of it. */
static PyObject *mha_load(MHAObject *self, PyObject *obj)
{
    PyArrayObject *arr = (PyArrayObject *)PyArray_FROM_OTF(
        obj, typenum_of(self), NPY_ARRAY_IN_ARRAY | NPY_ARRAY_FORCECAST);
    if (!arr) return NULL;
    if (PyArray_NDIM(arr) != 1 || PyArray_DIM(arr, 0) != (npy_intp)self->total) {
        PyErr_Format(PyExc_ValueError, "_load expects %lld scalars", (long long)self->total);
        Py_DECREF(arr);
        return NULL;
    }
    if (write_lock(self) < 0) {
        Py_DECREF(arr);
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    memmove(self->block, PyArray_DATA(arr),
            (size_t)self->total * mha_dtype_size(self->cfg.dtype));
    Py_END_ALLOW_THREADS
    write_unlock(self);
    Py_DECREF(arr);
    Py_RETURN_NONE;
}

/* _write_lock() / _write_unlock(): MultiHeadAttention.editing() (module.py).
 * In between, in-place writes into the parameter views by this thread are
 * atomic for calls from other threads: they wait, then see all new values. */
static PyObject *mha_write_lock(MHAObject *self, PyObject *Py_UNUSED(ignored))
{
    if (write_lock(self) < 0) return NULL;
    Py_RETURN_NONE;
}

static PyObject *mha_write_unlock(MHAObject *self, PyObject *Py_UNUSED(ignored))
{
    if (self->writer != PyThread_get_thread_ident() || self->writer_depth <= 0) {
        PyErr_SetString(PyExc_RuntimeError,
                        "_write_unlock: this thread does not hold the parameters' write lock");
        return NULL;
    }
    write_unlock(self);
    Py_RETURN_NONE;
}

/* `obj` as an array of real numbers (no copy for an ndarray). */
static PyArrayObject *as_real_array(PyObject *obj, const char *name)
{
    PyArrayObject *arr = (PyArrayObject *)PyArray_FROM_O(obj);
    if (!arr) return NULL;
    switch (PyArray_DESCR(arr)->kind) {
    case 'b': case 'i': case 'u': case 'f':
        return arr;
    default:
        PyErr_Format(PyExc_TypeError,
                     "%s must hold real numbers (bool, int or float), got dtype %R",
                     name, (PyObject *)PyArray_DESCR(arr));
        Py_DECREF(arr);
        return NULL;
    }
}

static PyObject *shape_str(PyArrayObject *arr)
{
    PyObject *s = PyObject_GetAttrString((PyObject *)arr, "shape");
    PyObject *r;
    if (!s) return NULL;
    r = PyObject_Str(s);
    Py_DECREF(s);
    return r;
}

static int check_input(PyArrayObject *arr, const char *name, const char *want)
{
    if (PyArray_NDIM(arr) != 3) {
        PyObject *s = shape_str(arr);
        if (s) {
            PyErr_Format(PyExc_ValueError, "%s must be 3-D %s (or 2-D unbatched), got shape %U",
                         name, want, s);
            Py_DECREF(s);
        }
        return -1;
    }
    return 0;
}

/* Convert mask `obj` of `kind` and broadcast it (NumPy's rules) onto
 * (B, H, Sq, Sk), filling m.  The array holding the data is kept in *keep. */
static int convert_mask(MHAObject *self, PyObject *obj, int kind, const int64_t dim[4],
                        mha_mask *m, PyArrayObject **keep)
{
    static const char *names[4] = {"batch", "heads", "query length", "key length"};
    int tn = kind == MHA_MASK_ADD ? typenum_of(self) : NPY_UINT8;
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
        if (ad < 0) {
            m->stride[d] = 0;
            continue;
        }
        npy_intp n = PyArray_DIM(arr, ad);
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

/* `seq`, a sequence of (kind, array) pairs (kind 0 blocking, 1 additive),
 * converted by convert_mask into masks[0 .. *n); keep[] holds their arrays
 * for the caller to release. */
static int convert_masks(MHAObject *self, PyObject *seq, const int64_t dim[4],
                         mha_mask masks[MHA_MAX_MASKS], PyArrayObject *keep[MHA_MAX_MASKS],
                         int *n)
{
    PyObject *fast = PySequence_Fast(seq, "masks must be a sequence of (kind, array) pairs");
    Py_ssize_t i;
    *n = 0;
    if (!fast) return -1;
    if (PySequence_Fast_GET_SIZE(fast) > MHA_MAX_MASKS) {
        PyErr_Format(PyExc_ValueError, "at most %d masks", MHA_MAX_MASKS);
        goto fail;
    }
    for (i = 0; i < PySequence_Fast_GET_SIZE(fast); i++) {
        PyObject *item = PySequence_Fast_GET_ITEM(fast, i);
        long kind;
        if (!PyTuple_Check(item) || PyTuple_GET_SIZE(item) != 2) {
            PyErr_SetString(PyExc_TypeError, "each mask must be a (kind, array) pair");
            goto fail;
        }
        kind = PyLong_AsLong(PyTuple_GET_ITEM(item, 0));
        if (kind == -1 && PyErr_Occurred()) goto fail;
        if (kind != MHA_MASK_BLOCK && kind != MHA_MASK_ADD) {
            PyErr_SetString(PyExc_ValueError, "mask kind must be 0 (blocking) or 1 (additive)");
            goto fail;
        }
        if (convert_mask(self, PyTuple_GET_ITEM(item, 1), (int)kind, dim, &masks[*n],
                         &keep[*n]) < 0)
            goto fail;
        (*n)++;
    }
    Py_DECREF(fast);
    return 0;
fail:
    Py_DECREF(fast);
    return -1;
}

/* The forward pass behind MultiHeadAttention.__call__ (module.py):
 *   _forward(query, key, value, masks, is_causal, need_weights, zero_rows,
 *            reference)
 * query (B, Sq, E), key (B, Sk, kdim), value (B, Sk, vdim); masks a tuple of
 * (kind, array) pairs, kind 0 blocking (nonzero = blocked) or 1 additive,
 * each broadcastable to (B, H, Sq, Sk).  reference: run the plain reference
 * core instead of the fast one (for tests).  Returns (output, weights|None). */
static PyObject *mha_forward_py(MHAObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    PyArrayObject *q0 = NULL, *k0 = NULL, *v0 = NULL, *q = NULL, *k = NULL, *v = NULL;
    PyArrayObject *out = NULL, *w = NULL;
    PyArrayObject *mask_arr[MHA_MAX_MASKS] = {NULL};
    PyObject *result = NULL;
    mha_mask masks[MHA_MAX_MASKS];
    mha_forward_args a;
    mha_params p;
    int is_causal, need_weights, zero_rows, reference, n_masks = 0, i, tn = typenum_of(self);
    int64_t E = self->cfg.d_model, H = self->cfg.n_heads;
    mha_status st;

    if (nargs != 8) {
        PyErr_SetString(PyExc_TypeError, "_forward takes exactly 8 arguments");
        return NULL;
    }
    if ((is_causal = PyObject_IsTrue(args[4])) < 0 ||
        (need_weights = PyObject_IsTrue(args[5])) < 0 ||
        (zero_rows = PyObject_IsTrue(args[6])) < 0 || (reference = PyObject_IsTrue(args[7])) < 0)
        return NULL;

    if (!(q0 = as_real_array(args[0], "query"))) goto fail;
    if (!(k0 = as_real_array(args[1], "key"))) goto fail;
    if (!(v0 = as_real_array(args[2], "value"))) goto fail;
    if (check_input(q0, "query", "(batch, seq, d_model)") < 0) goto fail;
    if (check_input(k0, "key", "(batch, seq, kdim)") < 0) goto fail;
    if (check_input(v0, "value", "(batch, seq, vdim)") < 0) goto fail;
    {
        npy_intp *qs = PyArray_DIMS(q0), *ks = PyArray_DIMS(k0), *vs = PyArray_DIMS(v0);
        const char *bad = NULL;
        char want[200];
        PyArrayObject *got = NULL;
        if (qs[2] != E) {
            bad = "query"; got = q0;
            snprintf(want, sizeof want, "(batch, seq, %lld) with d_model = %lld last",
                     (long long)E, (long long)E);
        } else if (ks[0] != qs[0] || ks[2] != self->cfg.kdim) {
            bad = "key"; got = k0;
            snprintf(want, sizeof want, "(%lld, Sk, %lld): query's batch and kdim = %lld",
                     (long long)qs[0], (long long)self->cfg.kdim, (long long)self->cfg.kdim);
        } else if (vs[0] != qs[0] || vs[1] != ks[1] || vs[2] != self->cfg.vdim) {
            bad = "value"; got = v0;
            snprintf(want, sizeof want,
                     "(%lld, %lld, %lld): query's batch, key's length and vdim = %lld",
                     (long long)qs[0], (long long)ks[1], (long long)self->cfg.vdim,
                     (long long)self->cfg.vdim);
        }
        if (bad) {
            PyObject *s = shape_str(got), *qsh = shape_str(q0), *ksh = shape_str(k0);
            if (s && qsh && ksh)
                PyErr_Format(PyExc_ValueError,
                             "%s must have shape %s, got %U (query %U, key %U)",
                             bad, want, s, qsh, ksh);
            Py_XDECREF(s);
            Py_XDECREF(qsh);
            Py_XDECREF(ksh);
            goto fail;
        }
    }
    memset(&a, 0, sizeof a);
    a.B = PyArray_DIM(q0, 0);
    a.Sq = PyArray_DIM(q0, 1);
    a.Sk = PyArray_DIM(k0, 1);
    /* sizes first: a shape too large is a MemoryError before anything is copied */
    st = mha_check_sizes(&self->cfg, a.B, a.Sq, a.Sk);
    if (st != MHA_OK) {
        PyErr_Format(PyExc_MemoryError,
                     "query, key and value of batch %lld, lengths %lld and %lld are too large "
                     "to allocate (%s)", (long long)a.B, (long long)a.Sq, (long long)a.Sk,
                     mha_status_str(st));
        goto fail;
    }
    {
        /* everything the call will allocate: the inputs in the module's dtype,
         * the output, the weights and the core's workspace (Q and the context
         * (B, Sq, E), K and V (B, Sk, E)).  More than the machine's memory
         * could never succeed: refuse it before allocating anything. */
        size_t es = mha_dtype_size(self->cfg.dtype);
        /* B*Sq, B*Sk and B*H*Sq are below products mha_check_sizes checked */
        int64_t need = 0, n_q, n_k, n_v, n_kv, n_w;
        int over = __builtin_mul_overflow(a.B * a.Sq, E, &n_q) ||
                   __builtin_mul_overflow(a.B * a.Sk, self->cfg.kdim, &n_k) ||
                   __builtin_mul_overflow(a.B * a.Sk, self->cfg.vdim, &n_v) ||
                   __builtin_mul_overflow(a.B * a.Sk, E, &n_kv) ||
                   __builtin_mul_overflow(a.B * H * a.Sq, a.Sk, &n_w) ||
                   add_bytes(&need, n_q, es) || add_bytes(&need, n_k, es) ||
                   add_bytes(&need, n_v, es) || add_bytes(&need, n_q, 3 * es) ||
                   add_bytes(&need, n_kv, 2 * es) ||
                   (need_weights && add_bytes(&need, n_w, es));
        if (over || need > physical_bytes()) {
            PyErr_Format(PyExc_MemoryError,
                         "query, key and value of batch %lld, lengths %lld and %lld need %s%lld "
                         "bytes%s, more than this machine's %lld bytes of memory",
                         (long long)a.B, (long long)a.Sq, (long long)a.Sk, over ? "over " : "",
                         (long long)(over ? INT64_MAX : need),
                         need_weights ? " with the (B, H, Sq, Sk) weights" : "",
                         (long long)physical_bytes());
            goto fail;
        }
    }

    /* masks */
    {
        const int64_t dim[4] = {a.B, H, a.Sq, a.Sk};
        if (convert_masks(self, args[3], dim, masks, mask_arr, &n_masks) < 0) goto fail;
    }

    /* inputs in the module's dtype, C-contiguous, aligned, native order */
    q = (PyArrayObject *)PyArray_FROM_OTF((PyObject *)q0, tn, NPY_ARRAY_IN_ARRAY | NPY_ARRAY_FORCECAST);
    if (!q) goto fail;
    if (args[1] == args[0]) { Py_INCREF(q); k = q; }
    else if (!(k = (PyArrayObject *)PyArray_FROM_OTF((PyObject *)k0, tn,
                                                     NPY_ARRAY_IN_ARRAY | NPY_ARRAY_FORCECAST)))
        goto fail;
    if (args[2] == args[1]) { Py_INCREF(k); v = k; }
    else if (!(v = (PyArrayObject *)PyArray_FROM_OTF((PyObject *)v0, tn,
                                                     NPY_ARRAY_IN_ARRAY | NPY_ARRAY_FORCECAST)))
        goto fail;
    {
        npy_intp od[3] = {(npy_intp)a.B, (npy_intp)a.Sq, (npy_intp)E};
        npy_intp wd[4] = {(npy_intp)a.B, (npy_intp)H, (npy_intp)a.Sq, (npy_intp)a.Sk};
        if (!(out = (PyArrayObject *)PyArray_SimpleNew(3, od, tn))) goto fail;
        if (need_weights && !(w = (PyArrayObject *)PyArray_SimpleNew(4, wd, tn))) goto fail;
    }
    a.query = PyArray_DATA(q);
    a.key = PyArray_DATA(k);
    a.value = PyArray_DATA(v);
    a.masks = masks;
    a.n_masks = n_masks;
    a.is_causal = is_causal;
    a.zero_masked_rows = zero_rows;
    a.out = PyArray_DATA(out);
    a.weights = w ? PyArray_DATA(w) : NULL;
    if (self->training && self->dropout > 0.0) {
        a.dropout = self->dropout;
        a.seed = self->seed;
        a.counter = self->counter++; /* under the GIL: one stream per call */
    }
    mha_params_from_block(&self->cfg, self->block, &p);
    {
        /* the owner of the write lock (editing()) computes without it */
        int lock = self->writer != PyThread_get_thread_ident(), rc = 0;
        Py_BEGIN_ALLOW_THREADS
        if (lock) rc = pthread_rwlock_rdlock(&self->lock);
        if (rc == 0) {
            st = reference ? mha_forward_ref(&self->cfg, &p, &a) : mha_forward(&self->cfg, &p, &a);
            if (lock) pthread_rwlock_unlock(&self->lock);
        }
        Py_END_ALLOW_THREADS
        if (rc != 0) {
            PyErr_Format(PyExc_RuntimeError, "cannot lock the module's parameters (error %d)", rc);
            goto fail;
        }
    }
    if (st != MHA_OK) {
        set_status_error(st, "forward");
        goto fail;
    }
    result = PyTuple_Pack(2, (PyObject *)out, w ? (PyObject *)w : Py_None);
fail:
    Py_XDECREF(q0);
    Py_XDECREF(k0);
    Py_XDECREF(v0);
    Py_XDECREF(q);
    Py_XDECREF(k);
    Py_XDECREF(v);
    Py_XDECREF(out);
    Py_XDECREF(w);
    for (i = 0; i < MHA_MAX_MASKS; i++) Py_XDECREF(mask_arr[i]);
    return result;
}

/* ------------------------------------------------------ training (backward)
 * The explicit training API behind mha_ext/autograd.py and mha_ext/torch.py:
 * no state is kept between a forward and its backward.  The caller holds what
 * the backward needs (the parameters, the inputs, the masks, the dropout
 * (p, counter)) and passes it back.
 *
 *   _take_counter() -> counter: reserve one dropout stream (atomic: GIL held)
 *   _forward_with(params, query, key, value, masks, is_causal, need_weights,
 *                 zero_rows, dropout, counter[, keep[, copy]])
 *       -> (output, weights | None)
 *       keep 1 (or True): -> (output, weights | None, (Q, K, V, ctx)), the
 *       forward's projections (mha_forward_save) for _backward's `saved`;
 *       keep 2: (Q, K, V, ctx, P), P (B, H, Sq, Sk) the softmax too
 *       copy true: one more item, (params | None, query, key, value): copies
 *       the forward made of its inputs and (when params is None: the
 *       module's, under its lock) of its parameters
 *   _backward(params, query, key, value, masks, is_causal, zero_rows,
 *             dropout, counter, grad_output, grad_weights | None[, saved])
 *       -> (grad_params, grad_query, grad_key, grad_value)
 *       saved: None (recompute) or the (Q, K, V, ctx[, P]) of _forward_with's
 *       call with keep (mha_backward_saved)
 *
 * params: None (the module's own parameters) or a 1-D array of the block's
 * `total` scalars laid out as _layout() says; grad_params has that layout.
 * query (B, Sq, E), key (B, Sk, kdim), value (B, Sk, vdim); masks as for
 * _forward; dropout p in [0, 1] (0: none) with the stream `counter` of the
 * module's seed. */

typedef struct {
    PyArrayObject *params, *q, *k, *v;
    PyArrayObject *mask_arr[MHA_MAX_MASKS];
    mha_mask masks[MHA_MAX_MASKS];
    mha_forward_args a;
    mha_params p;
} train_call;

static void train_call_clear(train_call *c)
{
    int i;
    Py_CLEAR(c->params);
    Py_CLEAR(c->q);
    Py_CLEAR(c->k);
    Py_CLEAR(c->v);
    for (i = 0; i < MHA_MAX_MASKS; i++) Py_CLEAR(c->mask_arr[i]);
}

static PyArrayObject *train_array(MHAObject *self, PyObject *obj, const char *name)
{
    if (obj == Py_None) {
        PyErr_Format(PyExc_TypeError, "%s must be an array, not None", name);
        return NULL;
    }
    return (PyArrayObject *)PyArray_FROM_OTF(obj, typenum_of(self),
                                             NPY_ARRAY_IN_ARRAY | NPY_ARRAY_FORCECAST);
}

/* args: params, query, key, value, masks, is_causal, zero_rows, dropout,
 * counter.  On success c->a describes the call (out and weights unset) and
 * c->p points at the parameters. */
static int train_call_parse(MHAObject *self, PyObject *const *args, int need_weights_unused,
                            train_call *c)
{
    int64_t E = self->cfg.d_model, H = self->cfg.n_heads;
    int is_causal, zero_rows;
    double p;
    unsigned long long counter;
    mha_status st;
    (void)need_weights_unused;

    memset(c, 0, sizeof *c);
    if ((is_causal = PyObject_IsTrue(args[5])) < 0 || (zero_rows = PyObject_IsTrue(args[6])) < 0)
        return -1;
    if (parse_dropout(args[7], &p) < 0) return -1;
    if (!PyLong_Check(args[8])) {
        PyErr_SetString(PyExc_TypeError, "counter must be an int");
        return -1;
    }
    counter = PyLong_AsUnsignedLongLong(args[8]);
    if (counter == (unsigned long long)-1 && PyErr_Occurred()) return -1;

    if (args[0] != Py_None) {
        if (!(c->params = train_array(self, args[0], "params"))) goto fail;
        if (PyArray_NDIM(c->params) != 1 || PyArray_DIM(c->params, 0) != (npy_intp)self->total) {
            PyErr_Format(PyExc_ValueError, "params must be a 1-D array of %lld scalars",
                         (long long)self->total);
            goto fail;
        }
    }
    if (!(c->q = train_array(self, args[1], "query")) ||
        !(c->k = train_array(self, args[2], "key")) ||
        !(c->v = train_array(self, args[3], "value")))
        goto fail;
    if (check_input(c->q, "query", "(batch, seq, d_model)") < 0 ||
        check_input(c->k, "key", "(batch, seq, kdim)") < 0 ||
        check_input(c->v, "value", "(batch, seq, vdim)") < 0)
        goto fail;
    {
        npy_intp *qs = PyArray_DIMS(c->q), *ks = PyArray_DIMS(c->k), *vs = PyArray_DIMS(c->v);
        if (qs[2] != E || ks[0] != qs[0] || ks[2] != self->cfg.kdim || vs[0] != qs[0] ||
            vs[1] != ks[1] || vs[2] != self->cfg.vdim) {
            PyErr_Format(PyExc_ValueError,
                         "query (B, Sq, %lld), key (B, Sk, %lld) and value (B, Sk, %lld) "
                         "expected, got (%lld, %lld, %lld), (%lld, %lld, %lld), (%lld, %lld, %lld)",
                         (long long)E, (long long)self->cfg.kdim, (long long)self->cfg.vdim,
                         (long long)qs[0], (long long)qs[1], (long long)qs[2],
                         (long long)ks[0], (long long)ks[1], (long long)ks[2],
                         (long long)vs[0], (long long)vs[1], (long long)vs[2]);
            goto fail;
        }
    }
    c->a.B = PyArray_DIM(c->q, 0);
    c->a.Sq = PyArray_DIM(c->q, 1);
    c->a.Sk = PyArray_DIM(c->k, 1);
    st = mha_check_sizes(&self->cfg, c->a.B, c->a.Sq, c->a.Sk);
    if (st != MHA_OK) {
        set_status_error(st, "query, key and value");
        goto fail;
    }
    {
        const int64_t dim[4] = {c->a.B, H, c->a.Sq, c->a.Sk};
        if (convert_masks(self, args[4], dim, c->masks, c->mask_arr, &c->a.n_masks) < 0)
            goto fail;
    }
    c->a.query = PyArray_DATA(c->q);
    c->a.key = PyArray_DATA(c->k);
    c->a.value = PyArray_DATA(c->v);
    c->a.masks = c->masks;
    c->a.is_causal = is_causal;
    c->a.zero_masked_rows = zero_rows;
    c->a.dropout = p;
    c->a.seed = self->seed;
    c->a.counter = (uint64_t)counter;
    mha_params_from_block(&self->cfg, c->params ? PyArray_DATA(c->params) : self->block, &c->p);
    return 0;
fail:
    train_call_clear(c);
    return -1;
}

static PyObject *mha_take_counter(MHAObject *self, PyObject *Py_UNUSED(ignored))
{
    return PyLong_FromUnsignedLongLong(self->counter++); /* under the GIL */
}

static PyObject *mha_forward_with_py(MHAObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    train_call c;
    PyArrayObject *out = NULL, *w = NULL, *kept[5] = {NULL, NULL, NULL, NULL, NULL};
    PyArrayObject *copies[4] = {NULL, NULL, NULL, NULL}; /* params, query, key, value */
    PyObject *result = NULL, *saved = NULL, *copied = NULL;
    PyObject *pargs[9];
    int need_weights, own = 0, copy = 0, tn = typenum_of(self), i;
    long keep = 0;
    mha_saved sv;
    mha_copies cv;
    mha_status st;

    if (nargs < 10 || nargs > 12) {
        PyErr_SetString(PyExc_TypeError, "_forward_with takes 10 to 12 arguments");
        return NULL;
    }
    if ((need_weights = PyObject_IsTrue(args[6])) < 0) return NULL;
    if (nargs >= 11) {
        if (!PyLong_Check(args[10])) {
            PyErr_SetString(PyExc_TypeError, "keep must be 0, 1 or 2");
            return NULL;
        }
        keep = PyLong_AsLong(args[10]);
        if (keep == -1 && PyErr_Occurred()) return NULL;
        if (keep < 0 || keep > 2) {
            PyErr_Format(PyExc_ValueError, "keep must be 0, 1 or 2, got %ld", keep);
            return NULL;
        }
    }
    if (nargs == 12 && (copy = PyObject_IsTrue(args[11])) < 0) return NULL;
    /* the parse order: params, q, k, v, masks, is_causal, zero_rows, dropout, counter */
    pargs[0] = args[0]; pargs[1] = args[1]; pargs[2] = args[2]; pargs[3] = args[3];
    pargs[4] = args[4]; pargs[5] = args[5]; pargs[6] = args[7]; pargs[7] = args[8];
    pargs[8] = args[9];
    if (train_call_parse(self, pargs, need_weights, &c) < 0) return NULL;
    own = c.params == NULL;
    memset(&sv, 0, sizeof sv);
    memset(&cv, 0, sizeof cv);
    {
        npy_intp od[3] = {(npy_intp)c.a.B, (npy_intp)c.a.Sq, (npy_intp)self->cfg.d_model};
        npy_intp wd[4] = {(npy_intp)c.a.B, (npy_intp)self->cfg.n_heads, (npy_intp)c.a.Sq,
                          (npy_intp)c.a.Sk};
        const npy_intp Dk = (npy_intp)(self->cfg.d_model / self->cfg.n_heads);
        /* Q, K (transposed), V per head: mha_forward_save's layouts */
        npy_intp hd[3][4] = {{(npy_intp)c.a.B, (npy_intp)self->cfg.n_heads, (npy_intp)c.a.Sq, Dk},
                             {(npy_intp)c.a.B, (npy_intp)self->cfg.n_heads, Dk, (npy_intp)c.a.Sk},
                             {(npy_intp)c.a.B, (npy_intp)self->cfg.n_heads, (npy_intp)c.a.Sk, Dk}};
        npy_intp pd[1] = {(npy_intp)self->total};
        const int n_kept = keep == 0 ? 0 : keep == 1 ? 4 : 5;
        if (!(out = (PyArrayObject *)PyArray_SimpleNew(3, od, tn))) goto fail;
        if (need_weights && !(w = (PyArrayObject *)PyArray_SimpleNew(4, wd, tn))) goto fail;
        /* Q, K, V, ctx (and P); zeroed only when B * Sq == 0 leaves K and V
         * unwritten */
        for (i = 0; i < n_kept; i++) {
            int nd = i == 3 ? 3 : 4;
            npy_intp *dims = i == 4 ? wd : i == 3 ? od : hd[i];
            kept[i] = (PyArrayObject *)(c.a.B * c.a.Sq == 0 ? PyArray_ZEROS(nd, dims, tn, 0)
                                                              : PyArray_SimpleNew(nd, dims, tn));
            if (!kept[i]) goto fail;
        }
        /* the copies: every one is written by the forward */
        if (copy) {
            if (own && !(copies[0] = (PyArrayObject *)PyArray_SimpleNew(1, pd, tn))) goto fail;
            if (!(copies[1] = (PyArrayObject *)PyArray_NewLikeArray(c.q, NPY_CORDER, NULL, 0)) ||
                !(copies[2] = (PyArrayObject *)PyArray_NewLikeArray(c.k, NPY_CORDER, NULL, 0)) ||
                !(copies[3] = (PyArrayObject *)PyArray_NewLikeArray(c.v, NPY_CORDER, NULL, 0)))
                goto fail;
        }
    }
    c.a.out = PyArray_DATA(out);
    c.a.weights = w ? PyArray_DATA(w) : NULL;
    if (keep) {
        sv.q = PyArray_DATA(kept[0]);
        sv.k = PyArray_DATA(kept[1]);
        sv.v = PyArray_DATA(kept[2]);
        sv.ctx = PyArray_DATA(kept[3]);
        sv.p = keep == 2 ? PyArray_DATA(kept[4]) : NULL;
    }
    if (copy) {
        cv.params = copies[0] ? PyArray_DATA(copies[0]) : NULL;
        cv.query = PyArray_DATA(copies[1]);
        cv.key = PyArray_DATA(copies[2]);
        cv.value = PyArray_DATA(copies[3]);
    }
    Py_BEGIN_ALLOW_THREADS
    if (own) pthread_rwlock_rdlock(&self->lock);
    st = mha_forward_save(&self->cfg, &c.p, &c.a, keep ? &sv : NULL, copy ? &cv : NULL);
    if (own) pthread_rwlock_unlock(&self->lock);
    Py_END_ALLOW_THREADS
    if (st != MHA_OK) {
        set_status_error(st, "forward");
        goto fail;
    }
    if (keep) {
        saved = keep == 1 ? PyTuple_Pack(4, (PyObject *)kept[0], (PyObject *)kept[1],
                                         (PyObject *)kept[2], (PyObject *)kept[3])
                          : PyTuple_Pack(5, (PyObject *)kept[0], (PyObject *)kept[1],
                                         (PyObject *)kept[2], (PyObject *)kept[3],
                                         (PyObject *)kept[4]);
        if (!saved) goto fail;
    }
    if (copy) {
        copied = PyTuple_Pack(4, copies[0] ? (PyObject *)copies[0] : Py_None,
                              (PyObject *)copies[1], (PyObject *)copies[2],
                              (PyObject *)copies[3]);
        if (!copied) goto fail;
        result = PyTuple_Pack(4, (PyObject *)out, w ? (PyObject *)w : Py_None,
                              saved ? saved : Py_None, copied);
    } else if (keep) {
        result = PyTuple_Pack(3, (PyObject *)out, w ? (PyObject *)w : Py_None, saved);
    } else {
        result = PyTuple_Pack(2, (PyObject *)out, w ? (PyObject *)w : Py_None);
    }
fail:
    Py_XDECREF(out);
    Py_XDECREF(w);
    Py_XDECREF(saved);
    Py_XDECREF(copied);
    for (i = 0; i < 5; i++) Py_XDECREF(kept[i]);
    for (i = 0; i < 4; i++) Py_XDECREF(copies[i]);
    train_call_clear(&c);
    return result;
}

static PyObject *mha_backward_py(MHAObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    train_call c;
    PyArrayObject *go = NULL, *gw = NULL, *gp = NULL, *gq = NULL, *gk = NULL, *gv = NULL;
    PyArrayObject *kept[5] = {NULL, NULL, NULL, NULL, NULL};
    PyObject *result = NULL;
    mha_backward_args ba;
    mha_saved sv;
    int own, tn = typenum_of(self), i, have_saved = 0;
    mha_status st;

    if (nargs != 11 && nargs != 12) {
        PyErr_SetString(PyExc_TypeError, "_backward takes 11 or 12 arguments");
        return NULL;
    }
    memset(&sv, 0, sizeof sv);
    if (train_call_parse(self, args, 0, &c) < 0) return NULL;
    own = c.params == NULL;
    if (!(go = train_array(self, args[9], "grad_output"))) goto fail;
    if (PyArray_NDIM(go) != 3 || PyArray_DIM(go, 0) != (npy_intp)c.a.B ||
        PyArray_DIM(go, 1) != (npy_intp)c.a.Sq || PyArray_DIM(go, 2) != (npy_intp)self->cfg.d_model) {
        PyObject *s = shape_str(go);
        if (s) {
            PyErr_Format(PyExc_ValueError, "grad_output must have the output's shape "
                         "(%lld, %lld, %lld), got %U", (long long)c.a.B, (long long)c.a.Sq,
                         (long long)self->cfg.d_model, s);
            Py_DECREF(s);
        }
        goto fail;
    }
    if (args[10] != Py_None) {
        if (!(gw = train_array(self, args[10], "grad_weights"))) goto fail;
        if (PyArray_NDIM(gw) != 4 || PyArray_DIM(gw, 0) != (npy_intp)c.a.B ||
            PyArray_DIM(gw, 1) != (npy_intp)self->cfg.n_heads ||
            PyArray_DIM(gw, 2) != (npy_intp)c.a.Sq || PyArray_DIM(gw, 3) != (npy_intp)c.a.Sk) {
            PyObject *s = shape_str(gw);
            if (s) {
                PyErr_Format(PyExc_ValueError, "grad_weights must have the weights' shape "
                             "(%lld, %lld, %lld, %lld), got %U", (long long)c.a.B,
                             (long long)self->cfg.n_heads, (long long)c.a.Sq,
                             (long long)c.a.Sk, s);
                Py_DECREF(s);
            }
            goto fail;
        }
    }
    if (nargs == 12 && args[11] != Py_None) {
        static const char *names[5] = {"saved Q", "saved K", "saved V", "saved ctx", "saved P"};
        Py_ssize_t n_saved;
        if (!PyTuple_Check(args[11]) ||
            ((n_saved = PyTuple_GET_SIZE(args[11])) != 4 && n_saved != 5)) {
            PyErr_SetString(PyExc_TypeError, "saved must be None or the (Q, K, V, ctx[, P]) "
                            "tuple of _forward_with(..., keep)");
            goto fail;
        }
        if (n_saved == 5 && PyTuple_GET_ITEM(args[11], 4) != Py_None) {
            if (!(kept[4] = train_array(self, PyTuple_GET_ITEM(args[11], 4), names[4])))
                goto fail;
            if (PyArray_NDIM(kept[4]) != 4 || PyArray_DIM(kept[4], 0) != (npy_intp)c.a.B ||
                PyArray_DIM(kept[4], 1) != (npy_intp)self->cfg.n_heads ||
                PyArray_DIM(kept[4], 2) != (npy_intp)c.a.Sq ||
                PyArray_DIM(kept[4], 3) != (npy_intp)c.a.Sk) {
                PyErr_Format(PyExc_ValueError, "%s must have shape (%lld, %lld, %lld, %lld)",
                             names[4], (long long)c.a.B, (long long)self->cfg.n_heads,
                             (long long)c.a.Sq, (long long)c.a.Sk);
                goto fail;
            }
        }
        for (i = 0; i < 4; i++) {
            /* Q (B, H, Sq, Dk), K (B, H, Dk, Sk), V (B, H, Sk, Dk), ctx (B, Sq, E) */
            const long long H = (long long)self->cfg.n_heads, Dk = (long long)self->cfg.d_model / H;
            const long long B = (long long)c.a.B, Sq = (long long)c.a.Sq, Sk = (long long)c.a.Sk;
            const long long want[4][4] = {{B, H, Sq, Dk}, {B, H, Dk, Sk}, {B, H, Sk, Dk},
                                          {B, Sq, (long long)self->cfg.d_model, -1}};
            const int nd = i == 3 ? 3 : 4;
            int d, ok;
            if (!(kept[i] = train_array(self, PyTuple_GET_ITEM(args[11], i), names[i])))
                goto fail;
            ok = PyArray_NDIM(kept[i]) == nd;
            for (d = 0; ok && d < nd; d++) ok = (long long)PyArray_DIM(kept[i], d) == want[i][d];
            if (!ok) {
                if (nd == 4)
                    PyErr_Format(PyExc_ValueError, "%s must have shape (%lld, %lld, %lld, %lld)",
                                 names[i], want[i][0], want[i][1], want[i][2], want[i][3]);
                else
                    PyErr_Format(PyExc_ValueError, "%s must have shape (%lld, %lld, %lld)",
                                 names[i], want[i][0], want[i][1], want[i][2]);
                goto fail;
            }
        }
        sv.q = PyArray_DATA(kept[0]);
        sv.k = PyArray_DATA(kept[1]);
        sv.v = PyArray_DATA(kept[2]);
        sv.ctx = PyArray_DATA(kept[3]);
        sv.p = kept[4] ? PyArray_DATA(kept[4]) : NULL;
        have_saved = 1;
    }
    {
        npy_intp pd[1] = {(npy_intp)self->total};
        npy_intp qd[3] = {(npy_intp)c.a.B, (npy_intp)c.a.Sq, (npy_intp)self->cfg.d_model};
        npy_intp kd[3] = {(npy_intp)c.a.B, (npy_intp)c.a.Sk, (npy_intp)self->cfg.kdim};
        npy_intp vd[3] = {(npy_intp)c.a.B, (npy_intp)c.a.Sk, (npy_intp)self->cfg.vdim};
        if (!(gp = (PyArrayObject *)PyArray_SimpleNew(1, pd, tn)) ||
            !(gq = (PyArrayObject *)PyArray_SimpleNew(3, qd, tn)) ||
            !(gk = (PyArrayObject *)PyArray_SimpleNew(3, kd, tn)) ||
            !(gv = (PyArrayObject *)PyArray_SimpleNew(3, vd, tn)))
            goto fail;
    }
    memset(&ba, 0, sizeof ba);
    ba.fwd = c.a;
    ba.grad_out = PyArray_DATA(go);
    ba.grad_weights = gw ? PyArray_DATA(gw) : NULL;
    ba.grad_query = PyArray_DATA(gq);
    ba.grad_key = PyArray_DATA(gk);
    ba.grad_value = PyArray_DATA(gv);
    ba.grad_params = PyArray_DATA(gp);
    Py_BEGIN_ALLOW_THREADS
    if (own) pthread_rwlock_rdlock(&self->lock);
    st = mha_backward_saved(&self->cfg, &c.p, &ba, have_saved ? &sv : NULL);
    if (own) pthread_rwlock_unlock(&self->lock);
    Py_END_ALLOW_THREADS
    if (st != MHA_OK) {
        set_status_error(st, "backward");
        goto fail;
    }
    result = PyTuple_Pack(4, (PyObject *)gp, (PyObject *)gq, (PyObject *)gk, (PyObject *)gv);
fail:
    Py_XDECREF(go);
    Py_XDECREF(gw);
    Py_XDECREF(gp);
    Py_XDECREF(gq);
    Py_XDECREF(gk);
    Py_XDECREF(gv);
    for (i = 0; i < 5; i++) Py_XDECREF(kept[i]);
    train_call_clear(&c);
    return result;
}

/* --------------------------------------------------- end training (backward) */

/* ----------------------------------------------------------- attributes */

static PyObject *get_d_model(MHAObject *s, void *c) { (void)c; return PyLong_FromLongLong(s->cfg.d_model); }
static PyObject *get_n_heads(MHAObject *s, void *c) { (void)c; return PyLong_FromLongLong(s->cfg.n_heads); }
static PyObject *get_d_k(MHAObject *s, void *c) { (void)c; return PyLong_FromLongLong(s->cfg.d_model / s->cfg.n_heads); }
static PyObject *get_kdim(MHAObject *s, void *c) { (void)c; return PyLong_FromLongLong(s->cfg.kdim); }
static PyObject *get_vdim(MHAObject *s, void *c) { (void)c; return PyLong_FromLongLong(s->cfg.vdim); }
static PyObject *get_bias(MHAObject *s, void *c) { (void)c; return PyBool_FromLong(s->cfg.bias); }
static PyObject *get_seed(MHAObject *s, void *c) { (void)c; return PyLong_FromUnsignedLongLong(s->seed); }
static PyObject *get_num_parameters(MHAObject *s, void *c) { (void)c; return PyLong_FromLongLong(s->total); }
static PyObject *get_dtype(MHAObject *s, void *c)
{
    (void)c;
    return (PyObject *)PyArray_DescrFromType(typenum_of(s));
}
static PyObject *get_dropout(MHAObject *s, void *c) { (void)c; return PyFloat_FromDouble(s->dropout); }
static int set_dropout(MHAObject *s, PyObject *v, void *c)
{
    double p;
    (void)c;
    if (!v) {
        PyErr_SetString(PyExc_AttributeError, "cannot delete dropout");
        return -1;
    }
    if (parse_dropout(v, &p) < 0) return -1;
    s->dropout = p;
    return 0;
}
static PyObject *get_training(MHAObject *s, void *c) { (void)c; return PyBool_FromLong(s->training); }
static int set_training(MHAObject *s, PyObject *v, void *c)
{
    int t;
    (void)c;
    if (!v) {
        PyErr_SetString(PyExc_AttributeError, "cannot delete training");
        return -1;
    }
    if ((t = PyObject_IsTrue(v)) < 0) return -1;
    s->training = t;
    return 0;
}
static PyObject *get_counter(MHAObject *s, void *c) { (void)c; return PyLong_FromUnsignedLongLong(s->counter); }
static int set_counter(MHAObject *s, PyObject *v, void *c)
{
    uint64_t n;
    (void)c;
    if (!v || !PyLong_Check(v)) {
        PyErr_SetString(PyExc_TypeError, "_counter must be an int");
        return -1;
    }
    n = (uint64_t)PyLong_AsUnsignedLongLong(v);
    if (n == (uint64_t)-1 && PyErr_Occurred()) return -1;
    s->counter = n;
    return 0;
}

static PyGetSetDef mha_getset[] = {
    {"d_model", (getter)get_d_model, NULL, "E: the model width.", NULL},
    {"n_heads", (getter)get_n_heads, NULL, "H: the number of heads.", NULL},
    {"d_k", (getter)get_d_k, NULL, "Dk = d_model / n_heads: the width of one head.", NULL},
    {"kdim", (getter)get_kdim, NULL, "The width of key inputs.", NULL},
    {"vdim", (getter)get_vdim, NULL, "The width of value inputs.", NULL},
    {"bias", (getter)get_bias, NULL, "Whether the projections have biases.", NULL},
    {"seed", (getter)get_seed, NULL, "The seed of the initialisation and the dropout stream.", NULL},
    {"num_parameters", (getter)get_num_parameters, NULL,
     "The number of scalars in all weights and biases (4*E*E + 4*E by default).", NULL},
    {"dtype", (getter)get_dtype, NULL, "The NumPy dtype of parameters, inputs and results.", NULL},
    {"dropout", (getter)get_dropout, (setter)set_dropout,
     "Dropout probability on the attention weights, in [0, 1] (used in training mode).", NULL},
    {"training", (getter)get_training, (setter)set_training,
     "True in training mode (dropout active), False after eval().", NULL},
    {"_counter", (getter)get_counter, (setter)set_counter,
     "How many dropout streams the module has used (one per training call).", NULL},
    {NULL}
};

static PyMethodDef mha_methods[] = {
    {"_forward", (PyCFunction)(void (*)(void))mha_forward_py, METH_FASTCALL,
     "_forward(query, key, value, masks, is_causal, need_weights, zero_rows, reference)\n"
     "--\n\nThe C forward pass; use the module's __call__ instead."},
    {"_block", (PyCFunction)mha_block, METH_NOARGS,
     "_block()\n--\n\nA 1-D view of all parameters (live memory)."},
    {"_layout", (PyCFunction)mha_layout, METH_NOARGS,
     "_layout()\n--\n\n(offset, size) of W_q.weight, W_q.bias, ... W_o.bias in _block()."},
    {"_load", (PyCFunction)mha_load, METH_O,
     "_load(block)\n--\n\nReplace all parameters at once (atomic for concurrent calls)."},
    {"_write_lock", (PyCFunction)mha_write_lock, METH_NOARGS,
     "_write_lock()\n--\n\nHold the parameters' write lock (see editing())."},
    {"_write_unlock", (PyCFunction)mha_write_unlock, METH_NOARGS,
     "_write_unlock()\n--\n\nRelease what _write_lock took."},
    {"_take_counter", (PyCFunction)mha_take_counter, METH_NOARGS,
     "_take_counter()\n--\n\nReserve one dropout stream: its counter (training API)."},
    {"_forward_with", (PyCFunction)(void (*)(void))mha_forward_with_py, METH_FASTCALL,
     "_forward_with(params, query, key, value, masks, is_causal, need_weights, zero_rows, "
     "dropout, counter, keep=0, copy=False)\n--\n\nThe forward with explicit parameters "
     "and dropout stream; keep 1: also return (Q, K, V, ctx) for _backward, keep 2: "
     "(Q, K, V, ctx, P); copy: also return the copies it made of (params or None, query, "
     "key, value); use MultiHeadAttention.forward_train."},
    {"_backward", (PyCFunction)(void (*)(void))mha_backward_py, METH_FASTCALL,
     "_backward(params, query, key, value, masks, is_causal, zero_rows, dropout, counter, "
     "grad_output, grad_weights, saved=None)\n--\n\nThe gradients of _forward_with's call "
     "(saved: its kept (Q, K, V, ctx[, P])); "
     "use MultiHeadAttention.backward."},
    {NULL}
};

static PyType_Slot mha_slots[] = {
    {Py_tp_new, mha_new},
    {Py_tp_dealloc, mha_dealloc},
    {Py_tp_methods, mha_methods},
    {Py_tp_getset, mha_getset},
    {Py_tp_doc, "The C part of mha_ext.MultiHeadAttention: parameter memory and the forward pass."},
    {0, NULL}
};

static PyType_Spec mha_spec = {
    .name = "mha_ext._core.MultiHeadAttention",
    .basicsize = sizeof(MHAObject),
    .itemsize = 0,
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE,
    .slots = mha_slots,
};

/* ------------------------------------------------------------- module */

static PyObject *set_num_threads(PyObject *m, PyObject *arg)
{
    long n;
    (void)m;
    if (!PyLong_Check(arg) || PyBool_Check(arg)) {
        PyErr_Format(PyExc_TypeError, "set_num_threads expects an int, not %.100s",
                     Py_TYPE(arg)->tp_name);
        return NULL;
    }
    n = PyLong_AsLong(arg);
    if (n == -1 && PyErr_Occurred()) return NULL;
    if (n < 1 || n > 256) {
        PyErr_Format(PyExc_ValueError, "set_num_threads expects 1 to 256 threads, got %ld", n);
        return NULL;
    }
    mha_set_num_threads((int)n);
    Py_RETURN_NONE;
}

static PyObject *get_num_threads(PyObject *m, PyObject *Py_UNUSED(ignored))
{
    (void)m;
    return PyLong_FromLong(mha_get_num_threads());
}

/* _set_isa(name) / _get_isa() / _isa_available(name): the instruction set of
 * the fast kernels ("portable", "avx2", "avx512"), for tests and benchmarks
 * (src/isa.c; the environment variable MHA_EXT_ISA sets the start value). */
static PyObject *set_isa(PyObject *m, PyObject *arg)
{
    const char *name = PyUnicode_Check(arg) ? PyUnicode_AsUTF8(arg) : NULL;
    (void)m;
    if (!name) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "_set_isa expects a str");
        return NULL;
    }
    if (mha_set_isa(name) != MHA_OK) {
        PyErr_Format(PyExc_ValueError, "instruction set %R is unknown or not supported by "
                     "this CPU (portable, avx2, avx512)", arg);
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyObject *get_isa(PyObject *m, PyObject *Py_UNUSED(ignored))
{
    (void)m;
    return PyUnicode_FromString(mha_get_isa());
}

static PyObject *isa_available(PyObject *m, PyObject *arg)
{
    const char *name = PyUnicode_Check(arg) ? PyUnicode_AsUTF8(arg) : NULL;
    (void)m;
    if (!name) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "_isa_available expects a str");
        return NULL;
    }
    return PyBool_FromLong(mha_isa_available(name));
}

static PyMethodDef module_methods[] = {
    {"_set_isa", set_isa, METH_O, "_set_isa(name, /)\n--\n\nUse the kernels of one instruction set."},
    {"_get_isa", get_isa, METH_NOARGS, "_get_isa()\n--\n\nThe instruction set of the kernels in use."},
    {"_isa_available", isa_available, METH_O,
     "_isa_available(name, /)\n--\n\nWhether this CPU and build can run that instruction set."},
    {"set_num_threads", set_num_threads, METH_O,
     "set_num_threads(n, /)\n--\n\n"
     "Use n threads (1 to 256) for the library's own parallel work."},
    {"get_num_threads", get_num_threads, METH_NOARGS,
     "get_num_threads()\n--\n\n"
     "The number of threads the library uses (default: the CPUs this process may use)."},
    {NULL}
};

static int module_exec(PyObject *m)
{
    module_state *state = (module_state *)PyModule_GetState(m);
    if (PyArray_ImportNumPyAPI() < 0) return -1;
    state->mha_type = (PyTypeObject *)PyType_FromModuleAndSpec(m, &mha_spec, NULL);
    if (!state->mha_type) return -1;
    if (PyModule_AddObjectRef(m, "MultiHeadAttention", (PyObject *)state->mha_type) < 0)
        return -1;
    return 0;
}

static int module_traverse(PyObject *m, visitproc visit, void *arg)
{
    module_state *state = (module_state *)PyModule_GetState(m);
    Py_VISIT(state->mha_type);
    return 0;
}

static int module_clear(PyObject *m)
{
    module_state *state = (module_state *)PyModule_GetState(m);
    Py_CLEAR(state->mha_type);
    return 0;
}

static void module_free(void *m) { module_clear((PyObject *)m); }

static PyModuleDef_Slot module_slots[] = {
    {Py_mod_exec, module_exec},
    {0, NULL}
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT,
    .m_name = "mha_ext._core",
    .m_doc = "The C core of mha_ext (multi-head attention), bound to NumPy.",
    .m_size = sizeof(module_state),
    .m_methods = module_methods,
    .m_slots = module_slots,
    .m_traverse = module_traverse,
    .m_clear = module_clear,
    .m_free = module_free,
};

PyMODINIT_FUNC PyInit__core(void) { return PyModuleDef_Init(&module_def); }
