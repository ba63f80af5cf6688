/*
 * Sequentially consistent 64-bit atomics on a buffer shared between processes.
 *
 * Python has no atomic operations on shared memory, and a lock where the
 * segment promises atomics is a defect (see shm/layout.py). This module is the
 * whole of the C in ankusa-shm: one type, AtomicView, that holds a buffer
 * export (so the mapping cannot be closed underneath it) and performs load,
 * store, fetch-add and compare-and-swap on aligned signed 64-bit words at a
 * byte offset. Everything else is Python.
 *
 * Offsets are checked on every call: a misaligned or out-of-range offset
 * raises ValueError/IndexError, never touches memory. A view of a read-only
 * buffer supports load() only; writes raise TypeError.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

typedef struct {
    PyObject_HEAD
    Py_buffer view;
    int held;
    int writable;
} AtomicView;

static int64_t *
word_at(AtomicView *self, PyObject *arg, int for_write)
{
    if (!self->held) {
        PyErr_SetString(PyExc_ValueError, "AtomicView is released");
        return NULL;
    }
    if (for_write && !self->writable) {
        PyErr_SetString(PyExc_TypeError, "AtomicView is read-only");
        return NULL;
    }
    Py_ssize_t off = PyLong_AsSsize_t(arg);
    if (off == -1 && PyErr_Occurred())
        return NULL;
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
    int64_t *w = word_at(self, args[0], 1);
    if (w == NULL || int64_arg(args[1], &v) < 0)
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
    int64_t *w = word_at(self, args[0], 1);
    if (w == NULL || int64_arg(args[1], &d) < 0)
        return NULL;
    return PyLong_FromLongLong(__atomic_fetch_add(w, d, __ATOMIC_SEQ_CST));
}

static PyObject *
av_cas(AtomicView *self, PyObject *const *args, Py_ssize_t nargs)
{
    int64_t expected, desired;
    if (!nargs_ok("cas", nargs, 3))
        return NULL;
    int64_t *w = word_at(self, args[0], 1);
    if (w == NULL || int64_arg(args[1], &expected) < 0 || int64_arg(args[2], &desired) < 0)
        return NULL;
    int ok = __atomic_compare_exchange_n(w, &expected, desired, 0, __ATOMIC_SEQ_CST,
                                         __ATOMIC_SEQ_CST);
    return PyBool_FromLong(ok);
}

static PyObject *
av_release(AtomicView *self, PyObject *Py_UNUSED(ignored))
{
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

static struct PyModuleDef atomics_module = {
    PyModuleDef_HEAD_INIT, "_atomics", "64-bit atomics on shared buffers.", -1, NULL,
};

PyMODINIT_FUNC
PyInit__atomics(void)
{
    if (PyType_Ready(&AtomicViewType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&atomics_module);
    if (m == NULL)
        return NULL;
    Py_INCREF(&AtomicViewType);
    if (PyModule_AddObject(m, "AtomicView", (PyObject *)&AtomicViewType) < 0) {
        Py_DECREF(&AtomicViewType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
