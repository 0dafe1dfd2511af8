// ThreadPool and Runtime. Workers spin for spin_us after each job (a decode step issues many
// small parallel regions back to back), then sleep on a condition variable, so an idle pool
// costs no CPU - which matters on a machine with few cores, where Python shares them.
#include "pool.h"

#include <chrono>

#if defined(__linux__)
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#endif

namespace kt {
void block_terminal_signals() {
#if defined(__linux__)
    sigset_t set;
    sigemptyset(&set);
    for (int s : {SIGINT, SIGQUIT, SIGTERM, SIGHUP}) sigaddset(&set, s);
    pthread_sigmask(SIG_BLOCK, &set, nullptr);
#endif
}

namespace {
// Bind the calling thread to `cpu` where this process may run there (else leave it be).
void pin_to(int cpu) {
#if defined(__linux__)
    cpu_set_t allowed;
    if (cpu < 0 || cpu >= CPU_SETSIZE || sched_getaffinity(0, sizeof(allowed), &allowed) != 0 || !CPU_ISSET(cpu, &allowed)) return;
    cpu_set_t one;
    CPU_ZERO(&one);
    CPU_SET(cpu, &one);
    pthread_setaffinity_np(pthread_self(), sizeof(one), &one);
#else
    (void)cpu;
#endif
}
}  // namespace

ThreadPool::ThreadPool(int n_threads, std::vector<int> cpus, int spin_us)
    : n_threads_(n_threads < 1 ? 1 : n_threads), cpus_(std::move(cpus)), spin_us_(spin_us) {
    for (int i = 1; i < n_threads_; i++) threads_.emplace_back(&ThreadPool::worker, this, i);
}

ThreadPool::~ThreadPool() {
    {
        std::lock_guard<std::mutex> lock(mu_);
        stop_ = true;
        generation_++;
    }
    wake_.notify_all();
    for (auto& t : threads_) t.join();
}

void ThreadPool::pin_caller() const {
    if (!cpus_.empty()) pin_to(cpus_[0]);
}

void ThreadPool::run_tasks(int id) {
    const auto& fn = *job_;
    const int n = n_tasks_.load(std::memory_order_acquire);
    for (int task = next_.fetch_add(1); task < n; task = next_.fetch_add(1)) fn(task, id);
}

void ThreadPool::parallel_for(int n_tasks, const std::function<void(int, int)>& fn) {
    if (n_tasks <= 0) return;
    if (n_threads_ == 1 || n_tasks == 1) {
        for (int t = 0; t < n_tasks; t++) fn(t, 0);
        return;
    }
    job_ = &fn;
    next_.store(0);
    n_tasks_.store(n_tasks, std::memory_order_release);
    busy_.store(n_threads_ - 1);
    resting_.store(false, std::memory_order_relaxed);  // (workers spin again after this job)
    {
        std::lock_guard<std::mutex> lock(mu_);
        generation_.fetch_add(1, std::memory_order_release);
    }
    wake_.notify_all();
    run_tasks(0);
    while (busy_.load(std::memory_order_acquire) != 0) KT_PAUSE();
    job_ = nullptr;
}

void ThreadPool::rest() { resting_.store(true, std::memory_order_release); }

void ThreadPool::rouse() {
    {
        std::lock_guard<std::mutex> lock(mu_);
        resting_.store(false, std::memory_order_release);
        rouses_.fetch_add(1, std::memory_order_release);
    }
    wake_.notify_all();
}

void ThreadPool::worker(int id) {
    block_terminal_signals();
    if (!cpus_.empty()) pin_to(cpus_[id % cpus_.size()]);
    uint64_t seen = 0;
    for (;;) {
        // spin a little for the next job (unless told to rest), then sleep until one comes or a
        // rouse() says one is coming
        const uint64_t roused = rouses_.load(std::memory_order_acquire);
        const auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(spin_us_);
        while (generation_.load(std::memory_order_acquire) == seen && !resting_.load(std::memory_order_acquire) &&
               std::chrono::steady_clock::now() < until)
            for (int i = 0; i < 8; i++) KT_PAUSE();  // (PAUSE is long on recent cores: a few between checks of the clock)
        if (generation_.load(std::memory_order_acquire) == seen) {
            std::unique_lock<std::mutex> lock(mu_);
            wake_.wait(lock, [&] { return generation_.load() != seen || rouses_.load() != roused; });
            if (generation_.load() == seen) continue;  // roused: spin for the job that is coming
        }
        seen = generation_.load(std::memory_order_acquire);
        if (stop_) return;
        run_tasks(id);
        busy_.fetch_sub(1, std::memory_order_release);
    }
}

Runtime::Runtime(int n_threads, std::vector<int> cpus, int spin_us) : pool_(n_threads, std::move(cpus), spin_us) {
    dispatcher_ = std::thread(&Runtime::dispatch, this);
}

Runtime::~Runtime() {
    {
        std::lock_guard<std::mutex> lock(mu_);
        stop_ = true;
    }
    more_.notify_all();
    dispatcher_.join();
}

void Runtime::reserve_scratch(size_t bytes) {
    // exclusive, as a job: no job (nor a Doorbell call) may be using the arena while it moves
    run_inline([&] {
        if (bytes > scratch_.size()) scratch_.resize(bytes);
    });
}

void Runtime::submit(std::function<void()> job) {
    {
        std::lock_guard<std::mutex> lock(mu_);
        queue_.push_back(std::move(job));
    }
    more_.notify_one();
}

void Runtime::run_inline(const std::function<void()>& job) {
    {
        std::unique_lock<std::mutex> lock(mu_);
        done_.wait(lock, [&] { return queue_.empty() && !running_; });
        running_ = true;  // the dispatcher stays out while this thread drives the pool
    }
    std::exception_ptr error;
    try {
        job();
    } catch (...) {
        error = std::current_exception();
    }
    bool queued;
    {
        std::lock_guard<std::mutex> lock(mu_);
        running_ = false;
        queued = !queue_.empty();
    }
    if (queued) more_.notify_one();  // jobs submitted meanwhile: the dispatcher's turn (else let it sleep)
    else done_.notify_all();
    if (error) std::rethrow_exception(error);
}

void Runtime::sync() {
    std::unique_lock<std::mutex> lock(mu_);
    done_.wait(lock, [&] { return queue_.empty() && !running_; });
    if (error_) {
        std::exception_ptr e = error_;
        error_ = nullptr;
        std::rethrow_exception(e);
    }
}

void Runtime::dispatch() {
    block_terminal_signals();
    pool_.pin_caller();
    std::unique_lock<std::mutex> lock(mu_);
    for (;;) {
        more_.wait(lock, [&] { return stop_ || (!queue_.empty() && !running_); });
        if (queue_.empty() && stop_) return;
        std::function<void()> job = std::move(queue_.front());
        queue_.pop_front();
        running_ = true;
        lock.unlock();
        try {
            job();
        } catch (...) {
            std::lock_guard<std::mutex> relock(mu_);
            if (!error_) error_ = std::current_exception();
        }
        lock.lock();
        running_ = false;
        if (queue_.empty()) done_.notify_all();
    }
}

}  // namespace kt
