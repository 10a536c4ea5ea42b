// Fiber scheduler for one dispatch; see executor.h for the semantics it implements.
//
// Fibers live for the process and are reused by every threadgroup: a fiber's body is a loop
// that runs the current kernel entry, marks itself done and switches back, so starting the next
// threadgroup costs no makecontext. On x86-64 a fiber switch is six register pushes and a stack
// swap (lily_msl_switch below) with no system call, where swapcontext also saves the signal
// mask through one: barrier-heavy kernels run ~4.5x faster. Under AddressSanitizer (which
// follows swapcontext), on other CPUs, or with LILY_MSL_CPU_UCONTEXT=1, swapcontext is used.
// A fiber stopped by an error is abandoned mid-kernel; all fibers are then rebuilt before the
// next dispatch. Execution is single-threaded: a kernel running here is a correctness model,
// not a fast path.
#include "msl_cpu/executor.h"

#include <dlfcn.h>
#include <sys/mman.h>
#include <ucontext.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "model/error.h"
#include "msl_cpu/encoder.h"

namespace lily::msl_cpu {
namespace {

#if defined(__x86_64__) && defined(__linux__)
#define LILY_MSL_FAST_SWITCH 1
// lily_msl_switch(save, to): push the callee-saved registers, store the stack pointer in *save,
// load `to`, pop the registers saved there and return into that fiber. A new fiber's stack is
// prepared (make_fiber) to "return" into fiber_body.
extern "C" void lily_msl_switch(void** save, void* to);
asm(R"(
  .text
  .p2align 4
  .type lily_msl_switch, @function
lily_msl_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size lily_msl_switch, .-lily_msl_switch
  .section .note.GNU-stack,"",@progbits
  .text
)");
#else
#define LILY_MSL_FAST_SWITCH 0
#endif

enum class State { Ready, Blocked, Done, Failed };
enum class Wait { ThreadgroupBarrier, SimdgroupBarrier, Collective };

struct Fiber {
  ucontext_t ctx;
  void* sp = nullptr;  // saved stack pointer (fast switch)
  char* stack = nullptr;
  size_t stack_bytes = 0;
  State state = State::Done;
  Wait wait = Wait::ThreadgroupBarrier;
  const char* what = "";
  const char* file = "";
  int line = 0;
  lily_msl_thread thread{};
};

struct Simdgroup {
  alignas(16) char slots[2][LILY_MSL_SIMD_WIDTH][LILY_MSL_SIMD_SLOT];
  int parity = 0;
};

// The scheduler's state: one per process (execution is single-threaded).
struct Scheduler {
  std::vector<Fiber> fibers;
  bool fibers_dirty = false;  // a fiber was abandoned mid-kernel: rebuild before reuse
  std::vector<Simdgroup> simd;
  ucontext_t main_ctx;
  void* main_sp = nullptr;
  bool fast = false;  // lily_msl_switch rather than swapcontext (decided once per process)
  int current = -1;
  const DispatchRun* run = nullptr;
  lily_msl_bindings tg_bindings{};  // the current threadgroup's bindings
  std::map<const void*, void*> tg_arrays;
  std::vector<void*> tg_blocks;
  size_t tg_bytes = 0;          // static + dynamic threadgroup memory of this threadgroup
  size_t tg_dynamic_bytes = 0;  // of which set_threadgroup_memory_length
  std::string failure;
};
Scheduler& sched() {
  static Scheduler s;
  return s;
}

[[noreturn]] void raise(const std::string& kernel, const std::string& what) {
  throw lily::Error("[msl_cpu] kernel '" + kernel + "': " + what);
}

void switch_to_main(Fiber& f);

void fiber_body() {
  Scheduler& s = sched();
  for (;;) {
    s.run->kernel->entry();
    Fiber& f = s.fibers[static_cast<size_t>(s.current)];
    f.state = State::Done;
    switch_to_main(f);
  }
}

void make_fiber(Fiber& f, size_t stack_bytes) {
  if (f.stack && f.stack_bytes != stack_bytes) {
    munmap(f.stack, f.stack_bytes);
    f.stack = nullptr;
  }
  if (!f.stack) {
    void* p = mmap(nullptr, stack_bytes, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_STACK, -1, 0);
    if (p == MAP_FAILED) throw lily::Error("[msl_cpu] cannot map a fiber stack");
    mprotect(p, static_cast<size_t>(getpagesize()), PROT_NONE);  // overflow guard
    f.stack = static_cast<char*>(p);
    f.stack_bytes = stack_bytes;
  }
  f.state = State::Done;
#if LILY_MSL_FAST_SWITCH
  if (sched().fast) {
    // The frame lily_msl_switch pops: six registers (zero) and the return address. The stack
    // pointer after the `ret` is 8 mod 16, as at the entry of a called function.
    auto top = (reinterpret_cast<uintptr_t>(f.stack) + stack_bytes) & ~uintptr_t(15);
    void** frame = reinterpret_cast<void**>(top - 64);
    for (int i = 0; i < 6; ++i) frame[i] = nullptr;
    frame[6] = reinterpret_cast<void*>(&fiber_body);
    frame[7] = nullptr;
    f.sp = frame;
    return;
  }
#endif
  getcontext(&f.ctx);
  f.ctx.uc_stack.ss_sp = f.stack;
  f.ctx.uc_stack.ss_size = stack_bytes;
  f.ctx.uc_link = nullptr;
  makecontext(&f.ctx, fiber_body, 0);
}

void switch_to_main(Fiber& f) {
#if LILY_MSL_FAST_SWITCH
  if (sched().fast) return lily_msl_switch(&f.sp, sched().main_sp);
#endif
  swapcontext(&f.ctx, &sched().main_ctx);
}

void switch_to_fiber(Fiber& f) {
#if LILY_MSL_FAST_SWITCH
  if (sched().fast) return lily_msl_switch(&sched().main_sp, f.sp);
#endif
  swapcontext(&sched().main_ctx, &f.ctx);
}

Fiber& current_fiber() { return sched().fibers[static_cast<size_t>(sched().current)]; }

// ---- host services called from kernel code (on a fiber) ------------------------------------

void api_barrier(int scope, const char* what, const char* file, int line) {
  Fiber& f = current_fiber();
  f.state = State::Blocked;
  f.wait = scope == LILY_MSL_BARRIER_SIMDGROUP ? Wait::SimdgroupBarrier : Wait::ThreadgroupBarrier;
  f.what = what;
  f.file = file;
  f.line = line;
  switch_to_main(f);
}

const void* api_simd_exchange(const void* value, size_t size, const char* what, const char* file,
                              int line) {
  Scheduler& s = sched();
  Fiber& f = current_fiber();
  Simdgroup& g = s.simd[f.thread.simdgroup_index_in_threadgroup];
  const int parity = g.parity;
  std::memcpy(g.slots[parity][f.thread.thread_index_in_simdgroup], value, size);
  f.state = State::Blocked;
  f.wait = Wait::Collective;
  f.what = what;
  f.file = file;
  f.line = line;
  switch_to_main(f);
  return g.slots[parity];
}

void api_fail(const char* what, const char* file, int line) {
  Scheduler& s = sched();
  Fiber& f = current_fiber();
  if (s.failure.empty())
    s.failure = std::string(what) + " at " + file + ":" + std::to_string(line) + " (thread " +
                std::to_string(f.thread.thread_index_in_threadgroup) + ")";
  f.state = State::Failed;
  s.fibers_dirty = true;
  switch_to_main(f);
}

void* api_threadgroup_alloc(const void* key, size_t size, size_t align, const char* name, const char* file,
                            int line) {
  Scheduler& s = sched();
  auto it = s.tg_arrays.find(key);
  if (it != s.tg_arrays.end()) return it->second;
  s.tg_bytes += size;
  if (s.tg_bytes > kMaxThreadgroupMemory) {
    std::string msg = "threadgroup memory: '" + std::string(name) + "' (" + std::to_string(size) +
                      " bytes) takes the threadgroup to " + std::to_string(s.tg_bytes) + " bytes (" +
                      std::to_string(s.tg_bytes - s.tg_dynamic_bytes) + " declared in the kernel + " +
                      std::to_string(s.tg_dynamic_bytes) + " set_threadgroup_memory_length), more than the " +
                      std::to_string(kMaxThreadgroupMemory) + " that Apple GPUs have";
    api_fail(msg.c_str(), file, line);
  }
  void* p = nullptr;  // exactly `size` bytes, so ASan's redzone starts right after the array
  if (posix_memalign(&p, std::max<size_t>(align, 16), size ? size : 1) != 0)
    api_fail("out of memory for a threadgroup array", file, line);
  std::memset(p, 0xFF, size);  // uninitialized on the GPU: make reads before writes visible
  s.tg_blocks.push_back(p);
  s.tg_arrays[key] = p;
  return p;
}

const lily_msl_host_api kHostApi = {api_barrier, api_simd_exchange, api_threadgroup_alloc,
                                    [](const char* w, const char* f, int l) { api_fail(w, f, l); }};

// ---- scheduling ------------------------------------------------------------------------------

std::string site(const Fiber& f) {
  return std::string(f.what) + " at " + f.file + ":" + std::to_string(f.line);
}

std::string describe(const Fiber& f) {
  switch (f.state) {
    case State::Done:
      return "returned";
    case State::Blocked:
      return "wait at " + site(f);
    case State::Failed:
      return "failed";
    default:
      return "running";
  }
}

// "threads 0-15 wait at ...; threads 16-31 returned" over the given thread indices.
std::string who_is_where(const std::vector<Fiber>& fibers, const std::vector<uint32_t>& ids) {
  std::string out;
  size_t i = 0;
  while (i < ids.size()) {
    std::string d = describe(fibers[ids[i]]);
    size_t j = i;
    while (j + 1 < ids.size() && ids[j + 1] == ids[j] + 1 && describe(fibers[ids[j + 1]]) == d) ++j;
    if (!out.empty()) out += "; ";
    out += (i == j ? "thread " + std::to_string(ids[i])
                   : "threads " + std::to_string(ids[i]) + "-" + std::to_string(ids[j])) +
           " " + d;
    i = j + 1;
  }
  return out;
}

std::string tg_name(const lily_msl_thread& t) {
  return "(" + std::to_string(t.threadgroup_position_in_grid[0]) + "," +
         std::to_string(t.threadgroup_position_in_grid[1]) + "," +
         std::to_string(t.threadgroup_position_in_grid[2]) + ")";
}

void run_threadgroup(Scheduler& s, const DispatchRun& run, const uint32_t tg_pos[3],
                     std::mt19937_64& rng) {
  const uint32_t tx = run.threads.width, ty = run.threads.height, tz = run.threads.depth;
  const uint32_t n = tx * ty * tz;
  const uint32_t nsimd = (n + LILY_MSL_SIMD_WIDTH - 1) / LILY_MSL_SIMD_WIDTH;
  const std::string kernel = run.kernel->name;

  // Threadgroup memory: fresh, poisoned, one allocation per binding (ASan sees each bound).
  s.tg_bindings = run.bindings;
  s.tg_bytes = 0;
  for (int i = 0; i < LILY_MSL_MAX_BINDINGS; ++i) {
    size_t len = run.bindings.threadgroup_memory_lengths[i];
    if (!len) continue;
    void* p = nullptr;
    if (posix_memalign(&p, 16, len) != 0) raise(kernel, "out of memory for threadgroup memory");
    std::memset(p, 0xFF, len);
    s.tg_blocks.push_back(p);
    s.tg_bindings.threadgroup_memory[i] = p;
    s.tg_bytes += len;
  }
  s.tg_dynamic_bytes = s.tg_bytes;
  for (auto& g : s.simd) g.parity = 0;

  for (uint32_t i = 0; i < n; ++i) {
    lily_msl_thread& t = s.fibers[i].thread;
    const uint32_t pos[3] = {i % tx, (i / tx) % ty, i / (tx * ty)};
    const uint32_t size[3] = {tx, ty, tz};
    const uint32_t grid[3] = {run.threadgroups.width, run.threadgroups.height,
                              run.threadgroups.depth};
    for (int d = 0; d < 3; ++d) {
      t.thread_position_in_threadgroup[d] = pos[d];
      t.threads_per_threadgroup[d] = size[d];
      t.threadgroup_position_in_grid[d] = tg_pos[d];
      t.threadgroups_per_grid[d] = grid[d];
      t.thread_position_in_grid[d] = tg_pos[d] * size[d] + pos[d];
      t.threads_per_grid[d] = grid[d] * size[d];
    }
    t.thread_index_in_threadgroup = i;
    t.simdgroup_index_in_threadgroup = i / LILY_MSL_SIMD_WIDTH;
    t.thread_index_in_simdgroup = i % LILY_MSL_SIMD_WIDTH;
    t.threads_per_simdgroup = LILY_MSL_SIMD_WIDTH;
    t.simdgroups_per_threadgroup = nsimd;
    t.active_lanes = std::min<uint32_t>(LILY_MSL_SIMD_WIDTH, n - (i / LILY_MSL_SIMD_WIDTH) * LILY_MSL_SIMD_WIDTH);
    t.bindings = &s.tg_bindings;
    s.fibers[i].state = State::Ready;
  }

  std::vector<uint32_t> order(n), all(n);
  std::iota(all.begin(), all.end(), 0u);
  for (;;) {
    order = all;
    if (run.randomize) std::shuffle(order.begin(), order.end(), rng);
    for (uint32_t i : order) {
      Fiber& f = s.fibers[i];
      if (f.state != State::Ready) continue;
      s.current = static_cast<int>(i);
      *run.module->current_slot() = &f.thread;
      switch_to_fiber(f);
    }
    s.current = -1;
    if (!s.failure.empty())
      raise(kernel, s.failure + " in threadgroup " + tg_name(s.fibers[0].thread));

    // Release every simdgroup whose lanes all wait at the same simdgroup-level point.
    bool progress = false, all_done = true;
    for (uint32_t g = 0; g < nsimd; ++g) {
      const uint32_t first = g * LILY_MSL_SIMD_WIDTH, last = std::min(n, first + LILY_MSL_SIMD_WIDTH);
      bool all_simd = true;
      for (uint32_t i = first; i < last; ++i) {
        const Fiber& f = s.fibers[i];
        if (f.state != State::Done) all_done = false;
        if (f.state != State::Blocked || f.wait == Wait::ThreadgroupBarrier) all_simd = false;
      }
      if (!all_simd) continue;
      const Fiber& lead = s.fibers[first];
      for (uint32_t i = first; i < last; ++i) {
        const Fiber& f = s.fibers[i];
        if (f.wait != lead.wait || f.line != lead.line || std::strcmp(f.file, lead.file) != 0 ||
            std::strcmp(f.what, lead.what) != 0) {
          std::vector<uint32_t> ids(last - first);
          std::iota(ids.begin(), ids.end(), first);
          raise(kernel, "the lanes of simdgroup " + std::to_string(g) + " in threadgroup " +
                            tg_name(lead.thread) + " reached different simdgroup operations: " +
                            who_is_where(s.fibers, ids));
        }
      }
      for (uint32_t i = first; i < last; ++i) s.fibers[i].state = State::Ready;
      if (lead.wait == Wait::Collective) s.simd[g].parity ^= 1;
      progress = true;
    }
    if (all_done) break;
    if (progress) continue;

    // Otherwise the whole threadgroup must wait at one threadgroup_barrier.
    const Fiber* lead = nullptr;
    bool ok = true;
    for (uint32_t i = 0; i < n && ok; ++i) {
      const Fiber& f = s.fibers[i];
      if (f.state != State::Blocked || f.wait != Wait::ThreadgroupBarrier) {
        ok = false;
      } else if (!lead) {
        lead = &f;
      } else if (f.line != lead->line || std::strcmp(f.file, lead->file) != 0) {
        ok = false;
      }
    }
    if (!ok) {
      // Name the point that is not reached by everyone, then who is where.
      const Fiber* waiting = nullptr;
      for (uint32_t i = 0; i < n && !waiting; ++i)
        if (s.fibers[i].state == State::Blocked) waiting = &s.fibers[i];
      std::string scope = waiting && waiting->wait == Wait::ThreadgroupBarrier
                              ? "every thread of the threadgroup"
                              : "every lane of the simdgroup";
      raise(kernel, (waiting ? site(*waiting) : std::string("a barrier")) + " is not reached by " +
                        scope + " (divergent control flow) in threadgroup " +
                        tg_name(s.fibers[0].thread) + ": " + who_is_where(s.fibers, all));
    }
    for (uint32_t i = 0; i < n; ++i) s.fibers[i].state = State::Ready;
  }
}

void free_threadgroup_memory(Scheduler& s) {
  for (void* p : s.tg_blocks) std::free(p);
  s.tg_blocks.clear();
  s.tg_arrays.clear();
}

// Under AddressSanitizer, say which kernel and thread were running when it stops the process.
void asan_death_callback() {
  Scheduler& s = sched();
  if (!s.run || s.current < 0) return;
  const lily_msl_thread& t = s.fibers[static_cast<size_t>(s.current)].thread;
  std::fprintf(stderr,
               "[msl_cpu] AddressSanitizer stopped kernel '%s' in threadgroup %s, thread %u\n",
               s.run->kernel->name, tg_name(t).c_str(), t.thread_index_in_threadgroup);
}
void install_asan_hook() {
  static bool done = false;
  if (done) return;
  done = true;
  using set_fn = void (*)(void (*)());
  if (auto set = reinterpret_cast<set_fn>(dlsym(RTLD_DEFAULT, "__asan_set_death_callback")))
    set(asan_death_callback);
}

}  // namespace

const lily_msl_host_api* host_api() { return &kHostApi; }

void execute(const DispatchRun& run) {
  // One scheduler per process: dispatches from several host threads take turns.
  static std::mutex one_at_a_time;
  std::lock_guard<std::mutex> lock(one_at_a_time);
  Scheduler& s = sched();
  const uint32_t n = run.threads.width * run.threads.height * run.threads.depth;
  const size_t ntg = size_t(run.threadgroups.width) * run.threadgroups.height * run.threadgroups.depth;
  if (n == 0 || ntg == 0) return;
  install_asan_hook();
  static const bool fast = LILY_MSL_FAST_SWITCH && !dlsym(RTLD_DEFAULT, "__asan_init") &&
                           !std::getenv("LILY_MSL_CPU_UCONTEXT");
  s.fast = fast;
  if (s.fibers.size() < n || s.fibers_dirty || (!s.fibers.empty() && s.fibers[0].stack_bytes != run.stack_bytes)) {
    std::vector<Fiber> fresh(std::max<size_t>(n, s.fibers.size()));
    for (size_t i = 0; i < s.fibers.size(); ++i) {  // keep the stacks
      fresh[i].stack = s.fibers[i].stack;
      fresh[i].stack_bytes = s.fibers[i].stack_bytes;
    }
    s.fibers.swap(fresh);
    for (auto& f : s.fibers) make_fiber(f, run.stack_bytes);
    s.fibers_dirty = false;
  }
  s.simd.resize((n + LILY_MSL_SIMD_WIDTH - 1) / LILY_MSL_SIMD_WIDTH);
  s.run = &run;
  s.failure.clear();

  std::vector<size_t> tgs(ntg);
  std::iota(tgs.begin(), tgs.end(), size_t(0));
  std::mt19937_64 rng(run.seed);
  if (run.randomize) std::shuffle(tgs.begin(), tgs.end(), rng);
  try {
    for (size_t k : tgs) {
      const uint32_t gx = run.threadgroups.width, gy = run.threadgroups.height;
      const uint32_t pos[3] = {uint32_t(k % gx), uint32_t((k / gx) % gy), uint32_t(k / (size_t(gx) * gy))};
      run_threadgroup(s, run, pos, rng);
      free_threadgroup_memory(s);
    }
  } catch (...) {
    // Fibers stopped mid-kernel are abandoned; rebuild them before the next dispatch.
    for (uint32_t i = 0; i < n; ++i)
      if (s.fibers[i].state != State::Done) s.fibers_dirty = true;
    free_threadgroup_memory(s);
    *run.module->current_slot() = nullptr;
    s.run = nullptr;
    throw;
  }
  *run.module->current_slot() = nullptr;
  s.run = nullptr;
}

}  // namespace lily::msl_cpu
