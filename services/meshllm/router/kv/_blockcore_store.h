/* The C block map's store (_blockcore.c): the hash table, blocks and their holders, slots and their lists. */

#ifndef MESHLLM_BLOCKCORE_STORE_H
#define MESHLLM_BLOCKCORE_STORE_H

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


#endif /* MESHLLM_BLOCKCORE_STORE_H */
