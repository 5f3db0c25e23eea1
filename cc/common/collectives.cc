#include "cc/common/collectives.h"

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>

namespace v4 {
namespace {

// Called boxed: the functional collectives' C++ signatures differ between torch versions.
at::Tensor call_and_wait(const char* name, torch::jit::Stack stack) {
  const c10::OperatorHandle collective = c10::Dispatcher::singleton().findSchemaOrThrow(name, "");
  static const c10::OperatorHandle wait = c10::Dispatcher::singleton().findSchemaOrThrow("_c10d_functional::wait_tensor", "");
  collective.callBoxed(&stack);
  wait.callBoxed(&stack);
  return stack.at(0).toTensor();
}

}  // namespace

at::Tensor all_to_all(const at::Tensor& x, const std::vector<int64_t>& out_splits,
                      const std::vector<int64_t>& in_splits, const std::string& group) {
  return call_and_wait("_c10d_functional::all_to_all_single",
                       {x.contiguous(), c10::IValue(out_splits), c10::IValue(in_splits), c10::IValue(group)});
}

at::Tensor all_reduce_sum(const at::Tensor& x, const std::string& group) {
  return call_and_wait("_c10d_functional::all_reduce", {x.contiguous(), c10::IValue("sum"), c10::IValue(group)});
}

}  // namespace v4
