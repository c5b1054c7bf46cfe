/* _core.c: the CPython/NumPy binding of the C core in src/: the module, its
 * functions, and the type (construction, parameter memory, attributes, the
 * write lock's methods).  The calls live in _core_calls.c, argument
 * conversion in _core_args.c and _core_parse.c, the lock in _core_lock.c,
 * the output cache in _core_mem.c (_core.h says what they share).
 * Everything easier in Python (mask semantics, torch interop, state dicts,
 * traces) lives in mha_ext/module.py, which subclasses the type defined
 * here.
 *
 * Legend: B batch, Sq/Sk query/key lengths, E d_model, H heads, Dk = E/H. */
#define MHA_EXT_IMPORTS_NUMPY
#include "_core.h"

#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <time.h>

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

/* ------------------------------------------------------------ the type */

static void free_block(PyObject *capsule)
{
    free(PyCapsule_GetPointer(capsule, "mha_ext._core.block"));
}

/* The parameter memory: an array (total,) whose base is a capsule owning a
 * zeroed block, its data 64-byte aligned.  Views of the parameters keep
 * that array alive, never the module, so a module that stores such a view
 * (m.wq = m.W_q.weight) makes no reference cycle through arrays, which the
 * garbage collector could not see.  calloc: a large block is fresh pages
 * the system zeroes on first touch, so a module never initialised
 * (_empty) holds next to no memory. */
static PyArrayObject *new_block(const MHAObject *self)
{
    size_t bytes = (size_t)self->total * mha_dtype_size(self->cfg.dtype);
    npy_intp dims[1] = {(npy_intp)self->total};
    void *mem = calloc(1, bytes + 64);
    PyObject *capsule = NULL;
    PyArrayObject *arr = NULL;
    if (!mem) {
        PyErr_Format(PyExc_MemoryError, "cannot allocate %lld parameters",
                     (long long)self->total);
        return NULL;
    }
    if (!(capsule = PyCapsule_New(mem, "mha_ext._core.block", free_block))) {
        free(mem);
        return NULL;
    }
    arr = (PyArrayObject *)PyArray_SimpleNewFromData(
        1, dims, typenum_of(self), (void *)(((uintptr_t)mem + 63) & ~(uintptr_t)63));
    if (!arr) {
        Py_DECREF(capsule);
        return NULL;
    }
    if (PyArray_SetBaseObject(arr, capsule) < 0) { /* steals capsule */
        Py_DECREF(arr);
        return NULL;
    }
    return arr;
}

static PyObject *mha_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"d_model", "n_heads", "dropout", "bias", "kdim", "vdim",
                             "dtype", "seed", "add_bias_kv", "add_zero_attn", "n_kv_heads",
                             "_empty", NULL};
    PyObject *o_e = NULL, *o_h = NULL, *o_p = NULL, *o_bias = Py_True, *o_kdim = Py_None,
             *o_vdim = Py_None, *o_dtype = NULL, *o_seed = Py_None, *o_bkv = NULL,
             *o_zero = NULL, *o_kvh = Py_None, *o_empty = NULL;
    MHAObject *self = NULL;
    mha_config cfg;
    double p = 0.0;
    uint64_t seed;
    mha_status st;
    int b, empty = 0;

    /* _empty (private): parameters left zero and never touched, for the
     * torch classes' cores, which every call hands their tensors */
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OO|O$OOOOOOOOO:MultiHeadAttention", kwlist,
                                     &o_e, &o_h, &o_p, &o_bias, &o_kdim, &o_vdim,
                                     &o_dtype, &o_seed, &o_bkv, &o_zero, &o_kvh, &o_empty))
        return NULL;
    if (o_empty && parse_flag(o_empty, "_empty", &empty) < 0) return NULL;
    memset(&cfg, 0, sizeof cfg);
    if (positive_int(o_e, "d_model", &cfg.d_model) < 0) return NULL;
    if (positive_int(o_h, "n_heads", &cfg.n_heads) < 0) return NULL;
    if (cfg.d_model % cfg.n_heads != 0) {
        PyErr_Format(PyExc_ValueError,
                     "d_model (%lld) must be divisible by n_heads (%lld)",
                     (long long)cfg.d_model, (long long)cfg.n_heads);
        return NULL;
    }
    if (o_kvh != Py_None && kv_heads_arg(o_kvh, cfg.n_heads, &cfg.n_kv_heads) < 0)
        return NULL;
    cfg.kdim = cfg.d_model;
    cfg.vdim = cfg.d_model;
    if (o_kdim != Py_None && positive_int(o_kdim, "kdim", &cfg.kdim) < 0) return NULL;
    if (o_vdim != Py_None && positive_int(o_vdim, "vdim", &cfg.vdim) < 0) return NULL;
    if (o_p && parse_dropout(o_p, "dropout", &p) < 0) return NULL;
    if (parse_flag(o_bias, "bias", &b) < 0) return NULL;
    cfg.bias = b;
    if (o_bkv && parse_flag(o_bkv, "add_bias_kv", &cfg.add_bias_kv) < 0) return NULL;
    if (o_zero && parse_flag(o_zero, "add_zero_attn", &cfg.add_zero_attn) < 0) return NULL;
    cfg.dtype = MHA_FLOAT32;
    if (o_dtype && parse_dtype(o_dtype, &cfg.dtype) < 0) return NULL;
    if (o_seed == Py_None) seed = random_seed();
    else if (parse_u64(o_seed, "seed", &seed) < 0) return NULL;

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
    if (!(self->params = new_block(self))) goto fail;
    self->block = PyArray_DATA(self->params);
    if (lock_init(&self->lock) < 0) goto fail;
    if (!empty) mha_params_init(&cfg, self->block, seed);
    return (PyObject *)self;
fail:
    Py_XDECREF(self);
    return NULL;
}

static void mha_dealloc(MHAObject *self)
{
    PyTypeObject *tp = Py_TYPE(self);
    lock_destroy(&self->lock);
    Py_CLEAR(self->params);
    self->block = NULL;
    tp->tp_free((PyObject *)self);
    Py_DECREF(tp);
}

/* _block(): a view (total,) of all parameters (live memory); its base is
 * the parameter array, never the module. */
static PyObject *mha_block(MHAObject *self, PyObject *Py_UNUSED(ignored))
{
    return PyArray_View(self->params, NULL, NULL);
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
 * `total` scalars, under the write lock, so no call sees half of it. */
static PyObject *mha_load(MHAObject *self, PyObject *obj)
{
    PyArrayObject *arr = (PyArrayObject *)PyArray_FROM_OTF(
        obj, typenum_of(self), NPY_ARRAY_IN_ARRAY | NPY_ARRAY_FORCECAST);
    PyObject *result = NULL;
    uint64_t token = 0;
    if (!arr) return NULL;
    if (PyArray_NDIM(arr) != 1 || PyArray_DIM(arr, 0) != (npy_intp)self->total) {
        PyErr_Format(PyExc_ValueError, "_load expects %lld scalars", (long long)self->total);
        goto fail;
    }
    if (lock_write(&self->lock, &token) < 0) goto fail;
    Py_BEGIN_ALLOW_THREADS
    memmove(self->block, PyArray_DATA(arr),
            (size_t)self->total * mha_dtype_size(self->cfg.dtype));
    lock_write_release(&self->lock, token);
    Py_END_ALLOW_THREADS
    result = Py_NewRef(Py_None);
fail:
    Py_DECREF(arr);
    return result;
}

static PyObject *mha_take_counter(MHAObject *self, PyObject *Py_UNUSED(ignored))
{
    return PyLong_FromUnsignedLongLong(self->counter++); /* under the GIL */
}

/* ----------------------------------------------------------- attributes */

static PyObject *get_d_model(MHAObject *s, void *c) { (void)c; return PyLong_FromLongLong(s->cfg.d_model); }
static PyObject *get_n_heads(MHAObject *s, void *c) { (void)c; return PyLong_FromLongLong(s->cfg.n_heads); }
static PyObject *get_d_k(MHAObject *s, void *c) { (void)c; return PyLong_FromLongLong(s->cfg.d_model / s->cfg.n_heads); }
static PyObject *get_kdim(MHAObject *s, void *c) { (void)c; return PyLong_FromLongLong(s->cfg.kdim); }
static PyObject *get_vdim(MHAObject *s, void *c) { (void)c; return PyLong_FromLongLong(s->cfg.vdim); }
static PyObject *get_bias(MHAObject *s, void *c) { (void)c; return PyBool_FromLong(s->cfg.bias); }
static PyObject *get_add_bias_kv(MHAObject *s, void *c) { (void)c; return PyBool_FromLong(s->cfg.add_bias_kv); }
static PyObject *get_add_zero_attn(MHAObject *s, void *c) { (void)c; return PyBool_FromLong(s->cfg.add_zero_attn); }
static PyObject *get_n_kv_heads(MHAObject *s, void *c) { (void)c; return PyLong_FromLongLong(mha_kv_heads(&s->cfg)); }
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
    if (parse_dropout(v, "dropout", &p) < 0) return -1;
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
    if (!v) {
        PyErr_SetString(PyExc_AttributeError, "cannot delete _counter");
        return -1;
    }
    if (parse_u64(v, "_counter", &n) < 0) return -1;
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
    {"add_bias_kv", (getter)get_add_bias_kv, NULL,
     "Whether bias_k and bias_v are appended to the keys and values (torch's add_bias_kv).", NULL},
    {"n_kv_heads", (getter)get_n_kv_heads, NULL,
     "Hkv: the key/value heads (n_heads unless grouped-query attention).", NULL},
    {"add_zero_attn", (getter)get_add_zero_attn, NULL,
     "Whether a zero key and value are appended (torch's add_zero_attn).", NULL},
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
    {"_forward", (PyCFunction)(void (*)(void))mha_forward_py, METH_VARARGS | METH_KEYWORDS,
     "_forward($self, query, key, value, *, params=None, masks=(), is_causal=False, "
     "need_weights=True, zero_rows=False, reference=False, scale=None, window=None, "
     "head_mask=None, layout=None, cache=None, average_weights=False)\n--\n\n"
     "The C forward pass -> (output, weights | None); use the module's __call__ instead."},
    {"_forward_train", (PyCFunction)(void (*)(void))mha_forward_train_py,
     METH_VARARGS | METH_KEYWORDS,
     "_forward_train($self, query, key, value, *, params=None, masks=(), is_causal=False, "
     "need_weights=True, zero_rows=False, dropout=0.0, counter=0, save=True, save_p=False, "
     "scale=None, window=None, head_mask=None, layout=None, average_weights=False)"
     "\n--\n\n"
     "The forward with explicit parameters and dropout stream -> (output, weights | None, "
     "saved | None, copies): saved (Q, K, V, ctx, P | None) for _backward, copies "
     "(params | None, query, key, value); use MultiHeadAttention.forward_train."},
    {"_backward", (PyCFunction)(void (*)(void))mha_backward_py, METH_VARARGS | METH_KEYWORDS,
     "_backward($self, query, key, value, grad_output, *, params=None, masks=(), is_causal=False, "
     "zero_rows=False, dropout=0.0, counter=0, grad_weights=None, saved=None, scale=None, "
     "window=None, head_mask=None, layout=None, scores_grad=False)\n--\n\n"
     "The gradients (grad_params, grad_query, grad_key, grad_value[, grad_scores]) of "
     "_forward_train's call with the same arguments; use MultiHeadAttention.backward."},
    {"_block", (PyCFunction)mha_block, METH_NOARGS,
     "_block($self)\n--\n\nA 1-D view of all parameters (live memory; its base is the "
     "parameter array, not the module)."},
    {"_snapshot", (PyCFunction)mha_snapshot, METH_NOARGS,
     "_snapshot($self)\n--\n\nA copy of all parameters (a new 1-D array), taken under the read "
     "lock: no load_state_dict or editing() block is half in it."},
    {"_edits", (PyCFunction)mha_edits, METH_NOARGS,
     "_edits($self)\n--\n\nHow many write holds (editing() blocks, load_state_dict) have "
     "begun on the parameters, nested ones not counted."},
    {"_layout", (PyCFunction)mha_layout, METH_NOARGS,
     "_layout($self)\n--\n\n(offset, size) of W_q.weight, W_q.bias, ... W_o.bias in _block()."},
    {"_load", (PyCFunction)mha_load, METH_O,
     "_load($self, block, /)\n--\n\nReplace all parameters at once (atomic for concurrent calls)."},
    {"_write_lock", (PyCFunction)mha_write_lock, METH_NOARGS,
     "_write_lock($self)\n--\n\nHold the parameters' write lock (see editing()); returns the "
     "hold's token."},
    {"_write_unlock", (PyCFunction)(void (*)(void))mha_write_unlock, METH_FASTCALL,
     "_write_unlock($self, token=None, /)\n--\n\nRelease one hold of _write_lock: the one "
     "named by token (from any thread), or the calling thread's."},
    {"_take_counter", (PyCFunction)mha_take_counter, METH_NOARGS,
     "_take_counter($self)\n--\n\nReserve one dropout stream: its counter (training API)."},
    {NULL}
};

static PyType_Slot mha_slots[] = {
    {Py_tp_new, mha_new},
    {Py_tp_dealloc, mha_dealloc},
    {Py_tp_methods, mha_methods},
    {Py_tp_getset, mha_getset},
    {Py_tp_doc, "MultiHeadAttention(d_model, n_heads, dropout=0.0, *, bias=True, kdim=None, "
                "vdim=None, dtype='float32', seed=None, add_bias_kv=False, "
                "add_zero_attn=False, n_kv_heads=None, _empty=False)\n--\n\n"
                "The C part of mha_ext.MultiHeadAttention: parameter memory and the calls "
                "(_empty: the parameters left zero and untouched, for the torch classes' "
                "modules, whose calls pass their own)."},
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
    int64_t n = 0;
    (void)m;
    /* any int (NumPy's too; not a bool or float); out of 1..256: ValueError */
    if (positive_int(arg, "set_num_threads: n", &n) < 0 || n > 256) {
        if (n > 256 || PyErr_ExceptionMatches(PyExc_ValueError)) {
            PyErr_Clear();
            PyErr_Format(PyExc_ValueError, "set_num_threads expects 1 to 256 threads, got %R",
                         arg);
        }
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
 * the fast kernels ("portable", "avx2", "avx512", "amx"), for tests and benchmarks
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
                     "this CPU (portable, avx2, avx512, amx)", arg);
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

/* cpu_info(): src/cpu.c's mha_get_cpu_info as a dict (the FMA probe and,
 * at first use, the weight gradients' packing probe run without the GIL:
 * some tens of milliseconds) */
static PyObject *cpu_info(PyObject *m, PyObject *Py_UNUSED(ignored))
{
    mha_cpu_info ci;
    mha_status st;
    (void)m;
    Py_BEGIN_ALLOW_THREADS
    st = mha_get_cpu_info(&ci);
    Py_END_ALLOW_THREADS
    if (st != MHA_OK) {
        PyErr_SetString(PyExc_RuntimeError, "mha_get_cpu_info failed");
        return NULL;
    }
    return Py_BuildValue("{s:s,s:L,s:L,s:L,s:s,s:i,s:i,s:d,s:L,s:{s:L,s:L},s:{s:i,s:i},s:i}",
                         "isa", mha_get_isa(), "l1d_bytes", (long long)ci.l1d_bytes,
                         "l2_bytes", (long long)ci.l2_bytes, "l3_bytes", (long long)ci.l3_bytes,
                         "cache_source", ci.cache_source, "fma_bits", ci.fma_bits,
                         "fma512_per_cycle", ci.fma512_per_cycle, "fma_ratio", ci.fma_ratio,
                         "gemm_kc", (long long)ci.gemm_kc, "gemm_nc", "float32",
                         (long long)ci.gemm_nc_f32, "float64", (long long)ci.gemm_nc_f64,
                         "tn_pack", "float32", ci.tn_pack_f32, "float64", ci.tn_pack_f64,
                         "threads", mha_get_num_threads());
}

/* release_memory(): the output cache's blocks and the calling thread's
 * workspace back to the system */
static PyObject *release_memory(PyObject *m, PyObject *Py_UNUSED(ignored))
{
    size_t bytes;
    (void)m;
    bytes = out_cache_release();
    mha_release_workspace();
    return PyLong_FromSize_t(bytes);
}

static PyObject *memory_info(PyObject *m, PyObject *Py_UNUSED(ignored))
{
    size_t cached, limit;
    int blocks;
    (void)m;
    out_cache_info(&cached, &blocks, &limit);
    /* size_t as unsigned long long ("K"): a limit past 2**63 bytes
     * (MHA_EXT_CACHE_MB near 2**44) was a negative Py_ssize_t */
    return Py_BuildValue("{s:K,s:i,s:K}", "cached_bytes", (unsigned long long)cached,
                         "cached_blocks", blocks, "limit_bytes", (unsigned long long)limit);
}

static PyMethodDef module_methods[] = {
    {"_set_isa", set_isa, METH_O, "_set_isa(name, /)\n--\n\nUse the kernels of one instruction set."},
    {"_get_isa", get_isa, METH_NOARGS, "_get_isa()\n--\n\nThe instruction set of the kernels in use."},
    {"_isa_available", isa_available, METH_O,
     "_isa_available(name, /)\n--\n\nWhether this CPU and build can run that instruction set."},
    {"cpu_info", cpu_info, METH_NOARGS,
     "cpu_info()\n--\n\n"
     "What the CPU reports and the blocking the library drew from it: a dict of isa, the\n"
     "cache sizes (l1d_bytes, l2_bytes per core, l3_bytes shared; 0 unknown; cache_source\n"
     "'cpuid', 'sysconf' or 'default'), fma_bits (vector FMA width of the ISA in use),\n"
     "fma512_per_cycle (512-bit FMAs a core starts per cycle: 1, 2, or 0 without AVX-512)\n"
     "and fma_ratio (time of 256-bit / time of 512-bit FMAs, measured: about 0.5 with one\n"
     "512-bit unit, 1 with two; above 0.9 counts as two), gemm_kc and gemm_nc (the\n"
     "packed GEMM's block of B per dtype: KC x NC scalars in half the L2), tn_pack (per\n"
     "dtype, 1 when the weight gradients' transposed-A products pack an A whose rows lie\n"
     "a multiple of 4 KiB apart, 0 when they read it in place: measured at first use on\n"
     "AVX-512, which reads other such A in place; MHA_EXT_TN_PACK=0/1 overrides) and\n"
     "threads.  The probes take some tens of ms."},
    {"release_memory", release_memory, METH_NOARGS,
     "release_memory()\n--\n\n"
     "Return the memory mha_ext keeps for reuse to the system: the cached blocks of freed\n"
     "result arrays and the calling thread's workspace.  Returns the cached bytes freed."},
    {"memory_info", memory_info, METH_NOARGS,
     "memory_info()\n--\n\n"
     "The output cache: a dict of cached_bytes and cached_blocks (freed result arrays'\n"
     "memory kept for the next ones of about their size) and limit_bytes (the cache's\n"
     "bound: MHA_EXT_CACHE_MB, else 1 GiB or an eighth of the memory; 0: off)."},
    {"set_num_threads", set_num_threads, METH_O,
     "set_num_threads(n, /)\n--\n\n"
     "Use n threads (1 to 256) for the library's own parallel work."},
    {"get_num_threads", get_num_threads, METH_NOARGS,
     "get_num_threads()\n--\n\n"
     "The number of threads the library uses (default: the CPUs this process may use)."},
    {"_sdpa", (PyCFunction)(void (*)(void))sdpa_py, METH_VARARGS | METH_KEYWORDS,
     "_sdpa(q, k, v, *, masks=(), is_causal=False, scale=None, dropout=0.0, seed=0, "
     "counter=0, need_weights=False, zero_rows=False, reference=False, window=None, layout=None, "
     "head_mask=None)\n--\n\n"
     "Attention on projected heads (see _core_sdpa.c): (out, weights | None)."},
    {"_sdpa_backward", (PyCFunction)(void (*)(void))sdpa_backward_py,
     METH_VARARGS | METH_KEYWORDS,
     "_sdpa_backward(q, k, v, grad_output, *, masks=(), is_causal=False, scale=None, "
     "dropout=0.0, seed=0, counter=0, zero_rows=False, grad_weights=None, "
     "reference=False, window=None, layout=None, head_mask=None, scores_grad=False)\n--\n\n"
     "The gradients of one _sdpa call: (grad_q, grad_k, grad_v[, grad_scores])."},
    {NULL}
};

static int module_exec(PyObject *m)
{
    module_state *state = (module_state *)PyModule_GetState(m);
    if (PyArray_ImportNumPyAPI() < 0) return -1;
    if (lock_setup() < 0) return -1;
    state->mha_type = (PyTypeObject *)PyType_FromModuleAndSpec(m, &mha_spec, NULL);
    if (!state->mha_type) return -1;
    if (PyModule_AddObjectRef(m, "MultiHeadAttention", (PyObject *)state->mha_type) < 0)
        return -1;
    state->edit_type = (PyTypeObject *)PyType_FromModuleAndSpec(m, &edit_spec, NULL);
    if (!state->edit_type) return -1;
    if (PyModule_AddObjectRef(m, "_Editing", (PyObject *)state->edit_type) < 0) return -1;
    state->holding_type = (PyTypeObject *)PyType_FromModuleAndSpec(m, &holding_spec, NULL);
    if (!state->holding_type) return -1;
    if (PyModule_AddObjectRef(m, "_Holding", (PyObject *)state->holding_type) < 0) return -1;
    {
        PyObject *guarded = PyType_FromModuleAndSpec(m, &guarded_spec, NULL);
        int rc = guarded ? PyModule_AddObjectRef(m, "_Guarded", guarded) : -1;
        Py_XDECREF(guarded);
        if (rc < 0) return -1;
    }
    return 0;
}

static int module_traverse(PyObject *m, visitproc visit, void *arg)
{
    module_state *state = (module_state *)PyModule_GetState(m);
    Py_VISIT(state->mha_type);
    Py_VISIT(state->edit_type);
    Py_VISIT(state->holding_type);
    return 0;
}

static int module_clear(PyObject *m)
{
    module_state *state = (module_state *)PyModule_GetState(m);
    Py_CLEAR(state->mha_type);
    Py_CLEAR(state->edit_type);
    Py_CLEAR(state->holding_type);
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
