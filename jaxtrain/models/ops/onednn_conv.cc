// 2-D float32 convolutions for XLA:CPU through oneDNN (model.conv_impl='onednn').
//
// Three XLA FFI handlers, the forward pass and its two gradients, for NHWC activations and
// HWIO kernels (Flax's layouts), so XLA passes its buffers as they are and no layout copy
// is needed around them. oneDNN picks its own blocked layout for the (small) kernel; the
// kernel is reordered into it on each call, as PyTorch's oneDNN path does. Primitives are
// built once per shape and kept. A call is split by batch slices over XLA's intra-op
// threads, oneDNN running sequentially in each (ParallelFor); scratch memory is per
// thread, so XLA may run two calls at once. jaxtrain/models/ops/onednn.py compiles this file and
// wires it into jax.
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <new>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "oneapi/dnnl/dnnl.hpp"
#include "xla/ffi/api/ffi.h"

#if DNNL_VERSION_MAJOR < 3
#error "jaxtrain's oneDNN convolutions need oneDNN 3 (pip install onednn-devel-cpu-gomp)"
#endif

namespace ffi = xla::ffi;
using dnnl::memory;

namespace {

using Tag = memory::format_tag;
constexpr auto kF32 = memory::data_type::f32;

dnnl::engine& Engine() {
  static dnnl::engine engine(dnnl::engine::kind::cpu, 0);
  return engine;
}

// One convolution's geometry, in oneDNN's terms (logical dims are N, C, H, W and O, I, H, W).
struct Geometry {
  memory::dims src, weights, dst, strides, dilates, padding_l, padding_r;

  std::string Key(const char* kind) const {
    std::string key(kind);
    for (const auto* dims : {&src, &weights, &dst, &strides, &dilates, &padding_l, &padding_r}) {
      key += '|';
      for (auto d : *dims) key += std::to_string(d) + ',';
    }
    return key;
  }
};

// src (N, H, W, C) and weights (KH, KW, I, O) as XLA holds them; the rest from attributes.
Geometry MakeGeometry(ffi::Span<const int64_t> src, ffi::Span<const int64_t> weights,
                      ffi::Span<const int64_t> dst, ffi::Span<const int64_t> strides,
                      ffi::Span<const int64_t> dilation, ffi::Span<const int64_t> padding) {
  Geometry g;
  g.src = {src[0], src[3], src[1], src[2]};
  g.weights = {weights[3], weights[2], weights[0], weights[1]};
  g.dst = {dst[0], dst[3], dst[1], dst[2]};
  g.strides = {strides[0], strides[1]};
  g.dilates = {dilation[0] - 1, dilation[1] - 1};  // oneDNN counts the gaps
  g.padding_l = {padding[0], padding[2]};
  g.padding_r = {padding[1], padding[3]};
  return g;
}

memory::desc Nhwc(const memory::dims& dims) { return memory::desc(dims, kF32, Tag::nhwc); }
memory::desc Hwio(const memory::dims& dims) { return memory::desc(dims, kF32, Tag::hwio); }
memory::desc Any(const memory::dims& dims) { return memory::desc(dims, kF32, Tag::any); }

dnnl::primitive_attr UserScratchpad() {
  dnnl::primitive_attr attr;
  attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
  return attr;
}

dnnl::convolution_forward::primitive_desc ForwardDesc(const Geometry& g) {
  return dnnl::convolution_forward::primitive_desc(
      Engine(), dnnl::prop_kind::forward_training, dnnl::algorithm::convolution_direct,
      Nhwc(g.src), Any(g.weights), Nhwc(g.dst), g.strides, g.dilates, g.padding_l, g.padding_r,
      UserScratchpad());
}

// A built primitive, and the reorder between the kernel as XLA holds it (HWIO) and as the
// primitive wants it (none when they agree).
struct Plan {
  dnnl::primitive primitive;
  memory::desc scratchpad;
  memory::desc weights_plain, weights_inner;
  bool reorder = false;
  dnnl::reorder weights_reorder;
};

template <typename Build>
std::shared_ptr<const Plan> Cached(const std::string& key, Build build) {
  static std::mutex mutex;
  static std::unordered_map<std::string, std::shared_ptr<const Plan>> plans;
  {
    std::lock_guard<std::mutex> lock(mutex);
    auto found = plans.find(key);
    if (found != plans.end()) return found->second;
  }
  auto plan = std::make_shared<const Plan>(build());
  std::lock_guard<std::mutex> lock(mutex);
  return plans.emplace(key, plan).first->second;
}

// `to_inner`: the kernel goes into the primitive (forward, input gradient); otherwise the
// primitive writes it (weight gradient) and it comes out in XLA's layout.
template <typename Primitive, typename Desc>
Plan MakePlan(const Desc& desc, const memory::desc& inner, const Geometry& g, bool to_inner) {
  Plan plan;
  plan.primitive = Primitive(desc);
  plan.scratchpad = desc.scratchpad_desc();
  plan.weights_plain = Hwio(g.weights);
  plan.weights_inner = inner;
  plan.reorder = inner != plan.weights_plain;
  if (plan.reorder) {
    plan.weights_reorder =
        to_inner ? dnnl::reorder(memory(plan.weights_plain, Engine()), memory(inner, Engine()))
                 : dnnl::reorder(memory(inner, Engine()), memory(plan.weights_plain, Engine()));
  }
  return plan;
}

// Memory a thread reuses from call to call (XLA runs one custom call at a time on each
// of its threads): no allocation, and no fresh pages to fault in, per convolution.
class Arena {
 public:
  void* Get(size_t bytes) {
    bytes = bytes < 64 ? 64 : bytes;  // a real pointer also for an empty scratchpad
    if (bytes > size_) {
      std::free(data_);
      data_ = std::aligned_alloc(64, (bytes + 63) / 64 * 64);
      size_ = data_ == nullptr ? 0 : bytes;
      if (data_ == nullptr) throw std::bad_alloc();
    }
    return data_;
  }
  ~Arena() { std::free(data_); }

 private:
  void* data_ = nullptr;
  size_t size_ = 0;
};

// Runs `plan` with the activations in `args` and the kernel at `weights` (the argument
// `weights_arg`), reordering the kernel into or out of the primitive's layout.
void Run(const Plan& plan, std::unordered_map<int, memory> args, int weights_arg,
         void* weights, bool weights_in) {
  thread_local Arena scratch_arena, weights_arena;
  auto& engine = Engine();
  dnnl::stream stream(engine);
  memory plain(plan.weights_plain, engine, weights);
  memory inner = plan.reorder ? memory(plan.weights_inner, engine,
                                       weights_arena.Get(plan.weights_inner.get_size()))
                              : plain;
  if (plan.reorder && weights_in) plan.weights_reorder.execute(stream, plain, inner);
  args[weights_arg] = inner;
  memory scratch(plan.scratchpad, engine, scratch_arena.Get(plan.scratchpad.get_size()));
  args[DNNL_ARG_SCRATCHPAD] = scratch;
  plan.primitive.execute(stream, args);
  if (plan.reorder && !weights_in) plan.weights_reorder.execute(stream, inner, plain);
  stream.wait();
}

template <typename F>
ffi::Error Guarded(F body) {
  try {
    return body();
  } catch (const dnnl::error& e) {
    return ffi::Error(ffi::ErrorCode::kInternal, std::string("oneDNN: ") + e.what());
  } catch (const std::exception& e) {
    return ffi::Error(ffi::ErrorCode::kInternal, e.what());
  }
}

// Runs work(0) ... work(parts - 1), spread over XLA's own intra-op threads: the calling
// thread and parts - 1 tasks scheduled on the pool claim parts from a counter, so the
// caller only ever waits for parts another thread has already started (never for a task
// still queued behind it: no deadlock when every pool thread is inside a custom call).
// oneDNN runs sequentially inside each part, so no second thread pool (OpenMP's) competes
// with XLA's for the cores.
void ParallelFor(ffi::ThreadPool& pool, int parts, std::function<void(int)> work) {
  struct State {
    std::function<void(int)> work;
    int parts;
    std::atomic<int> next{0}, finished{0};
    std::mutex mutex;
    std::condition_variable done;
    std::exception_ptr error;
  };
  auto state = std::make_shared<State>();
  state->work = std::move(work);
  state->parts = parts;
  auto drain = [](State& s) {
    omp_set_num_threads(1);  // this thread's oneDNN calls run sequentially
    for (int i; (i = s.next.fetch_add(1)) < s.parts;) {
      try {
        s.work(i);
      } catch (...) {
        std::lock_guard<std::mutex> lock(s.mutex);
        if (!s.error) s.error = std::current_exception();
      }
      if (s.finished.fetch_add(1) + 1 == s.parts) {
        std::lock_guard<std::mutex> lock(s.mutex);
        s.done.notify_all();
      }
    }
  };
  for (int i = 1; i < parts; ++i) pool.Schedule([state, drain] { drain(*state); });
  drain(*state);
  std::unique_lock<std::mutex> lock(state->mutex);
  state->done.wait(lock, [&] { return state->finished.load() == state->parts; });
  if (state->error) std::rethrow_exception(state->error);
}

// How many batch slices a convolution of `macs` multiply-adds is split into: one per pool
// thread, but none smaller than kMinSliceMacs (below that, waking a thread costs more than
// it saves).
constexpr double kMinSliceMacs = 4e6;

int Slices(ffi::ThreadPool& pool, const Geometry& g) {
  double macs = 1.0;
  for (auto d : g.dst) macs *= d;
  macs *= g.weights[1] * g.weights[2] * g.weights[3];
  int64_t by_size = static_cast<int64_t>(macs / kMinSliceMacs);
  int64_t slices = std::min<int64_t>({pool.num_threads(), g.src[0], by_size});
  return static_cast<int>(std::max<int64_t>(slices, 1));
}

// Images [begin, end) of slice `i` of `slices` over a batch of n.
std::pair<int64_t, int64_t> SliceRange(int64_t n, int i, int slices) {
  return {n * i / slices, n * (i + 1) / slices};
}

Geometry WithBatch(Geometry g, int64_t n) {
  g.src[0] = g.dst[0] = n;
  return g;
}

// Elements per image of an NHWC tensor with oneDNN dims (N, C, H, W).
int64_t PerImage(const memory::dims& dims) { return dims[1] * dims[2] * dims[3]; }

std::shared_ptr<const Plan> ForwardPlan(const Geometry& g) {
  return Cached(g.Key("fwd"), [&] {
    auto desc = ForwardDesc(g);
    return MakePlan<dnnl::convolution_forward>(desc, desc.weights_desc(), g, true);
  });
}

std::shared_ptr<const Plan> InputGradPlan(const Geometry& g) {
  return Cached(g.Key("bwd_data"), [&] {
    auto desc = dnnl::convolution_backward_data::primitive_desc(
        Engine(), dnnl::algorithm::convolution_direct, Nhwc(g.src), Any(g.weights),
        Nhwc(g.dst), g.strides, g.dilates, g.padding_l, g.padding_r, ForwardDesc(g),
        UserScratchpad());
    return MakePlan<dnnl::convolution_backward_data>(desc, desc.weights_desc(), g, true);
  });
}

std::shared_ptr<const Plan> KernelGradPlan(const Geometry& g) {
  return Cached(g.Key("bwd_weights"), [&] {
    auto desc = dnnl::convolution_backward_weights::primitive_desc(
        Engine(), dnnl::algorithm::convolution_direct, Nhwc(g.src), Any(g.weights),
        Nhwc(g.dst), g.strides, g.dilates, g.padding_l, g.padding_r, ForwardDesc(g),
        UserScratchpad());
    return MakePlan<dnnl::convolution_backward_weights>(desc, desc.diff_weights_desc(), g,
                                                         false);
  });
}

// The forward pass (x -> y) and the input gradient (dy -> dx) have one shape: the kernel
// goes in, one activation goes in and another comes out, each batch slice on a thread.
// `forward` says which: the activation going in is the source (x) or the gradient (dy).
ffi::Error SlicedWithKernelIn(ffi::ThreadPool& pool, const Geometry& g, bool forward,
                              const float* in, float* out, float* kernel) {
  int slices = Slices(pool, g);
  ParallelFor(pool, slices, [&](int i) {
    auto [begin, end] = SliceRange(g.src[0], i, slices);
    auto part = WithBatch(g, end - begin);
    const auto& in_dims = forward ? part.src : part.dst;
    const auto& out_dims = forward ? part.dst : part.src;
    auto& engine = Engine();
    Run(*(forward ? ForwardPlan(part) : InputGradPlan(part)),
        {{forward ? DNNL_ARG_SRC : DNNL_ARG_DIFF_DST,
          memory(Nhwc(in_dims), engine, const_cast<float*>(in) + begin * PerImage(in_dims))},
         {forward ? DNNL_ARG_DST : DNNL_ARG_DIFF_SRC,
          memory(Nhwc(out_dims), engine, out + begin * PerImage(out_dims))}},
        DNNL_ARG_WEIGHTS, kernel, true);
  });
  return ffi::Error::Success();
}

ffi::Error ForwardImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                       ffi::ResultBuffer<ffi::F32> y, ffi::Span<const int64_t> strides,
                       ffi::Span<const int64_t> dilation, ffi::Span<const int64_t> padding) {
  return Guarded([&] {
    auto g = MakeGeometry(x.dimensions(), w.dimensions(), y->dimensions(), strides, dilation,
                          padding);
    return SlicedWithKernelIn(pool, g, true, x.typed_data(), y->typed_data(), w.typed_data());
  });
}

ffi::Error InputGradImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> dy,
                         ffi::Buffer<ffi::F32> w, ffi::ResultBuffer<ffi::F32> dx,
                         ffi::Span<const int64_t> strides, ffi::Span<const int64_t> dilation,
                         ffi::Span<const int64_t> padding) {
  return Guarded([&] {
    auto g = MakeGeometry(dx->dimensions(), w.dimensions(), dy.dimensions(), strides, dilation,
                          padding);
    return SlicedWithKernelIn(pool, g, false, dy.typed_data(), dx->typed_data(),
                              w.typed_data());
  });
}

// Each slice's kernel gradient goes to its own buffer (slice 0: the result itself), and
// the slices' sums are added in slice order: the same result whichever thread ran which.
ffi::Error KernelGradImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                          ffi::Buffer<ffi::F32> dy, ffi::ResultBuffer<ffi::F32> dw,
                          ffi::Span<const int64_t> strides, ffi::Span<const int64_t> dilation,
                          ffi::Span<const int64_t> padding) {
  return Guarded([&] {
    auto g = MakeGeometry(x.dimensions(), dw->dimensions(), dy.dimensions(), strides, dilation,
                          padding);
    int slices = Slices(pool, g);
    const int64_t kernel_size = dw->element_count();
    std::vector<float> partial((slices - 1) * kernel_size);
    ParallelFor(pool, slices, [&](int i) {
      auto [begin, end] = SliceRange(g.src[0], i, slices);
      auto part = WithBatch(g, end - begin);
      auto& engine = Engine();
      float* out = i == 0 ? dw->typed_data() : partial.data() + (i - 1) * kernel_size;
      Run(*KernelGradPlan(part),
          {{DNNL_ARG_SRC, memory(Nhwc(part.src), engine,
                                 x.typed_data() + begin * PerImage(g.src))},
           {DNNL_ARG_DIFF_DST, memory(Nhwc(part.dst), engine,
                                      dy.typed_data() + begin * PerImage(g.dst))}},
          DNNL_ARG_DIFF_WEIGHTS, out, false);
    });
    float* total = dw->typed_data();
    for (int i = 1; i < slices; ++i) {
      const float* add = partial.data() + (i - 1) * kernel_size;
      for (int64_t j = 0; j < kernel_size; ++j) total[j] += add[j];
    }
    return ffi::Error::Success();
  });
}

}  // namespace

#define JAXTRAIN_CONV_HANDLER(name, impl)                         \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(name, impl,                       \
                                ffi::Ffi::Bind()                  \
                                    .Ctx<ffi::ThreadPool>()       \
                                    .Arg<ffi::Buffer<ffi::F32>>() \
                                    .Arg<ffi::Buffer<ffi::F32>>() \
                                    .Ret<ffi::Buffer<ffi::F32>>() \
                                    .Attr<ffi::Span<const int64_t>>("strides") \
                                    .Attr<ffi::Span<const int64_t>>("dilation") \
                                    .Attr<ffi::Span<const int64_t>>("padding"));

JAXTRAIN_CONV_HANDLER(JaxtrainConvForward, ForwardImpl)
JAXTRAIN_CONV_HANDLER(JaxtrainConvInputGrad, InputGradImpl)
JAXTRAIN_CONV_HANDLER(JaxtrainConvKernelGrad, KernelGradImpl)
