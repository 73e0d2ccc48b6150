#include "models/file_hyperparameters.h"

#include <algorithm>
#include <cctype>
#include <set>

#include "engine/core/error.h"
#include "engine/train/parameters.h"
#include "models/architecture.h"
#include "models/decoder.h"

namespace cputrain {
namespace {

std::string text(int64_t v) {
  return std::to_string(v);
}

class Checker {
 public:
  Checker(const FileHyperparameters& hp, const FileTensorShape& shape_of, const Architecture& arch)
      : hp_(hp), shape_of_(shape_of), arch_(arch) {}

  [[noreturn]] void fail(const FileHyperparameter& h, int64_t value,
                         const std::string& problem) const {
    throw UserError(hp_.where + ": " + h.key + " " + text(value) + " " + problem);
  }
  [[noreturn]] void fail(const FileHyperparameter& h, const std::string& problem) const {
    fail(h, *h.value, problem);
  }

  // A count the file gives: positive.
  int64_t positive(const FileHyperparameter& h) const {
    if (!h.value) throw UserError(hp_.where + ": no " + h.key);
    if (*h.value <= 0) fail(h, "must be positive");
    return *h.value;
  }

  // The file's name of parameter `ours`.
  std::string name(const std::string& ours) const { return tensor_name(ours, hp_.naming, arch_); }

  // The shape of parameter `ours`'s tensor, a matrix.
  std::vector<int64_t> matrix(const std::string& ours) const {
    const std::optional<std::vector<int64_t>> s = shape_of_(name(ours));
    if (!s || s->size() != 2)
      throw UserError(hp_.where + ": no tensor " + name(ours) + " of two dimensions");
    return *s;
  }

  // "[64, 172]", in the file's order (GGUF lists a row's length first).
  std::string shape(std::vector<int64_t> dims) const {
    if (hp_.naming == TensorNaming::Gguf) std::reverse(dims.begin(), dims.end());
    return shape_text(dims);
  }
  std::string tensor_differs(const std::string& ours, const std::vector<int64_t>& has,
                             const std::vector<int64_t>& given) const {
    return "tensor " + name(ours) + " has shape " + shape(has) + " where " +
           (hp_.naming == TensorNaming::Gguf ? "the model's hyperparameters give"
                                             : "config.json gives") +
           " " + shape(given);
  }
  // `h` differs from the dimension of `ours` that it sets (`given` is that tensor's shape from
  // the hyperparameters).
  [[noreturn]] void differs(const FileHyperparameter& h, int64_t value, const std::string& ours,
                            const std::vector<int64_t>& has,
                            const std::vector<int64_t>& given) const {
    fail(h, value, "differs from the file's tensors: " + tensor_differs(ours, has, given));
  }

  const FileHyperparameters& hp() const { return hp_; }

 private:
  const FileHyperparameters& hp_;
  const FileTensorShape& shape_of_;
  const Architecture& arch_;
};

// The blocks the file holds: the distinct N of its tensors named "blk.N." (GGUF) or
// "model.layers.N." (Hugging Face).
int64_t blocks_held(const std::vector<std::string>& names, TensorNaming naming) {
  const std::string prefix = naming == TensorNaming::Gguf ? "blk." : "model.layers.";
  std::set<std::string> blocks;
  for (const std::string& n : names) {
    if (!n.starts_with(prefix)) continue;
    size_t end = prefix.size();
    while (end < n.size() && std::isdigit(static_cast<unsigned char>(n[end]))) ++end;
    if (end > prefix.size() && end < n.size() && n[end] == '.')
      blocks.insert(n.substr(prefix.size(), end - prefix.size()));
  }
  return static_cast<int64_t>(blocks.size());
}

// The dimensions RoPE rotates: all of each head's, or where the architecture has partial rotary
// its first rope_dim (even).
void check_rope_dim(const Checker& check, const FileHyperparameters& hp, const Architecture& arch,
                    int64_t head, ModelConfig& c) {
  if (!hp.rope_dim.value) return;
  const int64_t rope = check.positive(hp.rope_dim);
  if (rope > head) check.fail(hp.rope_dim, "is more than the head dimension " + text(head));
  if (rope < head && !arch.partial_rotary)
    check.fail(hp.rope_dim, "rotates part of each head (of " + text(head) + "), which cputrain " +
                                "does not compute for " + std::string(arch.name));
  if (rope % 2 != 0) check.fail(hp.rope_dim, "is odd: RoPE rotates pairs");
  if (rope < head) c.rope_dim = rope;
}

// The heads of separate q and k projections (`wq`, `wk`): the head dimension, the heads and the
// key/value heads from their rows.
void check_heads(const Checker& check, const FileHyperparameters& hp, const std::string& wq,
                 const std::string& wk, const Architecture& arch, ModelConfig& c) {
  std::vector<int64_t> q = check.matrix(wq);
  const std::vector<int64_t> k = check.matrix(wk);
  // A gated attention's q tensor holds each head's query and output gate.
  if (c.attn_output_gate) {
    if (q[0] % 2 != 0)
      throw UserError(hp.where + ": tensor " + check.name(wq) + " has " + text(q[0]) +
                      " rows, where each head's query and output gate give an even count");
    q[0] /= 2;
  }
  if (q[0] % c.n_heads != 0)
    check.fail(hp.n_heads,
               "does not divide the " + text(q[0]) + " rows of tensor " + check.name(wq));
  int64_t head = 0;
  if (hp.head_dim.value) {
    head = check.positive(hp.head_dim);
    if (head != q[0] / c.n_heads)
      check.fail(hp.head_dim, "times " + hp.n_heads.key + " " + text(c.n_heads) +
                                  " differs from the " + text(q[0]) + " rows of tensor " +
                                  check.name(wq));
    c.head_dim = head;
  } else {
    if (c.d_model % c.n_heads != 0)
      check.fail(hp.n_heads, "does not divide " + hp.d_model.key + " " + text(c.d_model) +
                                 " (and no " + hp.head_dim.key + " gives the head dimension)");
    head = c.d_model / c.n_heads;
    if (head * c.n_heads != q[0])
      check.fail(hp.n_heads, "heads of " + text(head) + " (" + hp.d_model.key + " " +
                                 text(c.d_model) + " / " + text(c.n_heads) + ") differ from the " +
                                 text(q[0]) + " rows of tensor " + check.name(wq));
  }
  c.n_kv_heads = hp.n_kv_heads.value ? check.positive(hp.n_kv_heads) : c.n_heads;
  if (c.n_kv_heads > c.n_heads || c.n_heads % c.n_kv_heads != 0)
    check.fail(hp.n_kv_heads, c.n_kv_heads,
               "does not divide " + hp.n_heads.key + " " + text(c.n_heads));
  if (c.n_kv_heads * head != k[0])
    check.fail(hp.n_kv_heads, c.n_kv_heads,
               "heads of " + text(head) + " differ from the " + text(k[0]) + " rows of tensor " +
                   check.name(wk));
  check_rope_dim(check, hp, arch, head, c);
}

}  // namespace

void check_file_hyperparameters(const FileHyperparameters& hp,
                                const std::vector<std::string>& names,
                                const FileTensorShape& shape_of, ModelConfig& c) {
  const Checker check(hp, shape_of, architecture_of(c));
  // The embedding (vocab, d_model) sets the width and the vocabulary.
  const std::string embedding = "tok_embeddings.weight";
  const std::vector<int64_t> e = check.matrix(embedding);
  c.d_model = check.positive(hp.d_model);
  if (c.d_model != e[1]) {
    // The rows the vocabulary gives: the key's, else the embedding's other dimension (a
    // transposed one's first).
    const int64_t rows = hp.vocab.value ? *hp.vocab.value : e[0] == c.d_model ? e[1] : e[0];
    check.differs(hp.d_model, c.d_model, embedding, e, {rows, c.d_model});
  }
  c.vocab = e[0];
  if (hp.vocab.value && check.positive(hp.vocab) != c.vocab)
    check.differs(hp.vocab, *hp.vocab.value, embedding, e, {*hp.vocab.value, e[1]});

  c.n_layers = check.positive(hp.n_layers);
  const int64_t blocks = blocks_held(names, hp.naming) - hp.extra_blocks;
  if (c.n_layers != blocks)
    check.fail(hp.n_layers, "differs from the blocks the file holds (" + text(blocks) +
                                (hp.extra_blocks > 0 ? " and " + text(hp.extra_blocks) +
                                                           " of multi-token prediction)"
                                                     : ")"));

  // Heads: they divide the q projection's rows, each of the head dimension; the key/value heads
  // divide the heads and make the k projection's rows. Where q, k and v are one tensor, its rows
  // are the three's.
  const Architecture& arch = architecture_of(c);
  // The first attention layer's (Gated DeltaNet layers have none).
  int64_t first = 0;
  while (first < c.n_layers && c.linear_layer(first)) ++first;
  const std::string at = "layers." + text(first) + ".attention.";
  const std::string wq = at + "wq.weight", wk = at + "wk.weight";
  c.n_heads = check.positive(hp.n_heads);
  if (first == c.n_layers) {
    // No attention layer: the heads as the keys give them.
    c.n_kv_heads = hp.n_kv_heads.value ? check.positive(hp.n_kv_heads) : c.n_heads;
    if (hp.head_dim.value) c.head_dim = check.positive(hp.head_dim);
    if (c.n_kv_heads > c.n_heads || c.n_heads % c.n_kv_heads != 0)
      check.fail(hp.n_kv_heads, c.n_kv_heads,
                 "does not divide " + hp.n_heads.key + " " + text(c.n_heads));
    check_rope_dim(check, hp, arch, c.head_size(), c);
  } else if (arch.fused_qkv || c.qkv_fused) {
    const std::string wqkv = "layers.0.attention.wqkv.weight";
    const std::vector<int64_t> qkv = check.matrix(wqkv);
    int64_t head = 0;
    if (hp.head_dim.value) {
      head = check.positive(hp.head_dim);
    } else {
      if (c.d_model % c.n_heads != 0)
        check.fail(hp.n_heads, "does not divide " + hp.d_model.key + " " + text(c.d_model) +
                                   " (and no " + hp.head_dim.key + " gives the head dimension)");
      head = c.d_model / c.n_heads;
    }
    c.n_kv_heads = hp.n_kv_heads.value ? check.positive(hp.n_kv_heads) : c.n_heads;
    if (c.n_kv_heads > c.n_heads || c.n_heads % c.n_kv_heads != 0)
      check.fail(hp.n_kv_heads, c.n_kv_heads,
                 "does not divide " + hp.n_heads.key + " " + text(c.n_heads));
    if ((c.n_heads + 2 * c.n_kv_heads) * head != qkv[0])
      check.fail(hp.n_heads, "and " + text(c.n_kv_heads) + " key/value heads of " + text(head) +
                                 " differ from the " + text(qkv[0]) + " rows of tensor " +
                                 check.name(wqkv));
    if (hp.head_dim.value) c.head_dim = head;
    check_rope_dim(check, hp, arch, head, c);
  } else {
    check_heads(check, hp, wq, wk, arch, c);
  }

  if (arch.moe || (arch.experts_beside_mlp && hp.n_experts.value)) {
    // The router's rows are the experts; the experts' gate tensor (E, F, C) gives their width
    // (half the rows of each expert's gate and up where they are one tensor).
    const std::string router = "layers.0.feed_forward.router.weight";
    const std::vector<int64_t> r = check.matrix(router);
    c.n_experts = check.positive(hp.n_experts);
    if (c.n_experts != r[0])
      check.differs(hp.n_experts, c.n_experts, router, r, {c.n_experts, r[1]});
    c.experts_used = check.positive(hp.experts_used);
    if (c.experts_used > c.n_experts)
      check.fail(hp.experts_used, "is more than " + hp.n_experts.key + " " + text(c.n_experts));
    const int64_t parts = c.experts_gate_up_fused ? 2 : 1;
    const std::string w1 = parts == 2 ? "layers.0.feed_forward.experts.w13.weight"
                                      : "layers.0.feed_forward.experts.w1.weight";
    const std::optional<std::vector<int64_t>> g = shape_of(check.name(w1));
    if (!g || g->size() != 3)
      throw UserError(hp.where + ": no tensor " + check.name(w1) + " of three dimensions");
    const FileHyperparameter& width = arch.moe ? hp.ffn : hp.expert_ffn;
    int64_t& F = arch.moe ? c.ffn : c.expert_ffn;
    F = check.positive(width);
    if (F * parts != (*g)[1]) check.differs(width, F, w1, *g, {(*g)[0], parts * F, (*g)[2]});
    if (arch.shared_expert) {
      const std::string s1 = "layers.0.feed_forward.shared.w1.weight";
      const std::vector<int64_t> s = check.matrix(s1);
      c.shared_expert_ffn = check.positive(hp.shared_expert_ffn);
      if (c.shared_expert_ffn != s[0])
        check.differs(hp.shared_expert_ffn, c.shared_expert_ffn, s1, s,
                      {c.shared_expert_ffn, s[1]});
    }
  }
  if (!arch.moe) {
    // The gate projection's rows, or half the fused gate and up tensor's, or without a gate the up
    // projection's.
    const std::string w1 = arch.fused_gate_up      ? "layers.0.feed_forward.w13.weight"
                           : arch.mlp == Mlp::Gelu ? "layers.0.feed_forward.w3.weight"
                                                   : "layers.0.feed_forward.w1.weight";
    const std::vector<int64_t> gate = check.matrix(w1);
    const int64_t parts = arch.fused_gate_up ? 2 : 1;
    c.ffn = check.positive(hp.ffn);
    if (c.ffn * parts != gate[0]) check.differs(hp.ffn, c.ffn, w1, gate, {parts * c.ffn, gate[1]});
  }

  if (hp.layer_shapes) hp.layer_shapes(c);
  c.ctx = check.positive(hp.ctx);
  if (c.ctx > kMaxFileContext)
    check.fail(hp.ctx, "is more than cputrain computes (at most " + text(kMaxFileContext) + ")");

  // Every tensor of the model, now that the counts are bounded by the file.
  ParameterSet declared;
  DecoderModel::declare_parameters(c, declared);
  for (const FileTensor& t :
       file_tensors(declared, c, hp.naming, [](const ParameterInfo&) { return true; })) {
    const std::string& ours = declared.infos()[static_cast<size_t>(t.parts[0])].name;
    const std::optional<std::vector<int64_t>> has = shape_of(t.name);
    if (!has) throw UserError(hp.where + ": no tensor " + t.name + " (the model's " + ours + ")");
    // A matrix of one row may be held as a vector (llama.cpp's quantiser writes a shared expert's
    // gate, [C, 1] in the converter's file, as [C]).
    const auto squeezed = [](std::vector<int64_t> d) {
      while (d.size() > 1 && d.front() == 1) d.erase(d.begin());
      return d;
    };
    if (squeezed(*has) != squeezed(t.shape))
      throw UserError(hp.where + ": tensor " + t.name + " has shape " + check.shape(*has) +
                      " where " +
                      (hp.naming == TensorNaming::Gguf ? "the model's hyperparameters give"
                                                       : "config.json gives") +
                      " " + check.shape(t.shape));
  }
}

}  // namespace cputrain
