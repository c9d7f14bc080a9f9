// How the CUDA bench times a case: eager calls between events, CUDA-graph replay of one op and of a
// whole decode step, and the host's enqueue time.
// Part of kvforge_cuda_bench (cuda_bench.cu includes it once, in this order).
#pragma once

namespace {

// ---- timing ----------------------------------------------------------------------------------------

struct Timing {
  double eager_us = NAN, graph_us = NAN, host_us = NAN;
  std::string graph_error;
};

struct Timer {
  cudaStream_t stream;
  int iterations;
  bool cold;
  DeviceBuffer flush;  // twice L2: written before each cold iteration, untimed
  long long spin_cycles = 0;  // 30 us of SM clocks: the host's time to enqueue a call, with room

  // Times `iterations` calls of launch(i): events around the loop (warm), or around each call after an
  // untimed L2 flush (cold). Returns microseconds per call; `host_us`, where given, gets the host's
  // enqueue time per call (warm only: a cold run's flushes sit between the calls).
  template <class Launch> double time_calls(Launch launch, double* host_us) {
    cudaEvent_t start, stop;
    check(cudaEventCreate(&start), "event");
    check(cudaEventCreate(&stop), "event");
    float ms = 0;
    if (!cold) {
      check(cudaEventRecord(start, stream), "record");
      const auto host_start = std::chrono::steady_clock::now();
      for (int i = 0; i < iterations; ++i) launch(i);
      const double host = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - host_start).count();
      if (host_us) *host_us = host / iterations;
      check(cudaEventRecord(stop, stream), "record");
      check(cudaEventSynchronize(stop), "sync");
      check(cudaEventElapsedTime(&ms, start, stop), "elapsed");
    } else {
      for (int i = 0; i < iterations; ++i) {
        check(cudaMemsetAsync(flush.data, i & 0xff, size_t(flush.bytes), stream), "flush");
        check(cudaEventRecord(start, stream), "record");
        launch(i);
        check(cudaEventRecord(stop, stream), "record");
        check(cudaEventSynchronize(stop), "sync");
        float one = 0;
        check(cudaEventElapsedTime(&one, start, stop), "elapsed");
        ms += one;
      }
    }
    cudaEventDestroy(start);
    cudaEventDestroy(stop);
    return 1000.0 * ms / iterations;
  }

  // Eager calls, after a warm-up.
  template <class Op> void eager(Op op, Timing& t) {
    for (int i = 0; i < 3; ++i) op(i);
    check(cudaStreamSynchronize(stream), "warm-up");
    t.eager_us = time_calls(op, &t.host_us);
  }

  // op(i) captured on the stream and instantiated; null, with `error` set, where the capture fails (an
  // op that synchronizes or allocates).
  template <class Op> cudaGraphExec_t capture(Op op, int i, std::string& error) {
    check(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), "begin capture");
    try {
      op(i);
    } catch (const std::exception& e) {
      error = e.what();
    }
    cudaGraph_t graph = nullptr;
    const cudaError_t end = cudaStreamEndCapture(stream, &graph);
    if (error.empty() && end != cudaSuccess) error = cudaGetErrorString(end);
    cudaGetLastError();
    cudaGraphExec_t exec = nullptr;
    if (error.empty()) {
      const cudaError_t inst = cudaGraphInstantiate(&exec, graph, 0);
      if (inst != cudaSuccess) error = cudaGetErrorString(inst);
    }
    if (graph) cudaGraphDestroy(graph);
    return error.empty() ? exec : nullptr;
  }

  // Graphs of op(0) .. op(g - 1), each captured once, replayed in turn. A capture that fails is
  // reported, not fatal.
  template <class Op> void graph(Op op, int g, Timing& t) {
    std::vector<cudaGraphExec_t> execs;
    for (int i = 0; i < g && t.graph_error.empty(); ++i)
      if (cudaGraphExec_t exec = capture(op, i, t.graph_error)) execs.push_back(exec);
    if (t.graph_error.empty()) {
      auto replay = [&](int i) { check(cudaGraphLaunch(execs[size_t(i) % execs.size()], stream), "graph launch"); };
      for (int i = 0; i < 3; ++i) replay(i);
      t.graph_us = time_calls(replay, nullptr);
    }
    for (cudaGraphExec_t e : execs) cudaGraphExecDestroy(e);
  }

  // op(i) alone, as a graph, after prepare(i) has run eagerly and untimed (a lazy variant's staging,
  // before its commit). Each call is captured afresh, since prepare changes the state op reads, and is
  // launched behind a spin kernel, so that its events time the GPU's work and not the host's enqueue.
  template <class Prepare, class Op> void graph_alone(Prepare prepare, Op op, int calls, Timing& t) {
    std::vector<cudaGraphExec_t> execs;
    std::vector<cudaEvent_t> events(size_t(2 * calls));
    for (cudaEvent_t& e : events) check(cudaEventCreate(&e), "event");
    for (int i = 0; i < calls && t.graph_error.empty(); ++i) {
      prepare(i);
      const cudaGraphExec_t exec = capture(op, i, t.graph_error);
      if (!exec) break;
      execs.push_back(exec);
      spin_kernel<<<1, 1, 0, stream>>>(spin_cycles);
      check(cudaEventRecord(events[size_t(2 * i)], stream), "record");
      check(cudaGraphLaunch(exec, stream), "graph launch");
      check(cudaEventRecord(events[size_t(2 * i + 1)], stream), "record");
    }
    check(cudaStreamSynchronize(stream), "sync");
    if (t.graph_error.empty() && calls > 0) {
      double ms = 0;
      for (int i = 0; i < calls; ++i) {
        float one = 0;
        check(cudaEventElapsedTime(&one, events[size_t(2 * i)], events[size_t(2 * i + 1)]), "elapsed");
        ms += one;
      }
      t.graph_us = 1000.0 * ms / calls;
    }
    for (cudaGraphExec_t e : execs) cudaGraphExecDestroy(e);
    for (cudaEvent_t e : events) cudaEventDestroy(e);
  }
};

}  // namespace
