// LDET_CHECK(cond, message parts...): TORCH_CHECK with its message built by plain string
// appends, never by an iostream.
//
// TORCH_CHECK formats its parts with std::ostringstream. On a GPU image whose compiler and
// libstdc++ runtime differ, the extension's own instantiation of the numeric insertion
// (std::ostream::_M_insert<long>) reached the wrong locale facet and segfaulted, so a bad argument
// crashed the process instead of raising. Integers go through std::to_string, floating-point
// values through snprintf's %g (what an ostream prints by default), and the c10 types through
// their own library's string functions. A message of one std::string passes TORCH_CHECK's
// formatter through untouched.
#pragma once

#include <c10/core/Device.h>
#include <c10/core/Layout.h>
#include <c10/core/ScalarType.h>
#include <c10/util/ArrayRef.h>
#include <c10/util/Exception.h>

#include <cstdint>
#include <cstdio>
#include <string>
#include <type_traits>

namespace ldet {
namespace check_detail {

inline void put(std::string& s, const char* v) { s += v; }
inline void put(std::string& s, const std::string& v) { s += v; }
inline void put(std::string& s, char v) { s += v; }
inline void put(std::string& s, bool v) { s += v ? "true" : "false"; }
inline void put(std::string& s, c10::ScalarType v) { s += c10::toString(v); }
inline void put(std::string& s, const c10::Device& v) { s += v.str(); }
inline void put(std::string& s, c10::Layout v) {
  switch (v) {
    case c10::kStrided: s += "Strided"; return;
    case c10::kSparse: s += "Sparse"; return;
    case c10::kSparseCsr: s += "SparseCsr"; return;
    case c10::kSparseCsc: s += "SparseCsc"; return;
    case c10::kSparseBsr: s += "SparseBsr"; return;
    case c10::kSparseBsc: s += "SparseBsc"; return;
    case c10::kMkldnn: s += "Mkldnn"; return;
    default: s += "layout " + std::to_string(static_cast<int>(v)); return;
  }
}
inline void put(std::string& s, c10::IntArrayRef v) {
  s += '[';
  for (size_t i = 0; i < v.size(); ++i) {
    if (i > 0) s += ", ";
    s += std::to_string(v[i]);
  }
  s += ']';
}
template <typename T, std::enable_if_t<std::is_integral_v<T> && !std::is_same_v<T, bool> && !std::is_same_v<T, char>,
                                       int> = 0>
void put(std::string& s, T v) {
  s += std::to_string(v);
}
template <typename T, std::enable_if_t<std::is_floating_point_v<T>, int> = 0>
void put(std::string& s, T v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g", static_cast<double>(v));
  s += buf;
}

}  // namespace check_detail

// The parts of a check's message, concatenated.
template <typename... Parts>
std::string check_message(const Parts&... parts) {
  std::string s;
  (check_detail::put(s, parts), ...);
  return s;
}

}  // namespace ldet

#define LDET_CHECK(cond, ...) TORCH_CHECK(cond, ::ldet::check_message(__VA_ARGS__))
