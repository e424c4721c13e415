// A run-time count as a compile-time one: the register-blocked kernels have one instance per row (or head) count,
// whose accumulators stay in registers only when the count is a constant.
#pragma once

#include <type_traits>
#include <utility>

namespace fxc {

// f(std::integral_constant<int, c>) for the run-time count c in 1 .. N (nothing for other c).
template <int N, class F>
inline void with_count(int c, F&& f) {
  if constexpr (N >= 1) {
    if (c == N) {
      f(std::integral_constant<int, N>{});
      return;
    }
    with_count<N - 1>(c, std::forward<F>(f));
  }
}

}  // namespace fxc
