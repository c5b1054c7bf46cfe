/* _core.h: what the files of the binding (mha_ext/_core*.c) share.
 *
 *   _core.c        module init, module functions, the type: construction,
 *                  parameter memory, attributes, the write lock's methods
 *   _core_lock.c   the parameter lock (readers, one re-entrant writer),
 *                  interruptible waits, fork safety, the signal poll
 *   _core_args.c   scalar arguments (ints, flags, is_causal, scale, dtype,
 *                  dropout, seed), memory arithmetic, status errors
 *   _core_parse.c  the call's arrays, call_parse / call_clear
 *   _core_masks.c  masks: (kind, array) pairs broadcast onto (B, H, Sq, Sk)
 *   _core_calls.c  call_run and the three calls: _forward, _forward_train,
 *                  _backward
 *   _core_sdpa.c   the module functions _sdpa and _sdpa_backward (attention
 *                  on projected heads: mha_sdpa_forward / mha_sdpa_backward)
 *   _core_mem.c    the output cache: large result arrays reuse the memory
 *                  of freed ones (a NumPy memory handler)
 *
 * One call's life: call_parse (arguments -> arrays of the module's dtype,
 * every check before anything large is allocated), the entry point
 * allocates its outputs, call_run (the only place that takes the lock and
 * releases the GIL), the entry point packs its result, call_clear.
 *
 * Legend: B batch, Sq/Sk query/key lengths, E d_model, H heads, Dk = E/H. */
#ifndef MHA_EXT_CORE_H
#define MHA_EXT_CORE_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#define NPY_NO_DEPRECATED_API NPY_1_25_API_VERSION
#define NPY_TARGET_VERSION NPY_1_25_API_VERSION
#define PY_ARRAY_UNIQUE_SYMBOL mha_ext_ARRAY_API
#ifndef MHA_EXT_IMPORTS_NUMPY /* only _core.c imports NumPy's C API */
#define NO_IMPORT_ARRAY
#endif
#include <numpy/arrayobject.h>

#include <pthread.h>
#include <stdint.h>

#include "mha.h"

/* ---------------------------------------------------------------- the lock
 * Many calls read the parameters at once; one thread at a time writes them
 * (_load, editing()), and may nest its write holds and call the module
 * itself meanwhile.  Writers go first: a steady stream of calls does not
 * starve them.  Threads are told apart by thread_number(), never reused
 * (a new thread may get a dead thread's ident, never its number).
 * Every lock is in a registry: in a child of fork() the locks are usable
 * again (holds of threads that do not exist there are dropped; a write hold
 * of the forking thread itself stays). */
typedef struct param_lock {
    pthread_mutex_t mu;         /* guards every field below */
    pthread_cond_t cv;          /* signalled when readers or writer drop */
    long readers;               /* calls running on the parameters */
    uint64_t writer;            /* thread_number() of the writer, 0: none */
    long depth;                 /* its nested write holds */
    long writers_waiting;       /* writers queued: new readers wait */
    uint64_t generation;        /* bumped in a fork child: older read
                                   holds are no longer counted */
    uint64_t abandoned;         /* a writer dropped by fork, whose late
                                   release is then a no-op */
    uint64_t edits;             /* write holds begun (nested ones not
                                   counted): trace() compares it across its
                                   call and its copy of the parameters */
    struct param_lock *prev, *next; /* the registry of live locks */
    int ready;
} param_lock;

typedef struct read_ticket {
    int held;                   /* 0: not taken (this thread is the writer) */
    uint64_t generation;
    const struct param_lock *lk; /* held: the lock, in this thread's list */
    struct read_ticket *next;   /* of read holds, innermost first */
} read_ticket;

uint64_t thread_number(void);
int on_main_thread(void);
int lock_setup(void);                    /* once, at module init (GIL held) */
int lock_init(param_lock *lk);           /* 0, or -1 with MemoryError */
void lock_destroy(param_lock *lk);
/* With the GIL held; they release it while waiting, and on the main thread
 * check for signals every MHA_POLL_MS (-1 with the handler's exception).
 * A thread inside a call of the module (a signal handler's call within
 * it) reads again without queueing behind a waiting writer, and may not
 * write: -1 with a RuntimeError (it would wait for itself). */
int lock_read(param_lock *lk, read_ticket *t);
void lock_read_release(param_lock *lk, read_ticket *t); /* any GIL state */
int lock_write(param_lock *lk, uint64_t *token);
/* 0 released (or an abandoned hold), -1 when token holds nothing (no
 * exception set: the caller says what was wrong). */
int lock_write_release(param_lock *lk, uint64_t token);

/* The poll of mha_forward_args on the main thread: takes the GIL back, runs
 * the signal handlers, releases it; nonzero when a handler raised. */
typedef struct {
    PyThreadState *ts;          /* the caller's, saved by PyEval_SaveThread */
} signal_poll;
int poll_signals(void *ctx);

/* ---------------------------------------------------------------- the type */
typedef struct {
    PyTypeObject *mha_type;
    PyTypeObject *edit_type;    /* _Editing, editing()'s context manager */
    PyTypeObject *holding_type; /* _Holding, a KVCache's hold */
} module_state;

typedef struct {
    PyObject_HEAD
    mha_config cfg;
    PyArrayObject *params;      /* (total,) the parameters in mha_param_layout
                                   order; its memory belongs to a capsule, so
                                   views of it never reference the module */
    void *block;                /* its data, 64-byte aligned */
    int64_t total;              /* scalars in block */
    int64_t offset[MHA_NPARAM], size[MHA_NPARAM];
    double dropout;
    int training;
    uint64_t seed;
    uint64_t counter;           /* dropout streams used so far (GIL) */
    param_lock lock;
} MHAObject;

static inline int typenum_of(const MHAObject *self)
{
    return self->cfg.dtype == MHA_FLOAT64 ? NPY_FLOAT64 : NPY_FLOAT32;
}

/* ---------------------------------------------------------------- arguments */
int positive_int(PyObject *obj, const char *name, int64_t *out);
int kv_heads_arg(PyObject *obj, int64_t n_heads, int64_t *out);
int parse_flag(PyObject *obj, const char *name, int *out);
PyObject *shape_str(PyArrayObject *arr); /* str(arr.shape) */
int parse_dropout(PyObject *obj, const char *name, double *out);
int parse_dtype(PyObject *obj, mha_dtype *out);
int parse_u64(PyObject *obj, const char *name, uint64_t *out);
/* is_causal: False / True (MHA_CAUSAL_TOP_LEFT) or "lower_right"
 * (MHA_CAUSAL_LOWER_RIGHT) into *out */
int parse_causal(PyObject *obj, int *out);
/* window: None (*has = 0) or a tuple (left, right), each None (-1:
 * unbounded) or an int >= 0: mha_forward_args' has_window, window_left,
 * window_right (_core_masks.c) */
int parse_window(PyObject *obj, int *has, int64_t *left, int64_t *right);
/* scale: None (*has = 0: 1/sqrt(head width)) or a real number */
int parse_scale(PyObject *obj, int *has, double *out);
/* a sequence of (kind, array) pairs (kind 0 blocking, 1 additive of
 * `typenum`) broadcast onto dim (B, H, Sq, Sk): masks[0 .. *n) and the
 * arrays holding their data, arrs[0 .. *n) (new references) */
int convert_masks(PyObject *seq, int typenum, const int64_t dim[4], mha_mask *masks,
                  PyArrayObject **arrs, int *n);
/* layout: None or (keep, q_block, k_block), keep (1 or B, 1 or H, nqb, nkb)
 * of bool or uint8, nonzero = kept, for a call of dim (B, H, Sq, Sk): into
 * *ly, the data held by *arr (a new reference; NULL for None) */
int parse_layout(PyObject *obj, const int64_t dim[4], mha_block_layout *ly, PyArrayObject **arr);
int64_t physical_bytes(void);
int add_bytes(int64_t *total, int64_t n, size_t size);
void set_status_error(mha_status st, const char *what);

/* ---------------------------------------------------------------- a call */
typedef enum { CALL_FORWARD, CALL_FORWARD_TRAIN, CALL_BACKWARD } call_op;

/* The Python objects of one call, by keyword (NULL: not given). */
typedef struct {
    PyObject *query, *key, *value, *params, *masks;
    PyObject *is_causal, *need_weights, *zero_rows, *reference, *scale, *window;
    PyObject *dropout, *counter, *save, *save_p;
    PyObject *grad_output, *grad_weights, *saved, *head_mask, *layout;
    PyObject *cache; /* None, or (K (B, Hkv, Dk, cap), V (B, Hkv, cap, Dk), length) */
    PyObject *average_weights; /* _forward's: the weights (B, Sq, Sk'), the heads' mean */
    PyObject *scores_grad; /* _backward's: also dL/d masked scores (B, H, Sq, Sk') */
} call_objects;

struct call {
    MHAObject *self;
    call_op op;
    const char *name;           /* "forward", ... the public method, for messages */
    int need_weights, reference, save, save_p;
    int scores_grad;            /* _backward: dL/d masked scores asked for */
    /* owned references, converted to the module's dtype, C-contiguous */
    PyArrayObject *params;      /* NULL: the module's own (under its lock) */
    PyArrayObject *parts[MHA_NPARAM]; /* or one array per parameter (params given
                                   as a tuple in the block's order, parts[MHA_WQ]
                                   then set): no copy */
    PyArrayObject *query, *key, *value;
    PyArrayObject *grad_output, *grad_weights;
    PyArrayObject *head_mask;   /* (B, H), or NULL */
    PyArrayObject *layout;      /* the block layout's kept flags, or NULL */
    PyArrayObject *saved[5];    /* Q, K, V, ctx, P (P may stay NULL) */
    PyArrayObject *cache[2];    /* the cache's K and V (written by the call), or NULL */
    PyArrayObject *mask_arr[MHA_MAX_MASKS];
    mha_mask masks[MHA_MAX_MASKS];
    mha_params p;
    mha_backward_args ba;       /* ba.fwd: the forward call; the entry point
                                   sets the output pointers */
    mha_saved sv;               /* for forward_train (with save) or backward */
    mha_copies cp;              /* for forward_train */
    int have_saved;
};

int call_parse(MHAObject *self, call_op op, const call_objects *o, struct call *c);
int call_run(struct call *c);
void call_clear(struct call *c);

PyObject *mha_forward_py(MHAObject *self, PyObject *args, PyObject *kwds);
PyObject *mha_forward_train_py(MHAObject *self, PyObject *args, PyObject *kwds);
PyObject *mha_backward_py(MHAObject *self, PyObject *args, PyObject *kwds);
PyObject *sdpa_py(PyObject *m, PyObject *args, PyObject *kwds);
PyObject *sdpa_backward_py(PyObject *m, PyObject *args, PyObject *kwds);

/* ---------------------------------------------------------- the output cache
 * (_core_mem.c) A new array (zeroed when `zero`) of nd dims and float32 or
 * float64; one of 1 MiB or more gets memory from the cache of freed ones. */
PyArrayObject *out_new_array(int nd, const npy_intp *dims, int typenum, int zero);
size_t out_cache_release(void);  /* unmap every cached block: their bytes */
void out_cache_info(size_t *cached, int *blocks, size_t *limit);

/* _core_holds.c: holds taken and given back in one C call each; the
 * module's methods _write_lock, _write_unlock and _snapshot */
PyObject *mha_write_lock(MHAObject *self, PyObject *ignored);
PyObject *mha_write_unlock(MHAObject *self, PyObject *const *args, Py_ssize_t nargs);
PyObject *mha_snapshot(MHAObject *self, PyObject *ignored);
PyObject *mha_edits(MHAObject *self, PyObject *ignored);
extern PyType_Spec edit_spec; /* _Editing(module): editing()'s context manager */
extern PyType_Spec holding_spec; /* _Holding(d, busy): a KVCache's hold */
extern PyType_Spec guarded_spec; /* _Guarded: swapped()'s base, its exit run in C */

#endif /* MHA_EXT_CORE_H */
