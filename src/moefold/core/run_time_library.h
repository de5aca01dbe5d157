// A library loaded at run time (dlopen) rather than linked, so that a machine without it only
// loses the report that needs it (libcupti: gpu_activity.h; libnvidia-ml: gpu_clocks.h): the first
// of its file names that loads, then its functions by name; `error` says what was missing.
#pragma once

#include <dlfcn.h>

#include <initializer_list>
#include <string>

namespace moefold {

class RunTimeLibrary {
 public:
  // `what` names it in the errors (e.g. "libcupti").
  RunTimeLibrary(std::initializer_list<const char*> file_names, const char* what) : what_(what) {
    for (const char* name : file_names)
      if ((lib_ = dlopen(name, RTLD_NOW | RTLD_LOCAL)) != nullptr) return;
    error = what_ + " not found (" + dlerror() + ")";
  }
  // fn = the function `symbol` (null, and the first such miss in `error`, when it is not there).
  template <class Fn>
  void get(Fn& fn, const char* symbol) {
    fn = lib_ ? reinterpret_cast<Fn>(dlsym(lib_, symbol)) : nullptr;
    if (fn == nullptr && error.empty()) error = what_ + " has no " + symbol;
  }
  std::string error;  // empty: loaded, and every function asked for found

 private:
  std::string what_;
  void* lib_ = nullptr;
};

}  // namespace moefold
