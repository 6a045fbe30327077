/* The KV index's block map in C: block hash -> the slots holding it, and each slot's blocks in eviction order.

   The same answers as the Python map in blocks.py (tests/unit/test_block_map_equivalence.py checks both against
   one reference), in a layout that costs ~60 bytes per (slot, block) pair at fleet scale instead of ~160
   (docs/routing.md "The KV index"):

   - an open-addressing table, hash -> block id (linear probing, deletion by backward shift);
   - per block id: its hash and its holders, (slot, node) pairs sorted by slot (one inline, more in an array);
   - per pair a node of its slot's doubly linked list, least recently used first, with the block's reuse count.

   Slot numbers are given out by the Python wrapper (compiled.py); this module only grows its slot table.
   This file: the type and its changes; _blockcore_store.h the layout, _blockcore_convert.h the conversions,
   _blockcore_walk.h the reads a routing decision makes. */

#include "_blockcore_walk.h" /* _blockcore_store.h (the layout), _blockcore_convert.h */

/* ------------------------------------------------------------ the type */
static int Core_init(Core *c, PyObject *args, PyObject *kw) {
    if (PyTuple_GET_SIZE(args) || (kw != NULL && PyDict_GET_SIZE(kw))) {
        PyErr_SetString(PyExc_TypeError, "BlockCore() takes no arguments");
        return -1;
    }
    if (c->tvals != NULL)
        return 0;
    c->tmask = 1023;
    c->tkeys = PyMem_RawMalloc(1024 * sizeof(uint64_t));
    c->tvals = PyMem_RawCalloc(1024, sizeof(uint32_t));
    if (c->tkeys == NULL || c->tvals == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    return 0;
}

static void Core_dealloc(Core *c) {
    for (uint32_t b = 1; b <= c->bused; b++)
        if (c->bcap[b] > 1)
            PyMem_RawFree(c->bh[b].many);
    PyMem_RawFree(c->tkeys);
    PyMem_RawFree(c->tvals);
    PyMem_RawFree(c->bhash);
    PyMem_RawFree(c->bcount);
    PyMem_RawFree(c->bcap);
    PyMem_RawFree(c->bh);
    PyMem_RawFree(c->bfree);
    PyMem_RawFree(c->nodes);
    PyMem_RawFree(c->slots);
    PyMem_RawFree(c->keep_ids);
    Py_XDECREF(c->keep_obj);
    Py_TYPE(c)->tp_free((PyObject *)c);
}

static Py_ssize_t Core_len(Core *c) { return (Py_ssize_t)c->live; }

/* The slot `slot` and the hashes of `seq` (*hs, *n; free it) that add, touch, remove and replace work on. */
static Slot *slot_and_hashes(Core *c, Py_ssize_t slot, PyObject *seq, uint64_t **hs, Py_ssize_t *n) {
    Slot *s = slot_at(c, slot);
    if (s == NULL || (*hs = hashes_of(seq, n)) == NULL)
        return NULL;
    return s;
}

/* A new pair: block b (made for hash h when 0) held by `slot` too, its holder entry at `at` (0 for a new block), a
   node at the slot's most recently used end with `reuses`. Returns the node, 0 when out of memory (nothing changed). */
static uint32_t place(Core *c, Slot *s, uint32_t slot, uint32_t b, Py_ssize_t at, uint64_t h, uint32_t reuses) {
    if (!b && !(b = new_block(c, h)))
        return 0;
    uint32_t node = new_node(c, b);
    if (!node || insert_holder(c, b, at, slot, node)) {
        if (node)
            free_node(c, node);
        if (!c->bcount[b])
            free_block(c, b);
        return 0;
    }
    c->nodes[node].reuses = reuses;
    link_tail(c, s, node);
    s->size++;
    return node;
}

/* add(slot, hashes) -> how many were new to the slot (appended at the most recently used end, in order) */
static PyObject *Core_add(Core *c, PyObject *args) {
    Py_ssize_t slot, n, added = 0;
    PyObject *seq;
    uint64_t *hs;
    if (!PyArg_ParseTuple(args, "nO:add", &slot, &seq))
        return NULL;
    Slot *s = slot_and_hashes(c, slot, seq, &hs, &n);
    if (s == NULL)
        return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        uint32_t b = lookup(c, hs[i]);
        Py_ssize_t at = b ? find_holder(c, b, (uint32_t)slot) : -1;
        if (at >= 0)
            continue;
        if (!place(c, s, (uint32_t)slot, b, -at - 1, hs[i], 0)) {
            /* out of memory: what was added stays (the wrapper's sizes are then off; the process is in trouble) */
            PyMem_RawFree(hs);
            return NULL;
        }
        added++;
    }
    PyMem_RawFree(hs);
    return PyLong_FromSsize_t(added);
}

/* touch(slot, hashes, reused) -> reuse count change of the slot's hot blocks (blocks reused at least once) */
static PyObject *Core_touch(Core *c, PyObject *args) {
    Py_ssize_t slot, n, hot = 0;
    PyObject *seq;
    uint64_t *hs;
    int reused;
    if (!PyArg_ParseTuple(args, "nOp:touch", &slot, &seq, &reused))
        return NULL;
    Slot *s = slot_and_hashes(c, slot, seq, &hs, &n);
    if (s == NULL)
        return NULL;
    for (Py_ssize_t i = n - 1; i >= 0; i--) { /* the first block last */
        uint32_t b = lookup(c, hs[i]);
        Py_ssize_t at = b ? find_holder(c, b, (uint32_t)slot) : -1;
        if (at < 0)
            continue;
        uint32_t node = holders(c, b)[at].node;
        if (s->tail != node) {
            unlink_node(c, s, node);
            link_tail(c, s, node);
        }
        if (reused && !c->nodes[node].reuses++)
            hot++;
    }
    s->hot += hot;
    PyMem_RawFree(hs);
    return PyLong_FromSsize_t(hot);
}

/* remove(slot, hashes) -> (how many the slot held, how many of those were hot) */
static PyObject *Core_remove(Core *c, PyObject *args) {
    Py_ssize_t slot, n, gone = 0;
    PyObject *seq;
    uint64_t *hs;
    if (!PyArg_ParseTuple(args, "nO:remove", &slot, &seq))
        return NULL;
    Slot *s = slot_and_hashes(c, slot, seq, &hs, &n);
    if (s == NULL)
        return NULL;
    uint64_t hot = s->hot;
    for (Py_ssize_t i = 0; i < n; i++) {
        uint32_t b = lookup(c, hs[i]);
        Py_ssize_t at = b ? find_holder(c, b, (uint32_t)slot) : -1;
        if (at < 0)
            continue;
        if (drop_pair(c, s, b, at)) {
            PyMem_RawFree(hs);
            return NULL;
        }
        gone++;
    }
    PyMem_RawFree(hs);
    return Py_BuildValue("nK", gone, (unsigned long long)(hot - s->hot));
}

static int clear(Core *c, Slot *s, uint32_t slot) {
    uint32_t n = s->head;
    while (n) {
        uint32_t next = c->nodes[n].next, b = c->nodes[n].block;
        Py_ssize_t at = find_holder(c, b, slot);
        if (drop_pair(c, s, b, at))
            return -1;
        n = next;
    }
    s->head = s->tail = 0;
    s->size = s->hot = 0;
    return 0;
}

/* clear_slot(slot) -> how many blocks it held */
static PyObject *Core_clear_slot(Core *c, PyObject *arg) {
    Py_ssize_t slot = PyLong_AsSsize_t(arg);
    if (slot == -1 && PyErr_Occurred())
        return NULL;
    Slot *s = slot_at(c, slot);
    if (s == NULL)
        return NULL;
    uint64_t n = s->size;
    if (clear(c, s, (uint32_t)slot))
        return NULL;
    return PyLong_FromUnsignedLongLong(n);
}

/* replace(slot, hashes) -> how many blocks the slot holds: `hashes` (first occurrences) in that order, no reuse
   counted; blocks it held already move (no table work), the rest of its old blocks go. */
#define FRESH UINT32_MAX /* the reuse count of a node placed by this replace, until it ends */

static PyObject *Core_replace(Core *c, PyObject *args) {
    Py_ssize_t slot, n;
    PyObject *seq;
    uint64_t *hs;
    if (!PyArg_ParseTuple(args, "nO:replace", &slot, &seq))
        return NULL;
    Slot *s = slot_and_hashes(c, slot, seq, &hs, &n);
    if (s == NULL)
        return NULL;
    uint64_t placed = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        uint32_t b = lookup(c, hs[i]);
        Py_ssize_t at = b ? find_holder(c, b, (uint32_t)slot) : -1;
        if (at >= 0) {
            uint32_t node = holders(c, b)[at].node;
            if (c->nodes[node].reuses == FRESH)
                continue; /* a duplicate */
            unlink_node(c, s, node);
            link_tail(c, s, node);
            c->nodes[node].reuses = FRESH;
        } else if (!place(c, s, (uint32_t)slot, b, -at - 1, hs[i], FRESH)) {
            PyMem_RawFree(hs); /* out of memory: FRESH marks are left on placed nodes (the process is in trouble) */
            return NULL;
        }
        placed++;
    }
    PyMem_RawFree(hs);
    while (s->size > placed) { /* the old blocks not in the snapshot: all ahead of the placed ones */
        uint32_t node = s->head, b = c->nodes[node].block;
        c->nodes[node].reuses = 0;
        if (drop_pair(c, s, b, find_holder(c, b, (uint32_t)slot)))
            return NULL;
    }
    for (uint32_t node = s->head; node; node = c->nodes[node].next)
        c->nodes[node].reuses = 0;
    s->hot = 0;
    return PyLong_FromUnsignedLongLong(s->size);
}

static PyObject *Core_mask(Core *c, PyObject *arg) {
    uint64_t h;
    if (as_hash(arg, &h))
        return NULL;
    return mask_of(c, lookup(c, h));
}

/* masks() -> {hash: bits} of every indexed block (a copy, for checks) */
static PyObject *Core_masks(Core *c, PyObject *Py_UNUSED(ignored)) {
    PyObject *d = PyDict_New();
    if (d == NULL)
        return NULL;
    for (uint32_t b = 1; b <= c->bused; b++) {
        if (!c->bcount[b])
            continue;
        PyObject *k = PyLong_FromUnsignedLongLong(c->bhash[b]), *v = mask_of(c, b);
        if (k == NULL || v == NULL || PyDict_SetItem(d, k, v)) {
            Py_XDECREF(k);
            Py_XDECREF(v);
            Py_DECREF(d);
            return NULL;
        }
        Py_DECREF(k);
        Py_DECREF(v);
    }
    return d;
}

/* blocks(slot, with_reuses, limit=-1) -> {hash: reuses} in eviction order, or a list of the hashes (the first
   `limit` when not negative) */
static PyObject *Core_blocks(Core *c, PyObject *args) {
    Py_ssize_t slot, limit = -1;
    int with_reuses;
    if (!PyArg_ParseTuple(args, "np|n:blocks", &slot, &with_reuses, &limit))
        return NULL;
    Slot *s = slot_at(c, slot);
    if (s == NULL)
        return NULL;
    if (limit < 0 || (uint64_t)limit > s->size)
        limit = (Py_ssize_t)s->size;
    PyObject *out = with_reuses ? PyDict_New() : PyList_New(limit);
    if (out == NULL)
        return NULL;
    Py_ssize_t i = 0;
    for (uint32_t n = s->head; n && i < limit; n = c->nodes[n].next, i++) {
        PyObject *k = PyLong_FromUnsignedLongLong(c->bhash[c->nodes[n].block]);
        if (k == NULL)
            goto fail;
        if (!with_reuses) {
            PyList_SET_ITEM(out, i, k);
            continue;
        }
        PyObject *v = PyLong_FromUnsignedLong(c->nodes[n].reuses);
        int bad = v == NULL || PyDict_SetItem(out, k, v);
        Py_DECREF(k);
        Py_XDECREF(v);
        if (bad)
            goto fail;
    }
    return out;
fail:
    Py_DECREF(out);
    return NULL;
}

/* holding(slot, hashes) -> the set of those the slot holds */
static PyObject *Core_holding(Core *c, PyObject *args) {
    Py_ssize_t slot;
    PyObject *seq;
    if (!PyArg_ParseTuple(args, "nO:holding", &slot, &seq))
        return NULL;
    if (slot_at(c, slot) == NULL)
        return NULL;
    PyObject *out = PySet_New(NULL), *it = PyObject_GetIter(seq), *o;
    if (out == NULL || it == NULL)
        goto fail;
    while ((o = PyIter_Next(it)) != NULL) {
        uint64_t h;
        if (as_hash(o, &h)) {
            Py_DECREF(o);
            goto fail;
        }
        uint32_t b = lookup(c, h);
        int bad = b && find_holder(c, b, (uint32_t)slot) >= 0 && PySet_Add(out, o);
        Py_DECREF(o);
        if (bad)
            goto fail;
    }
    if (PyErr_Occurred())
        goto fail;
    Py_DECREF(it);
    return out;
fail:
    Py_XDECREF(it);
    Py_XDECREF(out);
    return NULL;
}

static PyObject *Core_holds(Core *c, PyObject *args) {
    Py_ssize_t slot;
    PyObject *ho;
    uint64_t h;
    if (!PyArg_ParseTuple(args, "nO:holds", &slot, &ho) || as_hash(ho, &h) || slot_at(c, slot) == NULL)
        return NULL;
    uint32_t b = lookup(c, h);
    return PyBool_FromLong(b && find_holder(c, b, (uint32_t)slot) >= 0);
}

/* memory() -> bytes this map has allocated (tables, blocks, holders, nodes, slots) */
static PyObject *Core_memory(Core *c, PyObject *Py_UNUSED(ignored)) {
    uint64_t bytes = (c->tmask + 1) * (sizeof(uint64_t) + sizeof(uint32_t));
    bytes += (uint64_t)c->balloc * (sizeof(uint64_t) + 2 * sizeof(uint32_t) + sizeof(Holders));
    bytes += (uint64_t)c->bfreecap * sizeof(uint32_t) + (uint64_t)c->nalloc * sizeof(Node);
    bytes += (uint64_t)c->nslots * sizeof(Slot);
    for (uint32_t b = 1; b <= c->bused; b++)
        if (c->bcap[b] > 1)
            bytes += (uint64_t)c->bcap[b] * sizeof(Holder);
    return PyLong_FromUnsignedLongLong(bytes);
}

static PyMethodDef Core_methods[] = {
    {"add", (PyCFunction)Core_add, METH_VARARGS, "add(slot, hashes) -> how many were new to the slot"},
    {"touch", (PyCFunction)Core_touch, METH_VARARGS, "touch(slot, hashes, reused) -> change of the slot's hot count"},
    {"remove", (PyCFunction)Core_remove, METH_VARARGS, "remove(slot, hashes) -> (removed, of them hot)"},
    {"clear_slot", (PyCFunction)Core_clear_slot, METH_O, "clear_slot(slot) -> how many blocks it held"},
    {"replace", (PyCFunction)Core_replace, METH_VARARGS, "replace(slot, hashes) -> how many blocks it holds"},
    {"hot_victims", (PyCFunction)Core_hot_victims, METH_VARARGS, "hot_victims(slot, k, keep) -> reused victims"},
    {"overlap_groups", (PyCFunction)Core_overlap_groups, METH_VARARGS, "overlap_groups(hashes, mask) -> groups"},
    {"mask", (PyCFunction)Core_mask, METH_O, "mask(hash) -> bits of the slots holding it"},
    {"masks", (PyCFunction)Core_masks, METH_NOARGS, "masks() -> {hash: bits}"},
    {"blocks", (PyCFunction)Core_blocks, METH_VARARGS, "blocks(slot, with_reuses) -> dict or list, LRU first"},
    {"holding", (PyCFunction)Core_holding, METH_VARARGS, "holding(slot, hashes) -> set"},
    {"holds", (PyCFunction)Core_holds, METH_VARARGS, "holds(slot, hash) -> bool"},
    {"memory", (PyCFunction)Core_memory, METH_NOARGS, "memory() -> bytes allocated"},
    {NULL, NULL, 0, NULL},
};

static PySequenceMethods Core_as_sequence = {
    .sq_length = (lenfunc)Core_len,
};

static PyTypeObject CoreType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "meshllm.router.kv._blockcore.BlockCore",
    .tp_basicsize = sizeof(Core),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Block hash -> slots holding it, and each slot's blocks in eviction order (see compiled.py).",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Core_init,
    .tp_dealloc = (destructor)Core_dealloc,
    .tp_methods = Core_methods,
    .tp_as_sequence = &Core_as_sequence,
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "_blockcore",
    .m_doc = "The KV index's block map in C (meshllm.router.kv.compiled).",
    .m_size = -1,
};

PyMODINIT_FUNC PyInit__blockcore(void) {
    if (PyType_Ready(&CoreType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    Py_INCREF(&CoreType);
    if (PyModule_AddObject(m, "BlockCore", (PyObject *)&CoreType) < 0) {
        Py_DECREF(&CoreType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
