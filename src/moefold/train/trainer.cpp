#include "moefold/train/trainer.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <limits>

#include "moefold/core/fault_points.h"
#include "moefold/core/profile.h"
#include "moefold/moe/all_gather_dispatcher.h"
#include "moefold/moe/all_to_all_dispatcher.h"
#include "moefold/moe/hierarchical_dispatcher.h"
#include "moefold/moe/slot_dispatcher.h"
#include "moefold/ops/fp8.h"
#include "moefold/ops/ops.h"
#include "moefold/parallel/context_parallel.h"
#include "moefold/train/pipeline_schedule.h"

namespace moefold {

DispatcherFactory dispatchers_for(const Config& cfg, Mesh& mesh) {
  if (mesh.dims.ep == 1 && mesh.dims.etp == 1) return {};
  // Rows of the residual stream per rank: sequences split over CP, then rows over TP.
  const int64_t tokens = cfg.train.micro_batch_size * cfg.train.seq_len / (mesh.dims.cp * mesh.dims.tp);
  // Peer copies only within a node: an EP group over several (real or emulated) nodes takes the
  // communicator's exchange unless ep_transport insists.
  const EpTransportChoice node_transport = parse_ep_transport(cfg.parallel.ep_transport);  // within a node
  const EpTransportChoice transport =
      node_transport == EpTransportChoice::automatic && mesh.ep_nodes > 1 ? EpTransportChoice::nccl : node_transport;
  if (cfg.moe.dispatcher == "hierarchical") {
    if (!mesh.ep_nodes_irregular.empty())
      MF_FAIL(
          "moe.dispatcher = \"hierarchical\" needs each node to hold the same number of an EP group's ranks, "
          "consecutive in EP rank: ",
          mesh.ep_nodes_irregular, " (parallel.ranks_per_node = ", mesh.dims.ranks_per_node, ")");
    MF_CHECK(mesh.ep_node != nullptr && mesh.ep_rail != nullptr,
             "moe.dispatcher = \"hierarchical\": the mesh was built without its node groups");
  }
  return [&cfg, &mesh, tokens, transport, node_transport](int64_t) -> std::unique_ptr<Dispatcher> {
    if (mesh.dims.etp > 1)  // tokens all-gathered over ETP, then all-to-all over EP
      return std::make_unique<AllGatherDispatcher>(cfg.moe, cfg.model.hidden_size, tokens, *mesh.etp,
                                                   mesh.dims.ep > 1 ? mesh.ep.get() : nullptr);
    if (cfg.moe.dispatcher == "slots")  // fixed-size slots, the counts on the device
      return std::make_unique<SlotDispatcher>(cfg.moe, cfg.model.hidden_size, tokens, *mesh.ep);
    if (cfg.moe.dispatcher == "hierarchical")  // across nodes once over the rail, then within the node
      return std::make_unique<HierarchicalDispatcher>(cfg.moe, cfg.model.hidden_size, tokens, *mesh.ep, *mesh.ep_node,
                                                      *mesh.ep_rail, node_transport);
    return std::make_unique<AllToAllDispatcher>(cfg.moe, cfg.model.hidden_size, tokens, *mesh.ep, transport);
  };
}

std::string cuda_graphs_refusal(const Config& cfg, const Mesh& mesh, Device device) {
  if (cfg.train.cuda_graphs == "none") return "";
  if (device != Device::cuda) return "a CPU run (nothing to capture)";
  if (mesh.world->size() > 1) {
    // Inside a layer the ranks meet only in NCCL calls on device buffers (TP and CP collectives,
    // the router's token group, the slot dispatcher's fixed-size all_to_all), forked from and joined
    // back into the captured stream: those are captured with the layer. The rest cannot be.
    if (cfg.train.cuda_graphs == "step")
      return "\"step\" with several ranks (the data-parallel reductions and pipeline transfers between the "
             "layers are not captured; \"layers\" is)";
    if (mesh.dims.etp > 1)
      return cat("parallel.etp = ", mesh.dims.etp,
                 " (the expert-tensor-parallel dispatcher reads token counts on the host)");
    if (mesh.dims.ep > 1 && cfg.moe.dispatcher != "slots")
      return cat("parallel.ep = ", mesh.dims.ep, " with moe.dispatcher = \"", cfg.moe.dispatcher,
                 "\" (its token counts come to the host; \"slots\" keeps them on the device)");
    if (cfg.parallel.overlap_moe_a2a)
      return "parallel.overlap_moe_a2a with several ranks (the interleaved micro-batches' exchanges run between the "
             "layers' halves)";
  }
  if (!cfg.train.offload_modules.empty()) return "train.offload_modules (copies between the layers)";
  if (cfg.train.cuda_graphs == "step" && cfg.parallel.overlap_moe_a2a)
    return "parallel.overlap_moe_a2a (two micro-batches interleaved)";
  return "";
}

int64_t moe_layers_before(const ModelConfig& m, int64_t layer) {
  int64_t n = 0;
  for (int64_t l = 0; l < layer; ++l) n += m.is_dense_layer(l) ? 0 : 1;
  return n;
}

int64_t moe_layers_total(const ModelConfig& m) {
  return moe_layers_before(m, m.num_hidden_layers) + m.num_nextn_predict_layers;
}

std::vector<PipelineStage> pipeline_chunks(const Config& cfg, const Mesh& mesh) {
  const std::vector<int64_t> counts = mesh.dims.stage_layers(cfg.model.num_hidden_layers);
  const int64_t pp = mesh.dims.pp, vpp = mesh.dims.vpp, last = pp * vpp - 1;
  std::vector<PipelineStage> out;
  for (int64_t c = 0; c < vpp; ++c) {
    const int64_t v = c * pp + mesh.pp_rank;  // the chunk's virtual stage
    PipelineStage st;
    for (int64_t u = 0; u < v; ++u) st.first_layer += counts[static_cast<size_t>(u)];
    st.num_layers = counts[static_cast<size_t>(v)];
    st.first = v == 0;
    st.last = v == last;
    out.push_back(st);
  }
  return out;
}

std::vector<int64_t> micro_batches_in_flight(const Config& cfg, const Mesh& mesh) {
  if (mesh.dims.pp == 1 && !cfg.parallel.overlap_moe_a2a) return {1};
  const int64_t micro = cfg.train.global_batch_size / (cfg.train.micro_batch_size * mesh.dims.dp);
  return micro_batches_in_flight(
      pipeline_actions(mesh.dims.pp, mesh.dims.vpp, mesh.pp_rank, micro, cfg.parallel.overlap_moe_a2a), mesh.dims.vpp);
}

std::vector<std::unique_ptr<Model>> make_models(const Config& cfg, Mesh& mesh) {
  std::vector<std::unique_ptr<Model>> out;
  const std::vector<PipelineStage> chunks = pipeline_chunks(cfg, mesh);
  const std::vector<int64_t> in_flight = micro_batches_in_flight(cfg, mesh);
  for (size_t c = 0; c < chunks.size(); ++c)
    for (int64_t k = 0; k < in_flight[c]; ++k)
      out.push_back(std::make_unique<Model>(cfg.model, cfg.moe, cfg.train.micro_batch_size, cfg.train.seq_len,
                                            ModelParallel{dispatchers_for(cfg, mesh), mesh.cp.get(), mesh.tp.get(),
                                                          mesh.tp_cp.get(), chunks[c], cfg.parallel.overlap_moe_a2a},
                                            cfg.train.recompute(), cfg.train.offload(), cfg.train.fp8_linears()));
  return out;
}

void StepBuffers::bind(Memory& mem, const Config& cfg, const Model& model, size_t models) {
  const Shape bs{cfg.train.micro_batch_size, cfg.train.seq_len};
  const Shape bl{cfg.train.micro_batch_size, model.local_seq_len()};
  const int64_t layers = moe_layers_total(cfg.model), experts = cfg.moe.num_experts;
  mem.set_part("trainer");
  ids_BL.clear();
  targets_BL.clear();
  for (size_t k = 0; k < models; ++k) {
    ids_BL.push_back(mem.mirrored(bl, DType::i32));
    targets_BL.push_back(mem.mirrored(bl, DType::i32));
  }
  // Host side whatever the device: token windows, statistics, loads.
  full_ids_BS = mem.host_act(bs, DType::i32);
  full_targets_BS = mem.host_act(bs, DType::i32);
  const int64_t le = layers * experts;
  sums = mem.mirrored({4 + le + layers + 3}, DType::f64);
  stats = sums.host.slice(0, 4);
  step_sums = sums.host.slice(4, 4 + le + layers + 2);
  load_sum_LE = step_sums.slice(0, le).view({layers, experts});
  dropped_L = step_sums.slice(le, le + layers);
  inter_node_bytes = step_sums.slice(le + layers, le + layers + 1);
  overflow_rows = step_sums.slice(le + layers + 1, le + layers + 2);
  dev_overflow_1 = sums.dev.slice(4 + le + layers + 1, 4 + le + layers + 2);
  slot_fill = sums.host.slice(4 + le + layers + 2, 4 + le + layers + 3);
  dev_fill_1 = sums.dev.slice(4 + le + layers + 2, 4 + le + layers + 3);
  dev_loss_1 = sums.dev.slice(0, 1);
  dev_router_2 = sums.dev.slice(1, 3);
  dev_mtp_1 = sums.dev.slice(3, 4);
  dev_load_E.clear();
  dev_dropped_1.clear();
  for (int64_t l = 0; l < layers; ++l) {
    dev_load_E.push_back(sums.dev.slice(4 + l * experts, 4 + (l + 1) * experts));
    dev_dropped_1.push_back(sums.dev.slice(4 + le + l, 4 + le + l + 1));
  }
  counts_E = mem.mirrored({experts}, DType::i64);
}

void bind_training(Memory& mem, std::vector<std::unique_ptr<Model>>& models, const Config& cfg, StepBuffers& buffers) {
  models.front()->bind(mem);
  buffers.bind(mem, cfg, *models.front(), models.size());
  for (size_t k = 1; k < models.size(); ++k) {
    // A chunk's first model registers its parameters; more micro-batches in flight take activations
    // of their own and share them.
    Memory::SharedParams shared(mem, models[k]->first_layer() == models[k - 1]->first_layer());
    models[k]->bind(mem);
  }
}

void apply_memory_options(Memory& mem, const TrainConfig& train) {
  if (mem.device() != Device::cuda) {
    if (!train.offload_modules.empty()) MF_FAIL("train.offload_modules needs the CUDA device (it offloads GPU memory)");
    if (train.optimizer_offload_fraction > 0)
      MF_FAIL("train.optimizer_offload_fraction = ", train.optimizer_offload_fraction,
              " needs the CUDA device (it offloads GPU memory)");
  }
  mem.set_fp8_params(train.fp8_param);
  if (train.main_grads_dtype != "bf16") return;
  if (!mem.mixed_precision())
    MF_FAIL("train.main_grads_dtype = 'bf16' needs bf16 compute with f32 master weights (the CUDA device)");
  mem.set_main_grads_dtype(DType::bf16);
}

ShardLayout shard_layout_for(const Mesh& mesh, const Model& model) {
  ShardLayout layout;
  layout.shards[static_cast<int>(ParamGroup::dense)] = mesh.dense->size();
  layout.shards[static_cast<int>(ParamGroup::tensor_parallel)] = mesh.dp_cp->size();
  layout.shards[static_cast<int>(ParamGroup::expert)] = mesh.edp->size();
  layout.bucket_of = [n = model.total_layers()](const std::string& name) { return grad_ready_point(name, n); };
  return layout;
}

Trainer::Trainer(const Config& cfg, const TokenDataset& data, Mesh& mesh, Device device, std::optional<DType> compute)
    : cfg_(cfg),
      mesh_(mesh),
      models_(make_models(cfg_, mesh)),
      model_(*models_.front()),
      exec_(device, cfg.kernels),
      mem_(compute.value_or(device == Device::cuda ? DType::bf16 : DType::f32), exec_),  // GPU: bf16, f32 masters
      opt_(cfg.train),
      loader_(data, cfg.train.seq_len, cfg.train.micro_batch_size, cfg.train.seed, cfg.data.valid_fraction) {
  const int64_t layers = moe_layers_total(cfg.model);
  apply_memory_options(mem_, cfg.train);
  if (cfg.parallel.distributed_optimizer) mem_.shard_layout(shard_layout_for(mesh, model_));
  auto bind_all = [&] { bind_training(mem_, models_, cfg_, buf_); };
  bind_all();  // measure
  // Master weights (and compute copies), gradients, the optimizer's state, activations.
  planned_bytes_ = mem_.param_bytes() + mem_.grad_bytes() + AdamW::state_bytes(mem_, cfg.train) + mem_.act_bytes();
  const size_t host = device == Device::cpu ? host_memory_bytes() : 0;  // a GPU fails its cudaMalloc by itself
  if (host > 0 && planned_bytes_ > host)
    MF_FAIL("the ", cfg.preset, " config needs ", planned_bytes_ >> 20, " MiB of planned memory (parameters, ",
            "gradients, AdamW state, activations) but this machine has ", host >> 20,
            " MiB; choose a smaller model or micro-batch (train.micro_batch_size, model.num_hidden_layers)");
  mem_.allocate();
  bind_all();
  mem_.finish_binding();
  for (const std::unique_ptr<Model>& m : models_)  // rows a dispatch cannot place: counted with the step's sums
    for (int64_t l = 0; l < m->num_moe_layers(); ++l)
      m->moe(l).dispatcher().set_overflow_sinks(buf_.dev_overflow_1, buf_.dev_fill_1);
  shard_groups_ = shard_groups();  // kept: the step loop allocates nothing
  opt_.bind(mem_, shard_groups_);
  opt_.set_overlap_gather(cfg.parallel.overlap_param_gather);
  grads_reducer_.emplace(mem_, model_.total_layers(), grad_groups());
  for (size_t k = 0; k < models_.size(); ++k)
    if (k == 0 || models_[k]->first_layer() != models_[k - 1]->first_layer()) chunk_base_.push_back(k);
  graphs_refusal_ = cuda_graphs_refusal(cfg_, mesh_, device);
  if (cfg_.train.cuda_graphs == "layers" && graphs_refusal_.empty())
    for (const std::unique_ptr<Model>& m : models_) m->set_cuda_graphs(true);
  step_graphs_.set_enabled(cfg_.train.cuda_graphs == "step" && graphs_refusal_.empty());
  if (step_graphs_.enabled())
    for (const std::unique_ptr<Model>& m : models_) m->set_rows_without_waiting(true);
  if (mesh_.dims.pp > 1 || cfg_.parallel.overlap_moe_a2a) {  // decided once: the step loop allocates nothing
    pipeline_ops_ = pipeline_ops(mesh_.dims.pp, mesh_.dims.vpp, mesh_.pp_rank, local_micro_batches(),
                                 cfg_.parallel.overlap_moe_a2a);
    tickets_.resize(models_.size());
  }
  for (std::vector<double>* v :
       {&metrics_.expert_load_max, &metrics_.expert_load_mean, &metrics_.expert_load_p50, &metrics_.expert_load_p90,
        &metrics_.expert_load_p99, &metrics_.expert_load_max_over_mean, &metrics_.expert_load_min,
        &metrics_.expert_load_dropped_fraction})
    v->assign(static_cast<size_t>(layers), 0.0);
  sorted_loads_.assign(static_cast<size_t>(cfg.moe.num_experts), 0.0);
}

void Trainer::shard_batch(size_t slot) {
  const int c = static_cast<int>(mesh_.dims.cp);
  const Mirrored &ids = buf_.ids_BL[slot], &targets = buf_.targets_BL[slot];
  if (c == 1) {
    ids.dev.copy_from(buf_.full_ids_BS);
    targets.dev.copy_from(buf_.full_targets_BS);
    return;
  }
  cp_shard_sequence(buf_.full_ids_BS, c, mesh_.cp_rank, ids.host);
  cp_shard_sequence(buf_.full_targets_BS, c, mesh_.cp_rank, targets.host);
  ids.to_device();
  targets.to_device();
}

void Trainer::load_micro_batch(int64_t position, int64_t i, size_t slot) {
  ProfileScope scope("batch load");
  const int64_t m = cfg_.train.micro_batch_size, s = cfg_.train.seq_len;
  const int64_t first = position + (i * mesh_.dims.dp + mesh_.dp_rank) * m;  // global sample of this micro-batch
  for (int64_t b = 0; b < m; ++b)
    loader_.train_sample(first + b, buf_.full_ids_BS.ptr<int32_t>() + b * s,
                         buf_.full_targets_BS.ptr<int32_t>() + b * s);
  shard_batch(slot);
}

void Trainer::forward_micro_batch(int64_t i, size_t slot) {
  double loss = 0;
  {
    ProfileScope scope("model forward");
    // The first forward waits for each layer's gathered weights as it reaches the layer.
    loss = models_[slot]->forward(
        buf_.ids_BL[slot].dev, buf_.targets_BL[slot].dev,
        i == 0 ? [this](int64_t point) { opt_.wait_weights(point); } : std::function<void(int64_t)>());
  }
  add_forward_results(slot, loss);
}

void Trainer::add_forward_results(size_t slot, double loss) {
  Model& model = *models_[slot];
  if (model.loss_on_device()) {
    add_inplace(exec_, buf_.dev_loss_1, model.loss_sum());
    model.add_mtp_loss(buf_.dev_mtp_1);
  } else {
    host_loss_sum_ += loss;
    host_mtp_sum_ += model.mtp_loss();
  }
  // Router losses, expert loads and the capacity's drops (by this rank's capacity) stay on the
  // device until the step's end.
  ProfileScope scope("expert loads and router losses");
  const int64_t first = moe_layers_before(cfg_.model, model.first_layer());
  for (int64_t l = 0; l < model.num_moe_layers(); ++l) {
    const auto at = static_cast<size_t>(first + l);
    model.moe(l).router().add_step_stats(buf_.dev_router_2, buf_.dev_load_E[at], buf_.dev_dropped_1[at]);
  }
}

void Trainer::run_micro_batch_graphs(int64_t position) {
  Model& model = *models_[0];
  opt_.wait_weights(std::numeric_limits<int64_t>::max());  // the distributed optimizer's gathers: before, not inside
  model.set_loss_on_device(true);
  const int64_t micro = local_micro_batches(), all_micro = micro * mesh_.dims.dp;
  const double lm_scale = 1.0 / static_cast<double>(cfg_.train.global_batch_size * cfg_.train.seq_len);
  const double moe_scale = 1.0 / static_cast<double>(all_micro);
  for (int64_t i = 0; i < micro; ++i) {
    load_micro_batch(position, i, 0);  // the host copies the batch in; the graph reads it there
    auto work = [&] {
      {
        ProfileScope scope("model forward");
        model.forward(buf_.ids_BL[0].dev, buf_.targets_BL[0].dev);
      }
      add_forward_results(0, 0.0);
      ProfileScope scope("model backward");
      model.backward(lm_scale, moe_scale);
    };
    auto replayed = [&] {
      for (int64_t l = 0; l < model.num_moe_layers(); ++l) model.moe(l).forward_replayed();
    };
    step_graphs_.micro_batch(exec_, mem_, work, replayed);
  }
  model.set_loss_on_device(false);  // evaluation reads its losses
}

void Trainer::backward_micro_batch(int64_t i, size_t slot) {
  // Loss = sum of token losses / global tokens + mean over all micro-batches of the router losses.
  // The last micro-batch starts each layer's gradient reduction as its backward ends.
  ProfileScope scope("model backward");
  const int64_t micro = local_micro_batches(), all_micro = micro * mesh_.dims.dp;
  const int64_t tokens = cfg_.train.global_batch_size * cfg_.train.seq_len;
  const bool overlap = cfg_.parallel.overlap_grad_reduce && i + 1 == micro;
  models_[slot]->backward(
      1.0 / static_cast<double>(tokens), 1.0 / static_cast<double>(all_micro),
      overlap ? [this](int64_t point) { grads_reducer_->ready(point); } : std::function<void(int64_t)>());
}

// The ops of pipeline_ops, one by one: receives posted ahead, waited for before their use; sends
// started after the computation that fills them, waited for before their buffer is written again.
void Trainer::run_pipeline(int64_t position) {
  using K = PipelineOpKind;
  Communicator *act_in = mesh_.activations_in(), *act_out = mesh_.activations_out(), *grad_in = mesh_.grads_in(),
               *grad_out = mesh_.grads_out();
  std::vector<Tickets>& t = tickets_;
  auto peer = [](Communicator* c) { return 1 - c->rank(); };
  auto wait = [](Communicator* c, int64_t ticket) {
    ProfileScope scope("pipeline send/recv");
    c->wait(ticket);
  };
  for (const PipelineOp& o : pipeline_ops_) {
    const size_t k = model_index(o.chunk, o.model);
    Model& model = *models_[k];
    Tickets& tk = t[k];
    switch (o.kind) {
      case K::post_recv_activations:
        tk.recv_act = act_in->start_recv(model.input(), peer(act_in));
        break;
      case K::post_recv_grads:
        tk.recv_grad = grad_in->start_recv(model.stream_grad(), peer(grad_in));
        break;
      case K::wait_recv_activations:
        wait(act_in, tk.recv_act);
        break;
      case K::wait_recv_grads:
        wait(grad_in, tk.recv_grad);
        break;
      case K::wait_send_activations:
        wait(act_out, tk.send_act);
        break;
      case K::wait_send_grads:
        wait(grad_out, tk.send_grad);
        break;
      case K::forward:
        load_micro_batch(position, o.micro, k);
        forward_micro_batch(o.micro, k);
        break;
      case K::backward:
        backward_micro_batch(o.micro, k);
        break;
      case K::forward_backward: {
        const size_t kb = model_index(o.chunk, o.model2);
        MF_CHECK(o.micro2 + 1 < local_micro_batches(), "the step's last backward is never paired");
        load_micro_batch(position, o.micro, k);
        const int64_t tokens = cfg_.train.global_batch_size * cfg_.train.seq_len;
        double loss = 0;
        {
          ProfileScope scope("model forward and backward");
          loss = Model::forward_backward(model, buf_.ids_BL[k].dev, buf_.targets_BL[k].dev, *models_[kb],
                                         1.0 / static_cast<double>(tokens),
                                         1.0 / static_cast<double>(local_micro_batches() * mesh_.dims.dp));
        }
        add_forward_results(k, loss);
        break;
      }
      case K::send_activations:
        tk.send_act = act_out->start_send(model.output(), peer(act_out));
        break;
      case K::send_grads:
        tk.send_grad = grad_out->start_send(model.stream_grad(), peer(grad_out));
        break;
    }
  }
}

void Trainer::reduce_embedding_copies() {
  if (mesh_.dims.pp == 1 || cfg_.model.num_nextn_predict_layers == 0) return;
  if (!mesh_.first_stage() && !mesh_.last_stage()) return;
  ProfileScope scope("embedding copies all-reduce");
  mesh_.pp_ends->all_reduce(mem_.grad("model.embed_tokens.weight"), ReduceOp::sum);
}

int64_t Trainer::local_micro_batches() const {
  return cfg_.train.global_batch_size / (cfg_.train.micro_batch_size * mesh_.dims.dp);
}

void Trainer::reduce_dense(const Tensor& t) {
  if (mesh_.dp_cp->size() > 1) mesh_.dp_cp->all_reduce(t, ReduceOp::sum);
}

AdamW::ShardGroups Trainer::shard_groups() const {
  AdamW::ShardGroups out{};
  for (const GradReducer::Group& g : grad_groups()) out[static_cast<size_t>(g.group)] = g.comm;
  return out;
}

std::vector<GradReducer::Group> Trainer::grad_groups() const {
  // Replicated parameters over DP x CP x TP (sequence parallelism gives each TP rank other
  // tokens), TP shards over DP x CP, experts over EDP (shard_layout_for: the same groups).
  return {{ParamGroup::dense, mesh_.dense.get()},
          {ParamGroup::tensor_parallel, mesh_.dp_cp.get()},
          {ParamGroup::expert, mesh_.edp.get()}};
}

void Trainer::init_fresh() {
  Model::init_params(exec_, mem_.params(), cfg_.train.seed);
  opt_.scatter_state();  // the compute copies (and, sharded, the master shards) from the values
  step_ = 0;
  loader_.set_position(0);
}

void Trainer::load(const std::string& ckpt) {
  opt_.prepare_state();  // sharded: host tensors for the moments to load into
  TrainerState s = load_checkpoint(ckpt, mem_.params(), &opt_, mesh_.pp.get());
  opt_.scatter_state();
  step_ = s.step;
  loader_.set_position(s.data_position);
}

std::string Trainer::save(CheckpointWriter& writer) {
  TrainerState s{step_, loader_.position(), cfg_.train.seed};
  opt_.gather_state();  // sharded: the whole state where the checkpoint reads it
  std::string dir;
  try {
    dir = writer.save(mem_.params(), opt_, s, config_to_toml(cfg_));
  } catch (const Error&) {
    opt_.release_state();
    throw;
  }
  opt_.release_state();
  return dir;
}

std::string Trainer::save(const std::string& checkpoints_dir) {
  CheckpointWriter writer(checkpoints_dir, mesh_);
  return save(writer);
}

void Trainer::gather_master_weights() {
  opt_.gather_state();
  opt_.release_state();
}

void Trainer::accumulate_gradients() {
  const int64_t s = cfg_.train.seq_len, dp = mesh_.dims.dp;
  const int64_t micro = local_micro_batches(), all_micro = micro * dp;
  const int64_t tokens = cfg_.train.global_batch_size * s;
  const int64_t layers = moe_layers_total(cfg_.model), experts = cfg_.moe.num_experts;
  const int64_t position = loader_.position();
  double* stats = buf_.stats.ptr<double>();
  double* load = buf_.load_sum_LE.ptr<double>();
  {
    ProfileScope scope("zero grads");
    mem_.zero_grads();
    buf_.sums.host.zero();
    buf_.sums.to_device(-1, &exec_);
    host_loss_sum_ = host_mtp_sum_ = 0;
    take_inter_node_bytes();  // what evaluation sent since the last step is not this step's
  }
  if (mesh_.dims.pp > 1 || cfg_.parallel.overlap_moe_a2a) {
    run_pipeline(position);
  } else if (step_graphs_.enabled()) {
    run_micro_batch_graphs(position);
  } else {
    for (int64_t i = 0; i < micro; ++i) {
      load_micro_batch(position, i, 0);
      forward_micro_batch(i, 0);
      backward_micro_batch(i, 0);
    }
  }
  loader_.set_position(position + cfg_.train.global_batch_size);
  reduce_embedding_copies();
  {
    ProfileScope scope("gradient all-reduce");  // with overlap: the rest, and the wait for all
    if (cfg_.parallel.overlap_grad_reduce)
      grads_reducer_->finish();
    else
      grads_reducer_->reduce_all();
  }
  // Global norm: every element once. Replicated gradients are identical on every rank after the
  // reduction; TP shards are disjoint over TP, expert shards over EP x ETP.
  // Sharded: each rank's slots, summed over the shard group first.
  double dense_sq = 0, expert_sq = 0;
  {
    ProfileScope scope("grad norm");  // sum_squares returns to the host: one wait for the stream
    double sq[2] = {0, 0};
    if (mem_.sharded()) {
      const AdamW::ShardGroups& groups = shard_groups_;
      double owned[kNumParamGroups];
      for (int g = 0; g < kNumParamGroups; ++g) {
        owned[g] = opt_.owned_grad_squares(static_cast<ParamGroup>(g));
        Communicator* c = groups[static_cast<size_t>(g)];
        if (c->size() > 1) c->all_reduce(Tensor(&owned[g], DType::f64, {1}), ReduceOp::sum);
      }
      sq[0] = owned[static_cast<int>(ParamGroup::tensor_parallel)];
      sq[1] = owned[static_cast<int>(ParamGroup::expert)];
      dense_sq = owned[static_cast<int>(ParamGroup::dense)];
    } else {
      // tensor-parallel, expert, dense, then the embedding's copy on the last stage (its owner counts it).
      Tensor blocks[kMaxSumSquares] = {mem_.grad_block(ParamGroup::tensor_parallel),
                                       mem_.grad_block(ParamGroup::expert), mem_.grad_block(ParamGroup::dense)};
      size_t n = 3;
      for (const Param& p : mem_.params())
        if (p.pipeline_copy) {
          MF_CHECK(n < kMaxSumSquares, "more pipeline copies than the gradient norm takes");
          blocks[n++] = p.grad;
        }
      double s[kMaxSumSquares];
      sum_squares_each(exec_, std::span<const Tensor>(blocks, n), std::span<double>(s, n));
      sq[0] = s[0];
      for (size_t i = 3; i < n; ++i) sq[0] -= s[i];
      sq[1] = s[1];
      dense_sq = s[2];
    }
    if (mesh_.tp->size() > 1) mesh_.tp->all_reduce(Tensor(&sq[0], DType::f64, {1}), ReduceOp::sum);
    if (mesh_.ep_etp->size() > 1) mesh_.ep_etp->all_reduce(Tensor(&sq[1], DType::f64, {1}), ReduceOp::sum);
    expert_sq = sq[0] + sq[1];
    if (mesh_.dims.pp > 1) {  // every stage's parameters (an embedding copy counted by its owner only)
      double both[2] = {dense_sq, expert_sq};
      mesh_.pp->all_reduce(Tensor(both, DType::f64, {2}), ReduceOp::sum);
      dense_sq = both[0];
      expert_sq = both[1];
    }
  }
  {
    // What the forwards left on the device (the grad norm has waited for the stream already).
    ProfileScope scope("statistics read-back");
    buf_.sums.to_host(-1, &exec_);
    stats[0] += host_loss_sum_;  // one of the two is 0: the loss sums stay bit for bit what they are
    stats[3] += host_mtp_sum_;
  }
  buf_.inter_node_bytes.ptr<double>()[0] = static_cast<double>(take_inter_node_bytes());
  {
    // The LM loss is complete on every TP rank; router losses and expert loads are per TP rank.
    ProfileScope scope("stats all-reduce");
    reduce_dense(buf_.stats);
    reduce_dense(buf_.step_sums);
    if (mesh_.tp->size() > 1) {
      mesh_.tp->all_reduce(buf_.stats.slice(1, 3), ReduceOp::sum);
      mesh_.tp->all_reduce(buf_.step_sums, ReduceOp::sum);
    }
    if (mesh_.dims.pp > 1) {  // each stage's losses and its layers' loads
      mesh_.pp->all_reduce(buf_.stats, ReduceOp::sum);
      mesh_.pp->all_reduce(buf_.step_sums, ReduceOp::sum);
    }
    if (slot_exchange()) mesh_.world->all_reduce(buf_.slot_fill, ReduceOp::max);
  }

  StepMetrics& out = metrics_;
  out.lm_loss = stats[0] / static_cast<double>(tokens);
  out.aux_loss = stats[1] / static_cast<double>(all_micro);
  out.z_loss = stats[2] / static_cast<double>(all_micro);
  out.mtp_loss = stats[3] / static_cast<double>(tokens);  // complete on every TP rank, like the LM loss
  out.loss = out.lm_loss + out.aux_loss + out.z_loss + out.mtp_loss;
  out.grad_norm = std::sqrt(dense_sq + expert_sq);
  out.tokens = tokens;
  std::vector<double>& sorted = sorted_loads_;  // the step loop allocates nothing
  for (int64_t l = 0; l < layers; ++l) {
    const double* c = load + l * experts;
    double sum = 0;
    for (int64_t e = 0; e < experts; ++e) sum += c[e];
    std::copy(c, c + experts, sorted.begin());
    std::sort(sorted.begin(), sorted.end());
    const double mean = sum / static_cast<double>(experts);
    // Nearest rank: the smallest load with at least p of the experts at or below it.
    auto pct = [&](double p) {
      const auto rank = static_cast<size_t>(std::ceil(p * static_cast<double>(experts)));
      return sorted[std::max<size_t>(rank, 1) - 1] / (mean > 0 ? mean : 1);
    };
    out.expert_load_max[l] = sorted.back();
    out.expert_load_mean[l] = mean;
    out.expert_load_p50[l] = pct(0.50);
    out.expert_load_p90[l] = pct(0.90);
    out.expert_load_p99[l] = pct(0.99);
    out.expert_load_max_over_mean[l] = pct(1.0);
    out.expert_load_min[l] = sorted.front();
    out.expert_load_dropped_fraction[l] = sum > 0 ? buf_.dropped_L.ptr<double>()[l] / sum : 0;
  }
  out.inter_node_bytes = buf_.inter_node_bytes.ptr<double>()[0];
  out.ep_slot_fill = buf_.slot_fill.ptr<double>()[0];
  fail_on_overflow(buf_.overflow_rows.ptr<double>()[0], out.ep_slot_fill, "step " + std::to_string(step_ + 1));
}

void Trainer::fail_on_overflow(double rows, double fill, const std::string& where) const {
  if (rows == 0) return;  // the same sum on every rank: every rank fails alike
  MF_FAIL(where, ": ", rows, " rows of the expert-parallel exchange did not fit its fixed slots (moe.dispatcher = \"",
          cfg_.moe.dispatcher, "\", moe.ep_recv_factor = ", cfg_.moe.ep_recv_factor,
          "); raise moe.ep_recv_factor (this routing asked for up to ", fill,
          " times a bound, and the bounds grow with it; moefold plan shows what it costs) or set it to 0 for the "
          "worst case");
}

std::string Trainer::cuda_graphs_note() const {
  if (cfg_.train.cuda_graphs == "none") return "";
  const std::string mode = "train.cuda_graphs = \"" + cfg_.train.cuda_graphs + "\"";
  if (!graphs_refusal_.empty()) return mode + " not used: " + graphs_refusal_;
  if (!step_graphs_.fallback().empty()) return mode + " stopped: " + step_graphs_.fallback();
  for (const std::unique_ptr<Model>& m : models_)
    if (!m->cuda_graphs().fallback().empty()) return mode + " stopped: " + m->cuda_graphs().fallback();
  return "";
}

void Trainer::quantize_fp8_weights_before_graphs() {
  if (cfg_.train.fp8 == "none" || cfg_.train.cuda_graphs == "none" || !graphs_refusal_.empty()) return;
  opt_.wait_all_weights();
  fp8_quantize_changed_params(mem_);
}

int64_t Trainer::cuda_graph_replays() const {
  int64_t n = step_graphs_.replays();
  for (const std::unique_ptr<Model>& m : models_) n += m->cuda_graphs().replays();
  return n;
}

int64_t Trainer::take_inter_node_bytes() {
  int64_t n = 0;
  for (const std::unique_ptr<Model>& m : models_)
    for (int64_t l = 0; l < m->num_moe_layers(); ++l) n += m->moe(l).dispatcher().take_inter_node_bytes();
  return n;
}

const StepMetrics& Trainer::train_step() {
  (void)fault_point("train.step");
  auto t0 = std::chrono::steady_clock::now();
  mem_.weights_changed();  // the optimizer, a load or an initialisation may have run since the last forward
  quantize_fp8_weights_before_graphs();
  accumulate_gradients();
  StepMetrics& out = metrics_;
  out.lr = learning_rate(cfg_.train, step_);
  // The loss and the norm are global (reduced over every rank): every rank decides alike.
  out.skipped = !std::isfinite(out.loss) || !std::isfinite(out.grad_norm);
  if (out.skipped && cfg_.train.on_nonfinite == "stop") fail_nonfinite();
  if (!out.skipped) {
    // Global-norm clipping inside the optimizer's pass (one read of the gradients, not three).
    ProfileScope scope("optimizer step");
    opt_.step(mem_.params(), out.lr, clip_factor(out.grad_norm, cfg_.train.grad_clip));
  }
  if (cfg_.moe.expert_bias && !out.skipped) {  // aux-loss-free balancing from this step's loads (every rank's tokens)
    ProfileScope scope("expert bias update");
    const double* load = buf_.load_sum_LE.ptr<double>();
    const int64_t experts = cfg_.moe.num_experts;
    for (const size_t base : chunk_base_) {  // each chunk's layers (a chunk's models share the bias)
      Model& model = *models_[base];
      const int64_t first = moe_layers_before(cfg_.model, model.first_layer());
      for (int64_t l = 0; l < model.num_moe_layers(); ++l) {
        int64_t* counts = buf_.counts_E.host.ptr<int64_t>();
        for (int64_t e = 0; e < experts; ++e) counts[e] = static_cast<int64_t>(load[(first + l) * experts + e]);
        buf_.counts_E.to_device();
        model.moe(l).update_expert_bias(buf_.counts_E.dev, cfg_.moe.expert_bias_update_rate);
      }
    }
  }
  ++step_;
  out.step = step_;
  out.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return out;
}

void Trainer::fail_nonfinite() const {
  const StepMetrics& m = metrics_;
  std::string first = "none on this rank";
  for (const Param& p : mem_.params())
    if (!std::isfinite(sum_squares(exec_, p.grad))) {
      first = p.name;
      break;
    }
  MF_FAIL("step ", step_ + 1, ": loss ", m.loss, ", gradient norm ", m.grad_norm,
          " (train.on_nonfinite = \"stop\"; \"skip\" drops such steps); first non-finite gradient on rank ",
          mesh_.world_rank, ": ", first);
}

double Trainer::evaluate() {
  const int64_t dp = mesh_.dims.dp, nv = loader_.num_valid_batches();
  if (nv == 0) return 0.0;
  opt_.wait_all_weights();
  mem_.weights_changed();
  quantize_fp8_weights_before_graphs();
  // Every rank runs the same number of forwards (expert parallelism exchanges tokens), so the
  // evaluated batches are rounded down to a multiple of dp (at least dp).
  const int64_t per_rank = std::max<int64_t>(1, std::min(cfg_.train.eval_batches, nv) / dp);
  double sum = 0;
  const bool slots = slot_exchange();  // the one dispatcher that can overflow
  if (slots) {                         // what the evaluation's dispatches cannot place (each step zeroes its own)
    buf_.overflow_rows.zero();
    buf_.dev_overflow_1.copy_from(buf_.overflow_rows);
    buf_.slot_fill.zero();
    buf_.dev_fill_1.copy_from(buf_.slot_fill);
  }
  // Pipeline: forward only, each batch through the chunks in order (virtual stage by virtual stage).
  Communicator *in = mesh_.activations_in(), *out = mesh_.activations_out();
  std::vector<int64_t> sending(chunk_base_.size(), -1);
  const int64_t last = mesh_.dims.pp * mesh_.dims.vpp - 1;
  for (int64_t i = 0; i < per_rank; ++i) {
    loader_.valid_batch((i * dp + mesh_.dp_rank) % nv, buf_.full_ids_BS.ptr<int32_t>(),
                        buf_.full_targets_BS.ptr<int32_t>());
    for (size_t c = 0; c < chunk_base_.size(); ++c) {
      const size_t k = chunk_base_[c];
      Model& model = *models_[k];
      const int64_t v = static_cast<int64_t>(c) * mesh_.dims.pp + mesh_.pp_rank;
      shard_batch(k);
      if (v > 0) in->wait(in->start_recv(model.input(), 1 - in->rank()));
      if (sending[c] >= 0) out->wait(sending[c]);  // the output is written again
      sum += model.forward(buf_.ids_BL[k].dev, buf_.targets_BL[k].dev);
      sending[c] = v < last ? out->start_send(model.output(), 1 - out->rank()) : -1;
    }
  }
  for (const int64_t ticket : sending)
    if (ticket >= 0) out->wait(ticket);
  if (slots) {
    buf_.overflow_rows.copy_from(buf_.dev_overflow_1);
    buf_.slot_fill.copy_from(buf_.dev_fill_1);
    mesh_.world->all_reduce(buf_.overflow_rows, ReduceOp::sum);
    mesh_.world->all_reduce(buf_.slot_fill, ReduceOp::max);
    fail_on_overflow(buf_.overflow_rows.ptr<double>()[0], buf_.slot_fill.ptr<double>()[0], "evaluation");
  }
  buf_.stats.ptr<double>()[0] = sum;
  reduce_dense(buf_.stats.slice(0, 1));
  if (mesh_.dims.pp > 1) mesh_.pp->all_reduce(buf_.stats.slice(0, 1), ReduceOp::sum);  // the last stage's
  return buf_.stats.ptr<double>()[0] /
         static_cast<double>(per_rank * dp * cfg_.train.micro_batch_size * cfg_.train.seq_len);
}

}  // namespace moefold
