#include "moefold/core/memory.h"

#include <unistd.h>

#include <cstdlib>
#include <cstring>

namespace moefold {

namespace {
constexpr size_t kAlign = 64;
size_t round_up(size_t n) { return (n + kAlign - 1) / kAlign * kAlign; }
}  // namespace

void Arena::Free::operator()(void* p) const { std::free(p); }

void Arena::allocate() {
  MF_CHECK(measuring(), "arena allocated twice");
  capacity_ = offset_;
  void* p = std::aligned_alloc(kAlign, capacity_ ? capacity_ : kAlign);
  MF_CHECK(p != nullptr, "out of host memory allocating ", capacity_, " bytes");
  std::memset(p, 0, capacity_);
  storage_.reset(static_cast<char*>(p));
  base_ = storage_.get();
  offset_ = 0;
}

Tensor Arena::take(DType dtype, Shape shape) {
  size_t bytes = round_up(static_cast<size_t>(shape.numel()) * dtype_size(dtype));
  void* p = nullptr;
  if (!measuring()) {
    MF_CHECK(offset_ + bytes <= capacity_, "arena overflow: ", offset_ + bytes, " > ", capacity_);
    p = base_ + offset_;
  }
  offset_ += bytes;
  return Tensor(p, dtype, shape);
}

void Arena::zero() const {
  if (base_) std::memset(base_, 0, offset_);
}

size_t host_memory_bytes() {
  long pages = ::sysconf(_SC_PHYS_PAGES), page = ::sysconf(_SC_PAGE_SIZE);
  return pages > 0 && page > 0 ? static_cast<size_t>(pages) * static_cast<size_t>(page) : 0;
}

Tensor Memory::param(const std::string& name, Shape shape, Init init, double init_std, bool decay) {
  for (const Param& p : params_) MF_CHECK(p.name != name, "parameter registered twice: ", name);
  Param p;
  p.name = name;
  p.value = params_arena_.take(dtype_, shape);
  p.grad = grads_.take(dtype_, shape);
  p.init = init;
  p.init_std = init_std;
  p.decay = decay;
  p.id = params_.size();
  params_.push_back(p);
  return p.value;
}

Tensor Memory::act(Shape shape) { return acts_.take(dtype_, shape); }
Tensor Memory::act(Shape shape, DType dtype) { return acts_.take(dtype, shape); }

void Memory::allocate() {
  MF_CHECK(measuring(), "Memory::allocate called twice");
  measured_[0] = params_arena_.used();
  measured_[1] = grads_.used();
  measured_[2] = acts_.used();
  params_arena_.allocate();
  grads_.allocate();
  acts_.allocate();
  params_.clear();
}

void Memory::finish_binding() const {
  MF_CHECK(!measuring(), "finish_binding before allocate");
  MF_CHECK(params_arena_.used() == measured_[0] && grads_.used() == measured_[1] && acts_.used() == measured_[2],
           "the real binding pass differs from the measuring pass");
}

const Param* Memory::find(const std::string& name) const {
  for (const Param& p : params_)
    if (p.name == name) return &p;
  return nullptr;
}

Tensor Memory::grad(const std::string& name) const {
  const Param* p = find(name);
  MF_CHECK(p != nullptr, "no parameter named ", name);
  return p->grad;
}

}  // namespace moefold
