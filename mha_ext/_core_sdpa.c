/* _core_sdpa.c: the module functions on projected heads, the C side of
 * mha_ext.scaled_dot_product_attention (keyword arguments; one result shape
 * each):
 *
 *   _sdpa(q, k, v, *, masks=(), is_causal=False, scale=None, dropout=0.0,
 *         seed=0, counter=0, need_weights=False, zero_rows=False,
 *         reference=False, window=None, layout=None, head_mask=None)
 *       -> (out (B, H, L, Dv), weights (B, H, L, S) | None)
 *   _sdpa_backward(q, k, v, grad_output, *, masks=(), is_causal=False,
 *                  scale=None, dropout=0.0, seed=0, counter=0,
 *                  zero_rows=False, grad_weights=None, reference=False,
 *                  window=None, layout=None, head_mask=None, scores_grad=False)
 *       -> (grad_q, grad_k, grad_v[, grad_scores])
 *       the gradients of the _sdpa call with the same arguments; with
 *       scores_grad, also dL/d (q·kᵀ·scale + masks) (B, H, L, S): an
 *       additive mask's gradient before its broadcast is summed.
 *
 * q (B, H, L, D), k (B, Hkv, S, D), v (B, Hkv, S, Dv) with H % Hkv == 0
 * (query head h reads key/value head h // (H // Hkv)); the dtype is q's
 * when float64, else float32, and k, v, masks and gradients are converted
 * to it.  masks: (kind, array) pairs as for _forward, broadcast onto
 * (B, H, L, S); is_causal False, True (top-left) or "lower_right"; scale
 * None (1/sqrt(D)) or a real number; dropout p with the stream (seed,
 * counter).  window: None or (left, right); layout: None or (keep (1|B,
 * 1|H, nqb, nkb) bool/uint8, nonzero = kept, q_block, k_block); head_mask:
 * None or (B, H) finite factors of each head's weights after dropout.
 * reference: the core's plain reference instead.  No module, no
 * lock: the call releases the GIL around the core, which polls for signals
 * on the main thread (Ctrl-C: KeyboardInterrupt). */
#include "_core.h"

#include <math.h>
#include <string.h>

typedef struct {
    mha_sdpa_backward_args ba; /* ba.fwd: the forward call */
    PyArrayObject *q, *k, *v, *grad_output, *grad_weights;
    PyArrayObject *layout;     /* the block layout's kept flags, or NULL */
    PyArrayObject *head_mask;  /* (B, H) of typenum, or NULL */
    PyArrayObject *mask_arr[MHA_MAX_MASKS];
    mha_mask masks[MHA_MAX_MASKS];
    int typenum, need_weights, reference;
} sdpa_call;

static void sdpa_clear(sdpa_call *c)
{
    int i;
    Py_CLEAR(c->q);
    Py_CLEAR(c->k);
    Py_CLEAR(c->v);
    Py_CLEAR(c->grad_output);
    Py_CLEAR(c->grad_weights);
    Py_CLEAR(c->layout);
    Py_CLEAR(c->head_mask);
    for (i = 0; i < MHA_MAX_MASKS; i++) Py_CLEAR(c->mask_arr[i]);
}

/* obj as a C-contiguous 4-D array of c->typenum */
static PyArrayObject *array4(sdpa_call *c, PyObject *obj, const char *name, const char *want)
{
    PyArrayObject *arr;
    if (obj == Py_None) {
        PyErr_Format(PyExc_TypeError, "%s must be an array, not None", name);
        return NULL;
    }
    arr = (PyArrayObject *)PyArray_FROM_OTF(obj, c->typenum,
                                            NPY_ARRAY_IN_ARRAY | NPY_ARRAY_FORCECAST);
    if (arr && PyArray_NDIM(arr) != 4) {
        PyErr_Format(PyExc_ValueError, "%s must be 4-D %s, got %d dimensions", name, want,
                     PyArray_NDIM(arr));
        Py_CLEAR(arr);
    }
    return arr;
}

static int same_dims(PyArrayObject *arr, const int64_t *want)
{
    int d;
    for (d = 0; d < 4; d++)
        if ((int64_t)PyArray_DIM(arr, d) != want[d]) return 0;
    return 1;
}

/* The arguments common to both functions into c (and c->ba.fwd). */
static int sdpa_parse(sdpa_call *c, PyObject *q, PyObject *k, PyObject *v, PyObject *masks,
                      PyObject *is_causal, PyObject *scale, PyObject *dropout, PyObject *seed,
                      PyObject *counter, PyObject *zero_rows, PyObject *reference,
                      PyObject *layout, PyObject *head_mask)
{
    mha_sdpa_args *a = &c->ba.fwd;
    PyArrayObject *q0;
    int64_t need = 0;
    size_t es;
    if (!(q0 = (PyArrayObject *)PyArray_FROM_O(q))) return -1;
    c->typenum = PyArray_TYPE(q0) == NPY_FLOAT64 ? NPY_FLOAT64 : NPY_FLOAT32;
    Py_DECREF(q0);
    a->dtype = c->typenum == NPY_FLOAT64 ? MHA_FLOAT64 : MHA_FLOAT32;
    es = mha_dtype_size(a->dtype);
    if ((is_causal && parse_causal(is_causal, &a->is_causal) < 0) ||
        (scale && parse_scale(scale, &a->has_scale, &a->scale) < 0) ||
        (dropout && parse_dropout(dropout, "dropout", &a->dropout) < 0) ||
        (seed && parse_u64(seed, "seed", &a->seed) < 0) ||
        (counter && parse_u64(counter, "counter", &a->counter) < 0) ||
        (zero_rows && parse_flag(zero_rows, "zero_rows", &a->zero_masked_rows) < 0) ||
        (reference && parse_flag(reference, "reference", &c->reference) < 0))
        return -1;
    if (!(c->q = array4(c, q, "q", "(B, H, L, D)")) ||
        !(c->k = array4(c, k, "k", "(B, Hkv, S, D)")) ||
        !(c->v = array4(c, v, "v", "(B, Hkv, S, Dv)")))
        return -1;
    a->B = PyArray_DIM(c->q, 0);
    a->H = PyArray_DIM(c->q, 1);
    a->L = PyArray_DIM(c->q, 2);
    a->D = PyArray_DIM(c->q, 3);
    a->Hkv = PyArray_DIM(c->k, 1);
    a->S = PyArray_DIM(c->k, 2);
    a->Dv = PyArray_DIM(c->v, 3);
    {
        const int64_t kd[4] = {a->B, a->Hkv, a->S, a->D}, vd[4] = {a->B, a->Hkv, a->S, a->Dv};
        if (!same_dims(c->k, kd) || !same_dims(c->v, vd) || a->H == 0 || a->Hkv == 0 ||
            a->H % a->Hkv != 0 || a->D == 0 || a->Dv == 0) {
            PyErr_Format(PyExc_ValueError,
                         "q (B, H, L, D), k (B, Hkv, S, D) and v (B, Hkv, S, Dv) must agree, "
                         "with H a multiple of Hkv and D, Dv > 0; got q (%lld, %lld, %lld, %lld), "
                         "k (%lld, %lld, %lld, %lld), v (%lld, %lld, %lld, %lld)",
                         (long long)a->B, (long long)a->H, (long long)a->L, (long long)a->D,
                         (long long)PyArray_DIM(c->k, 0), (long long)PyArray_DIM(c->k, 1),
                         (long long)PyArray_DIM(c->k, 2), (long long)PyArray_DIM(c->k, 3),
                         (long long)PyArray_DIM(c->v, 0), (long long)PyArray_DIM(c->v, 1),
                         (long long)PyArray_DIM(c->v, 2), (long long)PyArray_DIM(c->v, 3));
            return -1;
        }
    }
    /* q, k, v, out, the weights when asked for (c->need_weights, parsed
     * before), and the core's K transposed: more than the machine has could
     * never succeed */
    {
        int64_t bhl, bks, n_q, n_k, n_v, n_o, n_w;
        int over = __builtin_mul_overflow(a->B, a->H, &bhl) ||
                   __builtin_mul_overflow(bhl, a->L, &bhl) ||
                   __builtin_mul_overflow(bhl, a->D, &n_q) ||
                   __builtin_mul_overflow(bhl, a->Dv, &n_o) ||
                   __builtin_mul_overflow(bhl, a->S, &n_w) ||
                   __builtin_mul_overflow(a->B * a->Hkv, a->S, &bks) || /* <= k's size */
                   __builtin_mul_overflow(bks, a->D, &n_k) ||
                   __builtin_mul_overflow(bks, a->Dv, &n_v) || add_bytes(&need, n_q, es) ||
                   add_bytes(&need, n_k, 2 * es) || add_bytes(&need, n_v, es) ||
                   add_bytes(&need, n_o, es) ||
                   (c->need_weights && add_bytes(&need, n_w, es));
        if (over || need > physical_bytes()) {
            PyErr_Format(PyExc_MemoryError,
                         "scaled_dot_product_attention: q (%lld, %lld, %lld, %lld) against "
                         "%lld keys needs %s%lld bytes, more than this machine's %lld",
                         (long long)a->B, (long long)a->H, (long long)a->L, (long long)a->D,
                         (long long)a->S, over ? "over " : "", (long long)(over ? INT64_MAX : need),
                         (long long)physical_bytes());
            return -1;
        }
    }
    {
        const int64_t dim[4] = {a->B, a->H, a->L, a->S};
        if (masks && convert_masks(masks, c->typenum, dim, c->masks, c->mask_arr,
                                   &a->n_masks) < 0)
            return -1;
        if (parse_layout(layout, dim, &a->layout, &c->layout) < 0) return -1;
    }
    if (head_mask && head_mask != Py_None) { /* (B, H), finite */
        npy_intp i, n;
        c->head_mask = (PyArrayObject *)PyArray_FROM_OTF(head_mask, c->typenum,
                                                         NPY_ARRAY_IN_ARRAY | NPY_ARRAY_FORCECAST);
        if (!c->head_mask) return -1;
        if (PyArray_NDIM(c->head_mask) != 2 || PyArray_DIM(c->head_mask, 0) != a->B ||
            PyArray_DIM(c->head_mask, 1) != a->H) {
            PyErr_Format(PyExc_ValueError, "head_mask must have the shape (B, H) = (%lld, %lld)",
                         (long long)a->B, (long long)a->H);
            return -1;
        }
        n = PyArray_SIZE(c->head_mask);
        for (i = 0; i < n; i++) {
            double x = c->typenum == NPY_FLOAT64
                           ? ((const double *)PyArray_DATA(c->head_mask))[i]
                           : (double)((const float *)PyArray_DATA(c->head_mask))[i];
            if (!isfinite(x)) {
                PyErr_SetString(PyExc_ValueError, "head_mask must hold finite numbers");
                return -1;
            }
        }
        a->head_mask = PyArray_DATA(c->head_mask);
        a->head_mask_stride[0] = a->H;
        a->head_mask_stride[1] = 1;
    }
    a->masks = c->masks;
    a->q = PyArray_DATA(c->q);
    a->k = PyArray_DATA(c->k);
    a->v = PyArray_DATA(c->v);
    return 0;
}

/* The core call with the GIL released, polling for signals on the main
 * thread. */
static int sdpa_run(sdpa_call *c, int backward)
{
    signal_poll sp;
    mha_status st;
    if (on_main_thread()) {
        c->ba.fwd.poll = poll_signals;
        c->ba.fwd.poll_ctx = &sp;
    }
    sp.ts = PyEval_SaveThread();
    if (backward)
        st = c->reference ? mha_sdpa_backward_ref(&c->ba) : mha_sdpa_backward(&c->ba);
    else
        st = c->reference ? mha_sdpa_forward_ref(&c->ba.fwd) : mha_sdpa_forward(&c->ba.fwd);
    PyEval_RestoreThread(sp.ts);
    c->ba.fwd.poll = NULL;
    c->ba.fwd.poll_ctx = NULL;
    if (PyErr_Occurred()) return -1;
    if (st != MHA_OK) {
        set_status_error(st, backward ? "scaled_dot_product_attention backward"
                                      : "scaled_dot_product_attention");
        return -1;
    }
    return 0;
}

static PyArrayObject *new4(const sdpa_call *c, int64_t d0, int64_t d1, int64_t d2, int64_t d3)
{
    npy_intp d[4] = {(npy_intp)d0, (npy_intp)d1, (npy_intp)d2, (npy_intp)d3};
    return out_new_array(4, d, c->typenum, 0);
}

PyObject *sdpa_py(PyObject *m, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"q", "k", "v", "masks", "is_causal", "scale", "dropout", "seed",
                             "counter", "need_weights", "zero_rows", "reference", "window",
                             "layout", "head_mask", NULL};
    PyObject *q, *k, *v, *masks = NULL, *causal = NULL, *scale = NULL, *p = NULL, *seed = NULL,
             *counter = NULL, *need = NULL, *zero = NULL, *ref = NULL, *win = NULL, *result = NULL,
             *lay = NULL, *hm = NULL;
    PyArrayObject *out = NULL, *w = NULL;
    sdpa_call c;
    mha_sdpa_args *a = &c.ba.fwd;
    (void)m;
    memset(&c, 0, sizeof c);
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOO|$OOOOOOOOOOOO:_sdpa", kwlist, &q, &k, &v,
                                     &masks, &causal, &scale, &p, &seed, &counter, &need, &zero,
                                     &ref, &win, &lay, &hm))
        return NULL;
    if ((need && parse_flag(need, "need_weights", &c.need_weights) < 0) ||
        parse_window(win, &a->has_window, &a->window_left, &a->window_right) < 0 ||
        sdpa_parse(&c, q, k, v, masks, causal, scale, p, seed, counter, zero, ref, lay, hm) < 0)
        goto fail;
    if (!(out = new4(&c, a->B, a->H, a->L, a->Dv))) goto fail;
    if (c.need_weights && !(w = new4(&c, a->B, a->H, a->L, a->S))) goto fail;
    a->out = PyArray_DATA(out);
    a->weights = w ? PyArray_DATA(w) : NULL;
    if (sdpa_run(&c, 0) < 0) goto fail;
    result = PyTuple_Pack(2, (PyObject *)out, w ? (PyObject *)w : Py_None);
fail:
    Py_XDECREF(out);
    Py_XDECREF(w);
    sdpa_clear(&c);
    return result;
}

PyObject *sdpa_backward_py(PyObject *m, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"q", "k", "v", "grad_output", "masks", "is_causal", "scale",
                             "dropout", "seed", "counter", "zero_rows", "grad_weights",
                             "reference", "window", "layout", "head_mask", "scores_grad", NULL};
    PyObject *q, *k, *v, *go, *win = NULL, *lay = NULL, *hm = NULL, *masks = NULL, *causal = NULL, *scale = NULL, *p = NULL,
             *seed = NULL, *counter = NULL, *zero = NULL, *gw = Py_None, *ref = NULL,
             *sg = NULL, *result = NULL;
    PyArrayObject *dq = NULL, *dk = NULL, *dv = NULL, *ds = NULL;
    sdpa_call c;
    mha_sdpa_args *a = &c.ba.fwd;
    int scores_grad = 0;
    (void)m;
    memset(&c, 0, sizeof c);
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOOO|$OOOOOOOOOOOOO:_sdpa_backward", kwlist, &q,
                                     &k, &v, &go, &masks, &causal, &scale, &p, &seed, &counter,
                                     &zero, &gw, &ref, &win, &lay, &hm, &sg))
        return NULL;
    if ((sg && parse_flag(sg, "scores_grad", &scores_grad) < 0) ||
        parse_window(win, &a->has_window, &a->window_left, &a->window_right) < 0 ||
        sdpa_parse(&c, q, k, v, masks, causal, scale, p, seed, counter, zero, ref, lay, hm) < 0)
        goto fail;
    {
        const int64_t od[4] = {a->B, a->H, a->L, a->Dv}, wd[4] = {a->B, a->H, a->L, a->S};
        if (!(c.grad_output = array4(&c, go, "grad_output", "(B, H, L, Dv)"))) goto fail;
        if (!same_dims(c.grad_output, od)) {
            PyErr_Format(PyExc_ValueError, "grad_output must have the output's shape (%lld, "
                         "%lld, %lld, %lld)", (long long)od[0], (long long)od[1],
                         (long long)od[2], (long long)od[3]);
            goto fail;
        }
        if (gw != Py_None) {
            if (!(c.grad_weights = array4(&c, gw, "grad_weights", "(B, H, L, S)"))) goto fail;
            if (!same_dims(c.grad_weights, wd)) {
                PyErr_Format(PyExc_ValueError, "grad_weights must have the weights' shape "
                             "(%lld, %lld, %lld, %lld)", (long long)wd[0], (long long)wd[1],
                             (long long)wd[2], (long long)wd[3]);
                goto fail;
            }
        }
    }
    if (!(dq = new4(&c, a->B, a->H, a->L, a->D)) || !(dk = new4(&c, a->B, a->Hkv, a->S, a->D)) ||
        !(dv = new4(&c, a->B, a->Hkv, a->S, a->Dv)) ||
        (scores_grad && !(ds = new4(&c, a->B, a->H, a->L, a->S))))
        goto fail;
    c.ba.grad_scores = ds ? PyArray_DATA(ds) : NULL;
    c.ba.grad_out = PyArray_DATA(c.grad_output);
    c.ba.grad_weights = c.grad_weights ? PyArray_DATA(c.grad_weights) : NULL;
    c.ba.grad_q = PyArray_DATA(dq);
    c.ba.grad_k = PyArray_DATA(dk);
    c.ba.grad_v = PyArray_DATA(dv);
    if (sdpa_run(&c, 1) < 0) goto fail;
    result = ds ? PyTuple_Pack(4, (PyObject *)dq, (PyObject *)dk, (PyObject *)dv, (PyObject *)ds)
                : PyTuple_Pack(3, (PyObject *)dq, (PyObject *)dk, (PyObject *)dv);
fail:
    Py_XDECREF(ds);
    Py_XDECREF(dq);
    Py_XDECREF(dk);
    Py_XDECREF(dv);
    sdpa_clear(&c);
    return result;
}
