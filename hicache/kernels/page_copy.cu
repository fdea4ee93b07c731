// Page copies between two pools addressed by UVA pointers (GPU memory or pinned host memory).
//
// A copy is described by a segment table (one `Segment` per segment) and a list of page-id
// pairs. Page k's row of segment s lies at `src + src_ids[k] * src_stride` in the source and goes
// to `dst + dst_ids[k] * dst_stride`; it is `bytes` long. A page-first pool is one segment; a
// layer-first engine pool is one segment per layer tensor, and is still served by one call.
//
// Three ways to move the rows; hicache/kernels/cuda_paths.py (choose_path) chooses:
//   * `launch_kernel`: a kernel on a bounded grid. Each warp copies one chunk of one row at a
//     time with 16-byte loads and stores. The table must be device-readable; the ids are read
//     on the host and travel in the kernel's parameters (`IdBatch`), so nothing is staged and
//     nothing must outlive the call.
//   * `copy_batch`: cudaMemcpyBatchAsync over all rows: the copy engines move the bytes and no
//     SM is used. Table and ids are read on the host during the call.
//   * `Stager`: whole pages between a page-first host pool and two GPU staging buffers on the
//     copy engines, rows between those and a segmented GPU pool with the kernel on a side
//     stream, the two taking turns.
// `copy_loop` (one cudaMemcpyAsync per row) exists as the benchmark's baseline only.
// The `event_*` functions make, record and query the CUDA events that mark a copy's completion.
// No function here lets go of the GIL but `event_synchronize` (for worker threads, while it
// waits): torch's Event.record and tensor copies do, which would let a hicache worker thread take
// it in the middle of an engine-thread call.
//
// The caller has checked: addresses, strides and row sizes are multiples of 16 bytes; ids are
// in range; destination rows do not overlap.

#include <cuda_runtime.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cstdint>
#include <map>
#include <mutex>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace {

// One row of the segment table, as packed by cuda_paths.py (make_table): six int64 words.
struct Segment {
  int64_t src;          // address of page 0's row in the source pool
  int64_t src_stride;   // bytes from one page's row to the next in the source pool
  int64_t dst;          // address of page 0's row in the destination pool
  int64_t dst_stride;   // bytes from one page's row to the next in the destination pool
  int64_t bytes;        // bytes in one row (a multiple of 16)
  int64_t first_chunk;  // index of this segment's first chunk among a page's chunks
};
static_assert(sizeof(Segment) == 48, "Segment must match the table packed in cuda_paths.py");

constexpr int kThreads = 512;  // 16 warps per block
constexpr int kUnroll = 8;     // 16-byte loads in flight per lane: 4 KiB per warp

void check(cudaError_t err, const char* what) {
  if (err != cudaSuccess) {
    throw std::runtime_error(std::string("hicache page copy: ") + what + ": " +
                             cudaGetErrorString(err));
  }
}

// Makes `device` current for the scope and restores the previous one (no call at all when it
// was current already: the usual case, on the engine thread of a one-GPU rank).
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    check(cudaGetDevice(&previous_), "cudaGetDevice");
    switched_ = previous_ != device;
    if (switched_) check(cudaSetDevice(device), "cudaSetDevice");
  }
  ~DeviceGuard() {
    if (switched_) cudaSetDevice(previous_);
  }

 private:
  int previous_ = 0;
  bool switched_ = false;
};

// The segment that holds chunk `c` of a page: the last one whose first_chunk <= c.
__device__ __forceinline__ int find_segment(const Segment* table, int num_segs, int64_t c) {
  int lo = 0, hi = num_segs - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (__ldg(&table[mid].first_chunk) <= c) lo = mid; else hi = mid - 1;
  }
  return lo;
}

// The ids of up to N pages, passed by value: the kernel's parameters carry them to the device
// with the launch. Small copies (a request's pages) take a batch within the classic 4 KiB of
// parameters; large ones take batches of up to 32,764 bytes where the toolkit has them (CUDA
// 12.1 and later), so that a copy of many pages is a few launches.
template <int N>
struct IdBatch {
  int32_t src[N];
  int32_t dst[N];
};
constexpr int kSmallBatch = 480;  // 3,840 bytes
#if defined(CUDART_VERSION) && CUDART_VERSION >= 12010
constexpr int kLargeBatch = 4064;  // 32,512 bytes
#else
constexpr int kLargeBatch = kSmallBatch;
#endif

// Work item = (page k, chunk c of that page); warp w of the grid takes items w, w + W, ...
// Each lane keeps kUnroll independent 16-byte loads in flight before it stores them. The ids
// stay in the parameter space (__grid_constant__: no copy per thread); a warp reads one page's.
template <int N>
__global__ void __launch_bounds__(kThreads) copy_pages_kernel(
    const Segment* __restrict__ table, int num_segs, const __grid_constant__ IdBatch<N> ids,
    int64_t num_items, int64_t chunks_per_page, int64_t chunk_bytes) {
  const int lane = threadIdx.x & 31;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (kThreads / 32);
  for (int64_t item = blockIdx.x * (kThreads / 32) + (threadIdx.x >> 5); item < num_items;
       item += warps) {
    const int64_t k = item / chunks_per_page;
    const int64_t c = item - k * chunks_per_page;
    const Segment* seg = table + find_segment(table, num_segs, c);
    const int64_t offset = (c - __ldg(&seg->first_chunk)) * chunk_bytes;
    const int64_t vectors = min(chunk_bytes, __ldg(&seg->bytes) - offset) >> 4;
    const int4* from = reinterpret_cast<const int4*>(
        __ldg(&seg->src) + static_cast<int64_t>(ids.src[k]) * __ldg(&seg->src_stride) + offset);
    int4* to = reinterpret_cast<int4*>(
        __ldg(&seg->dst) + static_cast<int64_t>(ids.dst[k]) * __ldg(&seg->dst_stride) + offset);
    for (int64_t base = lane; base < vectors; base += 32 * kUnroll) {
      int4 v[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        if (base + 32 * u < vectors) v[u] = __ldcs(from + base + 32 * u);
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        if (base + 32 * u < vectors) __stcs(to + base + 32 * u, v[u]);
      }
    }
  }
}

// Launches the kernel on `stream` for the first `n` (<= N) pages of src_ids -> dst_ids.
template <int N>
void launch_batch(const Segment* table, int num_segs, const int32_t* src_ids,
                  const int32_t* dst_ids, int64_t n, int64_t chunks_per_page,
                  int64_t chunk_bytes, int64_t max_blocks, cudaStream_t stream) {
  IdBatch<N> ids;
  std::copy(src_ids, src_ids + n, ids.src);
  std::copy(dst_ids, dst_ids + n, ids.dst);
  const int64_t items = n * chunks_per_page;
  const int64_t needed = (items + kThreads / 32 - 1) / (kThreads / 32);
  const int blocks = static_cast<int>(std::min(needed, max_blocks));
  copy_pages_kernel<N><<<blocks, kThreads, 0, stream>>>(table, num_segs, ids, items,
                                                        chunks_per_page, chunk_bytes);
  check(cudaGetLastError(), "kernel launch");
}

// Enqueues the kernel on `stream` for pages src_ids[k] -> dst_ids[k] (host arrays of
// `num_pages` int32, read during the call), each launch on at most `max_blocks` blocks.
// `table` (num_segs Segments) is device-readable. The caller has made `device` current.
void enqueue_kernel(const Segment* table, int num_segs, const int32_t* src_ids,
                    const int32_t* dst_ids, int64_t num_pages, int64_t chunks_per_page,
                    int64_t chunk_bytes, int64_t max_blocks, cudaStream_t stream) {
  for (int64_t from = 0; from < num_pages;) {
    const int64_t left = num_pages - from;
    const int64_t n = std::min<int64_t>(left, left <= kSmallBatch ? kSmallBatch : kLargeBatch);
    if (n <= kSmallBatch) {
      launch_batch<kSmallBatch>(table, num_segs, src_ids + from, dst_ids + from, n,
                                chunks_per_page, chunk_bytes, max_blocks, stream);
    } else {
      launch_batch<kLargeBatch>(table, num_segs, src_ids + from, dst_ids + from, n,
                                chunks_per_page, chunk_bytes, max_blocks, stream);
    }
    from += n;
  }
}

void check_kernel_knobs(int64_t chunks_per_page, int64_t chunk_bytes, int64_t max_blocks) {
  if (chunk_bytes <= 0 || chunk_bytes % 16 || max_blocks <= 0 || chunks_per_page <= 0) {
    throw std::invalid_argument("chunk_bytes (a multiple of 16), chunks_per_page and "
                                "max_blocks must be positive");
  }
}

// The kernel path: `table` (num_segs Segments) is device-readable, `src_ids` and `dst_ids` are
// host addresses of num_pages int32 each (read before the call returns).
void launch_kernel(int64_t table, int64_t num_segs, int64_t src_ids, int64_t dst_ids,
                   int64_t num_pages, int64_t chunks_per_page, int64_t chunk_bytes,
                   int64_t max_blocks, int64_t stream, int64_t device) {
  check_kernel_knobs(chunks_per_page, chunk_bytes, max_blocks);
  if (num_pages == 0) return;
  DeviceGuard guard(static_cast<int>(device));
  enqueue_kernel(reinterpret_cast<const Segment*>(table), static_cast<int>(num_segs),
                 reinterpret_cast<const int32_t*>(src_ids),
                 reinterpret_cast<const int32_t*>(dst_ids), num_pages, chunks_per_page,
                 chunk_bytes, max_blocks, reinterpret_cast<cudaStream_t>(stream));
}

// The rows to copy as (dst, src, size) lists; a row adjacent to the previous one on both sides
// (right after it, or right before it for runs that go down) is merged into it.
struct Rows {
  std::vector<void*> dsts;
  std::vector<const void*> srcs;
  std::vector<size_t> sizes;
};

Rows collect_rows(int64_t table, int64_t num_segs, int64_t src_ids, int64_t dst_ids,
                  int64_t num_pages) {
  const Segment* t = reinterpret_cast<const Segment*>(table);
  const int32_t* sid = reinterpret_cast<const int32_t*>(src_ids);
  const int32_t* did = reinterpret_cast<const int32_t*>(dst_ids);
  Rows rows;
  rows.dsts.reserve(num_pages * num_segs);
  rows.srcs.reserve(num_pages * num_segs);
  rows.sizes.reserve(num_pages * num_segs);
  for (int64_t k = 0; k < num_pages; ++k) {
    for (int64_t s = 0; s < num_segs; ++s) {
      char* src = reinterpret_cast<char*>(t[s].src + sid[k] * t[s].src_stride);
      char* dst = reinterpret_cast<char*>(t[s].dst + did[k] * t[s].dst_stride);
      const size_t n = static_cast<size_t>(t[s].bytes);
      if (!rows.sizes.empty()) {  // adjacent to the last row on both sides: one row
        const size_t last = rows.sizes.back();
        const char* last_src = static_cast<const char*>(rows.srcs.back());
        char* last_dst = static_cast<char*>(rows.dsts.back());
        if (last_src + last == src && last_dst + last == dst) {  // right after it
          rows.sizes.back() += n;
          continue;
        }
        if (src + n == last_src && dst + n == last_dst) {  // right before it (runs down)
          rows.srcs.back() = src;
          rows.dsts.back() = dst;
          rows.sizes.back() += n;
          continue;
        }
      }
      rows.dsts.push_back(dst);
      rows.srcs.push_back(src);
      rows.sizes.push_back(n);
    }
  }
  return rows;
}

// The stream of a device that stands in for the legacy default stream, which
// cudaMemcpyBatchAsync refuses: created once and kept for the life of the process.
cudaStream_t legacy_stand_in(int device) {
  static std::mutex mutex;
  static std::map<int, cudaStream_t> streams;
  std::lock_guard<std::mutex> lock(mutex);
  cudaStream_t& s = streams[device];
  if (s == nullptr) check(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "stream");
  return s;
}

// Makes `waiter` wait for the work enqueued so far on `signaller`.
void order(cudaStream_t signaller, cudaStream_t waiter) {
  cudaEvent_t event;
  check(cudaEventCreateWithFlags(&event, cudaEventDisableTiming), "cudaEventCreate");
  check(cudaEventRecord(event, signaller), "cudaEventRecord");
  check(cudaStreamWaitEvent(waiter, event, 0), "cudaStreamWaitEvent");
  check(cudaEventDestroy(event), "cudaEventDestroy");  // released once it has completed
}

// cudaMemcpyBatchAsync over all rows, in calls of at most `rows_per_call` rows so that the copy
// engines start while later rows are still being enqueued. `table` and the ids are host
// addresses. On the legacy default stream the rows go through a side stream, forked from it and
// joined back into it. The caller has made `device` current.
void enqueue_batch(int64_t table, int64_t num_segs, int64_t src_ids, int64_t dst_ids,
                   int64_t num_pages, int64_t rows_per_call, cudaStream_t caller, int device) {
  Rows rows = collect_rows(table, num_segs, src_ids, dst_ids, num_pages);
  const bool legacy = caller == nullptr || caller == cudaStreamLegacy;
  cudaStream_t target = legacy ? legacy_stand_in(device) : caller;
  if (legacy) order(caller, target);
  cudaMemcpyAttributes attr = {};
  attr.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
  size_t zero = 0;
  for (size_t from = 0; from < rows.sizes.size(); from += rows_per_call) {
    const size_t n = std::min<size_t>(rows_per_call, rows.sizes.size() - from);
    check(cudaMemcpyBatchAsync(rows.dsts.data() + from, rows.srcs.data() + from,
                               rows.sizes.data() + from, n, &attr, &zero, 1, target),
          "cudaMemcpyBatchAsync");
  }
  if (legacy) order(target, caller);
}

// The copy engines' path (see enqueue_batch).
void copy_batch(int64_t table, int64_t num_segs, int64_t src_ids, int64_t dst_ids,
                int64_t num_pages, int64_t rows_per_call, int64_t stream, int64_t device) {
  if (rows_per_call <= 0) throw std::invalid_argument("rows_per_call must be positive");
  if (num_pages == 0) return;
  DeviceGuard guard(static_cast<int>(device));
  enqueue_batch(table, num_segs, src_ids, dst_ids, num_pages, rows_per_call,
                reinterpret_cast<cudaStream_t>(stream), static_cast<int>(device));
}

// The staged path between a page-first host pool and a segmented GPU pool, for one direction.
//
// Two GPU staging buffers of `per_part` whole pages each take turns: the copy engines move whole
// pages between the host and one buffer (one row per page, on the caller's stream) while the
// kernel moves rows between the other and the GPU pool (on a side stream of the Stager's own: a
// stream shared by all Stagers would queue a store's kernels behind a load's, and the two
// directions would run one after the other). The caller owns the buffers and the four segment
// tables, and keeps them alive as long as the Stager:
// `whole_tables[b]` (host memory) maps host pages to buffer b's whole pages (to the GPU) or
// back, `row_tables[b]` (device memory) maps buffer b's rows to the pool's or back.
//
// Ordering, with events: the side stream first waits for everything enqueued on the caller's
// stream before the call (the pool's rows are the model's until then), each part waits until
// its buffer's last reader is done (`free_[b]`), and the caller's stream waits for the side
// stream at the end, so work enqueued after the call sees every byte.
class Stager {
 public:
  Stager(bool to_gpu, int64_t per_part, std::vector<int64_t> whole_tables, int64_t whole_segs,
         std::vector<int64_t> row_tables, int64_t row_segs, int64_t chunks_per_page,
         int64_t chunk_bytes, int64_t max_blocks, int64_t rows_per_call, int64_t device)
      : to_gpu_(to_gpu), per_part_(per_part), whole_tables_(std::move(whole_tables)),
        whole_segs_(whole_segs), row_tables_(std::move(row_tables)), row_segs_(row_segs),
        chunks_per_page_(chunks_per_page), chunk_bytes_(chunk_bytes), max_blocks_(max_blocks),
        rows_per_call_(rows_per_call), device_(static_cast<int>(device)) {
    if (per_part <= 0 || rows_per_call <= 0 || whole_tables_.size() != 2 ||
        row_tables_.size() != 2) {
      throw std::invalid_argument("a Stager needs per_part > 0, rows_per_call > 0 and two "
                                  "tables of each kind");
    }
    check_kernel_knobs(chunks_per_page, chunk_bytes, max_blocks);
    DeviceGuard guard(device_);
    order_.resize(per_part);
    for (int64_t i = 0; i < per_part; ++i) order_[i] = static_cast<int32_t>(i);
    for (cudaEvent_t& e : free_) {
      check(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), "cudaEventCreate");
    }
    check(cudaStreamCreateWithFlags(&side_, cudaStreamNonBlocking), "cudaStreamCreate");
  }
  ~Stager() {  // both are released once the work enqueued on them has completed
    for (cudaEvent_t e : free_) cudaEventDestroy(e);
    cudaStreamDestroy(side_);
  }
  Stager(const Stager&) = delete;
  Stager& operator=(const Stager&) = delete;

  // Copies host page host_ids[k] to GPU page pool_ids[k] (to the GPU) or back, for k <
  // num_pages; both are host addresses of int32 ids, read during the call.
  void copy(int64_t host_ids, int64_t pool_ids, int64_t num_pages, int64_t stream) {
    if (num_pages == 0) return;
    DeviceGuard guard(device_);
    cudaStream_t main = reinterpret_cast<cudaStream_t>(stream);
    cudaStream_t side = side_;
    const int32_t* host = reinterpret_cast<const int32_t*>(host_ids);
    const int32_t* pool = reinterpret_cast<const int32_t*>(pool_ids);
    const int64_t staging = reinterpret_cast<int64_t>(order_.data());
    if (!to_gpu_) order(main, side);  // the model's last writes to the pool rows come first
    for (int64_t begin = 0, part = 0; begin < num_pages; begin += per_part_, ++part) {
      const int b = static_cast<int>(part % 2);
      const int64_t n = std::min(per_part_, num_pages - begin);
      const Segment* rows = reinterpret_cast<const Segment*>(row_tables_[b]);
      if (to_gpu_) {  // copy engines: host -> buffer b; then the kernel: buffer b -> pool rows
        check(cudaStreamWaitEvent(main, free_[b], 0), "cudaStreamWaitEvent");
        enqueue_batch(whole_tables_[b], whole_segs_, reinterpret_cast<int64_t>(host + begin),
                      staging, n, rows_per_call_, main, device_);
        order(main, side);
        enqueue_kernel(rows, static_cast<int>(row_segs_), order_.data(), pool + begin, n,
                       chunks_per_page_, chunk_bytes_, max_blocks_, side);
        check(cudaEventRecord(free_[b], side), "cudaEventRecord");
      } else {  // the kernel: pool rows -> buffer b; then copy engines: buffer b -> host
        check(cudaStreamWaitEvent(side, free_[b], 0), "cudaStreamWaitEvent");
        enqueue_kernel(rows, static_cast<int>(row_segs_), pool + begin, order_.data(), n,
                       chunks_per_page_, chunk_bytes_, max_blocks_, side);
        order(side, main);
        enqueue_batch(whole_tables_[b], whole_segs_, staging,
                      reinterpret_cast<int64_t>(host + begin), n, rows_per_call_, main, device_);
        check(cudaEventRecord(free_[b], main), "cudaEventRecord");
      }
    }
    if (to_gpu_) order(side, main);  // (back from the GPU, the last part's copy waited already)
  }

 private:
  const bool to_gpu_;
  const int64_t per_part_;
  const std::vector<int64_t> whole_tables_;
  const int64_t whole_segs_;
  const std::vector<int64_t> row_tables_;
  const int64_t row_segs_, chunks_per_page_, chunk_bytes_, max_blocks_, rows_per_call_;
  const int device_;
  std::vector<int32_t> order_;  // 0, 1, ..., per_part - 1: a staging buffer's page ids
  cudaEvent_t free_[2] = {nullptr, nullptr};
  cudaStream_t side_ = nullptr;  // the kernel's stream, this Stager's own
};

// One cudaMemcpyAsync per row: the baseline that the benchmark compares with.
void copy_loop(int64_t table, int64_t num_segs, int64_t src_ids, int64_t dst_ids,
               int64_t num_pages, int64_t stream, int64_t device) {
  if (num_pages == 0) return;
  DeviceGuard guard(static_cast<int>(device));
  Rows rows = collect_rows(table, num_segs, src_ids, dst_ids, num_pages);
  for (size_t i = 0; i < rows.sizes.size(); ++i) {
    check(cudaMemcpyAsync(rows.dsts[i], rows.srcs[i], rows.sizes[i], cudaMemcpyDefault,
                          reinterpret_cast<cudaStream_t>(stream)),
          "cudaMemcpyAsync");
  }
}

// A blocking-sync event (a thread waiting on it sleeps); `timing` makes it usable with
// event_elapsed_ms. Returns the handle as an integer; the caller destroys it once.
int64_t event_create(bool timing, int64_t device) {
  DeviceGuard guard(static_cast<int>(device));
  cudaEvent_t event;
  const unsigned flags = cudaEventBlockingSync | (timing ? 0u : cudaEventDisableTiming);
  check(cudaEventCreateWithFlags(&event, flags), "cudaEventCreate");
  return reinterpret_cast<int64_t>(event);
}

void event_record(int64_t event, int64_t stream, int64_t device) {
  DeviceGuard guard(static_cast<int>(device));  // the legacy stream (0) is the current device's
  check(cudaEventRecord(reinterpret_cast<cudaEvent_t>(event),
                        reinterpret_cast<cudaStream_t>(stream)),
        "cudaEventRecord");
}

// Whether the work before the event's last record has completed. Never waits.
bool event_query(int64_t event) {
  const cudaError_t err = cudaEventQuery(reinterpret_cast<cudaEvent_t>(event));
  if (err == cudaErrorNotReady) {
    cudaGetLastError();  // "not ready" is an answer, not an error: don't leave it behind
    return false;
  }
  check(err, "cudaEventQuery");
  return true;
}

// Makes `stream` wait, on the device, for the work before the event's last record. The host
// thread does not wait.
void event_wait(int64_t event, int64_t stream, int64_t device) {
  DeviceGuard guard(static_cast<int>(device));  // the legacy stream (0) is the current device's
  check(cudaStreamWaitEvent(reinterpret_cast<cudaStream_t>(stream),
                            reinterpret_cast<cudaEvent_t>(event), 0),
        "cudaStreamWaitEvent");
}

void event_synchronize(int64_t event) {
  check(cudaEventSynchronize(reinterpret_cast<cudaEvent_t>(event)), "cudaEventSynchronize");
}

float event_elapsed_ms(int64_t start, int64_t end) {
  float ms = 0;
  check(cudaEventElapsedTime(&ms, reinterpret_cast<cudaEvent_t>(start),
                             reinterpret_cast<cudaEvent_t>(end)),
        "cudaEventElapsedTime");
  return ms;
}

void event_destroy(int64_t event) { cudaEventDestroy(reinterpret_cast<cudaEvent_t>(event)); }

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "hicache page copies (see page_copy.cu)";
  m.def("launch_kernel", &launch_kernel);
  m.def("copy_batch", &copy_batch);
  m.def("copy_loop", &copy_loop);
  pybind11::class_<Stager>(m, "Stager")
      .def(pybind11::init<bool, int64_t, std::vector<int64_t>, int64_t, std::vector<int64_t>,
                          int64_t, int64_t, int64_t, int64_t, int64_t, int64_t>())
      .def("copy", &Stager::copy);
  m.def("event_create", &event_create);
  m.def("event_record", &event_record);
  m.def("event_query", &event_query);
  m.def("event_wait", &event_wait);
  m.def("event_synchronize", &event_synchronize,
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("event_elapsed_ms", &event_elapsed_ms);
  m.def("event_destroy", &event_destroy);
}
