/* The KV index's block map in C: block hash -> the slots holding it, and each slot's blocks in eviction order.

   The same answers as the Python map in blocks.py (tests/unit/test_block_map_equivalence.py checks both against
   one reference), in a layout that costs ~60 bytes per (slot, block) pair at fleet scale instead of ~160
   (docs/routing.md "The KV index"):

   - an open-addressing table, hash -> block id (linear probing, deletion by backward shift);
   - per block id: its hash and its holders, (slot, node) pairs sorted by slot (one inline, more in an array);
   - per pair a node of its slot's doubly linked list, least recently used first, with the block's reuse count.

   Slot numbers are given out by the Python wrapper (compiled.py); this module only grows its slot table. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    uint32_t slot, node;
} Holder;

typedef struct {
    uint32_t prev, next, block, reuses; /* node 0 is nil */
} Node;

typedef struct {
    uint32_t head, tail;
    uint64_t size, hot;
} Slot;

typedef union {
    Holder one;   /* cap <= 1 */
    Holder *many; /* cap > 1 */
} Holders;

typedef struct {
    PyObject_HEAD
    uint64_t *tkeys;
    uint32_t *tvals; /* 0: empty */
    uint64_t tmask, tcount;
    uint64_t *bhash;   /* block id -> hash */
    uint32_t *bcount;  /* block id -> holders */
    uint32_t *bcap;    /* block id -> holder capacity */
    Holders *bh;       /* block id -> holders */
    uint32_t bused;    /* ids handed out so far (id 0 never) */
    uint32_t balloc;   /* capacity of the block arrays */
    uint32_t *bfree;
    uint32_t nbfree, bfreecap;
    uint64_t live;
    Node *nodes;
    uint32_t nused, nalloc, nfree; /* nfree: head of the free node list (through next) */
    Slot *slots;
    uint32_t nslots;
    uint64_t version; /* bumped whenever a block id is given out or freed */
    PyObject *keep_obj;
    uint64_t keep_version;
    uint32_t *keep_ids;
    Py_ssize_t nkeep;
} Core;

static inline uint64_t mix(uint64_t x) {
    x ^= x >> 30;
    x *= 0xbf58476d1ce4e5b9ULL;
    x ^= x >> 27;
    x *= 0x94d049bb133111ebULL;
    x ^= x >> 31;
    return x;
}

static int grow(void **p, size_t item, uint64_t n) {
    void *q = PyMem_RawRealloc(*p, item * (size_t)n);
    if (q == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    *p = q;
    return 0;
}

/* ------------------------------------------------------------ hash table */
static uint32_t lookup(Core *c, uint64_t h) {
    uint64_t i = mix(h) & c->tmask;
    for (;;) {
        uint32_t v = c->tvals[i];
        if (!v || c->tkeys[i] == h)
            return v;
        i = (i + 1) & c->tmask;
    }
}

static void table_put(uint64_t *keys, uint32_t *vals, uint64_t mask, uint64_t h, uint32_t v) {
    uint64_t i = mix(h) & mask;
    while (vals[i])
        i = (i + 1) & mask;
    keys[i] = h;
    vals[i] = v;
}

static int table_insert(Core *c, uint64_t h, uint32_t v) {
    if ((c->tcount + 1) * 4 > (c->tmask + 1) * 3) { /* load 0.75: double */
        uint64_t cap = (c->tmask + 1) * 2;
        uint64_t *keys = PyMem_RawMalloc(cap * sizeof(uint64_t));
        uint32_t *vals = PyMem_RawCalloc(cap, sizeof(uint32_t));
        if (keys == NULL || vals == NULL) {
            PyMem_RawFree(keys);
            PyMem_RawFree(vals);
            PyErr_NoMemory();
            return -1;
        }
        for (uint64_t i = 0; i <= c->tmask; i++)
            if (c->tvals[i])
                table_put(keys, vals, cap - 1, c->tkeys[i], c->tvals[i]);
        PyMem_RawFree(c->tkeys);
        PyMem_RawFree(c->tvals);
        c->tkeys = keys;
        c->tvals = vals;
        c->tmask = cap - 1;
    }
    table_put(c->tkeys, c->tvals, c->tmask, h, v);
    c->tcount++;
    return 0;
}

static void table_delete(Core *c, uint64_t h) {
    uint64_t mask = c->tmask, i = mix(h) & mask;
    while (c->tvals[i] && c->tkeys[i] != h)
        i = (i + 1) & mask;
    if (!c->tvals[i])
        return;
    uint64_t j = i;
    for (;;) { /* backward shift: entries after the hole that may move into it do */
        j = (j + 1) & mask;
        if (!c->tvals[j])
            break;
        uint64_t k = mix(c->tkeys[j]) & mask;
        if ((j > i && (k <= i || k > j)) || (j < i && k <= i && k > j)) {
            c->tkeys[i] = c->tkeys[j];
            c->tvals[i] = c->tvals[j];
            i = j;
        }
    }
    c->tvals[i] = 0;
    c->tcount--;
}

/* ------------------------------------------------------------ blocks and holders */
static inline Holder *holders(Core *c, uint32_t b) { return c->bcap[b] <= 1 ? &c->bh[b].one : c->bh[b].many; }

static uint32_t new_block(Core *c, uint64_t h) {
    uint32_t b;
    if (c->nbfree) {
        b = c->bfree[--c->nbfree];
    } else {
        if (c->bused + 1 >= c->balloc) {
            uint64_t n = c->balloc ? (uint64_t)c->balloc * 2 : 1024;
            if (n > UINT32_MAX) {
                PyErr_SetString(PyExc_MemoryError, "the KV index holds 2^32 blocks");
                return 0;
            }
            if (grow((void **)&c->bhash, sizeof(uint64_t), n) || grow((void **)&c->bcount, sizeof(uint32_t), n) ||
                grow((void **)&c->bcap, sizeof(uint32_t), n) || grow((void **)&c->bh, sizeof(Holders), n))
                return 0;
            c->balloc = (uint32_t)n;
        }
        b = ++c->bused;
    }
    if (table_insert(c, h, b)) {
        if (b == c->bused && !(c->nbfree < c->bfreecap && c->bfree[c->nbfree] == b))
            c->bused--; /* a fresh id: not handed out */
        else
            c->nbfree++; /* back on the free list it came from */
        return 0;
    }
    c->bhash[b] = h;
    c->bcount[b] = 0;
    c->bcap[b] = 0;
    c->live++;
    c->version++;
    return b;
}

static int free_block(Core *c, uint32_t b) {
    table_delete(c, c->bhash[b]);
    if (c->bcap[b] > 1)
        PyMem_RawFree(c->bh[b].many);
    c->bcap[b] = 0;
    c->bcount[b] = 0;
    if (c->nbfree >= c->bfreecap) {
        uint64_t n = c->bfreecap ? (uint64_t)c->bfreecap * 2 : 1024;
        if (grow((void **)&c->bfree, sizeof(uint32_t), n))
            return -1;
        c->bfreecap = (uint32_t)n;
    }
    c->bfree[c->nbfree++] = b;
    c->live--;
    c->version++;
    return 0;
}

/* Index of `slot` among block b's holders, or -(insertion point) - 1. */
static Py_ssize_t find_holder(Core *c, uint32_t b, uint32_t slot) {
    Holder *hs = holders(c, b);
    Py_ssize_t lo = 0, hi = (Py_ssize_t)c->bcount[b];
    while (lo < hi) {
        Py_ssize_t mid = (lo + hi) >> 1;
        if (hs[mid].slot < slot)
            lo = mid + 1;
        else
            hi = mid;
    }
    if (lo < (Py_ssize_t)c->bcount[b] && hs[lo].slot == slot)
        return lo;
    return -lo - 1;
}

static int insert_holder(Core *c, uint32_t b, Py_ssize_t at, uint32_t slot, uint32_t node) {
    uint32_t n = c->bcount[b], cap = c->bcap[b];
    if (n == 0) {
        c->bh[b].one.slot = slot;
        c->bh[b].one.node = node;
        c->bcap[b] = 1;
        c->bcount[b] = 1;
        return 0;
    }
    if (n == cap) {
        uint32_t ncap = cap < 4 ? 4 : cap * 2;
        Holder *hs;
        if (cap <= 1) {
            hs = PyMem_RawMalloc(ncap * sizeof(Holder));
            if (hs == NULL) {
                PyErr_NoMemory();
                return -1;
            }
            hs[0] = c->bh[b].one;
        } else {
            hs = PyMem_RawRealloc(c->bh[b].many, ncap * sizeof(Holder));
            if (hs == NULL) {
                PyErr_NoMemory();
                return -1;
            }
        }
        c->bh[b].many = hs;
        c->bcap[b] = ncap;
    }
    Holder *hs = holders(c, b);
    memmove(hs + at + 1, hs + at, (size_t)(n - at) * sizeof(Holder));
    hs[at].slot = slot;
    hs[at].node = node;
    c->bcount[b] = n + 1;
    return 0;
}

static void erase_holder(Core *c, uint32_t b, Py_ssize_t at) {
    uint32_t n = c->bcount[b] - 1;
    Holder *hs = holders(c, b);
    memmove(hs + at, hs + at + 1, (size_t)(n - at) * sizeof(Holder));
    c->bcount[b] = n;
    if (n == 1 && c->bcap[b] > 1) { /* back inline: most blocks have one holder */
        Holder one = hs[0];
        PyMem_RawFree(hs);
        c->bh[b].one = one;
        c->bcap[b] = 1;
    }
}

/* ------------------------------------------------------------ slots and nodes */
static Slot *slot_at(Core *c, Py_ssize_t s) {
    if (s < 0 || s >= UINT32_MAX) {
        PyErr_Format(PyExc_IndexError, "slot %zd out of range", s);
        return NULL;
    }
    if ((uint64_t)s >= c->nslots) {
        uint64_t n = c->nslots ? c->nslots : 16;
        while (n <= (uint64_t)s)
            n *= 2;
        if (grow((void **)&c->slots, sizeof(Slot), n))
            return NULL;
        memset(c->slots + c->nslots, 0, (size_t)(n - c->nslots) * sizeof(Slot));
        c->nslots = (uint32_t)n;
    }
    return &c->slots[s];
}

static uint32_t new_node(Core *c, uint32_t b) {
    uint32_t n;
    if (c->nfree) {
        n = c->nfree;
        c->nfree = c->nodes[n].next;
    } else {
        if (c->nused + 1 >= c->nalloc) {
            uint64_t cap = c->nalloc ? (uint64_t)c->nalloc * 2 : 4096;
            if (cap > UINT32_MAX) {
                PyErr_SetString(PyExc_MemoryError, "the KV index holds 2^32 pairs");
                return 0;
            }
            if (grow((void **)&c->nodes, sizeof(Node), cap))
                return 0;
            c->nalloc = (uint32_t)cap;
        }
        n = ++c->nused;
    }
    c->nodes[n].block = b;
    c->nodes[n].reuses = 0;
    return n;
}

static inline void link_tail(Core *c, Slot *s, uint32_t n) {
    Node *nodes = c->nodes;
    nodes[n].prev = s->tail;
    nodes[n].next = 0;
    if (s->tail)
        nodes[s->tail].next = n;
    else
        s->head = n;
    s->tail = n;
}

static inline void unlink_node(Core *c, Slot *s, uint32_t n) {
    Node *nodes = c->nodes;
    uint32_t p = nodes[n].prev, x = nodes[n].next;
    if (p)
        nodes[p].next = x;
    else
        s->head = x;
    if (x)
        nodes[x].prev = p;
    else
        s->tail = p;
}

static inline void free_node(Core *c, uint32_t n) {
    c->nodes[n].next = c->nfree;
    c->nfree = n;
}

/* Drop the pair (slot, block) whose holder entry is at `at`; the block goes when nobody holds it. */
static int drop_pair(Core *c, Slot *s, uint32_t b, Py_ssize_t at) {
    uint32_t n = holders(c, b)[at].node;
    if (c->nodes[n].reuses)
        s->hot--;
    unlink_node(c, s, n);
    free_node(c, n);
    s->size--;
    erase_holder(c, b, at);
    return c->bcount[b] ? 0 : free_block(c, b);
}

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
