// Run-time settings read from the environment. Every one is read here, so that a value the
// launcher cannot use is refused with a ValueError naming the variable rather than read as
// something else (atoi("512MiB") is 512; "false" is not "0"). The settings, their ranges
// and defaults are the README's "Run-time settings" table, which
// tests/robustness/test_settings.py keeps equal to the names csrc/ reads. An unset or empty
// variable takes the default. (The SIMT emulator's own HW_SIM_STACK_KB is read by
// simt/simt_runtime.cpp, which does not depend on c10: simt/README.md.)
#pragma once

#include <c10/util/Exception.h>

#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <string>

namespace hw {

// The integer setting `name`: `fallback` when unset or empty, else its whole value, which
// must be a decimal integer from lo to hi (and a power of two if power_of_two; lo >= 1).
inline int64_t env_int(const char* name, int64_t fallback, int64_t lo,
                       int64_t hi = std::numeric_limits<int64_t>::max(), bool power_of_two = false) {
  TORCH_INTERNAL_ASSERT(!power_of_two || lo >= 1);
  const char* value = std::getenv(name);
  if (value == nullptr || value[0] == '\0') return fallback;
  char* end = nullptr;
  errno = 0;
  const long long v = std::strtoll(value, &end, 10);
  const bool whole = (value[0] == '-' || (value[0] >= '0' && value[0] <= '9')) && *end == '\0' && errno == 0;
  const bool ok = whole && v >= lo && v <= hi && (!power_of_two || (v & (v - 1)) == 0);
  const bool unbounded = hi == std::numeric_limits<int64_t>::max();
  TORCH_CHECK_VALUE(ok, "headwise: ", name, " must be ", power_of_two ? "a power of two" : "an integer",
                    unbounded ? " of at least " : " from ", lo, unbounded ? "" : " to ",
                    unbounded ? std::string() : std::to_string(hi), ", got '", value, "'");
  return v;
}

// The switch `name`: `fallback` when unset or empty, else its value, "0" or "1".
inline bool env_switch(const char* name, bool fallback) {
  const char* value = std::getenv(name);
  if (value == nullptr || value[0] == '\0') return fallback;
  const bool ok = (value[0] == '0' || value[0] == '1') && value[1] == '\0';
  TORCH_CHECK_VALUE(ok, "headwise: ", name, " must be 0 or 1, got '", value, "'");
  return value[0] == '1';
}

}  // namespace hw
