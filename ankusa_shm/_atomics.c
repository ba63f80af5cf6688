/*
 * Sequentially consistent 64-bit atomics on a buffer shared between processes.
 *
 * Python has no atomic operations on shared memory, and a lock where the
 * segment promises atomics is a defect (see shm/layout.py). This module is the
 * whole of the C in ankusa-shm: one type, AtomicView, that holds a buffer
 * export (so the mapping cannot be closed underneath it) and performs load,
 * store, fetch-add and compare-and-swap on aligned signed 64-bit words at a
 * byte offset, and two functions, crc32 and file_ids. Everything else is Python.
 *
 * Four hot routines live here too, because benchmarks showed they pay: the node rate
 * limiter's GCRA take (slot lookup + compare-and-swap of the TAT word), which costs several
 * hundred nanoseconds as Python and well under one hundred here (bench_shm.py); the
 * breaker's window sum, read on every failed store call (bench_fleet.py's stall); and a
 * histogram observation (bucket search + two fetch-adds), made twice a request
 * (bench_admin.py's metrics on/off). wait_at_least/wake are a futex on a word, so a
 * store writer waiting for its turn sleeps without the GIL and is woken the moment its
 * turn comes (shm/turns.py): polled from Python, every look took the GIL back from the
 * busy event loop of its process. And crc32, a settle record's check, computed over a
 * bytes object in place: zlib.crc32 (a buffer export, and a slice of the record to give
 * it) put the queue's push + pop over its 3 us target in bench_shm.py. And file_ids, a
 * stat() that keeps the GIL, for the store's check of its files after every batch
 * (store/schema.py): os.stat let go of the GIL three times a batch, and four paired
 * rounds of bench_http.py's fleet gave 0.90-1.06 of the hooks/s without the check
 * (median 0.93). The
 * formats are layout.py's; GCRA_FORMAT and BREAKER_FORMAT export the constants below so
 * gcra.py and breaker.py can refuse to run against a layout that disagrees.
 *
 * Offsets are checked on every call: a misaligned or out-of-range offset
 * raises ValueError/IndexError, never touches memory. A view of a read-only
 * buffer supports load() only; writes raise TypeError.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <limits.h>
#include <errno.h>
#include <linux/futex.h>
#include <stdint.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

typedef struct {
    PyObject_HEAD
    Py_buffer view;
    int held;
    int writable;
    int waiting; /* threads in wait_at_least, which runs without the GIL: no release */
} AtomicView;

static int64_t *
word_at(AtomicView *self, PyObject *arg, int for_write)
{
    /* Converted before the view is looked at: an __index__ may release it. Callers
       convert their other arguments before calling this, for the same reason. */
    Py_ssize_t off = PyLong_AsSsize_t(arg);
    if (off == -1 && PyErr_Occurred()) {
        if (PyErr_ExceptionMatches(PyExc_OverflowError)) {
            PyErr_Clear();
            PyErr_SetString(PyExc_IndexError, "offset outside any buffer");
        }
        return NULL;
    }
    if (!self->held) {
        PyErr_SetString(PyExc_ValueError, "AtomicView is released");
        return NULL;
    }
    if (for_write && !self->writable) {
        PyErr_SetString(PyExc_TypeError, "AtomicView is read-only");
        return NULL;
    }
    if (off < 0 || off > self->view.len - 8) {
        PyErr_Format(PyExc_IndexError, "offset %zd outside buffer of %zd bytes", off,
                     self->view.len);
        return NULL;
    }
    char *p = (char *)self->view.buf + off;
    if (((uintptr_t)p & 7) != 0) {
        PyErr_Format(PyExc_ValueError, "offset %zd is not 8-byte aligned", off);
        return NULL;
    }
    return (int64_t *)p;
}

/* Whether the word at ``base`` is not 8-byte aligned in memory (the buffer's own start
   may not be). */
static int
misaligned(AtomicView *self, int64_t base)
{
    return (((uintptr_t)self->view.buf + (uintptr_t)base) & 7) != 0;
}

static int
int64_arg(PyObject *arg, int64_t *out)
{
    long long v = PyLong_AsLongLong(arg);
    if (v == -1 && PyErr_Occurred())
        return -1;
    *out = (int64_t)v;
    return 0;
}

static int
nargs_ok(const char *name, Py_ssize_t nargs, Py_ssize_t want)
{
    if (nargs != want) {
        PyErr_Format(PyExc_TypeError, "%s() takes exactly %zd arguments (%zd given)", name, want,
                     nargs);
        return 0;
    }
    return 1;
}

/* CRC-32 as zlib computes it (reflected polynomial 0xEDB88320), eight bytes a step
 * ("slicing by 8"): a byte at a time took twice as long as zlib.crc32 of a copy. */
static uint32_t crc_table[8][256];

static void
crc_init(void)
{
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = i;
        for (int k = 0; k < 8; k++)
            c = (c & 1) ? 0xEDB88320u ^ (c >> 1) : c >> 1;
        crc_table[0][i] = c;
    }
    for (uint32_t i = 0; i < 256; i++)
        for (int t = 1; t < 8; t++)
            crc_table[t][i] = (crc_table[t - 1][i] >> 8) ^ crc_table[0][crc_table[t - 1][i] & 0xFF];
}

static uint32_t
crc32_of(const unsigned char *p, Py_ssize_t n)
{
    uint32_t c = 0xFFFFFFFFu;
    for (; n >= 8; p += 8, n -= 8) {
        uint32_t lo = c ^ ((uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 |
                           (uint32_t)p[3] << 24);
        uint32_t hi = (uint32_t)p[4] | (uint32_t)p[5] << 8 | (uint32_t)p[6] << 16 |
                      (uint32_t)p[7] << 24;
        c = crc_table[7][lo & 0xFF] ^ crc_table[6][(lo >> 8) & 0xFF] ^
            crc_table[5][(lo >> 16) & 0xFF] ^ crc_table[4][lo >> 24] ^
            crc_table[3][hi & 0xFF] ^ crc_table[2][(hi >> 8) & 0xFF] ^
            crc_table[1][(hi >> 16) & 0xFF] ^ crc_table[0][hi >> 24];
    }
    while (n--)
        c = crc_table[0][(c ^ *p++) & 0xFF] ^ (c >> 8);
    return c ^ 0xFFFFFFFFu;
}

/* crc32(data, start, end): the CRC-32 of data[start:end], data a bytes object, read in
 * place (no buffer export, no slice). */
static PyObject *
crc32_bytes(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    if (!nargs_ok("crc32", nargs, 3))
        return NULL;
    if (!PyBytes_Check(args[0])) {
        PyErr_SetString(PyExc_TypeError, "crc32() takes bytes");
        return NULL;
    }
    Py_ssize_t start = PyLong_AsSsize_t(args[1]);
    if (start == -1 && PyErr_Occurred())
        return NULL;
    Py_ssize_t end = PyLong_AsSsize_t(args[2]);
    if (end == -1 && PyErr_Occurred())
        return NULL;
    if (start < 0 || end < start || end > PyBytes_GET_SIZE(args[0])) {
        PyErr_Format(PyExc_IndexError, "[%zd:%zd] outside %zd bytes", start, end,
                     PyBytes_GET_SIZE(args[0]));
        return NULL;
    }
    const unsigned char *p = (const unsigned char *)PyBytes_AS_STRING(args[0]) + start;
    return PyLong_FromUnsignedLong(crc32_of(p, end - start));
}

static PyObject *
av_load(AtomicView *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (!nargs_ok("load", nargs, 1))
        return NULL;
    int64_t *w = word_at(self, args[0], 0);
    if (w == NULL)
        return NULL;
    return PyLong_FromLongLong(__atomic_load_n(w, __ATOMIC_SEQ_CST));
}

static PyObject *
av_store(AtomicView *self, PyObject *const *args, Py_ssize_t nargs)
{
    int64_t v;
    if (!nargs_ok("store", nargs, 2))
        return NULL;
    if (int64_arg(args[1], &v) < 0)
        return NULL;
    int64_t *w = word_at(self, args[0], 1);
    if (w == NULL)
        return NULL;
    __atomic_store_n(w, v, __ATOMIC_SEQ_CST);
    Py_RETURN_NONE;
}

static PyObject *
av_add(AtomicView *self, PyObject *const *args, Py_ssize_t nargs)
{
    int64_t d;
    if (!nargs_ok("add", nargs, 2))
        return NULL;
    if (int64_arg(args[1], &d) < 0)
        return NULL;
    int64_t *w = word_at(self, args[0], 1);
    if (w == NULL)
        return NULL;
    return PyLong_FromLongLong(__atomic_fetch_add(w, d, __ATOMIC_SEQ_CST));
}

static PyObject *
av_cas(AtomicView *self, PyObject *const *args, Py_ssize_t nargs)
{
    int64_t expected, desired;
    if (!nargs_ok("cas", nargs, 3))
        return NULL;
    if (int64_arg(args[1], &expected) < 0 || int64_arg(args[2], &desired) < 0)
        return NULL;
    int64_t *w = word_at(self, args[0], 1);
    if (w == NULL)
        return NULL;
    int ok = __atomic_compare_exchange_n(w, &expected, desired, 0, __ATOMIC_SEQ_CST,
                                         __ATOMIC_SEQ_CST);
    return PyBool_FromLong(ok);
}

/* -- GCRA table (see shm/layout.py and shm/gcra.py) ------------------------------------ */

#define G_SLOT_BYTES 16
#define G_KEY 0
#define G_TAT 8
#define G_TAG_SHIFT 49
#define G_TAG_MASK ((UINT64_C(1) << 14) - 1)
#define G_TAT_MASK ((UINT64_C(1) << 49) - 1)
#define G_HALF (UINT64_C(1) << 48)
#define G_MAX_SPAN (UINT64_C(1) << 46)

/* How far a TAT word is ahead of now (0: drained). Another tag, or a lead no limit can
 * produce, is a fresh bucket. */
static int64_t
g_lead(int64_t word, int64_t tag, int64_t now)
{
    if ((word >> G_TAG_SHIFT) != tag)
        return 0;
    uint64_t d = ((uint64_t)word - (uint64_t)now) & G_TAT_MASK;
    if (d >= G_HALF || d > G_MAX_SPAN)
        return 0;
    return (int64_t)d;
}

static int64_t
g_tag_of(int64_t key)
{
    int64_t tag = (int64_t)(((uint64_t)key >> G_TAG_SHIFT) & G_TAG_MASK);
    return tag ? tag : 1;
}

static int
g_claim(int64_t *w, int64_t expected, int64_t desired)
{
    return __atomic_compare_exchange_n(w, &expected, desired, 0, __ATOMIC_SEQ_CST,
                                       __ATOMIC_SEQ_CST);
}

/* The tenant's slot: found, or an empty one claimed, or a drained one taken over. */
static char *
g_find(char *table, uint64_t nslots, uint64_t probe, int64_t key, int64_t now)
{
    uint64_t home = (uint64_t)key % nslots;
    for (uint64_t i = 0; i < probe; i++) {
        char *slot = table + ((home + i) % nslots) * G_SLOT_BYTES;
        int64_t *k = (int64_t *)(slot + G_KEY);
        int64_t seen = __atomic_load_n(k, __ATOMIC_SEQ_CST);
        if (seen == key)
            return slot;
        if (seen == 0 && (g_claim(k, 0, key) || __atomic_load_n(k, __ATOMIC_SEQ_CST) == key))
            return slot;
    }
    for (uint64_t i = 0; i < probe; i++) {
        char *slot = table + ((home + i) % nslots) * G_SLOT_BYTES;
        int64_t *k = (int64_t *)(slot + G_KEY);
        int64_t seen = __atomic_load_n(k, __ATOMIC_SEQ_CST);
        if (seen == key)
            return slot;
        int64_t tat = __atomic_load_n((int64_t *)(slot + G_TAT), __ATOMIC_SEQ_CST);
        if (g_lead(tat, g_tag_of(seen), now) <= 0 && g_claim(k, seen, key))
            return slot;
    }
    return NULL;
}

static PyObject *
av_gcra_take(AtomicView *self, PyObject *const *args, Py_ssize_t nargs)
{
    int64_t a[8];
    if (!nargs_ok("gcra_take", nargs, 8))
        return NULL;
    for (int i = 0; i < 8; i++)
        if (int64_arg(args[i], &a[i]) < 0)
            return NULL;
    int64_t base = a[0], nslots = a[1], probe = a[2], key = a[3], tag = a[4];
    int64_t interval = a[5], span = a[6], now = a[7];
    if (!self->held || !self->writable) {
        PyErr_SetString(PyExc_TypeError, "gcra_take needs a held, writable view");
        return NULL;
    }
    if (base < 0 || misaligned(self, base) || nslots < 1 || probe < 1 || key == 0 ||
        interval < 1 || (uint64_t)interval > G_MAX_SPAN || span < 0 ||
        (uint64_t)span > G_MAX_SPAN || nslots > (self->view.len - base) / G_SLOT_BYTES) {
        PyErr_SetString(PyExc_ValueError, "gcra_take: table outside the buffer or misaligned, or a bad limit");
        return NULL;
    }
    char *table = (char *)self->view.buf + base;
    for (;;) {
        char *slot = g_find(table, (uint64_t)nslots, (uint64_t)probe, key, now);
        if (slot == NULL)
            return PyLong_FromLong(-1);
        int64_t *tat = (int64_t *)(slot + G_TAT);
        int64_t w = __atomic_load_n(tat, __ATOMIC_SEQ_CST);
        int64_t lead = g_lead(w, tag, now) + interval;
        if (lead > span)
            return PyLong_FromLongLong(lead - span);
        int64_t desired = (int64_t)(((uint64_t)tag << G_TAG_SHIFT) |
                                    ((uint64_t)(now + lead) & G_TAT_MASK));
        if (g_claim(tat, w, desired))
            return PyLong_FromLong(0);
    }
}

/* -- breaker window (see shm/layout.py and shm/breaker.py) ------------------------------ */

#define B_VALID (INT64_C(1) << 62)
#define B_EPOCH_SHIFT 32
#define B_EPOCH_MASK ((INT64_C(1) << 30) - 1)
#define B_FAIL_SHIFT 16
#define B_COUNT_MASK INT64_C(0xFFFF)

/* (calls, failures) over the n bucket words at `buckets` whose epoch lies within n of
 * `epoch` -- or ahead of it: a bucket a process with a later clock reading started. In
 * Python this sum cost ~14 us, paid by every failed store call (bench_fleet's stall). */
static PyObject *
av_breaker_window(AtomicView *self, PyObject *const *args, Py_ssize_t nargs)
{
    int64_t a[3];
    if (!nargs_ok("breaker_window", nargs, 3))
        return NULL;
    for (int i = 0; i < 3; i++)
        if (int64_arg(args[i], &a[i]) < 0)
            return NULL;
    int64_t base = a[0], n = a[1], epoch = a[2] & B_EPOCH_MASK;
    if (!self->held) {
        PyErr_SetString(PyExc_ValueError, "AtomicView is released");
        return NULL;
    }
    if (base < 0 || misaligned(self, base) || n < 1 || n > (self->view.len - base) / 8) {
        PyErr_SetString(PyExc_ValueError,
                        "breaker_window: buckets outside the buffer or misaligned");
        return NULL;
    }
    const int64_t *w = (const int64_t *)((char *)self->view.buf + base);
    int64_t calls = 0, failures = 0, half = (B_EPOCH_MASK + 1) >> 1;
    for (int64_t i = 0; i < n; i++) {
        int64_t b = __atomic_load_n(&w[i], __ATOMIC_SEQ_CST);
        if (!(b & B_VALID))
            continue;
        int64_t age = (epoch - (b >> B_EPOCH_SHIFT)) & B_EPOCH_MASK;
        if (age < n || age >= half) {
            calls += b & B_COUNT_MASK;
            failures += (b >> B_FAIL_SHIFT) & B_COUNT_MASK;
        }
    }
    return Py_BuildValue("(LL)", (long long)calls, (long long)failures);
}

/* -- histograms (see shm/layout.py and shm/histograms.py) ------------------------------ */

static PyObject *
av_observe(AtomicView *self, PyObject *const *args, Py_ssize_t nargs)
{
    int64_t base, value;
    if (!nargs_ok("observe", nargs, 3))
        return NULL;
    if (int64_arg(args[0], &base) < 0 || int64_arg(args[2], &value) < 0)
        return NULL;
    PyObject *bounds = args[1];
    if (!PyTuple_Check(bounds)) {
        PyErr_SetString(PyExc_TypeError, "observe: bounds must be a tuple of ints");
        return NULL;
    }
    Py_ssize_t n = PyTuple_GET_SIZE(bounds);
    if (!self->held) {
        PyErr_SetString(PyExc_ValueError, "AtomicView is released");
        return NULL;
    }
    if (!self->writable) {
        PyErr_SetString(PyExc_TypeError, "AtomicView of a read-only buffer");
        return NULL;
    }
    /* n + 1 buckets (the last one +Inf), then the sum */
    if (base < 0 || misaligned(self, base) || n + 2 > (self->view.len - base) / 8) {
        PyErr_SetString(PyExc_ValueError, "observe: histogram outside the buffer or misaligned");
        return NULL;
    }
    Py_ssize_t lo = 0, hi = n; /* the first bound >= value: bisect_left */
    while (lo < hi) {
        Py_ssize_t mid = (lo + hi) / 2;
        PyObject *item = PyTuple_GET_ITEM(bounds, mid);
        if (!PyLong_CheckExact(item)) { /* an __index__ could change the view under us */
            PyErr_SetString(PyExc_TypeError, "observe: bounds must be a tuple of ints");
            return NULL;
        }
        long long b = PyLong_AsLongLong(item);
        if (b == -1 && PyErr_Occurred())
            return NULL;
        if (b < value)
            lo = mid + 1;
        else
            hi = mid;
    }
    int64_t *w = (int64_t *)((char *)self->view.buf + base);
    __atomic_fetch_add(&w[lo], 1, __ATOMIC_SEQ_CST);
    __atomic_fetch_add(&w[n + 1], value, __ATOMIC_SEQ_CST);
    Py_RETURN_NONE;
}

/* The futex is the word's low half: where it lies depends on the byte order. */
static uint32_t *
futex_word(int64_t *w)
{
#if __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    return (uint32_t *)w;
#else
    return (uint32_t *)w + 1;
#endif
}

static int64_t
monotonic_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static PyObject *
av_wait_at_least(AtomicView *self, PyObject *const *args, Py_ssize_t nargs)
{
    int64_t value, timeout_ns;
    if (!nargs_ok("wait_at_least", nargs, 3))
        return NULL;
    if (int64_arg(args[1], &value) < 0 || int64_arg(args[2], &timeout_ns) < 0)
        return NULL;
    int64_t *w = word_at(self, args[0], 0);
    if (w == NULL)
        return NULL;
    int reached = 0;
    int64_t end = monotonic_ns() + timeout_ns;
    self->waiting++;
    Py_BEGIN_ALLOW_THREADS
    for (;;) {
        int64_t seen = __atomic_load_n(w, __ATOMIC_SEQ_CST);
        if (seen >= value) {
            reached = 1;
            break;
        }
        int64_t left = end - monotonic_ns();
        if (left <= 0)
            break;
        struct timespec ts = {(time_t)(left / 1000000000), (long)(left % 1000000000)};
        /* Sleeps only while the low half still reads as seen: a wake() between the load
           and here makes it return at once, and the loop looks again. */
        syscall(SYS_futex, futex_word(w), FUTEX_WAIT, (uint32_t)seen, &ts, NULL, 0);
    }
    Py_END_ALLOW_THREADS
    self->waiting--;
    return PyBool_FromLong(reached);
}

static PyObject *
av_wake(AtomicView *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (!nargs_ok("wake", nargs, 1))
        return NULL;
    int64_t *w = word_at(self, args[0], 1);
    if (w == NULL)
        return NULL;
    long woken = syscall(SYS_futex, futex_word(w), FUTEX_WAKE, INT_MAX, NULL, NULL, 0);
    return PyLong_FromLong(woken < 0 ? 0 : woken);
}

static PyObject *
av_release(AtomicView *self, PyObject *Py_UNUSED(ignored))
{
    if (self->waiting) {
        PyErr_SetString(PyExc_BufferError, "AtomicView has a thread in wait_at_least");
        return NULL;
    }
    if (self->held) {
        self->held = 0;
        PyBuffer_Release(&self->view);
    }
    Py_RETURN_NONE;
}

static int
av_init(AtomicView *self, PyObject *args, PyObject *kwds)
{
    PyObject *obj;
    static char *kwlist[] = {"buffer", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O:AtomicView", kwlist, &obj))
        return -1;
    if (self->waiting) { /* as release: a thread waits on the buffer without the GIL */
        PyErr_SetString(PyExc_BufferError, "AtomicView has a waiter");
        return -1;
    }
    if (self->held) {
        PyBuffer_Release(&self->view);
        self->held = 0;
    }
    if (PyObject_GetBuffer(obj, &self->view, PyBUF_WRITABLE) == 0) {
        self->writable = 1;
    } else {
        PyErr_Clear();
        if (PyObject_GetBuffer(obj, &self->view, PyBUF_SIMPLE) < 0)
            return -1;
        self->writable = 0;
    }
    self->held = 1;
    return 0;
}

static void
av_dealloc(AtomicView *self)
{
    if (self->held)
        PyBuffer_Release(&self->view);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *
av_get_size(AtomicView *self, void *Py_UNUSED(closure))
{
    return PyLong_FromSsize_t(self->held ? self->view.len : 0);
}

static PyObject *
av_get_writable(AtomicView *self, void *Py_UNUSED(closure))
{
    return PyBool_FromLong(self->writable);
}

static PyMethodDef av_methods[] = {
    {"load", (PyCFunction)(void (*)(void))av_load, METH_FASTCALL,
     "load(offset) -> int: atomic load of the word at offset."},
    {"store", (PyCFunction)(void (*)(void))av_store, METH_FASTCALL,
     "store(offset, value): atomic store."},
    {"add", (PyCFunction)(void (*)(void))av_add, METH_FASTCALL,
     "add(offset, delta) -> int: atomic fetch-add; returns the previous value."},
    {"cas", (PyCFunction)(void (*)(void))av_cas, METH_FASTCALL,
     "cas(offset, expected, desired) -> bool: atomic compare-and-swap."},
    {"gcra_take", (PyCFunction)(void (*)(void))av_gcra_take, METH_FASTCALL,
     "gcra_take(table, nslots, probe, key, tag, interval_us, span_us, now_us) -> int:\n"
     "0 admitted, >0 microseconds over the limit (nothing written), -1 no slot."},
    {"breaker_window", (PyCFunction)(void (*)(void))av_breaker_window, METH_FASTCALL,
     "breaker_window(buckets, n, epoch) -> (calls, failures) of the buckets in the window."},
    {"observe", (PyCFunction)(void (*)(void))av_observe, METH_FASTCALL,
     "observe(offset, bounds, value): add 1 to the first bucket whose bound is >= value "
     "(after the last: +Inf) and value to the sum word after the buckets."},
    {"wait_at_least", (PyCFunction)(void (*)(void))av_wait_at_least, METH_FASTCALL,
     "wait_at_least(offset, value, timeout_ns) -> bool: sleep, without the GIL, until the\n"
     "word is >= value (True) or timeout_ns has passed (False); wake() cuts a sleep short."},
    {"wake", (PyCFunction)(void (*)(void))av_wake, METH_FASTCALL,
     "wake(offset) -> int: wake every process and thread in wait_at_least on that word."},
    {"release", (PyCFunction)av_release, METH_NOARGS,
     "release(): drop the buffer export so the mapping can be closed."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef av_getset[] = {
    {"size", (getter)av_get_size, NULL, "Size of the buffer in bytes (0 once released).", NULL},
    {"writable", (getter)av_get_writable, NULL, "Whether store/add/cas are allowed.", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject AtomicViewType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "ankusa_shm._atomics.AtomicView",
    .tp_basicsize = sizeof(AtomicView),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "AtomicView(buffer): 64-bit sequentially consistent atomics on a buffer.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)av_init,
    .tp_dealloc = (destructor)av_dealloc,
    .tp_methods = av_methods,
    .tp_getset = av_getset,
};

/* file_ids(path, ...): (st_dev, st_ino) of each, or None if one is missing; stat()
 * with the GIL held. The store's writer thread checks its files this way after every
 * batch, before anyone is answered; os.stat lets go of the GIL for each call, and each
 * time the busy event loop of its process took it (the file comment has the figures). */
static PyObject *
file_ids(PyObject *Py_UNUSED(mod), PyObject *const *args, Py_ssize_t nargs)
{
    PyObject *out = PyTuple_New(nargs);
    if (out == NULL)
        return NULL;
    for (Py_ssize_t i = 0; i < nargs; i++) {
        PyObject *path = NULL;
        if (!PyUnicode_FSConverter(args[i], &path)) {
            Py_DECREF(out);
            return NULL;
        }
        struct stat st;
        int rc = stat(PyBytes_AS_STRING(path), &st);
        int err = errno;
        Py_DECREF(path);
        if (rc != 0) {
            Py_DECREF(out);
            if (err == ENOENT || err == ENOTDIR)
                Py_RETURN_NONE;
            errno = err;
            return PyErr_SetFromErrnoWithFilenameObject(PyExc_OSError, args[i]);
        }
        PyObject *id = Py_BuildValue("(KK)", (unsigned long long)st.st_dev,
                                     (unsigned long long)st.st_ino);
        if (id == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        PyTuple_SET_ITEM(out, i, id);
    }
    return out;
}

static PyMethodDef module_methods[] = {
    {"crc32", (PyCFunction)(void (*)(void))crc32_bytes, METH_FASTCALL,
     "crc32(data, start, end) -> int: zlib's CRC-32 of data[start:end] (data: bytes)."},
    {"file_ids", (PyCFunction)(void (*)(void))file_ids, METH_FASTCALL,
     "file_ids(path, ...) -> ((st_dev, st_ino), ...) | None: stat() without letting go\n"
     "of the GIL; None if a path does not exist."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef atomics_module = {
    PyModuleDef_HEAD_INIT, "_atomics", "64-bit atomics on shared buffers.", -1, module_methods,
};

PyMODINIT_FUNC
PyInit__atomics(void)
{
    if (PyType_Ready(&AtomicViewType) < 0)
        return NULL;
    crc_init();
    PyObject *m = PyModule_Create(&atomics_module);
    if (m == NULL)
        return NULL;
    PyObject *fmt = Py_BuildValue("(iiiiLLL)", G_SLOT_BYTES, G_KEY, G_TAT, G_TAG_SHIFT,
                                  (long long)G_TAG_MASK, (long long)G_TAT_MASK,
                                  (long long)G_MAX_SPAN);
    if (fmt == NULL || PyModule_AddObject(m, "GCRA_FORMAT", fmt) < 0) {
        Py_XDECREF(fmt);
        Py_DECREF(m);
        return NULL;
    }
    PyObject *bfmt = Py_BuildValue("(LiLiL)", (long long)B_VALID, B_EPOCH_SHIFT,
                                   (long long)B_EPOCH_MASK, B_FAIL_SHIFT,
                                   (long long)B_COUNT_MASK);
    if (bfmt == NULL || PyModule_AddObject(m, "BREAKER_FORMAT", bfmt) < 0) {
        Py_XDECREF(bfmt);
        Py_DECREF(m);
        return NULL;
    }
    Py_INCREF(&AtomicViewType);
    if (PyModule_AddObject(m, "AtomicView", (PyObject *)&AtomicViewType) < 0) {
        Py_DECREF(&AtomicViewType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
