/*
 * atomics.h - the one vocabulary for memory ordering in the engine.
 *
 * Every acquire or release in csrc/ goes through these macros, and every use
 * carries a one-line comment naming the operation it pairs with and why.
 * Thin wrappers over C11 <stdatomic.h>; nothing here allocates or blocks.
 */
#ifndef MTC_ATOMICS_H
#define MTC_ATOMICS_H

#include <stdatomic.h>

#define MTC_CACHELINE 64
#define MTC_ALIGNED_CL _Alignas(MTC_CACHELINE)

#define mtc_load_relaxed(p)        atomic_load_explicit((p), memory_order_relaxed)
#define mtc_load_acquire(p)        atomic_load_explicit((p), memory_order_acquire)
#define mtc_store_relaxed(p, v)    atomic_store_explicit((p), (v), memory_order_relaxed)
#define mtc_store_release(p, v)    atomic_store_explicit((p), (v), memory_order_release)
#define mtc_fetch_add_relaxed(p, v) atomic_fetch_add_explicit((p), (v), memory_order_relaxed)
#define mtc_fetch_add_acq_rel(p, v) atomic_fetch_add_explicit((p), (v), memory_order_acq_rel)
#define mtc_fetch_sub_acq_rel(p, v) atomic_fetch_sub_explicit((p), (v), memory_order_acq_rel)
#define mtc_exchange_acq_rel(p, v) atomic_exchange_explicit((p), (v), memory_order_acq_rel)
/* Weak CAS: may fail spuriously, use in loops. On failure *expected is updated. */
#define mtc_cas_weak_acq_rel(p, expected, desired) \
    atomic_compare_exchange_weak_explicit((p), (expected), (desired), \
                                          memory_order_acq_rel, memory_order_relaxed)
#define mtc_cas_weak_relaxed(p, expected, desired) \
    atomic_compare_exchange_weak_explicit((p), (expected), (desired), \
                                          memory_order_relaxed, memory_order_relaxed)
/* Full fence: used only for the sleep/wake handshake (Dekker-style). */
#define mtc_fence_seq_cst()        atomic_thread_fence(memory_order_seq_cst)

#if defined(__x86_64__) || defined(__i386__)
#define mtc_cpu_relax() __builtin_ia32_pause()
#elif defined(__aarch64__)
#define mtc_cpu_relax() __asm__ __volatile__("yield" ::: "memory")
#else
#define mtc_cpu_relax() ((void)0)
#endif

#endif /* MTC_ATOMICS_H */
