// Lets a background compile thread give way to the thread that serves decode steps.
//
// Both are Python threads under one GIL. A step releases the GIL in every kernel and takes it back after each
// (about 150 times per compiled batch-1 step); while the compile thread runs Python (Dynamo tracing, Inductor
// lowering and codegen) it keeps the GIL until the switch interval (5 ms) forces it off, so each of those
// re-takes can wait up to 5 ms. Measured on 2 cores: a ~14 ms batch-1 step took 350 ms beside a busy Python
// thread, and steps served while a graph compiled stalled up to 2.9 s. A shorter switch interval does not
// fix it (50-66 ms per step at 20-100 us).
//
// `give_way_to_steps(true)`, called on the compile thread, installs a C-level profile function on that thread
// only: every 256 Python calls and returns it checks whether a step is running (`set_stepping`, from the
// serving thread); if it is and the compile thread has run `slice_us` since it last gave way, it releases the
// GIL and sleeps until the step ends, at most `wait_us`. The step then runs its Python unhindered, and the
// compile still advances between steps and in its slices during long steps. A C function costs a few ns per
// event where a Python profile function made a compile 2.8x slower.

#include <Python.h>
#include <frameobject.h>
#include <torch/library.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <thread>

namespace {

using Clock = std::chrono::steady_clock;

std::atomic<bool> g_stepping{false};
std::atomic<int64_t> g_slice_us{1000};
std::atomic<int64_t> g_wait_us{8000};
std::atomic<int64_t> g_yields{0};
thread_local uint32_t t_events = 0;
thread_local Clock::time_point t_ran_since;

int give_way(PyObject*, PyFrameObject*, int, PyObject*) {
  if ((++t_events & 255u) != 0 || !g_stepping.load(std::memory_order_relaxed)) return 0;
  const Clock::time_point now = Clock::now();
  if (now - t_ran_since < std::chrono::microseconds(g_slice_us.load(std::memory_order_relaxed))) return 0;
  const Clock::time_point deadline = now + std::chrono::microseconds(g_wait_us.load(std::memory_order_relaxed));
  g_yields.fetch_add(1, std::memory_order_relaxed);
  Py_BEGIN_ALLOW_THREADS
  while (g_stepping.load(std::memory_order_relaxed) && Clock::now() < deadline)
    std::this_thread::sleep_for(std::chrono::microseconds(50));
  Py_END_ALLOW_THREADS
  t_ran_since = Clock::now();
  return 0;
}

// Install (or remove) the hook on the calling thread; `slice_us`/`wait_us` apply to every thread that has it.
void give_way_to_steps(bool on, int64_t slice_us, int64_t wait_us) {
  g_slice_us.store(slice_us);
  g_wait_us.store(wait_us);
  const PyGILState_STATE gil = PyGILState_Ensure();  // torch.ops calls arrive without the GIL
  t_ran_since = Clock::now();
  PyEval_SetProfile(on ? give_way : nullptr, nullptr);
  PyGILState_Release(gil);
}

void set_stepping(bool on) { g_stepping.store(on, std::memory_order_relaxed); }

int64_t give_way_count() { return g_yields.load(); }

}  // namespace

TORCH_LIBRARY_FRAGMENT(ringserve_qgemm, m) {
  m.def("give_way_to_steps(bool on, int slice_us, int wait_us) -> ()", &give_way_to_steps);
  m.def("set_stepping(bool on) -> ()", &set_stepping);
  m.def("give_way_count() -> int", &give_way_count);
}
