/* storage_backends._pageio: the file backend's batch reads and writes, and the check and
 * framing of pages, run without the GIL. Optional: without it memory://, redis:// and grpc://
 * run on the same checks in Python (portable.py, which answers the same), and file:// says
 * what to install (native.py).
 *
 * What it does, and nothing more:
 *   - xxh3_64(a, b): XXH3-64 (seed 0) of a + b, the checksum of every page: the xxHash
 *     library's, from its header (libxxhash-dev), with its AVX2 and AVX-512 kernels where the
 *     CPU has them (_xxh3_wide.h); this file has no hash of its own;
 *   - check_object(): the check of a stored object (check_parts below: header, lengths,
 *     checksum), answering 1 or the number of the reason; verify.check_object names it;
 *   - read_stretches(): read runs of neighbouring pages of packs with reads that never wait
 *     (RWF_NOWAIT: page-cache hits only) straight into the caller's buffers, a window at a
 *     time, and check each page as it lands (check_head, then its checksum a window at a
 *     time, through the library's streaming state), on this thread and up to `threads - 1`
 *     pool threads;
 *   - check_copy(): check whole objects held in memory (a network backend's replies) and copy
 *     each payload into its page, several at once;
 *   - frame_headers(): build the object headers (checksum included) of a batch of pages;
 *   - frame_copies(): copy a batch of pages into one buffer as whole objects, each framed
 *     over its copy as it is made (a staged put: one pass over the pages);
 *   - write_packs(): frame and write the packs of a batch, a thread per pack;
 *   - link_all(): hard-link packs' pages into place, several names at once;
 *   - sync_all(): fsync a batch's packs and the folders it linked names into, all at once.
 *
 * Python keeps every decision: which pages form a stretch, which pack a page goes to, what a
 * failed check is called (CorruptReason, by the numbers below), the MAC of a tenant secret
 * (HMAC-SHA256, hashlib), lz4, and the guard that keeps late writes out of buffers a call has
 * given back. The object format is the one in objects.py; `PLAIN_BYTES` etc. below must match
 * it (checked by the tests against objects.py).
 *
 * Why C: in Python a page read from the page cache costs a copy, an xxh3 and a few
 * microseconds of interpreter, and threads cannot share a batch because they take turns on
 * the GIL between copies. Here a batch's stretches are shared by threads that never touch the
 * interpreter. Writes likewise: a pack per thread, each framed (the xxh3 of every page) and
 * written with no interpreter between the system calls. Measured by
 * benchmarks/bench_file_read.py (reads against the host's plain parallel read),
 * benchmarks/bench_backends.py (file:// against bare Python file I/O) and
 * benchmarks/bench_checksum.py (the hash); the figures are in docs/performance.md.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <unistd.h>

/* -- the glibc this module asks for ------------------------------------------------------------ */

/* One wheel installs on any Linux with glibc 2.17 or newer (manylinux2014), whatever glibc it was
 * built on: the module asks only for symbol versions that old. Two are newer on a current glibc:
 * pthread_create and pthread_attr_setstacksize, moved into libc at 2.34 under a new version and
 * still exported under their first one, which is the one bound here; and preadv2 (2.26), called
 * through syscall(2) instead (the kernel's call is from Linux 4.6; before it the read gets
 * ENOSYS and takes the plain path, as read_one_stretch already does for a file system without
 * RWF_NOWAIT). `.ci/wheel` checks the outcome (auditwheel names the lowest tag that holds). */
#if defined(__x86_64__) && defined(__GLIBC__) && defined(__GLIBC_PREREQ)
#if __GLIBC_PREREQ(2, 34)
__asm__(".symver pthread_create,pthread_create@GLIBC_2.2.5");
__asm__(".symver pthread_attr_setstacksize,pthread_attr_setstacksize@GLIBC_2.2.5");
#endif
#endif

#ifndef RWF_NOWAIT
#define RWF_NOWAIT 0x00000008 /* the kernel's value (linux/fs.h), absent from old glibc headers */
#endif

static ssize_t preadv_nowait(int fd, const struct iovec *iov, int count, long long offset) {
#ifdef SYS_preadv2
    /* the offset as (low, high) words; on a 64-bit kernel the low word holds all of it */
    return syscall(SYS_preadv2, fd, iov, count, (unsigned long)offset, 0UL, RWF_NOWAIT);
#else
    (void)fd, (void)iov, (void)count, (void)offset;
    errno = ENOSYS;
    return -1;
#endif
}

#if __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "the object format is little-endian and so is this implementation"
#endif

/* -- the object header (objects.py) ---------------------------------------------------------- */

#define PLAIN_BYTES 48    /* magic .. raw length: what the checksum covers before the layout */
#define FIXED_BYTES 56    /* + the checksum */
#define UNHASHED_BYTES (FIXED_BYTES - PLAIN_BYTES) /* the checksum does not cover itself */
#define KEY_OFFSET 16
#define KEY_BYTES 16
#define STORED_OFFSET 32  /* stored payload length, then the raw length at 40 */
#define MAX_IOV 1024
#define MAX_LAYOUT_BYTES 0xFFFF /* the layout length is a u16 */

/* -- XXH3-64: the xxHash library's (its header, inlined) --------------------------------------- */

/* Every checksum is XXH3-64 (seed 0) from the xxHash library's own header, compiled into this
 * module (Debian/Ubuntu: libxxhash-dev). Its one-shot hash is fixed at compile time to the
 * build's baseline vector unit (SSE2 on x86-64), so the bytes are taken in by its streaming
 * update, which runs with the widest unit the CPU has: the library's AVX2 and AVX-512 kernels,
 * compiled for those units in _xxh3_avx2.c and _xxh3_avx512.c and picked at module init. */
#define XXH_INLINE_ALL
#include <xxhash.h>
#include "_xxh3_wide.h"

typedef int (*update_fn)(void *state, const void *in, size_t len);

static int update_baseline(void *state, const void *in, size_t len) {
    return XXH3_64bits_update((XXH3_state_t *)state, in, len) == XXH_OK ? 0 : -1;
}

static update_fn hash_update = update_baseline; /* the widest the CPU has: module init */

/* The hashed input as pieces in order (a header's fields, its layout, a payload in chunks):
 * `count` iovecs, concatenated. A cursor walks them. */
typedef struct {
    const struct iovec *piece;
    const struct iovec *end;
    size_t offset; /* into *piece */
} cursor_t;

/* XXH3-64 of an input taken in as its bytes become ready (a reader hashes each window of a
 * page while the window is still in the core's cache), or all at once (hash_pieces): the
 * library's streaming state, fed each piece's bytes where they lie. */
typedef struct {
    XXH3_state_t state; /* (64-byte aligned: on the stack, never in a malloc'd block) */
    cursor_t at;        /* the first byte not taken in yet */
    size_t len;         /* the whole input's bytes */
    size_t taken;       /* bytes taken in so far */
} stream_t;

static void stream_start(stream_t *st, const struct iovec *pieces, int count, size_t len) {
    XXH3_64bits_reset(&st->state);
    st->at = (cursor_t){pieces, pieces + count, 0};
    st->len = len;
    st->taken = 0;
}

/* Take in the input's first `ready` bytes (those not taken in yet). */
static void stream_take(stream_t *st, size_t ready) {
    cursor_t *at = &st->at;
    if (ready > st->len)
        ready = st->len;
    while (st->taken < ready) {
        size_t left = at->piece->iov_len - at->offset;
        if (left == 0) {
            at->piece++;
            at->offset = 0;
            continue;
        }
        size_t take = left < ready - st->taken ? left : ready - st->taken;
        hash_update(&st->state, (const uint8_t *)at->piece->iov_base + at->offset, take);
        at->offset += take;
        st->taken += take;
    }
}

/* The hash, once every byte of the input is in place. */
static uint64_t stream_end(stream_t *st) {
    stream_take(st, st->len);
    return XXH3_64bits_digest(&st->state);
}

/* XXH3-64 (seed 0) of the concatenation of `count` pieces: the one hash of every checksum. */
static uint64_t hash_pieces(const struct iovec *pieces, int count) {
    size_t len = 0;
    for (int i = 0; i < count; i++)
        len += pieces[i].iov_len;
    stream_t st;
    stream_start(&st, pieces, count, len);
    return stream_end(&st);
}

/* -- the object check ------------------------------------------------------------------------- */

/* What a check found: VERIFIED, or why not (objects.CorruptReason, in Python, by these
 * numbers: verify._REASONS), or SPLIT_HEADER (the header straddles two parts: the caller
 * joins them and asks again). 0 is left for "not checked" in a batch's results. */
enum {
    UNCHECKED = 0,
    VERIFIED = 1,
    BAD_MAGIC,
    BAD_VERSION,
    BAD_KEY,
    BAD_LAYOUT,
    BAD_LENGTH,
    BAD_TRUNCATED,
    BAD_CHECKSUM,
    BAD_COMPRESSION,
    SPLIT_HEADER,
    HEAD_OK, /* (check_head's answer: all but the checksum holds; never a result) */
};

#define MAGIC "HCKV"
#define SIGNED_VERSION 2
#define MAC_BYTES 32
#define MAX_PAYLOAD_BYTES (1ULL << 30)
#define LZ4_MAX_RATIO 255ULL
#define MAX_PARTS MAX_IOV

typedef struct {
    const uint8_t *key;    /* KEY_BYTES */
    const uint8_t *layout; /* NULL: any layout (the daemon stores every layout) */
    size_t layout_len;
    long long raw_bytes; /* the payload's size once decoded; -1: any */
} expect_t;

typedef struct {
    size_t header_bytes;
    int compression; /* 0 none, 1 lz4 */
} found_t;

static inline uint16_t load16(const uint8_t *p) {
    uint16_t v;
    memcpy(&v, p, 2);
    return v;
}

static inline uint64_t load64(const uint8_t *p) {
    uint64_t v;
    memcpy(&v, p, 8);
    return v;
}

/* check_parts' checks before the checksum, in the order they are applied, so that the reason
 * named is the first thing wrong: magic, version and flags, codec, key, layout, every length
 * (against the header, the bytes of the parts and the size expected). HEAD_OK when they all
 * hold, with `found` filled in. The parts' lengths count, not their bytes past the header: a
 * reader may check a header before its payload has arrived.
 * (Past 40 lines on purpose: the checks read best in the order they are applied.) */
static int check_head(const struct iovec *parts, int count, const expect_t *want,
                      found_t *found) {
    const uint8_t *head = parts[0].iov_base;
    size_t first = parts[0].iov_len, total = 0;
    for (int i = 0; i < count; i++)
        total += parts[i].iov_len;
    if (first < FIXED_BYTES) {
        if (total >= FIXED_BYTES && count > 1)
            return SPLIT_HEADER;
        return memcmp(head, MAGIC, first < 4 ? first : 4) == 0 ? BAD_TRUNCATED : BAD_MAGIC;
    }
    if (memcmp(head, MAGIC, 4) != 0)
        return BAD_MAGIC;
    uint16_t version = load16(head + 4), layout_len = load16(head + 8);
    int codec = head[6], flags = head[7];
    if ((version != 1 && version != SIGNED_VERSION) || flags != 0)
        return BAD_VERSION;
    if (codec > 1)
        return BAD_COMPRESSION;
    size_t header_bytes = FIXED_BYTES + layout_len + (version == SIGNED_VERSION ? MAC_BYTES : 0);
    if (first < header_bytes)
        return total >= header_bytes && count > 1 ? SPLIT_HEADER : BAD_TRUNCATED;
    if (memcmp(head + KEY_OFFSET, want->key, KEY_BYTES) != 0)
        return BAD_KEY;
    if (want->layout != NULL &&
        (layout_len != want->layout_len || memcmp(head + FIXED_BYTES, want->layout, layout_len)))
        return BAD_LAYOUT;
    uint64_t stored = load64(head + STORED_OFFSET), raw = load64(head + STORED_OFFSET + 8);
    uint64_t present = total - header_bytes;
    if (present < stored)
        return BAD_TRUNCATED;
    if (present > stored)
        return BAD_LENGTH;
    if (codec == 0 && raw != stored)
        return BAD_LENGTH;
    uint64_t bound = LZ4_MAX_RATIO * stored + 64; /* sizes a decompression buffer */
    if (raw > (bound < MAX_PAYLOAD_BYTES ? bound : MAX_PAYLOAD_BYTES))
        return BAD_LENGTH;
    if (want->raw_bytes >= 0 && raw != (uint64_t)want->raw_bytes)
        return BAD_LENGTH;
    found->header_bytes = header_bytes;
    found->compression = codec;
    return HEAD_OK;
}

/* What the checksum of an object in `parts` (its header checked: `header_bytes`) covers, as
 * pieces in order: every header byte but the checksum's, then the rest of the parts. Returns
 * the number of pieces, count + 2; `pieces` has room for MAX_PARTS + 2. */
static int hashed_pieces(const struct iovec *parts, int count, size_t header_bytes,
                         struct iovec *pieces) {
    const uint8_t *head = parts[0].iov_base;
    pieces[0] = (struct iovec){(void *)head, PLAIN_BYTES};
    pieces[1] = (struct iovec){(void *)(head + FIXED_BYTES), header_bytes - FIXED_BYTES};
    pieces[2] = (struct iovec){(void *)(head + header_bytes), parts[0].iov_len - header_bytes};
    for (int i = 1; i < count; i++)
        pieces[2 + i] = parts[i];
    return count + 2;
}

/* The one check of a stored object, `count` parts (at most MAX_PARTS) whose concatenation is
 * the object: its header (check_head), then the checksum over every byte but its own. The MAC
 * of a version 2 object is the caller's (verify.check_object: HMAC-SHA256 under the
 * tenant's key). */
static int check_parts(const struct iovec *parts, int count, const expect_t *want,
                       found_t *found) {
    int code = check_head(parts, count, want, found);
    if (code != HEAD_OK)
        return code;
    struct iovec pieces[MAX_PARTS + 2];
    int num = hashed_pieces(parts, count, found->header_bytes, pieces);
    const uint8_t *head = parts[0].iov_base;
    return hash_pieces(pieces, num) == load64(head + PLAIN_BYTES) ? VERIFIED : BAD_CHECKSUM;
}

/* -- a small pool of threads that every batch in flight shares ------------------------------- */

/* Batches posted by callers on several threads at once (the file backend reads a prefix as
 * parallel batches) share one pool: a pool thread takes a unit of the oldest batch that still
 * wants helpers and has units left, and moves on to the next batch when that one runs dry. So
 * N concurrent callers never start N pools' worth of threads, and no caller runs alone while
 * the pool idles. */
typedef struct batch batch_t;
struct batch {
    size_t num_units;
    atomic_size_t next; /* first unclaimed unit */
    void (*run)(batch_t *, size_t unit);
    void *data;
    int helpers_wanted; /* pool threads that may still join */
    int helpers_active; /* pool threads inside run() for this batch */
    batch_t *later;     /* the next batch posted, in pool.first's list */
};

static struct {
    pthread_mutex_t lock;
    pthread_cond_t wake;     /* a batch was posted */
    pthread_cond_t finished; /* a helper left a batch */
    int num_threads;
    batch_t *first; /* batches in flight, oldest first */
} pool = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, PTHREAD_COND_INITIALIZER, 0, NULL};

#define MAX_POOL_THREADS 64

static void work_on(batch_t *batch) {
    size_t unit;
    while ((unit = atomic_fetch_add(&batch->next, 1)) < batch->num_units)
        batch->run(batch, unit);
}

/* The oldest batch in flight that a helper may join and that has work left; called locked. */
static batch_t *wanting_help(void) {
    for (batch_t *b = pool.first; b != NULL; b = b->later)
        if (b->helpers_wanted > 0 && atomic_load(&b->next) < b->num_units)
            return b;
    return NULL;
}

static void *pool_thread(void *unused) {
    (void)unused;
    pthread_mutex_lock(&pool.lock);
    for (;;) {
        batch_t *batch;
        while ((batch = wanting_help()) == NULL)
            pthread_cond_wait(&pool.wake, &pool.lock);
        batch->helpers_wanted--;
        batch->helpers_active++;
        pthread_mutex_unlock(&pool.lock);
        work_on(batch);
        pthread_mutex_lock(&pool.lock);
        if (--batch->helpers_active == 0)
            pthread_cond_broadcast(&pool.finished);
    }
    return NULL;
}

static void reset_after_fork(void) {
    /* the child has none of the parent's threads: start from an empty pool */
    pthread_mutex_init(&pool.lock, NULL);
    pthread_cond_init(&pool.wake, NULL);
    pthread_cond_init(&pool.finished, NULL);
    pool.num_threads = 0;
    pool.first = NULL;
}

/* Start pool threads until there are `wanted` (fewer if the system refuses); called locked. */
static void grow_pool(int wanted) {
    while (pool.num_threads < wanted) {
        pthread_t thread;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        pthread_attr_setstacksize(&attr, 512 << 10); /* > 2 scratch headers */
        int failed = pthread_create(&thread, &attr, pool_thread, NULL);
        pthread_attr_destroy(&attr);
        if (failed)
            break;
        pool.num_threads++;
    }
}

/* Run every unit of `batch` on this thread and up to `threads - 1` pool threads; returns when
 * all are done. Called without the GIL, from any number of threads at once: their batches
 * share the pool, whose size is the largest `threads - 1` asked for. */
static void run_batch(batch_t *batch, int threads) {
    int helpers = threads - 1;
    if (helpers > (int)batch->num_units - 1)
        helpers = (int)batch->num_units - 1;
    if (helpers > MAX_POOL_THREADS)
        helpers = MAX_POOL_THREADS;
    if (helpers <= 0) {
        work_on(batch);
        return;
    }
    pthread_mutex_lock(&pool.lock);
    grow_pool(helpers);
    if (helpers > pool.num_threads)
        helpers = pool.num_threads;
    batch->helpers_wanted = helpers;
    batch->helpers_active = 0;
    batch->later = NULL;
    batch_t **tail = &pool.first;
    while (*tail != NULL)
        tail = &(*tail)->later;
    *tail = batch;
    for (int i = 0; i < helpers; i++)
        pthread_cond_signal(&pool.wake);
    pthread_mutex_unlock(&pool.lock);

    work_on(batch);

    pthread_mutex_lock(&pool.lock);
    batch->helpers_wanted = 0; /* every unit is claimed: no helper joins it now */
    while (batch->helpers_active > 0)
        pthread_cond_wait(&pool.finished, &pool.lock);
    for (batch_t **link = &pool.first; *link != NULL; link = &(*link)->later)
        if (*link == batch) {
            *link = batch->later;
            break;
        }
    pthread_mutex_unlock(&pool.lock);
}

/* Run every unit of `batch` (its num_units, run and data set) with the GIL released. */
static void run_without_gil(batch_t *batch, int threads) {
    atomic_init(&batch->next, 0);
    Py_BEGIN_ALLOW_THREADS
    run_batch(batch, threads);
    Py_END_ALLOW_THREADS
}

/* -- buffers ---------------------------------------------------------------------------------- */

typedef struct {
    Py_buffer *views;
    Py_ssize_t count;
} held_t;

static void release_all(held_t *held) {
    for (Py_ssize_t i = 0; i < held->count; i++)
        PyBuffer_Release(&held->views[i]);
    PyMem_Free(held->views);
    held->views = NULL;
    held->count = 0;
}

/* Take a buffer (writable if asked) into held->views[held->count]; NULL with an exception. */
static Py_buffer *hold(held_t *held, PyObject *obj, int writable, const char *what) {
    Py_buffer *view = &held->views[held->count];
    if (PyObject_GetBuffer(obj, view, writable ? PyBUF_WRITABLE : PyBUF_SIMPLE) < 0) {
        PyErr_Format(PyExc_TypeError, "%s: a contiguous%s buffer is needed", what,
                     writable ? " writable" : "");
        return NULL;
    }
    held->count++;
    return view;
}

/* Take every item of `list` into held (as hold does); 0 with an exception. */
static int hold_list(held_t *held, PyObject *list, int writable, const char *what) {
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(list); i++)
        if (hold(held, PyList_GET_ITEM(list, i), writable, what) == NULL)
            return 0;
    return 1;
}

/* A list of the ints at first, first + stride, ... (n of them): an errno per item, say, kept
 * in an array or in a field of an array of structs. NULL with an exception. */
static PyObject *int_list(const void *first, size_t stride, Py_ssize_t n) {
    PyObject *list = PyList_New(n);
    for (Py_ssize_t i = 0; list != NULL && i < n; i++) {
        PyObject *value = PyLong_FromLong(*(const int *)((const char *)first + stride * (size_t)i));
        if (value == NULL)
            Py_CLEAR(list);
        else
            PyList_SET_ITEM(list, i, value);
    }
    return list;
}

/* -- read_stretches --------------------------------------------------------------------------- */

typedef struct {
    int fd;
    long long offset;
    Py_ssize_t first_page; /* index in the batch of the stretch's first page */
    int num_pages;
    struct iovec *iov; /* header, its payload's pieces, header, pieces, ... */
    int num_iov;
    int *starts;       /* num_pages + 1: where each page's header is in iov, then num_iov */
    long long total;
    long long got; /* bytes read; 0: not cached; -1 error (errno in err); -2 no RWF_NOWAIT */
    int err;
} stretch_t;

typedef struct {
    stretch_t *stretches;
    const uint8_t *keys; /* KEY_BYTES per page of the batch */
    const uint8_t *layout;
    size_t layout_len;
    char *results;      /* one byte per page of the batch: what check_parts said (0: unchecked) */
    size_t window_bytes; /* what one preadv2 reads */
} reads_t;

/* The page of a stretch whose bytes are arriving: its header is checked once it is whole,
 * then its checksum takes in each window's share of it. */
typedef struct {
    int page;             /* in the stretch */
    long long start;      /* its first byte's offset in the stretch */
    int hashing;          /* its header checked out: `stream` takes in its bytes */
    struct iovec pieces[MAX_IOV + 2];
    stream_t stream;
} arriving_t;

/* Move `a` over what the stretch's first `done` bytes complete: each page's header checked
 * when whole (a page whose header fails gets that reason at once), its checksum's input taken
 * in up to `done`, and a page read whole settled in reads->results. */
static void take_arrived(const reads_t *reads, const stretch_t *s, arriving_t *a,
                         long long done) {
    while (a->page < s->num_pages) {
        const struct iovec *parts = &s->iov[s->starts[a->page]];
        int count = s->starts[a->page + 1] - s->starts[a->page]; /* header + payload pieces */
        Py_ssize_t page = s->first_page + a->page;
        long long payload = 0;
        for (int i = 1; i < count; i++)
            payload += (long long)parts[i].iov_len;
        long long size = (long long)parts[0].iov_len + payload;
        long long arrived = done - a->start;
        int code = UNCHECKED;
        if (!a->hashing) {
            if (arrived < (long long)parts[0].iov_len)
                return;
            expect_t want = {reads->keys + KEY_BYTES * page, reads->layout, reads->layout_len,
                             payload};
            found_t found;
            code = check_head(parts, count, &want, &found);
            if (code == SPLIT_HEADER)
                code = UNCHECKED; /* longer than its buffer: the page by page read joins it */
            if (code == HEAD_OK) {
                int num = hashed_pieces(parts, count, found.header_bytes, a->pieces);
                stream_start(&a->stream, a->pieces, num, (size_t)size - UNHASHED_BYTES);
                a->hashing = 1;
            }
        }
        if (a->hashing) {
            if (arrived < size) {
                stream_take(&a->stream, (size_t)arrived - UNHASHED_BYTES);
                return;
            }
            const uint8_t *head = parts[0].iov_base;
            code = stream_end(&a->stream) == load64(head + PLAIN_BYTES) ? VERIFIED : BAD_CHECKSUM;
        }
        reads->results[page] = (char)code;
        a->page++;
        a->start += size;
        a->hashing = 0;
    }
}

/* Up to `limit` bytes of the stretch's buffers from `skip` bytes on, as iovecs in `out` (room
 * for all of the stretch's); returns how many, and their bytes in *bytes. */
static int window_of(const stretch_t *s, long long skip, size_t limit, struct iovec *out,
                     size_t *bytes) {
    int n = 0;
    size_t taken = 0;
    for (int i = 0; i < s->num_iov && taken < limit; i++) {
        size_t len = s->iov[i].iov_len;
        if (skip >= (long long)len) {
            skip -= (long long)len;
            continue;
        }
        size_t take = len - (size_t)skip;
        if (take > limit - taken)
            take = limit - taken;
        out[n++] = (struct iovec){(uint8_t *)s->iov[i].iov_base + skip, take};
        taken += take;
        skip = 0;
    }
    *bytes = taken;
    return n;
}

/* Read one stretch window by window with reads that never wait, checking each page as its
 * bytes arrive: the checksum reads each window while it is still in this core's cache (a page
 * of 1.75 MiB read whole and then hashed was read from memory twice). A window the page cache
 * cannot give whole ends the stretch: its pages not settled are read another way. */
static void read_one_stretch(batch_t *batch, size_t unit) {
    reads_t *reads = batch->data;
    stretch_t *s = &reads->stretches[unit];
    struct iovec window[MAX_IOV];
    arriving_t arriving = {0};
    long long done = 0;
    while (done < s->total) {
        size_t want;
        int n = window_of(s, done, reads->window_bytes, window, &want);
        ssize_t got = preadv_nowait(s->fd, window, n, s->offset + done);
        if (got < 0 && done == 0) {
            s->err = errno;
            if (errno == EAGAIN)
                s->got = 0;
            else if (errno == EOPNOTSUPP || errno == EINVAL || errno == ENOSYS)
                s->got = -2;
            else
                s->got = -1;
            return;
        }
        if (got <= 0)
            break; /* past a window the page cache gave: partly cached (or an error) */
        done += got;
        take_arrived(reads, s, &arriving, done);
        if ((size_t)got < want)
            break;
    }
    s->got = done;
}

PyDoc_STRVAR(read_stretches_doc,
"read_stretches(stretches, keys, layout, results, threads, window_bytes) -> list[int]\n\n"
"Read each stretch (fd, offset, buffers, first_page) - `buffers` alternating a page's header\n"
"buffer (all of one size) and its payload: a buffer, or a list of buffers (its pieces, in\n"
"order: the page is read straight into them), the pages of the batch from `first_page` on\n"
"- with preadv2(RWF_NOWAIT) calls of `window_bytes` each, and check every page as\n"
"check_object does, against its key (16 bytes each, joined in `keys`), `layout` and its\n"
"payload's size, hashing each window as it lands: results[page] = 1 when it checked\n"
"out, else the reason's number (0 where the page was not read whole; a stretch not read\n"
"whole may have results for its first pages). Returns, per stretch, the bytes read: 0 when\n"
"the page cache had none, -1 on an error, -2 when the filesystem refuses RWF_NOWAIT. Runs\n"
"without the GIL, on up to `threads` threads.");

/* A page's payload, as the callers give it: one buffer, or a list of buffers whose
 * concatenation is the payload (its pieces: the scattered parts of a page in an engine's
 * pool, read into and written from where they lie). The iovecs it takes; -1 with an
 * exception (an empty list, or more than MAX_IOV pieces). */
static Py_ssize_t payload_pieces(PyObject *payload, const char *what) {
    if (!PyList_Check(payload))
        return 1;
    Py_ssize_t n = PyList_GET_SIZE(payload);
    if (n < 1 || n > MAX_IOV - 1) {
        PyErr_Format(PyExc_ValueError, "%s: a page's payload is a buffer or a list of 1 to "
                                       "1023 buffers", what);
        return -1;
    }
    return n;
}

/* Take a payload's buffers (payload_pieces) into held and `iov`; the iovecs filled, their
 * bytes added to *bytes; -1 with an exception. */
static Py_ssize_t hold_payload(held_t *held, PyObject *payload, int writable, const char *what,
                               struct iovec *iov, long long *bytes) {
    Py_ssize_t n = PyList_Check(payload) ? PyList_GET_SIZE(payload) : 1;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *piece = PyList_Check(payload) ? PyList_GET_ITEM(payload, i) : payload;
        Py_buffer *view = hold(held, piece, writable, what);
        if (view == NULL)
            return -1;
        iov[i] = (struct iovec){view->buf, (size_t)view->len};
        *bytes += view->len;
    }
    return n;
}

/* Take one stretch's buffers into held, `iov` and `starts` (num_pages + 1 of them); 0 with
 * an exception. */
static int hold_stretch(held_t *held, PyObject *item, stretch_t *s, struct iovec *iov,
                        int *starts, Py_ssize_t num_pages) {
    PyObject *buffers = PyTuple_GET_ITEM(item, 2);
    s->fd = (int)PyLong_AsLong(PyTuple_GET_ITEM(item, 0));
    s->offset = PyLong_AsLongLong(PyTuple_GET_ITEM(item, 1));
    s->first_page = PyLong_AsSsize_t(PyTuple_GET_ITEM(item, 3));
    if (PyErr_Occurred())
        return 0;
    s->num_pages = (int)(PyList_GET_SIZE(buffers) / 2);
    if (s->first_page < 0 || s->first_page + s->num_pages > num_pages || s->offset < 0) {
        PyErr_SetString(PyExc_ValueError, "read_stretches: a stretch lies outside the batch");
        return 0;
    }
    s->iov = iov;
    s->starts = starts;
    int at = 0;
    for (int p = 0; p < s->num_pages; p++) {
        starts[p] = at;
        Py_buffer *head = hold(held, PyList_GET_ITEM(buffers, 2 * p), 1, "read_stretches");
        if (head == NULL)
            return 0;
        if (head->len < FIXED_BYTES) {
            PyErr_SetString(PyExc_ValueError, "read_stretches: a header buffer is shorter than "
                                              "56 bytes");
            return 0;
        }
        iov[at++] = (struct iovec){head->buf, (size_t)head->len};
        s->total += head->len;
        Py_ssize_t n = hold_payload(held, PyList_GET_ITEM(buffers, 2 * p + 1), 1,
                                    "read_stretches", &iov[at], &s->total);
        if (n < 0)
            return 0;
        at += (int)n;
    }
    starts[s->num_pages] = at;
    s->num_iov = at;
    return 1;
}

/* The buffers (iovecs) of all stretches, and their pages in *pages; -1 with an exception. */
static Py_ssize_t count_stretch_buffers(PyObject *list, Py_ssize_t *pages) {
    Py_ssize_t total = 0;
    *pages = 0;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(list); i++) {
        PyObject *item = PyList_GET_ITEM(list, i);
        if (!PyTuple_Check(item) || PyTuple_GET_SIZE(item) != 4 ||
            !PyList_Check(PyTuple_GET_ITEM(item, 2))) {
            PyErr_SetString(PyExc_TypeError,
                            "read_stretches: each stretch is (fd, offset, buffers, first_page)");
            return -1;
        }
        PyObject *buffers = PyTuple_GET_ITEM(item, 2);
        Py_ssize_t n = PyList_GET_SIZE(buffers), iovs = 0;
        if (n == 0 || n % 2 || n > MAX_IOV) {
            PyErr_SetString(PyExc_ValueError,
                            "read_stretches: a stretch has 1 to 512 (header, payload) pairs");
            return -1;
        }
        for (Py_ssize_t b = 1; b < n; b += 2) {
            Py_ssize_t pieces = payload_pieces(PyList_GET_ITEM(buffers, b), "read_stretches");
            if (pieces < 0)
                return -1;
            iovs += 1 + pieces;
        }
        if (iovs > MAX_IOV) {
            PyErr_SetString(PyExc_ValueError, "read_stretches: a stretch has at most 1024 "
                                              "buffers, headers and pieces together");
            return -1;
        }
        total += iovs;
        *pages += n / 2;
    }
    return total;
}

static PyObject *read_stretches(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *list;
    Py_buffer keys, layout, results;
    int threads;
    Py_ssize_t window_bytes;
    if (!PyArg_ParseTuple(args, "O!y*y*w*in", &PyList_Type, &list, &keys, &layout, &results,
                          &threads, &window_bytes))
        return NULL;
    Py_ssize_t num = PyList_GET_SIZE(list);
    Py_ssize_t num_pages = keys.len / KEY_BYTES;
    PyObject *result = NULL;
    held_t held = {NULL, 0};
    stretch_t *stretches = NULL;
    struct iovec *iovs = NULL;
    int *starts = NULL;
    if (keys.len % KEY_BYTES || results.len < num_pages || layout.len > MAX_LAYOUT_BYTES ||
        window_bytes < 1) {
        PyErr_SetString(PyExc_ValueError, "read_stretches: keys must be 16 bytes each, results "
                                          "one byte per key, the layout at most 65535 bytes, "
                                          "window_bytes at least 1");
        goto done;
    }
    Py_ssize_t stretch_pages;
    Py_ssize_t num_buffers = count_stretch_buffers(list, &stretch_pages);
    if (num_buffers < 0)
        goto done;
    stretches = PyMem_Calloc(num ? num : 1, sizeof *stretches);
    iovs = PyMem_Calloc(num_buffers ? num_buffers : 1, sizeof *iovs);
    starts = PyMem_Calloc(stretch_pages + num + 1, sizeof *starts);
    held.views = PyMem_Calloc(num_buffers ? num_buffers : 1, sizeof *held.views);
    if (stretches == NULL || iovs == NULL || starts == NULL || held.views == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    struct iovec *iov = iovs;
    int *start = starts;
    for (Py_ssize_t i = 0; i < num; i++) {
        if (!hold_stretch(&held, PyList_GET_ITEM(list, i), &stretches[i], iov, start, num_pages))
            goto done;
        iov += stretches[i].num_iov;
        start += stretches[i].num_pages + 1;
    }
    reads_t reads = {stretches, keys.buf, layout.buf, (size_t)layout.len, results.buf,
                     (size_t)window_bytes};
    batch_t batch = {.num_units = (size_t)num, .run = read_one_stretch, .data = &reads};
    run_without_gil(&batch, threads);
    result = PyList_New(num);
    for (Py_ssize_t i = 0; result != NULL && i < num; i++) {
        PyObject *got = PyLong_FromLongLong(stretches[i].got);
        if (got == NULL)
            Py_CLEAR(result);
        else
            PyList_SET_ITEM(result, i, got);
    }
done:
    release_all(&held);
    PyMem_Free(iovs);
    PyMem_Free(starts);
    PyMem_Free(stretches);
    PyBuffer_Release(&keys);
    PyBuffer_Release(&layout);
    PyBuffer_Release(&results);
    return result;
}

/* -- check_copy ------------------------------------------------------------------------------- */

typedef struct {
    reads_t reads;      /* keys, layout, results (no stretches) */
    Py_buffer *objects; /* whole encoded objects: header then payload */
    Py_buffer *into;    /* each page's destination, exactly its payload's size */
} copies_t;

static void check_copy_one(batch_t *batch, size_t unit) {
    copies_t *copies = batch->data;
    const Py_buffer *obj = &copies->objects[unit], *into = &copies->into[unit];
    struct iovec whole = {obj->buf, (size_t)obj->len};
    expect_t want = {copies->reads.keys + KEY_BYTES * unit, copies->reads.layout,
                     copies->reads.layout_len, (long long)into->len};
    found_t found;
    int code = check_parts(&whole, 1, &want, &found);
    if (code == VERIFIED && found.compression != 0)
        code = UNCHECKED; /* intact, but lz4: the caller decompresses it */
    else if (code == VERIFIED)
        memcpy(into->buf, (const uint8_t *)obj->buf + found.header_bytes, (size_t)into->len);
    copies->reads.results[unit] = (char)code;
}

PyDoc_STRVAR(check_copy_doc,
"check_copy(objects, into, keys, layout, results, threads) -> None\n\n"
"Check each whole object (one buffer) as check_object does - against its key (16 bytes\n"
"each, joined in `keys`), `layout` and the size of into[i] - and only then copy its payload\n"
"into into[i]: results[i] = 1. Otherwise into[i] is left untouched and results[i] is the\n"
"reason's number, or 0 for an intact lz4 object (the caller decompresses it). Runs without\n"
"the GIL, on up to `threads` threads.");

static PyObject *check_copy(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *objects, *into;
    Py_buffer keys, layout, results;
    int threads;
    if (!PyArg_ParseTuple(args, "O!O!y*y*w*i", &PyList_Type, &objects, &PyList_Type, &into,
                          &keys, &layout, &results, &threads))
        return NULL;
    PyObject *result = NULL;
    Py_ssize_t num = PyList_GET_SIZE(objects);
    held_t held = {NULL, 0};
    if (PyList_GET_SIZE(into) != num || keys.len != KEY_BYTES * num || results.len < num ||
        layout.len > MAX_LAYOUT_BYTES) {
        PyErr_SetString(PyExc_ValueError,
                        "check_copy: one destination and 16 key bytes per object, results one "
                        "byte per object, the layout at most 65535 bytes");
        goto done;
    }
    held.views = PyMem_Calloc(2 * num + 1, sizeof *held.views);
    if (held.views == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    if (!hold_list(&held, objects, 0, "check_copy") || !hold_list(&held, into, 1, "check_copy"))
        goto done;
    copies_t copies = {
        .reads = {NULL, keys.buf, layout.buf, (size_t)layout.len, results.buf},
        .objects = held.views,
        .into = held.views + num,
    };
    batch_t batch = {.num_units = (size_t)num, .run = check_copy_one, .data = &copies};
    run_without_gil(&batch, threads);
    result = Py_NewRef(Py_None);
done:
    release_all(&held);
    PyBuffer_Release(&keys);
    PyBuffer_Release(&layout);
    PyBuffer_Release(&results);
    return result;
}

/* -- check_object ----------------------------------------------------------------------------- */

PyDoc_STRVAR(check_object_doc,
"check_object(parts, key, layout, raw_bytes) -> int\n\n"
"Check one stored object, given as a list of buffers whose concatenation is the object:\n"
"magic, version and flags, codec, that it is `key`'s (16 bytes), of `layout` (None: any),\n"
"every length (`raw_bytes`: the decoded size expected, -1 for any), the checksum. 1 when it\n"
"checked out, else the reason's number (verify._REASONS); 10 when the header straddles two\n"
"parts (join them and ask again). The MAC of a version 2 object is not looked at. Releases\n"
"the GIL for objects of 64 KiB and more.");

static PyObject *check_object(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *list, *layout_obj;
    Py_buffer key;
    long long raw_bytes;
    if (!PyArg_ParseTuple(args, "O!y*OL", &PyList_Type, &list, &key, &layout_obj, &raw_bytes))
        return NULL;
    Py_ssize_t num = PyList_GET_SIZE(list);
    PyObject *result = NULL;
    Py_buffer layout = {0};
    held_t held = {NULL, 0};
    struct iovec parts[MAX_PARTS];
    if (key.len != KEY_BYTES || num < 1 || num > MAX_PARTS) {
        PyErr_SetString(PyExc_ValueError, "check_object: a key is 16 bytes, an object 1 to "
                                          "1024 parts");
        goto done;
    }
    if (layout_obj != Py_None && PyObject_GetBuffer(layout_obj, &layout, PyBUF_SIMPLE) < 0)
        goto done;
    held.views = PyMem_Calloc(num, sizeof *held.views);
    if (held.views == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    if (!hold_list(&held, list, 0, "check_object"))
        goto done;
    size_t total = 0;
    for (Py_ssize_t i = 0; i < num; i++) {
        parts[i] = (struct iovec){held.views[i].buf, (size_t)held.views[i].len};
        total += parts[i].iov_len;
    }
    expect_t want = {key.buf, layout.obj != NULL ? layout.buf : NULL, (size_t)layout.len,
                     raw_bytes < 0 ? -1 : raw_bytes};
    found_t found;
    int code;
    if (total >= (64 << 10)) {
        Py_BEGIN_ALLOW_THREADS
        code = check_parts(parts, (int)num, &want, &found);
        Py_END_ALLOW_THREADS
    } else {
        code = check_parts(parts, (int)num, &want, &found);
    }
    result = PyLong_FromLong(code);
done:
    release_all(&held);
    PyBuffer_Release(&key);
    if (layout.obj != NULL)
        PyBuffer_Release(&layout);
    return result;
}

/* -- frame_headers ---------------------------------------------------------------------------- */

typedef struct {
    const uint8_t *keys;
    const uint8_t *plain;
    const uint8_t *layout;
    size_t layout_len;
    Py_buffer *pages;
    uint8_t *headers; /* (FIXED_BYTES + layout_len) per page */
} frames_t;

/* The header of one uncompressed page into `head` but its checksum: `plain` with the key and
 * lengths filled in, the layout. The payload is `count` pieces (at most MAX_IOV - 1), in
 * order. What the checksum takes in, in order, goes to `pieces` (room for count + 2); returns
 * how many. */
static int header_fields(const uint8_t *plain, const uint8_t *layout, size_t layout_len,
                         const uint8_t *key, const struct iovec *payload, int count,
                         uint8_t *head, struct iovec *pieces) {
    uint64_t length = 0;
    for (int i = 0; i < count; i++)
        length += payload[i].iov_len;
    memcpy(head, plain, PLAIN_BYTES);
    memcpy(head + KEY_OFFSET, key, KEY_BYTES);
    memcpy(head + STORED_OFFSET, &length, 8);
    memcpy(head + STORED_OFFSET + 8, &length, 8);
    memcpy(head + FIXED_BYTES, layout, layout_len);
    pieces[0] = (struct iovec){head, PLAIN_BYTES};
    pieces[1] = (struct iovec){head + FIXED_BYTES, layout_len};
    memcpy(&pieces[2], payload, (size_t)count * sizeof *payload);
    return count + 2;
}

/* The header of one uncompressed page into `head`: header_fields, then the checksum. */
static void frame_page(const uint8_t *plain, const uint8_t *layout, size_t layout_len,
                       const uint8_t *key, const struct iovec *payload, int count,
                       uint8_t *head) {
    struct iovec pieces[MAX_IOV + 2];
    int num = header_fields(plain, layout, layout_len, key, payload, count, head, pieces);
    uint64_t checksum = hash_pieces(pieces, num);
    memcpy(head + PLAIN_BYTES, &checksum, 8);
}

static void frame_one(batch_t *batch, size_t unit) {
    frames_t *frames = batch->data;
    size_t header_bytes = FIXED_BYTES + frames->layout_len;
    struct iovec page = {frames->pages[unit].buf, (size_t)frames->pages[unit].len};
    frame_page(frames->plain, frames->layout, frames->layout_len,
               frames->keys + KEY_BYTES * unit, &page, 1, frames->headers + header_bytes * unit);
}

/* The arguments frame_headers and frame_copies share: `plain` of PLAIN_BYTES, KEY_BYTES of
 * keys a page and `sized` (the caller's check of its own buffers), else a ValueError saying
 * `wrong`; and a layout whose length fits the header's u16. 0 with the exception set. */
static int frame_args_ok(const char *name, const Py_buffer *keys, const Py_buffer *plain,
                         const Py_buffer *layout, Py_ssize_t num, int sized, const char *wrong) {
    if (plain->len != PLAIN_BYTES || keys->len != KEY_BYTES * num || !sized) {
        PyErr_Format(PyExc_ValueError, "%s: %s", name, wrong);
        return 0;
    }
    if (layout->len > MAX_LAYOUT_BYTES) {
        PyErr_Format(PyExc_ValueError, "%s: the layout is at most 65535 bytes", name);
        return 0;
    }
    return 1;
}

PyDoc_STRVAR(frame_headers_doc,
"frame_headers(keys, plain, layout, pages, headers, threads) -> None\n\n"
"Write into `headers` ((56 + len(layout)) bytes per page) the header of each uncompressed\n"
"page: `plain` (48 bytes, key and lengths zero) with the page's key (16 bytes each, joined\n"
"in `keys`) and length filled in, the checksum, `layout`. Runs without the GIL, on up to\n"
"`threads` threads.");

static PyObject *frame_headers(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer keys, plain, layout, headers;
    PyObject *pages;
    int threads;
    if (!PyArg_ParseTuple(args, "y*y*y*O!w*i", &keys, &plain, &layout, &PyList_Type, &pages,
                          &headers, &threads))
        return NULL;
    PyObject *result = NULL;
    Py_ssize_t num = PyList_GET_SIZE(pages);
    held_t held = {NULL, 0};
    size_t header_bytes = FIXED_BYTES + (size_t)layout.len;
    if (!frame_args_ok("frame_headers", &keys, &plain, &layout, num,
                       (size_t)headers.len == header_bytes * (size_t)num,
                       "plain must be 48 bytes, keys 16 bytes per page, headers 56 + "
                       "len(layout) per page"))
        goto done;
    held.views = PyMem_Calloc(num ? num : 1, sizeof *held.views);
    if (held.views == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    if (!hold_list(&held, pages, 0, "frame_headers"))
        goto done;
    frames_t frames = {keys.buf, plain.buf, layout.buf, (size_t)layout.len, held.views,
                       headers.buf};
    batch_t batch = {.num_units = (size_t)num, .run = frame_one, .data = &frames};
    run_without_gil(&batch, threads);
    result = Py_NewRef(Py_None);
done:
    release_all(&held);
    PyBuffer_Release(&keys);
    PyBuffer_Release(&plain);
    PyBuffer_Release(&layout);
    PyBuffer_Release(&headers);
    return result;
}

/* -- frame_copies ----------------------------------------------------------------------------- */

/* A page is copied a chunk at a time and each chunk hashed right after, from the copy, while
 * both are still in the core's cache: one pass over the page's bytes from memory where a copy
 * then a frame_headers took two. 32 pages of 64 KiB, hot: 0.092 ms against 0.159 for the copy
 * and frame_headers apart; chunks of 64 KiB (source and copy well inside a core's L2) took 4 %
 * less than 16 KiB. The Mooncake put it serves: docs/performance.md, benchmarks/
 * bench_backends.py --backends mooncake. */
#define COPY_CHUNK_BYTES (64 << 10)

typedef struct {
    frames_t frames;            /* keys, plain, layout, pages (frames.headers unused) */
    uint8_t *out;               /* where the objects go */
    const Py_ssize_t *offsets;  /* each object's first byte in `out`, checked to fit */
} framed_copies_t;

static void frame_copy_one(batch_t *batch, size_t unit) {
    const framed_copies_t *copies = batch->data;
    const frames_t *f = &copies->frames;
    const Py_buffer *page = &f->pages[unit];
    struct iovec source = {page->buf, (size_t)page->len}, pieces[3];
    uint8_t *head = copies->out + copies->offsets[unit];
    uint8_t *payload = head + FIXED_BYTES + f->layout_len;
    header_fields(f->plain, f->layout, f->layout_len, f->keys + KEY_BYTES * unit, &source, 1,
                  head, pieces);
    XXH3_state_t state; /* (64-byte aligned: on the stack) */
    XXH3_64bits_reset(&state);
    hash_update(&state, pieces[0].iov_base, pieces[0].iov_len);
    hash_update(&state, pieces[1].iov_base, pieces[1].iov_len);
    for (size_t at = 0; at < source.iov_len; at += COPY_CHUNK_BYTES) {
        size_t n = source.iov_len - at < COPY_CHUNK_BYTES ? source.iov_len - at : COPY_CHUNK_BYTES;
        memcpy(payload + at, (const uint8_t *)source.iov_base + at, n);
        hash_update(&state, payload + at, n);
    }
    uint64_t checksum = XXH3_64bits_digest(&state);
    memcpy(head + PLAIN_BYTES, &checksum, 8);
}

/* The `num` offsets, as Py_ssize_t, into into[]: each object (header_bytes, then its page)
 * checked to lie inside the `out_len` bytes of `out`. 0 with an exception. */
static int object_offsets(PyObject *offsets, const Py_buffer *pages, Py_ssize_t num,
                          size_t header_bytes, Py_ssize_t out_len, Py_ssize_t *into) {
    for (Py_ssize_t i = 0; i < num; i++) {
        Py_ssize_t at = PyLong_AsSsize_t(PyList_GET_ITEM(offsets, i));
        if (at == -1 && PyErr_Occurred())
            return 0;
        if (at < 0 || (size_t)at + header_bytes + (size_t)pages[i].len > (size_t)out_len) {
            PyErr_Format(PyExc_ValueError,
                         "frame_copies: object %zd (at %zd, %zu + %zd bytes) does not fit the "
                         "%zd bytes of `out`",
                         i, at, header_bytes, pages[i].len, out_len);
            return 0;
        }
        into[i] = at;
    }
    return 1;
}

PyDoc_STRVAR(frame_copies_doc,
"frame_copies(keys, plain, layout, pages, out, offsets, threads) -> None\n\n"
"Write into `out` at offsets[i] the whole object of each uncompressed page: its header (as\n"
"frame_headers makes it: `plain` with the page's key and length, the checksum, `layout`),\n"
"then a copy of the page, the checksum taken of the copy as it is made (one pass over the\n"
"page). Every object is checked to fit `out` before a byte is written; objects must not\n"
"overlap one another or the pages. Runs without the GIL, on up to `threads` threads.");

static PyObject *frame_copies(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer keys, plain, layout, out;
    PyObject *pages, *offsets;
    int threads;
    if (!PyArg_ParseTuple(args, "y*y*y*O!w*O!i", &keys, &plain, &layout, &PyList_Type, &pages,
                          &out, &PyList_Type, &offsets, &threads))
        return NULL;
    PyObject *result = NULL;
    Py_ssize_t num = PyList_GET_SIZE(pages);
    held_t held = {NULL, 0};
    Py_ssize_t *at = NULL;
    if (!frame_args_ok("frame_copies", &keys, &plain, &layout, num,
                       PyList_GET_SIZE(offsets) == num,
                       "plain must be 48 bytes, keys 16 bytes and one offset per page"))
        goto done;
    held.views = PyMem_Calloc(num ? num : 1, sizeof *held.views);
    at = PyMem_Calloc(num ? num : 1, sizeof *at);
    if (held.views == NULL || at == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    if (!hold_list(&held, pages, 0, "frame_copies") ||
        !object_offsets(offsets, held.views, num, FIXED_BYTES + (size_t)layout.len, out.len, at))
        goto done;
    framed_copies_t copies = {
        .frames = {keys.buf, plain.buf, layout.buf, (size_t)layout.len, held.views, NULL},
        .out = out.buf,
        .offsets = at,
    };
    batch_t batch = {.num_units = (size_t)num, .run = frame_copy_one, .data = &copies};
    run_without_gil(&batch, threads);
    result = Py_NewRef(Py_None);
done:
    PyMem_Free(at);
    release_all(&held);
    PyBuffer_Release(&keys);
    PyBuffer_Release(&plain);
    PyBuffer_Release(&layout);
    PyBuffer_Release(&out);
    return result;
}

/* -- link_all --------------------------------------------------------------------------------- */

typedef struct {
    const char **sources;
    const char **paths;
    int *errors;
} links_t;

static void link_one(batch_t *batch, size_t unit) {
    links_t *links = batch->data;
    links->errors[unit] = link(links->sources[unit], links->paths[unit]) == 0 ? 0 : errno;
}

/* Each str of `list` encoded for the filesystem into encoded[i], its bytes at out[i]. */
static int encode_paths(PyObject *list, PyObject **encoded, const char **out) {
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(list); i++) {
        if (!PyUnicode_FSConverter(PyList_GET_ITEM(list, i), &encoded[i]))
            return 0;
        out[i] = PyBytes_AS_STRING(encoded[i]);
    }
    return 1;
}

PyDoc_STRVAR(link_all_doc,
"link_all(sources, paths, threads) -> list[int]\n\n"
"link(source, path) for each pair, on up to `threads` threads without the GIL; the errno of\n"
"each (0: linked). Nothing else: the caller handles names that exist or folders missing.");

static PyObject *link_all(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *sources, *paths;
    int threads;
    if (!PyArg_ParseTuple(args, "O!O!i", &PyList_Type, &sources, &PyList_Type, &paths, &threads))
        return NULL;
    Py_ssize_t num = PyList_GET_SIZE(paths);
    if (PyList_GET_SIZE(sources) != num) {
        PyErr_SetString(PyExc_ValueError, "link_all: one source per path");
        return NULL;
    }
    PyObject *result = NULL;
    PyObject **encoded = PyMem_Calloc(2 * num + 1, sizeof *encoded);
    const char **names = PyMem_Calloc(2 * num + 1, sizeof *names);
    int *errors = PyMem_Calloc(num + 1, sizeof *errors);
    if (encoded == NULL || names == NULL || errors == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    if (!encode_paths(sources, encoded, names) || !encode_paths(paths, encoded + num, names + num))
        goto done;
    links_t links = {names, names + num, errors};
    batch_t batch = {.num_units = (size_t)num, .run = link_one, .data = &links};
    run_without_gil(&batch, threads);
    result = int_list(errors, sizeof *errors, num);
done:
    for (Py_ssize_t i = 0; encoded != NULL && i < 2 * num; i++)
        Py_XDECREF(encoded[i]);
    PyMem_Free(encoded);
    PyMem_Free(names);
    PyMem_Free(errors);
    return result;
}

/* -- sync_all ---------------------------------------------------------------------------------- */

typedef struct {
    const char **paths; /* NULL where the target is an open file (fds) */
    const int *fds;
    int *errors;
} syncs_t;

static void sync_one(batch_t *batch, size_t unit) {
    syncs_t *syncs = batch->data;
    const char *path = syncs->paths[unit];
    int fd = path != NULL ? open(path, O_RDONLY | O_CLOEXEC) : syncs->fds[unit];
    int error = fd < 0 ? errno : 0;
    if (fd >= 0 && fsync(fd) != 0)
        error = errno;
    if (fd >= 0 && path != NULL)
        close(fd);
    syncs->errors[unit] = error;
}

PyDoc_STRVAR(sync_all_doc,
"sync_all(targets, threads) -> list[int]\n\n"
"fsync each target, a path (a file or folder, opened read-only) or an open file descriptor,\n"
"on up to `threads` threads without the GIL; the errno of each (0: durable). All at once: a\n"
"filesystem that commits one journal for all of them waits for the disk once, not once each.");

static PyObject *sync_all(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *targets;
    int threads;
    if (!PyArg_ParseTuple(args, "O!i", &PyList_Type, &targets, &threads))
        return NULL;
    Py_ssize_t num = PyList_GET_SIZE(targets);
    PyObject *result = NULL;
    PyObject **encoded = PyMem_Calloc(num + 1, sizeof *encoded);
    const char **paths = PyMem_Calloc(num + 1, sizeof *paths);
    int *fds = PyMem_Calloc(num + 1, sizeof *fds);
    int *errors = PyMem_Calloc(num + 1, sizeof *errors);
    if (encoded == NULL || paths == NULL || fds == NULL || errors == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < num; i++) {
        PyObject *target = PyList_GET_ITEM(targets, i);
        if (PyLong_Check(target)) {
            fds[i] = PyObject_AsFileDescriptor(target);
            if (fds[i] < 0)
                goto done;
        } else if (PyUnicode_FSConverter(target, &encoded[i])) {
            paths[i] = PyBytes_AS_STRING(encoded[i]);
        } else {
            goto done;
        }
    }
    syncs_t syncs = {paths, fds, errors};
    batch_t batch = {.num_units = (size_t)num, .run = sync_one, .data = &syncs};
    run_without_gil(&batch, threads);
    result = int_list(errors, sizeof *errors, num);
done:
    for (Py_ssize_t i = 0; encoded != NULL && i < num; i++)
        Py_XDECREF(encoded[i]);
    PyMem_Free(encoded);
    PyMem_Free(paths);
    PyMem_Free(fds);
    PyMem_Free(errors);
    return result;
}

/* -- write_packs ------------------------------------------------------------------------------ */

#define WRITE_BYTES (256 << 10) /* at most this much per write call (see write_all) */

typedef struct {
    const char *temp; /* the pack's temporary name */
    const uint8_t *table;
    size_t table_len;
    const uint8_t *keys; /* KEY_BYTES per page */
    int num_pages;     /* (the number of parts, where headers is NULL) */
    uint8_t *headers;  /* (FIXED_BYTES + layout_len) per page, filled in here; or NULL */
    struct iovec *iov; /* the table, then header, payload pieces, header, pieces, ... (the
                        * pages' headers' iovecs filled in by write_one); or, where headers
                        * is NULL, the table then the objects' parts */
    int num_iov;
    int *starts;       /* num_pages + 1: where each page's header is in iov (headers only) */
    int error;         /* errno of the create, write or close; 0 when written */
} pack_t;

typedef struct {
    pack_t *packs;
    const uint8_t *plain;
    const uint8_t *layout;
    size_t layout_len;
} writes_t;

typedef struct framing framing_t;
static int frame_until(framing_t *f, long long written, long long upto);

/* Write the buffers in order, at most WRITE_BYTES per call: a single 2 MiB write into a new
 * file ran at a tenth of the speed of 256 KiB calls (file_store._write_all). Before each call,
 * `framing` (unless NULL) checksums what it is about to write (frame_until). 0 or the errno. */
static int write_all(int fd, const struct iovec *iov, int count, framing_t *framing) {
    struct iovec chunk[MAX_IOV];
    int first = 0;
    size_t skip = 0; /* bytes of iov[first] written already */
    long long written_bytes = 0;
    while (first < count) {
        int n = 0;
        size_t size = 0;
        for (int j = first; j < count && n < MAX_IOV && size < WRITE_BYTES; j++) {
            size_t offset = j == first ? skip : 0;
            size_t len = iov[j].iov_len - offset;
            if (len > WRITE_BYTES - size)
                len = WRITE_BYTES - size;
            if (len == 0)
                continue;
            chunk[n].iov_base = (uint8_t *)iov[j].iov_base + offset;
            chunk[n].iov_len = len;
            n++;
            size += len;
        }
        if (n == 0)
            return 0; /* only empty buffers were left */
        if (framing != NULL) {
            int error = frame_until(framing, written_bytes, written_bytes + (long long)size);
            if (error)
                return error;
        }
        ssize_t written = writev(fd, chunk, n);
        if (written < 0) {
            if (errno == EINTR)
                continue;
            return errno;
        }
        if (written == 0)
            return EIO;
        written_bytes += written;
        size_t left = (size_t)written; /* a short write (a signal, a full disk): go on after it */
        while (first < count) {
            size_t rest = iov[first].iov_len - skip;
            if (left < rest) {
                skip += left;
                break;
            }
            left -= rest;
            first++;
            skip = 0;
        }
    }
    return 0;
}

/* Make the folder of `path`, and the one above it, where missing: page names and packs live
 * two folders below the root, which exists. 0 or the errno. */
static int make_parents(const char *path) {
    char dir[PATH_MAX];
    size_t len = strlen(path);
    if (len >= sizeof dir)
        return ENAMETOOLONG;
    memcpy(dir, path, len + 1);
    char *slash = strrchr(dir, '/');
    if (slash == NULL || slash == dir)
        return ENOENT;
    *slash = '\0';
    if (mkdir(dir, 0777) == 0 || errno == EEXIST)
        return 0;
    if (errno != ENOENT)
        return errno;
    char *up = strrchr(dir, '/');
    if (up == NULL || up == dir)
        return ENOENT;
    *up = '\0';
    if (mkdir(dir, 0777) != 0 && errno != EEXIST)
        return errno;
    *up = '/';
    if (mkdir(dir, 0777) != 0 && errno != EEXIST)
        return errno;
    return 0;
}

/* The pages of a pack checksummed as they are written, a write call's share at a time, just
 * before the call: the kernel then copies bytes the checksum has just brought into this
 * core's cache (hashing a page of a few MiB whole, then writing it, read it from memory
 * twice). One page is being hashed at a time (the pages lie in order). A page's checksum is
 * in its header, written before its payload: where the header went out already, the 8 bytes
 * are written again in place once known (the pack is a temporary file: nobody reads it yet). */
struct framing {
    int fd;
    const writes_t *writes;
    const pack_t *pack;
    int page;          /* the page being hashed, or the next */
    int open;          /* its stream is started */
    long long head_at; /* its header's offset in the pack */
    long long end_at;  /* one past its last byte */
    stream_t stream;
    struct iovec pieces[MAX_IOV + 2];
};

/* Hash every page's bytes in the pack up to offset `upto` (`written` bytes are written): a
 * page whose last byte is reached gets its checksum. 0 or the errno of a write in place. */
static int frame_until(framing_t *f, long long written, long long upto) {
    const pack_t *pack = f->pack;
    const writes_t *writes = f->writes;
    size_t header_bytes = FIXED_BYTES + writes->layout_len;
    while (f->page < pack->num_pages) {
        uint8_t *head = pack->headers + header_bytes * (size_t)f->page;
        if (!f->open) {
            if (f->head_at >= upto)
                return 0;
            int at = pack->starts[f->page], count = pack->starts[f->page + 1] - at - 1;
            int num = header_fields(writes->plain, writes->layout, writes->layout_len,
                                    pack->keys + KEY_BYTES * f->page, &pack->iov[at + 1], count,
                                    head, f->pieces);
            size_t len = 0;
            for (int i = 0; i < num; i++)
                len += f->pieces[i].iov_len;
            stream_start(&f->stream, f->pieces, num, len);
            f->end_at = f->head_at + (long long)(len + UNHASHED_BYTES);
            f->open = 1;
        }
        long long reach = (upto < f->end_at ? upto : f->end_at) - f->head_at;
        /* bytes of the page up to `reach` that the checksum takes in: all but its own 8 */
        long long taken = reach <= PLAIN_BYTES ? reach
                          : reach <= FIXED_BYTES ? PLAIN_BYTES : reach - UNHASHED_BYTES;
        stream_take(&f->stream, (size_t)taken);
        if (f->head_at + reach < f->end_at)
            return 0;
        uint64_t checksum = stream_end(&f->stream);
        memcpy(head + PLAIN_BYTES, &checksum, 8);
        if (f->head_at + PLAIN_BYTES < written &&
            pwrite(f->fd, head + PLAIN_BYTES, 8, f->head_at + PLAIN_BYTES) != 8)
            return errno ? errno : EIO;
        f->page++;
        f->open = 0;
        f->head_at = f->end_at;
    }
    return 0;
}

static void write_one(batch_t *batch, size_t unit) {
    writes_t *writes = batch->data;
    pack_t *pack = &writes->packs[unit];
    size_t header_bytes = FIXED_BYTES + writes->layout_len;
    struct iovec *iov = pack->iov;
    for (int i = 0; pack->headers != NULL && i < pack->num_pages; i++)
        iov[pack->starts[i]] = (struct iovec){pack->headers + header_bytes * i, header_bytes};
    int flags = O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC;
    int fd = open(pack->temp, flags, 0644);
    if (fd < 0 && errno == ENOENT && make_parents(pack->temp) == 0)
        fd = open(pack->temp, flags, 0644);
    if (fd < 0) {
        pack->error = errno;
        return;
    }
    framing_t framing; /* (on the stack: the XXH3 state wants its 64-byte alignment) */
    framing.fd = fd;
    framing.writes = writes;
    framing.pack = pack;
    framing.page = 0;
    framing.open = 0;
    framing.head_at = (long long)pack->table_len;
    framing_t *f = pack->headers != NULL ? &framing : NULL;
    int error = write_all(fd, iov, pack->num_iov, f);
    if (close(fd) != 0 && error == 0 && errno != EINTR)
        error = errno;
    if (error) {
        unlink(pack->temp);
        pack->error = error;
    }
}

PyDoc_STRVAR(write_packs_doc,
"write_packs(packs, plain, layout, threads) -> list[int]\n\n"
"Write each pack (temp, table, keys, pages, headers) on its own thread, without the GIL:\n"
"frame its uncompressed pages into `headers` (as frame_headers does), create `temp`\n"
"(O_EXCL; its two folders made if missing), write the table then each header and page,\n"
"close (no fsync: sync_all makes a batch durable). A page is a buffer, or a list of buffers\n"
"(its pieces, in order: hashed and written where they lie, gathered by writev). A pack of\n"
"objects framed already has keys and headers None, and `pages` its objects' parts (header,\n"
"payload, ...), written as they are. Returns the errno of each pack: 0 when written;\n"
"otherwise its temporary file is removed.");

/* The iovecs of all packs' pages (a header and each piece, or each part) in *iovs, and their
 * pages in *pages; -1 with an exception. */
static Py_ssize_t count_pack_entries(PyObject *list, Py_ssize_t *pages) {
    Py_ssize_t total = 0;
    *pages = 0;
    for (Py_ssize_t p = 0; p < PyList_GET_SIZE(list); p++) {
        PyObject *item = PyList_GET_ITEM(list, p);
        if (!PyTuple_Check(item) || PyTuple_GET_SIZE(item) != 5 ||
            !PyList_Check(PyTuple_GET_ITEM(item, 3))) {
            PyErr_SetString(PyExc_TypeError, "write_packs: each pack is (temp, table, keys, "
                                             "pages, headers) with a list of pages");
            return -1;
        }
        PyObject *entries = PyTuple_GET_ITEM(item, 3);
        Py_ssize_t n = PyList_GET_SIZE(entries);
        if (n == 0 || n > (1 << 20)) {
            PyErr_SetString(PyExc_ValueError, "write_packs: a pack has 1 to 2**20 pages");
            return -1;
        }
        *pages += n;
        if (PyTuple_GET_ITEM(item, 4) == Py_None) { /* framed already: parts, one iovec each */
            total += n;
            continue;
        }
        for (Py_ssize_t i = 0; i < n; i++) {
            Py_ssize_t pieces = payload_pieces(PyList_GET_ITEM(entries, i), "write_packs");
            if (pieces < 0)
                return -1;
            total += 1 + pieces;
        }
    }
    return total;
}

/* Take one pack's buffers into held and `pack` (its iovecs from `iov`, its page starts from
 * `starts`); the iovecs it uses, or 0 with an exception. `temp` gets the encoded name (the
 * caller releases it). */
static Py_ssize_t hold_pack(held_t *held, PyObject *item, pack_t *pack, struct iovec *iov,
                            int *starts, size_t header_bytes, PyObject **temp) {
    PyObject *pages = PyTuple_GET_ITEM(item, 3);
    Py_ssize_t n = PyList_GET_SIZE(pages);
    if (!PyUnicode_FSConverter(PyTuple_GET_ITEM(item, 0), temp))
        return 0;
    pack->temp = PyBytes_AS_STRING(*temp);
    Py_buffer *table = hold(held, PyTuple_GET_ITEM(item, 1), 0, "write_packs: table");
    if (table == NULL)
        return 0;
    pack->table = table->buf;
    pack->table_len = (size_t)table->len;
    pack->num_pages = (int)n;
    pack->iov = iov;
    iov[0] = (struct iovec){(void *)pack->table, pack->table_len};
    long long bytes = 0;
    if (PyTuple_GET_ITEM(item, 4) == Py_None && PyTuple_GET_ITEM(item, 2) == Py_None) {
        for (Py_ssize_t i = 0; i < n; i++) { /* framed already: the parts as they are */
            Py_buffer *part = hold(held, PyList_GET_ITEM(pages, i), 0, "write_packs: part");
            if (part == NULL)
                return 0;
            iov[1 + i] = (struct iovec){part->buf, (size_t)part->len};
        }
        pack->num_iov = (int)(1 + n);
        return 1 + n;
    }
    Py_buffer *keys = hold(held, PyTuple_GET_ITEM(item, 2), 0, "write_packs: keys");
    Py_buffer *headers =
        keys ? hold(held, PyTuple_GET_ITEM(item, 4), 1, "write_packs: headers") : NULL;
    if (headers == NULL)
        return 0;
    if (keys->len != KEY_BYTES * n || (size_t)headers->len != header_bytes * (size_t)n) {
        PyErr_SetString(PyExc_ValueError, "write_packs: keys must be 16 bytes per page, "
                                          "headers 56 + len(layout) per page");
        return 0;
    }
    pack->keys = keys->buf;
    pack->headers = headers->buf;
    pack->starts = starts;
    int at = 1;
    for (Py_ssize_t i = 0; i < n; i++) {
        starts[i] = at++; /* the header's iovec: filled in once framed */
        Py_ssize_t got = hold_payload(held, PyList_GET_ITEM(pages, i), 0, "write_packs: page",
                                      &iov[at], &bytes);
        if (got < 0)
            return 0;
        at += (int)got;
    }
    starts[n] = at;
    pack->num_iov = at;
    return at;
}

static PyObject *write_packs(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *list;
    Py_buffer plain, layout;
    int threads;
    if (!PyArg_ParseTuple(args, "O!y*y*i", &PyList_Type, &list, &plain, &layout, &threads))
        return NULL;
    Py_ssize_t num = PyList_GET_SIZE(list);
    PyObject *result = NULL;
    held_t held = {NULL, 0};
    pack_t *packs = NULL;
    PyObject **temps = NULL;
    struct iovec *iovs = NULL;
    int *starts = NULL;
    if (plain.len != PLAIN_BYTES || layout.len > MAX_LAYOUT_BYTES) {
        PyErr_SetString(PyExc_ValueError, "write_packs: plain must be 48 bytes, the layout at "
                                          "most 65535");
        goto done;
    }
    Py_ssize_t total_pages;
    Py_ssize_t total_iovs = count_pack_entries(list, &total_pages);
    if (total_iovs < 0)
        goto done;
    packs = PyMem_Calloc(num + 1, sizeof *packs);
    held.views = PyMem_Calloc(3 * num + total_iovs + 1, sizeof *held.views);
    temps = PyMem_Calloc(num + 1, sizeof *temps);
    iovs = PyMem_Calloc(num + total_iovs + 1, sizeof *iovs);
    starts = PyMem_Calloc(num + total_pages + 1, sizeof *starts);
    if (!packs || !held.views || !temps || !iovs || !starts) {
        PyErr_NoMemory();
        goto done;
    }
    struct iovec *iov = iovs;
    int *start = starts;
    for (Py_ssize_t p = 0; p < num; p++) {
        Py_ssize_t used = hold_pack(&held, PyList_GET_ITEM(list, p), &packs[p], iov, start,
                                    FIXED_BYTES + (size_t)layout.len, &temps[p]);
        if (used == 0)
            goto done;
        iov += used;
        start += packs[p].num_pages + 1;
    }
    writes_t writes = {packs, plain.buf, layout.buf, (size_t)layout.len};
    batch_t batch = {.num_units = (size_t)num, .run = write_one, .data = &writes};
    run_without_gil(&batch, threads);
    result = int_list(&packs[0].error, sizeof *packs, num);
done:
    release_all(&held);
    for (Py_ssize_t p = 0; temps != NULL && p < num; p++)
        Py_XDECREF(temps[p]);
    PyMem_Free(temps);
    PyMem_Free(iovs);
    PyMem_Free(starts);
    PyMem_Free(packs);
    PyBuffer_Release(&plain);
    PyBuffer_Release(&layout);
    return result;
}

/* -- xxh3_64 ---------------------------------------------------------------------------------- */

PyDoc_STRVAR(xxh3_64_doc,
"xxh3_64(first, second=b'') -> int\n\n"
"XXH3 64-bit (seed 0) of first + second, without joining them. Releases the GIL for inputs\n"
"of 64 KiB and more.");

static PyObject *xxh3_64(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer first, second = {0};
    if (!PyArg_ParseTuple(args, "y*|y*", &first, &second))
        return NULL;
    struct iovec pieces[2] = {{first.buf, (size_t)first.len}, {second.buf, (size_t)second.len}};
    int count = second.obj != NULL ? 2 : 1;
    uint64_t h;
    if (first.len + second.len >= (64 << 10)) {
        Py_BEGIN_ALLOW_THREADS
        h = hash_pieces(pieces, count);
        Py_END_ALLOW_THREADS
    } else {
        h = hash_pieces(pieces, count);
    }
    PyBuffer_Release(&first);
    if (second.obj != NULL)
        PyBuffer_Release(&second);
    return PyLong_FromUnsignedLongLong(h);
}

/* -- the module ------------------------------------------------------------------------------- */

PyDoc_STRVAR(simd_doc,
"simd(name=None) -> str\n\n"
"The vector unit the xxHash library's XXH3 runs with here: 'avx512', 'avx2' or 'baseline' (the\n"
"build's own: SSE2 on x86-64). Given a name, use that one (tests check each); ValueError if\n"
"this CPU or build lacks it.");

static PyObject *simd(PyObject *self, PyObject *args) {
    (void)self;
    const char *name = NULL;
    if (!PyArg_ParseTuple(args, "|s", &name))
        return NULL;
    if (name != NULL && strcmp(name, "baseline") == 0) {
        hash_update = update_baseline;
    } else if (name != NULL) {
#ifdef PAGEIO_WIDE
        if (strcmp(name, "avx512") == 0 && __builtin_cpu_supports("avx512f"))
            hash_update = pageio_update_avx512;
        else if (strcmp(name, "avx2") == 0 && __builtin_cpu_supports("avx2"))
            hash_update = pageio_update_avx2;
        else
#endif
            return PyErr_Format(PyExc_ValueError, "simd: %s is not available here", name);
    }
#ifdef PAGEIO_WIDE
    if (hash_update == pageio_update_avx512)
        return PyUnicode_FromString("avx512");
    if (hash_update == pageio_update_avx2)
        return PyUnicode_FromString("avx2");
#endif
    return PyUnicode_FromString("baseline");
}

static PyMethodDef methods[] = {
    {"read_stretches", read_stretches, METH_VARARGS, read_stretches_doc},
    {"frame_headers", frame_headers, METH_VARARGS, frame_headers_doc},
    {"frame_copies", frame_copies, METH_VARARGS, frame_copies_doc},
    {"check_copy", check_copy, METH_VARARGS, check_copy_doc},
    {"check_object", check_object, METH_VARARGS, check_object_doc},
    {"link_all", link_all, METH_VARARGS, link_all_doc},
    {"write_packs", write_packs, METH_VARARGS, write_packs_doc},
    {"sync_all", sync_all, METH_VARARGS, sync_all_doc},
    {"xxh3_64", xxh3_64, METH_VARARGS, xxh3_64_doc},
    {"simd", simd, METH_VARARGS, simd_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "_pageio",
    .m_doc = "The file backend's page reads, checks and framing in C, without the GIL.",
    .m_size = -1,
    .m_methods = methods,
};

PyMODINIT_FUNC PyInit__pageio(void) {
#ifdef PAGEIO_WIDE
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f"))
        hash_update = pageio_update_avx512;
    else if (__builtin_cpu_supports("avx2"))
        hash_update = pageio_update_avx2;
#endif
    static int forked_handler = 0;
    if (!forked_handler) {
        pthread_atfork(NULL, NULL, reset_after_fork);
        forked_handler = 1;
    }
    return PyModule_Create(&module);
}
