/* The C block map's conversions (_blockcore.c): Python ints as hashes and as slot masks. */

#ifndef MESHLLM_BLOCKCORE_CONVERT_H
#define MESHLLM_BLOCKCORE_CONVERT_H

#include "_blockcore_store.h"

/* ------------------------------------------------------------ conversions */
static int as_hash(PyObject *o, uint64_t *out) {
    if (PyLong_Check(o)) {
        *out = PyLong_AsUnsignedLongLong(o);
    } else {
        PyObject *i = PyNumber_Index(o);
        if (i == NULL)
            return -1;
        *out = PyLong_AsUnsignedLongLong(i);
        Py_DECREF(i);
    }
    if (*out == (uint64_t)-1 && PyErr_Occurred()) {
        if (PyErr_ExceptionMatches(PyExc_OverflowError)) {
            PyErr_Clear();
            PyErr_SetString(PyExc_OverflowError, "a block hash is an unsigned 64-bit integer");
        }
        return -1;
    }
    return 0;
}

/* The hashes of `seq` as an array (*n of them), all converted before anything changes: a bad one changes nothing. */
static uint64_t *hashes_of(PyObject *seq, Py_ssize_t *n) {
    PyObject *fast = PySequence_Fast(seq, "hashes must be iterable");
    if (fast == NULL)
        return NULL;
    Py_ssize_t len = PySequence_Fast_GET_SIZE(fast);
    PyObject **items = PySequence_Fast_ITEMS(fast);
    uint64_t *out = PyMem_RawMalloc((size_t)(len ? len : 1) * sizeof(uint64_t));
    if (out == NULL) {
        Py_DECREF(fast);
        PyErr_NoMemory();
        return NULL;
    }
    for (Py_ssize_t i = 0; i < len; i++) {
        if (as_hash(items[i], &out[i])) {
            Py_DECREF(fast);
            PyMem_RawFree(out);
            return NULL;
        }
    }
    Py_DECREF(fast);
    *n = len;
    return out;
}

/* An int with bit `slots[i]` set for each i. */
static PyObject *bits_of(const uint32_t *slots, Py_ssize_t n, size_t stride) {
    uint32_t top = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        uint32_t s = *(const uint32_t *)((const char *)slots + i * stride);
        if (s > top)
            top = s;
    }
    size_t nbytes = n ? top / 8 + 1 : 1;
    unsigned char small[256];
    unsigned char *buf = nbytes <= sizeof small ? small : PyMem_RawCalloc(nbytes, 1);
    if (buf == NULL)
        return PyErr_NoMemory();
    if (buf == small)
        memset(small, 0, nbytes);
    for (Py_ssize_t i = 0; i < n; i++) {
        uint32_t s = *(const uint32_t *)((const char *)slots + i * stride);
        buf[s >> 3] |= (unsigned char)(1u << (s & 7));
    }
    PyObject *r = _PyLong_FromByteArray(buf, nbytes, 1, 0);
    if (buf != small)
        PyMem_RawFree(buf);
    return r;
}

static PyObject *mask_of(Core *c, uint32_t b) {
    if (!b)
        return PyLong_FromLong(0);
    return bits_of(&holders(c, b)->slot, c->bcount[b], sizeof(Holder));
}

/* The set bits of a non-negative int, ascending, into a new array (*n of them). */
static uint32_t *slots_of_mask(PyObject *mask, Py_ssize_t *n) {
    if (!PyLong_Check(mask)) {
        PyErr_SetString(PyExc_TypeError, "a slot mask is an int");
        return NULL;
    }
    if (_PyLong_Sign(mask) < 0) {
        PyErr_SetString(PyExc_ValueError, "a slot mask is not negative");
        return NULL;
    }
    size_t nbits = _PyLong_NumBits(mask);
    if (nbits == (size_t)-1 && PyErr_Occurred())
        return NULL;
    size_t nbytes = nbits / 8 + 1;
    unsigned char *buf = PyMem_RawMalloc(nbytes);
    uint32_t *out = PyMem_RawMalloc((nbits + 1) * sizeof(uint32_t));
    if (buf == NULL || out == NULL) {
        PyMem_RawFree(buf);
        PyMem_RawFree(out);
        PyErr_NoMemory();
        return NULL;
    }
#if PY_VERSION_HEX >= 0x030D0000
    int bad = _PyLong_AsByteArray((PyLongObject *)mask, buf, nbytes, 1, 0, 1);
#else
    int bad = _PyLong_AsByteArray((PyLongObject *)mask, buf, nbytes, 1, 0);
#endif
    if (bad < 0) {
        PyMem_RawFree(buf);
        PyMem_RawFree(out);
        return NULL;
    }
    Py_ssize_t k = 0;
    for (size_t i = 0; i < nbytes; i++) {
        unsigned char v = buf[i];
        while (v) {
            int low = __builtin_ctz(v);
            out[k++] = (uint32_t)(i * 8 + low);
            v &= (unsigned char)(v - 1);
        }
    }
    PyMem_RawFree(buf);
    *n = k;
    return out;
}


#endif /* MESHLLM_BLOCKCORE_CONVERT_H */
