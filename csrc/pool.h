// The CPU runtime: a pool of pinned workers (spin, then sleep) and a dispatcher thread that runs
// submitted jobs one after another, so Python (and the GPU) go on while the CPU computes.
#pragma once
#include <atomic>
#include <cstdint>
#include <condition_variable>
#include <deque>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#define KT_PAUSE() _mm_pause()
#else
#define KT_PAUSE()
#endif

namespace kt {

class ThreadPool {
  public:
    // n_threads counts the thread that calls parallel_for (it works too); thread i is bound to
    // cpus[i % cpus.size()] (Python orders them: each physical core's first thread, fastest cores
    // first, then the second threads); none: not bound.
    ThreadPool(int n_threads, std::vector<int> cpus, int spin_us);
    ~ThreadPool();
    ThreadPool(const ThreadPool&) = delete;
    ThreadPool& operator=(const ThreadPool&) = delete;

    // fn(task, thread) for task in [0, n_tasks), scheduled dynamically; returns when all are done.
    void parallel_for(int n_tasks, const std::function<void(int, int)>& fn);
    int size() const { return n_threads_; }
    void pin_caller() const;  // bind the calling thread to thread 0's CPU (when binding is on)
    // rest(): workers spinning for a next job go to sleep now (no job is coming soon: the cores
    // are the caller's, e.g. Python between two decode steps); rouse(): sleeping workers spin
    // again (a job is coming: its first parallel_for then finds them awake). Neither touches a job.
    void rest();
    void rouse();

  private:
    void worker(int id);
    void run_tasks(int id);

    const int n_threads_;
    const std::vector<int> cpus_;
    const int spin_us_;
    std::vector<std::thread> threads_;
    const std::function<void(int, int)>* job_ = nullptr;
    std::atomic<int> n_tasks_{0}, next_{0}, busy_{0};
    std::atomic<uint64_t> generation_{0};
    std::atomic<bool> resting_{false};  // set by rest(), cleared by rouse() and parallel_for(): no spinning while set
    std::atomic<uint64_t> rouses_{0};   // a change ends a sleep
    std::atomic<bool> stop_{false};
    std::mutex mu_;
    std::condition_variable wake_;
};

// Owns the pool; jobs submitted from Python run on its dispatcher thread, in order.
class Runtime {
  public:
    Runtime(int n_threads, std::vector<int> cpus, int spin_us);
    ~Runtime();
    void submit(std::function<void()> job);
    // Run `job` on the calling thread (as the pool's thread 0) once queued jobs are done: a
    // synchronous call pays no hand-off to the dispatcher and back.
    void run_inline(const std::function<void()>& job);
    // Wait for every submitted job; rethrows the first error a job raised.
    void sync();
    ThreadPool& pool() { return pool_; }
    // Scratch memory shared by the kernels of this runtime: jobs run one at a time on the
    // dispatcher, so one arena serves every layer. Kernels reserve their size when constructed.
    void reserve_scratch(size_t bytes);
    uint8_t* scratch() { return scratch_.data(); }

  private:
    void dispatch();

    ThreadPool pool_;
    std::deque<std::function<void()>> queue_;
    std::mutex mu_;
    std::condition_variable more_, done_;
    bool running_ = false, stop_ = false;
    std::exception_ptr error_;
    std::vector<uint8_t> scratch_;
    std::thread dispatcher_;
};

// Block the terminal's signals (SIGINT, SIGQUIT, SIGTERM, SIGHUP) in the calling thread: the
// kernels' own threads never take them, so they reach a thread that acts on them (Python's main
// thread: a Ctrl-C at a chat prompt wakes its blocked read, which one landing here would not).
void block_terminal_signals();

}  // namespace kt
