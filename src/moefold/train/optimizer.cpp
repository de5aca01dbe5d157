#include "moefold/train/optimizer.h"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <map>
#include <thread>
#include <tuple>
#include <utility>

#include "moefold/core/exec.h"
#include "moefold/ops/fp8.h"
#include "moefold/ops/ops.h"

namespace moefold {

namespace {

// A group's bucket slot of shard rank k: [begin + k s, begin + (k + 1) s), s = (end - begin) / n.
std::pair<int64_t, int64_t> slot_of(const GradBucket& b, int64_t n, int64_t k) {
  const int64_t s = (b.end - b.begin) / n;
  return {b.begin + k * s, b.begin + (k + 1) * s};
}

// Optimizer offload: of each bucket of a group (block order), how many elements of this rank's slot
// (len / shards; none of a full_master bucket) live on the host: the last round(fraction x total)
// of the group's slot elements.
std::vector<int64_t> host_elements(const std::vector<GradBucket>& buckets, int64_t shards, double fraction) {
  int64_t total = 0;
  for (const GradBucket& b : buckets)
    if (!b.full_master) total += (b.end - b.begin) / shards;
  int64_t device = total - std::llround(fraction * static_cast<double>(total));
  std::vector<int64_t> out;
  for (const GradBucket& b : buckets) {
    const int64_t k = b.full_master ? 0 : (b.end - b.begin) / shards, kd = std::min(k, device);
    device -= kd;
    out.push_back(k - kd);
  }
  return out;
}

constexpr int64_t kPieceElements = int64_t{1} << 24;  // 64 MB of f32 gradient per copy

// Elements of `p`'s gradient within its group's gradient block.
std::pair<int64_t, int64_t> elements_of(const Param& p, const Tensor& grad_block) {
  const auto at =
      static_cast<int64_t>((static_cast<const char*>(p.grad.data()) - static_cast<const char*>(grad_block.data())) /
                           static_cast<std::ptrdiff_t>(dtype_size(grad_block.dtype())));
  return {at, at + p.grad.numel()};
}

// A moment's dtype: bf16 where asked for beside f32 masters, else the master dtype.
DType moment_dtype(const std::string& name, DType master) {
  return master == DType::f32 && name == "bf16" ? DType::bf16 : master;
}

}  // namespace

void AdamW::bind(const ExecContext& ctx, const std::vector<Param>& params) {
  ctx_ = &ctx;
  params_ = &params;
  sharded_ = false;
  exposed_ = false;
  if (!params.empty()) arena_.set_device(params.front().value.device());  // moments beside the weights
  auto take_all = [&] {
    segments_.clear();
    exp_avg_.clear();
    exp_avg_sq_.clear();
    for (size_t i = 0; i < params.size(); ++i) {
      const Param& p = params[i];
      const int64_t n = p.value.numel();
      m_dtype_ = moment_dtype(cfg_.exp_avg_dtype, p.value.dtype());
      v_dtype_ = moment_dtype(cfg_.exp_avg_sq_dtype, p.value.dtype());
      exp_avg_.push_back(arena_.take(m_dtype_, p.value.shape()));
      exp_avg_sq_.push_back(arena_.take(v_dtype_, p.value.shape()));
      segments_.push_back({i, p.group, 0, n, p.value.view({n}), exp_avg_.back().view({n}), exp_avg_sq_.back().view({n}),
                           p.grad.view({n}), p.has_compute_copy() ? p.compute.view({n}) : Tensor(), true});
    }
  };
  take_all();  // measure
  arena_.allocate();
  take_all();
  make_batches();
}

size_t AdamW::state_bytes(const Memory& mem, const TrainConfig& cfg) {
  // Per group: master, m and v of each sharded slot; m and v of each full_master bucket (its
  // master is the parameter's own). Unsharded: m and v of every parameter (arena rounding).
  const DType master = mem.master_dtype();
  const size_t esize = dtype_size(master), msize = dtype_size(moment_dtype(cfg.exp_avg_dtype, master)),
               vsize = dtype_size(moment_dtype(cfg.exp_avg_sq_dtype, master));
  auto round = [](size_t n) { return (n + 63) / 64 * 64; };
  size_t n = 0;
  if (!mem.sharded()) {
    for (const Param& p : mem.params()) {
      const auto k = static_cast<size_t>(p.grad.numel());
      n += round(k * msize) + round(k * vsize);
    }
    return n;
  }
  for (int g = 0; g < kNumParamGroups; ++g) {
    const ParamGroup group = static_cast<ParamGroup>(g);
    const std::vector<GradBucket>& buckets = mem.grad_buckets(group);
    const std::vector<int64_t> host = host_elements(buckets, mem.shards(group), cfg.optimizer_offload_fraction);
    for (size_t i = 0; i < buckets.size(); ++i) {
      const GradBucket& b = buckets[i];
      const auto len = static_cast<size_t>(b.end - b.begin);
      const size_t k = (b.full_master ? len : len / static_cast<size_t>(mem.shards(group))) - host[i];
      n += (b.full_master ? 0 : round(k * esize)) + round(k * msize) + round(k * vsize);
    }
  }
  return n;
}

size_t AdamW::host_state_bytes(const Memory& mem, const TrainConfig& cfg) {
  if (!mem.sharded() || !(cfg.optimizer_offload_fraction > 0)) return 0;
  const DType master = mem.master_dtype();
  const size_t esize = dtype_size(master), msize = dtype_size(moment_dtype(cfg.exp_avg_dtype, master)),
               vsize = dtype_size(moment_dtype(cfg.exp_avg_sq_dtype, master));
  auto round = [](size_t n) { return (n + 63) / 64 * 64; };
  size_t n = 0, staged = 0;
  for (int g = 0; g < kNumParamGroups; ++g) {
    const ParamGroup group = static_cast<ParamGroup>(g);
    size_t group_staged = 0;
    for (const int64_t k : host_elements(mem.grad_buckets(group), mem.shards(group), cfg.optimizer_offload_fraction)) {
      if (k == 0) continue;
      const auto kh = static_cast<size_t>(k);
      n += round(kh * esize) + round(kh * msize) + round(kh * vsize);
      group_staged += kh;
    }
    // The group's gradient staging, in its gradients' dtype (bf16 with train.main_grads_dtype).
    if (group_staged > 0) n += round(group_staged * dtype_size(mem.grad_dtype(group)));
    staged += group_staged;
  }
  // And the compute copies' staging.
  return n + round(staged * dtype_size(mem.dtype()));
}

void AdamW::bind(const Memory& mem, const ShardGroups& groups) {
  if (!mem.sharded()) {
    bind(mem.exec(), mem.params());
    // Each segment's place in its group's gradient block: where bf16 moments pass in f32.
    for (int g = 0; g < kNumParamGroups; ++g)
      groups_[static_cast<size_t>(g)].grad_block = mem.grad_block(static_cast<ParamGroup>(g));
    for (Segment& sg : segments_) {
      const auto [a, e] = elements_of(mem.params()[sg.param], groups_[static_cast<size_t>(sg.group)].grad_block);
      sg.begin = a;
      sg.end = e;
    }
    exposed_ = m_dtype_ != mem.master_dtype() || v_dtype_ != mem.master_dtype();
    MF_CHECK(arena_.capacity() == state_bytes(mem, cfg_), "AdamW: state of ", arena_.capacity(), " bytes, planned ",
             state_bytes(mem, cfg_));
    return;
  }
  ctx_ = &mem.exec();
  params_ = &mem.params();
  sharded_ = true;
  exposed_ = true;
  mixed_ = mem.mixed_precision();
  arena_.set_device(mem.device());
  const DType dt = mem.master_dtype();
  m_dtype_ = moment_dtype(cfg_.exp_avg_dtype, dt);
  v_dtype_ = moment_dtype(cfg_.exp_avg_sq_dtype, dt);
  const std::vector<Param>& params = mem.params();
  const double fraction = cfg_.optimizer_offload_fraction;
  for (int g = 0; g < kNumParamGroups; ++g) {
    const ParamGroup group = static_cast<ParamGroup>(g);
    Group& gr = groups_[static_cast<size_t>(g)];
    gr.buckets = mem.grad_buckets(group);
    gr.comm = groups[static_cast<size_t>(g)];
    if (gr.buckets.empty()) continue;
    MF_CHECK(gr.comm != nullptr && gr.comm->size() == mem.shards(group), "AdamW: parameter group ", g,
             " is laid out for ", mem.shards(group), " shards but its group has ", gr.comm ? gr.comm->size() : 0,
             " ranks");
    gr.grad_block = mem.grad_block(group);
    gr.compute_block = mem.compute_block(group);
    gr.code_block = mem.code_block(group);
    gr.scale_block = mem.scale_block(group);
    for (const GradBucket& b : gr.buckets)
      MF_CHECK(!b.fp8 || fraction == 0 || mem.dtype() == DType::bf16,
               "AdamW: optimizer offload of FP8-only weights needs bf16 compute");
    gr.stage = mem.master_staging(group);
    // Decided once: the step loop allocates nothing.
    gr.gather_order.clear();
    for (size_t i = 0; i < gr.buckets.size(); ++i)
      if (!gr.buckets[i].full_master) gr.gather_order.push_back(i);
    std::sort(gr.gather_order.begin(), gr.gather_order.end(), [&](size_t a, size_t b) {
      return gr.buckets[a].key != gr.buckets[b].key ? gr.buckets[a].key < gr.buckets[b].key : a < b;
    });
    pending_[static_cast<size_t>(g)].reserve(gr.gather_order.size());
  }
  // One pass measures, the next takes: per bucket the slot's master, m and v (one tensor each,
  // the slot's segments are views of it), or a full_master bucket's m and v.
  MF_CHECK(fraction == 0 || mem.device() == Device::cuda, "optimizer offload on a CPU run");  // apply_memory_options
  host_arena_.set_device(Device::cpu);
  host_arena_.set_pinned(true);
  auto take_all = [&] {
    segments_.clear();
    pieces_.clear();
    int64_t staged = 0;  // offloaded elements so far: the staging offset of the next
    for (int g = 0; g < kNumParamGroups; ++g) {
      Group& gr = groups_[static_cast<size_t>(g)];
      gr.staging_base = staged;
      std::vector<std::pair<std::pair<int64_t, int64_t>, size_t>> ranges;  // the group's parameters
      for (size_t i = 0; i < params.size() && !arena_.measuring(); ++i)
        if (static_cast<int>(params[i].group) == g) ranges.push_back({elements_of(params[i], gr.grad_block), i});
      const std::vector<int64_t> host = host_elements(gr.buckets, gr.comm ? gr.comm->size() : 1, fraction);
      for (size_t bi = 0; bi < gr.buckets.size(); ++bi) {
        const GradBucket& b = gr.buckets[bi];
        const bool whole = b.full_master;
        const auto [s0, s1] = whole ? std::pair{b.begin, b.end} : slot_of(b, gr.comm->size(), gr.comm->rank());
        const int64_t sp = s1 - host[bi];  // [s0, sp) on the device, [sp, s1) on the host
        const Tensor master = whole ? Tensor() : arena_.take(dt, {sp - s0});
        const Tensor m = arena_.take(m_dtype_, {sp - s0}), v = arena_.take(v_dtype_, {sp - s0});
        Tensor hmaster, hm, hv;
        if (sp < s1) {
          hmaster = host_arena_.take(dt, {s1 - sp});
          hm = host_arena_.take(m_dtype_, {s1 - sp});
          hv = host_arena_.take(v_dtype_, {s1 - sp});
        }
        const int64_t staging = staged;
        staged += s1 - sp;
        if (arena_.measuring()) continue;
        // Where each offloaded element's new bf16 copy lands on the device: among the compute
        // copies, or in an FP8-only bucket (no compute copies: the codes are quantized on the
        // GPU from these values) in the bucket's offloaded gradients' bytes, packed from their
        // start (the gradients left for the host before, on the same copy stream; dead until the
        // next backward, and at least 2 bytes an element).
        const size_t gsize = dtype_size(gr.grad_block.dtype()), csize = dtype_size(mem.dtype());
        const auto landing = [&](int64_t j) -> char* {
          if (!b.fp8)
            return static_cast<char*>(gr.compute_block.data()) +
                   static_cast<size_t>(j + b.copy_begin - b.begin) * csize;
          return static_cast<char*>(gr.grad_block.data()) + static_cast<size_t>(sp) * gsize +
                 static_cast<size_t>(j - sp) * csize;
        };
        for (int64_t p = sp; p < s1; p += kPieceElements)
          pieces_.push_back(
              {static_cast<size_t>(g), p, staging + (p - sp), std::min(kPieceElements, s1 - p), landing(p)});
        for (const auto& [range, i] : ranges) {
          const Param& p = params[i];
          const int64_t a = std::max(range.first, s0), e = std::min(range.second, sp);
          if (a < e) {
            Segment sg{i, p.group, a, e, {}, m.slice(a - s0, e - s0), v.slice(a - s0, e - s0), {}, {}, whole};
            if (whole) {  // the parameter's own master; its compute copy where it has one
              sg.master = p.value.view({p.value.numel()});
              sg.grad = p.grad.view({p.grad.numel()});
              if (p.has_compute_copy()) sg.compute = p.compute.view({p.compute.numel()});
            } else {
              sg.master = master.slice(a - s0, e - s0);
              sg.grad = gr.grad_block.slice(a, e);
              const int64_t c = b.copy_begin - b.begin;  // the copies' offset from the gradients'
              if (b.fp8) {
                sg.code = gr.code_block.slice(a + c, e + c);
                sg.first = a - range.first;
              } else {
                sg.compute = gr.compute_block.slice(a + c, e + c);
              }
            }
            segments_.push_back(std::move(sg));
          }
          const int64_t ha = std::max(range.first, sp), he = std::min(range.second, s1);
          if (ha < he) {  // offloaded: its state on the host, its gradient and compute copy staged
            Segment sg{i,
                       p.group,
                       ha,
                       he,
                       hmaster.slice(ha - sp, he - sp),
                       hm.slice(ha - sp, he - sp),
                       hv.slice(ha - sp, he - sp),
                       gr.grad_block.slice(ha, he),
                       {},
                       false,
                       true,
                       staging + (ha - sp)};
            if (b.fp8) {  // its codes from its landed bf16 values (gather_copies)
              const int64_t c = b.copy_begin - b.begin;
              sg.code = gr.code_block.slice(ha + c, he + c);
              sg.first = ha - range.first;
              sg.values = Tensor(landing(ha), mem.dtype(), {he - ha}, mem.device());
            } else {
              sg.compute = gr.compute_block.slice(ha + b.copy_begin - b.begin, he + b.copy_begin - b.begin);
            }
            segments_.push_back(std::move(sg));
          }
        }
      }
      // The group's offloaded gradients land in its own staging, in the block's dtype.
      gr.host_grad = staged > gr.staging_base
                         ? host_arena_.take(mem.grad_dtype(static_cast<ParamGroup>(g)), {staged - gr.staging_base})
                         : Tensor();
    }
    if (fraction > 0) host_compute_ = host_arena_.take(mem.dtype(), {staged});
  };
  take_all();
  arena_.allocate();
  if (fraction > 0) host_arena_.allocate();
  take_all();
  if (fraction > 0) {
    MF_CHECK(host_arena_.capacity() == host_state_bytes(mem, cfg_), "AdamW: host state of ", host_arena_.capacity(),
             " bytes, planned ", host_state_bytes(mem, cfg_));
    copy_ = std::make_unique<ExecContext>(Device::cuda, ctx_->kernels(), ExecContext::Stream::own);
    threads_ = std::make_unique<HostThreads>(static_cast<int>(std::max(1u, std::thread::hardware_concurrency())));
    fences_.clear();
    fences_.resize(pieces_.size());
  }
  MF_CHECK(arena_.capacity() == state_bytes(mem, cfg_), "AdamW: state of ", arena_.capacity(), " bytes, planned ",
           state_bytes(mem, cfg_));
  make_batches();
}

void AdamW::make_batches() {
  // Small parameters (norms, routers, small projections) in batches, one per combination of
  // dtypes: one launch each instead of one per parameter. Large ones keep their own (vectorized)
  // pass, which costs its launch nothing in comparison. Offloaded segments, and sharded ones whose
  // f32 compute copy is copied after the update, stay out.
  constexpr int64_t kBatchElements = int64_t{1} << 20;
  batches_.clear();
  batched_.assign(segments_.size(), false);
  std::map<std::tuple<DType, DType, DType, int>, std::vector<AdamWEntry>> by_dtypes;
  for (size_t k = 0; k < segments_.size(); ++k) {
    const Segment& sg = segments_[k];
    const bool copied_after = sharded_ && sg.compute.defined() && !mixed_;
    if (sg.host || copied_after || sg.master.numel() > kBatchElements) continue;
    const int c = sg.compute.defined() ? static_cast<int>(sg.compute.dtype()) : -1;
    by_dtypes[{sg.grad.dtype(), sg.m.dtype(), sg.v.dtype(), c}].push_back(
        {sg.master, sg.grad, sg.m, sg.v, sg.compute, (*params_)[sg.param].decay});
    batched_[k] = true;
  }
  for (auto& [dtypes, entries] : by_dtypes) batches_.emplace_back(std::move(entries));
}

void AdamW::step(std::vector<Param>& params, double lr, double grad_scale) {
  MF_CHECK(&params == params_ || (!sharded_ && params.size() == exp_avg_.size()), "optimizer bound to ",
           params_ ? params_->size() : 0, " parameters, stepping ", params.size());
  wait_all_weights();  // the last step's gathers write the compute copies this one writes
  ++steps_;
  const double b1 = cfg_.adam_beta1, b2 = cfg_.adam_beta2, eps = cfg_.adam_eps;
  const double bc1 = 1.0 - std::pow(b1, static_cast<double>(steps_));
  const double bc2 = 1.0 - std::pow(b2, static_cast<double>(steps_));
  // Offload: the offloaded gradients start towards the host while the GPU updates its part.
  if (!pieces_.empty()) {
    copy_->wait_for(*ctx_);
    for (size_t i = 0; i < pieces_.size(); ++i) {
      const Piece& pc = pieces_[i];
      const Group& gr = groups_[pc.group];
      const size_t esize = dtype_size(gr.grad_block.dtype());
      device_copy_async(
          static_cast<char*>(gr.host_grad.data()) + static_cast<size_t>(pc.staging - gr.staging_base) * esize,
          Device::cpu, static_cast<const char*>(gr.grad_block.data()) + static_cast<size_t>(pc.begin) * esize,
          Device::cuda, static_cast<size_t>(pc.n) * esize, copy_->stream());
      fences_[i].record(copy_->stream());
    }
  }
  // The batches hold the bound parameters' tensors: only for those (the caller may pass a copy).
  const bool batches = &params == params_;
  if (batches)
    for (const AdamWBatch& b : batches_)
      b.update(*ctx_, AdamWStep{lr, b1, b2, eps, cfg_.weight_decay, bc1, bc2, grad_scale});
  for (size_t k = 0; k < segments_.size(); ++k) {
    const Segment& sg = segments_[k];
    if (sg.host || (batches && batched_[k])) continue;
    const Param& p = params[sg.param];
    const AdamWStep s{lr, b1, b2, eps, p.decay ? cfg_.weight_decay : 0.0, bc1, bc2, grad_scale};
    if (!sharded_) {  // the caller's tensors (the optimizer may be bound to a copy of the list)
      adamw_update(*ctx_, p.value, p.grad, exp_avg_[k], exp_avg_sq_[k], s, p.has_compute_copy() ? p.compute : Tensor());
      continue;
    }
    // With mixed precision the pass also writes the bf16 compute copy; an f32 copy is copied.
    const bool fused = mixed_ && sg.compute.defined();
    adamw_update(*ctx_, sg.master, sg.grad, sg.m, sg.v, s, fused ? sg.compute : Tensor());
    if (!fused && sg.compute.defined()) sg.compute.copy_from(sg.master, ctx_);
  }
  if (!sharded_) return;
  if (!pieces_.empty()) step_host(params, AdamWStep{lr, b1, b2, eps, 0.0, bc1, bc2, grad_scale});
  // Every rank's updated slots to every rank, each group's buckets in forward order on its
  // stream (the first layer's weights first).
  for (size_t g = 0; g < groups_.size(); ++g) gather_copies(g);
  if (!overlap_gather_) wait_all_weights();
}

void AdamW::gather_copies(size_t g, bool fp8_only) {
  const Group& gr = groups_[g];
  if (gr.scale_block.defined() && gr.scale_block.numel() > 0) {
    // The FP8-only buckets' block scales: each rank's amax of its slots' part of every block (the
    // values rounded to the compute dtype, as its copies would be), one max over the shard group,
    // the scales; then each slot's codes. Each code depends only on its value and its block's
    // amax, so the codes are those of quantizing each whole weight (fp8_quantize_blocks).
    if (gr.scale_block.device() == Device::cuda)
      device_zero(gr.scale_block.data(), gr.scale_block.nbytes(), ctx_->stream());
    else
      gr.scale_block.zero();
    for (const Segment& sg : segments_)
      if (static_cast<size_t>(sg.group) == g && sg.code.defined()) {
        const Param& p = (*params_)[sg.param];
        // An offloaded slot's values landed as bf16 (step_host, scatter_state): rounded already.
        fp8_block_amax(*ctx_, sg.host ? sg.values : sg.master, p.grad.shape(), sg.first, p.fp8.s, mixed_ && !sg.host);
      }
    gr.comm->wait(gr.comm->start_all_reduce(gr.scale_block, ReduceOp::max));
    fp8_scales_from_amax(*ctx_, gr.scale_block);
    for (const Segment& sg : segments_)
      if (static_cast<size_t>(sg.group) == g && sg.code.defined()) {
        const Param& p = (*params_)[sg.param];
        fp8_quantize_part(*ctx_, sg.host ? sg.values : sg.master, p.grad.shape(), sg.first, p.fp8.s, sg.code,
                          mixed_ && !sg.host);
      }
  }
  for (const size_t i : gr.gather_order) {
    const GradBucket& b = gr.buckets[i];
    if (fp8_only && !b.fp8) continue;
    const Tensor& copies = b.fp8 ? gr.code_block : gr.compute_block;
    pending_[g].emplace_back(b.key,
                             gr.comm->start_all_gather(copies.slice(b.copy_begin, b.copy_begin + (b.end - b.begin))));
  }
}

void AdamW::step_host(const std::vector<Param>& params, const AdamWStep& base) {
  const size_t csize = dtype_size(host_compute_.dtype());
  const bool bf16_compute = host_compute_.dtype() == DType::bf16;
  size_t first = 0;  // the first offloaded segment that may still overlap a piece (both in staging order)
  for (size_t i = 0; i < pieces_.size(); ++i) {
    const Piece& pc = pieces_[i];
    fences_[i].wait();
    const int64_t p0 = pc.staging, p1 = pc.staging + pc.n;
    for (size_t k = first; k < segments_.size(); ++k) {
      const Segment& sg = segments_[k];
      if (!sg.host) continue;
      const int64_t s0 = sg.staging, s1 = sg.staging + (sg.end - sg.begin);
      if (s1 <= p0) {
        first = k + 1;
        continue;
      }
      if (s0 >= p1) break;
      const int64_t lo = std::max(s0, p0), hi = std::min(s1, p1), a = lo - s0, e = hi - s0;
      AdamWStep s = base;
      s.weight_decay = params[sg.param].decay ? cfg_.weight_decay : 0.0;
      const Group& gr = groups_[static_cast<size_t>(sg.group)];
      const Tensor master = sg.master.slice(a, e), compute = host_compute_.slice(lo, hi);
      adamw_update_host(master, gr.host_grad.slice(lo - gr.staging_base, hi - gr.staging_base), sg.m.slice(a, e),
                        sg.v.slice(a, e), s, bf16_compute ? compute : Tensor(), threads_.get());
      if (!bf16_compute) compute.copy_from(master);  // an f32 compute copy is the master itself
    }
    device_copy_async(pc.to, Device::cuda,
                      static_cast<const char*>(host_compute_.data()) + static_cast<size_t>(p0) * csize, Device::cpu,
                      static_cast<size_t>(pc.n) * csize, copy_->stream());
  }
  ctx_->wait_for(*copy_);  // the gathers and the next forward read the copied compute copies
}

void AdamW::wait_weights(int64_t point) {
  for (size_t g = 0; g < groups_.size(); ++g) {
    std::vector<std::pair<int64_t, int64_t>>& pending = pending_[g];
    // Started in key order: waiting for the last one at or below `point` waits for all before it.
    size_t n = 0;
    while (n < pending.size() && pending[n].first <= point) ++n;
    if (n == 0) continue;
    groups_[g].comm->wait(pending[n - 1].second);
    pending.erase(pending.begin(), pending.begin() + static_cast<std::ptrdiff_t>(n));
  }
}

double AdamW::owned_grad_squares(ParamGroup group) const {
  MF_CHECK(sharded_, "AdamW::owned_grad_squares without the distributed optimizer");
  const Group& gr = groups_[static_cast<size_t>(group)];
  double sq = 0;
  for (const GradBucket& b : gr.buckets) {
    if (b.full_master) {
      if (gr.comm->rank() == 0) sq += sum_squares(*ctx_, gr.grad_block.slice(b.begin, b.end));
      continue;
    }
    const auto [s0, s1] = slot_of(b, gr.comm->size(), gr.comm->rank());
    sq += sum_squares(*ctx_, gr.grad_block.slice(s0, s1));
  }
  for (const Segment& sg : segments_)  // a copy of another stage's parameter: its owner counts it
    if (sg.group == group && (*params_)[sg.param].pipeline_copy) sq -= sum_squares(*ctx_, sg.grad);
  return sq;
}

void AdamW::gather_into_grad_blocks(int pick) {
  wait_all_weights();
  for (const Segment& sg : segments_) {
    const Tensor& src = pick == 0 ? sg.master : pick == 1 ? sg.m : sg.v;
    if (pick == 0 && sg.whole) continue;  // Param::value is this master already
    const Group& gr = groups_[static_cast<size_t>(sg.group)];
    convert(src, gr.exposure().slice(sg.begin, sg.end));
  }
  for (const Group& gr : groups_) {
    int64_t last = -1;
    for (const GradBucket& b : gr.buckets)
      if (!b.full_master) last = gr.comm->start_all_gather(gr.exposure().slice(b.begin, b.end));
    if (last >= 0) gr.comm->wait(last);
  }
}

void AdamW::convert(const Tensor& src, const Tensor& dst) const {
  if (src.dtype() == dst.dtype()) {
    dst.copy_from(src, ctx_);
    return;
  }
  if (src.device() == dst.device()) {
    cast(*ctx_, src, dst);
    return;
  }
  // Across devices (offloaded state, checkpoints only): cast on the host.
  const ExecContext& host = ExecContext::standard(Device::cpu);
  const bool from_host = src.device() == Device::cpu;
  const DType via = from_host ? dst.dtype() : src.dtype();
  std::vector<std::byte> tmp(static_cast<size_t>(src.numel()) * dtype_size(via));
  const Tensor t(tmp.data(), via, src.shape());
  if (from_host) {
    cast(host, src, t);
    dst.copy_from(t, ctx_);
  } else {
    t.copy_from(src, ctx_);
    cast(host, t, dst);
  }
}

// The host copies of the moments are f32 whatever the gradient block's dtype (bf16 with
// train.main_grads_dtype): a bf16 block passes through a host bf16 buffer, widened or narrowed here.
void AdamW::block_to_host(const Tensor& block, std::vector<std::byte>& host) const {
  if (block.numel() == 0) return;
  if (block.dtype() != DType::bf16) {
    Tensor(host.data(), block.dtype(), block.shape()).copy_from(block, ctx_);
    return;
  }
  std::vector<uint16_t> narrow(static_cast<size_t>(block.numel()));
  Tensor(narrow.data(), DType::bf16, block.shape()).copy_from(block, ctx_);
  auto* wide = reinterpret_cast<float*>(host.data());
  for (size_t i = 0; i < narrow.size(); ++i) wide[i] = bf16_to_f32(narrow[i]);
}

void AdamW::host_to_block(const std::vector<std::byte>& host, const Tensor& block) const {
  if (block.numel() == 0) return;
  if (block.dtype() != DType::bf16) {
    block.copy_from(Tensor(const_cast<std::byte*>(host.data()), block.dtype(), block.shape()), ctx_);
    return;
  }
  std::vector<uint16_t> narrow(static_cast<size_t>(block.numel()));
  const auto* wide = reinterpret_cast<const float*>(host.data());
  for (size_t i = 0; i < narrow.size(); ++i) narrow[i] = f32_to_bf16(wide[i]);
  block.copy_from(Tensor(narrow.data(), DType::bf16, block.shape()), ctx_);
}

void AdamW::prepare_state() {
  if (!exposed_) return;
  for (int g = 0; g < kNumParamGroups; ++g) {
    const Tensor& block = groups_[static_cast<size_t>(g)].exposure();
    const DType wide = block.dtype() == DType::bf16 ? DType::f32 : block.dtype();  // f32 for bf16 blocks
    const size_t bytes = static_cast<size_t>(block.numel()) * dtype_size(wide);
    host_m_[static_cast<size_t>(g)].assign(bytes, std::byte{0});
    host_v_[static_cast<size_t>(g)].assign(bytes, std::byte{0});
  }
}

void AdamW::gather_state() {
  if (!exposed_) return;
  prepare_state();
  // The gradient blocks carry each quantity in turn (the gradients are dead after the step):
  // the moments on to host memory, the masters last, staying there as Param::value.
  for (int pick : {1, 2}) {
    gather_into_grad_blocks(pick);
    for (int g = 0; g < kNumParamGroups; ++g) {
      const Group& gr = groups_[static_cast<size_t>(g)];
      std::vector<std::byte>& host = pick == 1 ? host_m_[static_cast<size_t>(g)] : host_v_[static_cast<size_t>(g)];
      block_to_host(gr.exposure(), host);
    }
  }
  if (sharded_) gather_into_grad_blocks(0);
}

void AdamW::scatter_state() {
  const std::vector<Param>& params = *params_;
  wait_all_weights();
  // Sharded: the master slots from Param::value (the gradients' storage, or the host staging with
  // bf16 gradients), before anything else passes through that storage.
  for (const Segment& sg : segments_)
    if (sharded_ && !sg.whole)
      sg.master.copy_from(groups_[static_cast<size_t>(sg.group)].exposure().slice(sg.begin, sg.end), ctx_);
  // Every rank holds every value: each compute copy is cast whole, no gather needed. The FP8-only
  // weights' codes come from the slots as the step makes them (gathered).
  for (const Param& p : params)
    if (p.has_compute_copy()) convert(p.value, p.compute);
  if (sharded_) {
    for (size_t g = 0; g < groups_.size(); ++g)
      if (groups_[g].scale_block.defined() && groups_[g].scale_block.numel() > 0) {
        for (const Segment& sg : segments_)  // offloaded FP8-only slots: their values as a step lands them
          if (static_cast<size_t>(sg.group) == g && sg.host && sg.code.defined()) convert(sg.master, sg.values);
        gather_copies(g, true);
      }
    wait_all_weights();
  }
  const bool loaded = !host_m_[0].empty() || !host_m_[1].empty() || !host_m_[2].empty();
  if (!exposed_ || !loaded) return release_state();
  // The moments, each in turn, from host memory through each group's exposure block (the gradients,
  // or the f32 staging) into the segments (converted to their dtype).
  for (int pick : {1, 2}) {
    for (int g = 0; g < kNumParamGroups; ++g) {
      const Group& gr = groups_[static_cast<size_t>(g)];
      const std::vector<std::byte>& host =
          pick == 1 ? host_m_[static_cast<size_t>(g)] : host_v_[static_cast<size_t>(g)];
      host_to_block(host, gr.exposure());
    }
    for (const Segment& sg : segments_)
      convert(groups_[static_cast<size_t>(sg.group)].exposure().slice(sg.begin, sg.end), pick == 1 ? sg.m : sg.v);
  }
  release_state();
}

void AdamW::release_state() {
  for (auto* hs : {&host_m_, &host_v_})
    for (std::vector<std::byte>& h : *hs) std::vector<std::byte>().swap(h);
}

Tensor AdamW::moment(size_t i, int which) const {
  if (!exposed_) return which == 0 ? exp_avg_.at(i) : exp_avg_sq_.at(i);
  const Param& p = params_->at(i);
  const size_t g = static_cast<size_t>(p.group);
  const std::vector<std::byte>& host = which == 0 ? host_m_[g] : host_v_[g];
  MF_CHECK(!host.empty(), "AdamW: the moments of ", p.name, " are not gathered (gather_state)");
  const Tensor& block = groups_[g].exposure();
  const auto [a, e] = elements_of(p, groups_[g].grad_block);
  const DType wide = block.dtype() == DType::bf16 ? DType::f32 : block.dtype();
  return Tensor(const_cast<std::byte*>(host.data()), wide, block.shape()).slice(a, e).view(p.grad.shape());
}

double clip_factor(double norm, double max_norm) {
  if (!(max_norm > 0)) return 1.0;
  return std::min(1.0, max_norm / (norm + 1e-6));
}

double clip_grad_norm(const ExecContext& ctx, std::vector<Param>& params, double norm, double max_norm) {
  const double f = clip_factor(norm, max_norm);
  if (f < 1.0)
    for (Param& p : params) scale_inplace(ctx, p.grad, f);
  return f;
}

double learning_rate(const TrainConfig& c, int64_t step) {
  if (step < c.warmup_steps) return c.lr * static_cast<double>(step + 1) / static_cast<double>(c.warmup_steps);
  const int64_t decay_steps = c.steps - c.warmup_steps;
  if (decay_steps <= 0 || step >= c.steps) return c.min_lr;
  const double progress = static_cast<double>(step - c.warmup_steps) / static_cast<double>(decay_steps);
  return c.min_lr + 0.5 * (c.lr - c.min_lr) * (1.0 + std::cos(M_PI * progress));
}

}  // namespace moefold
