#include "moefold/core/memory.h"

#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <numeric>

#include "moefold/core/device.h"
#include "moefold/core/rng.h"

namespace moefold {

namespace {
constexpr size_t kAlign = 64;
size_t round_up(size_t n) { return (n + kAlign - 1) / kAlign * kAlign; }
}  // namespace

void Arena::Free::operator()(void* p) const {
  if (device == Device::cuda)
    device_free(p);
  else if (pinned)
    pinned_host_free(p);
  else
    std::free(p);
}

void Arena::allocate() {
  MF_CHECK(measuring(), "arena allocated twice");
  capacity_ = offset_;
  void* p = nullptr;
  if (device_ == Device::cuda) {
    p = device_malloc(capacity_ ? capacity_ : kAlign);
    device_zero(p, capacity_, stream_);
  } else {
    // aligned_alloc wants a multiple of the alignment (a block reserved to an odd byte count).
    p = pinned_ ? pinned_host_malloc(capacity_) : std::aligned_alloc(kAlign, capacity_ ? round_up(capacity_) : kAlign);
    MF_CHECK(p != nullptr, "out of host memory allocating ", capacity_, " bytes");
    std::memset(p, 0, capacity_);
  }
  storage_ = std::unique_ptr<char, Free>(static_cast<char*>(p), Free{device_, pinned_ && device_ == Device::cpu});
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
  return Tensor(p, dtype, shape, device_);
}

Tensor Arena::take_at(DType dtype, Shape shape, size_t at) {
  MF_CHECK(at >= offset_ && at % dtype_size(dtype) == 0, "Arena::take_at ", at, " below ", offset_, " or misaligned");
  const size_t bytes = static_cast<size_t>(shape.numel()) * dtype_size(dtype);
  void* p = nullptr;
  if (!measuring()) {
    MF_CHECK(at + bytes <= capacity_, "arena overflow: ", at + bytes, " > ", capacity_);
    p = base_ + at;
  }
  offset_ = at + bytes;
  return Tensor(p, dtype, shape, device_);
}

void Arena::pad_to(size_t multiple) { offset_ = (offset_ + multiple - 1) / multiple * multiple; }

void Arena::reserve_to(size_t bytes) { offset_ = std::max(offset_, bytes); }

void Arena::zero() const {
  if (!base_) return;
  if (device_ == Device::cuda)
    device_zero(base_, offset_, stream_);
  else
    std::memset(base_, 0, offset_);
}

void OverlayPool::begin(size_t slot) {
  if (slot >= size_.size()) {
    MF_CHECK(measuring(), "overlay slot ", slot, " was not measured");
    size_.resize(slot + 1, 0);
  }
  slot_ = slot;
  offset_ = 0;
}

Tensor OverlayPool::take(DType dtype, Shape shape) {
  MF_CHECK(slot_ < size_.size(), "OverlayPool::take before begin");
  const size_t bytes = round_up(static_cast<size_t>(shape.numel()) * dtype_size(dtype));
  void* p = nullptr;
  if (!measuring()) {
    MF_CHECK(offset_ + bytes <= size_[slot_], "overlay slot ", slot_, " overflow: ", offset_ + bytes, " > ",
             size_[slot_]);
    p = static_cast<char*>(arena_.base()) + base_[slot_] + offset_;
  }
  offset_ += bytes;
  std::vector<size_t>& most = measuring() ? size_ : real_;
  most[slot_] = std::max(most[slot_], offset_);
  return Tensor(p, dtype, shape, arena_.device());
}

void OverlayPool::allocate() {
  base_.assign(size_.size(), 0);
  size_t total = 0;
  for (size_t i = 0; i < size_.size(); ++i) {
    base_[i] = total;
    total += size_[i];
  }
  arena_.reserve_to(total);
  arena_.allocate();
  real_.assign(size_.size(), 0);
}

OverlayPool::Range OverlayPool::scope() const {
  if (measuring() || slot_ >= size_.size()) return {nullptr, offset_};
  return {static_cast<char*>(arena_.base()) + base_[slot_], offset_};
}

size_t OverlayPool::bytes() const {
  size_t n = 0;
  for (size_t b : size_) n += b;
  return n;
}

Memory::Memory(DType dtype, Device device) : Memory(dtype, ExecContext::standard(device)) {}

Memory::Memory(DType dtype, const ExecContext& exec)
    : dtype_(dtype), main_grads_dtype_(master_dtype()), device_(exec.device()), exec_(&exec) {
  const Device device = device_;
  void* stream = exec.stream();  // the arenas are zeroed in the order of the modules' ops
  for (Arena& a : params_arena_) a.set_device(device, stream);
  for (Arena& a : grads_) a.set_device(device, stream);
  for (Arena& a : compute_) a.set_device(device, stream);
  for (Arena& a : codes_) a.set_device(device, stream);
  for (Arena& a : scales_) a.set_device(device, stream);
  fp8_.set_device(device, stream);
  acts_.set_device(device, stream);
  peer_acts_.set_device(device, stream);
  scratch_.set_device(device, stream);
  exchange_scratch_.set_device(device, stream);
  recompute_.set_device(device, stream);
  offload_.set_device(device, stream);
  host_offload_.set_device(Device::cpu);
  host_offload_.set_pinned(device == Device::cuda);  // a CPU run never offloads (nor pins)
}

size_t host_memory_bytes() {
  long pages = ::sysconf(_SC_PHYS_PAGES), page = ::sysconf(_SC_PAGE_SIZE);
  return pages > 0 && page > 0 ? static_cast<size_t>(pages) * static_cast<size_t>(page) : 0;
}

Tensor Memory::param(const ParamSpec& spec) {
  const std::string& name = spec.name;
  const Shape& shape = spec.shape;
  const DimShard& dim_shard = spec.dim_shard;
  const ParamGroup group = spec.group;
  const int64_t shard_offset = spec.shard_offset, global_rows = spec.global_rows;
  if (shared_params_) {
    const Param* q = find(name);
    MF_CHECK(q != nullptr && q->value.shape() == shape, "Memory::SharedParams: no parameter ", name, " of shape ",
             shape.str());
    return q->compute;
  }
  for (const Param& p : params_) MF_CHECK(p.name != name, "parameter registered twice: ", name);
  const int g = static_cast<int>(group);
  Param p;
  p.name = name;
  if (sharded_) {
    if (params_.empty())  // a new pass: the buckets of the last one stay readable until now (planning)
      for (std::vector<GradBucket>& b : buckets_) b.clear();
    take_sharded(p, spec);
  } else {
    p.value = params_arena_[g].take(master_dtype(), shape);
    p.grad = grads_[g].take(grad_dtype(group), shape);
    if (!mixed_precision())
      p.compute = p.value;
    else if (spec.fp8 && fp8_params_)  // kept only in FP8: a shape, no data
      p.compute = Tensor(nullptr, dtype_, shape, device_);
    else
      p.compute = compute_[g].take(dtype_, shape);
  }
  if (spec.fp8) {
    if (!p.fp8_gathered) {  // else take_sharded placed them in the code and scale blocks
      p.fp8.q = fp8_.take(DType::u8, shape);
      p.fp8.s = fp8_.take(DType::f32, fp8_block_scale_shape(shape, false));
    }
    p.fp8.qT = fp8_.take(DType::u8, fp8_transposed_shape(shape));
    p.fp8.sT = fp8_.take(DType::f32, fp8_block_scale_shape(shape, true));
  }
  p.full_master = spec.full_master;
  p.pipeline_copy = spec.pipeline_copy;
  p.group = group;
  p.shard_offset = shard_offset;
  p.global_rows = global_rows > 0 ? global_rows : shape[0];
  MF_CHECK(shard_offset >= 0 && shard_offset + shape[0] <= p.global_rows, name, ": shard [", shard_offset, ", ",
           shard_offset + shape[0], ") of ", p.global_rows, " rows");
  if (dim_shard.dim >= 0) {
    const int d = dim_shard.dim;
    MF_CHECK(d >= 1 && d < shape.ndim && dim_shard.chunks >= 1 && shape[d] % dim_shard.chunks == 0, name,
             ": dim shard of dimension ", d, " in ", dim_shard.chunks, " chunks for shape ", shape.str());
    const int64_t n = shape[d] / dim_shard.chunks;
    MF_CHECK(dim_shard.offset >= 0 && dim_shard.offset + n <= dim_shard.global_size, name, ": dim ", d, " shard [",
             dim_shard.offset, ", ", dim_shard.offset + n, ") of ", dim_shard.global_size);
    p.dim_shard = dim_shard;
  }
  p.init = spec.init;
  p.init_std = spec.init_std;
  p.decay = spec.decay;
  p.id = params_.size();
  params_.push_back(p);
  return p.compute;
}

void Memory::set_fp8_params(bool on) {
  MF_CHECK(params_.empty() && grad_bytes() == 0, "Memory::set_fp8_params after parameters were registered");
  fp8_params_ = on;
}

Shape fp8_block_scale_shape(const Shape& w, bool transposed) {
  MF_CHECK(w.ndim == 2 || w.ndim == 3, "an FP8 weight of shape ", w.str(), " ([O, I] or [E, O, I])");
  constexpr int64_t kBlock = 128;  // ops/fp8.h's kFp8Tile
  const int64_t o_n = w[w.ndim - 2], i_n = w[w.ndim - 1];
  const int64_t ob = (o_n + kBlock - 1) / kBlock, ib = (i_n + kBlock - 1) / kBlock;
  const int64_t a = transposed ? ib : ob, b = transposed ? ob : ib;
  return w.ndim == 3 ? Shape{w[0], a, b} : Shape{a, b};
}

Shape fp8_transposed_shape(const Shape& w) {
  MF_CHECK(w.ndim == 2 || w.ndim == 3, "an FP8 weight of shape ", w.str(), " ([O, I] or [E, O, I])");
  const int64_t o_n = w[w.ndim - 2], i_n = w[w.ndim - 1];
  return w.ndim == 3 ? Shape{w[0], i_n, o_n} : Shape{i_n, o_n};
}

void Memory::set_main_grads_dtype(DType dtype) {
  MF_CHECK(params_.empty() && grad_bytes() == 0, "Memory::set_main_grads_dtype after parameters were registered");
  MF_CHECK(dtype == master_dtype() || (dtype == DType::bf16 && mixed_precision()), "main gradients in ",
           dtype_name(dtype), " need bf16 compute and an unsharded optimizer");
  main_grads_dtype_ = dtype;
}

void Memory::shard_layout(ShardLayout layout) {
  MF_CHECK(params_.empty() && grad_bytes() == 0, "Memory::shard_layout after parameters were registered");
  for (int64_t n : layout.shards) MF_CHECK(n >= 1, "Memory::shard_layout: ", n, " shards");
  MF_CHECK(layout.bucket_of != nullptr, "Memory::shard_layout without bucket_of");
  layout_ = std::move(layout);
  sharded_ = true;
}

void Memory::take_sharded(Param& p, const ParamSpec& spec) {
  const int g = static_cast<int>(spec.group);
  const size_t esize = dtype_size(grad_dtype(spec.group));  // the block's elements
  const int64_t shards = layout_.shards[g];
  std::vector<GradBucket>& buckets = buckets_[g];
  const int64_t key = layout_.bucket_of(spec.name);
  const bool fp8 = spec.fp8 && fp8_params_ && !spec.full_master;  // kept only in FP8: codes gathered
  if (buckets.empty() || buckets.back().key != key || buckets.back().full_master != spec.full_master ||
      buckets.back().fp8 != fp8) {
    // A new bucket starts at a multiple of the shard count (and of the arena's alignment).
    grads_[g].pad_to(std::lcm(kAlign, static_cast<size_t>(shards) * esize));
    GradBucket b{key, static_cast<int64_t>(grads_[g].used() / esize), 0, spec.full_master, fp8};
    // Its copies: the compute block skips the FP8-only buckets' room in whole multiples of 64
    // elements and of the shard count (the gap to the last bucket with copies, rounded down), so
    // the copies keep their gradients' alignment, and without FP8-only buckets copy_begin == begin
    // (the gaps are the alignment padding, shorter than that multiple). The code block packs its
    // buckets, each from a multiple of the alignment and of the shard count.
    const auto last = std::find_if(buckets.rbegin(), buckets.rend(), [&](const GradBucket& c) { return c.fp8 == fp8; });
    if (fp8) {
      codes_[g].pad_to(std::lcm(kAlign, static_cast<size_t>(shards)));
      b.copy_begin = static_cast<int64_t>(codes_[g].used());
    } else {
      const int64_t unit = std::lcm(int64_t{64}, shards);
      const int64_t gap = b.begin - (last == buckets.rend() ? 0 : last->end);
      const int64_t end = last == buckets.rend() ? 0 : last->copy_begin + (last->end - last->begin);
      b.copy_begin = end + gap - gap / unit * unit;
    }
    buckets.push_back(b);
  }
  GradBucket& b = buckets.back();
  const size_t at = grads_[g].used();  // bytes: the copy sits at the same element offset in its bucket
  p.grad = grads_[g].take(grad_dtype(spec.group), spec.shape);
  const int64_t end = static_cast<int64_t>(grads_[g].used() / esize);
  b.end = (end + shards - 1) / shards * shards;
  const auto copy_at = static_cast<size_t>(b.copy_begin + (static_cast<int64_t>(at / esize) - b.begin));
  if (fp8) {
    p.compute = Tensor(nullptr, dtype_, spec.shape, device_);
    p.fp8.q = codes_[g].take_at(DType::u8, spec.shape, copy_at);
    p.fp8.s = scales_[g].take(DType::f32, fp8_block_scale_shape(spec.shape, false));
    p.fp8_gathered = true;
  } else {
    p.compute = compute_[g].take_at(dtype_, spec.shape, copy_at * dtype_size(dtype_));
  }
  if (spec.full_master)
    p.value = params_arena_[g].take(master_dtype(), spec.shape);
  else if (p.grad.dtype() == master_dtype())
    p.value = p.grad;
  else  // bf16 gradients: the master's staging in host memory, at the gradient's element offset
    p.value = staging_[g].take_at(master_dtype(), spec.shape, at / esize * dtype_size(master_dtype()));
  if (spec.full_master && !mixed_precision()) p.compute = p.value;
}

int64_t Memory::copy_elems(int g, bool fp8) const {
  int64_t n = 0;
  for (const GradBucket& b : buckets_[g])
    if (b.fp8 == fp8) n = std::max(n, b.copy_begin + (b.end - b.begin));
  return n;
}

Tensor Memory::master_staging(ParamGroup group) const {
  const int g = static_cast<int>(group);
  if (!sharded_ || grad_dtype(group) == master_dtype()) return Tensor();
  return Tensor(staging_[g].base(), master_dtype(), {block_elems(g)}, Device::cpu);
}

Tensor Memory::compute_block(ParamGroup group) const {
  MF_CHECK(sharded_, "Memory::compute_block without the distributed optimizer's layout");
  const int g = static_cast<int>(group);
  return Tensor(compute_[g].base(), dtype_, {copy_elems(g, false)}, device_);
}

Tensor Memory::code_block(ParamGroup group) const {
  MF_CHECK(sharded_, "Memory::code_block without the distributed optimizer's layout");
  const int g = static_cast<int>(group);
  return Tensor(codes_[g].base(), DType::u8, {copy_elems(g, true)}, device_);
}

Tensor Memory::scale_block(ParamGroup group) const {
  MF_CHECK(sharded_, "Memory::scale_block without the distributed optimizer's layout");
  const int g = static_cast<int>(group);
  return Tensor(scales_[g].base(), DType::f32, {static_cast<int64_t>(scales_[g].used() / sizeof(float))}, device_);
}

Shape Param::global_shape() const {
  Shape g = value.shape();
  if (g.ndim == 0) return g;
  g.dims[0] = global_rows > 0 ? global_rows : g.dims[0];
  if (dim_shard.dim >= 1) g.dims[dim_shard.dim] = dim_shard.chunks * dim_shard.global_size;
  return g;
}

int64_t Param::global_index(int64_t local) const {
  const Shape& s = value.shape();
  const Shape g = global_shape();
  int64_t coord[kMaxDims] = {};
  for (int d = s.ndim - 1; d >= 0; --d) {
    coord[d] = local % s[d];
    local /= s[d];
  }
  coord[0] += shard_offset;
  if (dim_shard.dim >= 1) coord[dim_shard.dim] += dim_shard.chunks * dim_shard.offset;  // a contiguous range
  int64_t index = 0;
  for (int d = 0; d < s.ndim; ++d) index = index * g[d] + coord[d];
  return index;
}

void fill_normal_shard(const Param& p, uint64_t seed, uint64_t stream, double mean, double std,
                       const FillNormal& fill) {
  const Tensor& v = p.value;
  MF_CHECK(v.contiguous(), p.name, ": fill_normal_shard needs a contiguous value");
  const int64_t numel = v.numel();
  // A run of consecutive local elements that is consecutive in the whole tensor too: the local
  // slice of dim_shard.dim (a contiguous range of the whole dimension, see DimShard) with everything
  // after it (dimensions after dim_shard.dim are never sharded).
  int64_t run = numel;
  if (p.dim_shard.dim >= 1) {
    run = v.size(p.dim_shard.dim);
    for (int d = p.dim_shard.dim + 1; d < v.ndim(); ++d) run *= v.size(d);
  }
  if (numel == 0 || run == 0) return;
  char* base = static_cast<char*>(v.data());
  const size_t elem = dtype_size(v.dtype());
  for (int64_t first = 0; first < numel; first += run)
    fill(Tensor(base + static_cast<size_t>(first) * elem, v.dtype(), {run}, v.device()), seed, stream, mean, std,
         static_cast<uint64_t>(p.global_index(first)));
}

void Memory::set_part(const std::string& part) {
  if (!measuring()) return;
  for (size_t i = 0; i < parts_.size(); ++i)
    if (parts_[i].part == part) {
      part_ = i;
      return;
    }
  parts_.push_back({part, 0, 0});
  part_ = parts_.size() - 1;
}

Tensor Memory::take_act(Arena& a, DType dtype, Shape shape, bool host) {
  const size_t before = a.used();
  Tensor t = a.take(dtype, shape);
  if (measuring()) {
    if (parts_.empty()) set_part("other");
    (host ? parts_[part_].host : parts_[part_].device) += a.used() - before;
  }
  return t;
}

Tensor Memory::take_overlaid(OverlayPool& pool, DType dtype, Shape shape, const char* part) {
  const size_t before = pool.bytes();
  Tensor t = pool.take(dtype, shape);
  if (measuring() && pool.bytes() > before) {
    if (parts_.empty()) set_part("other");
    const size_t current = part_;
    set_part(part);
    parts_[part_].device += pool.bytes() - before;
    part_ = current;
  }
  return t;
}

namespace {
constexpr const char* kScratchPart = "layers' shared workspace";
constexpr const char* kRecomputePart = "recomputed layers' block";
constexpr const char* kExchangePart = "layers' exchange workspace";
constexpr const char* kOffloadPart = "offloaded layers' slots";
}  // namespace

Tensor Memory::offloaded(Shape shape) { return offloaded(shape, dtype_); }
Tensor Memory::offloaded(Shape shape, DType dtype) {
  if (in_layer_ && acts_in_scratch_) return take_overlaid(scratch_, dtype, shape, kScratchPart);  // recomputed
  if (in_layer_ && offload_slot_ >= 0) return take_overlaid(offload_, dtype, shape, kOffloadPart);
  return act(shape, dtype);
}

Tensor Memory::act(Shape shape) { return act(shape, dtype_); }
Tensor Memory::act(Shape shape, DType dtype) {
  if (in_layer_ && acts_in_scratch_) return take_overlaid(scratch_, dtype, shape, kScratchPart);
  if (in_layer_ && recompute_slot_ >= 0) return take_overlaid(recompute_, dtype, shape, kRecomputePart);
  return take_act(acts_, dtype, shape, false);
}
Tensor Memory::result(Shape shape, DType dtype) { return take_act(acts_, dtype, shape, false); }
Tensor Memory::scratch(Shape shape) { return scratch(shape, dtype_); }
Tensor Memory::scratch(Shape shape, DType dtype) {
  return in_layer_ ? take_overlaid(scratch_, dtype, shape, kScratchPart) : take_act(acts_, dtype, shape, false);
}
Tensor Memory::exchange_scratch(Shape shape, DType dtype) {
  return in_layer_ ? take_overlaid(exchange_scratch_, dtype, shape, kExchangePart)
                   : take_act(acts_, dtype, shape, false);
}

void Memory::begin_layer(int recompute_slot, int offload_slot) {
  MF_CHECK(!in_layer_, "Memory::begin_layer inside a layer");
  in_layer_ = true;
  scratch_.begin(0);
  exchange_scratch_.begin(0);
  recompute_slot_ = recompute_slot;
  if (recompute_slot >= 0) recompute_.begin(static_cast<size_t>(recompute_slot));
  offload_slot_ = offload_slot;
  if (offload_slot >= 0) offload_.begin(static_cast<size_t>(offload_slot));
}

Memory::OffloadBlock Memory::end_layer() {
  MF_CHECK(in_layer_ && !acts_in_scratch_, "Memory::end_layer outside a layer (or under ScratchActs)");
  in_layer_ = false;
  recompute_slot_ = -1;
  OffloadBlock block;
  if (offload_slot_ >= 0) {
    const OverlayPool::Range r = offload_.scope();
    block.bytes = r.bytes;
    block.device = r.data;
    const size_t before = host_offload_.used();
    const Tensor host = host_offload_.take(DType::u8, {static_cast<int64_t>(r.bytes)});
    block.host = host.data();
    if (measuring() && host_offload_.used() > before) {
      const size_t current = part_;
      set_part(kOffloadPart);
      parts_[part_].host += host_offload_.used() - before;
      part_ = current;
    }
  }
  offload_slot_ = -1;
  return block;
}
Tensor Memory::host_act(Shape shape, DType dtype) {
  return device_ == Device::cpu ? take_act(acts_, dtype, shape, false) : take_act(host_acts_, dtype, shape, true);
}
Tensor Memory::peer_act(Shape shape, DType dtype) { return take_act(peer_acts_, dtype, shape, false); }
Mirrored Memory::mirrored(Shape shape, DType dtype) {
  if (device_ == Device::cpu) {
    const Tensor t = act(shape, dtype);
    return {t, t};
  }
  return {host_act(shape, dtype), act(shape, dtype)};
}

namespace {
Tensor first_rows(const Tensor& t, int64_t n) { return n < 0 || t.ndim() == 0 ? t : t.slice(0, n); }
}  // namespace

// One tensor on a CPU run (nothing to copy); copies are no-ops on the measuring pass (no data).
void Mirrored::to_device(int64_t n, const ExecContext* on) const {
  if (host.data() != dev.data()) first_rows(dev, n).copy_from(first_rows(host, n), on);
}
void Mirrored::to_host(int64_t n, const ExecContext* on) const {
  if (host.data() != dev.data()) first_rows(host, n).copy_from(first_rows(dev, n), on);
}

void Memory::bind_twice(const std::function<void()>& bind) {
  bind();
  allocate();
  bind();
  finish_binding();
}

void Memory::allocate() {
  MF_CHECK(measuring(), "Memory::allocate called twice");
  const std::vector<const Arena*> all = arenas();
  for (size_t i = 0; i < all.size(); ++i) measured_[i] = all[i]->used();
  for (int g = 0; g < kNumParamGroups && sharded_; ++g) {
    // The last bucket's padding: room up to its end in the gradient and compute blocks.
    grads_[g].reserve_to(static_cast<size_t>(block_elems(g)) * dtype_size(grad_dtype(static_cast<ParamGroup>(g))));
    if (grad_dtype(static_cast<ParamGroup>(g)) != master_dtype())
      staging_[g].reserve_to(static_cast<size_t>(block_elems(g)) * dtype_size(master_dtype()));
    compute_[g].reserve_to(static_cast<size_t>(copy_elems(g, false)) * dtype_size(dtype_));
    codes_[g].reserve_to(static_cast<size_t>(copy_elems(g, true)));
  }
  for (int g = 0; g < kNumParamGroups; ++g) {
    params_arena_[g].allocate();
    grads_[g].allocate();
    compute_[g].allocate();
    codes_[g].allocate();
    scales_[g].allocate();
    staging_[g].allocate();
  }
  fp8_.allocate();
  acts_.allocate();
  host_acts_.allocate();
  peer_acts_.allocate();
  scratch_.allocate();
  exchange_scratch_.allocate();
  recompute_.allocate();
  offload_.allocate();
  host_offload_.allocate();
  params_.clear();
}

void Memory::finish_binding() const {
  MF_CHECK(!measuring(), "finish_binding before allocate");
  const std::vector<const Arena*> all = arenas();
  for (size_t i = 0; i < all.size(); ++i)
    MF_CHECK(all[i]->used() == measured_[i], "the real binding pass differs from the measuring pass");
  MF_CHECK(scratch_.matches_measured() && exchange_scratch_.matches_measured() && recompute_.matches_measured() &&
               offload_.matches_measured(),
           "the real binding pass's overlaid workspace differs from the measuring pass's");
}

std::vector<const Arena*> Memory::arenas() const {
  std::vector<const Arena*> all;
  for (int g = 0; g < kNumParamGroups; ++g) {
    all.push_back(&params_arena_[g]);
    all.push_back(&grads_[g]);
    all.push_back(&compute_[g]);
    all.push_back(&codes_[g]);
    all.push_back(&scales_[g]);
  }
  all.push_back(&fp8_);
  all.push_back(&acts_);
  all.push_back(&host_acts_);
  all.push_back(&peer_acts_);
  all.push_back(&host_offload_);
  return all;
}

size_t Memory::param_bytes() const { return master_bytes() + compute_bytes() + fp8_bytes(); }

size_t Memory::master_bytes() const {
  size_t n = 0;
  for (const Arena& a : params_arena_) n += a.used();
  return n;
}

// Sharded: up to the last bucket's padded end (what allocate reserves), also while measuring.
size_t Memory::compute_bytes() const {
  size_t n = 0;
  for (int g = 0; g < kNumParamGroups; ++g)
    n += std::max(compute_[g].used(), static_cast<size_t>(copy_elems(g, false)) * dtype_size(dtype_));
  return n;
}

size_t Memory::fp8_bytes() const {
  size_t n = fp8_.used();
  for (int g = 0; g < kNumParamGroups; ++g)
    n += std::max(codes_[g].used(), static_cast<size_t>(copy_elems(g, true))) + scales_[g].used();
  return n;
}

size_t Memory::grad_bytes() const {
  size_t n = 0;
  for (int g = 0; g < kNumParamGroups; ++g)
    n += std::max(grads_[g].used(),
                  static_cast<size_t>(block_elems(g)) * dtype_size(grad_dtype(static_cast<ParamGroup>(g))));
  return n;
}

void Memory::zero_grads() {
  ++grad_generation_;
  for (int g = 0; g < kNumParamGroups; ++g) {
    bool any_marked = false;
    for (const Param& p : params_) any_marked |= static_cast<int>(p.group) == g && p.grad_written_by_backward;
    if (!any_marked) {
      grads_[g].zero();  // one memset (padding between parameters included: it stays zero)
      continue;
    }
    for (const Param& p : params_)
      if (static_cast<int>(p.group) == g && !p.grad_written_by_backward) {
        if (device_ == Device::cuda)
          device_zero(p.grad.data(), p.grad.nbytes(), exec_->stream());
        else
          std::memset(p.grad.data(), 0, p.grad.nbytes());
      }
  }
}

size_t Memory::grad_written_by_backward(const std::string& name) {
  for (size_t i = 0; i < params_.size(); ++i)
    if (params_[i].name == name) {
      params_[i].grad_written_by_backward = true;
      return i;
    }
  MF_FAIL("grad_written_by_backward: no parameter ", name);
}

bool Memory::accumulate_grad(size_t index) {
  MF_CHECK(index < params_.size() && params_[index].grad_written_by_backward, "Memory::accumulate_grad: parameter ",
           index, " is not written by its backward");
  Param& p = params_[index];
  const bool accumulate = p.written_generation == grad_generation_;
  if (grad_writes_ != nullptr) grad_writes_->push_back({index, p.written_generation});
  p.written_generation = grad_generation_;
  return accumulate;
}

void Memory::mark_grads_written(const std::vector<GradWrite>& writes) {
  for (const GradWrite& w : writes) params_[w.index].written_generation = grad_generation_;
}

void Memory::restore_grad_writes(const std::vector<GradWrite>& writes) {
  for (auto it = writes.rbegin(); it != writes.rend(); ++it) params_[it->index].written_generation = it->previous;
}

Tensor Memory::grad_block(ParamGroup group) const {
  const Arena& a = grads_[static_cast<int>(group)];
  const DType dt = grad_dtype(group);
  const int64_t n = sharded_ ? block_elems(static_cast<int>(group)) : static_cast<int64_t>(a.used() / dtype_size(dt));
  return Tensor(a.base(), dt, {n}, device_);
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
