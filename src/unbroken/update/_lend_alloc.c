/* The raw allocator under the lending pool (`unbroken.update.lending`): torch's caching
 * allocator asks it for segments through `torch.cuda.memory.CUDAPluggableAllocator`, and it
 * hands out address ranges inside the lent retained regions first (best fit, 512-byte
 * aligned), falling back to the driver's cuMemAlloc when they are full. Frees inside a lent
 * range return it to the free list (coalesced); others go to cuMemFree.
 *
 * One instance per process (torch loads the library once; the state is the library's).
 * Every entry point takes one mutex: torch calls alloc/free under its own lock, the Python
 * side calls set_ranges/stats from the trainer's thread.
 *
 * The driver is opened lazily with dlopen, so the library loads (and its range logic is
 * tested) on a host without CUDA; `ub_lend_set_fallback` replaces the driver for tests.
 */
#include <dlfcn.h>
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <sys/types.h>

#define UB_MAX_RANGES 64
#define UB_MAX_FREE 4096
#define UB_ALIGN 512u

typedef struct {
    uintptr_t lo, hi;
} ub_span;

typedef void *(*ub_alloc_fn)(size_t);
typedef void (*ub_free_fn)(void *);

static pthread_mutex_t ub_lock = PTHREAD_MUTEX_INITIALIZER;
static ub_span ub_ranges[UB_MAX_RANGES];
static int ub_n_ranges;
static ub_span ub_free_list[UB_MAX_FREE]; /* sorted by address, disjoint, not adjacent */
static int ub_n_free;
static size_t ub_lent_total, ub_lent_used, ub_lent_peak, ub_lent_live;
static size_t ub_fb_used, ub_fb_peak, ub_fb_calls, ub_refused;
static ub_alloc_fn ub_fb_alloc;
static ub_free_fn ub_fb_free;

/* -- the driver fallback ------------------------------------------------------------------ */
typedef int (*cu_alloc_t)(uintptr_t *, size_t);
typedef int (*cu_free_t)(uintptr_t);
static cu_alloc_t cu_mem_alloc;
static cu_free_t cu_mem_free;

static int ub_driver(void) {
    if (cu_mem_alloc)
        return 1;
    void *h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
    if (!h)
        h = dlopen("libcuda.so.1", RTLD_NOW);
    if (!h)
        return 0;
    cu_mem_alloc = (cu_alloc_t)dlsym(h, "cuMemAlloc_v2");
    cu_mem_free = (cu_free_t)dlsym(h, "cuMemFree_v2");
    return cu_mem_alloc && cu_mem_free;
}

static void *ub_fallback_alloc(size_t size) {
    if (ub_fb_alloc)
        return ub_fb_alloc(size);
    uintptr_t p = 0;
    if (!ub_driver() || cu_mem_alloc(&p, size) != 0)
        return NULL;
    return (void *)p;
}

static void ub_fallback_free(void *ptr) {
    if (ub_fb_free)
        ub_fb_free(ptr);
    else if (ub_driver())
        cu_mem_free((uintptr_t)ptr);
}

/* -- the free list ------------------------------------------------------------------------ */
static size_t ub_round(size_t n) { return (n + UB_ALIGN - 1) & ~(size_t)(UB_ALIGN - 1); }

static int ub_lent(uintptr_t p) {
    for (int i = 0; i < ub_n_ranges; i++)
        if (p >= ub_ranges[i].lo && p < ub_ranges[i].hi)
            return 1;
    return 0;
}

static void ub_remove(int i) {
    memmove(&ub_free_list[i], &ub_free_list[i + 1], (size_t)(ub_n_free - i - 1) * sizeof(ub_span));
    ub_n_free--;
}

/* Insert [lo, hi) and merge it with its neighbours when they touch (never across two lent
 * ranges: their addresses are not contiguous memory of one allocation). */
static int ub_insert(uintptr_t lo, uintptr_t hi) {
    int i = 0;
    while (i < ub_n_free && ub_free_list[i].lo < lo)
        i++;
    int left = i > 0 && ub_free_list[i - 1].hi == lo;
    int right = i < ub_n_free && ub_free_list[i].lo == hi;
    for (int r = 0; r < ub_n_ranges && (left || right); r++) {
        if (lo == ub_ranges[r].lo)
            left = 0;
        if (hi == ub_ranges[r].hi)
            right = 0;
    }
    if (left && right) {
        ub_free_list[i - 1].hi = ub_free_list[i].hi;
        ub_remove(i);
    } else if (left) {
        ub_free_list[i - 1].hi = hi;
    } else if (right) {
        ub_free_list[i].lo = lo;
    } else {
        if (ub_n_free == UB_MAX_FREE)
            return 0;
        memmove(&ub_free_list[i + 1], &ub_free_list[i], (size_t)(ub_n_free - i) * sizeof(ub_span));
        ub_free_list[i] = (ub_span){lo, hi};
        ub_n_free++;
    }
    return 1;
}

/* -- entry points ------------------------------------------------------------------------- */

/* Replace the lent ranges: refused (returns 0) while any lent byte is in use. `los`/`sizes`
 * are n address/size pairs, disjoint (the Python side checks), each trimmed inward to 512-byte
 * alignment. */
int ub_lend_set_ranges(const uintptr_t *los, const size_t *sizes, int n) {
    int ok = 0;
    pthread_mutex_lock(&ub_lock);
    if (ub_lent_used == 0 && n >= 0 && n <= UB_MAX_RANGES) {
        ub_n_ranges = ub_n_free = 0;
        ub_lent_total = ub_lent_peak = ub_lent_live = 0;
        for (int i = 0; i < n; i++) {
            uintptr_t lo = (los[i] + UB_ALIGN - 1) & ~(uintptr_t)(UB_ALIGN - 1);
            uintptr_t hi = (los[i] + sizes[i]) & ~(uintptr_t)(UB_ALIGN - 1);
            if (hi <= lo)
                continue;
            ub_ranges[ub_n_ranges++] = (ub_span){lo, hi};
            ub_insert(lo, hi);
            ub_lent_total += hi - lo;
        }
        ok = 1;
    }
    pthread_mutex_unlock(&ub_lock);
    return ok;
}

void *ub_lend_alloc(ssize_t size, int device, void *stream) {
    (void)device;
    (void)stream;
    if (size <= 0 || (size_t)size > SIZE_MAX - UB_ALIGN)
        return NULL;
    size_t need = ub_round((size_t)size);
    void *out = NULL;
    pthread_mutex_lock(&ub_lock);
    int best = -1;
    /* A free adds at most one free-list entry, so with fewer live lent segments than the list
     * has room for beside the ranges' own entries, every later free fits. */
    int room = ub_lent_live < (size_t)(UB_MAX_FREE - UB_MAX_RANGES);
    for (int i = 0; room && i < ub_n_free; i++) {
        size_t have = ub_free_list[i].hi - ub_free_list[i].lo;
        if (have >= need &&
            (best < 0 || have < ub_free_list[best].hi - ub_free_list[best].lo))
            best = i;
    }
    if (best >= 0) {
        out = (void *)ub_free_list[best].lo;
        ub_free_list[best].lo += need;
        if (ub_free_list[best].lo == ub_free_list[best].hi)
            ub_remove(best);
        ub_lent_used += need;
        ub_lent_live++;
        if (ub_lent_used > ub_lent_peak)
            ub_lent_peak = ub_lent_used;
    } else {
        out = ub_fallback_alloc(need);
        if (out) {
            ub_fb_used += need;
            ub_fb_calls++;
            if (ub_fb_used > ub_fb_peak)
                ub_fb_peak = ub_fb_used;
        } else {
            ub_refused++;
        }
    }
    pthread_mutex_unlock(&ub_lock);
    return out;
}

void ub_lend_free(void *ptr, ssize_t size, int device, void *stream) {
    (void)device;
    (void)stream;
    size_t n = ub_round((size_t)size);
    uintptr_t p = (uintptr_t)ptr;
    pthread_mutex_lock(&ub_lock);
    if (ub_lent(p)) {
        if (ub_insert(p, p + n)) { /* cannot fail: `room` in ub_lend_alloc */
            ub_lent_used -= n;
            ub_lent_live--;
        }
    } else {
        ub_fallback_free(ptr);
        ub_fb_used -= n;
    }
    pthread_mutex_unlock(&ub_lock);
}

/* out[8]: lent bytes, lent in use, lent peak, fallback in use, fallback peak, fallback calls,
 * refused calls, free-list entries. `reset_peaks` sets both peaks to their current use. */
void ub_lend_stats(size_t *out, int reset_peaks) {
    pthread_mutex_lock(&ub_lock);
    out[0] = ub_lent_total;
    out[1] = ub_lent_used;
    out[2] = ub_lent_peak;
    out[3] = ub_fb_used;
    out[4] = ub_fb_peak;
    out[5] = ub_fb_calls;
    out[6] = ub_refused;
    out[7] = (size_t)ub_n_free;
    if (reset_peaks) {
        ub_lent_peak = ub_lent_used;
        ub_fb_peak = ub_fb_used;
    }
    pthread_mutex_unlock(&ub_lock);
}

/* Tests: route the fallback to host functions (NULL restores the driver). */
void ub_lend_set_fallback(ub_alloc_fn alloc, ub_free_fn free_) {
    pthread_mutex_lock(&ub_lock);
    ub_fb_alloc = alloc;
    ub_fb_free = free_;
    pthread_mutex_unlock(&ub_lock);
}
