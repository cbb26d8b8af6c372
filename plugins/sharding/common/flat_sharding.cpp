#include "sharding/common/flat_sharding.hpp"

#include <algorithm>
#include <cmath>

#include "loom/error.hpp"
#include "loom/log.hpp"
#include "loom/trace.hpp"

namespace loom::shard {
namespace {

const char* strategy_name(Strategy s) {
  switch (s) {
    case Strategy::ddp: return "ddp";
    case Strategy::zero1: return "zero1";
    case Strategy::zero2: return "zero2";
    case Strategy::zero3: return "zero3";
    case Strategy::hybrid: return "hybrid_shard";
  }
  return "?";
}

// A rotating scratch buffer and the last collective that read or wrote it:
// before the compute stream rewrites it, it waits for that collective.
struct Slot {
  Tensor t;
  Communicator* comm = nullptr;
  CommTicket ticket = 0;
  void wait(const ExecContext& ctx) {
    if (comm && ticket) comm->wait(ctx, ticket);
  }
  void used_by(Communicator* c, CommTicket tk) { comm = c, ticket = tk; }
};

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

}  // namespace

struct FlatSharding::Impl {
  // Configuration.
  Strategy strategy;
  std::string name;
  int rank = 0, world = 1;
  int group = 1;     // shard group size (g): ddp 1, zero* world, hybrid shard_group_size
  int replicas = 1;  // world / group
  bool reshard_after_forward = true;
  int prefetch = 1;
  DType reduce_dtype = DType::f32;

  bool shard_optim() const { return strategy != Strategy::ddp; }
  // Gradients reduced into the shard every micro-batch (and only a shard kept).
  bool shard_grads() const { return strategy == Strategy::zero2 || strategy == Strategy::zero3 || strategy == Strategy::hybrid; }
  bool shard_params() const { return strategy == Strategy::zero3 || strategy == Strategy::hybrid; }

  // Groups. shard: the ranks a unit is split over; replica: the ranks holding
  // the same shard (size 1 unless ddp or hybrid).
  Communicator* world_comm = nullptr;
  std::unique_ptr<Communicator> shard_own, replica_own;
  Communicator* shard = nullptr;
  Communicator* replica = nullptr;

  // Per unit.
  struct Unit {
    int64_t numel = 0, padded = 0, chunk = 0, begin = 0;
    bool tied_target = false;  // another unit reads its params (the embedding of a tied model)
    bool experts = false;      // a layer's experts under expert parallelism (UnitInfo::expert_group)
    // zero3/hybrid resharding after forward: gathered again before its
    // backward (the gather schedule's backward events, setup()).
    bool gathered_for_backward = false;
    // FP8 gathers: none of its weights travels in FP8 (the codec says so,
    // GatherCodecPlainUnits), so it is gathered as its parameters, as
    // without the codec: no wire buffer, no decode.
    bool plain = false;
    CommTicket gather_ticket = 0;  // zero1/zero2: the post-step all-gather of its params
  };
  std::vector<Unit> units;
  int64_t max_padded = 0, max_chunk = 0;  // over units that use the rotating buffers
  DType param_dtype = DType::f32, grad_dtype = DType::f32;
  int64_t grad_accum = 1;

  // Scratch (in the order scratch() asks for it).
  Slot grad_pool[2];       // shard_grads: whole-unit gradient buffers the backward writes into
  Slot stage[2];           // grads converted to reduce_dtype before reducing (when they differ)
  Tensor rtmp[2];          // reduce-scatter output when it cannot land in the shard directly (read: rtmp_read)
  Tensor ftmp;             // rtmp converted to fp32 (reduce_dtype != fp32)
  std::vector<Slot> gather_pool;     // zero3/hybrid with reshard_after_forward: prefetch + 1 buffers
  std::vector<Tensor> gather_own;    // per unit (reshard_after_forward = false), or the tied target's
  Slot tied_grads;                   // ticket of the last reduce that read the tied target's grads
  int grad_slot = 0, stage_slot = 0, rtmp_slot = 0;

  std::vector<UnitState>* state = nullptr;

  // FP8 weight gathers (gather_dtype = "fp8", the recipe's GatherCodec): each
  // gathered unit's own chunk is encoded once after the parameters change
  // (wire_shard, `encoded` false until then), every gather moves wire bytes
  // into a wire slot, and the unit's params are decoded from it just before
  // the compute that reads them. A unit without FP8 weights (Unit::plain)
  // is gathered as its parameters instead.
  bool fp8_gather = false;
  std::string gather_where;
  GatherCodec* codec = nullptr;
  std::vector<Tensor> wire_shard;  // per unit (empty for units not gathered)
  std::vector<Slot> wire_pool;     // one per gather buffer (gather_pool, or a unit's own)
  std::vector<int> wire_slot_of;   // per unit with its own gathered buffer: its wire slot, else -1
  // The unit travels as FP8 wire (gathered through the codec).
  bool via_wire(size_t ui) const { return fp8_gather && !units[ui].experts && !units[ui].plain; }
  bool encoded = false;
  int64_t max_wire = 0;

  // Expert parallelism: experts units are split over groups of `ep`
  // consecutive ranks, each rank holding its experts' range whole (never
  // gathered); expert_replica: the world / ep ranks holding the same range,
  // whose gradients are added on the last micro-batch.
  int ep = 1;
  std::unique_ptr<Communicator> expert_replica_own;
  Communicator* expert_replica = nullptr;
  CommTicket last_expert = 0;

  // zero3/hybrid gather schedule of one micro-batch: unit per event, in the
  // order forward then (reshard_after_forward) backward uses them.
  std::vector<int> events;
  std::vector<CommTicket> event_ticket;
  std::vector<int> event_slot;
  size_t next_event = 0, issued = 0;
  bool started_early = false;  // the next micro-batch's first gathers were issued in the last backward
  int kept_unit = -1;  // the last unit of the forward, whose backward reads the forward's gather

  // A reduce-scatter that lands in rtmp is added into the unit's fp32 shard on
  // the optimizer queue (OptimizerOps::optimizer_queue, the second stream on
  // CUDA), which waits for the collective: the compute queue goes on with the
  // next unit's backward instead of waiting for the reduce-scatter and then
  // adding a whole shard between two layers. Markers on that queue: after
  // the add that last read each rtmp slot (the collective that rewrites the
  // slot waits for it) and after the last add of all (what reads a shard,
  // the optimizer step or a replica all-reduce, waits for it).
  static constexpr uint64_t kNoMarker = ~uint64_t{0};
  uint64_t rtmp_read[2] = {kNoMarker, kNoMarker};
  uint64_t landed = kNoMarker;
  int micro = 0;
  CommTicket last_shard = 0, last_replica = 0, last_world = 0;

  // ---- helpers ----
  std::string where(const UnitState& u) const {
    return cat("sharding.plugin = \"", name, "\", unit ", u.info->name);
  }

  void track(Communicator* c, CommTicket t) {
    if (c == shard) last_shard = std::max(last_shard, t);
    if (c == replica) last_replica = std::max(last_replica, t);
    if (c == world_comm) last_world = std::max(last_world, t);
  }

  // Issue the all-gather of event e's unit into its buffer.
  void issue_gather(ShardingEnv& env, size_t e) {
    const int ui = events[e];
    UnitState& u = (*state)[static_cast<size_t>(ui)];
    const Unit& m = units[static_cast<size_t>(ui)];
    Tensor out;
    if (!gather_own.empty() && gather_own[static_cast<size_t>(ui)].data) {
      out = gather_own[static_cast<size_t>(ui)];
    } else {
      Slot& s = gather_pool[e % gather_pool.size()];
      out = view(s.t, 0, {m.padded});
      event_slot[e] = static_cast<int>(e % gather_pool.size());
    }
    if (via_wire(static_cast<size_t>(ui))) {
      // The wire slot of this event's buffer; the params are decoded at use.
      Slot& w = wire_pool[wire_index(e, ui)];
      Tensor wout = view(w.t, 0, {codec->wire_chunk_bytes(ui) * group});
      CommTicket t = shard->all_gather(env.ctx, wire_shard[static_cast<size_t>(ui)], wout);
      track(shard, t);
      event_ticket[e] = t;
      w.used_by(shard, t);
      return;
    }
    CommTicket t = shard->all_gather(env.ctx, u.param_shard, out);
    track(shard, t);
    event_ticket[e] = t;
    if (event_slot[e] >= 0) gather_pool[static_cast<size_t>(event_slot[e])].used_by(shard, t);
  }

  // The wire slot of event e (of unit ui): its gather buffer's.
  size_t wire_index(size_t e, int ui) const {
    const int own = wire_slot_of.empty() ? -1 : wire_slot_of[static_cast<size_t>(ui)];
    return own >= 0 ? static_cast<size_t>(own) : e % gather_pool.size();
  }

  // A new micro-batch's (or evaluation's) schedule: nothing used, nothing issued.
  void restart_schedule() {
    next_event = 0;
    issued = 0;
    std::fill(event_slot.begin(), event_slot.end(), -1);
  }

  // The end of a backward that another micro-batch of the step follows: its
  // first gathers go on the comm stream now, ahead of the reduce-scatter of
  // the unit just finished. Issued at the next forward instead, they would
  // wait behind that reduce-scatter (the embedding's gradient, the largest
  // unit's), and the forward with them. Their buffers are free: the compute
  // that read them is all queued, and each gather starts after it.
  void start_next_micro(ShardingEnv& env) {
    if (events.empty()) return;
    restart_schedule();
    const size_t last = std::min(events.size() - 1, static_cast<size_t>(prefetch));
    while (issued <= last) issue_gather(env, issued++);
    started_early = true;
  }

  // Make event e's gathered params ready for the compute stream, issuing up to
  // `prefetch` later gathers first so they overlap this unit's compute.
  void use_event(ShardingEnv& env, UnitState& u) {
    LOOM_CHECK(next_event < events.size() && events[next_event] == u.index, where(u),
               ": units ran out of the order the gather schedule expects (event ", next_event, ")");
    const size_t e = next_event++;
    const size_t last = std::min(events.size() - 1, e + static_cast<size_t>(prefetch));
    while (issued <= last) issue_gather(env, issued++);
    {
      // Traced (benchmarks/trace_gaps.py): how long the compute stream waits here for the gather.
      trace::Scope r(trace::Track::compute, "gather.wait", env.ctx.stream);
      shard->wait(env.ctx, event_ticket[e]);
    }
    // The unit reads its params from this event's buffer until its next event.
    const int ui = events[e];
    if (!gather_own.empty() && gather_own[static_cast<size_t>(ui)].data) u.params = gather_own[static_cast<size_t>(ui)];
    else u.params = view(gather_pool[static_cast<size_t>(event_slot[e])].t, 0, {units[static_cast<size_t>(ui)].padded});
    if (via_wire(static_cast<size_t>(ui))) {
      // On the compute queue: the wire slot's next gather is issued after this.
      const Tensor w = view(wire_pool[wire_index(e, ui)].t, 0, {codec->wire_chunk_bytes(ui) * group});
      trace::Scope r(trace::Track::compute, "gather.decode", env.ctx.stream);
      codec->decode(env.ctx, ui, w, u.params);
    }
  }

  // The compute queue's later work sees every shard complete: it waits for
  // the last add queued on the optimizer queue (no host wait).
  void shards_landed(ShardingEnv& env) {
    if (landed != kNoMarker) env.ops->wait(env.ctx, landed);
  }

  // On the optimizer queue, after reduce-scatter t into `out` (rtmp[slot]):
  // out into the unit's fp32 shard (written on the step's first micro-batch,
  // added to after it).
  void land_on_queue(ShardingEnv& env, UnitState& u, const Tensor& out, int slot, CommTicket t, bool first) {
    const ExecContext q = env.ops->optimizer_queue(env.ctx);
    shard->wait(q, t);
    Tensor src = out;
    if (reduce_dtype != DType::f32) {
      Tensor f = view(ftmp, 0, {out.numel()});  // one buffer: the adds run in order on their queue
      env.ops->convert(q, f, src);
      src = f;
    }
    if (first) env.ops->convert(q, u.grad_shard, src);
    else env.ops->accumulate(q, u.grad_shard, src);
    rtmp_read[slot] = landed = env.ops->mark(q);
  }

  // The unit's gradients in reduce_dtype: the grads themselves, or a staged copy.
  Tensor reduce_input(ShardingEnv& env, UnitState& u, int64_t n) {
    Tensor g = view(u.grads, 0, {n});
    if (grad_dtype == reduce_dtype) return g;
    Slot& s = stage[stage_slot];
    stage_slot ^= 1;
    s.wait(env.ctx);
    Tensor st = view(s.t, 0, {n});
    env.ops->convert(env.ctx, st, g);
    return st;
  }
  Slot* last_stage() { return grad_dtype == reduce_dtype ? nullptr : &stage[stage_slot ^ 1]; }

  // Reduce-scatter the unit's whole gradient into its shard (accumulating
  // after the first micro-batch of the step).
  void reduce_scatter_unit(ShardingEnv& env, UnitState& u, bool first) {
    const Unit& m = units[static_cast<size_t>(u.index)];
    Tensor in = reduce_input(env, u, m.padded);
    const bool direct = first && reduce_dtype == DType::f32;
    Tensor out;
    int slot = 0;
    if (direct) {
      out = u.grad_shard;
    } else {
      slot = rtmp_slot;
      rtmp_slot ^= 1;
      // The collective below rewrites the slot after the add that read it
      // last (two reduce-scatters ago) on the optimizer queue: it starts after
      // the compute queue's work queued so far, which now waits for that add.
      if (rtmp_read[slot] != kNoMarker) env.ops->wait(env.ctx, rtmp_read[slot]);
      out = view(rtmp[slot], 0, {m.chunk});
    }
    CommTicket t = shard->reduce_scatter(env.ctx, in, out, ReduceOp::sum);
    track(shard, t);
    if (Slot* s = last_stage()) s->used_by(shard, t);
    if (shard_grads()) {
      if (m.tied_target) tied_grads.used_by(shard, t);
      else grad_pool[grad_slot ^ 1].used_by(shard, t);  // the slot before_backward handed this unit
    }
    if (!direct) land_on_queue(env, u, out, slot, t, first);
  }
};

FlatSharding::FlatSharding(const PluginInit& init, Strategy strategy, std::string name)
    : impl_(std::make_unique<Impl>()) {
  Impl& I = *impl_;
  I.strategy = strategy;
  I.name = std::move(name);
  I.rank = init.rank;
  I.world = init.world;
  // The table first: every key read and unknown ones refused before
  // anything about the run is, so a key this strategy does not take is named
  // as that (listing the ones it takes) however the process was started
  // (`loom compare` lists them for a --strategies item's keys).
  const ConfigTable& t = init.config;
  const std::string rd = t.get_choice("reduce_dtype", "fp32", {"fp32", "bf16"});
  I.reduce_dtype = rd == "fp32" ? DType::f32 : DType::bf16;
  if (I.shard_params()) {
    I.reshard_after_forward = t.get_bool("reshard_after_forward", true);
    I.prefetch = static_cast<int>(t.get_int("prefetch", 1, 0, 8));
    I.fp8_gather = t.get_choice("gather_dtype", "param", {"param", "fp8"}) == "fp8";
    I.gather_where = t.where("gather_dtype");
  } else if (const std::vector<std::string> present = t.keys();
             std::find(present.begin(), present.end(), "gather_dtype") != present.end()) {
    // Looked up without has(), which would list it among the keys this strategy takes.
    t.fail("gather_dtype", cat("gather_dtype applies to the strategies that gather parameters before each unit's ",
                               "compute (zero3, full_shard, hybrid_shard); sharding.plugin = \"", I.name,
                               "\" keeps whole parameters on every rank: remove the key"));
  }
  const int64_t local = init.local_world > 0 ? init.local_world : 1;
  const int64_t group = strategy == Strategy::hybrid ? t.get_int("shard_group_size", local, 1, 1 << 20) : 0;
  t.finish();
  // A strategy splits the work across ranks: started as one plain process
  // there is nothing to split, and the user most likely forgot the launcher.
  if (!init.under_launcher && init.world == 1)
    throw Error(cat("sharding.plugin = \"", I.name, "\" splits the work across ranks, but this process was started "
                    "alone: launch it with `mpirun -np N loom ...` (or `srun --mpi=pmix ...` under Slurm), or set "
                    "sharding.plugin = \"none\" for one process; `loom check --world-size N` plans it for N ranks "
                    "without starting them"));
  if (I.reduce_dtype == DType::bf16 && init.device != Device::cuda)
    t.fail("reduce_dtype", "reduce_dtype = \"bf16\" needs run.device = \"cuda\"; the CPU path reduces in fp32");
  if (strategy == Strategy::hybrid) {
    if (init.world % group != 0)
      t.fail("shard_group_size", cat("shard_group_size = ", group, " does not divide the world size ", init.world,
                                     ": pick a divisor of ", init.world, " (the default is the ranks per node, ",
                                     local, ")"));
    I.group = static_cast<int>(group);
  } else if (strategy == Strategy::ddp) {
    I.group = 1;
  } else {
    I.group = init.world;
  }
  I.replicas = init.world / I.group;
}

FlatSharding::~FlatSharding() = default;

std::vector<UnitLayout> FlatSharding::plan(const ShardingEnv& env, const std::vector<UnitInfo>& infos) {
  Impl& I = *impl_;
  LOOM_CHECK(env.world && env.host && env.ops, "sharding.plugin = \"", I.name, "\": the core gave no communicator");
  LOOM_CHECK(env.world->size() == I.world, "sharding.plugin = \"", I.name, "\": communicator has ",
             env.world->size(), " ranks, the plugin was created for ", I.world);
  I.world_comm = env.world;
  // Shard group: consecutive ranks (one node under the default hybrid
  // group); replica group: the ranks with the same position in their group.
  const int gi = I.rank / I.group, gr = I.rank % I.group;
  I.shard_own = env.world->split(gi, gr);
  I.replica_own = env.world->split(gr, gi);
  I.shard = I.shard_own.get();
  I.replica = I.replica_own.get();
  I.param_dtype = env.param_dtype;
  I.grad_dtype = env.grad_dtype;
  I.grad_accum = env.grad_accum;

  I.units.assign(infos.size(), {});
  for (const UnitInfo& u : infos)
    if (u.uses_params_of >= 0) I.units.at(static_cast<size_t>(u.uses_params_of)).tied_target = true;
  for (const UnitInfo& u : infos)
    if (u.expert_group > 1) {
      LOOM_CHECK(I.ep == 1 || I.ep == u.expert_group, "sharding.plugin = \"", I.name,
                 "\": experts units split over groups of ", I.ep, " and ", u.expert_group, " ranks");
      I.ep = u.expert_group;
    }
  if (I.ep > 1) {
    LOOM_CHECK(I.world % I.ep == 0, "sharding.expert_parallel = ", I.ep, " does not divide the ", I.world, " ranks");
    I.expert_replica_own = env.world->split(I.rank % I.ep, I.rank / I.ep);
    I.expert_replica = I.expert_replica_own.get();
  }
  if (I.fp8_gather) {
    if (!env.codec || env.codec->fp8_weights() == 0)
      throw Error(cat(I.gather_where, ": sharding.gather_dtype = \"fp8\" moves the weights that the precision recipe casts to ",
                      "FP8 per tensor from their current amax, and there are none: ",
                      env.codec ? env.codec->why_none() : std::string("the core offers no FP8 gathers"),
                      ". Use precision.plugin = \"fp8_current\", or gather_dtype = \"param\""));
    I.codec = env.codec;
  }
  std::vector<UnitLayout> out;
  for (size_t i = 0; i < infos.size(); ++i) {
    Impl::Unit& m = I.units[i];
    m.numel = infos[i].numel;
    if (infos[i].expert_group > 1) {
      // This rank's experts: a range of whole experts, held with its gradient
      // and optimizer state; replicas: the ranks of the other groups.
      LOOM_CHECK(m.numel % I.ep == 0, "sharding.plugin = \"", I.name, "\": unit ", infos[i].name, " of ", m.numel,
                 " elements does not split over ", I.ep, " ranks");
      m.experts = true;
      m.chunk = m.numel / I.ep;
      m.padded = m.numel;
      m.begin = static_cast<int64_t>(I.rank % I.ep) * m.chunk;
      UnitLayout l;
      l.padded_numel = m.padded;
      l.params_sharded = true;
      l.param_numel = m.chunk;
      l.grad_numel = m.chunk;
      l.optim_numel = m.chunk;
      l.optim_begin = m.begin;
      l.replicas = I.world / I.ep;
      l.replica = I.rank / I.ep;
      out.push_back(l);
      continue;
    }
    m.chunk = ceil_div(m.numel, I.group);
    m.padded = m.chunk * I.group;
    m.begin = static_cast<int64_t>(gr) * m.chunk;
    if (!m.tied_target) {
      I.max_padded = std::max(I.max_padded, m.padded);
      I.max_chunk = std::max(I.max_chunk, m.chunk);
    } else {
      I.max_chunk = std::max(I.max_chunk, m.chunk);
    }
    UnitLayout l;
    l.padded_numel = m.padded;
    l.params_sharded = I.shard_params();
    l.param_numel = I.shard_params() ? m.chunk : m.padded;
    l.grad_numel = I.shard_grads() && !m.tied_target ? 0 : m.padded;
    l.grad_shard_numel = I.shard_optim() ? m.chunk : 0;
    l.optim_numel = m.chunk;
    l.optim_begin = m.begin;
    // ddp: every rank owns the whole unit; hybrid: one owner per shard group.
    l.replicas = I.replicas;
    l.replica = gi;
    if (I.strategy == Strategy::ddp) l.replica = I.rank;
    out.push_back(l);
  }
  if (I.codec) {
    std::vector<int64_t> chunk;
    for (const Impl::Unit& m : I.units) chunk.push_back(m.experts ? 0 : m.chunk);
    I.codec->plan(I.group, gr, chunk);
    // Units without FP8 weights (the embedding; the head unless the recipe
    // casts it) gather their parameters as they are, straight into the
    // parameters: the codec is planned again without them.
    int as_params = 0;
    if (const auto* p = dynamic_cast<const GatherCodecPlainUnits*>(I.codec)) {
      for (size_t i = 0; i < I.units.size(); ++i)
        if (!I.units[i].experts && p->gathers_as_params(static_cast<int>(i))) {
          I.units[i].plain = true;
          chunk[i] = 0;
          ++as_params;
        }
      if (as_params > 0) I.codec->plan(I.group, gr, chunk);
    }
    int64_t wire = 0, plain = 0;
    for (size_t i = 0; i < I.units.size(); ++i)
      if (!I.units[i].experts) {
        const int64_t p = I.units[i].chunk * static_cast<int64_t>(dtype_size(I.param_dtype));
        const int64_t w = I.codec->wire_chunk_bytes(static_cast<int>(i));  // 0 for a plain unit: planned without it
        I.max_wire = std::max(I.max_wire, w);
        wire += I.units[i].plain ? p : w;
        plain += p;
      }
    log_info(cat("sharding ", I.name, ": gather_dtype fp8: ", I.codec->fp8_weights(),
                 " weights travel as E4M3 codes (", as_params, " units without any gathered as parameters); a gather ",
                 "of the whole model moves ", wire, " bytes per rank's chunk (", plain, " in ", dtype_name(I.param_dtype),
                 ", ", static_cast<double>(wire) / static_cast<double>(plain), "x)"));
  }
  return out;
}

std::vector<ShardingBuffer> FlatSharding::scratch(const ShardingEnv&) {
  Impl& I = *impl_;
  std::vector<ShardingBuffer> b;
  if (I.shard_grads() && I.max_padded > 0)
    for (int i = 0; i < 2; ++i) b.push_back({cat("grad_bucket.", i), I.grad_dtype, I.max_padded, MemCategory::comm});
  int64_t max_all = 0;
  for (const auto& m : I.units) max_all = std::max(max_all, m.padded);
  if (I.grad_dtype != I.reduce_dtype)
    for (int i = 0; i < 2; ++i) b.push_back({cat("reduce_stage.", i), I.reduce_dtype, max_all, MemCategory::comm});
  const bool need_rtmp = I.shard_optim() && (I.grad_accum > 1 || I.reduce_dtype != DType::f32);
  if (need_rtmp)
    for (int i = 0; i < 2; ++i) b.push_back({cat("reduce_out.", i), I.reduce_dtype, I.max_chunk, MemCategory::comm});
  if (need_rtmp && I.reduce_dtype != DType::f32) b.push_back({"reduce_out.f32", DType::f32, I.max_chunk, MemCategory::comm});
  if (I.shard_params()) {
    if (I.reshard_after_forward) {
      for (int i = 0; i <= I.prefetch; ++i)
        b.push_back({cat("gather.", i), I.param_dtype, I.max_padded, MemCategory::comm});
    }
    for (size_t u = 0; u < I.units.size(); ++u)
      if ((!I.reshard_after_forward && !I.units[u].experts) || I.units[u].tied_target)
        b.push_back({cat("gathered.", u), I.param_dtype, I.units[u].padded, MemCategory::params});
    if (I.codec) {
      // Bytes (e4m3 as the byte type): each unit's encoded chunk, then one
      // gathered wire buffer per gather buffer above, in the same order.
      for (size_t u = 0; u < I.units.size(); ++u)
        if (I.via_wire(u))
          b.push_back({cat("fp8_wire.", u), DType::e4m3, I.codec->wire_chunk_bytes(static_cast<int>(u)),
                       MemCategory::params});
      if (I.reshard_after_forward && I.max_wire > 0)
        for (int i = 0; i <= I.prefetch; ++i)
          b.push_back({cat("fp8_gather.", i), DType::e4m3, I.max_wire * I.group, MemCategory::comm});
      for (size_t u = 0; u < I.units.size(); ++u)
        if (((!I.reshard_after_forward && !I.units[u].experts) || I.units[u].tied_target) && I.via_wire(u))
          b.push_back({cat("fp8_gathered.", u), DType::e4m3, I.codec->wire_chunk_bytes(static_cast<int>(u)) * I.group,
                       MemCategory::comm});
    }
  }
  return b;
}

void FlatSharding::setup(ShardingEnv& env, std::vector<UnitState>& units, std::vector<Tensor>& scratch) {
  Impl& I = *impl_;
  I.state = &units;
  size_t k = 0;
  auto next = [&]() -> Tensor {
    LOOM_CHECK(k < scratch.size(), "sharding: the core handed ", scratch.size(), " scratch buffers, fewer than asked");
    return scratch[k++];
  };
  if (I.shard_grads() && I.max_padded > 0)
    for (auto& s : I.grad_pool) s.t = next();
  if (I.grad_dtype != I.reduce_dtype)
    for (auto& s : I.stage) s.t = next();
  const bool need_rtmp = I.shard_optim() && (I.grad_accum > 1 || I.reduce_dtype != DType::f32);
  if (need_rtmp)
    for (Tensor& t : I.rtmp) t = next();
  if (need_rtmp && I.reduce_dtype != DType::f32) I.ftmp = next();
  if (I.shard_params()) {
    if (I.reshard_after_forward) {
      I.gather_pool.resize(static_cast<size_t>(I.prefetch) + 1);
      for (auto& s : I.gather_pool) s.t = next();
    }
    I.gather_own.assign(units.size(), Tensor());
    for (size_t u = 0; u < I.units.size(); ++u)
      if ((!I.reshard_after_forward && !I.units[u].experts) || I.units[u].tied_target) I.gather_own[u] = next();
    if (I.codec) {
      I.wire_shard.assign(units.size(), Tensor());
      for (size_t u = 0; u < I.units.size(); ++u)
        if (I.via_wire(u)) I.wire_shard[u] = next();
      if (I.reshard_after_forward && I.max_wire > 0) {
        I.wire_pool.resize(static_cast<size_t>(I.prefetch) + 1);
        for (auto& s : I.wire_pool) s.t = next();
      }
      I.wire_slot_of.assign(units.size(), -1);
      for (size_t u = 0; u < I.units.size(); ++u)
        if (((!I.reshard_after_forward && !I.units[u].experts) || I.units[u].tied_target) && I.via_wire(u)) {
          I.wire_slot_of[u] = static_cast<int>(I.wire_pool.size());
          I.wire_pool.emplace_back();
          I.wire_pool.back().t = next();
        }
      I.encoded = false;
    }
    // The gather schedule of one micro-batch. A tied target is gathered once
    // (first) and kept; the rest in forward order and, when resharding after
    // forward, again in backward order.
    const int n = static_cast<int>(units.size());
    auto gathered = [&](int u) { return !I.units[static_cast<size_t>(u)].experts; };  // experts units never are
    for (int u = 0; u < n; ++u)
      if (I.units[static_cast<size_t>(u)].tied_target) I.events.push_back(u);
    for (int u = 0; u < n; ++u)
      if (!I.units[static_cast<size_t>(u)].tied_target && gathered(u)) I.events.push_back(u);
    if (I.reshard_after_forward) {
      // The backward starts with the unit the forward ended with (the head):
      // it keeps that gather instead of resharding and gathering it again at
      // once (its buffer is next reused by a gather issued after its backward).
      if (!I.events.empty() && !I.units[static_cast<size_t>(I.events.back())].tied_target)
        I.kept_unit = I.events.back();
      // A unit of token embeddings alone is not gathered again: its
      // backward reads no parameter (ParamRole::embedding, the gradient is a
      // scatter-add of the output's).
      auto reads_params = [&](int u) {
        const auto& ps = units[static_cast<size_t>(u)].info->params;
        return ps.empty() ||
               !std::all_of(ps.begin(), ps.end(), [](const ParamInfo& p) { return p.role == ParamRole::embedding; });
      };
      for (int u = n - 1; u >= 0; --u) {
        Impl::Unit& m = I.units[static_cast<size_t>(u)];
        m.gathered_for_backward = !m.tied_target && gathered(u) && u != I.kept_unit && reads_params(u);
        if (m.gathered_for_backward) I.events.push_back(u);
      }
    }
    I.event_ticket.assign(I.events.size(), 0);
    I.event_slot.assign(I.events.size(), -1);
    LOOM_CHECK(I.events.empty() || I.events.front() == 0 || !I.units[0].tied_target, "sharding: tied target must be unit 0");
  }
  for (UnitState& u : units) {
    if (I.units[static_cast<size_t>(u.index)].experts) {
      u.params = u.param_shard;  // the rank's experts, read in place (ffn_moe.cpp offsets them)
      continue;
    }
    LOOM_CHECK(u.layout.params_sharded == I.shard_params(), I.where(u), ": core allocated an unexpected layout");
  }
  (void)env;
}

void FlatSharding::begin_step(ShardingEnv&, std::vector<UnitState>&) {
  impl_->micro = 0;
}

void FlatSharding::before_forward(ShardingEnv& env, UnitState& u) {
  Impl& I = *impl_;
  if (I.units[static_cast<size_t>(u.index)].experts) return;  // held whole, never gathered
  if (!I.shard_params()) {
    // zero1/zero2: the params were all-gathered after the last step.
    const auto& m = I.units[static_cast<size_t>(u.index)];
    if (m.gather_ticket) I.shard->wait(env.ctx, m.gather_ticket);
    return;
  }
  if (u.index == 0) {
    // A new forward (training micro-batch or evaluation) starts the schedule
    // over, unless the backward before it already did (start_next_micro).
    if (!I.started_early) I.restart_schedule();
    I.started_early = false;
    if (I.codec && !I.encoded) {
      // The parameters changed (start, resume, an optimizer step): encode
      // every unit's own chunk once, before its first gather.
      I.codec->encode(env.ctx, *I.shard, *I.state, I.wire_shard);
      I.encoded = true;
    }
  }
  if (I.units[static_cast<size_t>(u.index)].tied_target && I.next_event > 0) return;  // gathered, kept
  I.use_event(env, u);
}

void FlatSharding::before_backward(ShardingEnv& env, UnitState& u) {
  Impl& I = *impl_;
  const auto& m = I.units[static_cast<size_t>(u.index)];
  if (m.experts) return;  // its gradient buffer is its own (the core's), accumulating over micro-batches
  if (I.shard_grads()) {
    if (u.index == static_cast<int>(I.units.size()) - 1) {
      // The backward starts: a tied target's grads receive the head's
      // gradient first, so clear them now (after their last reduce read them).
      for (size_t i = 0; i < I.units.size(); ++i)
        if (I.units[i].tied_target) {
          I.tied_grads.wait(env.ctx);
          env.ops->zero(env.ctx, (*I.state)[i].grads);
        }
    }
    if (!m.tied_target) {
      Slot& s = I.grad_pool[I.grad_slot];
      I.grad_slot ^= 1;
      s.wait(env.ctx);
      u.grads = view(s.t, 0, {m.padded});
      // The backward fills [0, numel) (UnitState::grads_fresh); the padding
      // may hold another unit's gradient and goes into the reduce-scatter.
      u.grads_fresh = true;
      if (m.padded > m.numel) {
        Tensor pad = view(s.t, m.numel, {m.padded - m.numel});
        env.ops->zero(env.ctx, pad);
      }
    }
  }
  if (m.gathered_for_backward) I.use_event(env, u);
}

void FlatSharding::after_backward(ShardingEnv& env, UnitState& u, bool last_micro) {
  Impl& I = *impl_;
  const auto& m = I.units[static_cast<size_t>(u.index)];
  const bool first = I.micro == 0;
  if (u.index == 0) ++I.micro;
  if (m.experts) {
    // The owner's gradient covers its group's tokens, already scaled by
    // 1 / world: the replicas' sum is the global batch's gradient.
    if (last_micro && I.expert_replica->size() > 1)
      I.last_expert = std::max(I.last_expert, I.expert_replica->all_reduce(env.ctx, u.grads, ReduceOp::sum));
    return;
  }
  switch (I.strategy) {
    case Strategy::ddp: {
      if (!last_micro) return;  // accumulate locally until the step's last micro-batch
      Tensor in = I.reduce_input(env, u, m.numel);
      CommTicket t = I.world_comm->all_reduce(env.ctx, in, ReduceOp::sum);
      I.track(I.world_comm, t);
      if (Slot* s = I.last_stage()) {
        // Reduced in reduce_dtype: back into the grads the optimizer reads.
        s->used_by(I.world_comm, t);
        I.world_comm->wait(env.ctx, t);
        Tensor g = view(u.grads, 0, {m.numel});
        env.ops->convert(env.ctx, g, in);
      }
      return;
    }
    case Strategy::zero1:
      if (last_micro) I.reduce_scatter_unit(env, u, true);
      return;
    case Strategy::zero2:
    case Strategy::zero3:
    case Strategy::hybrid:
      if (u.index == 0 && !last_micro && I.shard_params()) I.start_next_micro(env);
      I.reduce_scatter_unit(env, u, first);
      if (last_micro && I.replicas > 1) {
        // Across shard groups: the shard must be complete before it is all-reduced.
        I.shards_landed(env);
        if (I.last_shard) I.shard->wait(env.ctx, I.last_shard);
        CommTicket t = I.replica->all_reduce(env.ctx, u.grad_shard, ReduceOp::sum);
        I.track(I.replica, t);
      }
      return;
  }
}

void FlatSharding::step(ShardingEnv& env, std::vector<UnitState>& units, const AdamWHyper& h) {
  Impl& I = *impl_;
  I.shards_landed(env);
  if (I.last_shard) I.shard->wait(env.ctx, I.last_shard);
  if (I.last_replica) I.replica->wait(env.ctx, I.last_replica);
  if (I.last_world) I.world_comm->wait(env.ctx, I.last_world);
  if (I.last_expert) I.expert_replica->wait(env.ctx, I.last_expert);

  if (I.ep > 1) {
    // Expert parallelism: the ranks hold different experts, so the norm is
    // added up over the world, each rank summing its share of what it owns
    // (a range held by R replicas: the replica's 1/R of it), so that every
    // element counts once.
    auto share = [&](const Tensor& g, int64_t n, int replicas, int replica) {
      const int64_t lo = n * replica / replicas, hi = n * (replica + 1) / replicas;
      if (hi > lo) env.ops->norm_add(env.ctx, g, lo, hi);
    };
    for (UnitState& u : units) {
      const auto& m = I.units[static_cast<size_t>(u.index)];
      if (m.experts) share(u.grads, m.chunk, u.layout.replicas, u.layout.replica);
      else if (I.strategy == Strategy::ddp) share(u.grads, m.numel, I.world, I.rank);
      else share(u.grad_shard, std::clamp<int64_t>(m.numel - m.begin, 0, m.chunk), I.replicas, I.rank / I.group);
    }
    env.ops->norm_finish(env.ctx, I.world_comm);
  }
  for (UnitState& u : units) {
    if (I.ep > 1) break;  // added up above
    const auto& m = I.units[static_cast<size_t>(u.index)];
    if (I.strategy == Strategy::ddp) {
      env.ops->norm_add(env.ctx, u.grads, 0, m.numel);
    } else {
      const int64_t valid = std::clamp<int64_t>(m.numel - m.begin, 0, m.chunk);
      if (valid > 0) env.ops->norm_add(env.ctx, u.grad_shard, 0, valid);
    }
  }
  if (I.ep == 1) env.ops->norm_finish(env.ctx, I.strategy == Strategy::ddp ? nullptr : I.shard);
  for (UnitState& u : units) {
    auto& m = I.units[static_cast<size_t>(u.index)];
    if (m.experts) {
      env.ops->adamw(env.ctx, u, u.grads, h, u.param_shard, m.begin);
      continue;
    }
    switch (I.strategy) {
      case Strategy::ddp:
        env.ops->adamw(env.ctx, u, u.grads, h, u.params, 0);
        break;
      case Strategy::zero1:
      case Strategy::zero2: {
        // Update the owned range in place, then gather everyone's ranges.
        env.ops->adamw(env.ctx, u, u.grad_shard, h, u.params, 0);
        Tensor own = view(u.params, m.begin, {m.chunk});
        Tensor full = view(u.params, 0, {m.padded});
        m.gather_ticket = I.shard->all_gather(env.ctx, own, full);
        I.track(I.shard, m.gather_ticket);
        break;
      }
      case Strategy::zero3:
      case Strategy::hybrid:
        env.ops->adamw(env.ctx, u, u.grad_shard, h, u.param_shard, m.begin);
        break;
    }
  }
  I.encoded = false;  // FP8 gathers: the next forward encodes the new parameters
}

}  // namespace loom::shard
