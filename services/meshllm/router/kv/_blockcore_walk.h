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

/* overlap_groups(hashes, mask) -> [(depth, bits of the slots among mask whose prefix ends there)], depth > 0 */
static PyObject *Core_overlap_groups(Core *c, PyObject *args) {
    PyObject *seq, *mask;
    if (!PyArg_ParseTuple(args, "OO:overlap_groups", &seq, &mask))
        return NULL;
    Py_ssize_t ncur;
    uint32_t *cur = slots_of_mask(mask, &ncur);
    if (cur == NULL)
        return NULL;
    uint32_t *next = PyMem_RawMalloc((size_t)(ncur ? ncur : 1) * sizeof(uint32_t));
    uint32_t *gone = PyMem_RawMalloc((size_t)(ncur ? ncur : 1) * sizeof(uint32_t));
    PyObject *out = PyList_New(0), *fast = NULL;
    if (next == NULL || gone == NULL || out == NULL) {
        if (out == NULL || !PyErr_Occurred())
            PyErr_NoMemory();
        goto fail;
    }
    if (!ncur)
        goto done;
    fast = PySequence_Fast(seq, "hashes must be iterable");
    if (fast == NULL)
        goto fail;
    PyObject **items = PySequence_Fast_ITEMS(fast);
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast), depth = 0;
    uint32_t prev = 0;
    for (; depth < n; depth++) {
        uint64_t h;
        if (as_hash(items[depth], &h))
            goto fail;
        uint32_t b = lookup(c, h);
        Py_ssize_t nn = 0, ng = 0;
        if (b && b == prev)
            continue;
        prev = b;
        if (b) { /* next = cur ∩ holders(b), gone = cur \ holders(b): both sorted */
            Holder *hs = holders(c, b);
            Py_ssize_t nh = c->bcount[b], i = 0, j = 0;
            if (nh >= ncur * 8) {
                for (; i < ncur; i++) {
                    Py_ssize_t lo = j, hi = nh;
                    while (lo < hi) {
                        Py_ssize_t mid = (lo + hi) >> 1;
                        if (hs[mid].slot < cur[i])
                            lo = mid + 1;
                        else
                            hi = mid;
                    }
                    j = lo;
                    if (j < nh && hs[j].slot == cur[i])
                        next[nn++] = cur[i];
                    else
                        gone[ng++] = cur[i];
                }
            } else {
                while (i < ncur) {
                    if (j >= nh || cur[i] < hs[j].slot)
                        gone[ng++] = cur[i++];
                    else if (cur[i] == hs[j].slot) {
                        next[nn++] = cur[i++];
                        j++;
                    } else
                        j++;
                }
            }
        } else {
            memcpy(gone, cur, (size_t)ncur * sizeof(uint32_t));
            ng = ncur;
        }
        if (!ng)
            continue;
        if (depth) {
            PyObject *bits = bits_of(gone, ng, sizeof(uint32_t));
            PyObject *item = bits ? Py_BuildValue("(nN)", depth, bits) : NULL;
            if (item == NULL || PyList_Append(out, item)) {
                Py_XDECREF(item);
                goto fail;
            }
            Py_DECREF(item);
        }
        uint32_t *t = cur;
        cur = next;
        next = t;
        ncur = nn;
        if (!ncur)
            goto done;
    }
    if (depth && ncur) {
        PyObject *bits = bits_of(cur, ncur, sizeof(uint32_t));
        PyObject *item = bits ? Py_BuildValue("(nN)", depth, bits) : NULL;
        if (item == NULL || PyList_Append(out, item)) {
            Py_XDECREF(item);
            goto fail;
        }
        Py_DECREF(item);
    }
done:
    Py_XDECREF(fast);
    PyMem_RawFree(cur);
    PyMem_RawFree(next);
    PyMem_RawFree(gone);
    return out;
fail:
    Py_XDECREF(fast);
    Py_XDECREF(out);
    PyMem_RawFree(cur);
    PyMem_RawFree(next);
    PyMem_RawFree(gone);
    return NULL;
}


#endif /* MESHLLM_BLOCKCORE_WALK_H */
