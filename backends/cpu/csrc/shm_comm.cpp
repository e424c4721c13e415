// Shared-memory all-reduce / all-gather between the ranks of one host: the CPU kernels of
// fxc::all_reduce and fxc::all_gather (schemas in fxcompiler/ops/collectives.py).
//
// A group that joined a segment (join(), from backends/cpu/comm.py) uses it; any other group
// name falls back to torch's functional collectives (_c10d_functional + wait_tensor) through
// the dispatcher, i.e. gloo on CPU: the reference and the multi-host path.
//
// Segment layout (one file in /dev/shm, mapped by every rank):
//   flags:  world x 64-byte lines, line r holds rank r's sequence number (int64, atomic)
//   slots:  world x 2 x slot_bytes, rank r's two buffers (used alternately by call parity)
// A call with sequence s: copy my chunk into slot[me][s & 1], publish flag[me] = s (release),
// wait until every flag >= s (acquire), then read every rank's slot in rank order (so every
// rank computes the same bits). Two buffers make the second barrier unnecessary: a rank can
// only overwrite slot[r][s & 1] at call s + 2, after every peer published s + 1, which they do
// after finishing call s. Tensors larger than a slot go through in chunks (one sequence each).
// Waiting spins with pause, then yields the core (ranks may outnumber cores).

// pybind11 with torch's Tensor casters, torch::Library and ATen's headers, not torch/extension.h (the whole C++
// frontend API), which tripled the build time.
#include <torch/csrc/utils/pybind.h>
#include <torch/library.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/from_blob.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <atomic>
#include <cstring>
#include <fcntl.h>
#include <map>
#include <mutex>
#include <sched.h>
#include <stdexcept>
#include <string>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kLine = 64;

struct Group {
  std::string path;
  int rank = 0;
  int world = 1;
  int64_t slot_bytes = 0;
  int64_t seq = 0;
  char* base = nullptr;
  size_t size = 0;

  std::atomic<int64_t>* flag(int r) const { return reinterpret_cast<std::atomic<int64_t>*>(base + r * kLine); }
  char* slot(int r, int64_t s) const {
    return base + world * kLine + (static_cast<int64_t>(r) * 2 + (s & 1)) * slot_bytes;
  }
};

std::mutex g_mutex;
std::map<std::string, Group*> g_groups;

Group* find(const std::string& name) {
  std::lock_guard<std::mutex> lock(g_mutex);
  auto it = g_groups.find(name);
  return it == g_groups.end() ? nullptr : it->second;
}

inline void cpu_relax() {
#if defined(__x86_64__)
  _mm_pause();
#endif
}

void wait_all(Group* g, int64_t s) {
  for (int r = 0; r < g->world; ++r) {
    auto* f = g->flag(r);
    int spins = 0;
    while (f->load(std::memory_order_acquire) < s) {
      if (++spins < (1 << 16)) {
        cpu_relax();
      } else {
        sched_yield();  // more ranks than free cores: give the peer the core
      }
    }
  }
}

void publish(Group* g, int64_t s) { g->flag(g->rank)->store(s, std::memory_order_release); }

at::Tensor reduce_shm(Group* g, const at::Tensor& x) {
  at::Tensor in = x.contiguous();
  at::Tensor out = at::empty_like(in, at::MemoryFormat::Contiguous);
  const int64_t elem = in.element_size();
  const int64_t total = in.numel();
  const int64_t per_chunk = std::max<int64_t>(1, g->slot_bytes / elem);
  const bool low = in.scalar_type() == at::kBFloat16 || in.scalar_type() == at::kHalf;
  auto opts = in.options();
  for (int64_t off = 0; off < total; off += per_chunk) {
    const int64_t n = std::min(per_chunk, total - off);
    const int64_t s = ++g->seq;
    std::memcpy(g->slot(g->rank, s), static_cast<const char*>(in.data_ptr()) + off * elem, n * elem);
    publish(g, s);
    wait_all(g, s);
    at::Tensor dst = out.view({-1}).narrow(0, off, n);
    at::Tensor acc = at::from_blob(g->slot(0, s), {n}, opts);
    acc = low ? acc.to(at::kFloat) : acc.clone();
    for (int r = 1; r < g->world; ++r) {
      acc.add_(at::from_blob(g->slot(r, s), {n}, opts));  // rank order: every rank sums alike
    }
    dst.copy_(acc);
  }
  return out;
}

at::Tensor gather_shm(Group* g, const at::Tensor& x) {
  at::Tensor in = x.contiguous();
  std::vector<int64_t> shape(in.sizes().begin(), in.sizes().end());
  if (shape.empty()) shape.push_back(1);
  shape[0] *= g->world;
  at::Tensor out = at::empty(shape, in.options());
  const int64_t bytes = in.numel() * in.element_size();
  char* dst = static_cast<char*>(out.data_ptr());
  const char* src = static_cast<const char*>(in.data_ptr());
  for (int64_t off = 0; off < bytes || (off == 0 && bytes == 0); off += g->slot_bytes) {
    const int64_t n = std::min(g->slot_bytes, bytes - off);
    const int64_t s = ++g->seq;
    if (n > 0) std::memcpy(g->slot(g->rank, s), src + off, n);
    publish(g, s);
    wait_all(g, s);
    for (int r = 0; r < g->world; ++r) {
      if (n > 0) std::memcpy(dst + r * bytes + off, g->slot(r, s), n);
    }
    if (bytes == 0) break;
  }
  return out;
}

at::Tensor c10d_wait(const at::Tensor& t) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("_c10d_functional::wait_tensor", "")
                       .typed<at::Tensor(const at::Tensor&)>();
  return op.call(t);
}

at::Tensor all_reduce_cpu(const at::Tensor& x, c10::string_view group) {
  Group* g = find(std::string(group));
  if (g != nullptr && g->world > 1) return reduce_shm(g, x);
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("_c10d_functional::all_reduce", "")
                       .typed<at::Tensor(const at::Tensor&, c10::string_view, c10::string_view)>();
  return c10d_wait(op.call(x.contiguous(), "sum", group));
}

at::Tensor all_gather_cpu(const at::Tensor& x, int64_t world, c10::string_view group) {
  Group* g = find(std::string(group));
  if (g != nullptr && g->world > 1) {
    TORCH_CHECK(world == g->world, "fxc::all_gather: world=", world, " but group ", std::string(group), " has ",
                g->world, " ranks");
    return gather_shm(g, x);
  }
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("_c10d_functional::all_gather_into_tensor", "")
                       .typed<at::Tensor(const at::Tensor&, int64_t, c10::string_view)>();
  return c10d_wait(op.call(x.contiguous(), world, group));
}

// Map the segment file ``path`` (created and sized by rank 0 before anyone joins) as ``name``.
void join(const std::string& name, const std::string& path, int64_t rank, int64_t world, int64_t slot_bytes) {
  TORCH_CHECK(world >= 1 && rank >= 0 && rank < world, "shm join: rank ", rank, " world ", world);
  TORCH_CHECK(slot_bytes > 0 && slot_bytes % kLine == 0, "shm join: slot_bytes must be a positive multiple of 64");
  size_t size = static_cast<size_t>(world * kLine + world * 2 * slot_bytes);
  int fd = ::open(path.c_str(), O_RDWR);
  TORCH_CHECK(fd >= 0, "shm join: cannot open ", path);
  struct stat st;
  ::fstat(fd, &st);
  TORCH_CHECK(static_cast<size_t>(st.st_size) >= size, "shm join: ", path, " holds ", st.st_size, " bytes, need ",
              size);
  void* p = ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  ::close(fd);
  TORCH_CHECK(p != MAP_FAILED, "shm join: mmap of ", path, " failed");
  auto* g = new Group();
  g->path = path;
  g->rank = static_cast<int>(rank);
  g->world = static_cast<int>(world);
  g->slot_bytes = slot_bytes;
  g->base = static_cast<char*>(p);
  g->size = size;
  g->seq = g->flag(g->rank)->load(std::memory_order_acquire);
  std::lock_guard<std::mutex> lock(g_mutex);
  auto it = g_groups.find(name);
  if (it != g_groups.end()) {
    ::munmap(it->second->base, it->second->size);
    delete it->second;
  }
  g_groups[name] = g;
}

void leave(const std::string& name) {
  std::lock_guard<std::mutex> lock(g_mutex);
  auto it = g_groups.find(name);
  if (it == g_groups.end()) return;
  ::munmap(it->second->base, it->second->size);
  delete it->second;
  g_groups.erase(it);
}

bool joined(const std::string& name) { return find(name) != nullptr; }

}  // namespace

TORCH_LIBRARY_IMPL(fxc, CPU, m) {
  m.impl("all_reduce", &all_reduce_cpu);
  m.impl("all_gather", &all_gather_cpu);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("join", &join, "map a shared-memory segment as the communicator of a process group");
  m.def("leave", &leave, "unmap a group's segment");
  m.def("joined", &joined, "whether a group name has a shared-memory segment here");
}
