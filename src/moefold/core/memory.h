// Planned memory. Every module binds its tensors through a Memory twice: first while measuring
// (views carry null pointers, only sizes are summed), then after allocate() for real, so all
// sizes are pure functions of the config and the step loop never calls the allocator.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "moefold/core/exec.h"
#include "moefold/core/rng.h"
#include "moefold/core/tensor.h"

namespace moefold {

// One contiguous, 64-byte aligned, zero-initialised block carved by a bump pointer.
class Arena {
 public:
  Arena() = default;
  // Where allocate() takes the block (host: aligned_alloc; cuda: cudaMalloc) and the stream its
  // zeroing runs on (null: the primary stream). REQUIRES: before allocate().
  void set_device(Device device, void* stream = nullptr) {
    device_ = device;
    stream_ = stream;
  }
  Device device() const { return device_; }
  // Host arenas only: page-locked memory (pinned_host_malloc), for asynchronous copies to and from
  // the GPU. REQUIRES: before allocate().
  void set_pinned(bool pinned) { pinned_ = pinned; }
  Arena(const Arena&) = delete;
  Arena& operator=(const Arena&) = delete;

  bool measuring() const { return base_ == nullptr; }
  // Reserves exactly the bytes measured so far and rewinds for the real pass.
  void allocate();
  // Rewinds to the start (keeps the block).
  void rewind() { offset_ = 0; }
  Tensor take(DType dtype, Shape shape);
  // A view at byte `at` (>= used(), a multiple of the dtype's size); used() moves past it.
  Tensor take_at(DType dtype, Shape shape, size_t at);
  // Moves used() up to the next multiple of `multiple` bytes / up to `bytes`.
  void pad_to(size_t multiple);
  void reserve_to(size_t bytes);
  size_t used() const { return offset_; }
  size_t capacity() const { return capacity_; }
  void* base() const { return base_; }
  // Zeroes the used part of the block.
  void zero() const;

 private:
  struct Free {
    Device device;  // value-initialised: cpu (no member initialiser: unique_ptr needs it default-constructible)
    bool pinned;
    void operator()(void* p) const;
  };
  Device device_ = Device::cpu;
  bool pinned_ = false;
  void* stream_ = nullptr;
  std::unique_ptr<char, Free> storage_;
  char* base_ = nullptr;
  size_t capacity_ = 0;
  size_t offset_ = 0;
};

// Blocks overlaid in slots: take() hands out consecutive tensors from the base of the slot named by
// the last begin(); every begin() of a slot starts at that slot's base again, so scopes of one slot
// overlap, and each slot is as large as the most any scope took from it (the measuring pass finds
// it). Memory's workspace shared between layers (1 slot) and the recomputed layers' block (a slot per
// position in a recomputed chunk) are OverlayPools.
class OverlayPool {
 public:
  void set_device(Device device, void* stream) { arena_.set_device(device, stream); }
  bool measuring() const { return arena_.measuring(); }
  void begin(size_t slot);
  Tensor take(DType dtype, Shape shape);
  // Ends the measuring pass: reserves the sum of the slots' sizes.
  void allocate();
  // Whether the real pass took the same maximum from every slot as the measuring one.
  bool matches_measured() const { return real_ == size_; }
  size_t bytes() const;  // sum of the slots' sizes (so far, while measuring)
  // What the current scope took: its first byte (null while measuring) and its bytes.
  struct Range {
    void* data;
    size_t bytes;
  };
  Range scope() const;

 private:
  Arena arena_;
  std::vector<size_t> size_, real_;  // per slot: measured maximum; the real pass's maximum
  std::vector<size_t> base_;         // per slot: byte offset in the block (after allocate)
  size_t slot_ = 0, offset_ = 0;     // the current slot, and bytes taken from it in this scope
};

enum class Init : uint8_t { zeros, ones, normal };

// Which ranks reduce a parameter's gradient (parallel folding). dense: replicated on every rank
// of the dense view (norms, the router), reduced over DP x CP x TP (with sequence parallelism
// each TP rank sees other tokens); tensor_parallel: sharded over TP (projections, embedding, LM
// head), reduced over DP x CP; expert: reduced over EDP. Each group has its own arenas, so one
// collective reduces all gradients of a group.
enum class ParamGroup : uint8_t { dense = 0, expert = 1, tensor_parallel = 2 };
inline constexpr int kNumParamGroups = 3;

// A shard along a dimension other than 0 (expert tensor parallelism splits the expert FFN F):
// dimension `dim` of the whole tensor is `chunks` equal chunks of `global_size` each,
// interleaved row by row: whole index chunks * i + c is row i of chunk c (gate_up_proj
// [E, 2F, H]: gate row j at 2j, up row j at 2j + 1, chunks 2; down_proj [E, H, F]: chunks 1).
// This rank holds rows [offset, offset + n) of every chunk, n = local shape[dim] / chunks: the
// contiguous range [chunks * offset, chunks * (offset + n)) of the whole dimension.
struct DimShard {
  int dim = -1;             // sharded dimension (>= 1); -1: none beyond dim 0
  int64_t offset = 0;       // first row held, within each chunk
  int64_t global_size = 0;  // size of one chunk in the whole tensor
  int64_t chunks = 1;       // chunks interleaved along `dim`
};

// What Memory::param registers. A sharded parameter holds rows [shard_offset, shard_offset +
// shape[0]) of global_rows (0: unsharded), and with dim_shard.dim >= 1 also a slice of that
// dimension (see DimShard).
struct ParamSpec {
  std::string name;                      // Hugging Face name, e.g. "model.layers.0.mlp.gate_proj.weight"
  Shape shape;                           // this rank's part
  Init init = Init::normal;              // how init_params fills it
  double init_std = 0.02;                // Init::normal's standard deviation
  bool decay = true;                     // AdamW weight decay (false for norms and biases)
  ParamGroup group = ParamGroup::dense;  // which ranks reduce its gradient
  int64_t shard_offset = 0;              // first global row (dim 0) held here
  int64_t global_rows = 0;               // dim 0 of the whole parameter (0: shape[0], unsharded)
  DimShard dim_shard = {};               // a second sharded dimension (none by default)
  // With the distributed optimizer, keep the whole master weight on every rank (Param::value
  // stays the master; its gradient is all-reduced and every rank updates all of it): for modules
  // that read or write the master weight itself (the router's f32 gate, its expert bias).
  bool full_master = false;
  bool pipeline_copy = false;  // Param::pipeline_copy
  // The forward reads it as FP8 128 x 128 blocks (train.fp8, ops/fp8.h): Memory keeps its FP8 copy
  // (Param::fp8), and with set_fp8_params no bf16 compute copy.
  bool fp8 = false;
};

// A weight quantized to FP8 128 x 128 blocks (ops/fp8.h's blocks layout, fp8_quantize_blocks's
// four outputs: the forward reads q and sT, the data gradient qT and s). Undefined (q undefined):
// the FP8 ops quantize the weight at each call.
struct Fp8Weight {
  Tensor q, s, qT, sT;
  bool defined() const { return q.defined(); }
};
// The shapes of a weight's ([O, I] or [E, O, I]) block scales, s [(E,) ceil(O/128), ceil(I/128)]
// (transposed: sT [(E,) ceil(I/128), ceil(O/128)]), and of its transposed data qT [(E,) I, O].
Shape fp8_block_scale_shape(const Shape& w, bool transposed);
Shape fp8_transposed_shape(const Shape& w);

struct Param {
  std::string name;  // Hugging Face name, e.g. "model.layers.0.self_attn.q_proj.weight"
  // Master weight (the master dtype: f32, or f64 in gradient checks). With the distributed
  // optimizer (Memory::shard_layout) the master lives in the optimizer's shards and `value` is a
  // view of the gradient's storage: the whole master only between AdamW::gather_state and the
  // next zero_grads, and what init and load write before AdamW::scatter_state (full_master
  // parameters excepted: theirs is the master as without sharding).
  Tensor value;
  Tensor grad;  // same shape and dtype; accumulated by backward
  // The weight the forward reads: `value` itself, or with mixed precision (compute dtype bf16)
  // a bf16 copy that whoever changes `value` refreshes (the optimizer does it in its pass).
  Tensor compute;
  Init init = Init::normal;
  double init_std = 0.02;
  bool decay = true;  // false for norms and biases
  uint64_t id = 0;    // position in registration order
  ParamGroup group = ParamGroup::dense;
  int64_t shard_offset = 0;  // global index (dim 0) of this rank's first row (expert parallel)
  int64_t global_rows = 0;   // size of dim 0 of the whole (unsharded) parameter
  DimShard dim_shard;        // a second sharded dimension (dim_shard.dim -1: none)
  bool full_master = false;  // ParamSpec::full_master
  // Its backward writes the gradient at the step's first call instead of adding to zeros
  // (Memory::grad_written_by_backward): zero_grads leaves it alone.
  bool grad_written_by_backward = false;
  int64_t written_generation = -1;  // the generation a backward last wrote it in (accumulate_grad)
  // A copy of a parameter another pipeline stage owns (the embedding on the last stage, for
  // multi-token prediction): its gradient is summed with the owner's, the gradient norm and
  // checkpoints count the owner's only.
  bool pipeline_copy = false;
  // ParamSpec::fp8: the weight's FP8 copy (u8 codes and f32 scales, in Memory's FP8 block), and the
  // Memory::weights_version it was quantized at (ops/fp8.h's Fp8Param refreshes it). With
  // Memory::set_fp8_params and mixed precision, `compute` then has a shape and no data: the
  // forward reads the FP8 copy only, which the master refreshes.
  Fp8Weight fp8;
  uint64_t fp8_version = ~uint64_t{0};
  // Sharded FP8-only (GradBucket::fp8): fp8.q and fp8.s come from the optimizer (its slots
  // quantized, the codes gathered); a refresh only transposes them into qT and sT.
  bool fp8_gathered = false;
  // Whether `compute` is a separate copy the writers of `value` refresh.
  bool has_compute_copy() const { return compute.data() != nullptr && compute.data() != value.data(); }

  // Shape of the whole (unsharded) parameter.
  Shape global_shape() const;
  // Row-major flat index, in the whole parameter, of this shard's element `local` (row-major in
  // value). Unsharded: local; dim-0 shard: shard_offset * row + local; along dim_shard.dim, local
  // index c is whole index dim_shard.chunks * dim_shard.offset + c (see DimShard).
  int64_t global_index(int64_t local) const;
};

// Initialises a shard as the whole tensor would be: element i of p.value gets
// mean + std * normal(seed, stream, p.global_index(i)), one fill_normal per contiguous run. For
// an unsharded or dim-0-sharded parameter this is exactly fill_normal(p.value, seed, stream,
// mean, std, shard_offset * row).
// `fill` fills one run (a contiguous tensor and the global index of its first element): core's
// fill_normal on the host, or ops' fill_normal_any for a tensor on either device.
using FillNormal =
    std::function<void(const Tensor& t, uint64_t seed, uint64_t stream, double mean, double std, uint64_t first_index)>;
void fill_normal_shard(const Param& p, uint64_t seed, uint64_t stream, double mean, double std,
                       const FillNormal& fill = fill_normal);

// A buffer the host computes and the device reads, or the reverse (dispatch plans built from
// exchanged counts): one tensor on a CPU run (host == dev), a host and a device copy on a GPU run.
struct Mirrored {
  Tensor host, dev;
  // Copies the first n elements of dim 0 (all when n < 0) host -> device / device -> host; no-op
  // when both are one tensor. to_host waits for the device. On the stream of `on` (null: the
  // primary stream; Tensor::copy_from).
  void to_device(int64_t n = -1, const ExecContext* on = nullptr) const;
  void to_host(int64_t n = -1, const ExecContext* on = nullptr) const;
};

// Physical memory of this machine in bytes (0 when unknown).
size_t host_memory_bytes();

// The distributed optimizer's layout of each parameter group's blocks (Memory::shard_layout).
struct ShardLayout {
  int64_t shards[kNumParamGroups] = {1, 1, 1};  // the ranks each group's optimizer state is split over
  // Parameters of a group whose keys are equal in a row form one bucket (GradReducer: the point
  // of backward at which their gradients are final). full_master parameters form their own.
  std::function<int64_t(const std::string& param_name)> bucket_of;
};
// Elements [begin, end) of a group's gradient (and compute) block: begin and end are multiples of
// the group's shard count, so rank k of the shard group owns slot [begin + k s, begin + (k + 1) s),
// s = (end - begin) / shards. full_master: its parameters are ParamSpec::full_master (the bucket is
// all-reduced and updated whole on every rank).
// copy_begin: where the bucket's copies start, in the group's compute block (Memory::compute_block),
// or, fp8, in its code block: slot k's copies at [copy_begin + k s, copy_begin + (k + 1) s). Without
// FP8-only buckets copy_begin == begin (the compute block mirrors the gradient block).
// fp8: the bucket's weights are kept only in FP8 (Memory::set_fp8_params): no compute copies, their
// FP8 codes (Param::fp8.q) are views of the group's code block (u8, at their gradients' element
// offsets within the bucket, from copy_begin) and their block scales (Param::fp8.s) views of its
// scale block (AdamW quantizes its slot and gathers the codes).
struct GradBucket {
  int64_t key = 0, begin = 0, end = 0;
  bool full_master = false;
  bool fp8 = false;
  int64_t copy_begin = 0;
};

class Memory {
 public:
  // Every arena on `device` (parameters, gradients and activations on the GPU for cuda).
  // `dtype` is the compute dtype of activations and of the weights the forward reads; master
  // weights and gradients are f32 when it is bf16 (mixed precision), else the same dtype.
  // The modules bound through it run their ops on `exec` (Memory::exec()).
  Memory(DType dtype, const ExecContext& exec);
  // The same on the device's standard context (ExecContext::standard): tests and tools.
  explicit Memory(DType dtype, Device device = Device::cpu);

  DType dtype() const { return dtype_; }
  DType master_dtype() const { return dtype_ == DType::bf16 ? DType::f32 : dtype_; }
  // The dtype of a group's gradients: the master dtype, or for the expert and tensor-parallel
  // groups what set_main_grads_dtype chose.
  DType grad_dtype(ParamGroup group) const { return group == ParamGroup::dense ? master_dtype() : main_grads_dtype_; }
  // bf16: the expert and tensor-parallel groups' gradients in bf16 (train.main_grads_dtype).
  // REQUIRES: before the first bind; mixed precision. Sharded, those groups' Param::value (the
  // masters' staging) then lives in host memory (master_staging), not over the gradients.
  void set_main_grads_dtype(DType dtype);
  // Whether compute copies differ from the master weights (Param::compute != Param::value).
  bool mixed_precision() const { return master_dtype() != dtype_; }
  Device device() const { return device_; }
  // Where the modules bound through this Memory run their ops (core/exec.h): they keep it from
  // bind, as they keep the communicators they are given.
  const ExecContext& exec() const { return *exec_; }
  bool measuring() const { return acts_.measuring(); }
  // Counts the points where the weights may have changed since (the Trainer calls weights_changed()
  // before each step's and each evaluation's forwards: the optimizer, a checkpoint load or an
  // initialisation ran in between); FP8 weight caches (ops/fp8.h) quantize again when it moved.
  uint64_t weights_version() const { return weights_version_; }
  void weights_changed() { ++weights_version_; }
  // train.fp8_param: parameters registered with ParamSpec::fp8 get no bf16 compute copy (mixed
  // precision; their FP8 copy is quantized from the master, rounded to bf16 first, so the FP8
  // codes are the ones the copy would give). Sharded (shard_layout), such parameters (full_master
  // ones excepted) get no compute copy whatever the dtypes, and buckets of their own
  // (GradBucket::fp8). REQUIRES: before the first bind.
  void set_fp8_params(bool on);
  bool fp8_params() const { return fp8_params_; }

  // Registers a parameter (and its gradient); returns the view the forward reads (Param::compute:
  // the master weight itself, or its bf16 copy). Name the fields that differ from the defaults:
  //   mem.param({.name = p + ".norm.weight", .shape = {h}, .init = Init::ones, .decay = false})
  Tensor param(const ParamSpec& spec);
  // While one lives, param() registers nothing and returns the view of the parameter registered
  // under that name (same shape): a second binding of the same modules (another micro-batch in
  // flight on a pipeline stage) takes activations of its own and shares weights and gradients.
  class SharedParams {
   public:
    // `on` false: no change.
    SharedParams(Memory& mem, bool on) : mem_(mem), previous_(mem.shared_params_) {
      mem.shared_params_ = previous_ || on;
    }
    ~SharedParams() { mem_.shared_params_ = previous_; }
    SharedParams(const SharedParams&) = delete;
    SharedParams& operator=(const SharedParams&) = delete;

   private:
    Memory& mem_;
    bool previous_;
  };
  // Activation or workspace tensor (compute dtype unless given): kept for this module alone, unless
  // the module binds inside a recomputed layer or under ScratchActs (below).
  Tensor act(Shape shape);
  Tensor act(Shape shape, DType dtype);
  // A tensor read after the forward by others than its module (the router's expert counts, which
  // the trainer reads after the whole forward): always kept, whatever act() takes from.
  Tensor result(Shape shape, DType dtype);

  // Workspace shared between layers. The decoder layers bind one at a time between begin_layer()
  // and end_layer(); a tensor from scratch() is valid only during one call of its module (a
  // forward, or a backward with the recomputation it starts with): the scratch of every layer
  // starts at the same byte, so all layers share one block as large as the largest layer's
  // (backward workspaces, forward temporaries, and what a module recomputes before its backward).
  // Scratch tensors of one layer never overlap each other. Outside a layer scratch() is act().
  Tensor scratch(Shape shape);
  Tensor scratch(Shape shape, DType dtype);
  // Like scratch(), in a block of its own that only these take from: what a layer's backward keeps
  // from one of its phases to the next while another micro-batch's layer runs in between
  // (parallel.overlap_moe_a2a: the MoE layer's output and input gradient rows, which an exchange
  // fills), which scratch() of that layer would overwrite. Outside a layer act().
  Tensor exchange_scratch(Shape shape, DType dtype);
  // recompute_slot >= 0: the whole layer is recomputed before its backward (train.recompute_num_layers),
  // and act() takes from slot `recompute_slot` of the recomputed layers' block (its position in its
  // recomputed chunk): the layers of one slot overlap there as layers overlap in scratch.
  // offload_slot >= 0: offloaded() takes from that slot of the offloaded layers' block (activation
  // offload: a layer's offloaded tensors are one contiguous range there, with a pinned host copy).
  void begin_layer(int recompute_slot = -1, int offload_slot = -1);
  // A layer's offloaded tensors: `bytes` at `device` (its slot) and their pinned host copy at `host`
  // (null pointers while measuring; bytes 0 without offload).
  struct OffloadBlock {
    void* device = nullptr;
    void* host = nullptr;
    size_t bytes = 0;
  };
  OffloadBlock end_layer();
  // Inside a layer with an offload slot: a tensor of that slot (the kept input of an offloaded
  // module: train.offload_modules), which the model copies to the host after the layer's forward and
  // back before its backward; elsewhere act().
  Tensor offloaded(Shape shape);
  Tensor offloaded(Shape shape, DType dtype);
  // While one lives, act() takes scratch() (a module recomputed whole before its backward binds
  // what it keeps so); `on` false: no change.
  class ScratchActs {
   public:
    ScratchActs(Memory& mem, bool on) : mem_(mem), previous_(mem.acts_in_scratch_) {
      mem.acts_in_scratch_ = previous_ || on;
    }
    ~ScratchActs() { mem_.acts_in_scratch_ = previous_; }
    ScratchActs(const ScratchActs&) = delete;
    ScratchActs& operator=(const ScratchActs&) = delete;

   private:
    Memory& mem_;
    bool previous_;
  };
  // Workspace the host reads or writes (plans from exchanged counts): in host memory whatever
  // the device (on a CPU run the same as act()).
  Tensor host_act(Shape shape, DType dtype);
  // A host_act and an act of one shape (one tensor on a CPU run).
  Mirrored mirrored(Shape shape, DType dtype);
  // An act in the peer-visible block: a block of its own, which GPUs of one host map into each
  // other's address space (Communicator::map_peer_memory), so a peer can copy straight into it.
  // Ranks that bind the same modules in the same order get every peer_act at the same offset.
  Tensor peer_act(Shape shape, DType dtype);
  Tensor peer_act(Shape shape) { return peer_act(std::move(shape), dtype_); }
  // The peer-visible block (null while measuring) and its size in bytes.
  void* peer_block() const { return peer_acts_.base(); }
  size_t peer_block_bytes() const { return peer_acts_.capacity(); }

  // The distributed optimizer's layout (before the first bind): each group's gradients are cut
  // into GradBuckets padded to multiples of its shard count, every compute copy (Param::compute)
  // sits at its gradient's element offset in one compute block, and only full_master parameters
  // get a master weight here (the others' live in the optimizer: see Param::value).
  void shard_layout(ShardLayout layout);
  bool sharded() const { return sharded_; }
  int64_t shards(ParamGroup group) const { return layout_.shards[static_cast<int>(group)]; }
  // The group's buckets in block order (sharded; empty when the group has no parameters).
  const std::vector<GradBucket>& grad_buckets(ParamGroup group) const { return buckets_[static_cast<int>(group)]; }
  // The group's compute copies as one flat tensor (sharded only): bucket b's at b.copy_begin (laid
  // out like grad_block but for the FP8-only buckets' room, which it skips).
  Tensor compute_block(ParamGroup group) const;
  // Sharded with FP8-only weights (set_fp8_params): the group's FP8 codes (u8) and block scales
  // (f32) as flat tensors (GradBucket::fp8); empty without such buckets.
  Tensor code_block(ParamGroup group) const;
  Tensor scale_block(ParamGroup group) const;
  // Sharded with bf16 gradients: the group's f32 master staging in host memory, laid out like
  // grad_block (Param::value views it); undefined otherwise (the gradients' storage stages).
  Tensor master_staging(ParamGroup group) const;

  // Names the part of the model whose workspace the next act / host_act / mirrored / peer_act
  // calls take (moefold plan's breakdown: "embedding", "layers.3", "head", ...). The measuring
  // pass counts their bytes per part, in order of first use.
  void set_part(const std::string& part);
  struct PartBytes {
    std::string part;
    size_t device = 0, host = 0;  // device: the run's device (the host on a CPU run)
  };
  const std::vector<PartBytes>& part_bytes() const { return parts_; }

  // The whole binding sequence: bind() measures, allocate(), bind() takes the real tensors,
  // finish_binding() checks that both passes agree. `bind` registers every module's tensors.
  void bind_twice(const std::function<void()>& bind);
  // Ends the measuring pass: allocates every arena and clears the registrations; the caller
  // binds again. REQUIRES: measuring().
  void allocate();
  // Checks that the real pass took exactly what the measuring pass did.
  void finish_binding() const;

  std::vector<Param>& params() { return params_; }
  const std::vector<Param>& params() const { return params_; }
  const Param* find(const std::string& name) const;
  // The gradient of registered parameter `name` (aborts when absent).
  Tensor grad(const std::string& name) const;
  // Sets every gradient to zero (one memset per group), except those of parameters marked
  // grad_written_by_backward, and starts a new gradient generation.
  void zero_grads();
  // Marks registered parameter `name`: from now on zero_grads skips its gradient, and its
  // backward must WRITE the gradient on its first call of each generation and ACCUMULATE after
  // that (accumulate_grad says which). Saves a memset and a read of the whole gradient per step
  // (the expert weights' f32 gradients: most of a MoE model's). Returns the parameter's index.
  size_t grad_written_by_backward(const std::string& name);
  // For a parameter marked so (its index): whether this backward accumulates into its gradient
  // (another backward wrote it in this generation already: every binding of the module shares
  // the answer), recording the write.
  bool accumulate_grad(size_t index);
  // Incremented by every zero_grads(): a backward compares it with the generation it last wrote.
  int64_t grad_generation() const { return grad_generation_; }
  // CUDA graphs (train.cuda_graphs): while `into` is set, accumulate_grad records each parameter
  // it is asked about with the generation it had written before; a replayed backward marks the
  // same parameters written in this generation (as running it would have), and a failed capture
  // puts back what it recorded.
  struct GradWrite {
    size_t index = 0;
    int64_t previous = -1;
  };
  void record_grad_writes(std::vector<GradWrite>* into) { grad_writes_ = into; }
  void mark_grads_written(const std::vector<GradWrite>& writes);
  void restore_grad_writes(const std::vector<GradWrite>& writes);
  // All gradients of a group as one flat tensor (for one all-reduce); padding between
  // parameters is zero and stays zero. Empty when the group has no parameters.
  Tensor grad_block(ParamGroup group) const;
  size_t param_bytes() const;    // master weights, compute copies and FP8 copies
  size_t master_bytes() const;   // the master weights (the optimizer's shards not included)
  size_t compute_bytes() const;  // separate compute copies (mixed precision, or sharded)
  size_t fp8_bytes() const;      // the FP8 copies of ParamSpec::fp8 weights (train.fp8)
  size_t grad_bytes() const;
  // Device workspace: kept activations, the peer-visible block, the shared workspace and the
  // recomputed layers' block.
  size_t act_bytes() const {
    return acts_.used() + peer_acts_.used() + scratch_.bytes() + exchange_scratch_.bytes() + recompute_.bytes() +
           offload_.bytes();
  }
  size_t scratch_bytes() const { return scratch_.bytes(); }      // the workspace shared between layers
  size_t recompute_bytes() const { return recompute_.bytes(); }  // the recomputed layers' block
  // Host workspaces: plans, offloaded activations' copies, the masters' staging (bf16 gradients, sharded).
  size_t host_act_bytes() const {
    size_t n = host_acts_.used() + host_offload_.used();
    for (const Arena& a : staging_) n += a.used();
    return n;
  }

 private:
  DType dtype_;
  DType main_grads_dtype_;
  Device device_ = Device::cpu;
  const ExecContext* exec_;
  int64_t grad_generation_ = 0;
  std::vector<GradWrite>* grad_writes_ = nullptr;
  Arena params_arena_[kNumParamGroups], grads_[kNumParamGroups], compute_[kNumParamGroups], acts_;
  Arena fp8_;                                               // the FP8 weight copies (Param::fp8)
  Arena codes_[kNumParamGroups], scales_[kNumParamGroups];  // sharded FP8-only buckets' codes and scales
  Arena staging_[kNumParamGroups];                          // host: sharded masters' staging with bf16 gradients
  Arena host_acts_;                                         // always host memory; empty on a CPU run
  Arena peer_acts_;                                         // the peer-visible activations (peer_act)
  OverlayPool scratch_, recompute_;  // shared between layers (1 slot); recomputed layers (a slot per position)
  OverlayPool exchange_scratch_;     // exchange_scratch (1 slot)
  OverlayPool offload_;              // offloaded layers (a slot per layer index mod the model's slot count)
  Arena host_offload_;               // pinned: each offloaded layer's host copy
  bool in_layer_ = false, acts_in_scratch_ = false, shared_params_ = false, fp8_params_ = false;
  uint64_t weights_version_ = 0;
  int recompute_slot_ = -1, offload_slot_ = -1;
  size_t measured_[5 * kNumParamGroups + 5] = {};
  bool sharded_ = false;
  ShardLayout layout_;
  std::vector<PartBytes> parts_;  // measuring pass: workspace bytes by part
  size_t part_ = 0;               // the current part's index in parts_
  // Takes from `a`, counting the bytes under the current part while measuring.
  Tensor take_act(Arena& a, DType dtype, Shape shape, bool host);
  // Takes from an overlay pool, counting its growth under the part named `part` while measuring.
  Tensor take_overlaid(OverlayPool& pool, DType dtype, Shape shape, const char* part);
  std::vector<GradBucket> buckets_[kNumParamGroups];  // sharded: each group's buckets
  // Sharded: elements of group g's padded blocks (the last bucket's end).
  int64_t block_elems(int g) const { return buckets_[g].empty() ? 0 : buckets_[g].back().end; }
  // Sharded: elements of group g's compute block (fp8 false) or code block (true): the furthest
  // copy end of its buckets of that kind.
  int64_t copy_elems(int g, bool fp8) const;
  std::vector<const Arena*> arenas() const;            // every arena, in a fixed order
  void take_sharded(Param& p, const ParamSpec& spec);  // Memory::param's tensors with shard_layout
  std::vector<Param> params_;
};

}  // namespace moefold
