/* _core_holds.c: the holds a Python `with` block or `finally` takes and
 * gives back in one C call each, so that no Python code (an exception from
 * a signal handler, Ctrl-C) can run between a hold and the block that
 * releases it: the parameters' write lock (_write_lock / _write_unlock,
 * editing()'s context manager _Editing), the read lock of a snapshot of
 * them (_snapshot) and a KVCache's hold (_Holding). */
#include "_core.h"

/* _write_lock() -> token / _write_unlock(token=None): the parameters' write
 * lock (editing() takes it through _Editing, below).  In between, in-place
 * writes into the parameter views are atomic for calls from other threads:
 * they wait, then see all new values.  The holder is a thread (its holds
 * nest, and it may call the module meanwhile); the token names that hold,
 * so that any thread may end it.  Without a token, the calling thread's
 * own hold is released. */
PyObject *mha_write_lock(MHAObject *self, PyObject *Py_UNUSED(ignored))
{
    uint64_t token;
    if (lock_write(&self->lock, &token) < 0) return NULL;
    return PyLong_FromUnsignedLongLong(token);
}

PyObject *mha_write_unlock(MHAObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    uint64_t token = thread_number();
    if (nargs > 1) {
        PyErr_SetString(PyExc_TypeError, "_write_unlock takes at most 1 argument (token)");
        return NULL;
    }
    if (nargs == 1 && args[0] != Py_None && parse_u64(args[0], "token", &token) < 0)
        return NULL;
    if (lock_write_release(&self->lock, token) < 0) {
        PyErr_SetString(PyExc_RuntimeError,
                        "_write_unlock: the parameters' write lock is not held by this "
                        "thread or token");
        return NULL;
    }
    Py_RETURN_NONE;
}

/* _snapshot(): a copy of every parameter (a new 1-D array), taken under the
 * read lock, as a call reads them: a load_state_dict or an editing() block
 * in another thread is wholly in it or not at all (state_dict, and so
 * pickle and copy.deepcopy, which copied tensor by tensor and could mix
 * old and new values). */
PyObject *mha_snapshot(MHAObject *self, PyObject *Py_UNUSED(ignored))
{
    read_ticket t = {0};
    npy_intp n = (npy_intp)self->total;
    PyArrayObject *out = (PyArrayObject *)PyArray_SimpleNew(1, &n, typenum_of(self));
    if (!out) return NULL;
    if (lock_read(&self->lock, &t) < 0) {
        Py_DECREF(out);
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    memcpy(PyArray_DATA(out), self->block, (size_t)self->total * mha_dtype_size(self->cfg.dtype));
    lock_read_release(&self->lock, &t);
    Py_END_ALLOW_THREADS
    return (PyObject *)out;
}

/* _edits(): how many write holds (editing() blocks, load_state_dict) have
 * begun on the parameters, nested ones not counted.  trace() reads it
 * before its call and after its copy of the parameters: the same count,
 * and the copy holds the parameters the call read. */
PyObject *mha_edits(MHAObject *self, PyObject *Py_UNUSED(ignored))
{
    uint64_t n;
    pthread_mutex_lock(&self->lock.mu);
    n = self->lock.edits;
    pthread_mutex_unlock(&self->lock.mu);
    return PyLong_FromUnsignedLongLong(n);
}

/* _Editing(module): editing()'s context manager (module.py).  __enter__
 * takes the module's write lock and __exit__ releases that hold, each in
 * one C call: no Python code (an exception from a signal handler, Ctrl-C)
 * runs between taking the lock and the start of the with block, or
 * between its end and the release.  contextlib's generator manager ran
 * Python code in both places, and an interrupt there left the lock held
 * until the generator was collected (never, while a traceback kept it).
 * The hold is the entering thread's (holds nest); any thread may end it,
 * and a guard dropped while entered ends its hold. */
typedef struct {
    PyObject_HEAD
    PyObject *module; /* the MHAObject */
    uint64_t token;   /* the hold: lock_write's token, 0 while not entered */
} EditObject;

static PyObject *edit_new(PyTypeObject *type, PyObject *args, PyObject *kwargs)
{
    module_state *state = (module_state *)PyType_GetModuleState(type);
    PyObject *module;
    EditObject *self;
    if (!state) return NULL;
    if (kwargs && PyDict_GET_SIZE(kwargs)) {
        PyErr_SetString(PyExc_TypeError, "_Editing(module) takes no keyword arguments");
        return NULL;
    }
    if (!PyArg_UnpackTuple(args, "_Editing", 1, 1, &module)) return NULL;
    if (!PyObject_TypeCheck(module, state->mha_type)) {
        PyErr_SetString(PyExc_TypeError, "_Editing(module): module must be a MultiHeadAttention");
        return NULL;
    }
    self = (EditObject *)type->tp_alloc(type, 0);
    if (!self) return NULL;
    self->module = Py_NewRef(module);
    self->token = 0;
    return (PyObject *)self;
}

static PyObject *edit_enter(EditObject *self, PyObject *Py_UNUSED(ignored))
{
    uint64_t token;
    if (self->token) {
        PyErr_SetString(PyExc_RuntimeError, "this editing() block is entered already: use a "
                                            "new `with mha.editing():` for a nested block");
        return NULL;
    }
    if (lock_write(&((MHAObject *)self->module)->lock, &token) < 0) return NULL;
    self->token = token;
    return Py_NewRef(self->module);
}

static void edit_release(EditObject *self)
{
    uint64_t token = self->token;
    self->token = 0;
    if (token) lock_write_release(&((MHAObject *)self->module)->lock, token);
}

static PyObject *edit_exit(EditObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)args;
    (void)nargs;
    edit_release(self);
    Py_RETURN_FALSE; /* an exception in the block goes on */
}

static int edit_traverse(EditObject *self, visitproc visit, void *arg)
{
    Py_VISIT(Py_TYPE(self));
    Py_VISIT(self->module);
    return 0;
}

static int edit_clear(EditObject *self)
{
    if (self->module) edit_release(self);
    Py_CLEAR(self->module);
    return 0;
}

static void edit_dealloc(EditObject *self)
{
    PyTypeObject *tp = Py_TYPE(self);
    PyObject_GC_UnTrack(self);
    edit_clear(self);
    tp->tp_free(self);
    Py_DECREF(tp);
}

static PyMethodDef edit_methods[] = {
    {"__enter__", (PyCFunction)edit_enter, METH_NOARGS,
     "__enter__($self, /)\n--\n\nTake the module's write lock; returns the module."},
    {"__exit__", (PyCFunction)(void (*)(void))edit_exit, METH_FASTCALL,
     "__exit__($self, *exc_info)\n--\n\nRelease the hold __enter__ took; False."},
    {NULL}
};

static PyType_Slot edit_slots[] = {
    {Py_tp_new, edit_new},
    {Py_tp_dealloc, edit_dealloc},
    {Py_tp_traverse, edit_traverse},
    {Py_tp_clear, edit_clear},
    {Py_tp_methods, edit_methods},
    {Py_tp_doc, "_Editing(module, /)\n--\n\n"
                "editing()'s context manager: the module's write lock, taken and released in C."},
    {0, NULL}
};

PyType_Spec edit_spec = {
    .name = "mha_ext._core._Editing",
    .basicsize = sizeof(EditObject),
    .itemsize = 0,
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .slots = edit_slots,
};

/* _Holding(d, busy): a KVCache's hold (cache.py; d its `_busy` dict) as a
 * context manager.  __enter__ sets d["by"] = [the entering thread's id]
 * (the token) unless another token is there: then RuntimeError(busy), never
 * a wait.  __exit__ removes d["by"] if it is still this hold's token (a fork
 * child drops other threads' holds by giving the cache a new dict).  Each is
 * one C call, and a with statement runs no Python code between __enter__
 * and its block, nor between the block and __exit__: an exception from a
 * signal handler (Ctrl-C) cannot leave the cache held, nor take it without
 * the block that gives it back.  A guard dropped while entered gives back
 * its hold. */
typedef struct {
    PyObject_HEAD
    PyObject *d;     /* the cache's _busy dict */
    PyObject *busy;  /* the RuntimeError's message */
    PyObject *key;   /* "by" */
    PyObject *token; /* [thread id] while entered, else NULL */
} HoldObject;

static PyObject *holding_new(PyTypeObject *type, PyObject *args, PyObject *kwargs)
{
    PyObject *d, *busy;
    HoldObject *self;
    if (kwargs && PyDict_GET_SIZE(kwargs)) {
        PyErr_SetString(PyExc_TypeError, "_Holding(d, busy) takes no keyword arguments");
        return NULL;
    }
    if (!PyArg_UnpackTuple(args, "_Holding", 2, 2, &d, &busy)) return NULL;
    if (!PyDict_CheckExact(d) || !PyUnicode_Check(busy)) {
        PyErr_SetString(PyExc_TypeError, "_Holding(d, busy): d a dict, busy a str");
        return NULL;
    }
    self = (HoldObject *)type->tp_alloc(type, 0);
    if (!self) return NULL;
    self->key = PyUnicode_InternFromString("by");
    if (!self->key) {
        Py_DECREF(self);
        return NULL;
    }
    self->d = Py_NewRef(d);
    self->busy = Py_NewRef(busy);
    self->token = NULL;
    return (PyObject *)self;
}

static PyObject *holding_enter(HoldObject *self, PyObject *Py_UNUSED(ignored))
{
    PyObject *token, *id, *cur;
    if (self->token) {
        PyErr_SetString(PyExc_RuntimeError, "this cache hold is entered already");
        return NULL;
    }
    id = PyLong_FromUnsignedLong(PyThread_get_thread_ident());
    if (!id) return NULL;
    token = PyList_New(1);
    if (!token) {
        Py_DECREF(id);
        return NULL;
    }
    PyList_SET_ITEM(token, 0, id); /* steals id */
    cur = PyDict_SetDefault(self->d, self->key, token); /* borrowed */
    if (!cur || cur != token) {
        if (cur) PyErr_SetObject(PyExc_RuntimeError, self->busy);
        Py_DECREF(token);
        return NULL;
    }
    self->token = token;
    Py_RETURN_NONE;
}

/* give back this hold's token if d still holds it: 0, or -1 with an error */
static int holding_release(HoldObject *self)
{
    PyObject *token = self->token, *cur;
    int rc = 0;
    if (!token) return 0;
    self->token = NULL;
    cur = PyDict_GetItemWithError(self->d, self->key); /* borrowed */
    if (!cur && PyErr_Occurred()) rc = -1;
    else if (cur == token && PyDict_DelItem(self->d, self->key) < 0) rc = -1;
    Py_DECREF(token);
    return rc;
}

static PyObject *holding_exit(HoldObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)args;
    (void)nargs;
    if (holding_release(self) < 0) return NULL;
    Py_RETURN_FALSE; /* an exception in the block goes on */
}

static int holding_traverse(HoldObject *self, visitproc visit, void *arg)
{
    Py_VISIT(Py_TYPE(self));
    Py_VISIT(self->d);
    Py_VISIT(self->busy);
    Py_VISIT(self->token);
    return 0;
}

/* the collector's clear and dealloc: give back an entered hold (an error
 * being raised around them is kept) */
static int holding_clear(HoldObject *self)
{
    if (self->token && self->d && self->key) {
#if PY_VERSION_HEX >= 0x030C0000
        PyObject *exc = PyErr_GetRaisedException();
        if (holding_release(self) < 0) PyErr_WriteUnraisable((PyObject *)self);
        PyErr_SetRaisedException(exc);
#else
        PyObject *type, *value, *tb;
        PyErr_Fetch(&type, &value, &tb);
        if (holding_release(self) < 0) PyErr_WriteUnraisable((PyObject *)self);
        PyErr_Restore(type, value, tb);
#endif
    }
    Py_CLEAR(self->token);
    Py_CLEAR(self->d);
    Py_CLEAR(self->busy);
    Py_CLEAR(self->key);
    return 0;
}

static void holding_dealloc(HoldObject *self)
{
    PyTypeObject *tp = Py_TYPE(self);
    PyObject_GC_UnTrack(self);
    holding_clear(self);
    tp->tp_free(self);
    Py_DECREF(tp);
}

static PyMethodDef holding_methods[] = {
    {"__enter__", (PyCFunction)holding_enter, METH_NOARGS,
     "__enter__($self, /)\n--\n\nTake the cache, or RuntimeError(busy) when another holds it."},
    {"__exit__", (PyCFunction)(void (*)(void))holding_exit, METH_FASTCALL,
     "__exit__($self, *exc_info)\n--\n\nGive back the hold __enter__ took; False."},
    {NULL}
};

static PyType_Slot holding_slots[] = {
    {Py_tp_new, holding_new},
    {Py_tp_dealloc, holding_dealloc},
    {Py_tp_traverse, holding_traverse},
    {Py_tp_clear, holding_clear},
    {Py_tp_methods, holding_methods},
    {Py_tp_doc, "_Holding(d, busy, /)\n--\n\n"
                "A KVCache's hold as a context manager, taken and given back in C."},
    {0, NULL}
};

PyType_Spec holding_spec = {
    .name = "mha_ext._core._Holding",
    .basicsize = sizeof(HoldObject),
    .itemsize = 0,
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .slots = holding_slots,
};

/* _Guarded: a base class for a Python context manager whose exit must
 * run (mha_ext.torch.swapped: the model's own modules put back).  Its
 * __enter__ and __exit__ are C calls of the subclass's _enter() and
 * _exit(): a with statement then runs no Python code of ours before
 * _exit is called, and an exception raised as _exit starts or runs (one
 * from a signal handler: Ctrl-C) gets _exit called once more, to finish
 * its work (_exit must be idempotent), before that exception is raised. */
static PyObject *guarded_enter(PyObject *self, PyObject *Py_UNUSED(ignored))
{
    return PyObject_CallMethod(self, "_enter", NULL);
}

static PyObject *guarded_exit(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    PyObject *r;
    (void)args;
    (void)nargs;
    r = PyObject_CallMethod(self, "_exit", NULL);
    if (!r) {
#if PY_VERSION_HEX >= 0x030C0000
        PyObject *exc = PyErr_GetRaisedException();
        r = PyObject_CallMethod(self, "_exit", NULL);
        Py_XDECREF(r);
        PyErr_SetRaisedException(exc); /* the first exception, whatever the second call did */
#else
        PyObject *type, *value, *tb;
        PyErr_Fetch(&type, &value, &tb);
        r = PyObject_CallMethod(self, "_exit", NULL);
        Py_XDECREF(r);
        PyErr_Restore(type, value, tb);
#endif
        return NULL;
    }
    Py_DECREF(r);
    Py_RETURN_FALSE; /* an exception in the block goes on */
}

static void guarded_dealloc(PyObject *self)
{
    PyTypeObject *tp = Py_TYPE(self);
    tp->tp_free(self);
    Py_DECREF(tp);
}

static PyMethodDef guarded_methods[] = {
    {"__enter__", (PyCFunction)guarded_enter, METH_NOARGS,
     "__enter__($self, /)\n--\n\nself._enter()."},
    {"__exit__", (PyCFunction)(void (*)(void))guarded_exit, METH_FASTCALL,
     "__exit__($self, *exc_info)\n--\n\nself._exit(), once more if an exception stopped it; "
     "False."},
    {NULL}
};

static PyType_Slot guarded_slots[] = {
    {Py_tp_dealloc, guarded_dealloc},
    {Py_tp_methods, guarded_methods},
    {Py_tp_doc, "A context manager's base whose __enter__ / __exit__ call _enter() / _exit() "
                "from C (_exit again if an exception stopped it)."},
    {0, NULL}
};

PyType_Spec guarded_spec = {
    .name = "mha_ext._core._Guarded",
    .basicsize = sizeof(PyObject),
    .itemsize = 0,
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE,
    .slots = guarded_slots,
};
