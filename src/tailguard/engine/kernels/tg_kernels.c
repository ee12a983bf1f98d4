/* tailguard's CPU kernels: matrix products straight on GGUF's quantized blocks with float32 activations, and a whole
 * decode step (every layer, paged attention, the LM head) in one call.
 *
 * Why: SmolLM2's GGUF stores its layers as Q4_1 and its embedding/LM head as Q8_0. Multiplying by those blocks with
 * float32 activations computes exactly what the float32 model computes (its weights *are* those blocks, dequantized),
 * while reading 6.4x fewer bytes than float32 weights; llama.cpp instead quantizes the activations to 8 bits, which
 * changes the answers. Running the whole decode step here removes the ~750 small torch ops per step that cost more
 * than the matrix products themselves.
 *
 * Built at install (or on first use) with `gcc -O3 -march=native -fopenmp`. Parallel loops run on a pool of our own
 * (see "threads" below), or on OpenMP's (libgomp, shared with torch: same soname) when asked. Called through ctypes,
 * which releases the GIL for the duration of each call.
 */
#define _GNU_SOURCE
#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <time.h>
#include <unistd.h>
#if defined(__linux__)
#include <linux/futex.h>
#include <sys/syscall.h>
#endif

#include <omp.h>
#if defined(__AVX512F__) || defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

/* ggml's type ids, so Python can pass GGUF's own numbers; TG_Q4_1R is ours: Q4_1 repacked at load time, each row
 * [nb x 16 nibble bytes][nb float32 scales d][nb float32 mins m], so the single-row kernel loads a block's scale as
 * a float instead of converting a half per block and row, and the mins fold into one dot product per row. The same
 * numbers as Q4_1 (a half converts to float exactly). */
enum { TG_F32 = 0, TG_F16 = 1, TG_Q4_0 = 2, TG_Q4_1 = 3, TG_Q8_0 = 8, TG_Q4_1R = 100, TG_Q4_1X = 101, TG_Q8_0X = 102 };

/* TG_Q4_1X / TG_Q8_0X: the layout of the int8-activation kernel (AVX-512 VNNI). Rows go in groups of XG = 16; within a
 * group, block b of all 16 rows is stored together so that one 64-byte register holds 16 rows x 4 consecutive weight
 * bytes (lane r = output row r), which vpdpbusd multiplies by 4 broadcast activation bytes:
 *   Q4_1X, 384 bytes a group and block: 4 x [16 rows x nibble bytes 4i..4i+3] (low nibbles: k = 4i..4i+3, high
 *          nibbles: k = 16+4i..16+4i+3), then the 16 rows' d as float32, then their m as float32.
 *   Q8_0X, 576 bytes a group and block: 8 x [16 rows x bytes 4i..4i+3, each q + 128 as an unsigned byte], then the
 *          16 rows' d as float32.
 * A group is 16 whole rows' bytes (24 or 36 a block and row), so concatenating matrices by rows, or keeping the first
 * rows, stays exact at multiples of 16. The same numbers as Q4_1 / Q8_0 (halves convert to floats exactly). */
#define XG 16
static inline int is_interleaved(int fmt) { return fmt == TG_Q4_1X || fmt == TG_Q8_0X; }

int tg_abi_version(void) { return 11; }

/* ---- threads -------------------------------------------------------------------------------------------------------
 * Every parallel loop goes through tg_for: a range [0, n) cut into chunks that the calling thread and a pool of worker
 * threads take one at a time from a shared counter. Two pools:
 *
 * TG_POOL_OWN (the default): ours. A waiting thread (a worker between loops, the caller at a loop's end) polls for
 * tg_spin_ns (enough for the gaps between a step's loops), then sleeps on a futex; at the end of a decode step the
 * workers sleep at once (pool_park: the engine's Python work comes next), and while pool threads keep being preempted
 * (a busy neighbour, more threads than free CPUs) nobody polls at all (spin_allowed). libgomp's default instead polls ~300,000
 * pauses (~5 ms here) after every parallel region, so with ~120 regions a decode step its workers never slept while a
 * server ran: they held every core the step did not need, starving the HTTP front and the tokenizer, and a worker
 * preempted by another process left the others spinning at its barrier for a scheduler time slice (static shares:
 * nobody can take its half). Here chunks are claimed dynamically, so a preempted or still waking thread holds up only
 * the chunk it is on, and the caller never waits for a worker that has not started: it does the chunks itself.
 *
 * TG_POOL_OPENMP: libgomp's pool with the previous static split, OMP_WAIT_POLICY / GOMP_SPINCOUNT as libgomp reads
 * them (TAILGUARD_THREAD_POOL=openmp), to compare against.
 *
 * Each chunk computes the same numbers whichever thread takes it, so outputs do not depend on the pool or the count. */
typedef void (*tg_range_fn)(void *ctx, int64_t i0, int64_t i1);

enum { TG_POOL_OWN = 0, TG_POOL_OPENMP = 1 };
static _Atomic int tg_pool_kind = TG_POOL_OWN;
static _Atomic int tg_threads = 1;         /* own pool: threads of a loop, the caller included (Python sets it) */
static _Atomic int64_t tg_spin_ns = 100000; /* own pool: polling before a waiting thread sleeps (Python sets it) */
#define CHUNKS_PER_THREAD 4                /* dynamic chunks a loop is cut into, per thread */

/* The words written during a loop (state, done) sit on cache lines of their own, apart from the one that polling
 * workers read (gen), so claiming chunks does not keep pulling that line away from them. */
static struct {
    pthread_mutex_t lock;                  /* one loop at a time: a concurrent caller runs its loop alone */
    pthread_t *workers;
    int n_workers;
    _Alignas(64) _Atomic uint64_t state;   /* generation, chunks, next unclaimed chunk (pack_state) */
    _Alignas(64) _Atomic uint32_t done;    /* chunks finished: the caller sleeps on it (futex word) */
    _Atomic int32_t caller_waiting;
    _Alignas(64) _Atomic uint32_t gen;     /* the current loop's generation: workers sleep on it (futex word) */
    _Atomic uint32_t parked;               /* a generation after which workers sleep at once (a step's last loop) */
    _Atomic int32_t sleepers, quit;
    /* the current loop, written before its generation is published */
    _Atomic(tg_range_fn) fn;
    _Atomic(void *) ctx;
    _Atomic int64_t n, grain;
    _Alignas(64) _Atomic int64_t contended_until; /* now_ns() before which nobody polls (see spin_allowed) */
    /* counters for tests and benchmarks: loops run by the pool, worker sleeps, caller sleeps, loops run alone
     * because the pool was busy, times polling was turned off for contention */
    _Atomic int64_t stats[5];
} pool = {.lock = PTHREAD_MUTEX_INITIALIZER};

#define RLX memory_order_relaxed

static inline int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

static void futex_wait(void *addr, uint32_t expected) {
#if defined(__linux__)
    syscall(SYS_futex, addr, FUTEX_WAIT_PRIVATE, expected, NULL, NULL, 0);
#else
    (void)addr; (void)expected;
    sched_yield();
#endif
}

static void futex_wake(void *addr, int count) {
#if defined(__linux__)
    syscall(SYS_futex, addr, FUTEX_WAKE_PRIVATE, count, NULL, NULL, 0);
#else
    (void)addr; (void)count;
#endif
}

/* Polling pays only while the thread we wait for is running. When another runnable thread (a neighbour process, the
 * server's front, or our own threads outnumbering the CPUs) preempts ours, the one we wait for may be the one off the
 * CPU, and polling keeps it from the CPU we hold: single-stream decode steps took 1.3x as long polling 100 us as not
 * polling beside a busy-loop neighbour, while with nothing else running polling decoded ~15% faster. So each pool
 * thread counts its involuntary context switches (read at most once a millisecond, when it is about to wait):
 * CONTENTION_SWITCHES of them within CONTENTION_WINDOW_NS turn polling off for every pool thread for
 * CONTENTION_HOLD_NS. A few switches are no sign (kernel threads, timers: up to ~30 a second a thread on a quiet
 * host); a thread sharing its CPU is preempted at every time slice (~140 a second measured, two threads on one CPU). */
#define CONTENTION_CHECK_NS 1000000
#define CONTENTION_WINDOW_NS 50000000
#define CONTENTION_SWITCHES 6
/* a second: longer than a server's usual idle gap between requests, so that each new request does not start polling
 * beside the neighbour again until the next window catches it (polling off costs single-stream decode ~15% while it
 * lasts; serving's quiet E2E P99 without polling was within run-to-run noise of polling's, noisy_neighbour.py) */
#define CONTENTION_HOLD_NS 1000000000

static int spin_allowed(int64_t now) {
#if defined(RUSAGE_THREAD)
    static _Thread_local int64_t checked_at = 0, window_start = 0, window_base = -1;
    if (now - checked_at >= CONTENTION_CHECK_NS) {
        struct rusage ru;
        if (getrusage(RUSAGE_THREAD, &ru) == 0) {
            const int64_t switches = ru.ru_nivcsw;
            if (window_base < 0 || now - window_start >= CONTENTION_WINDOW_NS) {
                window_start = now;
                window_base = switches;
            } else if (switches - window_base >= CONTENTION_SWITCHES) {
                atomic_store_explicit(&pool.contended_until, now + CONTENTION_HOLD_NS, RLX);
                atomic_fetch_add_explicit(&pool.stats[4], 1, RLX);
                window_start = now;
                window_base = switches;
            }
        }
        checked_at = now;
    }
#endif
    return now >= atomic_load_explicit(&pool.contended_until, RLX);
}

/* Poll *word for up to tg_spin_ns until it differs from `value` (until_equal 0) or equals it (1); 1 when it did.
 * A worker (gen_done: the generation it finished) also stops when the caller has parked the pool after it. */
static int poll_word(_Atomic uint32_t *word, uint32_t value, int until_equal, const uint32_t *gen_done) {
#define POLL_MET() ((atomic_load_explicit(word, memory_order_acquire) == value) == until_equal)
#define PARKED() (gen_done != NULL && atomic_load_explicit(&pool.parked, RLX) == *gen_done)
    if (POLL_MET()) return 1;
    const int64_t spin = atomic_load_explicit(&tg_spin_ns, RLX);
    if (spin <= 0 || PARKED()) return 0;
    const int64_t now = now_ns();
    if (!spin_allowed(now)) return 0;
    const int64_t deadline = now + spin;
    for (;;) {
        for (int i = 0; i < 32; i++) {
            cpu_relax();
            if (POLL_MET()) return 1;
        }
        const int64_t t = now_ns();
        if (t >= deadline || PARKED() || !spin_allowed(t)) return 0;
    }
#undef PARKED
#undef POLL_MET
}

/* A loop's whole claim state in one word: its generation, its chunk count and the next unclaimed chunk. The count
 * must travel with the counter: read apart, a worker preempted between reading an old loop's exhausted counter and
 * the count could read the next loop's larger count, claim a chunk of the old loop that does not exist (its CAS
 * still succeeds, the caller not having published the next loop yet) and add it to the next loop's done count,
 * which then passed its chunks and left the caller asleep forever (100,000 short loops hung within a minute). */
#define STATE_CHUNK_BITS 16
#define MAX_CHUNKS ((1 << STATE_CHUNK_BITS) - 1)
static inline uint64_t pack_state(uint32_t g, uint32_t chunks) { return (uint64_t)g << 32 | (uint64_t)chunks << 16; }
static inline uint32_t state_gen(uint64_t s) { return (uint32_t)(s >> 32); }
static inline uint32_t state_chunks(uint64_t s) { return (uint32_t)(s >> 16) & MAX_CHUNKS; }
static inline uint32_t state_next(uint64_t s) { return (uint32_t)s & MAX_CHUNKS; }

/* Claim and run chunks of loop `g` until none is left or the loop is over; then count them done, all at once (one
 * write to the shared counter per thread and loop). */
static void run_chunks(uint32_t g) {
    uint32_t mine = 0, chunks = 0;
    uint64_t s = atomic_load_explicit(&pool.state, memory_order_acquire);
    for (;;) {
        if (state_gen(s) != g || state_next(s) >= state_chunks(s)) break;
        if (!atomic_compare_exchange_weak_explicit(&pool.state, &s, s + 1, memory_order_acq_rel, memory_order_acquire))
            continue;
        /* chunk c of g is ours: g cannot end before it is done, so the loop's fields (published before its state)
         * are g's */
        const uint32_t c = state_next(s);
        chunks = state_chunks(s);
        const tg_range_fn fn = atomic_load_explicit(&pool.fn, RLX);
        void *ctx = atomic_load_explicit(&pool.ctx, RLX);
        const int64_t n = atomic_load_explicit(&pool.n, RLX), grain = atomic_load_explicit(&pool.grain, RLX);
        const int64_t i0 = (int64_t)c * grain, i1 = i0 + grain < n ? i0 + grain : n;
        fn(ctx, i0, i1);
        mine++;
        s = atomic_load_explicit(&pool.state, memory_order_acquire);
    }
    if (mine > 0 && atomic_fetch_add(&pool.done, mine) + mine == chunks && atomic_load(&pool.caller_waiting))
        futex_wake(&pool.done, 1);
}

static void *worker_main(void *arg) {
    uint32_t seen = (uint32_t)(uintptr_t)arg;
    for (;;) {
        if (!poll_word(&pool.gen, seen, 0, &seen)) {
            /* sleepers before the re-check, the caller's gen before its sleepers check: one of us sees the other */
            atomic_fetch_add(&pool.sleepers, 1);
            while (atomic_load(&pool.gen) == seen) {
                atomic_fetch_add_explicit(&pool.stats[1], 1, RLX);
                futex_wait(&pool.gen, seen);
            }
            atomic_fetch_sub(&pool.sleepers, 1);
        }
        if (atomic_load(&pool.quit)) return NULL;
        seen = atomic_load_explicit(&pool.gen, memory_order_acquire);
        run_chunks(seen);
    }
}

static void stop_workers(void) {
    if (pool.n_workers == 0) return;
    atomic_store(&pool.quit, 1);
    atomic_fetch_add(&pool.gen, 1);
    futex_wake(&pool.gen, INT32_MAX);
    for (int i = 0; i < pool.n_workers; i++) pthread_join(pool.workers[i], NULL);
    free(pool.workers);
    pool.workers = NULL;
    pool.n_workers = 0;
    atomic_store(&pool.quit, 0);
}

/* A forked child has none of the parent's worker threads: start afresh (a new pool on its first loop). */
static void pool_after_fork_child(void) {
    pthread_mutex_init(&pool.lock, NULL);
    pool.workers = NULL;
    pool.n_workers = 0;
    atomic_store(&pool.sleepers, 0);
    atomic_store(&pool.caller_waiting, 0);
    atomic_store(&pool.quit, 0);
}

/* n workers (the caller makes n + 1 threads); under pool.lock. 0 on success. */
static int ensure_workers(int n) {
    static int fork_handler = 0;
    if (pool.n_workers == n) return 0;
    if (!fork_handler) {
        pthread_atfork(NULL, NULL, pool_after_fork_child);
        fork_handler = 1;
    }
    stop_workers();
    pool.workers = (pthread_t *)malloc(sizeof(pthread_t) * (size_t)n);
    if (pool.workers == NULL) return -1;
    /* workers block every signal: Python handles signals on its own threads */
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old);
    const uint32_t g = atomic_load(&pool.gen);
    for (int i = 0; i < n; i++) {
        if (pthread_create(&pool.workers[i], NULL, worker_main, (void *)(uintptr_t)g) != 0) break;
        pool.n_workers++;
    }
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    return pool.n_workers == n ? 0 : -1;
}

static void pool_for(int64_t n, int64_t grain, tg_range_fn fn, void *ctx, int nt) {
    if (ensure_workers(nt - 1) != 0 && pool.n_workers == 0) {
        fn(ctx, 0, n);
        return;
    }
    const int32_t chunks = (int32_t)((n + grain - 1) / grain);
    atomic_store_explicit(&pool.fn, fn, RLX);
    atomic_store_explicit(&pool.ctx, ctx, RLX);
    atomic_store_explicit(&pool.n, n, RLX);
    atomic_store_explicit(&pool.grain, grain, RLX);
    atomic_store_explicit(&pool.done, 0, RLX);
    const uint32_t g = atomic_load_explicit(&pool.gen, RLX) + 1;
    atomic_store_explicit(&pool.state, pack_state(g, (uint32_t)chunks), memory_order_release);
    atomic_store(&pool.gen, g);
    if (atomic_load(&pool.sleepers) > 0) futex_wake(&pool.gen, INT32_MAX);
    atomic_fetch_add_explicit(&pool.stats[0], 1, RLX);
    run_chunks(g);
    /* the chunks still running on workers: poll, then sleep until the last one wakes us (caller_waiting before the
     * re-check, the worker's done before its caller_waiting check: one of us sees the other) */
    if (!poll_word(&pool.done, (uint32_t)chunks, 1, NULL)) {
        for (;;) {
            atomic_store(&pool.caller_waiting, 1);
            const uint32_t d = atomic_load(&pool.done);
            if (d == (uint32_t)chunks) break;
            atomic_fetch_add_explicit(&pool.stats[2], 1, RLX);
            futex_wait(&pool.done, d);
        }
        atomic_store(&pool.caller_waiting, 0);
    }
}

/* fn over [0, n): in chunks of at least min_grain items on the pool (parallel set, more than one chunk), else in
 * one call on this thread. `dynamic`: OpenMP's pool hands out single items (the attention tasks, whose costs differ);
 * otherwise it splits [0, n) statically, one share per thread (its split before the own pool existed). */
static void tg_for(int64_t n, int64_t min_grain, int parallel, int dynamic, tg_range_fn fn, void *ctx) {
    if (n <= 0) return;
    if (atomic_load_explicit(&tg_pool_kind, RLX) == TG_POOL_OPENMP) {
        if (!parallel) {
            fn(ctx, 0, n);
        } else if (dynamic) {
#pragma omp parallel for schedule(dynamic)
            for (int64_t i = 0; i < n; i++) fn(ctx, i, i + 1);
        } else {
#pragma omp parallel
            {
                const int nt = omp_get_num_threads(), id = omp_get_thread_num();
                const int64_t i0 = n * id / nt, i1 = n * (id + 1) / nt;
                if (i0 < i1) fn(ctx, i0, i1);
            }
        }
        return;
    }
    const int nt = atomic_load_explicit(&tg_threads, RLX);
    if (!parallel || nt <= 1 || n <= min_grain) {
        fn(ctx, 0, n);
        return;
    }
    if (pthread_mutex_trylock(&pool.lock) != 0) { /* another thread's loop (or this one's, nested) has the pool */
        atomic_fetch_add_explicit(&pool.stats[3], 1, RLX);
        fn(ctx, 0, n);
        return;
    }
    const int64_t want = (int64_t)nt * CHUNKS_PER_THREAD;
    int64_t grain = (n + want - 1) / want;
    if (grain < min_grain) grain = min_grain;
    if ((n + grain - 1) / grain > MAX_CHUNKS) grain = (n + MAX_CHUNKS - 1) / MAX_CHUNKS;
    pool_for(n, grain, fn, ctx, nt);
    pthread_mutex_unlock(&pool.lock);
}

/* The caller's work is over for a while (a decode step ends; the next begins after the engine's Python work, ~1 ms
 * or more): the workers sleep now instead of polling through it. The next loop wakes them, while the caller already
 * works on its chunks. */
static void pool_park(void) {
    if (atomic_load_explicit(&tg_pool_kind, RLX) == TG_POOL_OWN && pool.n_workers > 0)
        atomic_store_explicit(&pool.parked, atomic_load_explicit(&pool.gen, RLX), RLX);
}

/* Threads of a parallel loop, the caller included: the own pool's (process-wide) and OpenMP's (a per-thread setting
 * of the calling thread; torch's set_num_threads sets the same one when torch shares the runtime). */
void tg_set_num_threads(int n) {
    if (n < 1) return;
    atomic_store_explicit(&tg_threads, n, RLX);
    omp_set_num_threads(n);
}

int tg_num_threads(void) {
    return atomic_load_explicit(&tg_pool_kind, RLX) == TG_POOL_OPENMP ? omp_get_max_threads()
                                                                       : atomic_load_explicit(&tg_threads, RLX);
}

/* How long the own pool's waiting threads poll before they sleep (0: sleep at once). */
void tg_set_spin_ns(int64_t ns) { atomic_store_explicit(&tg_spin_ns, ns > 0 ? ns : 0, RLX); }

/* TG_POOL_OWN or TG_POOL_OPENMP for the loops from now on; -1 for another value. Switching to OpenMP stops the own
 * pool's workers. */
int tg_set_thread_pool(int kind) {
    if (kind != TG_POOL_OWN && kind != TG_POOL_OPENMP) return -1;
    atomic_store_explicit(&tg_pool_kind, kind, RLX);
    if (kind == TG_POOL_OPENMP) {
        pthread_mutex_lock(&pool.lock);
        stop_workers();
        pthread_mutex_unlock(&pool.lock);
    }
    return 0;
}

/* out[6]: loops the own pool ran, worker sleeps, caller sleeps, loops run alone because the pool was busy, times
 * polling was turned off for contention, workers. */
void tg_thread_stats(int64_t *out) {
    for (int i = 0; i < 5; i++) out[i] = atomic_load_explicit(&pool.stats[i], RLX);
    out[5] = pool.n_workers;
}

/* Stress the pool: `loops` parallel loops of 1..max_n items (min grain 1), each item counted by whichever thread
 * runs it; after each loop every item must have run exactly once. Returns the loops where one did not (0: sound).
 * For the pool's tests: a loop that ends early, runs an item twice or hangs is a bug that no model test finds fast. */
typedef struct {
    _Atomic int32_t *hits;
    int64_t spin;
} stress_ctx;

static void stress_range(void *p, int64_t i0, int64_t i1) {
    stress_ctx *ctx = (stress_ctx *)p;
    for (int64_t i = i0; i < i1; i++) {
        for (int64_t k = 0; k < ctx->spin; k++) cpu_relax();
        atomic_fetch_add_explicit(&ctx->hits[i], 1, RLX);
    }
}

int64_t tg_pool_stress(int64_t loops, int max_n, int64_t spin) {
    if (max_n < 1) return -1;
    _Atomic int32_t *hits = (_Atomic int32_t *)calloc((size_t)max_n, sizeof(int32_t));
    if (hits == NULL) return -1;
    stress_ctx ctx = {hits, spin};
    int64_t bad = 0;
    uint64_t x = 88172645463325252ull;
    for (int64_t l = 0; l < loops; l++) {
        x ^= x << 13; x ^= x >> 7; x ^= x << 17;
        const int64_t n = 1 + (int64_t)(x % (uint64_t)max_n);
        tg_for(n, 1, 1, 1, stress_range, &ctx);
        int wrong = 0;
        for (int64_t i = 0; i < n; i++) {
            if (atomic_load_explicit(&hits[i], RLX) != 1) wrong = 1;
            atomic_store_explicit(&hits[i], 0, RLX);
        }
        bad += wrong;
    }
    free((void *)hits);
    return bad;
}

/* 1: decode attention takes the generic path even where the AVX-512 one applies (a test and a benchmark compare
 * the two in one process). */
static int generic_attention = 0;
void tg_set_generic_attention(int on) { generic_attention = on != 0; }

/* 1 when this build has the int8-activation (VNNI) products; the loader lays matrices out for them only then. */
#if !(defined(__AVX512F__) && defined(__AVX512VNNI__))
void tg_set_activation_passes(int passes) { (void)passes; }
#endif

int tg_int8_dot(void) {
#if defined(__AVX512F__) && defined(__AVX512VNNI__)
    return 1;
#else
    return 0;
#endif
}

const char *tg_simd(void) {
#if defined(__AVX512F__)
    return "avx512";
#elif defined(__AVX2__) && defined(__FMA__)
    return "avx2";
#else
    return "scalar";
#endif
}

/* ---- half precision ------------------------------------------------------------------------------------------- */

static inline float h2f(uint16_t h) {
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
    if (exp == 0) {
        float f = (float)man * (1.0f / 16777216.0f); /* subnormal: man * 2^-24 */
        return (h & 0x8000) ? -f : f;
    }
    bits = exp == 31 ? (sign | 0x7f800000u | (man << 13)) : (sign | ((exp + 112) << 23) | (man << 13));
    float f;
    memcpy(&f, &bits, 4);
    return f;
#endif
}

static inline uint16_t f2h(float f) {
#if defined(__F16C__)
    return _cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT);
#else
    /* Round to nearest even; overflow to inf; small values through the subnormal range. */
    uint32_t x;
    memcpy(&x, &f, 4);
    uint32_t sign = (x >> 16) & 0x8000;
    uint32_t absx = x & 0x7fffffff;
    if (absx >= 0x7f800000) return (uint16_t)(sign | 0x7c00 | (absx > 0x7f800000 ? 0x200 : 0));
    if (absx >= 0x477ff000) return (uint16_t)(sign | 0x7c00);
    if (absx < 0x38800000) { /* subnormal or zero in half */
        float a;
        memcpy(&a, &absx, 4);
        return (uint16_t)(sign | (uint32_t)lrintf(a * 16777216.0f));
    }
    uint32_t mant = absx & 0x7fffff, e = (absx >> 23) - 112;
    uint32_t h = (e << 10) | (mant >> 13);
    uint32_t rest = mant & 0x1fff;
    if (rest > 0x1000 || (rest == 0x1000 && (h & 1))) h++;
    return (uint16_t)(sign | h);
#endif
}

/* ---- quantized rows -------------------------------------------------------------------------------------------- */

static inline int64_t row_bytes(int fmt, int K) {
    switch (fmt) {
    case TG_F32: return (int64_t)K * 4;
    case TG_F16: return (int64_t)K * 2;
    case TG_Q4_0: return (int64_t)K / 32 * 18;
    case TG_Q4_1: return (int64_t)K / 32 * 20;
    case TG_Q4_1R: return (int64_t)K / 32 * 24;
    case TG_Q8_0: return (int64_t)K / 32 * 34;
    case TG_Q4_1X: return (int64_t)K / 32 * 24;
    case TG_Q8_0X: return (int64_t)K / 32 * 36;
    default: return -1;
    }
}


/* Dequantize one row of K weights into out[K] (float32), exactly as gguf's reference dequantizer does. */
static void dequant_row(const uint8_t *row, int fmt, int K, float *out) {
    if (fmt == TG_F32) {
        memcpy(out, row, (size_t)K * 4);
        return;
    }
    if (fmt == TG_F16) {
        const uint16_t *h = (const uint16_t *)row;
        for (int k = 0; k < K; k++) out[k] = h2f(h[k]);
        return;
    }
    const int nb = K / 32;
    for (int b = 0; b < nb; b++) {
        float *o = out + b * 32;
        if (fmt == TG_Q8_0) {
            const uint8_t *blk = row + (size_t)b * 34;
            uint16_t dh;
            memcpy(&dh, blk, 2);
            const float d = h2f(dh);
            const int8_t *qs = (const int8_t *)(blk + 2);
#if defined(__AVX512F__)
            __m512 dv = _mm512_set1_ps(d);
            _mm512_storeu_ps(o, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)qs))), dv));
            _mm512_storeu_ps(o + 16,
                             _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(qs + 16)))), dv));
#elif defined(__AVX2__)
            __m256 dv = _mm256_set1_ps(d);
            for (int j = 0; j < 32; j += 8)
                _mm256_storeu_ps(o + j, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(qs + j)))), dv));
#else
            for (int j = 0; j < 32; j++) o[j] = d * (float)qs[j];
#endif
        } else { /* Q4_0 / Q4_1: 16 bytes of nibbles, low nibbles are weights 0..15, high nibbles 16..31 */
            const int q41 = fmt == TG_Q4_1 || fmt == TG_Q4_1R;
            float d, m;
            const uint8_t *qs;
            if (fmt == TG_Q4_1R) {
                qs = row + (size_t)b * 16;
                memcpy(&d, row + (size_t)nb * 16 + (size_t)b * 4, 4);
                memcpy(&m, row + (size_t)nb * 20 + (size_t)b * 4, 4);
            } else {
                const uint8_t *blk = row + (size_t)b * (q41 ? 20 : 18);
                uint16_t dh, mh = 0;
                memcpy(&dh, blk, 2);
                if (q41) memcpy(&mh, blk + 2, 2);
                d = h2f(dh);
                m = q41 ? h2f(mh) : -8.0f * d;
                qs = blk + (q41 ? 4 : 2);
            }
#if defined(__AVX512F__) || defined(__AVX2__)
            __m128i q = _mm_loadu_si128((const __m128i *)qs);
            __m128i lo = _mm_and_si128(q, _mm_set1_epi8(0x0f));
            __m128i hi = _mm_and_si128(_mm_srli_epi16(q, 4), _mm_set1_epi8(0x0f));
#endif
#if defined(__AVX512F__)
            __m512 dv = _mm512_set1_ps(d), mv = _mm512_set1_ps(m);
            /* d * q + m with two roundings, as the reference does (no fused multiply-add here). */
            _mm512_storeu_ps(o, _mm512_add_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(lo)), dv), mv));
            _mm512_storeu_ps(o + 16, _mm512_add_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(hi)), dv), mv));
#elif defined(__AVX2__)
            __m256 dv = _mm256_set1_ps(d), mv = _mm256_set1_ps(m);
            _mm256_storeu_ps(o, _mm256_add_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo)), dv), mv));
            _mm256_storeu_ps(o + 8, _mm256_add_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8))), dv), mv));
            _mm256_storeu_ps(o + 16, _mm256_add_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi)), dv), mv));
            _mm256_storeu_ps(o + 24, _mm256_add_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8))), dv), mv));
#else
            if (q41) {
                for (int j = 0; j < 16; j++) {
                    o[j] = d * (float)(qs[j] & 15) + m;
                    o[j + 16] = d * (float)(qs[j] >> 4) + m;
                }
            } else {
                for (int j = 0; j < 16; j++) {
                    o[j] = d * (float)((int)(qs[j] & 15) - 8);
                    o[j + 16] = d * (float)((int)(qs[j] >> 4) - 8);
                }
            }
#endif
        }
    }
}

/* Row n of the interleaved formats into out[K]: the bytes gathered back into GGUF's block order, then the same
 * arithmetic as dequant_row. */
static void dequant_row_x(const uint8_t *w, int fmt, int K, int64_t n, float *out) {
    const int nb = K / 32, r = (int)(n % XG);
    const int64_t bb = fmt == TG_Q4_1X ? 384 : 576;
    const uint8_t *grp = w + (size_t)(n / XG) * XG * nb * (bb / XG);
    for (int b = 0; b < nb; b++) {
        const uint8_t *blk = grp + (size_t)b * bb;
        float *o = out + b * 32;
        if (fmt == TG_Q4_1X) {
            float d, m;
            memcpy(&d, blk + 256 + r * 4, 4);
            memcpy(&m, blk + 320 + r * 4, 4);
            for (int j = 0; j < 16; j++) {
                const uint8_t q = blk[(j / 4) * 64 + r * 4 + j % 4];
                o[j] = d * (float)(q & 15) + m;
                o[j + 16] = d * (float)(q >> 4) + m;
            }
        } else {
            float d;
            memcpy(&d, blk + 512 + r * 4, 4);
            for (int j = 0; j < 32; j++) o[j] = d * (float)((int)blk[(j / 4) * 64 + r * 4 + j % 4] - 128);
        }
    }
}

/* Row n of a matrix in any format. */
static void dequant_row_at(const uint8_t *w, int fmt, int K, int64_t rb, int64_t n, float *out) {
    if (is_interleaved(fmt)) dequant_row_x(w, fmt, K, n, out);
    else dequant_row(w + (size_t)n * rb, fmt, K, out);
}

/* ---- dense dot products on dequantized rows --------------------------------------------------------------------- */

#if defined(__AVX512F__)
#define VL 16
typedef __m512 vf;
#define VLOAD(p) _mm512_loadu_ps(p)
#define VFMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#define VZERO() _mm512_setzero_ps()
#define VSUM(v) _mm512_reduce_add_ps(v)
#elif defined(__AVX2__) && defined(__FMA__)
#define VL 8
typedef __m256 vf;
#define VLOAD(p) _mm256_loadu_ps(p)
#define VFMA(a, b, c) _mm256_fmadd_ps(a, b, c)
#define VZERO() _mm256_setzero_ps()
static inline float hsum256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#define VSUM(v) hsum256(v)
#endif

static inline float dot(const float *a, const float *b, int n) {
    int k = 0;
    float s = 0.0f;
#ifdef VL
    vf acc0 = VZERO(), acc1 = VZERO();
    for (; k + 2 * VL <= n; k += 2 * VL) {
        acc0 = VFMA(VLOAD(a + k), VLOAD(b + k), acc0);
        acc1 = VFMA(VLOAD(a + k + VL), VLOAD(b + k + VL), acc1);
    }
    for (; k + VL <= n; k += VL) acc0 = VFMA(VLOAD(a + k), VLOAD(b + k), acc0);
#ifdef __AVX512F__
    s = VSUM(_mm512_add_ps(acc0, acc1));
#else
    s = VSUM(_mm256_add_ps(acc0, acc1));
#endif
#endif
    for (; k < n; k++) s += a[k] * b[k];
    return s;
}

/* ROWS dequantized rows w[ROWS][K] against one activation row x[K]: out[r] = dot(w[r], x). Eight independent
 * accumulator chains keep both FMA ports busy; x is loaded once for all rows. */
#define ROWS 8
static inline void dots8(const float *w, int K, const float *x, float *out) {
    int k = 0;
#ifdef VL
    vf a0 = VZERO(), a1 = VZERO(), a2 = VZERO(), a3 = VZERO(), a4 = VZERO(), a5 = VZERO(), a6 = VZERO(), a7 = VZERO();
    for (; k + VL <= K; k += VL) {
        vf xv = VLOAD(x + k);
        a0 = VFMA(VLOAD(w + k), xv, a0);
        a1 = VFMA(VLOAD(w + K + k), xv, a1);
        a2 = VFMA(VLOAD(w + 2 * K + k), xv, a2);
        a3 = VFMA(VLOAD(w + 3 * K + k), xv, a3);
        a4 = VFMA(VLOAD(w + 4 * K + k), xv, a4);
        a5 = VFMA(VLOAD(w + 5 * K + k), xv, a5);
        a6 = VFMA(VLOAD(w + 6 * K + k), xv, a6);
        a7 = VFMA(VLOAD(w + 7 * K + k), xv, a7);
    }
    out[0] = VSUM(a0); out[1] = VSUM(a1); out[2] = VSUM(a2); out[3] = VSUM(a3);
    out[4] = VSUM(a4); out[5] = VSUM(a5); out[6] = VSUM(a6); out[7] = VSUM(a7);
#else
    for (int r = 0; r < ROWS; r++) out[r] = 0.0f;
#endif
    for (; k < K; k++)
        for (int r = 0; r < ROWS; r++) out[r] += w[(size_t)r * K + k] * x[k];
}

/* Four dequantized rows w[4][K] against four activation rows x[4][ldx]: out[t][r]. Sixteen accumulators, eight
 * loads per sixteen FMAs: the batched-decode micro-kernel. */
static inline void dots4x4(const float *w, int K, const float *x, int ldx, float out[4][4]) {
    int k = 0;
    for (int t = 0; t < 4; t++)
        for (int r = 0; r < 4; r++) out[t][r] = 0.0f;
#ifdef VL
    vf c00 = VZERO(), c01 = VZERO(), c02 = VZERO(), c03 = VZERO(), c10 = VZERO(), c11 = VZERO(), c12 = VZERO(),
       c13 = VZERO(), c20 = VZERO(), c21 = VZERO(), c22 = VZERO(), c23 = VZERO(), c30 = VZERO(), c31 = VZERO(),
       c32 = VZERO(), c33 = VZERO();
    for (; k + VL <= K; k += VL) {
        const vf w0 = VLOAD(w + k), w1 = VLOAD(w + K + k), w2 = VLOAD(w + 2 * K + k), w3 = VLOAD(w + 3 * K + k);
        vf xv = VLOAD(x + k);
        c00 = VFMA(w0, xv, c00); c01 = VFMA(w1, xv, c01); c02 = VFMA(w2, xv, c02); c03 = VFMA(w3, xv, c03);
        xv = VLOAD(x + ldx + k);
        c10 = VFMA(w0, xv, c10); c11 = VFMA(w1, xv, c11); c12 = VFMA(w2, xv, c12); c13 = VFMA(w3, xv, c13);
        xv = VLOAD(x + 2 * ldx + k);
        c20 = VFMA(w0, xv, c20); c21 = VFMA(w1, xv, c21); c22 = VFMA(w2, xv, c22); c23 = VFMA(w3, xv, c23);
        xv = VLOAD(x + 3 * ldx + k);
        c30 = VFMA(w0, xv, c30); c31 = VFMA(w1, xv, c31); c32 = VFMA(w2, xv, c32); c33 = VFMA(w3, xv, c33);
    }
    out[0][0] = VSUM(c00); out[0][1] = VSUM(c01); out[0][2] = VSUM(c02); out[0][3] = VSUM(c03);
    out[1][0] = VSUM(c10); out[1][1] = VSUM(c11); out[1][2] = VSUM(c12); out[1][3] = VSUM(c13);
    out[2][0] = VSUM(c20); out[2][1] = VSUM(c21); out[2][2] = VSUM(c22); out[2][3] = VSUM(c23);
    out[3][0] = VSUM(c30); out[3][1] = VSUM(c31); out[3][2] = VSUM(c32); out[3][3] = VSUM(c33);
#endif
    for (; k < K; k++)
        for (int t = 0; t < 4; t++)
            for (int r = 0; r < 4; r++) out[t][r] += w[(size_t)r * K + k] * x[(size_t)t * ldx + k];
}

/* y[t, n] (+)= sum_k x[t, k] * W[n, k] for rows n in [n0, n1), on a per-thread scratch of ROWS dequantized rows. */
static void linear_rows(const float *x, int T, int K, const uint8_t *w, int fmt, int64_t rb, int n0, int n1, float *y,
                        int ldy, int accumulate, float *scratch) {
    float part[ROWS];
    for (int n = n0; n < n1; n += ROWS) {
        const int rows = n1 - n < ROWS ? n1 - n : ROWS;
        for (int r = 0; r < rows; r++) dequant_row_at(w, fmt, K, rb, n + r, scratch + (size_t)r * K);
        int t = 0;
        if (rows == ROWS) {
            float tile[4][4];
            for (; t + 4 <= T; t += 4) {
                for (int half = 0; half < 2; half++) {
                    dots4x4(scratch + (size_t)half * 4 * K, K, x + (size_t)t * K, K, tile);
                    for (int i = 0; i < 4; i++) {
                        float *yt = y + (size_t)(t + i) * ldy + n + half * 4;
                        for (int r = 0; r < 4; r++) yt[r] = accumulate ? yt[r] + tile[i][r] : tile[i][r];
                    }
                }
            }
        }
        for (; t < T; t++) {
            const float *xt = x + (size_t)t * K;
            float *yt = y + (size_t)t * ldy + n;
            if (rows == ROWS) {
                dots8(scratch, K, xt, part);
            } else {
                for (int r = 0; r < rows; r++) part[r] = dot(scratch + (size_t)r * K, xt, K);
            }
            if (accumulate)
                for (int r = 0; r < rows; r++) yt[r] += part[r];
            else
                for (int r = 0; r < rows; r++) yt[r] = part[r];
        }
    }
}

#if defined(__AVX512F__)
/* One activation row against Q4_1 / Q8_0 rows without a dequantized copy (the single-stream decode path): per block,
 * d * (q . x) + m * sum(x), four rows at a time so each x block is loaded once. Same sums as the dequantized product
 * up to float rounding order. */
#define FUSED_ROWS 4
static inline __m512 q_lo(__m128i q, __m128i mask) { return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(q, mask))); }
static inline __m512 q_hi(__m128i q, __m128i mask) {
    return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(q, 4), mask)));
}

/* Block b of row r against the activation block (xl, xh): returns q . x for that block; sets *d (and *m). */
static inline __m512 q41_block(const uint8_t *blk, __m512 xl, __m512 xh, __m128i mask, float *d, float *m) {
    uint16_t dh, mh;
    memcpy(&dh, blk, 2);
    memcpy(&mh, blk + 2, 2);
    *d = h2f(dh);
    *m = h2f(mh);
    const __m128i q = _mm_loadu_si128((const __m128i *)(blk + 4));
    return _mm512_fmadd_ps(q_hi(q, mask), xh, _mm512_mul_ps(q_lo(q, mask), xl));
}

static inline __m512 q80_block(const uint8_t *blk, __m512 xl, __m512 xh, float *d) {
    uint16_t dh;
    memcpy(&dh, blk, 2);
    *d = h2f(dh);
    const __m512 ql = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(blk + 2))));
    const __m512 qh = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(blk + 18))));
    return _mm512_fmadd_ps(qh, xh, _mm512_mul_ps(ql, xl));
}

/* Q4_1R rows: the nibbles are contiguous (16 bytes a block), d and m are float arrays after them. */
static inline __m512 q41r_block(const uint8_t *qs, __m512 xl, __m512 xh, __m128i mask) {
    const __m128i q = _mm_loadu_si128((const __m128i *)qs);
    return _mm512_fmadd_ps(q_hi(q, mask), xh, _mm512_mul_ps(q_lo(q, mask), xl));
}

static void gemv_q41r(const float *x, const float *xsum, int K, const uint8_t *w, int64_t rb, int n0, int n1, float *y,
                      int accumulate) {
    const int nb = K / 32;
    const __m128i mask = _mm_set1_epi8(0x0f);
    int n = n0;
    for (; n + FUSED_ROWS <= n1; n += FUSED_ROWS) {
        const uint8_t *r0 = w + (size_t)n * rb, *r1 = r0 + rb, *r2 = r1 + rb, *r3 = r2 + rb;
        const float *d0 = (const float *)(r0 + (size_t)nb * 16), *d1 = (const float *)(r1 + (size_t)nb * 16);
        const float *d2 = (const float *)(r2 + (size_t)nb * 16), *d3 = (const float *)(r3 + (size_t)nb * 16);
        __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps(), a2 = _mm512_setzero_ps(), a3 = _mm512_setzero_ps();
        for (int b = 0; b < nb; b++) {
            const __m512 xl = _mm512_loadu_ps(x + b * 32), xh = _mm512_loadu_ps(x + b * 32 + 16);
            const size_t o = (size_t)b * 16;
            a0 = _mm512_fmadd_ps(q41r_block(r0 + o, xl, xh, mask), _mm512_set1_ps(d0[b]), a0);
            a1 = _mm512_fmadd_ps(q41r_block(r1 + o, xl, xh, mask), _mm512_set1_ps(d1[b]), a1);
            a2 = _mm512_fmadd_ps(q41r_block(r2 + o, xl, xh, mask), _mm512_set1_ps(d2[b]), a2);
            a3 = _mm512_fmadd_ps(q41r_block(r3 + o, xl, xh, mask), _mm512_set1_ps(d3[b]), a3);
        }
        /* the mins: sum_b m_b * sum(x_b), one short dot product per row */
        const float v0 = _mm512_reduce_add_ps(a0) + dot(d0 + nb, xsum, nb);
        const float v1 = _mm512_reduce_add_ps(a1) + dot(d1 + nb, xsum, nb);
        const float v2 = _mm512_reduce_add_ps(a2) + dot(d2 + nb, xsum, nb);
        const float v3 = _mm512_reduce_add_ps(a3) + dot(d3 + nb, xsum, nb);
        if (accumulate) { y[n] += v0; y[n + 1] += v1; y[n + 2] += v2; y[n + 3] += v3; }
        else { y[n] = v0; y[n + 1] = v1; y[n + 2] = v2; y[n + 3] = v3; }
    }
    for (; n < n1; n++) {
        const uint8_t *r0 = w + (size_t)n * rb;
        const float *d0 = (const float *)(r0 + (size_t)nb * 16);
        __m512 a0 = _mm512_setzero_ps();
        for (int b = 0; b < nb; b++) {
            const __m512 xl = _mm512_loadu_ps(x + b * 32), xh = _mm512_loadu_ps(x + b * 32 + 16);
            a0 = _mm512_fmadd_ps(q41r_block(r0 + (size_t)b * 16, xl, xh, mask), _mm512_set1_ps(d0[b]), a0);
        }
        const float v0 = _mm512_reduce_add_ps(a0) + dot(d0 + nb, xsum, nb);
        y[n] = accumulate ? y[n] + v0 : v0;
    }
}

static void gemv_fused(const float *x, const float *xsum, int K, const uint8_t *w, int fmt, int64_t rb, int n0, int n1,
                       float *y, int accumulate) {
    if (fmt == TG_Q4_1R) {
        gemv_q41r(x, xsum, K, w, rb, n0, n1, y, accumulate);
        return;
    }
    const int nb = K / 32;
    const __m128i mask = _mm_set1_epi8(0x0f);
    int n = n0;
    float d0, d1, d2, d3, m0, m1, m2, m3;
    for (; n + FUSED_ROWS <= n1; n += FUSED_ROWS) {
        const uint8_t *r0 = w + (size_t)n * rb, *r1 = r0 + rb, *r2 = r1 + rb, *r3 = r2 + rb;
        __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps(), a2 = _mm512_setzero_ps(), a3 = _mm512_setzero_ps();
        float s0 = 0.0f, s1 = 0.0f, s2 = 0.0f, s3 = 0.0f;
        if (fmt == TG_Q4_1) {
            for (int b = 0; b < nb; b++) {
                const __m512 xl = _mm512_loadu_ps(x + b * 32), xh = _mm512_loadu_ps(x + b * 32 + 16);
                const size_t o = (size_t)b * 20;
                const __m512 t0 = q41_block(r0 + o, xl, xh, mask, &d0, &m0);
                const __m512 t1 = q41_block(r1 + o, xl, xh, mask, &d1, &m1);
                const __m512 t2 = q41_block(r2 + o, xl, xh, mask, &d2, &m2);
                const __m512 t3 = q41_block(r3 + o, xl, xh, mask, &d3, &m3);
                a0 = _mm512_fmadd_ps(t0, _mm512_set1_ps(d0), a0);
                a1 = _mm512_fmadd_ps(t1, _mm512_set1_ps(d1), a1);
                a2 = _mm512_fmadd_ps(t2, _mm512_set1_ps(d2), a2);
                a3 = _mm512_fmadd_ps(t3, _mm512_set1_ps(d3), a3);
                s0 += m0 * xsum[b]; s1 += m1 * xsum[b]; s2 += m2 * xsum[b]; s3 += m3 * xsum[b];
            }
        } else {
            for (int b = 0; b < nb; b++) {
                const __m512 xl = _mm512_loadu_ps(x + b * 32), xh = _mm512_loadu_ps(x + b * 32 + 16);
                const size_t o = (size_t)b * 34;
                const __m512 t0 = q80_block(r0 + o, xl, xh, &d0);
                const __m512 t1 = q80_block(r1 + o, xl, xh, &d1);
                const __m512 t2 = q80_block(r2 + o, xl, xh, &d2);
                const __m512 t3 = q80_block(r3 + o, xl, xh, &d3);
                a0 = _mm512_fmadd_ps(t0, _mm512_set1_ps(d0), a0);
                a1 = _mm512_fmadd_ps(t1, _mm512_set1_ps(d1), a1);
                a2 = _mm512_fmadd_ps(t2, _mm512_set1_ps(d2), a2);
                a3 = _mm512_fmadd_ps(t3, _mm512_set1_ps(d3), a3);
            }
        }
        const float v0 = _mm512_reduce_add_ps(a0) + s0, v1 = _mm512_reduce_add_ps(a1) + s1;
        const float v2 = _mm512_reduce_add_ps(a2) + s2, v3 = _mm512_reduce_add_ps(a3) + s3;
        if (accumulate) { y[n] += v0; y[n + 1] += v1; y[n + 2] += v2; y[n + 3] += v3; }
        else { y[n] = v0; y[n + 1] = v1; y[n + 2] = v2; y[n + 3] = v3; }
    }
    for (; n < n1; n++) { /* leftover rows, one at a time */
        const uint8_t *r0 = w + (size_t)n * rb;
        __m512 a0 = _mm512_setzero_ps();
        float s0 = 0.0f;
        for (int b = 0; b < nb; b++) {
            const __m512 xl = _mm512_loadu_ps(x + b * 32), xh = _mm512_loadu_ps(x + b * 32 + 16);
            const __m512 t0 = fmt == TG_Q4_1 ? q41_block(r0 + (size_t)b * 20, xl, xh, mask, &d0, &m0)
                                             : q80_block(r0 + (size_t)b * 34, xl, xh, &d0);
            a0 = _mm512_fmadd_ps(t0, _mm512_set1_ps(d0), a0);
            if (fmt == TG_Q4_1) s0 += m0 * xsum[b];
        }
        const float v0 = _mm512_reduce_add_ps(a0) + s0;
        y[n] = accumulate ? y[n] + v0 : v0;
    }
}
#endif

#if defined(__AVX512F__) && defined(__AVX512VNNI__)
#define TG_VNNI 1
/* ---- int8 activations (AVX-512 VNNI), llama.cpp's lever ----------------------------------------------------------
 * Each activation row is quantized per 32-element block: x8 = round(x / dx), dx = max|x| / 127, and the products are
 * integer dot products (vpdpbusd: unsigned weight bytes x signed activation bytes -> int32), converted to float once
 * per block:  sum_k w_k x_k ~= d_w dx sum_k q_k x8_k + m_w sum_k x_k  (Q4_1; the min term uses the float sum of x,
 * exactly), and for Q8_0, stored as q + 128, d_w dx (sum_k (q_k + 128) x8_k - 128 sum_k x8_k), the correction exact in
 * integers. The error is that of rounding x to 8 bits per block (|x8 dx - x| <= dx / 2), the same as llama.cpp's
 * Q8_1/Q8_0 activations. Each output row r of a 16-row group is one lane of a 16-lane accumulator, so there is no
 * horizontal sum; the group's weights are unpacked once per tile of up to XT activation rows. Every activation row's
 * result is the same sequence of operations whatever the tile or batch it is in, so it does not depend on the batch. */
#define XT 8

/* Two passes (tg_set_activation_passes(2)): the rounding residual x - dx x8 is quantized the same way (scale dr <=
 * dx / 254) and multiplied too, so the activations carry ~16 bits: the error bound drops ~250-fold, to near float32's
 * products, for twice the integer work. */
static int tg_act_passes = 2;
void tg_set_activation_passes(int passes) { tg_act_passes = passes == 2 ? 2 : 1; }

typedef struct {
    int passes;
    int8_t *q;      /* [passes][T, K] */
    float *d;       /* [passes][T, nb] block scales */
    float *sum;     /* [T, nb] float sums of x per block (Q4_1's min term) */
    int32_t *corr;  /* [passes][T, nb] -128 * sum of the block's bytes (Q8_0's +128 offset) */
} tg_xq;

/* One 32-element block (lo, hi) to bytes o[32] at scale max|x| / 127; returns the scale, sets *corr. */
static inline float quantize_block_x8(__m512 lo, __m512 hi, int8_t *o, int32_t *corr, __m512 *rlo, __m512 *rhi) {
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
    const float d = amax / 127.0f, id = amax > 0.0f ? 127.0f / amax : 0.0f;
    /* round to nearest even (the default rounding mode); |x| * id <= 127, so no clamp is needed */
    const __m512i ql = _mm512_cvtps_epi32(_mm512_mul_ps(lo, _mm512_set1_ps(id)));
    const __m512i qh = _mm512_cvtps_epi32(_mm512_mul_ps(hi, _mm512_set1_ps(id)));
    _mm_storeu_si128((__m128i *)o, _mm512_cvtsepi32_epi8(ql));
    _mm_storeu_si128((__m128i *)(o + 16), _mm512_cvtsepi32_epi8(qh));
    *corr = -128 * _mm512_reduce_add_epi32(_mm512_add_epi32(ql, qh));
    *rlo = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(ql), _mm512_set1_ps(d), lo); /* x - d x8 */
    *rhi = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(qh), _mm512_set1_ps(d), hi);
    return d;
}

typedef struct {
    const float *x;
    int T, K;
    tg_xq *xq;
} quantize_job;

static void quantize_range(void *arg, int64_t t0, int64_t t1) {
    const quantize_job *j = (const quantize_job *)arg;
    const float *x = j->x;
    const int T = j->T, K = j->K, nb = K / 32;
    tg_xq *xq = j->xq;
    const size_t pq = (size_t)T * K, ps = (size_t)T * nb;
    for (int t = (int)t0; t < (int)t1; t++) {
        for (int b = 0; b < nb; b++) {
            const float *xb = x + (size_t)t * K + b * 32;
            const size_t tb = (size_t)t * nb + b, tk = (size_t)t * K + b * 32;
            const __m512 lo = _mm512_loadu_ps(xb), hi = _mm512_loadu_ps(xb + 16);
            __m512 rlo, rhi, r2lo, r2hi;
            xq->sum[tb] = _mm512_reduce_add_ps(_mm512_add_ps(lo, hi));
            xq->d[tb] = quantize_block_x8(lo, hi, xq->q + tk, xq->corr + tb, &rlo, &rhi);
            if (xq->passes == 2) xq->d[ps + tb] = quantize_block_x8(rlo, rhi, xq->q + pq + tk, xq->corr + ps + tb, &r2lo, &r2hi);
        }
    }
}

static void quantize_rows_x8(const float *x, int T, int K, tg_xq *xq) {
    quantize_job j = {x, T, K, xq};
    tg_for(T, 1, (int64_t)T * K >= 65536, 0, quantize_range, &j);
}

static inline __m512i bcast4(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm512_set1_epi32(v);
}

/* One 16-row group against activation rows t0 .. t0 + TT - 1 (TT <= XT): y[t, n0 .. n0 + 15]. */
static inline __attribute__((always_inline)) void xgroup_tile(const uint8_t *grp, int fmt, int nb, int K, int T,
                                                               const tg_xq *xq, int t0, int TT, const int PASSES,
                                                               float *y, int ldy, int n0, int accumulate) {
    __m512 acc[XT];
    for (int t = 0; t < TT; t++) acc[t] = _mm512_setzero_ps();
    if (fmt == TG_Q4_1X) {
        const __m512i mask = _mm512_set1_epi8(0x0f);
        for (int b = 0; b < nb; b++) {
            const uint8_t *blk = grp + (size_t)b * 384;
            __m512i lo[4], hi[4];
            for (int i = 0; i < 4; i++) {
                const __m512i p = _mm512_loadu_si512((const void *)(blk + i * 64));
                lo[i] = _mm512_and_si512(p, mask);
                hi[i] = _mm512_and_si512(_mm512_srli_epi16(p, 4), mask);
            }
            const __m512 dw = _mm512_loadu_ps((const float *)(blk + 256)), mw = _mm512_loadu_ps((const float *)(blk + 320));
            for (int t = 0; t < TT; t++) {
                const size_t tb = (size_t)(t0 + t) * nb + b;
                for (int pass = 0; pass < PASSES; pass++) {
                    const int8_t *xb = xq->q + (size_t)pass * T * K + (size_t)(t0 + t) * K + b * 32;
                    __m512i s = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo[0], bcast4(xb));
                    s = _mm512_dpbusd_epi32(s, lo[1], bcast4(xb + 4));
                    s = _mm512_dpbusd_epi32(s, lo[2], bcast4(xb + 8));
                    s = _mm512_dpbusd_epi32(s, lo[3], bcast4(xb + 12));
                    s = _mm512_dpbusd_epi32(s, hi[0], bcast4(xb + 16));
                    s = _mm512_dpbusd_epi32(s, hi[1], bcast4(xb + 20));
                    s = _mm512_dpbusd_epi32(s, hi[2], bcast4(xb + 24));
                    s = _mm512_dpbusd_epi32(s, hi[3], bcast4(xb + 28));
                    const float dx = xq->d[(size_t)pass * T * nb + tb];
                    acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(dw, _mm512_set1_ps(dx)), acc[t]);
                }
                acc[t] = _mm512_fmadd_ps(mw, _mm512_set1_ps(xq->sum[tb]), acc[t]);
            }
        }
    } else { /* TG_Q8_0X */
        for (int b = 0; b < nb; b++) {
            const uint8_t *blk = grp + (size_t)b * 576;
            __m512i wq[8];
            for (int i = 0; i < 8; i++) wq[i] = _mm512_loadu_si512((const void *)(blk + i * 64));
            const __m512 dw = _mm512_loadu_ps((const float *)(blk + 512));
            for (int t = 0; t < TT; t++) {
                const size_t tb = (size_t)(t0 + t) * nb + b;
                for (int pass = 0; pass < PASSES; pass++) {
                    const size_t pb = (size_t)pass * T * nb + tb;
                    const int8_t *xb = xq->q + (size_t)pass * T * K + (size_t)(t0 + t) * K + b * 32;
                    __m512i s = _mm512_set1_epi32(xq->corr[pb]);
                    for (int i = 0; i < 8; i++) s = _mm512_dpbusd_epi32(s, wq[i], bcast4(xb + 4 * i));
                    acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(dw, _mm512_set1_ps(xq->d[pb])), acc[t]);
                }
            }
        }
    }
    for (int t = 0; t < TT; t++) {
        float *yt = y + (size_t)(t0 + t) * ldy + n0;
        _mm512_storeu_ps(yt, accumulate ? _mm512_add_ps(_mm512_loadu_ps(yt), acc[t]) : acc[t]);
    }
}

/* The tiles of one group over all T activation rows: constant tile sizes and pass count (always inlined), so the
 * accumulators live in registers. */
static inline __attribute__((always_inline)) void xgroup_tiles(const uint8_t *grp, int fmt, int nb, int K, int T,
                                                                const tg_xq *xq, const int PASSES, float *y, int ldy,
                                                                int n0, int accumulate) {
    int t = 0;
    for (; t + XT <= T; t += XT) xgroup_tile(grp, fmt, nb, K, T, xq, t, XT, PASSES, y, ldy, n0, accumulate);
    if (T - t >= 4) { xgroup_tile(grp, fmt, nb, K, T, xq, t, 4, PASSES, y, ldy, n0, accumulate); t += 4; }
    if (T - t >= 2) { xgroup_tile(grp, fmt, nb, K, T, xq, t, 2, PASSES, y, ldy, n0, accumulate); t += 2; }
    if (T - t >= 1) xgroup_tile(grp, fmt, nb, K, T, xq, t, 1, PASSES, y, ldy, n0, accumulate);
}

static void xgroups(const uint8_t *w, int fmt, int K, const tg_xq *xq, int T, int g0, int g1, float *y, int ldy,
                    int accumulate) {
    const int nb = K / 32;
    const size_t gbytes = (size_t)nb * (fmt == TG_Q4_1X ? 384 : 576);
    for (int g = g0; g < g1; g++) {
        const uint8_t *grp = w + (size_t)g * gbytes;
        if (xq->passes == 2) xgroup_tiles(grp, fmt, nb, K, T, xq, 2, y, ldy, g * XG, accumulate);
        else xgroup_tiles(grp, fmt, nb, K, T, xq, 1, y, ldy, g * XG, accumulate);
    }
}

typedef struct {
    const uint8_t *w;
    int fmt, K, T;
    const tg_xq *xq;
    float *y;
    int ldy, accumulate;
} x8_job;

static void x8_range(void *arg, int64_t g0, int64_t g1) {
    const x8_job *j = (const x8_job *)arg;
    xgroups(j->w, j->fmt, j->K, j->xq, j->T, (int)g0, (int)g1, j->y, j->ldy, j->accumulate);
}

static void linear_x8(const float *x, int T, int K, const uint8_t *w, int fmt, int N, float *y, int ldy,
                      int accumulate) {
    const int nb = K / 32, groups = N / XG;
    tg_xq xq;
    xq.passes = tg_act_passes;
    xq.q = (int8_t *)malloc((size_t)xq.passes * T * K);
    xq.d = (float *)malloc(sizeof(float) * (size_t)xq.passes * T * nb);
    xq.sum = (float *)malloc(sizeof(float) * (size_t)T * nb);
    xq.corr = (int32_t *)malloc(sizeof(int32_t) * (size_t)xq.passes * T * nb);
    quantize_rows_x8(x, T, K, &xq);
    x8_job j = {w, fmt, K, T, &xq, y, ldy, accumulate};
    tg_for(groups, 1, 1, 0, x8_range, &j);
    free(xq.q); free(xq.d); free(xq.sum); free(xq.corr);
}
#endif

/* The rows [n0, n1) of a product: the fused single-row kernel (xsum set) or dequantized rows (xsum NULL). */
typedef struct {
    const float *x, *xsum;
    int T, K;
    const uint8_t *w;
    int fmt;
    int64_t rb;
    int N;
    float *y;
    int ldy, accumulate;
} linear_job;

static void linear_range(void *arg, int64_t g0, int64_t g1) {
    const linear_job *j = (const linear_job *)arg;
    const int n0 = (int)(g0 * ROWS), n1 = g1 * ROWS < j->N ? (int)(g1 * ROWS) : j->N;
    if (n0 >= n1) return;
#if defined(__AVX512F__)
    if (j->xsum != NULL) {
        gemv_fused(j->x, j->xsum, j->K, j->w, j->fmt, j->rb, n0, n1, j->y, j->accumulate);
        return;
    }
#endif
    float *scratch = (float *)malloc(sizeof(float) * ROWS * (size_t)j->K);
    linear_rows(j->x, j->T, j->K, j->w, j->fmt, j->rb, n0, n1, j->y, j->ldy, j->accumulate, scratch);
    free(scratch);
}

/* y[T, N] (+)= x[T, K] @ W[N, K]^T, W in `fmt`. Rows are split between threads in groups of ROWS. */
static void linear(const float *x, int T, int K, const uint8_t *w, int fmt, int N, float *y, int ldy, int accumulate) {
    const int64_t rb = row_bytes(fmt, K);
    const int groups = (N + ROWS - 1) / ROWS;
#if defined(TG_VNNI)
    if (is_interleaved(fmt)) {
        linear_x8(x, T, K, w, fmt, N, y, ldy, accumulate);
        return;
    }
#endif
#if defined(__AVX512F__)
    if (T == 1 && (fmt == TG_Q4_1 || fmt == TG_Q4_1R || fmt == TG_Q8_0) && K % 32 == 0) {
        float *xsum = (float *)malloc(sizeof(float) * (size_t)(K / 32));
        for (int b = 0; b < K / 32; b++) {
            float s = 0.0f;
            for (int j = 0; j < 32; j++) s += x[b * 32 + j];
            xsum[b] = s;
        }
        linear_job j = {x, xsum, T, K, w, fmt, rb, N, y, ldy, accumulate};
        tg_for(groups, 1, 1, 0, linear_range, &j);
        free(xsum);
        return;
    }
#endif
    linear_job j = {x, NULL, T, K, w, fmt, rb, N, y, ldy, accumulate};
    tg_for(groups, 1, 1, 0, linear_range, &j);
}

/* The interleaved formats hold whole groups of 16 rows. */
static inline int bad_shape(int fmt, int N, int K) {
    return row_bytes(fmt, K) < 0 || (fmt >= TG_Q4_0 && K % 32) || (is_interleaved(fmt) && N % XG);
}

int tg_linear(const float *x, int T, int K, const uint8_t *w, int fmt, int N, float *y, int accumulate) {
    if (bad_shape(fmt, N, K)) return -1;
    linear(x, T, K, w, fmt, N, y, N, accumulate);
    return 0;
}

typedef struct {
    const uint8_t *w;
    int fmt, K;
    int64_t rb;
    float *out;
} dequant_job;

static void dequant_range(void *arg, int64_t n0, int64_t n1) {
    const dequant_job *j = (const dequant_job *)arg;
    for (int64_t n = n0; n < n1; n++) dequant_row_at(j->w, j->fmt, j->K, j->rb, n, j->out + (size_t)n * j->K);
}

int tg_dequant(const uint8_t *w, int fmt, int N, int K, float *out) {
    const int64_t rb = row_bytes(fmt, K);
    if (bad_shape(fmt, N, K)) return -1;
    dequant_job j = {w, fmt, K, rb, out};
    tg_for(N, 1, 1, 0, dequant_range, &j);
    return 0;
}

int tg_embed(const int64_t *ids, int T, const uint8_t *w, int fmt, int vocab, int K, float *out) {
    const int64_t rb = row_bytes(fmt, K);
    if (bad_shape(fmt, vocab, K)) return -1;
    for (int t = 0; t < T; t++) {
        if (ids[t] < 0 || ids[t] >= vocab) return -2;
        dequant_row_at(w, fmt, K, rb, ids[t], out + (size_t)t * K);
    }
    return 0;
}

/* ---- prompt rows on the matrix units (AMX, bfloat16) ----------------------------------------------------------------
 * A prompt's tokens are many rows through the same weights: a GEMM, where the int8 kernels above, built for a few rows
 * (decode), leave most of this CPU's compute unused. With AMX a core multiplies 16x32 by 32x16 bfloat16 tiles into
 * float32 in one instruction (TDPBF16PS), ~8x what AVX-512 reaches. Each weight matrix gets a bfloat16 copy (its GGUF
 * blocks dequantized, then rounded to nearest even) in the tiles' layout: for every 16 output rows n and 32 inputs k,
 * one 1 KiB tile of 16 lines (input pairs k = 2i, 2i+1) x 16 output rows x 2 values. Activations are rounded to
 * bfloat16 per product; sums stay float32. The OS hands the tiles out on request (Linux's arch_prctl), once a
 * process. Built only where the compiler targets AMX (-march=native on such a CPU); elsewhere tg_amx_available is 0. */
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__linux__)
#define TG_AMX 1
#elif defined(__AVX512BF16__) && defined(__AVX512F__)
#define TG_AMX 1
#define TG_TILE_EMU 1 /* no AMX: the same tile code on the software tile unit below */
#endif

/* ---- scratch buffers ----------------------------------------------------------------------------------------- */

/* This thread's scratch `slot` of at least `bytes` (64-byte aligned): a step's row buffers and the prompt path's
 * tiles. They stay from step to step: fresh ones at these sizes (mmap'd by malloc, or heap that free hands back to
 * the OS) cost a page fault every 4 KiB each time, ~2,200 faults in a 512-token prompt step (~6 ms at the ~2.6 us a
 * fault costs on these machines). scratch_trim, at a step's end, frees the largest until the thread keeps at most
 * SCRATCH_KEEP_BYTES (a 512-token step's ~19 MiB stay), so that a large step budget does not hold its memory
 * between steps; a thread's buffers go when the thread ends. */
enum { SCRATCH_X, SCRATCH_ACT, SCRATCH_K, SCRATCH_V, STEP_X, STEP_H, STEP_QKV, STEP_Q, STEP_ATTN, STEP_GU, STEP_ACT,
       SCRATCHES };
#define SCRATCH_KEEP_BYTES ((size_t)32 << 20)
typedef struct {
    void *buf[SCRATCHES];
    size_t cap[SCRATCHES];
} scratch_set;
static pthread_key_t scratch_key;
static pthread_once_t scratch_once = PTHREAD_ONCE_INIT;

static void scratch_free_set(void *p) {
    scratch_set *s = (scratch_set *)p;
    for (int i = 0; i < SCRATCHES; i++) free(s->buf[i]);
    free(s);
}

static void scratch_key_init(void) { pthread_key_create(&scratch_key, scratch_free_set); }

static scratch_set *scratch_of_thread(void) {
    pthread_once(&scratch_once, scratch_key_init);
    scratch_set *s = (scratch_set *)pthread_getspecific(scratch_key);
    if (s == NULL) {
        s = (scratch_set *)calloc(1, sizeof(scratch_set));
        if (s == NULL) abort();
        pthread_setspecific(scratch_key, s);
    }
    return s;
}

static void *scratch(int slot, size_t bytes) {
    scratch_set *s = scratch_of_thread();
    if (bytes > s->cap[slot]) {
        free(s->buf[slot]);
        s->cap[slot] = (bytes + 65535) / 65536 * 65536;
        s->buf[slot] = aligned_alloc(64, s->cap[slot]);
        if (s->buf[slot] == NULL) abort();
    }
    return s->buf[slot];
}

static void scratch_trim(void) {
    scratch_set *s = scratch_of_thread();
    for (;;) {
        size_t kept = 0;
        int largest = 0;
        for (int i = 0; i < SCRATCHES; i++) {
            kept += s->cap[i];
            if (s->cap[i] > s->cap[largest]) largest = i;
        }
        if (kept <= SCRATCH_KEEP_BYTES) return;
        free(s->buf[largest]);
        s->buf[largest] = NULL;
        s->cap[largest] = 0;
    }
}

#if defined(TG_AMX)
#define AMX_TILE_ELEMS 512 /* bfloat16 values in one 16 x 64-byte tile */

#if defined(TG_TILE_EMU)
/* The software tile unit, for CPUs with AVX-512 BF16 and no AMX (AMD Zen 4 and later). The tile code's 32 x 32
 * blocks (products and attention) are computed whole by emu_block (below): VDPBF16PS, a pair of an A row broadcast
 * times a line of B (16 outputs), on the tiles' layouts and in their order of sums, into four 1 KiB accumulator
 * tiles a thread that _tile_stored then writes out as the tile code expects. So the whole prompt path (products,
 * SiLU on the way out, attention) runs on it unchanged but for those blocks. Measured against the block kernels on
 * such a CPU: docs/benchmarks.md. */
typedef union { float f[256]; uint32_t u[256]; } __attribute__((aligned(64))) emu_tile;
static __thread emu_tile emu_tiles[4]; /* the accumulators 0-3 of the block emu_block computed last */

static inline __attribute__((always_inline)) void emu_store(int t, void *p, long stride) {
    char *dst = (char *)p;
    const uint32_t *src = emu_tiles[t].u;
    for (int r = 0; r < 16; r++)
        _mm512_storeu_si512((void *)(dst + (size_t)r * stride), _mm512_load_si512((const void *)(src + 16 * r)));
}

/* gcc's immintrin.h defines the AMX names as macros whatever the target: the ones the emulated path still reaches
 * are replaced, the others removed, so that tile code left outside emu_block cannot compile to AMX instructions */
#undef _tile_loadd
#undef _tile_stream_loadd
#undef _tile_stored
#undef _tile_zero
#undef _tile_dpbf16ps
#undef _tile_loadconfig
#undef _tile_release
#define _tile_stored(t, p, stride) emu_store((t), (p), (stride))
#define _tile_loadconfig(cfg) ((void)(cfg))
#define _tile_release() ((void)0)

int tg_amx_available(void) { return 1; }
int tg_tile_unit(void) { return 2; }
#else
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18
static int amx_state = -1; /* -1: not asked yet, 0: refused, 1: granted */

int tg_amx_available(void) {
    if (amx_state < 0) amx_state = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    return amx_state;
}
int tg_tile_unit(void) { return tg_amx_available(); }
#endif

static inline uint16_t f2bf(float f) { /* round to nearest even (weights; NaN does not occur in them) */
    uint32_t u;
    memcpy(&u, &f, 4);
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

typedef struct { const uint8_t *w; int fmt, K; int64_t rb; uint16_t *out; } bf16_pack_job;

static void bf16_pack_range(void *arg, int64_t nb0, int64_t nb1) { /* nb: blocks of 16 output rows */
    const bf16_pack_job *j = (const bf16_pack_job *)arg;
    const int K = j->K, kbn = K / 32;
    float *row = (float *)malloc(sizeof(float) * (size_t)K);
    for (int64_t nb = nb0; nb < nb1; nb++)
        for (int c = 0; c < 16; c++) {
            dequant_row_at(j->w, j->fmt, K, j->rb, nb * 16 + c, row);
            for (int k = 0; k < K; k++) {
                const size_t tile = (size_t)nb * kbn + k / 32;
                j->out[tile * AMX_TILE_ELEMS + (size_t)((k % 32) / 2) * 32 + c * 2 + (k & 1)] = f2bf(row[k]);
            }
        }
    free(row);
}

/* out[N * K] (bfloat16): W [N, K] in `fmt`, in the tiles' layout. N a multiple of 32, K of 32. */
int tg_pack_bf16(const uint8_t *w, int fmt, int N, int K, uint16_t *out) {
    if (bad_shape(fmt, N, K) || N % 32 || K % 32) return -1;
    bf16_pack_job j = {w, fmt, K, row_bytes(fmt, K), out};
    tg_for(N / 16, 1, 1, 0, bf16_pack_range, &j);
    return 0;
}

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((packed)) amx_config;

/* This thread's tile registers: all eight 16 rows x 64 bytes (accumulators 0-3, operands 4-7). */
static inline void amx_load_config(void) {
    amx_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) { cfg.colsb[t] = 64; cfg.rows[t] = 16; }
    _tile_loadconfig(&cfg);
}

typedef struct {
    const uint16_t *x; /* activations as A tiles: [Tp / 16 row blocks][K / 32][16 rows x 32], Tp = T rounded to 32 */
    const uint16_t *w; /* the weight's tiles */
    int T, Tp, K;
    float *y;
    int ldy, accumulate;
    int64_t groups; /* N / 32 */
} amx_job;

/* Rows in blocks of about AMX_BLOCK_BYTES of activation tiles: a block stays in L2 (2 MiB a core here) while every
 * column group of the range passes over it; with all of T at once (1,536 rows: 1.7-4.7 MiB) they came from L3. */
#define AMX_BLOCK_BYTES (768 * 1024)

static inline int amx_row_block(int K) {
    const int rb = AMX_BLOCK_BYTES / (K * 2) / 32 * 32;
    return rb < 32 ? 32 : rb;
}

#if !defined(TG_TILE_EMU)
/* K tile kb of a 32 x 32 block: rows a0 / a1 (16 each) times columns b0 / b1 (16 each) into accumulators 0-3, for
 * amx_block_part and the gate/up loop that applies SiLU between K tiles. */
static inline __attribute__((always_inline)) void amx_k_step(const uint16_t *a0, const uint16_t *a1,
                                                             const uint16_t *b0, const uint16_t *b1, int kb) {
    _tile_stream_loadd(4, a0 + (size_t)kb * AMX_TILE_ELEMS, 64);
    _tile_stream_loadd(5, a1 + (size_t)kb * AMX_TILE_ELEMS, 64);
    _tile_loadd(6, b0 + (size_t)kb * AMX_TILE_ELEMS, 64);
    _tile_loadd(7, b1 + (size_t)kb * AMX_TILE_ELEMS, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
}
#endif

/* amx_block_part: accumulators 0-3 = the 32 x 32 block of rows a0 (two A tiles' rows, kbn tiles each) times the
 * columns of b0 (two column tiles), over K tiles [kb0, kb1) from the sums in acc (NULL: from zero): over the whole of
 * K in pieces or at once, one sum sequence per output, whichever block or thread computes it. */
#if defined(TG_TILE_EMU)
/* The software tile unit's 32 x 32 block: 8 rows at a time with their 16 sums (8 rows x 2 column tiles) in
 * registers over all of its K tiles, then into accumulators 0-3 as the tile code expects them; each line of B feeds
 * 8 rows' products. Against emulating each tile instruction with its sums through memory: the same sums in the same
 * order, 1.1-1.5x the products a second (benchmarks/tile_product.py); keeping B's lines in L1 across the four passes
 * (K in pieces) gained nothing. A's rows 0-15 start at a_lo, 16-31 at a_hi, sa bytes apart; K tile k of A is ak
 * bytes on, of B (columns 0-15 at b0, 16-31 at b1) bk bytes on; acc: the sums so far (32 rows of 32), or NULL. */
#define EMU_ROWS 8
static inline __attribute__((always_inline)) void emu_rows_part(const char *a, long sa, long ak, const char *b0,
                                                                const char *b1, long bk, int k0, int k1,
                                                                __m512 s[2 * EMU_ROWS]) {
    for (int k = k0; k < k1; k++) {
        const char *ka = a + k * ak, *kb0 = b0 + k * bk, *kb1 = b1 + k * bk;
        for (int i = 0; i < 16; i++) {
            const __m512bh l0 = (__m512bh)_mm512_loadu_si512((const void *)(kb0 + 64 * i));
            const __m512bh l1 = (__m512bh)_mm512_loadu_si512((const void *)(kb1 + 64 * i));
            for (int r = 0; r < EMU_ROWS; r++) {
                int pair;
                memcpy(&pair, ka + sa * r + 4 * i, 4);
                const __m512bh x = (__m512bh)_mm512_set1_epi32(pair);
                s[2 * r] = _mm512_dpbf16_ps(s[2 * r], x, l0);
                s[2 * r + 1] = _mm512_dpbf16_ps(s[2 * r + 1], x, l1);
            }
        }
    }
}

static inline __attribute__((always_inline)) void emu_block(const void *a_lo, const void *a_hi, long sa, long ak,
                                                            const void *b0, const void *b1, long bk, int k0, int k1,
                                                            const float *acc) {
    for (int row0 = 0; row0 < 32; row0 += EMU_ROWS) { /* a pass's rows lie in one A tile */
        __m512 s[2 * EMU_ROWS];
        for (int r = 0; r < EMU_ROWS; r++) {
            s[2 * r] = acc ? _mm512_load_ps(acc + (row0 + r) * 32) : _mm512_setzero_ps();
            s[2 * r + 1] = acc ? _mm512_load_ps(acc + (row0 + r) * 32 + 16) : _mm512_setzero_ps();
        }
        const char *a = (const char *)(row0 < 16 ? a_lo : a_hi) + sa * (row0 % 16);
        emu_rows_part(a, sa, ak, (const char *)b0, (const char *)b1, bk, k0, k1, s);
        float *t0 = emu_tiles[row0 < 16 ? 0 : 2].f + 16 * (row0 % 16);
        float *t1 = emu_tiles[row0 < 16 ? 1 : 3].f + 16 * (row0 % 16);
        for (int r = 0; r < EMU_ROWS; r++) {
            _mm512_store_ps(t0 + 16 * r, s[2 * r]);
            _mm512_store_ps(t1 + 16 * r, s[2 * r + 1]);
        }
    }
}

static inline void amx_block_part(const uint16_t *a0, const uint16_t *b0, int kbn, int kb0, int kb1, const float *acc) {
    const long tile = AMX_TILE_ELEMS * 2; /* bytes */
    emu_block(a0, a0 + (size_t)kbn * AMX_TILE_ELEMS, 64, tile, b0, b0 + (size_t)kbn * AMX_TILE_ELEMS, tile, kb0, kb1,
              acc);
}
#else
/* The activations' tiles, streamed from L2 and used once here, load with the non-temporal hint (TILELOADDT1) so they
 * do not push the weight's tiles out of L1: ~20% more products a second at K = 576 (one core, 512-1,536 rows). */
static inline void amx_block_part(const uint16_t *a0, const uint16_t *b0, int kbn, int kb0, int kb1, const float *acc) {
    const uint16_t *a1 = a0 + (size_t)kbn * AMX_TILE_ELEMS, *b1 = b0 + (size_t)kbn * AMX_TILE_ELEMS;
    if (acc == NULL) {
        _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
    } else { /* the sums of the K tiles before kb0, stored exactly (float32) */
        _tile_loadd(0, acc, 128);
        _tile_loadd(1, acc + 16, 128);
        _tile_loadd(2, acc + 16 * 32, 128);
        _tile_loadd(3, acc + 16 * 32 + 16, 128);
    }
    for (int kb = kb0; kb < kb1; kb++) amx_k_step(a0, a1, b0, b1, kb);
}
#endif

static inline void amx_block(const uint16_t *a0, const uint16_t *b0, int kbn) { amx_block_part(a0, b0, kbn, 0, kbn, NULL); }

/* K tiles a column group's weight is cut into (pieces of at most AMX_KC): where a group's tiles (2 K x 32 bytes)
 * are over L1's 48 KiB (down's K = 1,536: 96 KiB), both operands came from L2 at every block; a piece's stay in L1
 * while the row block passes, its 32 x 32 sums kept (exactly: float32) in an L2 scratch between pieces. */
#define AMX_KC 16
static inline int amx_k_piece(int kbn) {
    if (kbn <= AMX_KC + AMX_KC / 4) return kbn;
    const int pieces = (kbn + AMX_KC - 1) / AMX_KC;
    return (kbn + pieces - 1) / pieces;
}

static inline void amx_store_block(float *c, size_t ld) { /* accumulators 0-3 to c: 32 rows of ld floats */
    _tile_stored(0, c, ld * 4);
    _tile_stored(1, c + 16, ld * 4);
    _tile_stored(2, c + 16 * ld, ld * 4);
    _tile_stored(3, c + 16 * ld + 16, ld * 4);
}

/* Column group g's weight tiles (2 x kbn) at a 64-byte aligned place: tiles off 64-byte lines load every line
 * twice (numpy's large arrays start 16 bytes into a page), so where W is off (wc not NULL) they are copied first. */
static inline const uint16_t *amx_group(const uint16_t *w, int64_t g, int kbn, uint16_t *wc) {
    const uint16_t *b = w + (size_t)g * 2 * kbn * AMX_TILE_ELEMS;
    if (wc == NULL) return b;
    memcpy(wc, b, sizeof(uint16_t) * 2 * kbn * AMX_TILE_ELEMS);
    return wc;
}

/* Part `part` of `parts` of column group g's weight tiles toward L2 (nothing past the last group), issued while the
 * group before it computes: a prompt step's weights (~200 MB of tiles for SmolLM2's layers) come from L3 or memory,
 * and a group's first row block otherwise waited on its lines one miss at a time. */
static inline void amx_prefetch_group(const uint16_t *w, int64_t g, int64_t groups, int kbn, int part, int parts) {
    if (g < 0 || g >= groups) return;
    const char *b = (const char *)(w + (size_t)g * 2 * kbn * AMX_TILE_ELEMS);
    const int lines = 2 * kbn * AMX_TILE_ELEMS * 2 / 64;
    for (int l = lines * part / parts; l < lines * (part + 1) / parts; l++) _mm_prefetch(b + (size_t)l * 64, _MM_HINT_T1);
}

/* The group whose weights a range's loop needs after g: the next of the range, else the first one again for the
 * next row block, else the group after the range (likely the next range claimed). */
static inline int64_t amx_next_group(int64_t g, int64_t g0, int64_t g1, int more_rows) {
    return g + 1 < g1 ? g + 1 : (more_rows ? g0 : g1);
}

/* amx_group's copy buffer where W's tiles are off 64-byte lines, else NULL. */
static uint16_t *amx_group_buffer(const uint16_t *w, int kbn) {
    return ((uintptr_t)w & 63) ? (uint16_t *)aligned_alloc(64, sizeof(uint16_t) * 2 * kbn * AMX_TILE_ELEMS) : NULL;
}

/* Output columns [32 g0, 32 g1), row block by row block; per block, the weight's tiles for 32 columns (2 x K x 32
 * bytes, or a piece of K of them: amx_k_piece) stay in L1 while the block's activation tiles come from L2. y's
 * 32 x 32 blocks are stored straight from the tiles when whole and not added to y, else through c. */
static void amx_range(void *arg, int64_t g0, int64_t g1) {
    const amx_job *j = (const amx_job *)arg;
    amx_load_config();
    const int kbn = j->K / 32, rb = amx_row_block(j->K), kc = amx_k_piece(kbn);
    const int kl = (kbn - 1) / kc * kc; /* the last piece's first K tile (0: one piece) */
    uint16_t *wc = amx_group_buffer(j->w, kbn);
    float *part = kc < kbn ? (float *)aligned_alloc(64, sizeof(float) * (size_t)rb * 32) : NULL;
    float c[32 * 32] __attribute__((aligned(64)));
    for (int mb = 0; mb < j->Tp; mb += rb) {
        const int me = mb + rb < j->Tp ? mb + rb : j->Tp;
        const int nblk = (me - mb) / 32, parts = (kl / kc + 1) * nblk; /* the next group's prefetch: every piece */
        for (int64_t g = g0; g < g1; g++) {
            const uint16_t *b0 = amx_group(j->w, g, kbn, wc);
            const int64_t gn = amx_next_group(g, g0, g1, me < j->Tp);
            for (int kb0 = 0; kb0 <= kl; kb0 += kc)
                for (int m0 = mb; m0 < me; m0 += 32) {
                    amx_prefetch_group(j->w, gn, j->groups, kbn, kb0 / kc * nblk + (m0 - mb) / 32, parts);
                    float *pm = part + (size_t)(m0 - mb) * 32;
                    amx_block_part(j->x + (size_t)(m0 / 16) * kbn * AMX_TILE_ELEMS, b0, kbn, kb0,
                                   kb0 + kc < kbn ? kb0 + kc : kbn, kb0 > 0 ? pm : NULL);
                    if (kb0 < kl) {
                        amx_store_block(pm, 32);
                        continue;
                    }
                    float *yb = j->y + (size_t)m0 * j->ldy + g * 32;
                    const int rows = j->T - m0 < 32 ? j->T - m0 : 32;
                    if (!j->accumulate && rows == 32) {
                        amx_store_block(yb, (size_t)j->ldy);
                        continue;
                    }
                    amx_store_block(c, 32);
                    for (int r = 0; r < rows; r++) {
                        float *yr = yb + (size_t)r * j->ldy;
                        const __m512 lo = _mm512_load_ps(c + r * 32), hi = _mm512_load_ps(c + r * 32 + 16);
                        if (j->accumulate) {
                            _mm512_storeu_ps(yr, _mm512_add_ps(_mm512_loadu_ps(yr), lo));
                            _mm512_storeu_ps(yr + 16, _mm512_add_ps(_mm512_loadu_ps(yr + 16), hi));
                        } else {
                            _mm512_storeu_ps(yr, lo);
                            _mm512_storeu_ps(yr + 16, hi);
                        }
                    }
                }
        }
    }
    free(part);
    free(wc);
    _tile_release();
}

static inline __m512 exp512(__m512 x);

/* silu(g) * u as the step's silu_mul computes it (the same numbers). */
static inline __m512 silu_times(__m512 g, __m512 u) {
    const __m512 e = exp512(_mm512_sub_ps(_mm512_setzero_ps(), g));
    return _mm512_mul_ps(_mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), e)), u);
}

/* The MLP's gate|up product with SiLU(gate) * up applied as its blocks come out of the tiles, written as bfloat16
 * A tiles (I / 32 per 16 rows) for the down product: the [T, 2I] float32 gate|up rows and the [T, I] activation
 * rows that a separate SiLU pass wrote and read, and their conversion to tiles, are never made. Groups [g0, g1) of
 * 32 activation columns; per row block, the gate half's blocks go to a scratch (L2) and the up half's meet them. */
typedef struct { const uint16_t *x, *w; int T, Tp, K, I; uint16_t *act; } amx_silu_job;

/* Rows [r0, r1) of the 32-row block at m0 (mb: its row block's first row) of column group g: SiLU(gate) * up from
 * the gate scratch and the up block c, as bfloat16 into the activation's tiles. */
static inline void silu_act_rows(const amx_silu_job *j, const float *gate, const float *c, int mb, int m0, int64_t g,
                                 int r0, int r1) {
    const int ikbn = j->I / 32;
    for (int r = r0; r < r1; r++) {
        const float *gr = gate + (size_t)(m0 - mb + r) * 32;
        uint16_t *dst = j->act + ((size_t)((m0 + r) / 16) * ikbn + g) * AMX_TILE_ELEMS + (r % 16) * 32;
        if (m0 + r < j->T) {
            const __m512 lo = silu_times(_mm512_load_ps(gr), _mm512_load_ps(c + r * 32));
            const __m512 hi = silu_times(_mm512_load_ps(gr + 16), _mm512_load_ps(c + r * 32 + 16));
            _mm512_store_si512((void *)dst, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
        } else {
            memset(dst, 0, 64); /* rows past T: zeros, as to_tiles_range leaves them */
        }
    }
}

/* The up half: while block m0's tile products run, the vector units apply SiLU to the block before it (its sums in
 * the other half of cb), a few rows per K step. Done after each block's products, the SiLU (an exp and a divide per
 * value) left the matrix unit idle: about as long as the block's products themselves. */
static void amx_silu_range(void *arg, int64_t g0, int64_t g1) {
    const amx_silu_job *j = (const amx_silu_job *)arg;
    amx_load_config();
    const int kbn = j->K / 32, rb = amx_row_block(j->K), ikbn = j->I / 32;
    uint16_t *wc = amx_group_buffer(j->w, kbn);
    float *gate = (float *)aligned_alloc(64, sizeof(float) * (size_t)rb * 32);
    float cb[2][32 * 32] __attribute__((aligned(64)));
    for (int mb = 0; mb < j->Tp; mb += rb) {
        const int me = mb + rb < j->Tp ? mb + rb : j->Tp;
        for (int64_t g = g0; g < g1; g++) {
            const uint16_t *bg = amx_group(j->w, g, kbn, wc);
            const int64_t gn = amx_next_group(g, g0, g1, me < j->Tp);
            const int parts = (me - mb) / 32;
            for (int m0 = mb; m0 < me; m0 += 32) {
                amx_prefetch_group(j->w, g + ikbn, 2 * ikbn, kbn, (m0 - mb) / 32, parts); /* this group's up half */
                amx_block(j->x + (size_t)(m0 / 16) * kbn * AMX_TILE_ELEMS, bg, kbn);
                amx_store_block(gate + (size_t)(m0 - mb) * 32, 32);
            }
            const uint16_t *bu = amx_group(j->w, g + ikbn, kbn, wc);
            int prev = -1; /* the block whose SiLU is pending */
            for (int m0 = mb; m0 < me; m0 += 32) {
                amx_prefetch_group(j->w, gn, ikbn, kbn, (m0 - mb) / 32, parts); /* the next gate half */
                const uint16_t *a0 = j->x + (size_t)(m0 / 16) * kbn * AMX_TILE_ELEMS;
                const float *cp = prev >= 0 ? cb[((prev - mb) / 32) & 1] : NULL;
#if defined(TG_TILE_EMU) /* one set of vector units: nothing to overlap */
                amx_block(a0, bu, kbn);
                if (cp != NULL) silu_act_rows(j, gate, cp, mb, prev, g, 0, 32);
#else
                const uint16_t *a1 = a0 + (size_t)kbn * AMX_TILE_ELEMS, *b1 = bu + (size_t)kbn * AMX_TILE_ELEMS;
                _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
                for (int kb = 0; kb < kbn; kb++) { /* amx_block's products, the same order */
                    amx_k_step(a0, a1, bu, b1, kb);
                    if (cp != NULL) silu_act_rows(j, gate, cp, mb, prev, g, 32 * kb / kbn, 32 * (kb + 1) / kbn);
                }
#endif
                amx_store_block(cb[((m0 - mb) / 32) & 1], 32);
                prev = m0;
            }
            if (prev >= 0) silu_act_rows(j, gate, cb[((prev - mb) / 32) & 1], mb, prev, g, 0, 32);
        }
    }
    free(gate);
    free(wc);
    _tile_release();
}

static float rms_scale(const float *x, int n, float eps);
static void hadamard(float *v, int n);
static inline __attribute__((always_inline)) void hadamard_regs(__m512 *r, int nv);

/* x's rows into A tiles, each first through the RMS norm of weight norm_w where that is set, or turned back by the
 * Hadamard transform head by head (heads of unturn_hd values) where that is set: the step's norms and the attention
 * output's turn then write tiles, not float rows that a separate pass read back to round. */
typedef struct {
    const float *x;
    int T, K;
    uint16_t *xb;
    const float *norm_w;
    float eps;
    int unturn_hd;
} to_tiles_job;

static inline void tile_row_store(uint16_t *dst, __m512 lo, __m512 hi) { /* 32 values, one 64-byte tile row */
    _mm512_store_si512((void *)dst, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
}

/* Rows [16 b0, 16 b1) of x into A tiles (rows past T are zeros). A row's 32-value blocks go from registers to the
 * tiles through the norm (its scale, then its weight: rms_norm's products in rms_norm's order) or each head's turn
 * back, with no float row in between; heads that are not a whole number of blocks take the float row. */
static void to_tiles_range(void *arg, int64_t b0, int64_t b1) {
    const to_tiles_job *j = (const to_tiles_job *)arg;
    const int K = j->K, kbn = K / 32, hd = j->unturn_hd;
    const int in_regs = hd == 0 || (hd % 32 == 0 && hd <= 512);
    float *row = in_regs ? NULL : (float *)aligned_alloc(64, sizeof(float) * (size_t)K);
    for (int64_t b = b0; b < b1; b++)
        for (int r = 0; r < 16; r++) {
            const int64_t t = b * 16 + r;
            uint16_t *dst = j->xb + (size_t)b * kbn * AMX_TILE_ELEMS + r * 32; /* block kb: + kb * AMX_TILE_ELEMS */
            if (t >= j->T) {
                for (int kb = 0; kb < kbn; kb++) memset(dst + (size_t)kb * AMX_TILE_ELEMS, 0, 64);
                continue;
            }
            const float *x = j->x + (size_t)t * K;
            if (hd > 0 && in_regs) {
                __m512 v[32];
                for (int h = 0; h < K; h += hd) {
                    for (int i = 0; i < hd / 16; i++) v[i] = _mm512_loadu_ps(x + h + 16 * i);
                    hadamard_regs(v, hd / 16);
                    for (int i = 0; i < hd / 32; i++)
                        tile_row_store(dst + (size_t)(h / 32 + i) * AMX_TILE_ELEMS, v[2 * i], v[2 * i + 1]);
                }
                continue;
            }
            if (hd > 0) {
                memcpy(row, x, sizeof(float) * (size_t)K);
                for (int i = 0; i < K; i += hd) hadamard(row + i, hd);
                x = row;
            }
            const float *w = j->norm_w;
            const __m512 sv = _mm512_set1_ps(w != NULL ? rms_scale(x, K, j->eps) : 1.0f);
            for (int kb = 0; kb < kbn; kb++) {
                __m512 lo = _mm512_loadu_ps(x + kb * 32), hi = _mm512_loadu_ps(x + kb * 32 + 16);
                if (w != NULL) {
                    lo = _mm512_mul_ps(_mm512_mul_ps(lo, sv), _mm512_loadu_ps(w + kb * 32));
                    hi = _mm512_mul_ps(_mm512_mul_ps(hi, sv), _mm512_loadu_ps(w + kb * 32 + 16));
                }
                tile_row_store(dst + (size_t)kb * AMX_TILE_ELEMS, lo, hi);
            }
        }
    free(row);
}

/* x[T, K] as A tiles, Tp = T rounded up to 32 rows (zeros past T), in scratch `slot`; each row through the RMS norm
 * of weight norm_w (not NULL), or turned back head by head (unturn_hd > 0), first. */
static uint16_t *amx_tiles_of(const float *x, int T, int K, int slot, const float *norm_w, float eps, int unturn_hd) {
    const int Tp = (T + 31) / 32 * 32;
    uint16_t *xb = (uint16_t *)scratch(slot, (size_t)Tp * K * 2);
    to_tiles_job tj = {x, T, K, xb, norm_w, eps, unturn_hd};
    tg_for(Tp / 16, 2, Tp >= 64, 0, to_tiles_range, &tj);
    return xb;
}

static uint16_t *amx_tiles(const float *x, int T, int K, int slot) { return amx_tiles_of(x, T, K, slot, NULL, 0.0f, 0); }

/* y[T, N] (+)= X @ W^T with X as A tiles (amx_tiles) and W's bfloat16 tiles `wb`. */
static void linear_amx_tiles(const uint16_t *xb, int T, int K, const uint16_t *wb, int N, float *y, int ldy,
                             int accumulate) {
    amx_job j = {xb, wb, T, (T + 31) / 32 * 32, K, y, ldy, accumulate, N / 32};
    tg_for(N / 32, 1, 1, 0, amx_range, &j);
}

/* y[T, N] (+)= x[T, K] @ W^T with W's bfloat16 tiles `wb`. */
static void linear_amx(const float *x, int T, int K, const uint16_t *wb, int N, float *y, int ldy, int accumulate) {
    linear_amx_tiles(amx_tiles(x, T, K, SCRATCH_X), T, K, wb, N, y, ldy, accumulate);
}

/* SiLU(x W_gate^T) * (x W_up^T) as A tiles for the down product ([Tp, I] bfloat16, zeros past T; this thread's
 * scratch, valid until its next gate_up_amx): x as A tiles (amx_tiles), W = gate|up, [2I, K] as bfloat16 tiles. */
static const uint16_t *gate_up_amx(const uint16_t *xb, int T, int K, const uint16_t *wb, int I) {
    const int Tp = (T + 31) / 32 * 32;
    uint16_t *act = (uint16_t *)scratch(SCRATCH_ACT, (size_t)Tp * I * 2);
    amx_silu_job j = {xb, wb, T, Tp, K, I, act};
    tg_for(I / 32, 1, 1, 0, amx_silu_range, &j);
    return act;
}

/* y[T, N] (+)= x[T, K] @ W^T through W's tiles (tg_pack_bf16): for tests and benchmarks. */
int tg_linear_bf16(const float *x, int T, int K, const uint16_t *wb, int N, float *y, int accumulate) {
    if (T < 1 || K % 32 || N % 32 || !tg_amx_available()) return -1;
    linear_amx(x, T, K, wb, N, y, N, accumulate);
    scratch_trim();
    return 0;
}
#else
int tg_amx_available(void) { return 0; }
int tg_tile_unit(void) { return 0; }
int tg_linear_bf16(const float *x, int T, int K, const uint16_t *wb, int N, float *y, int accumulate) {
    (void)x; (void)T; (void)K; (void)wb; (void)N; (void)y; (void)accumulate;
    return -1;
}
int tg_pack_bf16(const uint8_t *w, int fmt, int N, int K, uint16_t *out) {
    (void)w; (void)fmt; (void)N; (void)K; (void)out;
    return -1;
}
#endif

/* ---- the decode step ---------------------------------------------------------------------------------------------- */

typedef struct {
    const uint8_t *data;
    int32_t fmt, N, K, pad;
    const uint16_t *bf16; /* the weights as bfloat16 tiles for prompt rows (tg_pack_bf16), or NULL */
} tg_mat;

/* y (+)= x @ W^T for a step's rows: rows [0, n_dec) (decodes) through the block kernels, the rest (prompt rows)
 * through the matrix units when W has its tiles. A row's numbers depend on its kind and its own values only. */
static void step_linear(const float *x, int T, int n_dec, int K, const tg_mat *W, float *y, int ldy, int accumulate) {
#if defined(TG_AMX)
    if (W->bf16 != NULL && n_dec < T) {
        if (n_dec > 0) linear(x, n_dec, K, W->data, W->fmt, W->N, y, ldy, accumulate);
        linear_amx(x + (size_t)n_dec * K, T - n_dec, K, W->bf16, W->N, y + (size_t)n_dec * ldy, ldy, accumulate);
        return;
    }
#endif
    (void)n_dec;
    linear(x, T, K, W->data, W->fmt, W->N, y, ldy, accumulate);
}

/* step_linear with the prompt rows already as A tiles (xb, step_rows_in), or, xb NULL, all rows as floats. */
static void step_linear_in(const float *x, const uint16_t *xb, int T, int n_dec, int K, const tg_mat *W, float *y,
                           int ldy, int accumulate) {
#if defined(TG_AMX)
    if (xb != NULL) {
        if (n_dec > 0) linear(x, n_dec, K, W->data, W->fmt, W->N, y, ldy, accumulate);
        linear_amx_tiles(xb, T - n_dec, K, W->bf16, W->N, y + (size_t)n_dec * ldy, ldy, accumulate);
        return;
    }
#endif
    (void)xb;
    step_linear(x, T, n_dec, K, W, y, ldy, accumulate);
}

typedef struct {
    const float *attn_norm, *ffn_norm;
    tg_mat qkv, o, gate_up, down;
} tg_layer;

typedef struct {
    int32_t n_layers, hidden, inter, n_heads, n_kv, head_dim, vocab, max_pos;
    float eps, pad;
    const tg_layer *layers;
    const float *final_norm;
    tg_mat embed, lm_head;
    const float *cos, *sin; /* [max_pos, head_dim]; sin carries rotate-half's sign in its first half */
} tg_model;

/* KV cache formats. TG_KV_I8: each (position, kv head) row is head_dim int8 values then its float16 scale (2 bytes),
 * value = scale * q, scale = max|x| / 127 rounded to float16: [n_layers, 2, num_blocks, block_size, n_kv, head_dim + 2]
 * bytes. A scale per token and head follows each token's own range (keys differ a lot from head to head), and is
 * written with the token, so no block ever needs re-quantizing as it fills. */
enum { TG_KV_F32 = 0, TG_KV_F16 = 1, TG_KV_I8 = 2 };

typedef struct {
    void *kv;           /* [n_layers, 2, num_blocks, block_size, n_kv, row], row = head_dim (floats) or head_dim + 2 */
    int32_t fmt, num_blocks, block_size, pad;
} tg_kv;

/* Elements (floats, halves or bytes) per stored (position, kv head) row, and the bytes of one element. */
static inline int kv_row_width(int fmt, int hd) { return fmt == TG_KV_I8 ? hd + 2 : hd; }
static inline int kv_elem_bytes(int fmt) { return fmt == TG_KV_I8 ? 1 : fmt == TG_KV_F16 ? 2 : 4; }

/* 1 / sqrt(mean(x^2) + eps), the sum of squares in double */
static float rms_scale(const float *x, int n, float eps) {
    double ss = 0.0;
    int i0 = 0;
#if defined(__AVX512F__)
    __m512d acc = _mm512_setzero_pd();
    for (; i0 + 8 <= n; i0 += 8) {
        const __m512d v = _mm512_cvtps_pd(_mm256_loadu_ps(x + i0));
        acc = _mm512_fmadd_pd(v, v, acc);
    }
    ss = _mm512_reduce_add_pd(acc);
#endif
    for (int i = i0; i < n; i++) ss += (double)x[i] * x[i];
    return 1.0f / sqrtf((float)(ss / n) + eps);
}

static void rms_norm(const float *x, const float *w, int n, float eps, float *out) {
    const float r = rms_scale(x, n, eps);
    for (int i = 0; i < n; i++) out[i] = x[i] * r * w[i];
}

static void rope(float *v, int hd, const float *cos, const float *sin) {
    float tmp[512];
    const int half = hd / 2;
    for (int i = 0; i < hd; i++) tmp[i] = v[i];
    /* rotate-half with the sign in `sin`: two straight loops (vectorized) instead of one with a modulo */
    for (int i = 0; i < half; i++) v[i] = tmp[i] * cos[i] + tmp[i + half] * sin[i];
    for (int i = half; i < hd; i++) v[i] = tmp[i] * cos[i] + tmp[i - half] * sin[i];
}

/* int8 KV rows hold K and V turned by the orthonormal Hadamard transform (Sylvester order, H = H^T = H^-1) when
 * head_dim is a power of two: a few outlier channels then no longer set the one scale of a row, and the int8
 * rounding error spreads evenly (QuaRot's trick). Scores are unchanged ((Hq) . (Hk) = q . k): the queries turn the
 * same way, and the attention output turns back (sum p_i H v_i = H sum p_i v_i). torch_model.py's rotate_kv does the same
 * for the torch path. Mean per-token change of -log p against a float32 cache: 0.024 / 0.029 (en / zh) unturned,
 * 0.012 / 0.016 turned (benchmarks/kv_rotation.py). */
static inline int kv_rotated(int fmt, int hd) { return fmt == TG_KV_I8 && hd >= 2 && (hd & (hd - 1)) == 0; }

#if defined(__AVX512F__)
/* hadamard below for n = 16 .. 512 in registers: the same adds in the same order, so the same numbers. Butterflies
 * within a vector pair lane L with lane L ^ s: an in-lane shuffle or a swap of 128-bit lanes brings the partner, and
 * one fused multiply-add with +-1 (exact) makes a + b in the lower lane and b - a in the upper, rounded once as the
 * add or subtract is (a permute with an index vector, an add and a masked subtract took about three times as long
 * on the EPYC machine: the turn was most of a prompt step's RoPE + KV write). Across vectors, whole vectors. */
static inline __m512 lanes_sign(int s) { /* +1 in lanes L with L & s == 0, -1 in the others */
    const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    return _mm512_mask_blend_ps(_mm512_test_epi32_mask(lane, _mm512_set1_epi32(s)), _mm512_set1_ps(1.0f),
                                _mm512_set1_ps(-1.0f));
}

static inline __attribute__((always_inline)) void hadamard_regs(__m512 *r, int nv) {
    const __m512 s1 = lanes_sign(1), s2 = lanes_sign(2), s4 = lanes_sign(4), s8 = lanes_sign(8);
    for (int i = 0; i < nv; i++) {
        __m512 v = r[i];
        v = _mm512_fmadd_ps(v, s1, _mm512_permute_ps(v, 0xB1));
        v = _mm512_fmadd_ps(v, s2, _mm512_permute_ps(v, 0x4E));
        v = _mm512_fmadd_ps(v, s4, _mm512_shuffle_f32x4(v, v, 0xB1));
        r[i] = _mm512_fmadd_ps(v, s8, _mm512_shuffle_f32x4(v, v, 0x4E));
    }
    for (int len = 1; len < nv; len <<= 1)
        for (int i = 0; i < nv; i += len << 1)
            for (int j = i; j < i + len; j++) {
                const __m512 a = r[j], b = r[j + len];
                r[j] = _mm512_add_ps(a, b);
                r[j + len] = _mm512_sub_ps(a, b);
            }
    const __m512 sc = _mm512_set1_ps(1.0f / sqrtf((float)(16 * nv)));
    for (int i = 0; i < nv; i++) r[i] = _mm512_mul_ps(r[i], sc);
}

static void hadamard_avx512(float *v, int n) {
    const int nv = n / 16;
    __m512 r[32];
    for (int i = 0; i < nv; i++) r[i] = _mm512_loadu_ps(v + 16 * i);
    hadamard_regs(r, nv);
    for (int i = 0; i < nv; i++) _mm512_storeu_ps(v + 16 * i, r[i]);
}
#endif

static void hadamard(float *v, int n) {
#if defined(__AVX512F__)
    if (n >= 16 && n <= 512) {
        hadamard_avx512(v, n);
        return;
    }
#endif
    for (int len = 1; len < n; len <<= 1)
        for (int i = 0; i < n; i += len << 1)
            for (int j = i; j < i + len; j++) {
                const float a = v[j], b = v[j + len];
                v[j] = a + b;
                v[j + len] = a - b;
            }
    const float s = 1.0f / sqrtf((float)n);
    for (int i = 0; i < n; i++) v[i] *= s;
}

#if defined(__AVX512F__) && defined(__F16C__)
/* One KV row of 16 * nv values held in registers, stored at element offset off: lane by lane the scalar code's
 * operations below (the max of |x| is the same in any order, division is IEEE's, rounding half to even), so the same
 * bytes. */
static inline __attribute__((always_inline)) void kv_store_regs(void *kv, int fmt, size_t off, const __m512 *r,
                                                                int nv) {
    if (fmt == TG_KV_F32) {
        for (int i = 0; i < nv; i++) _mm512_storeu_ps((float *)kv + off + 16 * i, r[i]);
        return;
    }
    if (fmt == TG_KV_F16) {
        uint16_t *d = (uint16_t *)kv + off;
        for (int i = 0; i < nv; i++)
            _mm256_storeu_si256((__m256i *)(d + 16 * i), _mm512_cvtps_ph(r[i], _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        return;
    }
    int8_t *d = (int8_t *)kv + off;
    __m512 amax = _mm512_setzero_ps();
    for (int i = 0; i < nv; i++) amax = _mm512_max_ps(_mm512_abs_ps(r[i]), amax);
    const uint16_t sh = f2h(_mm512_reduce_max_ps(amax) / 127.0f);
    float s = h2f(sh);
    if (s == 0.0f) s = 1.0f;
    const __m512 sv = _mm512_set1_ps(s), lo = _mm512_set1_ps(-127.0f), hi = _mm512_set1_ps(127.0f);
    for (int i = 0; i < nv; i++) {
        const __m512 q = _mm512_roundscale_ps(_mm512_div_ps(r[i], sv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        _mm_storeu_si128((__m128i *)(d + 16 * i), _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(_mm512_min_ps(_mm512_max_ps(q, lo), hi))));
    }
    memcpy(d + 16 * nv, &sh, 2);
}
#endif

/* One (position, kv head) row of hd values at element offset off. int8: the same numbers as torch_model.py's
 * quantize_kv (scale rounded to float16 first, then q = round-half-even(x / scale), clamped to +-127). */
static inline void kv_store(void *kv, int fmt, size_t off, const float *src, int hd) {
#if defined(__AVX512F__) && defined(__F16C__)
    /* 16 values at a time: the scalar loops were ~2/3 of a prompt step's RoPE + KV write (a divide and a rounding
     * per value, a serial max). */
    if (hd % 16 == 0 && hd <= 512) {
        __m512 r[32];
        for (int i = 0; i < hd / 16; i++) r[i] = _mm512_loadu_ps(src + 16 * i);
        kv_store_regs(kv, fmt, off, r, hd / 16);
        return;
    }
#endif
    if (fmt == TG_KV_F16) {
        uint16_t *d = (uint16_t *)kv + off;
        for (int i = 0; i < hd; i++) d[i] = f2h(src[i]);
    } else if (fmt == TG_KV_I8) {
        int8_t *d = (int8_t *)kv + off;
        float amax = 0.0f;
        for (int i = 0; i < hd; i++) amax = fabsf(src[i]) > amax ? fabsf(src[i]) : amax;
        const uint16_t sh = f2h(amax / 127.0f);
        float s = h2f(sh);
        if (s == 0.0f) s = 1.0f; /* an all-zero row (or one below float16's range) stores zeros */
        for (int i = 0; i < hd; i++) {
            float r = nearbyintf(src[i] / s);
            r = r > 127.0f ? 127.0f : (r < -127.0f ? -127.0f : r);
            d[i] = (int8_t)r;
        }
        memcpy(d + hd, &sh, 2);
    } else {
        memcpy((float *)kv + off, src, sizeof(float) * (size_t)hd);
    }
}

static inline float kv_scale(const void *kv, size_t off, int hd) {
    uint16_t sh;
    memcpy(&sh, (const int8_t *)kv + off + hd, 2);
    return h2f(sh);
}

/* sum_i a[i] * q[i] over an int8 row, converted to float in registers (no dequantized copy). */
static inline float dot_i8(const float *a, const int8_t *q, int n) {
    int k = 0;
    float s = 0.0f;
#if defined(__AVX512F__)
    __m512 acc = _mm512_setzero_ps();
    for (; k + 16 <= n; k += 16)
        acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + k),
                              _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(q + k)))), acc);
    s = _mm512_reduce_add_ps(acc);
#elif defined(__AVX2__) && defined(__FMA__)
    __m256 acc = _mm256_setzero_ps();
    for (; k + 8 <= n; k += 8)
        acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + k),
                              _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(q + k)))), acc);
    s = hsum256(acc);
#endif
    for (; k < n; k++) s += a[k] * (float)q[k];
    return s;
}

/* o[i] += w * q[i] over an int8 row (w carries the row's scale). */
static inline void axpy_i8(float w, const int8_t *q, float *o, int n) {
    int k = 0;
#if defined(__AVX512F__)
    const __m512 wv = _mm512_set1_ps(w);
    for (; k + 16 <= n; k += 16)
        _mm512_storeu_ps(o + k, _mm512_fmadd_ps(wv, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(q + k)))),
                                                _mm512_loadu_ps(o + k)));
#elif defined(__AVX2__) && defined(__FMA__)
    const __m256 wv = _mm256_set1_ps(w);
    for (; k + 8 <= n; k += 8)
        _mm256_storeu_ps(o + k, _mm256_fmadd_ps(wv, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(q + k)))),
                                                _mm256_loadu_ps(o + k)));
#endif
    for (; k < n; k++) o[k] += w * (float)q[k];
}

static inline const float *kv_row(const void *kv, int fmt, size_t off, int hd, float *buf) {
    if (fmt == TG_KV_F32) return (const float *)kv + off;
    const uint16_t *s = (const uint16_t *)kv + off;
    int i = 0;
#if defined(__F16C__) && defined(__AVX2__)
    for (; i + 8 <= hd; i += 8) _mm256_storeu_ps(buf + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(s + i))));
#endif
    for (; i < hd; i++) buf[i] = h2f(s[i]);
    return buf;
}

/* exp over an array, in place. With AVX-512: 2^(x log2 e) = 2^n * 2^f, f in [-1/2, 1/2], 2^f by a degree-7
 * polynomial (relative error ~1e-7, about an ulp), scaled by 2^n with scalef (which underflows to 0 cleanly);
 * glibc's scalar expf in the softmax and SiLU loops cost several ms a step at 16 streams. */
#if defined(__AVX512F__)
static inline __m512 exp512(__m512 x) {
    x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.0f)), _mm512_set1_ps(-104.0f));
    const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.4426950408889634f));
    const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(t, n);
    __m512 p = _mm512_set1_ps(1.525273380405984e-05f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.5403530393381608e-04f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558146428443e-03f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.618129107628477e-03f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.550410866482158e-02f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.402265069591007e-01f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931471805599453e-01f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}
#endif

/* s[i] = exp(s[i] - shift); returns the sum. */
static float exp_shifted_sum(float *s, int n, float shift) {
    int i = 0;
    float sum = 0.0f;
#if defined(__AVX512F__)
    __m512 acc = _mm512_setzero_ps();
    const __m512 sh = _mm512_set1_ps(shift);
    for (; i + 16 <= n; i += 16) {
        const __m512 e = exp512(_mm512_sub_ps(_mm512_loadu_ps(s + i), sh));
        _mm512_storeu_ps(s + i, e);
        acc = _mm512_add_ps(acc, e);
    }
    if (i < n) {
        const __mmask16 m = (__mmask16)((1u << (n - i)) - 1u);
        const __m512 e = exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, s + i), sh));
        _mm512_mask_storeu_ps(s + i, m, e);
        acc = _mm512_add_ps(acc, _mm512_maskz_mov_ps(m, e));
        i = n;
    }
    sum = _mm512_reduce_add_ps(acc);
#endif
    for (; i < n; i++) {
        s[i] = expf(s[i] - shift);
        sum += s[i];
    }
    return sum;
}

/* Decode attention is already sliced (flash-decoding): every (sequence, KV head) context is cut into SLICE-position
 * slices, each a task with its own max, sum of exp and unnormalised output, merged by log-sum-exp below. The score
 * buffer is one slice on the stack whatever the context; the only per-context memory is pm (hd + 2 floats per slice,
 * KV head and query head: ~76 KB for SmolLM2 at 8K tokens). No float copy of the cache is made (the generic path
 * reads rows one at a time, the AVX-512 one converts 16 K rows at a time into a 4-8 KB tile on the stack). So an 8K context needs nothing more here; the torch paths (torch_model.py
 * attention_sliced, EngineArgs.attention_slice_tokens) do the same for steps with prefill chunks. */
#define SLICE 256   /* positions per attention slice: long contexts split across threads, merged by log-sum-exp */
#define MAX_GROUP 16

#if defined(__AVX512F__)
#define FAST_MAX_GROUP 4
#define FAST_MAX_NV 8   /* head_dim up to 128 (8 vectors of 16 floats) */

/* The 16 horizontal sums of v[0..15] as one vector, element i = sum(v[i]): a transposing tree of 15 adds and 30
 * shuffles instead of 16 separate reductions (~8 dependent operations each). */
static inline __m512 reduce16(__m512 *v) {
    __m512 w[8], x[4], y[2];
    for (int i = 0; i < 8; i++)  /* 256-bit halves: [v(2i) lo+hi, v(2i+1) lo+hi] */
        w[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                             _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
    for (int i = 0; i < 4; i++)  /* 128-bit lanes: v(4i .. 4i+3), 4 partial sums each */
        x[i] = _mm512_add_ps(_mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], 0xDD));
    for (int k = 0; k < 2; k++)  /* lane L: 2 partials of v(8k+L), 2 of v(8k+4+L) */
        y[k] = _mm512_add_ps(_mm512_shuffle_ps(x[2 * k], x[2 * k + 1], 0x44),
                             _mm512_shuffle_ps(x[2 * k], x[2 * k + 1], 0xEE));
    /* element 4L+e = sum v(L+4e): put it at L+4e */
    const __m512 z = _mm512_add_ps(_mm512_shuffle_ps(y[0], y[1], 0x88), _mm512_shuffle_ps(y[0], y[1], 0xDD));
    const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    return _mm512_permutexvar_ps(order, z);
}

/* One stored K/V row as nv vectors of floats (int8 rows unscaled: the caller applies the row's scale). */
static inline void load_kv_row(const void *kv, int fmt, size_t off, int nv, __m512 *out) {
    if (fmt == TG_KV_F16) {
        const uint16_t *h = (const uint16_t *)kv + off;
        for (int c = 0; c < nv; c++) out[c] = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(h + 16 * c)));
    } else if (fmt == TG_KV_I8) {
        const int8_t *b = (const int8_t *)kv + off;
        for (int c = 0; c < nv; c++)
            out[c] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(b + 16 * c))));
    } else {
        const float *f = (const float *)kv + off;
        for (int c = 0; c < nv; c++) out[c] = _mm512_loadu_ps(f + 16 * c);
    }
}

/* The lines of a stored K/V row (offset `off` in the cache's elements) toward L1: decode attention reads every row
 * of a context once a step, from blocks scattered over a cache far larger than L2, and without this each row's first
 * line was a miss the loop stood waiting on (~40% of the attention's samples under perf, 16 streams x 1,024). */
static inline void prefetch_kv_row(const void *kv, int esz, size_t off, int row_bytes) {
    const char *b = (const char *)kv + off * (size_t)esz;
    const uintptr_t first = (uintptr_t)b & ~(uintptr_t)63, last = ((uintptr_t)b + (size_t)row_bytes - 1) & ~(uintptr_t)63;
    for (uintptr_t l = first; l <= last; l += 64) _mm_prefetch((const char *)l, _MM_HINT_T0);
}

/* One attention slice [p0, p1) of one sequence and KV head for its `group` query heads (group <= 4, hd = 16 nv):
 * scores 16 positions at a time (K rows converted once into floats, one accumulator per position, summed by
 * reduce16), softmax statistics, then V accumulated with the group's outputs held in registers. Writes res as the
 * generic path does: per query head max, sum of exp, unnormalised output. The slice's row offsets are worked out
 * once (block table walked, no division per row); while 16 positions' K rows are scored, the next 16 K rows and
 * these 16 V rows are fetched ahead. */
static inline __attribute__((always_inline)) void attend_slice_fast_n(
    const tg_kv *c, size_t k_base, size_t v_base, const int32_t *table, int bs, int stride, int p0, int p1,
    const float *qh, const int group, const int nv, float scale, float *scores, float *res) {
    const int hd = 16 * nv, i8 = c->fmt == TG_KV_I8;
    const int esz = kv_elem_bytes(c->fmt), row_bytes = kv_row_width(c->fmt, hd) * esz;
    size_t roff[SLICE];
    for (int p = p0, blk = p0 / bs, r = p0 % bs; p < p1; p++) {
        roff[p - p0] = ((size_t)table[blk] * bs + r) * stride;
        if (++r == bs) { r = 0; blk++; }
    }
    __m512 qv[FAST_MAX_GROUP][FAST_MAX_NV];
    for (int j = 0; j < group; j++)
        for (int v = 0; v < nv; v++) qv[j][v] = _mm512_loadu_ps(qh + (size_t)j * hd + 16 * v);
    float kf[16 * 16 * FAST_MAX_NV];
    float rs[16];  /* each position's score scale: softmax scale x the int8 row's own scale */
    __m512 mxv[FAST_MAX_GROUP];
    for (int j = 0; j < group; j++) mxv[j] = _mm512_set1_ps(-INFINITY);
    for (int i = p0; i < p1 && i < p0 + 16; i++) prefetch_kv_row(c->kv, esz, k_base + roff[i - p0], row_bytes);
    for (int p = p0; p < p1; p += 16) {
        const int n = p1 - p < 16 ? p1 - p : 16;
        for (int i = p + 16; i < p1 && i < p + 32; i++) prefetch_kv_row(c->kv, esz, k_base + roff[i - p0], row_bytes);
        for (int i = p; i < p + n; i++) prefetch_kv_row(c->kv, esz, v_base + roff[i - p0], row_bytes);
        for (int i = 0; i < 16; i++) {
            __m512 row[FAST_MAX_NV];
            if (i < n) {
                const size_t off = k_base + roff[p + i - p0];
                load_kv_row(c->kv, c->fmt, off, nv, row);
                rs[i] = i8 ? kv_scale(c->kv, off, hd) * scale : scale;
            } else {
                for (int v = 0; v < nv; v++) row[v] = _mm512_setzero_ps();
                rs[i] = 0.0f;
            }
            for (int v = 0; v < nv; v++) _mm512_storeu_ps(kf + (size_t)(i * nv + v) * 16, row[v]);
        }
        const __m512 rsv = _mm512_loadu_ps(rs);
        const __mmask16 m = (__mmask16)(n == 16 ? 0xFFFFu : (1u << n) - 1u);
        for (int j = 0; j < group; j++) {
            __m512 acc[16];
            for (int i = 0; i < 16; i++) {
                const float *k = kf + (size_t)i * nv * 16;
                __m512 a = _mm512_mul_ps(qv[j][0], _mm512_loadu_ps(k));
                for (int v = 1; v < nv; v++) a = _mm512_fmadd_ps(qv[j][v], _mm512_loadu_ps(k + 16 * v), a);
                acc[i] = a;
            }
            const __m512 sc = _mm512_mul_ps(reduce16(acc), rsv);
            _mm512_mask_storeu_ps(scores + (size_t)j * SLICE + (p - p0), m, sc);
            mxv[j] = _mm512_mask_max_ps(mxv[j], m, mxv[j], sc);
        }
    }
    for (int j = 0; j < group; j++) {
        /* the running maximum, kept 16 wide as the scores were made (a scalar pass over them was 14% of the
         * attention's samples: one dependent max a score) */
        const float mx = _mm512_reduce_max_ps(mxv[j]);
        res[j * (hd + 2)] = mx;
        res[j * (hd + 2) + 1] = exp_shifted_sum(scores + (size_t)j * SLICE, p1 - p0, mx);
    }
    __m512 o[FAST_MAX_GROUP][FAST_MAX_NV];
    for (int j = 0; j < group; j++)
        for (int v = 0; v < nv; v++) o[j][v] = _mm512_setzero_ps();
    for (int p = p0; p < p1; p++) {
        const size_t off = v_base + roff[p - p0];
        __m512 row[FAST_MAX_NV];
        load_kv_row(c->kv, c->fmt, off, nv, row);
        const float vs = i8 ? kv_scale(c->kv, off, hd) : 1.0f;
        for (int j = 0; j < group; j++) {
            const __m512 w = _mm512_set1_ps(scores[(size_t)j * SLICE + (p - p0)] * vs);
            for (int v = 0; v < nv; v++) o[j][v] = _mm512_fmadd_ps(w, row[v], o[j][v]);
        }
    }
    for (int j = 0; j < group; j++)
        for (int v = 0; v < nv; v++) _mm512_storeu_ps(res + j * (hd + 2) + 2 + 16 * v, o[j][v]);
}

/* attend_slice_fast_n with the group and head size as constants where they are SmolLM2's (3 query heads a KV head,
 * 64 dims): its queries and outputs then stay in 24 registers instead of arrays spilled to the stack. */
static void attend_slice_fast(const tg_kv *c, size_t k_base, size_t v_base, const int32_t *table, int bs, int stride,
                              int p0, int p1, const float *qh, int group, int nv, float scale, float *scores,
                              float *res) {
    if (group == 3 && nv == 4)
        attend_slice_fast_n(c, k_base, v_base, table, bs, stride, p0, p1, qh, 3, 4, scale, scores, res);
    else
        attend_slice_fast_n(c, k_base, v_base, table, bs, stride, p0, p1, qh, group, nv, scale, scores, res);
}
#endif

/* The attention slices [t0, t1), each for every KV head in turn (task = slice * G + KV head, each with its own
 * scores on the stack): a position's K/V rows of all the heads share its cache lines, and with the heads of a slice
 * handed to different threads both cores fetched the same lines. */
typedef struct {
    const tg_kv *c;
    const float *q;
    const int32_t *tables, *ctx_lens;
    const int *first;
    float *pm;
    size_t layer_off, v_off;
    float scale;
    int H, G, hd, group, bs, rw, i8, max_blocks;
} attention_job;

static void attention_range(void *arg, int64_t t0, int64_t t1) {
    const attention_job *jb = (const attention_job *)arg;
    const tg_kv *c = jb->c;
    const float *q = jb->q;
    const int32_t *tables = jb->tables, *ctx_lens = jb->ctx_lens;
    const int *first = jb->first;
    float *pm = jb->pm;
    const size_t layer_off = jb->layer_off, v_off = jb->v_off;
    const float scale = jb->scale;
    const int H = jb->H, G = jb->G, hd = jb->hd, group = jb->group, bs = jb->bs, rw = jb->rw, i8 = jb->i8;
    const int max_blocks = jb->max_blocks;
    float scores[MAX_GROUP * SLICE];
    float kbuf[512], vbuf[512];
    for (int task = (int)t0 * G; task < (int)t1 * G; task++) {
        const int g = task % G, slice = task / G;
        int d = 0;
        while (first[d + 1] <= slice) d++;
        const int p0 = (slice - first[d]) * SLICE;
        const int p1 = p0 + SLICE < ctx_lens[d] ? p0 + SLICE : ctx_lens[d];
        const int32_t *table = tables + (size_t)d * max_blocks;
        float *res = pm + (size_t)task * group * (hd + 2);
#if defined(__AVX512F__)
        if (group <= FAST_MAX_GROUP && hd % 16 == 0 && hd <= 16 * FAST_MAX_NV && !generic_attention) {
            attend_slice_fast(c, layer_off + (size_t)g * rw, layer_off + v_off + (size_t)g * rw, table, bs, G * rw,
                              p0, p1, q + (size_t)d * H * hd + (size_t)g * group * hd, group, hd / 16, scale,
                              scores, res);
            continue;
        }
#endif
        for (int p = p0; p < p1; p++) {
            const size_t off = layer_off + ((size_t)table[p / bs] * bs + p % bs) * G * rw + (size_t)g * rw;
            const float *qh = q + (size_t)d * H * hd + (size_t)g * group * hd;
            if (i8) {
                /* the row's scale folds into the softmax scale: one multiply per score, not per element */
                const int8_t *k8 = (const int8_t *)c->kv + off;
                const float ks = kv_scale(c->kv, off, hd) * scale;
                for (int j = 0; j < group; j++) scores[j * SLICE + (p - p0)] = dot_i8(qh + (size_t)j * hd, k8, hd) * ks;
                continue;
            }
            const float *k = kv_row(c->kv, c->fmt, off, hd, kbuf);
            for (int j = 0; j < group; j++) scores[j * SLICE + (p - p0)] = dot(qh + (size_t)j * hd, k, hd) * scale;
        }
        for (int j = 0; j < group; j++) {
            float *s = scores + j * SLICE, mx = -INFINITY, sum = 0.0f;
            for (int i = 0; i < p1 - p0; i++) mx = s[i] > mx ? s[i] : mx;
            sum = exp_shifted_sum(s, p1 - p0, mx);
            res[j * (hd + 2)] = mx;
            res[j * (hd + 2) + 1] = sum;
            memset(res + j * (hd + 2) + 2, 0, sizeof(float) * (size_t)hd);
        }
        for (int p = p0; p < p1; p++) {
            const size_t off = layer_off + v_off + ((size_t)table[p / bs] * bs + p % bs) * G * rw + (size_t)g * rw;
            if (i8) {
                const int8_t *v8 = (const int8_t *)c->kv + off;
                const float vs = kv_scale(c->kv, off, hd);
                for (int j = 0; j < group; j++)
                    axpy_i8(scores[j * SLICE + (p - p0)] * vs, v8, res + j * (hd + 2) + 2, hd);
                continue;
            }
            const float *v = kv_row(c->kv, c->fmt, off, hd, vbuf);
            for (int j = 0; j < group; j++) {
                const float w = scores[j * SLICE + (p - p0)];
                float *o = res + j * (hd + 2) + 2;
                for (int i = 0; i < hd; i++) o[i] += w * v[i];
            }
        }
    }
}

/* One decode query per sequence against its paged K/V. q, out: [D, n_heads * hd]. */
static void paged_attention(const tg_model *m, const tg_kv *c, int layer, int D, const float *q, const int32_t *tables,
                            int max_blocks, const int32_t *ctx_lens, float *out) {
    const int H = m->n_heads, G = m->n_kv, hd = m->head_dim, group = H / G, bs = c->block_size;
    const int rw = kv_row_width(c->fmt, hd), i8 = c->fmt == TG_KV_I8;
    const size_t layer_off = (size_t)layer * 2 * c->num_blocks * bs * G * rw;
    const size_t v_off = (size_t)c->num_blocks * bs * G * rw;
    const float scale = 1.0f / sqrtf((float)hd);
    int *first = (int *)malloc(sizeof(int) * (size_t)(D + 1));
    first[0] = 0;
    for (int d = 0; d < D; d++) first[d + 1] = first[d] + (ctx_lens[d] + SLICE - 1) / SLICE;
    const int n_slices = first[D];
    const int n_tasks = n_slices * G;
    /* per task and query head of its group: running max, sum of exp, unnormalised output */
    float *pm = (float *)malloc(sizeof(float) * (size_t)n_tasks * group * (hd + 2));
    /* Short contexts (most decode steps) are too little work to wake a second thread for. */
    int64_t positions = 0;
    for (int d = 0; d < D; d++) positions += ctx_lens[d];
    attention_job job = {c, q, tables, ctx_lens, first, pm, layer_off, v_off, scale, H, G, hd, group, bs, rw, i8,
                         max_blocks};
    tg_for(n_slices, 1, positions * G >= 1024, 1, attention_range, &job);
    /* merge the slices of each (sequence, head) */
    for (int d = 0; d < D; d++) {
        for (int h = 0; h < H; h++) {
            const int g = h / group, j = h % group;
            float mx = -INFINITY, total = 0.0f;
            for (int s = first[d]; s < first[d + 1]; s++) {
                const float sm = pm[((size_t)(s * G + g) * group + j) * (hd + 2)];
                mx = sm > mx ? sm : mx;
            }
            float *o = out + (size_t)d * H * hd + (size_t)h * hd;
            memset(o, 0, sizeof(float) * (size_t)hd);
            for (int s = first[d]; s < first[d + 1]; s++) {
                const float *r = pm + ((size_t)(s * G + g) * group + j) * (hd + 2);
                const float f = expf(r[0] - mx);
                total += r[1] * f;
                for (int i = 0; i < hd; i++) o[i] += r[2 + i] * f;
            }
            const float inv = 1.0f / total;
            for (int i = 0; i < hd; i++) o[i] *= inv;
        }
    }
    free(pm);
    free(first);
}

#if defined(TG_AMX)
/* A prompt chunk's attention on the matrix units. The per-row kernel above reads every key once per query row, so a
 * 512-token chunk read its keys ~256 times over and attention took half the chunk's time. Here the chunk's rows are
 * attended as blocks: its sequence's K and V are read once per layer and KV head into bfloat16 tiles, then for every
 * 32 query rows (the group's heads of consecutive positions) S = Q K^T on the tiles, a causal softmax in float32
 * over the whole row of scores (no running rescale: the row fits), and P V on the tiles again. Rows are the chunk's
 * rows at positions p0 .. p0 + n - 1, keys 0 .. p0 + n - 1 of one block table. */
#define PA_ROWS 32
#define PA_PAD 16 /* floats a row of scores (bfloat16: twice that a row of P) runs past the context's 32s */
typedef struct {
    const tg_kv *c;
    const float *q; /* [n, H * hd] the chunk's rows */
    float *out;     /* [n, H * hd] */
    const int32_t *table;
    int p0, n, ctx, ctx_pad, H, G, hd, group, bs, rw, i8, nkb16, nkb32;
    size_t layer_off, v_off;
    float scale;
    uint16_t *kt, *vt; /* per KV head: K as B tiles of 16 keys x 32 dims, V as B tiles of 32 keys x 16 dims */
} pattn_job;

static inline void kv_value_row(const tg_kv *c, size_t off, int hd, int i8, float *out) {
    if (i8) {
        const int8_t *b = (const int8_t *)c->kv + off;
        const float sc = kv_scale(c->kv, off, hd);
        for (int i = 0; i < hd; i++) out[i] = (float)b[i] * sc;
    } else if (c->fmt == TG_KV_F16) {
        const uint16_t *h = (const uint16_t *)c->kv + off;
        for (int i = 0; i < hd; i++) out[i] = h2f(h[i]);
    } else {
        memcpy(out, (const float *)c->kv + off, sizeof(float) * (size_t)hd);
    }
}

/* Tasks (KV head, 32 keys): K and V rows into their tiles; keys past ctx are zeros. Keys go in pairs: a pair's V
 * values interleave into one 64-byte tile row; a key's K dimension pairs are one column of 32-bit lanes, written by
 * a scatter. Rounded to nearest even as f2bf (cvtne*: the same bits, denormals aside). */
static void pattn_pack_range(void *arg, int64_t t0, int64_t t1) {
    const pattn_job *j = (const pattn_job *)arg;
    const int hd = j->hd, G = j->G, ndb = hd / 32, nvb = hd / 16;
    float kr[2][512] __attribute__((aligned(64))), vr[2][512] __attribute__((aligned(64)));
    const __m512i rows64 = _mm512_setr_epi32(0, 16, 32, 48, 64, 80, 96, 112, 128, 144, 160, 176, 192, 208, 224,
                                             240); /* tile row r at dword 16 r */
    for (int64_t t = t0; t < t1; t++) {
        const int g = (int)(t / j->nkb32), kb = (int)(t % j->nkb32);
        uint16_t *kt = j->kt + (size_t)g * j->ctx_pad * hd, *vt = j->vt + (size_t)g * j->ctx_pad * hd;
        for (int jj = 0; jj < 32; jj += 2) {
            for (int e = 0; e < 2; e++) {
                const int key = kb * 32 + jj + e;
                if (key < j->ctx) {
                    const size_t slot = (size_t)j->table[key / j->bs] * j->bs + key % j->bs;
                    const size_t at = j->layer_off + (slot * G + g) * j->rw;
                    kv_value_row(j->c, at, hd, j->i8, kr[e]);
                    kv_value_row(j->c, at + j->v_off, hd, j->i8, vr[e]);
                } else {
                    memset(kr[e], 0, sizeof(float) * (size_t)hd);
                    memset(vr[e], 0, sizeof(float) * (size_t)hd);
                }
                /* K: tile (16-key block, 32-dim block): [dim pair][key][2] */
                const int key16 = key / 16, kk = key % 16;
                for (int db = 0; db < ndb; db++) {
                    const float *kd = kr[e] + db * 32;
                    const __m512bh v = _mm512_cvtne2ps_pbh(_mm512_load_ps(kd + 16), _mm512_load_ps(kd));
                    uint16_t *tile = kt + ((size_t)key16 * ndb + db) * AMX_TILE_ELEMS;
                    _mm512_i32scatter_epi32((void *)(tile + kk * 2), rows64, (__m512i)v, 4);
                }
            }
            /* V: tile (16-dim block, 32-key block): [key pair][dim][2] */
            for (int vb = 0; vb < nvb; vb++) {
                const __m512i v0 = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(_mm512_load_ps(vr[0] + vb * 16)));
                const __m512i v1 = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(_mm512_load_ps(vr[1] + vb * 16)));
                uint16_t *tile = vt + ((size_t)vb * j->nkb32 + kb) * AMX_TILE_ELEMS;
                _mm512_store_si512((void *)(tile + (jj / 2) * 32), _mm512_or_si512(v0, _mm512_slli_epi32(v1, 16)));
            }
        }
    }
}

/* 2^t for t <= 0, to 7.7e-5 relative (a degree-3 polynomial for 2^f, f in [-1/2, 1/2], fitted for relative error):
 * probabilities that are rounded to bfloat16 next (half an ulp: 2e-3) need no more, and this is half exp512's
 * instructions (no clamps: t <= 0, and scalef takes any exponent below float's range to 0). The softmax of long
 * prompts computes an exponential for every (query, key) pair: it was a third of the attention's time. */
static inline __m512 exp2_for_bf16(__m512 t) {
    const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(t, n);
    __m512 p = _mm512_fmadd_ps(_mm512_set1_ps(0.05508868f), f, _mm512_set1_ps(0.24260405f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.69327624f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.99992894f));
    return _mm512_scalef_ps(p, n);
}

/* p[i] = bfloat16(exp(s[i] - shift)) for i < n, zeros up to n_pad (a multiple of 16); returns the float32 sum of the
 * exponentials before rounding. exp(s - shift) = 2^(s log2 e - shift log2 e): one FMA. Two sums, so that the adds do
 * not wait on each other. */
static float exp_to_bf16(const float *s, uint16_t *p, int n, int n_pad, float shift) {
    const __m512 l2e = _mm512_set1_ps(1.4426950408889634f), off = _mm512_set1_ps(-shift * 1.4426950408889634f);
    __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
    int i = 0;
    for (; i + 32 <= n; i += 32) {
        const __m512 e0 = exp2_for_bf16(_mm512_fmadd_ps(_mm512_loadu_ps(s + i), l2e, off));
        const __m512 e1 = exp2_for_bf16(_mm512_fmadd_ps(_mm512_loadu_ps(s + i + 16), l2e, off));
        _mm512_storeu_si512((void *)(p + i), (__m512i)_mm512_cvtne2ps_pbh(e1, e0));
        acc0 = _mm512_add_ps(acc0, e0);
        acc1 = _mm512_add_ps(acc1, e1);
    }
    for (; i < n; i += 16) {
        const __mmask16 m = n - i >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - i)) - 1u);
        const __m512 e = _mm512_maskz_mov_ps(m, exp2_for_bf16(_mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, s + i), l2e, off)));
        _mm256_storeu_si256((__m256i *)(p + i), (__m256i)_mm512_cvtneps_pbh(e));
        acc0 = _mm512_add_ps(acc0, e);
    }
    for (; i < n_pad; i += 16) _mm256_storeu_si256((__m256i *)(p + i), _mm256_setzero_si256()); /* masked, padding */
    return _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
}

/* The largest of s[0..n): four running maxima, so that each max does not wait for the one before it. */
static float row_max(const float *s, int n) {
    __m512 m0 = _mm512_set1_ps(-INFINITY), m1 = m0, m2 = m0, m3 = m0;
    int k = 0;
    for (; k + 64 <= n; k += 64) {
        m0 = _mm512_max_ps(m0, _mm512_loadu_ps(s + k));
        m1 = _mm512_max_ps(m1, _mm512_loadu_ps(s + k + 16));
        m2 = _mm512_max_ps(m2, _mm512_loadu_ps(s + k + 32));
        m3 = _mm512_max_ps(m3, _mm512_loadu_ps(s + k + 48));
    }
    for (; k + 16 <= n; k += 16) m0 = _mm512_max_ps(m0, _mm512_loadu_ps(s + k));
    if (k < n) {
        const __mmask16 tail = (__mmask16)((1u << (n - k)) - 1u);
        m1 = _mm512_mask_max_ps(m1, tail, m1, _mm512_maskz_loadu_ps(tail, s + k));
    }
    return _mm512_reduce_max_ps(_mm512_max_ps(_mm512_max_ps(m0, m1), _mm512_max_ps(m2, m3)));
}

/* Tasks (KV head, 32 rows of its group's queries): row m of the group is query head g * group + m % group of chunk
 * row m / group. */
static void pattn_range(void *arg, int64_t t0, int64_t t1) {
    const pattn_job *j = (const pattn_job *)arg;
    const int hd = j->hd, group = j->group, qd = j->H * hd, ndb = hd / 32, M = j->n * group;
    const int nblocks = (M + PA_ROWS - 1) / PA_ROWS;
    amx_load_config();
    /* rows of scores (lds floats) and of P (ldp bfloat16) a line past a multiple of 2 KiB / 1 KiB: a tile's 16 rows
     * then fall in different L1 sets, not in 2 or 4 */
    const size_t lds = (size_t)j->ctx_pad + PA_PAD, ldp = (size_t)j->ctx_pad + 2 * PA_PAD;
    float *sc = (float *)aligned_alloc(64, sizeof(float) * PA_ROWS * lds);
    uint16_t *pb = (uint16_t *)aligned_alloc(64, sizeof(uint16_t) * PA_ROWS * ldp);
    uint16_t qa[PA_ROWS * 512] __attribute__((aligned(64)));
    float ob[PA_ROWS * 512] __attribute__((aligned(64)));
    float inv[PA_ROWS];
    for (int64_t t = t0; t < t1; t++) {
        /* the last rows' blocks (the most keys) first, every KV head's before the next block: the pool's chunks go
         * from dear to cheap, so the last one claimed leaves the other threads little to wait for */
        const int g = (int)(t % j->G), m0 = (nblocks - 1 - (int)(t / j->G)) * PA_ROWS;
        const int rows = M - m0 < PA_ROWS ? M - m0 : PA_ROWS;
        const uint16_t *kt = j->kt + (size_t)g * j->ctx_pad * hd, *vt = j->vt + (size_t)g * j->ctx_pad * hd;
        for (int m = 0; m < PA_ROWS; m++) {
            uint16_t *dst = qa + (size_t)m * hd;
            if (m < rows) {
                const int i = (m0 + m) / group, h = g * group + (m0 + m) % group;
                const float *src = j->q + (size_t)i * qd + (size_t)h * hd;
                const __m512 sv = _mm512_set1_ps(j->scale);
                for (int d = 0; d < hd; d += 32) /* hd % 32 == 0 */
                    _mm512_storeu_si512((void *)(dst + d),
                                        (__m512i)_mm512_cvtne2ps_pbh(_mm512_mul_ps(_mm512_loadu_ps(src + d + 16), sv),
                                                                     _mm512_mul_ps(_mm512_loadu_ps(src + d), sv)));
            } else {
                memset(dst, 0, sizeof(uint16_t) * (size_t)hd);
            }
        }
        /* keys this block needs: up to its last row's position */
        const int last_i = (m0 + rows - 1) / group;
        const int nk = j->p0 + last_i + 1, nk32 = (nk + 31) / 32;
        for (int kb = 0; kb < nk32; kb++) { /* S = Q K^T for 32 keys at a time */
#if defined(TG_TILE_EMU)
            emu_block(qa, qa + 16 * hd, hd * 2, 64, kt + (size_t)(2 * kb) * ndb * AMX_TILE_ELEMS,
                      kt + (size_t)(2 * kb + 1) * ndb * AMX_TILE_ELEMS, AMX_TILE_ELEMS * 2, 0, ndb, NULL);
#else
            _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
            for (int db = 0; db < ndb; db++) {
                _tile_loadd(4, qa + db * 32, hd * 2);
                _tile_loadd(5, qa + 16 * hd + db * 32, hd * 2);
                _tile_loadd(6, kt + ((size_t)(2 * kb) * ndb + db) * AMX_TILE_ELEMS, 64);
                _tile_loadd(7, kt + ((size_t)(2 * kb + 1) * ndb + db) * AMX_TILE_ELEMS, 64);
                _tile_dpbf16ps(0, 4, 6);
                _tile_dpbf16ps(1, 4, 7);
                _tile_dpbf16ps(2, 5, 6);
                _tile_dpbf16ps(3, 5, 7);
            }
#endif
            const size_t ld = lds * 4;
            _tile_stored(0, sc + kb * 32, ld);
            _tile_stored(1, sc + kb * 32 + 16, ld);
            _tile_stored(2, sc + 16 * lds + kb * 32, ld);
            _tile_stored(3, sc + 16 * lds + kb * 32 + 16, ld);
        }
        /* causal softmax per row, in float32; P rounded to bfloat16, normalised after P V */
        for (int m = 0; m < PA_ROWS; m++) {
            float *srow = sc + (size_t)m * lds;
            uint16_t *prow = pb + (size_t)m * ldp;
            const int seen = m < rows ? j->p0 + (m0 + m) / group + 1 : 0;
            if (seen > 0) {
                inv[m] = 1.0f / exp_to_bf16(srow, prow, seen, nk32 * 32, row_max(srow, seen));
            } else {
                inv[m] = 0.0f;
                memset(prow, 0, sizeof(uint16_t) * (size_t)nk32 * 32);
            }
        }
        /* O = P V, 32 dims at a time */
        for (int db = 0; db < ndb; db++) {
#if defined(TG_TILE_EMU)
            emu_block(pb, pb + 16 * ldp, (long)ldp * 2, 64, vt + (size_t)(2 * db) * j->nkb32 * AMX_TILE_ELEMS,
                      vt + (size_t)(2 * db + 1) * j->nkb32 * AMX_TILE_ELEMS, AMX_TILE_ELEMS * 2, 0, nk32, NULL);
#else
            _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
            for (int kb = 0; kb < nk32; kb++) {
                _tile_loadd(4, pb + kb * 32, ldp * 2);
                _tile_loadd(5, pb + 16 * ldp + kb * 32, ldp * 2);
                _tile_loadd(6, vt + ((size_t)(2 * db) * j->nkb32 + kb) * AMX_TILE_ELEMS, 64);
                _tile_loadd(7, vt + ((size_t)(2 * db + 1) * j->nkb32 + kb) * AMX_TILE_ELEMS, 64);
                _tile_dpbf16ps(0, 4, 6);
                _tile_dpbf16ps(1, 4, 7);
                _tile_dpbf16ps(2, 5, 6);
                _tile_dpbf16ps(3, 5, 7);
            }
#endif
            _tile_stored(0, ob + db * 32, hd * 4);
            _tile_stored(1, ob + db * 32 + 16, hd * 4);
            _tile_stored(2, ob + 16 * hd + db * 32, hd * 4);
            _tile_stored(3, ob + 16 * hd + db * 32 + 16, hd * 4);
        }
        for (int m = 0; m < rows; m++) {
            const int i = (m0 + m) / group, h = g * group + (m0 + m) % group;
            float *dst = j->out + (size_t)i * qd + (size_t)h * hd;
            for (int d = 0; d < hd; d++) dst[d] = ob[(size_t)m * hd + d] * inv[m];
        }
    }
    _tile_release();
    free(sc);
    free(pb);
}

static void prompt_attention_amx(const tg_model *m, const tg_kv *c, int layer, const float *q, const int32_t *table,
                                 int p0, int n, float *out) {
    const int H = m->n_heads, G = m->n_kv, hd = m->head_dim, bs = c->block_size;
    const int rw = kv_row_width(c->fmt, hd);
    const int ctx = p0 + n, ctx_pad = (ctx + 31) / 32 * 32;
    pattn_job j = {c, q, out, table, p0, n, ctx, ctx_pad, H, G, hd, H / G, bs, rw, c->fmt == TG_KV_I8, ctx_pad / 16,
                   ctx_pad / 32, (size_t)layer * 2 * c->num_blocks * bs * G * rw, (size_t)c->num_blocks * bs * G * rw,
                   1.0f / sqrtf((float)hd), NULL, NULL};
    j.kt = (uint16_t *)scratch(SCRATCH_K, sizeof(uint16_t) * (size_t)G * ctx_pad * hd);
    j.vt = (uint16_t *)scratch(SCRATCH_V, sizeof(uint16_t) * (size_t)G * ctx_pad * hd);
    tg_for((int64_t)G * j.nkb32, 1, 1, 0, pattn_pack_range, &j);
    const int64_t tasks = (int64_t)G * ((n * (H / G) + PA_ROWS - 1) / PA_ROWS);
    tg_for(tasks, 1, 1, 1, pattn_range, &j);
}
#endif

/* The step's attention: decode rows (and short prompt runs) by the per-row kernel; runs of at least
 * PROMPT_ATTN_MIN_ROWS prompt rows of one sequence (consecutive positions over the same block table) on the matrix
 * units when the step's weights have their tiles. */
#define PROMPT_ATTN_MIN_ROWS 16
static void step_attention(const tg_model *m, const tg_kv *c, int layer, int D, int n_dec, const float *q,
                           const int32_t *tables, int max_blocks, const int32_t *ctx_lens, const int64_t *positions,
                           float *out) {
#if defined(TG_AMX)
    const int hd = m->head_dim, qd = m->n_heads * hd;
    if (m->layers[0].qkv.bf16 != NULL && hd % 32 == 0 && hd <= 512 && n_dec < D) {
        int done = 0; /* rows [0, done) attended */
        int d = n_dec;
        while (d < D) {
            int e = d + 1;
            while (e < D && positions[e] == positions[e - 1] + 1 &&
                   memcmp(tables + (size_t)e * max_blocks, tables + (size_t)d * max_blocks,
                          sizeof(int32_t) * (size_t)((ctx_lens[e] + c->block_size - 1) / c->block_size)) == 0)
                e++;
            if (e - d >= PROMPT_ATTN_MIN_ROWS) {
                if (d > done)
                    paged_attention(m, c, layer, d - done, q + (size_t)done * qd, tables + (size_t)done * max_blocks,
                                    max_blocks, ctx_lens + done, out + (size_t)done * qd);
                prompt_attention_amx(m, c, layer, q + (size_t)d * qd, tables + (size_t)d * max_blocks,
                                     (int)positions[d], e - d, out + (size_t)d * qd);
                done = e;
            }
            d = e;
        }
        if (D > done)
            paged_attention(m, c, layer, D - done, q + (size_t)done * qd, tables + (size_t)done * max_blocks,
                            max_blocks, ctx_lens + done, out + (size_t)done * qd);
        return;
    }
#endif
    (void)n_dec; (void)positions;
    paged_attention(m, c, layer, D, q, tables, max_blocks, ctx_lens, out);
}

/* act[d, i] = silu(gate[d, i]) * up[d, i] over [D, 2I] gate|up rows: spread over the threads and vectorized
 * (glibc's vector expf through omp simd); as a serial scalar loop it cost several ms a step at 16 streams. */
typedef struct {
    const float *gu;
    int64_t I, n;
    float *act;
} silu_job;

static void silu_range(void *arg, int64_t b0, int64_t b1) {
    const silu_job *j = (const silu_job *)arg;
    const float *gu = j->gu;
    const int64_t I = j->I, n = j->n;
    float *act = j->act;
    for (int64_t c = b0 * 256; c < n && c < b1 * 256; c += 256) {
        const int64_t end = c + 256 < n ? c + 256 : n;
        for (int64_t e = c; e < end;) {
            const int64_t d = e / I, i0 = e % I;
            const int64_t stop = (d + 1) * I < end ? (d + 1) * I : end;
            const float *g = gu + d * 2 * I, *u = g + I;
            float *a = act + d * I;
            const int i1 = (int)(i0 + (stop - e));
            int i = (int)i0;
#if defined(__AVX512F__)
            for (; i + 16 <= i1; i += 16) {
                const __m512 gv = _mm512_loadu_ps(g + i);
                const __m512 sig = _mm512_div_ps(gv, _mm512_add_ps(_mm512_set1_ps(1.0f), exp512(_mm512_sub_ps(_mm512_setzero_ps(), gv))));
                _mm512_storeu_ps(a + i, _mm512_mul_ps(sig, _mm512_loadu_ps(u + i)));
            }
#endif
            for (; i < i1; i++) a[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
            e = stop;
        }
    }
}

static void silu_mul(const float *gu, int D, int I, float *act) {
    const int64_t n = (int64_t)D * I;
    silu_job j = {gu, I, n, act};
    tg_for((n + 255) / 256, 1, n >= 4096, 0, silu_range, &j);
}

/* Where a decode step's time goes (benchmarks/profile_native_step.py): off unless asked, one branch per phase. */
enum { P_NORM, P_QKV, P_ROPE_KV, P_ATTN, P_O, P_GATE_UP, P_SILU, P_DOWN, P_HEAD, P_PHASES };
static int tg_profiling = 0;
static double tg_prof[P_PHASES];
void tg_profile(int on) {
    tg_profiling = on;
    memset(tg_prof, 0, sizeof(tg_prof));
}
void tg_profile_read(double *out) { memcpy(out, tg_prof, sizeof(tg_prof)); }
#define PHASE(k, ...)                                                                                            \
    do {                                                                                                         \
        const double t0_ = tg_profiling ? omp_get_wtime() : 0.0;                                                 \
        __VA_ARGS__;                                                                                                 \
        if (tg_profiling) tg_prof[k] += omp_get_wtime() - t0_;                                                   \
    } while (0)

/* D rows through every layer; writes each row's K/V at its slot, then logits[n_out, vocab] for the rows out_rows
 * names (NULL: rows 0 .. n_out - 1; n_out = 0: none, a step of prefill chunks that sample nothing). A row is one
 * token at one position of one sequence: a decode, or one token of a prefill chunk or a verification, whose earlier
 * tokens are rows of the same step. Every row's K/V is written before
 * attention reads the cache, so each row attends exactly to its positions 0..position (causal), and its numbers
 * depend on its own sequence only, not on who shares the step.
 * tables: [D, max_blocks] block ids; ctx_lens[d] = position + 1 (the keys the token attends to, itself included). */
/* The per-row work between a step's products (norms, RoPE, the KV write, the Hadamard turn of the attention output):
 * spread over the pool when a step has many rows (prompts), on the calling thread for a few (decode). */
#define ROWS_PARALLEL_MIN 32
typedef struct {
    const tg_model *m;
    const tg_kv *c;
    const float *norm_w;
    const float *in;
    float *out, *q;
    const int64_t *positions, *slots;
    size_t layer_off, v_off;
    int rw, rotated;
} rows_job;

static void norm_range(void *arg, int64_t d0, int64_t d1) {
    const rows_job *j = (const rows_job *)arg;
    const int Hd = j->m->hidden;
    for (int64_t d = d0; d < d1; d++) rms_norm(j->in + (size_t)d * Hd, j->norm_w, Hd, j->m->eps, j->out + (size_t)d * Hd);
}

#if defined(__AVX512F__) && defined(__F16C__)
/* rope_kv_range below with each head in registers from load to store: RoPE, the Hadamard turn, then the query's
 * float row or the KV row's bytes, where the loop below makes three passes over the row and a copy. The same
 * operations in the same order (RoPE as x * cos + x_rolled * sin with the first product fused, as GCC contracts the
 * loop below), so the same numbers. */
static void rope_kv_rows_avx512(const rows_job *j, int64_t d0, int64_t d1) {
    const tg_model *m = j->m;
    const int H = m->n_heads, G = m->n_kv, hd = m->head_dim, qd = H * hd, kvd = G * hd, qkv_w = qd + 2 * kvd;
    const int nv = hd / 16, nh = nv / 2;
    for (int64_t d = d0; d < d1; d++) {
        const float *row = j->out + (size_t)d * qkv_w;
        const float *cs = m->cos + (size_t)j->positions[d] * hd, *sn = m->sin + (size_t)j->positions[d] * hd;
        for (int i = 0; i < H + 2 * G; i++) {
            __m512 r[32];
            for (int v = 0; v < nv; v++) r[v] = _mm512_loadu_ps(row + (size_t)i * hd + 16 * v);
            if (i < H + G)
                for (int v = 0; v < nh; v++) {
                    const __m512 lo = r[v], hi = r[v + nh];
                    r[v] = _mm512_fmadd_ps(lo, _mm512_loadu_ps(cs + 16 * v), _mm512_mul_ps(hi, _mm512_loadu_ps(sn + 16 * v)));
                    r[v + nh] = _mm512_fmadd_ps(hi, _mm512_loadu_ps(cs + 16 * (v + nh)),
                                                _mm512_mul_ps(lo, _mm512_loadu_ps(sn + 16 * (v + nh))));
                }
            if (j->rotated) hadamard_regs(r, nv);
            if (i < H) {
                for (int v = 0; v < nv; v++) _mm512_storeu_ps(j->q + (size_t)d * qd + (size_t)i * hd + 16 * v, r[v]);
            } else {
                const int g = i < H + G ? i - H : i - H - G;
                const size_t at = j->layer_off + ((size_t)j->slots[d] * G + g) * j->rw + (i < H + G ? 0 : j->v_off);
                kv_store_regs(j->c->kv, j->c->fmt, at, r, nv);
            }
        }
    }
}
#endif

static void rope_kv_range(void *arg, int64_t d0, int64_t d1) {
    const rows_job *j = (const rows_job *)arg;
    const tg_model *m = j->m;
    const int H = m->n_heads, G = m->n_kv, hd = m->head_dim, qd = H * hd, kvd = G * hd, qkv_w = qd + 2 * kvd;
#if defined(__AVX512F__) && defined(__F16C__)
    if (hd % 32 == 0 && hd <= 512) {
        rope_kv_rows_avx512(j, d0, d1);
        return;
    }
#endif
    for (int64_t d = d0; d < d1; d++) {
        float *row = j->out + (size_t)d * qkv_w;
        const float *cs = m->cos + (size_t)j->positions[d] * hd, *sn = m->sin + (size_t)j->positions[d] * hd;
        for (int i = 0; i < H + G; i++) rope(row + (size_t)i * hd, hd, cs, sn);
        if (j->rotated)
            for (int i = 0; i < H + 2 * G; i++) hadamard(row + (size_t)i * hd, hd);
        memcpy(j->q + (size_t)d * qd, row, sizeof(float) * (size_t)qd);
        for (int g = 0; g < G; g++) {
            const size_t at = j->layer_off + ((size_t)j->slots[d] * G + g) * j->rw;
            kv_store(j->c->kv, j->c->fmt, at, row + qd + (size_t)g * hd, hd);
            kv_store(j->c->kv, j->c->fmt, at + j->v_off, row + qd + kvd + (size_t)g * hd, hd);
        }
    }
}

static void unturn_range(void *arg, int64_t d0, int64_t d1) { /* the attention output back from the turned basis */
    const rows_job *j = (const rows_job *)arg;
    const int H = j->m->n_heads, hd = j->m->head_dim;
    for (int64_t i = d0 * H; i < d1 * H; i++) hadamard(j->out + (size_t)i * hd, hd);
}

/* A product's input rows, made ready by the norm (norm_w set: `in` normed into `out`) or by the attention output's
 * turn back (unturn: `in` = `out`, turned in place): all of them as float rows in `out`, or, where `tiles` (the
 * product has bfloat16 tiles and the step prompt rows), the decode rows [0, n_dec) in `out` and the prompt rows
 * straight into A tiles, returned (their float rows are not written). */
static const uint16_t *step_rows_in(rows_job *rj, int D, int n_dec, int K, int tiles, int unturn) {
    const int par = D >= ROWS_PARALLEL_MIN;
    const tg_range_fn fn = unturn ? unturn_range : norm_range;
#if defined(TG_AMX)
    if (tiles && n_dec < D) {
        if (n_dec > 0) tg_for(n_dec, 8, n_dec >= ROWS_PARALLEL_MIN, 0, fn, rj);
        return amx_tiles_of(rj->in + (size_t)n_dec * K, D - n_dec, K, SCRATCH_X, unturn ? NULL : rj->norm_w,
                            rj->m->eps, unturn ? rj->m->head_dim : 0);
    }
#endif
    (void)K; (void)tiles; (void)n_dec;
    tg_for(D, 8, par, 0, fn, rj);
    return NULL;
}

/* x (+)= down(SiLU(gate) * up) of h for a step's rows. Prompt rows on the matrix units (hb: their normed rows as A
 * tiles, step_rows_in; gate_up_amx: the activation goes from the tiles to the down product's tiles); decode rows
 * through the block kernels. */
static void step_mlp(const float *h, const uint16_t *hb, int D, int n_dec, int Hd, int I, const tg_layer *L,
                     float *gu, float *act, float *x) {
#if defined(TG_AMX)
    if (hb != NULL) {
        if (n_dec > 0) {
            PHASE(P_GATE_UP, linear(h, n_dec, Hd, L->gate_up.data, L->gate_up.fmt, 2 * I, gu, 2 * I, 0));
            PHASE(P_SILU, silu_mul(gu, n_dec, I, act));
            PHASE(P_DOWN, linear(act, n_dec, I, L->down.data, L->down.fmt, Hd, x, Hd, 1));
        }
        const uint16_t *a = NULL;
        PHASE(P_GATE_UP, a = gate_up_amx(hb, D - n_dec, Hd, L->gate_up.bf16, I));
        PHASE(P_DOWN, linear_amx_tiles(a, D - n_dec, I, L->down.bf16, Hd, x + (size_t)n_dec * Hd, Hd, 1));
        return;
    }
#endif
    (void)hb;
    PHASE(P_GATE_UP, step_linear(h, D, n_dec, Hd, &L->gate_up, gu, 2 * I, 0));
    PHASE(P_SILU, silu_mul(gu, D, I, act));
    PHASE(P_DOWN, step_linear(act, D, n_dec, I, &L->down, x, Hd, 1));
}

static float *step_buffer(int slot, size_t floats) { return (float *)scratch(slot, floats * sizeof(float)); }

int tg_decode(const tg_model *m, const tg_kv *c, int D, const int64_t *tokens, const int64_t *positions,
              const int64_t *slots, const int32_t *tables, int max_blocks, const int32_t *ctx_lens, int n_out,
              const int32_t *out_rows, float *logits, int n_dec) {
    const int Hd = m->hidden, I = m->inter, H = m->n_heads, G = m->n_kv, hd = m->head_dim;
    const int qd = H * hd, kvd = G * hd, qkv_w = qd + 2 * kvd;
    if (hd > 512 || H / G > MAX_GROUP || H % G) return -1;
    for (int d = 0; d < D; d++) {
        if (positions[d] < 0 || positions[d] >= m->max_pos || ctx_lens[d] != positions[d] + 1) return -2;
        if (tokens[d] < 0 || tokens[d] >= m->embed.N) return -3;
    }
    if (n_out < 0 || n_out > D) return -5;
    if (n_dec < 0 || n_dec > D) n_dec = D;
    if (c->fmt < TG_KV_F32 || c->fmt > TG_KV_I8) return -4;
    for (int o = 0; out_rows != NULL && o < n_out; o++)
        if (out_rows[o] < 0 || out_rows[o] >= D) return -5;
    /* on 64-byte lines: the matrix units store 64-byte tile rows straight into these */
    float *x = step_buffer(STEP_X, (size_t)D * Hd);
    float *h = step_buffer(STEP_H, (size_t)D * Hd);
    float *qkv = step_buffer(STEP_QKV, (size_t)D * qkv_w);
    float *q = step_buffer(STEP_Q, (size_t)D * qd);
    float *attn = step_buffer(STEP_ATTN, (size_t)D * qd);
    float *gu = step_buffer(STEP_GU, (size_t)D * 2 * I);
    float *act = step_buffer(STEP_ACT, (size_t)D * I);
    const int64_t erb = row_bytes(m->embed.fmt, Hd);
    for (int d = 0; d < D; d++) dequant_row_at(m->embed.data, m->embed.fmt, Hd, erb, tokens[d], x + (size_t)d * Hd);
    const int rw = kv_row_width(c->fmt, hd);
    const size_t v_off = (size_t)c->num_blocks * c->block_size * G * rw;
    const int rotated = kv_rotated(c->fmt, hd);
    for (int l = 0; l < m->n_layers; l++) {
        const tg_layer *L = &m->layers[l];
        const size_t layer_off = (size_t)l * 2 * v_off;
        const int par = D >= ROWS_PARALLEL_MIN;
        rows_job rj = {m, c, L->attn_norm, x, h, q, positions, slots, layer_off, v_off, rw, rotated};
        const uint16_t *xb = NULL;
        PHASE(P_NORM, xb = step_rows_in(&rj, D, n_dec, Hd, L->qkv.bf16 != NULL, 0));
        PHASE(P_QKV, step_linear_in(h, xb, D, n_dec, Hd, &L->qkv, qkv, qkv_w, 0));
        rj.out = qkv;
        PHASE(P_ROPE_KV, tg_for(D, 8, par, 0, rope_kv_range, &rj));
        PHASE(P_ATTN, step_attention(m, c, l, D, n_dec, q, tables, max_blocks, ctx_lens, positions, attn));
        rj.in = rj.out = attn;
        xb = NULL;
        if (rotated) PHASE(P_O, xb = step_rows_in(&rj, D, n_dec, qd, L->o.bf16 != NULL, 1));
        PHASE(P_O, step_linear_in(attn, xb, D, n_dec, qd, &L->o, x, Hd, 1));
        rj.norm_w = L->ffn_norm;
        rj.in = x;
        rj.out = h;
        const int mlp_tiles = L->gate_up.bf16 != NULL && L->down.bf16 != NULL && I % 32 == 0;
        PHASE(P_NORM, xb = step_rows_in(&rj, D, n_dec, Hd, mlp_tiles, 0));
        step_mlp(h, xb, D, n_dec, Hd, I, L, gu, act, x);
    }
    /* the LM head costs more than a layer: only the rows that are sampled */
    for (int o = 0; o < n_out; o++) {
        const int d = out_rows != NULL ? out_rows[o] : o;
        rms_norm(x + (size_t)d * Hd, m->final_norm, Hd, m->eps, h + (size_t)o * Hd);
    }
    if (n_out > 0) PHASE(P_HEAD, linear(h, n_out, Hd, m->lm_head.data, m->lm_head.fmt, m->vocab, logits, m->vocab, 0));
    pool_park();
    scratch_trim();
    return 0;
}
