/* _core_parse.c: a call's arrays and call_parse: the arguments checked and
 * converted (to arrays of the module's dtype, C-contiguous) before anything
 * large is allocated, and call_clear.  Every error names the argument and
 * what was expected. */
#include "_core.h"

#include <math.h>
#include <string.h>

/* ------------------------------------------------------------ arrays */

/* str(arr.shape), for error messages (also _core_masks.c) */
PyObject *shape_str(PyArrayObject *arr)
{
    PyObject *s = PyObject_GetAttrString((PyObject *)arr, "shape");
    PyObject *r;
    if (!s) return NULL;
    r = PyObject_Str(s);
    Py_DECREF(s);
    return r;
}

/* `obj` as an array of real numbers (bool, int or float; no copy for an
 * ndarray): checked before anything is converted or allocated. */
static PyArrayObject *real_array(PyObject *obj, const char *name)
{
    PyArrayObject *arr;
    if (obj == NULL || obj == Py_None) {
        PyErr_Format(PyExc_TypeError, "%s must be an array, not None", name);
        return NULL;
    }
    if (!(arr = (PyArrayObject *)PyArray_FROM_O(obj))) return NULL;
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

/* *arr replaced by a C-contiguous, aligned, native array of the module's
 * dtype (itself when it already is one). */
static int to_module_dtype(MHAObject *self, PyArrayObject **arr)
{
    PyArrayObject *conv = (PyArrayObject *)PyArray_FROM_OTF(
        (PyObject *)*arr, typenum_of(self), NPY_ARRAY_IN_ARRAY | NPY_ARRAY_FORCECAST);
    if (!conv) return -1;
    Py_SETREF(*arr, conv);
    return 0;
}

/* real_array, then to_module_dtype. */
static PyArrayObject *input_array(MHAObject *self, PyObject *obj, const char *name)
{
    PyArrayObject *arr = real_array(obj, name);
    if (arr && to_module_dtype(self, &arr) < 0) Py_CLEAR(arr);
    return arr;
}

/* arr has exactly the shape want[0 .. nd); else a ValueError naming it. */
static int check_shape(PyArrayObject *arr, const char *name, int nd, const int64_t *want,
                       const char *what)
{
    PyObject *s;
    int d, ok = PyArray_NDIM(arr) == nd;
    for (d = 0; ok && d < nd; d++) ok = (int64_t)PyArray_DIM(arr, d) == want[d];
    if (ok) return 0;
    if (!(s = shape_str(arr))) return -1;
    if (nd == 4)
        PyErr_Format(PyExc_ValueError, "%s must have %s (%lld, %lld, %lld, %lld), got %U",
                     name, what, (long long)want[0], (long long)want[1], (long long)want[2],
                     (long long)want[3], s);
    else if (nd == 3)
        PyErr_Format(PyExc_ValueError, "%s must have %s (%lld, %lld, %lld), got %U", name,
                     what, (long long)want[0], (long long)want[1], (long long)want[2], s);
    else if (nd == 2)
        PyErr_Format(PyExc_ValueError, "%s must have %s (%lld, %lld), got %U", name, what,
                     (long long)want[0], (long long)want[1], s);
    else
        PyErr_Format(PyExc_ValueError, "%s must have %s (%lld,), got %U", name, what,
                     (long long)want[0], s);
    Py_DECREF(s);
    return -1;
}

/* query (B, Sq, E), key (B, Sk, kdim), value (B, Sk, vdim). */
static int check_inputs(MHAObject *self, struct call *c)
{
    static const char *names[3] = {"query", "key", "value"};
    static const char *wants[3] = {"(batch, seq, d_model)", "(batch, seq, kdim)",
                                   "(batch, seq, vdim)"};
    PyArrayObject *in[3] = {c->query, c->key, c->value};
    const int64_t E = self->cfg.d_model;
    npy_intp *qs, *ks, *vs;
    const char *bad = NULL;
    char want[200];
    PyArrayObject *got = NULL;
    int i;
    for (i = 0; i < 3; i++) {
        if (PyArray_NDIM(in[i]) != 3) {
            PyObject *s = shape_str(in[i]);
            if (s) {
                PyErr_Format(PyExc_ValueError,
                             "%s must be 3-D %s (or 2-D unbatched), got shape %U",
                             names[i], wants[i], s);
                Py_DECREF(s);
            }
            return -1;
        }
    }
    qs = PyArray_DIMS(c->query);
    ks = PyArray_DIMS(c->key);
    vs = PyArray_DIMS(c->value);
    if (qs[2] != E) {
        bad = "query"; got = c->query;
        snprintf(want, sizeof want, "(batch, seq, %lld) with d_model = %lld last",
                 (long long)E, (long long)E);
    } else if (ks[0] != qs[0] || ks[2] != self->cfg.kdim) {
        bad = "key"; got = c->key;
        snprintf(want, sizeof want, "(%lld, Sk, %lld): query's batch and kdim = %lld",
                 (long long)qs[0], (long long)self->cfg.kdim, (long long)self->cfg.kdim);
    } else if (vs[0] != qs[0] || vs[1] != ks[1] || vs[2] != self->cfg.vdim) {
        bad = "value"; got = c->value;
        snprintf(want, sizeof want,
                 "(%lld, %lld, %lld): query's batch, key's length and vdim = %lld",
                 (long long)qs[0], (long long)ks[1], (long long)self->cfg.vdim,
                 (long long)self->cfg.vdim);
    }
    if (bad) {
        PyObject *s = shape_str(got), *qsh = shape_str(c->query), *ksh = shape_str(c->key);
        if (s && qsh && ksh)
            PyErr_Format(PyExc_ValueError, "%s must have shape %s, got %U (query %U, key %U)",
                         bad, want, s, qsh, ksh);
        Py_XDECREF(s);
        Py_XDECREF(qsh);
        Py_XDECREF(ksh);
        return -1;
    }
    return 0;
}

/* ------------------------------------------------------------ the call */

/* Everything the call will allocate (inputs in the module's dtype, outputs,
 * the core's workspace: Q and the context (B, Sq, E), K and V (B, Sk, E),
 * what the training calls keep or return); more than the machine's memory
 * could never succeed: a MemoryError before anything large is allocated. */
static int check_memory(MHAObject *self, struct call *c)
{
    const mha_forward_args *a = &c->ba.fwd;
    const int64_t E = self->cfg.d_model, H = self->cfg.n_heads;
    const int64_t Skx = a->Sk + mha_extra_keys(&self->cfg); /* with the extra keys */
    size_t es = mha_dtype_size(self->cfg.dtype);
    /* B*Sq, B*Sk and B*H*Sq are below products mha_check_sizes checked */
    int64_t need = 0, n_q, n_k, n_v, n_kv, n_w, n_p;
    int weights = c->op == CALL_BACKWARD ? c->grad_weights != NULL || c->saved[4] != NULL
                                         : c->need_weights;
    int over = __builtin_mul_overflow(a->B * a->Sq, E, &n_q) ||
               __builtin_mul_overflow(a->B * a->Sk, self->cfg.kdim, &n_k) ||
               __builtin_mul_overflow(a->B * a->Sk, self->cfg.vdim, &n_v) ||
               __builtin_mul_overflow(a->B * Skx, E, &n_kv) ||
               __builtin_mul_overflow(a->B * H * a->Sq, Skx, &n_p) || /* per head: P */
               __builtin_mul_overflow(a->B * (a->average_weights ? 1 : H) * a->Sq, Skx, &n_w) ||
               add_bytes(&need, n_q, es) || add_bytes(&need, n_k, es) ||
               add_bytes(&need, n_v, es) || add_bytes(&need, n_q, 3 * es) ||
               add_bytes(&need, n_kv, 2 * es) || (weights && add_bytes(&need, n_w, es)) ||
               (c->scores_grad && add_bytes(&need, n_p, es));
    if (!over && c->op == CALL_FORWARD_TRAIN)
        over = (c->save && (add_bytes(&need, n_q, 2 * es) || add_bytes(&need, n_kv, 2 * es))) ||
               (c->save && c->save_p && add_bytes(&need, n_p, es)) ||
               add_bytes(&need, n_q, es) || add_bytes(&need, n_k, es) ||
               add_bytes(&need, n_v, es) || (!c->params && add_bytes(&need, self->total, es));
    if (!over && c->op == CALL_BACKWARD) /* the four gradients */
        over = add_bytes(&need, self->total, es) || add_bytes(&need, n_q, es) ||
               add_bytes(&need, n_k, es) || add_bytes(&need, n_v, es);
    if (over || need > physical_bytes()) {
        PyErr_Format(PyExc_MemoryError,
                     "%s: query, key and value of batch %lld, lengths %lld and %lld need %s%lld "
                     "bytes%s, more than this machine's %lld bytes of memory", c->name,
                     (long long)a->B, (long long)a->Sq, (long long)a->Sk, over ? "over " : "",
                     (long long)(over ? INT64_MAX : need),
                     weights ? " with the (B, H, Sq, Sk) weights" : "",
                     (long long)physical_bytes());
        return -1;
    }
    return 0;
}

/* saved = (Q, K, V, ctx, P | None) of _forward_train(save=True). */
static int parse_saved(MHAObject *self, PyObject *obj, struct call *c)
{
    static const char *names[5] = {"saved Q", "saved K", "saved V", "saved ctx", "saved P"};
    const int64_t H = self->cfg.n_heads, Dk = self->cfg.d_model / H, E = self->cfg.d_model;
    const int64_t B = c->ba.fwd.B, Sq = c->ba.fwd.Sq, Hkv = mha_kv_heads(&self->cfg);
    const int64_t Sk = c->ba.fwd.Sk + mha_extra_keys(&self->cfg); /* K, V with their extra rows */
    const int64_t want[5][4] = {{B, H, Sq, Dk}, {B, Hkv, Dk, Sk}, {B, Hkv, Sk, Dk},
                                {B, Sq, E, 0}, {B, H, Sq, Sk}};
    Py_ssize_t n;
    int i;
    if (!PyTuple_Check(obj) || ((n = PyTuple_GET_SIZE(obj)) != 4 && n != 5)) {
        PyErr_SetString(PyExc_TypeError, "saved must be None or the (Q, K, V, ctx, P | None) "
                        "tuple of _forward_train(..., save=True)");
        return -1;
    }
    for (i = 0; i < n; i++) {
        PyObject *item = PyTuple_GET_ITEM(obj, i);
        if (i == 4 && item == Py_None) break;
        if (!(c->saved[i] = input_array(self, item, names[i]))) return -1;
        if (check_shape(c->saved[i], names[i], i == 3 ? 3 : 4, want[i], "shape") < 0) return -1;
    }
    c->sv.q = PyArray_DATA(c->saved[0]);
    c->sv.k = PyArray_DATA(c->saved[1]);
    c->sv.v = PyArray_DATA(c->saved[2]);
    c->sv.ctx = PyArray_DATA(c->saved[3]);
    c->sv.p = c->saved[4] ? PyArray_DATA(c->saved[4]) : NULL;
    c->have_saved = 1;
    return 0;
}

/* params = a tuple of MHA_NPARAM arrays in the block's order, None where
 * the layout has no tensor: each converted to the module's dtype (no copy
 * when it already is, C-contiguous) and of that tensor's shape: a weight
 * (out, in), a bias (out,), bias_k and bias_v (Ekv,). */
static int parse_parts(MHAObject *self, PyObject *obj, struct call *c)
{
    const mha_config *cfg = &self->cfg;
    const int64_t E = cfg->d_model, Ekv = mha_kv_heads(cfg) * (E / cfg->n_heads);
    const int64_t out[4] = {E, Ekv, Ekv, E}, in[4] = {E, cfg->kdim, cfg->vdim, E};
    static const char *names[MHA_NPARAM] = {"W_q.weight", "W_q.bias", "W_k.weight", "W_k.bias",
                                            "W_v.weight", "W_v.bias", "W_o.weight", "W_o.bias",
                                            "bias_k", "bias_v"};
    char name[32];
    Py_ssize_t i;
    if (PyTuple_GET_SIZE(obj) != MHA_NPARAM) {
        PyErr_Format(PyExc_ValueError, "params as a tuple must hold %d arrays (the block's "
                     "order), got %zd", MHA_NPARAM, PyTuple_GET_SIZE(obj));
        return -1;
    }
    for (i = 0; i < MHA_NPARAM; i++) {
        PyObject *item = PyTuple_GET_ITEM(obj, i);
        if (self->size[i] == 0) {
            if (item != Py_None) {
                PyErr_Format(PyExc_ValueError, "params[%zd] (%s) must be None: this module "
                             "has no such tensor", i, names[i]);
                return -1;
            }
            continue;
        }
        PyOS_snprintf(name, sizeof name, "params[%d] (%s)", (int)i, names[i]);
        if (!(c->parts[i] = input_array(self, item, name))) return -1;
        {
            const int weight = i < 8 && i % 2 == 0;
            const int64_t want[2] = {i < 8 ? out[i / 2] : Ekv, weight ? in[i / 2] : 0};
            if (check_shape(c->parts[i], name, weight ? 2 : 1, want, "the shape") < 0)
                return -1;
        }
    }
    return 0;
}

/* cache = (K, V, length): the module's dtype, C-contiguous, writeable
 * arrays K (B, Hkv, Dk, cap) and V (B, Hkv, cap, Dk) (cap > 0) taken as
 * they are (never copied: the call writes into them), and 0 <= length with
 * length + Sk <= cap.  Sets the call's cache fields. */
static int parse_cache(MHAObject *self, PyObject *obj, struct call *c)
{
    static const char *names[2] = {"the cache's K", "the cache's V"};
    mha_forward_args *a = &c->ba.fwd;
    const int64_t Hkv = mha_kv_heads(&self->cfg), Dk = self->cfg.d_model / self->cfg.n_heads;
    long long len;
    int64_t cap;
    int i;
    if (!PyTuple_Check(obj) || PyTuple_GET_SIZE(obj) != 3) {
        PyErr_SetString(PyExc_TypeError, "cache must be None or a (K, V, length) tuple");
        return -1;
    }
    if (c->op != CALL_FORWARD || c->reference) {
        PyErr_SetString(PyExc_ValueError, "a cache is for the plain forward call only");
        return -1;
    }
    if (mha_extra_keys(&self->cfg) != 0) {
        PyErr_SetString(PyExc_ValueError, "a cache cannot be used with add_bias_kv or "
                        "add_zero_attn (their extra keys would sit inside the cached ones)");
        return -1;
    }
    for (i = 0; i < 2; i++) {
        PyObject *x = PyTuple_GET_ITEM(obj, i);
        PyArrayObject *arr;
        if (!PyArray_Check(x) || PyArray_TYPE((PyArrayObject *)x) != typenum_of(self) ||
            !PyArray_ISNOTSWAPPED((PyArrayObject *)x) || /* '>f8' is float64's number too */
            !PyArray_IS_C_CONTIGUOUS((PyArrayObject *)x) ||
            !PyArray_ISWRITEABLE((PyArrayObject *)x) || !PyArray_ISALIGNED((PyArrayObject *)x) ||
            PyArray_NDIM((PyArrayObject *)x) != 4) {
            PyErr_Format(PyExc_ValueError, "%s must be a writeable C-contiguous 4-D array of "
                         "the module's dtype in native byte order", names[i]);
            return -1;
        }
        arr = (PyArrayObject *)x;
        cap = (int64_t)PyArray_DIM(arr, i == 0 ? 3 : 2);
        {
            const int64_t want[2][4] = {{a->B, Hkv, Dk, cap}, {a->B, Hkv, cap, Dk}};
            if (cap <= 0 || check_shape(arr, names[i], 4, want[i], "shape") < 0) {
                if (!PyErr_Occurred())
                    PyErr_Format(PyExc_ValueError, "%s must have a capacity > 0", names[i]);
                return -1;
            }
        }
        c->cache[i] = (PyArrayObject *)Py_NewRef(x);
    }
    if ((int64_t)PyArray_DIM(c->cache[0], 3) != (int64_t)PyArray_DIM(c->cache[1], 2)) {
        PyErr_SetString(PyExc_ValueError, "the cache's K and V must have the same capacity");
        return -1;
    }
    len = PyLong_AsLongLong(PyTuple_GET_ITEM(obj, 2));
    if (len == -1 && PyErr_Occurred()) return -1;
    if (len < 0 || len > cap || a->Sk > cap - (int64_t)len) {
        PyErr_Format(PyExc_ValueError, "the cache holds %lld of %lld keys: %lld more do not fit",
                     len, (long long)cap, (long long)a->Sk);
        return -1;
    }
    a->cache_k = PyArray_DATA(c->cache[0]);
    a->cache_v = PyArray_DATA(c->cache[1]);
    a->cache_cap = cap;
    a->cache_len = (int64_t)len;
    return 0;
}

#define FLAG(field, obj, name) ((obj) && parse_flag((obj), (name), &(field)) < 0)

int call_parse(MHAObject *self, call_op op, const call_objects *o, struct call *c)
{
    static const char *names[3] = {"forward", "forward_train", "backward"}; /* public */
    mha_forward_args *a = &c->ba.fwd;
    int is_causal = 0, zero_rows = 0, has_scale = 0;
    double scale = 0.0;
    double p = 0.0;
    uint64_t counter = 0;
    mha_status st;

    memset(c, 0, sizeof *c);
    c->self = self;
    c->op = op;
    c->name = names[op];
    c->need_weights = op != CALL_BACKWARD;
    c->save = op == CALL_FORWARD_TRAIN;
    if ((o->is_causal && parse_causal(o->is_causal, &is_causal) < 0) ||
        (o->scale && parse_scale(o->scale, &has_scale, &scale) < 0) ||
        FLAG(c->need_weights, o->need_weights, "need_weights") ||
        FLAG(zero_rows, o->zero_rows, "zero_rows") ||
        FLAG(c->reference, o->reference, "reference") || FLAG(c->save, o->save, "save") ||
        FLAG(c->save_p, o->save_p, "save_p") ||
        FLAG(a->average_weights, o->average_weights, "average_weights") ||
        FLAG(c->scores_grad, o->scores_grad, "scores_grad"))
        return -1;
    if (parse_window(o->window, &a->has_window, &a->window_left, &a->window_right) < 0)
        return -1;
    if (o->dropout && parse_dropout(o->dropout, "dropout", &p) < 0) return -1;
    if (o->counter && parse_u64(o->counter, "counter", &counter) < 0) return -1;

    if (o->params && PyTuple_Check(o->params)) {
        if (parse_parts(self, o->params, c) < 0) goto fail;
    } else if (o->params && o->params != Py_None) {
        const int64_t want[1] = {self->total};
        if (!(c->params = input_array(self, o->params, "params"))) goto fail;
        if (check_shape(c->params, "params", 1, want, "the parameter block's shape") < 0)
            goto fail;
    }
    /* query, key and value unconverted until the sizes are checked */
    if (!(c->query = real_array(o->query, "query"))) goto fail;
    if (!(c->key = real_array(o->key, "key"))) goto fail;
    if (!(c->value = real_array(o->value, "value"))) goto fail;
    if (check_inputs(self, c) < 0) goto fail;
    a->B = PyArray_DIM(c->query, 0);
    a->Sq = PyArray_DIM(c->query, 1);
    a->Sk = PyArray_DIM(c->key, 1);
    /* sizes first: a shape too large is a MemoryError before any allocation */
    st = mha_check_sizes(&self->cfg, a->B, a->Sq, a->Sk);
    if (st != MHA_OK) {
        PyErr_Format(PyExc_MemoryError,
                     "query, key and value of batch %lld, lengths %lld and %lld are too large "
                     "to allocate (%s)", (long long)a->B, (long long)a->Sq, (long long)a->Sk,
                     mha_status_str(st));
        goto fail;
    }
    if (op == CALL_BACKWARD) {
        const int64_t od[3] = {a->B, a->Sq, self->cfg.d_model};
        const int64_t wd[4] = {a->B, self->cfg.n_heads, a->Sq,
                               a->Sk + mha_extra_keys(&self->cfg)};
        if (!(c->grad_output = input_array(self, o->grad_output, "grad_output")) ||
            check_shape(c->grad_output, "grad_output", 3, od, "the output's shape") < 0)
            goto fail;
        if (o->grad_weights && o->grad_weights != Py_None &&
            (!(c->grad_weights = input_array(self, o->grad_weights, "grad_weights")) ||
             check_shape(c->grad_weights, "grad_weights", 4, wd, "the weights' shape") < 0))
            goto fail;
        if (o->saved && o->saved != Py_None && parse_saved(self, o->saved, c) < 0) goto fail;
    }
    if (o->cache && o->cache != Py_None && parse_cache(self, o->cache, c) < 0) goto fail;
    if (check_memory(self, c) < 0) goto fail;
    if (to_module_dtype(self, &c->query) < 0) goto fail;
    if (o->key == o->query) /* self-attention: convert once */
        Py_SETREF(c->key, (PyArrayObject *)Py_NewRef(c->query));
    else if (to_module_dtype(self, &c->key) < 0)
        goto fail;
    if (o->value == o->key)
        Py_SETREF(c->value, (PyArrayObject *)Py_NewRef(c->key));
    else if (to_module_dtype(self, &c->value) < 0)
        goto fail;
    if (o->head_mask && o->head_mask != Py_None) { /* (B, H) finite, the module's dtype */
        const int64_t hd[2] = {a->B, self->cfg.n_heads};
        npy_intp i, n;
        if (!(c->head_mask = input_array(self, o->head_mask, "head_mask")) ||
            check_shape(c->head_mask, "head_mask", 2, hd, "the shape (batch, heads)") < 0)
            goto fail;
        n = PyArray_SIZE(c->head_mask);
        for (i = 0; i < n; i++) {
            double x = self->cfg.dtype == MHA_FLOAT64
                           ? ((const double *)PyArray_DATA(c->head_mask))[i]
                           : (double)((const float *)PyArray_DATA(c->head_mask))[i];
            if (!isfinite(x)) {
                PyErr_SetString(PyExc_ValueError, "head_mask must hold finite numbers");
                goto fail;
            }
        }
        a->head_mask = PyArray_DATA(c->head_mask);
        a->head_mask_stride[0] = self->cfg.n_heads;
        a->head_mask_stride[1] = 1;
    }
    {
        const int64_t dim[4] = {a->B, self->cfg.n_heads, a->Sq, a->cache_len + a->Sk};
        if (o->masks && convert_masks(o->masks, typenum_of(self), dim, c->masks, c->mask_arr,
                                      &a->n_masks) < 0)
            goto fail;
        if (parse_layout(o->layout, dim, &a->layout, &c->layout) < 0) goto fail;
    }
    a->query = PyArray_DATA(c->query);
    a->key = PyArray_DATA(c->key);
    a->value = PyArray_DATA(c->value);
    a->masks = c->masks;
    a->is_causal = is_causal;
    a->has_scale = has_scale;
    a->scale = scale;
    a->zero_masked_rows = zero_rows;
    a->seed = self->seed;
    if (op == CALL_FORWARD) {
        /* the module's own dropout: one stream per call (under the GIL) */
        if (self->training && self->dropout > 0.0) {
            a->dropout = self->dropout;
            a->counter = self->counter++;
        }
    } else {
        a->dropout = p;
        a->counter = counter;
    }
    if (c->parts[MHA_WQ]) { /* given as a tuple (W_q is never empty) */
        const void *t[MHA_NPARAM];
        int i;
        for (i = 0; i < MHA_NPARAM; i++) t[i] = c->parts[i] ? PyArray_DATA(c->parts[i]) : NULL;
        mha_params_from_tensors(t, &c->p);
    } else {
        mha_params_from_block(&self->cfg, c->params ? PyArray_DATA(c->params) : self->block,
                              &c->p);
    }
    return 0;
fail:
    call_clear(c);
    return -1;
}

void call_clear(struct call *c)
{
    int i;
    Py_CLEAR(c->params);
    for (i = 0; i < MHA_NPARAM; i++) Py_CLEAR(c->parts[i]);
    Py_CLEAR(c->query);
    Py_CLEAR(c->key);
    Py_CLEAR(c->value);
    Py_CLEAR(c->grad_output);
    Py_CLEAR(c->grad_weights);
    Py_CLEAR(c->head_mask);
    Py_CLEAR(c->layout);
    for (i = 0; i < 5; i++) Py_CLEAR(c->saved[i]);
    Py_CLEAR(c->cache[0]);
    Py_CLEAR(c->cache[1]);
    for (i = 0; i < MHA_MAX_MASKS; i++) Py_CLEAR(c->mask_arr[i]);
}
