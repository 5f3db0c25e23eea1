// Device implementations of an op's kernels, chosen by the device of its tensors. A kernel file
// (cc/ops/<op>.cu) registers its implementation once, when its module loads; the op's ATen code
// asks for the implementation of its tensors' device and computes itself where none is registered
// (the CPU, a build without the kernel) or where the kernel declines the inputs (returns false).
// Adding a kernel is one registration; the op's code has no #ifdef.
#pragma once

#include <ATen/ATen.h>
#include <ATen/core/Tensor.h>
#include <c10/core/DeviceType.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstdlib>
#include <initializer_list>
#include <string>
#include <string_view>
#include <vector>

namespace v4 {

// Kernel: a struct naming one kernel of an op, with `using Fn = bool (*)(...)`: the function
// returns false where it does not cover the inputs.
template <typename Kernel>
class Backend {
 public:
  using Fn = typename Kernel::Fn;

  // The implementation for `device`, or nullptr.
  static Fn find(c10::DeviceType device) {
    const auto i = static_cast<size_t>(device);
    return i < kSlots ? slots()[i] : nullptr;
  }

  // static const v4::Backend<K>::Register registered(c10::DeviceType::CUDA, &fn);  in the kernel file.
  struct Register {
    Register(c10::DeviceType device, Fn fn) { slots().at(static_cast<size_t>(device)) = fn; }
  };

 private:
  static constexpr size_t kSlots = static_cast<size_t>(c10::DeviceType::COMPILE_TIME_MAX_DEVICE_TYPES);
  static std::array<Fn, kSlots>& slots() {
    static std::array<Fn, kSlots> fns{};
    return fns;
  }
};

// The words of the comma list in environment variable `name` (unset or empty: none): the kernels'
// switches, read at each call so that one process can time each choice.
inline std::vector<std::string> env_words(const char* name) {
  std::vector<std::string> words;
  const char* value = std::getenv(name);
  for (std::string_view rest = value == nullptr ? "" : value; !rest.empty();) {
    const size_t end = std::min(rest.find(','), rest.size());
    words.emplace_back(rest.substr(0, end));
    rest.remove_prefix(std::min(end + 1, rest.size()));
  }
  return words;
}

// A kernel's variants named in environment variable `name` (env_words): names[i] sets bit i, `none`
// none; unset or empty, `unset`; another word is a ValueError naming the variable, the word and the names.
inline unsigned env_variants(const char* name, std::initializer_list<std::string_view> names, unsigned unset = 0) {
  const std::vector<std::string> words = env_words(name);
  if (words.empty()) return unset;
  unsigned mask = 0;
  for (const std::string& word : words) {
    unsigned bit = 0;
    for (size_t i = 0; i < names.size(); ++i)
      if (word == names.begin()[i]) bit = 1u << i;
    if (bit == 0 && word != "none") {
      std::string expected;  // "a, b and c"
      for (size_t i = 0; i < names.size(); ++i) {
        expected += i == 0 ? "" : i + 1 < names.size() ? ", " : " and ";
        expected += names.begin()[i];
      }
      TORCH_CHECK_VALUE(false, name, "=", std::getenv(name), ": unknown variant '", word,
                        "'; expected a comma list of ", expected, ", or none");
    }
    mask |= bit;
  }
  return mask;
}

// t contiguous with its data 16-byte aligned (for kernels that read 16 bytes at a time): t itself
// where it is, else a fresh copy (a new allocation starts aligned; a view may not).
inline at::Tensor dense16(const at::Tensor& t) {
  const at::Tensor c = t.contiguous();
  return reinterpret_cast<uintptr_t>(c.const_data_ptr()) % 16 == 0 ? c : c.clone();
}

// Host values on `device` without waiting for it: a blocking copy to a GPU from pageable memory
// synchronises the stream (copy_ with non_blocking false), so at each call the GPU would drain and
// then idle while the host caught up. Through pinned memory the copy is queued on the stream (the
// caching host allocator keeps the buffer until it lands).
inline at::Tensor upload(const at::Tensor& host, c10::Device device) {
  if (host.device() == device || !device.is_cuda() || !host.is_cpu()) return host.to(device).contiguous();
  return host.contiguous().pin_memory().to(device, host.scalar_type(), /*non_blocking=*/true);
}
inline at::Tensor upload(const std::vector<int64_t>& values, c10::Device device) {
  const auto longs = at::TensorOptions().dtype(at::kLong);
  if (!device.is_cuda()) return at::tensor(values, longs.device(device));
  at::Tensor host = at::empty({static_cast<int64_t>(values.size())}, longs.pinned_memory(true));
  std::copy(values.begin(), values.end(), host.data_ptr<int64_t>());
  return host.to(device, at::kLong, /*non_blocking=*/true);
}

}  // namespace v4
