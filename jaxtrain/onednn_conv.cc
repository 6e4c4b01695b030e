// 2-D float32 convolutions for XLA:CPU through oneDNN (model.conv_impl='onednn').
//
// Three XLA FFI handlers, the forward pass and its two gradients, for NHWC activations and
// HWIO kernels (Flax's layouts), so XLA passes its buffers as they are and no layout copy
// is needed around them. oneDNN picks its own blocked layout for the (small) kernel; the
// kernel is reordered into it on each call, as PyTorch's oneDNN path does. Primitives are
// built once per shape and kept; each call brings its own scratch memory, so XLA may run
// two of them at once. jaxtrain/onednn.py compiles this file and wires it into jax.
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>

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

// Runs `plan` with the activations in `args` and the kernel at `weights` (the argument
// `weights_arg`), reordering the kernel into or out of the primitive's layout.
ffi::Error Run(const Plan& plan, std::unordered_map<int, memory> args, int weights_arg,
               void* weights, bool weights_in) {
  auto& engine = Engine();
  dnnl::stream stream(engine);
  memory plain(plan.weights_plain, engine, weights);
  memory inner = plan.reorder ? memory(plan.weights_inner, engine) : plain;
  if (plan.reorder && weights_in) plan.weights_reorder.execute(stream, plain, inner);
  args[weights_arg] = inner;
  memory scratch(plan.scratchpad, engine);
  args[DNNL_ARG_SCRATCHPAD] = scratch;
  plan.primitive.execute(stream, args);
  if (plan.reorder && !weights_in) plan.weights_reorder.execute(stream, inner, plain);
  stream.wait();
  return ffi::Error::Success();
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

ffi::Error ForwardImpl(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                       ffi::ResultBuffer<ffi::F32> y, ffi::Span<const int64_t> strides,
                       ffi::Span<const int64_t> dilation, ffi::Span<const int64_t> padding) {
  return Guarded([&] {
    auto g = MakeGeometry(x.dimensions(), w.dimensions(), y->dimensions(), strides, dilation,
                          padding);
    auto plan = Cached(g.Key("fwd"), [&] {
      auto desc = ForwardDesc(g);
      return MakePlan<dnnl::convolution_forward>(desc, desc.weights_desc(), g, true);
    });
    auto& engine = Engine();
    return Run(*plan,
               {{DNNL_ARG_SRC, memory(Nhwc(g.src), engine, x.typed_data())},
                {DNNL_ARG_DST, memory(Nhwc(g.dst), engine, y->typed_data())}},
               DNNL_ARG_WEIGHTS, w.typed_data(), true);
  });
}

ffi::Error InputGradImpl(ffi::Buffer<ffi::F32> dy, ffi::Buffer<ffi::F32> w,
                         ffi::ResultBuffer<ffi::F32> dx, ffi::Span<const int64_t> strides,
                         ffi::Span<const int64_t> dilation, ffi::Span<const int64_t> padding) {
  return Guarded([&] {
    auto g = MakeGeometry(dx->dimensions(), w.dimensions(), dy.dimensions(), strides, dilation,
                          padding);
    auto plan = Cached(g.Key("bwd_data"), [&] {
      auto desc = dnnl::convolution_backward_data::primitive_desc(
          Engine(), dnnl::algorithm::convolution_direct, Nhwc(g.src), Any(g.weights),
          Nhwc(g.dst), g.strides, g.dilates, g.padding_l, g.padding_r, ForwardDesc(g),
          UserScratchpad());
      return MakePlan<dnnl::convolution_backward_data>(desc, desc.weights_desc(), g, true);
    });
    auto& engine = Engine();
    return Run(*plan,
               {{DNNL_ARG_DIFF_DST, memory(Nhwc(g.dst), engine, dy.typed_data())},
                {DNNL_ARG_DIFF_SRC, memory(Nhwc(g.src), engine, dx->typed_data())}},
               DNNL_ARG_WEIGHTS, w.typed_data(), true);
  });
}

ffi::Error KernelGradImpl(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> dy,
                          ffi::ResultBuffer<ffi::F32> dw, ffi::Span<const int64_t> strides,
                          ffi::Span<const int64_t> dilation, ffi::Span<const int64_t> padding) {
  return Guarded([&] {
    auto g = MakeGeometry(x.dimensions(), dw->dimensions(), dy.dimensions(), strides, dilation,
                          padding);
    auto plan = Cached(g.Key("bwd_weights"), [&] {
      auto desc = dnnl::convolution_backward_weights::primitive_desc(
          Engine(), dnnl::algorithm::convolution_direct, Nhwc(g.src), Any(g.weights),
          Nhwc(g.dst), g.strides, g.dilates, g.padding_l, g.padding_r, ForwardDesc(g),
          UserScratchpad());
      return MakePlan<dnnl::convolution_backward_weights>(desc, desc.diff_weights_desc(), g,
                                                           false);
    });
    auto& engine = Engine();
    return Run(*plan,
               {{DNNL_ARG_SRC, memory(Nhwc(g.src), engine, x.typed_data())},
                {DNNL_ARG_DIFF_DST, memory(Nhwc(g.dst), engine, dy.typed_data())}},
               DNNL_ARG_DIFF_WEIGHTS, dw->typed_data(), false);
  });
}

}  // namespace

#define JAXTRAIN_CONV_HANDLER(name, impl)                         \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(name, impl,                       \
                                ffi::Ffi::Bind()                  \
                                    .Arg<ffi::Buffer<ffi::F32>>() \
                                    .Arg<ffi::Buffer<ffi::F32>>() \
                                    .Ret<ffi::Buffer<ffi::F32>>() \
                                    .Attr<ffi::Span<const int64_t>>("strides") \
                                    .Attr<ffi::Span<const int64_t>>("dilation") \
                                    .Attr<ffi::Span<const int64_t>>("padding"));

JAXTRAIN_CONV_HANDLER(JaxtrainConvForward, ForwardImpl)
JAXTRAIN_CONV_HANDLER(JaxtrainConvInputGrad, InputGradImpl)
JAXTRAIN_CONV_HANDLER(JaxtrainConvKernelGrad, KernelGradImpl)
