// Gated Sparse Attention (seed 003; spec/gsa.md) as a layer: the value gate G2, a cheap indexer
// that scores every visible key, each token's top-k_t keys under the adaptive budget, softmax
// attention over that selection (winnow::gsa_sparse_attention), and the output gate G1. 003's
// baselines are the same layer with switches: dense (no gates, no indexer), gated only (gates,
// dense attention), sparse only (DeepSeek-V3.2's ReLU indexer and a fixed k, no gates).
//
// The indexer trains on its own loss and on inputs detached from the main graph (selection is
// not differentiable): KL(p_t || softmax_s(I_ts)), p_t the layer's attention distribution
// averaged over its heads, over every visible key during the warm-up phase (train.phases entry
// named options.warmup_phase, where attention is dense) and over the selection afterwards. The
// loss (winnow's gsa_indexer_loss operator; composed, in chunks of query rows, where the layer
// runs composed) is reported as the auxiliary loss "indexer_kl" (train.aux_loss_weights), one
// value per token on average.
#include <c10/core/impl/LocalDispatchKeySet.h>

#include <cmath>

#include "nn/attention.h"
#include "nn/composed.h"
#include "winnow/torch/ops.h"

namespace winnow::nn {
namespace {

struct GsaOptions {
  bool gates = true;  // G1 (per head, D_v gates) and G2 (per kv head, D_v gates); biases start at 0
  // sigmoid: GSA's gated indexer, sum_j sigmoid(w_tj) sigmoid(<q_tj, k_s> / sqrt(d_I) + b_j);
  // relu: DeepSeek-V3.2's, sum_j w_tj relu(<q_tj, k_s> / sqrt(d_I)); none: dense attention.
  std::string indexer = "sigmoid";
  std::int64_t indexer_heads = 4, indexer_dim = 64;
  // The budget k_t: fixed (k keys, 0 meaning k_max) or one of the variance rules of spec/gsa.md.
  std::string budget = "inverse_variance";
  std::int64_t k = 0;
  // 003 uses 2048 / 256 / 4096 at 4K-32K contexts; these suit contexts of about 1K.
  std::int64_t k_base = 256, k_min = 64, k_max = 512;
  // Of Vbar, the running mean of the rows' score variance: Vbar <- m Vbar + (1 - m) batch mean
  // (1: kept at the first batch's).
  double variance_momentum = 0.99;
  std::string warmup_phase = "indexer_warmup";
  bool indexer_loss = true;
  std::int64_t loss_chunk = 256;  // query rows per chunk of the composed indexer loss

  template <class V>
  void fields(V& v) {
    v("gates", gates);
    v("indexer", indexer, config::one_of({"sigmoid", "relu", "none"}));
    v("indexer_heads", indexer_heads, config::at_least(1));
    v("indexer_dim", indexer_dim, config::at_least(1));
    v("budget", budget, config::one_of({"fixed", "inverse_variance", "eq8", "reference"}));
    v("k", k, config::at_least(0));
    v("k_base", k_base, config::at_least(1));
    v("k_min", k_min, config::at_least(1));
    v("k_max", k_max, config::at_least(1));
    v("variance_momentum", variance_momentum, config::in_range(0, 1, true));
    v("warmup_phase", warmup_phase);
    v("indexer_loss", indexer_loss);
    v("loss_chunk", loss_chunk, config::at_least(1));
  }
};

gsa::Budget budget_rule(const std::string& name) {
  if (name == "fixed") return gsa::Budget::fixed;
  if (name == "eq8") return gsa::Budget::eq8;
  if (name == "reference") return gsa::Budget::reference;
  return gsa::Budget::inverse_variance;
}

// 003 section 6's indexer loss, sum_t KL(p_t || softmax_s(I_ts)) over the visible keys (dense)
// or the selection (sparse), p_t the heads' mean attention distribution (from q and k, which
// carry no gradient), per token on average. Memory stays O(chunk x L): the forward keeps only
// its inputs, and the backward forms each chunk of query rows again and differentiates it
// alone. Autocast is off inside, so that both passes compute the same function (float32, or
// float64 for float64 inputs).
struct KlSpec {
  bool sparse = true, relu = false;
  std::int64_t chunk = 256;
  double scale = 1, index_scale = 1;
  // As a tensor, so that it travels through autograd::Function::apply's arguments.
  torch::Tensor pack() const {
    return torch::tensor({sparse ? 1.0 : 0.0, relu ? 1.0 : 0.0, static_cast<double>(chunk), scale, index_scale},
                         torch::kFloat64);
  }
  static KlSpec unpack(const torch::Tensor& t) {
    const auto* v = t.data_ptr<double>();
    KlSpec s;
    s.sparse = v[0] != 0;
    s.relu = v[1] != 0;
    s.chunk = static_cast<std::int64_t>(v[2]);
    s.scale = v[3];
    s.index_scale = v[4];
    return s;
  }
};

// One chunk's summed KL terms, rows [r0, r0 + c) of the queries (iq and iw hold just those rows).
torch::Tensor indexer_kl_chunk(const torch::Tensor& iq, const torch::Tensor& ik, const torch::Tensor& iw,
                               const torch::Tensor& ib, const torch::Tensor& q, const torch::Tensor& k,
                               const torch::Tensor& indices, const torch::Tensor& counts, const KlSpec& spec,
                               std::int64_t r0, std::int64_t c) {
  const std::int64_t B = q.size(0), Lq = q.size(1), Lk = k.size(1);
  const torch::ScalarType wt = q.scalar_type() == torch::kFloat64 ? torch::kFloat64 : torch::kFloat32;
  torch::Tensor allowed;
  if (spec.sparse) {
    allowed = composed::list_mask(indices.narrow(1, r0, c), counts.narrow(1, r0, c), Lk);
  } else {
    const auto opts = torch::TensorOptions().dtype(torch::kInt64).device(q.device());
    const torch::Tensor pos = torch::arange(Lk - Lq + r0, Lk - Lq + r0 + c, opts).unsqueeze(1);
    allowed = torch::arange(Lk, opts).unsqueeze(0).le(pos).unsqueeze(0).expand({B, c, Lk});
  }
  const torch::Tensor p =
      composed::masked_softmax_weights(q.narrow(1, r0, c).to(wt), k.to(wt), spec.scale, allowed).mean(1);
  const torch::Tensor scores = composed::gsa_indexer_scores(iq.to(wt), ik.to(wt), iw.to(wt),
                                                            ib.defined() ? ib.to(wt) : ib, spec.relu, spec.index_scale);
  const torch::Tensor log_q = torch::log_softmax(scores.masked_fill(allowed.logical_not(), -INFINITY), -1);
  // p log p - p log q on the allowed keys (p = 0 there contributes nothing).
  const torch::Tensor terms = torch::xlogy(p, p) - p * log_q.masked_fill(allowed.logical_not(), 0);
  return terms.masked_fill(allowed.logical_not(), 0).sum();
}

class ChunkedIndexerKl : public torch::autograd::Function<ChunkedIndexerKl> {
 public:
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& iq, const torch::Tensor& ik,
                               const torch::Tensor& iw, const torch::Tensor& ib_or_empty, const torch::Tensor& q,
                               const torch::Tensor& k, const torch::Tensor& indices, const torch::Tensor& counts,
                               const torch::Tensor& spec_tensor) {
    ctx->save_for_backward({iq, ik, iw, ib_or_empty, q, k, indices, counts, spec_tensor});
    const KlSpec spec = KlSpec::unpack(spec_tensor);
    const torch::Tensor ib = ib_or_empty.numel() > 0 ? ib_or_empty : torch::Tensor();
    c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
    torch::NoGradGuard no_grad;
    const std::int64_t Lq = q.size(1);
    torch::Tensor total;
    for (std::int64_t r0 = 0; r0 < Lq; r0 += spec.chunk) {
      const std::int64_t c = std::min(spec.chunk, Lq - r0);
      const torch::Tensor part =
          indexer_kl_chunk(iq.narrow(1, r0, c), ik, iw.narrow(1, r0, c), ib, q, k, indices, counts, spec, r0, c);
      total = total.defined() ? total + part : part;
    }
    return total / static_cast<double>(q.size(0) * Lq);
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad_out) {
    const auto saved = ctx->get_saved_variables();
    const torch::Tensor &iq = saved[0], &ik = saved[1], &iw = saved[2], &q = saved[4], &k = saved[5];
    const torch::Tensor ib = saved[3].numel() > 0 ? saved[3] : torch::Tensor();
    const KlSpec spec = KlSpec::unpack(saved[8]);
    c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
    const std::int64_t Lq = q.size(1);
    const torch::Tensor scale = grad_out[0] / static_cast<double>(q.size(0) * Lq);
    torch::Tensor giq = torch::zeros_like(iq), gik = torch::zeros_like(ik), giw = torch::zeros_like(iw);
    torch::Tensor gib = ib.defined() ? torch::zeros_like(ib) : torch::Tensor();
    for (std::int64_t r0 = 0; r0 < Lq; r0 += spec.chunk) {
      const std::int64_t c = std::min(spec.chunk, Lq - r0);
      torch::AutoGradMode grad_mode(true);
      const torch::Tensor iqc = iq.narrow(1, r0, c).detach().requires_grad_();
      const torch::Tensor iwc = iw.narrow(1, r0, c).detach().requires_grad_();
      const torch::Tensor ikd = ik.detach().requires_grad_();
      const torch::Tensor ibd = ib.defined() ? ib.detach().requires_grad_() : torch::Tensor();
      const torch::Tensor part = indexer_kl_chunk(iqc, ikd, iwc, ibd, q, k, saved[6], saved[7], spec, r0, c);
      torch::autograd::variable_list inputs = {iqc, ikd, iwc};
      if (ibd.defined()) inputs.push_back(ibd);
      const auto grads = torch::autograd::grad({part}, inputs, {scale.to(part.scalar_type())});
      giq.narrow(1, r0, c).add_(grads[0].to(giq.scalar_type()));
      gik.add_(grads[1].to(gik.scalar_type()));
      giw.narrow(1, r0, c).add_(grads[2].to(giw.scalar_type()));
      if (ibd.defined()) gib.add_(grads[3].to(gib.scalar_type()));
    }
    return {giq, gik, giw, gib, torch::Tensor(), torch::Tensor(), torch::Tensor(), torch::Tensor(), torch::Tensor()};
  }
};

class GsaAttention final : public AttentionLayer {
 public:
  GsaAttention(const ModelConfig& model, std::int64_t /*layer_index*/)
      : options_(options_of<GsaOptions>(model.attention)),
        h_(head_layout(model)),
        position_(model, h_.head_dim),
        kernel_(uses_kernel(model.attention)) {
    const std::int64_t d = model.d_model;
    const double init_std = model.init_std;
    q_ = make_linear(*this, "q", d, h_.heads * h_.head_dim, init_std);
    k_ = make_linear(*this, "k", d, h_.kv_heads * h_.head_dim, init_std);
    v_ = make_linear(*this, "v", d, h_.kv_heads * h_.value_dim, init_std);
    o_ = make_linear(*this, "o", h_.heads * h_.value_dim, d, residual_output_std(model));
    if (options_.gates) {
      output_gate_ = make_linear(*this, "output_gate", d, h_.heads * h_.value_dim, init_std, true);
      value_gate_ = make_linear(*this, "value_gate", d, h_.kv_heads * h_.value_dim, init_std, true);
    }
    if (indexed()) {
      const std::int64_t hi = options_.indexer_heads, di = options_.indexer_dim;
      indexer_q_ = make_linear(*this, "indexer_q", d, hi * di, init_std);
      indexer_k_ = make_linear(*this, "indexer_k", d, di, init_std);
      // 003's head weights sigmoid(h_t W_Iw_j + c_j): the bias is c. DeepSeek's w_tj has none.
      const bool sigmoid = options_.indexer == "sigmoid";
      indexer_weights_ = make_linear(*this, "indexer_weights", d, hi, init_std, sigmoid);
      if (sigmoid) indexer_bias_ = register_parameter("indexer_bias", torch::zeros({hi}));
      // Vbar; 0 until the first batch in training mode sets it.
      variance_mean_ = register_buffer("indexer_variance_mean", torch::zeros({1}, torch::kFloat64));
    }
  }

  void set_phase(const std::string& phase) override { warmup_ = phase == options_.warmup_phase; }

  torch::Tensor forward(const torch::Tensor& x, LayerCache* cache) override {
    const std::int64_t B = x.size(0), L = x.size(1);
    const auto qkv = project(x, {q_->weight, k_->weight, v_->weight});
    const torch::Tensor q = qkv[0].view({B, L, h_.heads, h_.head_dim});
    const torch::Tensor k = qkv[1].view({B, L, h_.kv_heads, h_.head_dim});
    torch::Tensor v = qkv[2].view({B, L, h_.kv_heads, h_.value_dim});
    if (value_gate_) v = v * torch::sigmoid(value_gate_(x)).view({B, L, h_.kv_heads, h_.value_dim});
    const auto in = position_.prepare(q, k, v, cache);
    const torch::Tensor qv = in.q.to(in.v.scalar_type()), kv = in.k.to(in.v.scalar_type());

    const bool sparse = indexed() && !warmup_;
    const bool learn = indexed() && options_.indexer_loss && is_training();
    Indexer ix;
    if (sparse || learn) ix = index(x, cache, /*select=*/sparse);

    torch::Tensor o;
    torch_ops::AttentionCall call;
    call.scale = h_.scale;
    if (sparse) {
      o = kernel_ ? torch_ops::gsa_sparse_attention(qv, kv, in.v, ix.indices, ix.counts, call, /*trusted=*/true)
                  : composed::gsa_sparse_attention(qv, kv, in.v, ix.indices, ix.counts, h_.scale);
    } else {
      o = kernel_ ? torch_ops::softmax_attention(qv, kv, in.v, call)
                  : composed::softmax_attention(qv, kv, in.v, h_.scale, /*attend_current=*/true);
    }
    if (learn) add_aux_loss("indexer_kl", indexer_kl(qv.detach(), kv.detach(), ix, sparse));
    if (probe()) record_probe(qv, kv, ix, sparse);
    if (output_gate_) o = o * torch::sigmoid(output_gate_(x)).view({B, L, h_.heads, h_.value_dim});
    return project(o.reshape({B, L, h_.heads * h_.value_dim}), {o_->weight})[0];
  }

 private:
  bool indexed() const { return options_.indexer != "none"; }

  // The indexer's operands for this chunk (its keys for every cached position too) and the
  // selection they make.
  struct Indexer {
    torch::Tensor q, k, weights, bias;  // (B, Lq, H_I, d_I), (B, Lk, 1, d_I), (B, Lq, H_I), (H_I)
    torch::Tensor indices, counts;
  };

  Indexer index(const torch::Tensor& x, LayerCache* cache, bool select) {
    const std::int64_t B = x.size(0), L = x.size(1), hi = options_.indexer_heads, di = options_.indexer_dim;
    const torch::Tensor xd = x.detach();
    Indexer ix;
    ix.q = indexer_q_(xd).view({B, L, hi, di});
    torch::Tensor k = indexer_k_(xd).view({B, L, 1, di});
    ix.weights = indexer_weights_(xd);
    if (cache != nullptr) k = cache->side().append(k, k.narrow(3, 0, 0)).first;
    ix.k = k;
    if (indexer_bias_.defined()) ix.bias = indexer_bias_;
    const bool adaptive = options_.budget != "fixed";
    // The warm-up phase selects nothing but keeps Vbar current for the sparse phase.
    if (!select && !(adaptive && is_training())) return ix;

    // The selection reads one dtype: the activations' on CUDA, float32 or float64 on the CPU.
    const torch::ScalarType dt =
        x.is_cuda() || ix.q.scalar_type() == torch::kFloat64 ? ix.q.scalar_type() : torch::kFloat32;
    const torch::Tensor sq = ix.q.detach().to(dt), sk = ix.k.detach().to(dt), sw = ix.weights.detach().to(dt);
    const torch::ScalarType stats = dt == torch::kFloat64 ? torch::kFloat64 : torch::kFloat32;
    const torch_ops::Opt<at::Tensor> sb = ix.bias.defined()
                                            ? torch_ops::Opt<at::Tensor>(ix.bias.detach().to(stats))
                                            : torch_ops::Opt<at::Tensor>();
    gsa::IndexerOptions o;
    o.form = options_.indexer == "relu" ? gsa::ScoreForm::relu : gsa::ScoreForm::sigmoid;
    o.budget = budget_rule(options_.budget);
    o.k = options_.k > 0 ? std::min(options_.k, options_.k_max) : options_.k_max;
    o.k_base = options_.k_base;
    o.k_min = std::min(options_.k_min, options_.k_max);
    o.k_max = options_.k_max;
    // A selection of one key per row measures the rows' variance alone.
    auto measured_variance = [&] {
      gsa::IndexerOptions measure = o;
      measure.budget = gsa::Budget::fixed;
      measure.k = 1;
      return std::get<2>(torch_ops::gsa_select_keys(sq, sk, sw, sb, measure));
    };
    auto update_mean = [&](const torch::Tensor& variance) {
      torch::NoGradGuard no_grad;
      const double m = options_.variance_momentum;
      variance_mean_.mul_(m).add_(variance.to(torch::kFloat64).mean(), 1.0 - m);
    };
    // Only the variance rules read Vbar (a host read of a device buffer on CUDA). No running
    // mean yet: the first training batch sets it; outside training an unset mean reads as 1
    // (so that results do not depend on how a sequence is split into chunks).
    double vbar = adaptive ? variance_mean_.item<double>() : 1.0;
    if (!(vbar > 0) && !is_training()) vbar = 1.0;
    const bool unset = !(vbar > 0);
    auto set_mean = [&](const torch::Tensor& variance) {
      vbar = variance.to(torch::kFloat64).mean().item<double>();
      if (!(vbar > 0)) vbar = 1.0;  // every row flat: any positive Vbar gives k_max
      variance_mean_.fill_(vbar);
    };
    if (!select) {
      const torch::Tensor variance = measured_variance();
      unset ? set_mean(variance) : update_mean(variance);
      return ix;
    }
    if (unset) set_mean(measured_variance());
    o.mean_variance = vbar;
    auto [indices, counts, variance] = torch_ops::gsa_select_keys(sq, sk, sw, sb, o);
    if (is_training() && adaptive) update_mean(variance);
    ix.indices = indices;
    ix.counts = counts;
    return ix;
  }

  // 003 section 6: sum_t KL(p_t || softmax_s(I_ts)) over the visible keys (dense) or the
  // selection (sparse), p_t the heads' mean attention distribution, per token on average.
  torch::Tensor indexer_kl(const torch::Tensor& q, const torch::Tensor& k, const Indexer& ix, bool sparse) const {
    KlSpec spec;
    spec.sparse = sparse;
    spec.relu = options_.indexer == "relu";
    spec.chunk = options_.loss_chunk;
    spec.scale = h_.scale;
    spec.index_scale = 1.0 / std::sqrt(static_cast<double>(options_.indexer_dim));
    // autograd::Function takes no undefined tensors: empty ones stand for the missing bias and,
    // in the dense phase, the missing lists.
    if (kernel_) {
      // winnow's operator: no L x L matrix, the lists read in place; per row, then averaged.
      gsa::IndexerLossOptions o;
      o.form = spec.relu ? gsa::ScoreForm::relu : gsa::ScoreForm::sigmoid;
      o.scale = spec.index_scale;
      o.attention_scale = spec.scale;
      const torch::ScalarType dt = ix.q.scalar_type();
      const torch::ScalarType stats = dt == torch::kFloat64 ? torch::kFloat64 : torch::kFloat32;
      using Opt = torch_ops::Opt<at::Tensor>;
      const torch::Tensor rows = torch_ops::gsa_indexer_loss(
          ix.q, ix.k.to(dt), ix.weights.to(dt), ix.bias.defined() ? Opt(ix.bias.to(stats)) : Opt(), q.to(dt), k.to(dt),
          sparse ? Opt(ix.indices) : Opt(), sparse ? Opt(ix.counts) : Opt(), o);
      return rows.mean();
    }
    auto or_empty = [&](const torch::Tensor& t) { return t.defined() ? t : torch::empty({0}, q.options()); };
    return ChunkedIndexerKl::apply(ix.q, ix.k, ix.weights, or_empty(ix.bias), q, k, or_empty(ix.indices),
                                   or_empty(ix.counts), spec.pack());
  }

  void record_probe(const torch::Tensor& q, const torch::Tensor& k, const Indexer& ix, bool sparse) {
    const torch::Tensor pq = probed_queries(q);
    const std::int64_t R = pq.size(1), Lq = q.size(1);
    if (!sparse) {
      probe()->record(probe_layer(), composed::softmax_weights(pq, k, h_.scale, true), /*attend_current=*/true);
      return;
    }
    const torch::Tensor idx = ix.indices.narrow(1, Lq - R, R), cnt = ix.counts.narrow(1, Lq - R, R);
    const torch::Tensor w = composed::masked_softmax_weights(pq, k, h_.scale, composed::list_mask(idx, cnt, k.size(1)));
    const torch::Tensor selected = cnt.to(torch::kFloat32).unsqueeze(1).expand({pq.size(0), h_.heads, R});
    probe()->record(probe_layer(), w, /*attend_current=*/true, {{"selected_keys", selected}});
  }

  GsaOptions options_;
  HeadLayout h_;
  PositionalEncoding position_;
  bool kernel_;
  bool warmup_ = false;
  torch::nn::Linear q_{nullptr}, k_{nullptr}, v_{nullptr}, o_{nullptr};
  torch::nn::Linear output_gate_{nullptr}, value_gate_{nullptr};
  torch::nn::Linear indexer_q_{nullptr}, indexer_k_{nullptr}, indexer_weights_{nullptr};
  torch::Tensor indexer_bias_, variance_mean_;
};

}  // namespace

const Mechanism& gsa_mechanism() {
  static const Mechanism m = [] {
    Mechanism m;
    m.name = "gsa";
    m.summary = "Gated Sparse Attention: value and output gates, an indexer (sigmoid | relu) with exact "
                "top-k selection under an adaptive budget, softmax over the selection; RoPE | NoPE";
    m.fused_operator = "winnow::gsa_sparse_attention";
    m.graph_blocker = [](const AttentionConfig&) -> std::string {
      return "GSA's budget reads its running mean on the host every step";
    };
    m.positions = {"rope", "nope"};
    m.option_keys = option_keys_of<GsaOptions>();
    m.resolve_options = resolve_options_as<GsaOptions>;
    m.kernel_gap = [](const AttentionConfig&) -> std::string { return ""; };
    m.check = [](const AttentionConfig& a, const std::string& path) {
      const GsaOptions o = options_of<GsaOptions>(a);
      if (o.budget != "fixed" && o.k_min > o.k_max) {
        config::fail(path + ".k_min", "at most k_max = " + std::to_string(o.k_max), std::to_string(o.k_min));
      }
      if (o.k > o.k_max) config::fail(path + ".k", "at most k_max = " + std::to_string(o.k_max), std::to_string(o.k));
    };
    m.make = [](const ModelConfig& model, std::int64_t layer) -> std::shared_ptr<AttentionLayer> {
      return std::make_shared<GsaAttention>(model, layer);
    };
    return m;
  }();
  return m;
}

}  // namespace winnow::nn
