/* _core_calls.c: call_run, and the three calls of the private protocol
 * (keyword arguments; each result's shape follows from them):
 *
 *   _forward(query, key, value, *, params=None, masks=(), is_causal=False,
 *            need_weights=True, zero_rows=False, reference=False, scale=None)
 *       -> (output, weights | None)
 *       The call behind MultiHeadAttention.__call__; dropout is the
 *       module's own (training and dropout > 0, one stream per call).
 *       params: None (the module's, under its lock), the flat block, or a
 *       tuple of MHA_NPARAM arrays in the block's order (None where the
 *       layout has no such tensor), each read in place when it is already
 *       C-contiguous in the module's dtype (the torch classes' parameters:
 *       no copy of them per call).
 *       reference: the plain reference core instead of the fast one.
 *       cache=(K, V, length): K (B, Hkv, Dk, cap), V (B, Hkv, cap, Dk)
 *       arrays the call writes its keys and values into, at [length,
 *       length + Sk), then attends over all length + Sk (masks and weights
 *       over those); the caller advances length (mha_ext._calls).
 *       average_weights=True: the weights are (B, Sq, Sk'), the mean over
 *       the heads (summed head by head in order, then divided by H:
 *       mha_ext._calls.head_mean's bits); see mha_forward_args.average_weights.
 *   _forward_train(query, key, value, *, params=None, masks=(),
 *                  is_causal=False, need_weights=True, zero_rows=False,
 *                  dropout=0.0, counter=0, save=True, save_p=False, scale=None)
 *       -> (output, weights | None, saved | None, copies)
 *       saved = (Q, K, V, ctx, P | None) for _backward (P with save_p),
 *       None without save; copies = (params | None, query, key, value),
 *       the forward's copies of its inputs (key or value the very array of
 *       an earlier one's copy when it was that input: self-attention copies
 *       once) and, when params is None or a tuple, of the parameters (the
 *       module's made under its lock).
 *   _backward(query, key, value, grad_output, *, params=None, masks=(),
 *             is_causal=False, zero_rows=False, dropout=0.0, counter=0,
 *             grad_weights=None, saved=None, scale=None, scores_grad=False)
 *       -> (grad_params, grad_query, grad_key, grad_value[, grad_scores])
 *       The gradients of the _forward_train call with the same arguments
 *       (saved: its saved tuple, or None to recompute); params as for
 *       _forward.  scores_grad=True adds dL/d masked scores (B, H, Sq, Sk'),
 *       the scores after the masks are added, before the softmax: an
 *       additive mask's gradient before its broadcast is summed.
 *
 * query (B, Sq, E), key (B, Sk, kdim), value (B, Sk, vdim); masks a
 * sequence of (kind, array) pairs, kind 0 blocking (nonzero = blocked) or
 * 1 additive, each broadcastable to (B, H, Sq, Sk); is_causal False, True
 * (top-left) or "lower_right"; scale None (1/sqrt(Dk)) or a real number.
 * With add_bias_kv / add_zero_attn the weights (and grad_weights, saved K,
 * V and P) have Sk' = Sk + extra keys (mha_extra_keys); params None (the
 * module's own parameters, read under its lock) or a 1-D block of
 * num_parameters scalars laid out as _layout() says, as is grad_params;
 * dropout p in [0, 1] with the stream `counter` of the module's seed. */
#include "_core.h"

/* Run c's core call with the GIL released: the only place that takes the
 * module's lock (not when this thread holds the write lock, nor for
 * explicit params).  On the main thread the core polls for signals, so
 * Ctrl-C stops a long call; a stop or any failed status is an exception. */
int call_run(struct call *c)
{
    MHAObject *self = c->self;
    read_ticket t = {0};
    signal_poll sp;
    mha_status st = MHA_OK;

    if (!c->params && !c->parts[MHA_WQ] && lock_read(&self->lock, &t) < 0) return -1;
    if (on_main_thread()) {
        c->ba.fwd.poll = poll_signals;
        c->ba.fwd.poll_ctx = &sp;
    }
    sp.ts = PyEval_SaveThread();
    switch (c->op) {
    case CALL_FORWARD:
        st = c->reference ? mha_forward_ref(&self->cfg, &c->p, &c->ba.fwd)
                          : mha_forward(&self->cfg, &c->p, &c->ba.fwd);
        break;
    case CALL_FORWARD_TRAIN:
        st = mha_forward_save(&self->cfg, &c->p, &c->ba.fwd, c->save ? &c->sv : NULL, &c->cp);
        break;
    case CALL_BACKWARD:
        st = mha_backward_saved(&self->cfg, &c->p, &c->ba, c->have_saved ? &c->sv : NULL);
        break;
    }
    lock_read_release(&self->lock, &t);
    PyEval_RestoreThread(sp.ts);
    c->ba.fwd.poll = NULL;
    c->ba.fwd.poll_ctx = NULL;
    if (PyErr_Occurred()) return -1; /* a signal handler raised */
    if (st != MHA_OK) {
        set_status_error(st, c->op == CALL_BACKWARD ? "backward" : "forward");
        return -1;
    }
    return 0;
}

/* A new array of the module's dtype; zeroed when `zero` (for buffers the
 * core leaves unwritten on empty shapes). */
static PyArrayObject *new_array(struct call *c, int nd, const int64_t *dims, int zero)
{
    npy_intp d[4];
    int i;
    for (i = 0; i < nd; i++) d[i] = (npy_intp)dims[i];
    return out_new_array(nd, d, typenum_of(c->self), zero);
}

static PyObject *obj_or_none(PyArrayObject *a)
{
    return a ? (PyObject *)a : Py_None;
}

PyObject *mha_forward_py(MHAObject *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"query", "key", "value", "params", "masks", "is_causal",
                             "need_weights", "zero_rows", "reference", "scale", "window",
                             "head_mask", "layout", "cache", "average_weights", NULL};
    call_objects o = {0};
    struct call c;
    PyArrayObject *out = NULL, *w = NULL;
    PyObject *result = NULL;

    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOO|$OOOOOOOOOOOO:_forward", kwlist, &o.query,
                                     &o.key, &o.value, &o.params, &o.masks, &o.is_causal,
                                     &o.need_weights,
                                     &o.zero_rows, &o.reference, &o.scale, &o.window,
                                     &o.head_mask, &o.layout, &o.cache, &o.average_weights))
        return NULL;
    if (call_parse(self, CALL_FORWARD, &o, &c) < 0) return NULL;
    {
        const int64_t B = c.ba.fwd.B, Sq = c.ba.fwd.Sq;
        /* every key: the cached ones, the given ones, the extra ones */
        const int64_t Skx = c.ba.fwd.cache_len + c.ba.fwd.Sk + mha_extra_keys(&self->cfg);
        const int64_t od[3] = {B, Sq, self->cfg.d_model}, wd[4] = {B, self->cfg.n_heads, Sq, Skx};
        const int64_t wa[3] = {B, Sq, Skx}; /* average_weights: the heads' mean */
        if (!(out = new_array(&c, 3, od, 0))) goto fail;
        if (c.need_weights && !(w = c.ba.fwd.average_weights ? new_array(&c, 3, wa, 0)
                                                             : new_array(&c, 4, wd, 0)))
            goto fail;
    }
    c.ba.fwd.out = PyArray_DATA(out);
    c.ba.fwd.weights = w ? PyArray_DATA(w) : NULL;
    if (call_run(&c) < 0) goto fail;
    result = PyTuple_Pack(2, (PyObject *)out, obj_or_none(w));
fail:
    Py_XDECREF(out);
    Py_XDECREF(w);
    call_clear(&c);
    return result;
}

PyObject *mha_forward_train_py(MHAObject *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"query", "key", "value", "params", "masks", "is_causal",
                             "need_weights", "zero_rows", "dropout", "counter", "save",
                             "save_p", "scale", "window", "head_mask", "layout",
                             "average_weights", NULL};
    call_objects o = {0};
    struct call c;
    PyArrayObject *out = NULL, *w = NULL, *kept[5] = {NULL}, *copies[4] = {NULL};
    PyObject *saved = NULL, *copied = NULL, *result = NULL;
    int i;

    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOO|$OOOOOOOOOOOOOO:_forward_train", kwlist,
                                     &o.query, &o.key, &o.value, &o.params, &o.masks,
                                     &o.is_causal, &o.need_weights, &o.zero_rows, &o.dropout,
                                     &o.counter, &o.save, &o.save_p, &o.scale, &o.window,
                                     &o.head_mask, &o.layout, &o.average_weights))
        return NULL;
    if (call_parse(self, CALL_FORWARD_TRAIN, &o, &c) < 0) return NULL;
    {
        const int64_t B = c.ba.fwd.B, Sq = c.ba.fwd.Sq;
        const int64_t Sk = c.ba.fwd.Sk + mha_extra_keys(&self->cfg); /* with the extra keys */
        const int64_t E = self->cfg.d_model, H = self->cfg.n_heads, Dk = E / H;
        const int64_t Hkv = mha_kv_heads(&self->cfg);
        const int64_t od[3] = {B, Sq, E}, wd[4] = {B, H, Sq, Sk}, wa[3] = {B, Sq, Sk};
        /* mha_forward_save's layouts: Q, K (transposed), V per head, ctx, P */
        const int64_t kd[5][4] = {{B, H, Sq, Dk}, {B, Hkv, Dk, Sk}, {B, Hkv, Sk, Dk},
                                  {B, Sq, E, 0}, {B, H, Sq, Sk}};
        const int64_t pd[1] = {self->total};
        const int n_kept = !c.save ? 0 : c.save_p ? 5 : 4;
        if (!(out = new_array(&c, 3, od, 0))) goto fail;
        if (c.need_weights && !(w = c.ba.fwd.average_weights ? new_array(&c, 3, wa, 0)
                                                             : new_array(&c, 4, wd, 0)))
            goto fail;
        /* zeroed only when B * Sq == 0 leaves K and V unwritten */
        for (i = 0; i < n_kept; i++)
            if (!(kept[i] = new_array(&c, i == 3 ? 3 : 4, kd[i], B * Sq == 0))) goto fail;
        /* the copies: every one is written by the forward; an input that is
         * an earlier one (self-attention: query is key is value) shares
         * that one's copy, made once */
        if (!c.params && !(copies[0] = new_array(&c, 1, pd, 0))) goto fail;
        for (i = 1; i < 4; i++) {
            PyArrayObject *in = i == 1 ? c.query : i == 2 ? c.key : c.value;
            const int64_t d[3] = {PyArray_DIM(in, 0), PyArray_DIM(in, 1), PyArray_DIM(in, 2)};
            const int same = i > 1 && in == c.query ? 1 : i == 3 && in == c.key ? 2 : 0;
            if (same) {
                Py_INCREF(copies[same]);
                copies[i] = copies[same];
            } else if (!(copies[i] = new_array(&c, 3, d, 0))) {
                goto fail;
            }
        }
    }
    c.ba.fwd.out = PyArray_DATA(out);
    c.ba.fwd.weights = w ? PyArray_DATA(w) : NULL;
    if (c.save) {
        c.sv.q = PyArray_DATA(kept[0]);
        c.sv.k = PyArray_DATA(kept[1]);
        c.sv.v = PyArray_DATA(kept[2]);
        c.sv.ctx = PyArray_DATA(kept[3]);
        c.sv.p = kept[4] ? PyArray_DATA(kept[4]) : NULL;
    }
    c.cp.params = copies[0] ? PyArray_DATA(copies[0]) : NULL;
    c.cp.query = PyArray_DATA(copies[1]);
    c.cp.key = copies[2] == copies[1] ? NULL : PyArray_DATA(copies[2]);
    c.cp.value = copies[3] == copies[1] || copies[3] == copies[2] ? NULL : PyArray_DATA(copies[3]);
    if (call_run(&c) < 0) goto fail;
    if (c.save && !(saved = PyTuple_Pack(5, (PyObject *)kept[0], (PyObject *)kept[1],
                                         (PyObject *)kept[2], (PyObject *)kept[3],
                                         obj_or_none(kept[4]))))
        goto fail;
    if (!(copied = PyTuple_Pack(4, obj_or_none(copies[0]), (PyObject *)copies[1],
                                (PyObject *)copies[2], (PyObject *)copies[3])))
        goto fail;
    result = PyTuple_Pack(4, (PyObject *)out, obj_or_none(w), saved ? saved : Py_None, copied);
fail:
    Py_XDECREF(out);
    Py_XDECREF(w);
    Py_XDECREF(saved);
    Py_XDECREF(copied);
    for (i = 0; i < 5; i++) Py_XDECREF(kept[i]);
    for (i = 0; i < 4; i++) Py_XDECREF(copies[i]);
    call_clear(&c);
    return result;
}

PyObject *mha_backward_py(MHAObject *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"query", "key", "value", "grad_output", "params", "masks",
                             "is_causal", "zero_rows", "dropout", "counter", "grad_weights",
                             "saved", "scale", "window", "head_mask", "layout", "scores_grad",
                             NULL};
    call_objects o = {0};
    struct call c;
    PyArrayObject *gp = NULL, *gq = NULL, *gk = NULL, *gv = NULL, *gs = NULL;
    PyObject *result = NULL;

    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOOO|$OOOOOOOOOOOOO:_backward", kwlist,
                                     &o.query, &o.key, &o.value, &o.grad_output, &o.params,
                                     &o.masks, &o.is_causal, &o.zero_rows, &o.dropout,
                                     &o.counter, &o.grad_weights, &o.saved, &o.scale, &o.window,
                                     &o.head_mask, &o.layout, &o.scores_grad))
        return NULL;
    if (call_parse(self, CALL_BACKWARD, &o, &c) < 0) return NULL;
    {
        const int64_t B = c.ba.fwd.B, Sq = c.ba.fwd.Sq, Sk = c.ba.fwd.Sk;
        const int64_t pd[1] = {self->total}, qd[3] = {B, Sq, self->cfg.d_model},
                      kd[3] = {B, Sk, self->cfg.kdim}, vd[3] = {B, Sk, self->cfg.vdim};
        if (!(gp = new_array(&c, 1, pd, 0)) || !(gq = new_array(&c, 3, qd, 0)) ||
            !(gk = new_array(&c, 3, kd, 0)) || !(gv = new_array(&c, 3, vd, 0)))
            goto fail;
        if (c.scores_grad) {
            const int64_t sd[4] = {B, self->cfg.n_heads, Sq, Sk + mha_extra_keys(&self->cfg)};
            if (!(gs = new_array(&c, 4, sd, 0))) goto fail;
            c.ba.grad_scores = PyArray_DATA(gs);
        }
    }
    c.ba.grad_out = PyArray_DATA(c.grad_output);
    c.ba.grad_weights = c.grad_weights ? PyArray_DATA(c.grad_weights) : NULL;
    c.ba.grad_params = PyArray_DATA(gp);
    c.ba.grad_query = PyArray_DATA(gq);
    c.ba.grad_key = PyArray_DATA(gk);
    c.ba.grad_value = PyArray_DATA(gv);
    if (call_run(&c) < 0) goto fail;
    result = gs ? PyTuple_Pack(5, (PyObject *)gp, (PyObject *)gq, (PyObject *)gk, (PyObject *)gv,
                               (PyObject *)gs)
                : PyTuple_Pack(4, (PyObject *)gp, (PyObject *)gq, (PyObject *)gk, (PyObject *)gv);
fail:
    Py_XDECREF(gs);
    Py_XDECREF(gp);
    Py_XDECREF(gq);
    Py_XDECREF(gk);
    Py_XDECREF(gv);
    call_clear(&c);
    return result;
}
