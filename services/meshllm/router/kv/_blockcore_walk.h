/* The C block map's reads for a decision (_blockcore.c): hot victims of a slot, a prompt's depth groups. */

#ifndef MESHLLM_BLOCKCORE_WALK_H
#define MESHLLM_BLOCKCORE_WALK_H

#include "_blockcore_convert.h"

/* hot_victims(slot, k, keep) -> of the k least recently used blocks not in keep (hashes), how many were reused */
static int keep_ids(Core *c, PyObject *keep) {
    if (keep == c->keep_obj && c->keep_version == c->version)
        return 0;
    PyMem_RawFree(c->keep_ids);
    c->keep_ids = NULL;
    c->nkeep = 0;
    Py_CLEAR(c->keep_obj);
    Py_ssize_t n = PyObject_Size(keep);
    if (n < 0)
        return -1;
    c->keep_ids = PyMem_RawMalloc((size_t)(n ? n : 1) * sizeof(uint32_t));
    if (c->keep_ids == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    PyObject *it = PyObject_GetIter(keep), *o;
    if (it == NULL)
        return -1;
    Py_ssize_t k = 0;
    while ((o = PyIter_Next(it)) != NULL) {
        uint64_t h;
        int bad = as_hash(o, &h);
        Py_DECREF(o);
        if (bad) {
            Py_DECREF(it);
            return -1;
        }
        uint32_t b = lookup(c, h);
        if (b && k < n)
            c->keep_ids[k++] = b;
    }
    Py_DECREF(it);
    if (PyErr_Occurred())
        return -1;
    /* sort (insertion sort is enough for a prompt's blocks; qsort for more) */
    for (Py_ssize_t i = 1; i < k; i++) {
        uint32_t v = c->keep_ids[i];
        Py_ssize_t j = i;
        while (j > 0 && c->keep_ids[j - 1] > v) {
            c->keep_ids[j] = c->keep_ids[j - 1];
            j--;
        }
        c->keep_ids[j] = v;
    }
    c->nkeep = k;
    if (PyFrozenSet_CheckExact(keep)) { /* immutable: the same object is the same hashes next time */
        Py_INCREF(keep);
        c->keep_obj = keep;
        c->keep_version = c->version;
    }
    return 0;
}

static inline int kept(Core *c, uint32_t b) {
    Py_ssize_t lo = 0, hi = c->nkeep;
    while (lo < hi) {
        Py_ssize_t mid = (lo + hi) >> 1;
        if (c->keep_ids[mid] < b)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo < c->nkeep && c->keep_ids[lo] == b;
}

static PyObject *Core_hot_victims(Core *c, PyObject *args) {
    Py_ssize_t slot, k;
    PyObject *keep;
    if (!PyArg_ParseTuple(args, "nnO:hot_victims", &slot, &k, &keep))
        return NULL;
    Slot *s = slot_at(c, slot);
    if (s == NULL)
        return NULL;
    if (k <= 0 || !s->head)
        return PyLong_FromLong(0);
    int any = PyObject_IsTrue(keep);
    if (any < 0 || (any && keep_ids(c, keep)))
        return NULL;
    Py_ssize_t seen = 0, hot = 0;
    for (uint32_t n = s->head; n && seen < k; n = c->nodes[n].next) {
        if (any && c->nkeep && kept(c, c->nodes[n].block))
            continue;
        seen++;
        if (c->nodes[n].reuses)
            hot++;
    }
    return PyLong_FromSsize_t(hot);
}

/* Split the sorted candidates `cur` by block b's holders (sorted by slot): next = cur ∩ holders, gone = the rest.
   A block with 8x more holders than candidates (a prefix the whole fleet holds) is searched, else merged. */
static void split_by_holders(Core *c, uint32_t b, const uint32_t *cur, Py_ssize_t ncur, uint32_t *next,
                             Py_ssize_t *nn, uint32_t *gone, Py_ssize_t *ng) {
    Holder *hs = holders(c, b);
    Py_ssize_t nh = c->bcount[b], j = 0;
    *nn = *ng = 0;
    for (Py_ssize_t i = 0; i < ncur; i++) {
        if (nh >= ncur * 8) {
            Py_ssize_t hi = nh;
            while (j < hi) {
                Py_ssize_t mid = (j + hi) >> 1;
                if (hs[mid].slot < cur[i])
                    j = mid + 1;
                else
                    hi = mid;
            }
        } else {
            while (j < nh && hs[j].slot < cur[i])
                j++;
        }
        if (j < nh && hs[j].slot == cur[i])
            next[(*nn)++] = cur[i];
        else
            gone[(*ng)++] = cur[i];
    }
}

/* Append (depth, bits of `slots`) to `out`; -1 on error. */
static int append_group(PyObject *out, Py_ssize_t depth, const uint32_t *slots, Py_ssize_t n) {
    PyObject *bits = bits_of(slots, n, sizeof(uint32_t));
    PyObject *item = bits ? Py_BuildValue("(nN)", depth, bits) : NULL;
    int bad = item == NULL || PyList_Append(out, item);
    Py_XDECREF(item);
    return bad ? -1 : 0;
}

/* overlap_groups(hashes, mask) -> [(depth, bits of the slots among mask whose prefix ends there)], depth > 0 */
static PyObject *Core_overlap_groups(Core *c, PyObject *args) {
    PyObject *seq, *mask;
    if (!PyArg_ParseTuple(args, "OO:overlap_groups", &seq, &mask))
        return NULL;
    Py_ssize_t ncur, depth = 0;
    uint32_t *cur = slots_of_mask(mask, &ncur);
    if (cur == NULL)
        return NULL;
    uint32_t *next = PyMem_RawMalloc((size_t)(ncur ? ncur : 1) * sizeof(uint32_t));
    uint32_t *gone = PyMem_RawMalloc((size_t)(ncur ? ncur : 1) * sizeof(uint32_t));
    PyObject *out = PyList_New(0), *fast = NULL;
    int failed = 1;
    if (next == NULL || gone == NULL || out == NULL) {
        if (out == NULL || !PyErr_Occurred())
            PyErr_NoMemory();
        goto end;
    }
    if (ncur && (fast = PySequence_Fast(seq, "hashes must be iterable")) == NULL)
        goto end;
    PyObject **items = fast ? PySequence_Fast_ITEMS(fast) : NULL;
    Py_ssize_t n = fast ? PySequence_Fast_GET_SIZE(fast) : 0;
    uint32_t prev = 0;
    for (; ncur && depth < n; depth++) {
        uint64_t h;
        if (as_hash(items[depth], &h))
            goto end;
        uint32_t b = lookup(c, h);
        if (b && b == prev)
            continue; /* the same block again: the same holders */
        prev = b;
        Py_ssize_t nn = 0, ng = ncur;
        if (b)
            split_by_holders(c, b, cur, ncur, next, &nn, gone, &ng);
        else
            memcpy(gone, cur, (size_t)ncur * sizeof(uint32_t)); /* nobody holds it: every candidate stops */
        if (!ng)
            continue;
        if (depth && append_group(out, depth, gone, ng))
            goto end;
        uint32_t *t = cur;
        cur = next;
        next = t;
        ncur = nn;
    }
    if (depth && ncur && append_group(out, depth, cur, ncur))
        goto end;
    failed = 0;
end:
    Py_XDECREF(fast);
    PyMem_RawFree(cur);
    PyMem_RawFree(next);
    PyMem_RawFree(gone);
    if (failed)
        Py_CLEAR(out);
    return out;
}


#endif /* MESHLLM_BLOCKCORE_WALK_H */
