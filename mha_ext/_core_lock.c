/* _core_lock.c: the parameter lock of each module (see _core.h), its
 * interruptible waits, its fork safety, and the signal poll of long calls.
 *
 * The lock is a mutex, a condition variable and counters rather than a
 * pthread_rwlock: its state can be repaired in a fork child, a wait can be
 * cut into slices to let Ctrl-C through, and a writer is recognised by a
 * number that no later thread reuses.  The mutex is held only for a few
 * instructions and never while taking the GIL. */
#include "_core.h"

#include <errno.h>
#include <stdatomic.h>
#include <time.h>

/* -------------------------------------------------------------- threads */

static _Atomic uint64_t next_number = 1;
static _Thread_local uint64_t my_number;
static unsigned long main_ident;          /* PyThread ident of the main thread */

/* A number for the calling thread, unique in this process's life. */
uint64_t thread_number(void)
{
    if (my_number == 0) my_number = atomic_fetch_add(&next_number, 1);
    return my_number;
}

int on_main_thread(void)
{
    return PyThread_get_thread_ident() == main_ident;
}

/* -------------------------------------------------------------- registry */

static pthread_mutex_t registry_mu = PTHREAD_MUTEX_INITIALIZER;
static param_lock *registry;              /* a doubly linked list */
static pthread_condattr_t cond_attr;      /* CLOCK_MONOTONIC */

/* fork(): hold the registry and every lock's mutex across it, so that the
 * child sees no half-made change; in the child, drop what other threads
 * held (they do not exist there) and make every lock usable again. */
static void before_fork(void)
{
    param_lock *lk;
    pthread_mutex_lock(&registry_mu);
    for (lk = registry; lk; lk = lk->next) pthread_mutex_lock(&lk->mu);
}

static void after_fork_parent(void)
{
    param_lock *lk;
    for (lk = registry; lk; lk = lk->next) pthread_mutex_unlock(&lk->mu);
    pthread_mutex_unlock(&registry_mu);
}

static void after_fork_child(void)
{
    param_lock *lk;
    uint64_t me = my_number; /* 0: this thread never held anything */
    main_ident = PyThread_get_thread_ident(); /* as CPython's own rule */
    for (lk = registry; lk; lk = lk->next) {
        lk->readers = 0;          /* the calls of other threads are gone */
        lk->writers_waiting = 0;
        lk->generation++;         /* a read of this thread ends uncounted */
        if (lk->writer != 0 && lk->writer != me) {
            lk->abandoned = lk->writer;
            lk->writer = 0;
            lk->depth = 0;
        }
        pthread_cond_init(&lk->cv, &cond_attr); /* waiters are gone too */
        pthread_mutex_unlock(&lk->mu);          /* held by this thread */
    }
    pthread_mutex_unlock(&registry_mu);
}

int lock_setup(void)
{
    static int done;
    PyObject *threading = NULL, *main = NULL, *ident = NULL;
    int rc = -1;
    if (!(threading = PyImport_ImportModule("threading"))) goto fail;
    if (!(main = PyObject_CallMethod(threading, "main_thread", NULL))) goto fail;
    if (!(ident = PyObject_GetAttrString(main, "ident"))) goto fail;
    main_ident = PyLong_AsUnsignedLong(ident);
    if (PyErr_Occurred()) goto fail;
    if (!done) {
        if (pthread_condattr_init(&cond_attr) != 0 ||
            pthread_condattr_setclock(&cond_attr, CLOCK_MONOTONIC) != 0 ||
            pthread_atfork(before_fork, after_fork_parent, after_fork_child) != 0) {
            PyErr_SetString(PyExc_RuntimeError, "cannot set up the module locks");
            goto fail;
        }
        done = 1;
    }
    rc = 0;
fail:
    Py_XDECREF(threading);
    Py_XDECREF(main);
    Py_XDECREF(ident);
    return rc;
}

int lock_init(param_lock *lk)
{
    memset(lk, 0, sizeof *lk);
    if (pthread_mutex_init(&lk->mu, NULL) != 0) goto fail;
    if (pthread_cond_init(&lk->cv, &cond_attr) != 0) {
        pthread_mutex_destroy(&lk->mu);
        goto fail;
    }
    pthread_mutex_lock(&registry_mu);
    lk->next = registry;
    if (registry) registry->prev = lk;
    registry = lk;
    pthread_mutex_unlock(&registry_mu);
    lk->ready = 1;
    return 0;
fail:
    PyErr_SetString(PyExc_MemoryError, "cannot create the module's lock");
    return -1;
}

void lock_destroy(param_lock *lk)
{
    if (!lk->ready) return;
    pthread_mutex_lock(&registry_mu);
    if (lk->prev) lk->prev->next = lk->next;
    else registry = lk->next;
    if (lk->next) lk->next->prev = lk->prev;
    pthread_mutex_unlock(&registry_mu);
    pthread_cond_destroy(&lk->cv);
    pthread_mutex_destroy(&lk->mu);
    lk->ready = 0;
}

/* ------------------------------------------------------------- waiting */

/* Wait (lk->mu held, GIL released through *ts) until ready(lk, me), in
 * slices of MHA_POLL_MS; between slices the main thread runs the signal
 * handlers.  0 when ready, -1 when a handler raised (lk->mu held either
 * way; the exception is in the thread state). */
static int wait_until(param_lock *lk, int (*ready)(const param_lock *, uint64_t),
                      uint64_t me, PyThreadState **ts)
{
    int main = on_main_thread();
    while (!ready(lk, me)) {
        struct timespec t;
        clock_gettime(CLOCK_MONOTONIC, &t);
        t.tv_nsec += MHA_POLL_MS * 1000000L;
        if (t.tv_nsec >= 1000000000L) {
            t.tv_sec += 1;
            t.tv_nsec -= 1000000000L;
        }
        pthread_cond_timedwait(&lk->cv, &lk->mu, &t);
        if (main && !ready(lk, me)) {
            int r;
            pthread_mutex_unlock(&lk->mu); /* never hold it while taking the GIL */
            PyEval_RestoreThread(*ts);
            r = PyErr_CheckSignals();
            *ts = PyEval_SaveThread();
            pthread_mutex_lock(&lk->mu);
            if (r < 0) return -1;
        }
    }
    return 0;
}

static int read_ready(const param_lock *lk, uint64_t me)
{
    (void)me;
    return lk->writer == 0 && lk->writers_waiting == 0;
}

/* a read inside a read of this thread: a queued writer waits for the outer
 * one, so this one must not wait for the writer */
static int nested_read_ready(const param_lock *lk, uint64_t me)
{
    (void)me;
    return lk->writer == 0;
}

static _Thread_local read_ticket *my_reads; /* this thread's read holds */

static int reading(const param_lock *lk)
{
    const read_ticket *t;
    for (t = my_reads; t; t = t->next)
        if (t->lk == lk) return 1;
    return 0;
}

static int write_ready(const param_lock *lk, uint64_t me)
{
    (void)me;
    return lk->writer == 0 && lk->readers == 0;
}

int lock_read(param_lock *lk, read_ticket *t)
{
    uint64_t me = thread_number();
    PyThreadState *ts = PyEval_SaveThread();
    int rc = 0;
    pthread_mutex_lock(&lk->mu);
    t->held = 0;
    if (lk->writer != me) { /* the writer itself computes without the lock */
        rc = wait_until(lk, reading(lk) ? nested_read_ready : read_ready, me, &ts);
        if (rc == 0) {
            lk->readers++;
            t->held = 1;
            t->generation = lk->generation;
            t->lk = lk;
            t->next = my_reads;
            my_reads = t;
        }
    }
    pthread_mutex_unlock(&lk->mu);
    PyEval_RestoreThread(ts);
    return rc;
}

void lock_read_release(param_lock *lk, read_ticket *t)
{
    read_ticket **p;
    if (!t->held) return;
    for (p = &my_reads; *p; p = &(*p)->next)
        if (*p == t) {
            *p = t->next;
            break;
        }
    pthread_mutex_lock(&lk->mu);
    if (t->generation == lk->generation && --lk->readers == 0)
        pthread_cond_broadcast(&lk->cv);
    pthread_mutex_unlock(&lk->mu);
}

int lock_write(param_lock *lk, uint64_t *token)
{
    uint64_t me = thread_number();
    PyThreadState *ts;
    int rc = 0;
    if (reading(lk)) {
        *token = 0;
        PyErr_SetString(PyExc_RuntimeError,
                        "cannot change the module's parameters inside one of its calls on the "
                        "same thread (a signal handler during the call?): the change would wait "
                        "for the call, which waits for the handler");
        return -1;
    }
    ts = PyEval_SaveThread();
    pthread_mutex_lock(&lk->mu);
    if (lk->writer == me) {
        lk->depth++;
    } else {
        uint64_t gen = lk->generation;
        lk->writers_waiting++;
        rc = wait_until(lk, write_ready, me, &ts);
        if (gen == lk->generation) lk->writers_waiting--;
        if (rc == 0) {
            lk->writer = me;
            lk->depth = 1;
            lk->edits++;
        } else {
            pthread_cond_broadcast(&lk->cv); /* readers queued behind us */
        }
    }
    pthread_mutex_unlock(&lk->mu);
    PyEval_RestoreThread(ts);
    *token = me;
    return rc;
}

int lock_write_release(param_lock *lk, uint64_t token)
{
    int rc = 0;
    pthread_mutex_lock(&lk->mu);
    if (token != 0 && lk->writer == token && lk->depth > 0) {
        if (--lk->depth == 0) {
            lk->writer = 0;
            pthread_cond_broadcast(&lk->cv);
        }
    } else if (token != 0 && lk->abandoned == token) {
        lk->abandoned = 0;
    } else {
        rc = -1;
    }
    pthread_mutex_unlock(&lk->mu);
    return rc;
}

/* ------------------------------------------------------------- the poll */

int poll_signals(void *ctx)
{
    signal_poll *sp = (signal_poll *)ctx;
    int r;
    PyEval_RestoreThread(sp->ts);
    r = PyErr_CheckSignals();
    sp->ts = PyEval_SaveThread();
    return r < 0;
}
