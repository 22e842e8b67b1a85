// Communication primitives: peer addressing, bounded waits, signals, the grid barrier.
//
// Ordering (why no signal word is ever reset). A dispatch signal carries (epoch << 32) | rows, a release signal
// epoch << 32, where epoch is this process's call counter (all ranks make the same sequence of calls); a receiver
// waits for an exact epoch match. A destination releases call e once every one of its blocks has finished its
// GEMMs of e, so it reads no more of what sources wrote into its receive area in e; in call e + 1 a source waits
// for that release before it writes rows there or overwrites its dispatch signal. A destination releases e only
// after every source's dispatch of e, and starts e + 1 only after releasing e, so the release word holds e - 1 or
// e while a source waits for e, and the dispatch word e - 1 or e while a destination waits for e; the epoch never
// aliases (2^32 calls between equal values). The combine arrivals are counts, not signals: a source zeroes its words at
// the start of each call, before grid barrier 1 and so before any dispatch signal of the call; a destination adds
// to them only for rows of that call, after that signal; and the source's wait for call e ends only when every
// add of e has landed (the sum must match exactly), so none of them spills into call e + 1. The combine rows
// themselves are rewritten in call e + 1 only after the source's dispatch of e + 1, when its combine of e is over.
//
// Two builds (plugin/flashmoe/build/recipe.py). The default one reaches peers by NVLink stores only, so it needs no
// NVSHMEM device code, and compiles the fp8 kernel as a whole program (faster, and ptxas honours setmaxnreg
// only there). The put build (FLASHMOE_DEVICE_PUTS=1) also reaches peers on other nodes, or every peer under
// FLASHMOE_FORCE_PUT, through NVSHMEM's device library, which needs relocatable device code. The host picks the
// build from the topology and refuses to launch the default one where a peer would need puts (kernel.cu
// peer_table), so the traps below are unreachable.
#pragma once

#ifndef FLASHMOE_DEVICE_PUTS
#define FLASHMOE_DEVICE_PUTS 0
#endif
#if FLASHMOE_DEVICE_PUTS
#include <nvshmem.h>
#include <nvshmemx.h>
#endif

#include "common.cuh"
#include "params.cuh"

namespace flashmoe {

constexpr bool kDevicePuts = FLASHMOE_DEVICE_PUTS != 0;

struct PeerTable {
  char* base[kMaxWorld];  // peer's symmetric heap mapped into this GPU, or nullptr (use puts)
};

// NVSHMEM's one-sided operations for proxied peers. The default build has none to call (see above): there they
// trap, so a launch that reached one by mistake fails loudly instead of dropping rows.
#if FLASHMOE_DEVICE_PUTS
__device__ __forceinline__ void put_warp(void* dst, const void* src, size_t bytes, int pe) {
  nvshmemx_putmem_nbi_warp(dst, src, bytes, pe);
}
__device__ __forceinline__ void put_thread(void* dst, const void* src, size_t bytes, int pe) {
  nvshmem_putmem_nbi(dst, src, bytes, pe);
}
__device__ __forceinline__ void signal_set(uint64_t* word, uint64_t value, int pe) {
  nvshmemx_signal_op(word, value, NVSHMEM_SIGNAL_SET, pe);
}
__device__ __forceinline__ void signal_add(uint64_t* word, uint64_t value, int pe) {
  nvshmemx_signal_op(word, value, NVSHMEM_SIGNAL_ADD, pe);
}
__device__ __forceinline__ void quiet_puts() { nvshmem_quiet(); }  // every put this PE issued is delivered
#else
__device__ __forceinline__ void put_warp(void*, const void*, size_t, int) { __trap(); }
__device__ __forceinline__ void put_thread(void*, const void*, size_t, int) { __trap(); }
__device__ __forceinline__ void signal_set(uint64_t*, uint64_t, int) { __trap(); }
__device__ __forceinline__ void signal_add(uint64_t*, uint64_t, int) { __trap(); }
__device__ __forceinline__ void quiet_puts() { __trap(); }
#endif

__device__ __forceinline__ bool use_p2p(const PeerTable& peers, int r) { return peers.base[r] != nullptr; }

__device__ __forceinline__ bool aborted(const Params& p) {
  return ld_volatile(ws_ptr<int>(p, p.ws_off.abort_flag)) != 0;
}

// First block to give up records why, host-visible, then raises the abort flag every waiter polls.
static __device__ void record_timeout(const Params& p, int phase, int peer, int64_t detail, uint32_t epoch,
                                      uint64_t observed) {
  int* flag = ws_ptr<int>(p, p.ws_off.abort_flag);
  if (atomicCAS(flag, 0, 1) == 0) {
    volatile Status* s = p.status;
    s->rank = p.rank;
    s->peer = peer;
    s->phase = phase;
    s->detail = detail;
    s->epoch = epoch;
    s->observed = static_cast<int64_t>(observed);
    s->block = blockIdx.x;
    __threadfence_system();
    s->code = kStatusTimeout;
    __threadfence_system();
  }
}

// Spin until done(*word); bounded by p.timeout_ns. Returns the word, or 0 after a timeout (recorded with `detail`)
// or an abort.
template <typename Done>
static __device__ uint64_t wait_word(const Params& p, const uint64_t* word, Done done, uint32_t epoch, int phase,
                                     int peer, int64_t detail) {
  stress_delay(peer + 17 * phase);
  const uint64_t start = globaltimer_ns();
  uint32_t spins = 0;
  while (true) {
    const uint64_t v = ld_acquire_sys(word);
    if (done(v)) return v;
    if ((++spins & 63) == 0) {
      if (aborted(p)) return 0;
      if (globaltimer_ns() - start > p.timeout_ns) {
        record_timeout(p, phase, peer, detail, epoch, v);
        return 0;
      }
    }
  }
}

// A signal: spin until (*word >> 32) == epoch. Returns the word, or 0 after a timeout/abort.
static __device__ uint64_t wait_signal(const Params& p, const uint64_t* word, uint32_t epoch, int phase, int peer) {
  return wait_word(p, word, [epoch](uint64_t v) { return static_cast<uint32_t>(v >> 32) == epoch; }, epoch, phase, peer,
                   -1);
}

// A count other GPUs add to: spin until *word == target. A word past its target is a bug: it never matches, and the
// timeout report shows the count against the target (detail).
static __device__ void wait_count(const Params& p, const uint64_t* word, uint64_t target, uint32_t epoch, int phase,
                                  int peer) {
  wait_word(p, word, [target](uint64_t v) { return v == target; }, epoch, phase, peer, static_cast<int64_t>(target));
}

// One warp: wait until every rank has released the previous call's buffers (`prev_epoch`; lane r watches rank r),
// before this rank writes rows into their receive areas or signals them (the ordering above).
static __device__ void wait_released(const Params& p, uint32_t prev_epoch) {
  const uint64_t* words = sym_ptr<uint64_t>(p, p.sym_off.release_signal);
  for (int r = threadIdx.x & 31; r < p.world_size; r += 32) wait_signal(p, words + r, prev_epoch, kPhaseReleaseWait, r);
  __syncwarp();
}

// Set word on `pe` (a remote store over NVLink, or an NVSHMEM signal for proxied peers). Callers make sure
// the data it announces is complete first (fence for stores, quiet for puts).
__device__ __forceinline__ void send_signal(const Params& p, const PeerTable& peers, uint64_t* local_word, int pe,
                                            uint64_t value) {
  stress_delay(pe);
  if (use_p2p(peers, pe)) {
    const int64_t off = reinterpret_cast<char*>(local_word) - p.sym;
    st_release_sys(reinterpret_cast<uint64_t*>(peers.base[pe] + off), value);
  } else {
    signal_set(local_word, value, pe);
  }
}

// Reset-free grid barrier for co-resident blocks (cooperative launch guarantees residency): each block adds 1,
// block 0 adds 2^31 - (n - 1), so the high bit flips exactly when all n have arrived; the low bits return to 0.
static __device__ void grid_barrier(const Params& p, int index, uint32_t epoch, int64_t* phase_end = nullptr) {
  __syncthreads();
  if (threadIdx.x == 0) {
    uint32_t* word = ws_ptr<uint32_t>(p, p.ws_off.barrier);
    const uint32_t add = blockIdx.x == 0 ? (0x80000000u - (gridDim.x - 1)) : 1u;
    const uint64_t arrived_ns = phase_end != nullptr ? globaltimer_ns() : 0;
    __threadfence();
    const uint32_t old = atomicAdd(word, add);
    // The adds of one barrier sum to 2^31, and only the last of them carries into the top bit: that block is
    // the last to finish the phase, and its arrival time is the phase's end (metrics.cuh; one plain store in
    // place of an atomicMax from every block on one line, which this barrier's fence would wait for).
    if (phase_end != nullptr && ((old ^ (old + add)) & 0x80000000u)) *phase_end = static_cast<int64_t>(arrived_ns);
    const uint64_t start = globaltimer_ns();
    uint32_t spins = 0;
    while (((old ^ ld_acquire_gpu(word)) & 0x80000000u) == 0) {
      if ((++spins & 63) == 0 && globaltimer_ns() - start > p.timeout_ns) {
        record_timeout(p, kPhaseGridBarrier, -1, index, epoch, ld_acquire_gpu(word));
        break;  // a block that never arrives is a bug, not a peer failure: report and run on
      }
    }
    __threadfence();
  }
  __syncthreads();
}

// Shared-memory copy of the host's peer table (kernel.cu: nvshmem_ptr, then the node and force-put rules).
static __device__ void load_peer_table(const Params& p, PeerTable& peers) {
  if (threadIdx.x < p.world_size) peers.base[threadIdx.x] = p.peer_sym[threadIdx.x];
  __syncthreads();
}

}  // namespace flashmoe
