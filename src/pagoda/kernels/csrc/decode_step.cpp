// A decode step's decoder layers in one native call (`DecodeProgram`, a torch custom class).
//
// At a small model's single-stream decode the GEMMs stream the weights in ~1 ms a layer, and the
// eight native calls per layer the Python decode plan makes (norm, qkv, rotary, attention, o,
// norm, gate_up, down) cost as much again in Python: argument parsing, views of the qkv output,
// the dispatch of each op. A DecodeProgram holds every layer's weights and KV cache, bound once
// (pagoda/models/decode_plan.py builds it), and runs the same ops in the same order on the same
// tensors through the dispatcher, so its results equal the Python plan's bit for bit. It calls
// the ops by name (boxed), not their C++ functions: each op's file owns its kernel and schema.

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/ivalue.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include "vec.h"

#include <cstdint>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

namespace {

#define PAGODA_STR_(x) #x
#define PAGODA_STR(x) PAGODA_STR_(x)

c10::OperatorHandle find_op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow((std::string(PAGODA_STR(PAGODA_OPS_NAMESPACE)) + "::" + name).c_str(), "");
}

// One linear: its op and every argument after the activations, bound once.
struct Linear {
  c10::OperatorHandle op;
  std::vector<c10::IValue> args;

  at::Tensor operator()(const at::Tensor& x, torch::jit::Stack& stack) const {
    stack.clear();
    stack.reserve(args.size() + 1);
    stack.emplace_back(x);
    for (const auto& a : args) stack.push_back(a);
    op.callBoxed(stack);
    return std::move(stack.back()).toTensor();
  }
};

struct Layer {
  at::Tensor input_norm, post_norm;
  std::optional<at::Tensor> q_norm, k_norm;  // per-head RMSNorm weights (Qwen3)
  at::Tensor kv_cache;
  double scale;
  int64_t window;  // 0: none
  Linear qkv, o, gate_up, down;
};

class DecodeProgram : public torch::CustomClassHolder {
 public:
  DecodeProgram(int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double eps)
      : heads_(num_heads),
        kv_heads_(num_kv_heads),
        head_dim_(head_dim),
        eps_(eps),
        norm_(find_op("add_rms_norm")),
        rotary_(find_op("rotary_")),
        attend_(find_op("paged_attention")),
        packed_(find_op("packed_linear")),
        quant_(find_op("quant_linear")) {
    TORCH_CHECK(num_heads > 0 && num_kv_heads > 0 && head_dim > 0, "DecodeProgram: head counts must be positive");
  }

  // A bf16/fp32 packed weight (`packed_linear`'s arguments after x).
  void add_packed(at::Tensor data, int64_t n, std::optional<at::Tensor> bias, int64_t epilogue, bool out_fp32) {
    pending_.push_back(Linear{packed_, {data, n, std::move(bias), epilogue, out_fp32}});
  }

  // A quantized weight (`quant_linear`'s arguments after x; bf16 out).
  void add_quant(std::vector<at::Tensor> values, std::vector<at::Tensor> scales, std::vector<int64_t> qtypes,
                 std::vector<int64_t> rows, std::optional<at::Tensor> bias, bool swiglu) {
    pending_.push_back(Linear{quant_,
                              {c10::List<at::Tensor>(values), c10::List<at::Tensor>(scales), c10::List<int64_t>(qtypes),
                               c10::List<int64_t>(rows), std::move(bias), swiglu, false}});
  }

  // The next layer, over the last four linears added: qkv, o, gate_up (SwiGLU fused), down.
  void add_layer(at::Tensor input_norm, at::Tensor post_norm, std::optional<at::Tensor> q_norm,
                 std::optional<at::Tensor> k_norm, at::Tensor kv_cache, double scale, int64_t window) {
    TORCH_CHECK(pending_.size() == 4, "DecodeProgram.add_layer: add its four linears first (got ", pending_.size(),
                ")");
    TORCH_CHECK(q_norm.has_value() == k_norm.has_value(), "DecodeProgram.add_layer: q_norm and k_norm go together");
    layers_.push_back(Layer{std::move(input_norm), std::move(post_norm), std::move(q_norm), std::move(k_norm),
                            std::move(kv_cache), scale, window, pending_[0], pending_[1], pending_[2], pending_[3]});
    pending_.clear();
  }

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

  // The layers on the embedded tokens `hidden` [T, H] -> (last mlp output, residual), as
  // DecoderLayer.forward computes them layer after layer.
  std::tuple<at::Tensor, at::Tensor> run(at::Tensor hidden, at::Tensor cos, at::Tensor sin, at::Tensor block_tables,
                                         at::Tensor seq_lens, at::Tensor query_start_loc, at::Tensor slot_mapping) {
    TORCH_CHECK(!layers_.empty(), "DecodeProgram.run: no layers");
    const int64_t T = hidden.size(0);
    const int64_t q_end = heads_ * head_dim_, k_end = q_end + kv_heads_ * head_dim_;
    torch::jit::Stack stack;
    at::Tensor residual;
    for (const Layer& layer : layers_) {
      if (!residual.defined()) {
        residual = hidden;
        hidden = norm(hidden, std::nullopt, layer.input_norm, stack).first;
      } else {
        std::tie(hidden, residual) = norm(hidden, residual, layer.input_norm, stack);
      }
      const at::Tensor qkv = layer.qkv(hidden, stack);
      at::Tensor q, k;
      if (!layer.q_norm.has_value()) {
        at::Tensor qk = qkv.slice(1, 0, k_end).view({T, heads_ + kv_heads_, head_dim_});
        rotate(qk, cos, sin, stack);
        q = qk.slice(1, 0, heads_);
        k = qk.slice(1, heads_);
      } else {
        q = norm(qkv.slice(1, 0, q_end).reshape({T * heads_, head_dim_}), std::nullopt, *layer.q_norm, stack).first;
        k = norm(qkv.slice(1, q_end, k_end).reshape({T * kv_heads_, head_dim_}), std::nullopt, *layer.k_norm, stack)
                .first;
        q = q.view({T, heads_, head_dim_});
        k = k.view({T, kv_heads_, head_dim_});
        rotate(q, cos, sin, stack);
        rotate(k, cos, sin, stack);
      }
      const at::Tensor v = qkv.slice(1, k_end).view({T, kv_heads_, head_dim_});
      stack.clear();
      stack.reserve(10);
      for (c10::IValue a : {c10::IValue(q), c10::IValue(layer.kv_cache), c10::IValue(block_tables),
                            c10::IValue(seq_lens), c10::IValue(query_start_loc), c10::IValue(layer.scale),
                            c10::IValue(layer.window), c10::IValue(k), c10::IValue(v), c10::IValue(slot_mapping)})
        stack.push_back(std::move(a));
      attend_.callBoxed(stack);
      const at::Tensor out = std::move(stack.back()).toTensor();
      hidden = layer.o(out.view({T, q_end}), stack);
      std::tie(hidden, residual) = norm(hidden, residual, layer.post_norm, stack);
      hidden = layer.down(layer.gate_up(hidden, stack), stack);
    }
    return {hidden, residual};
  }

 private:
  std::pair<at::Tensor, at::Tensor> norm(const at::Tensor& x, const std::optional<at::Tensor>& residual,
                                         const at::Tensor& weight, torch::jit::Stack& stack) const {
    stack.clear();
    stack.emplace_back(x);
    stack.emplace_back(residual);
    stack.emplace_back(weight);
    stack.emplace_back(eps_);
    norm_.callBoxed(stack);
    at::Tensor summed = std::move(stack[1]).toTensor();
    at::Tensor out = std::move(stack[0]).toTensor();
    return {out, summed};
  }

  void rotate(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, torch::jit::Stack& stack) const {
    stack.clear();
    stack.emplace_back(x);
    stack.emplace_back(cos);
    stack.emplace_back(sin);
    rotary_.callBoxed(stack);
  }

  int64_t heads_, kv_heads_, head_dim_;
  double eps_;
  c10::OperatorHandle norm_, rotary_, attend_, packed_, quant_;
  std::vector<Linear> pending_;
  std::vector<Layer> layers_;
};

}  // namespace

PAGODA_LIBRARY_FRAGMENT(m) {
  m.class_<DecodeProgram>("DecodeProgram")
      .def(torch::init<int64_t, int64_t, int64_t, double>())
      .def("add_packed", &DecodeProgram::add_packed)
      .def("add_quant", &DecodeProgram::add_quant)
      .def("add_layer", &DecodeProgram::add_layer)
      .def("num_layers", &DecodeProgram::num_layers)
      .def("run", &DecodeProgram::run);
}
