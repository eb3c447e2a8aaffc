// generate's decode steps from their tokens: the embedding, every decoder layer and the final norm in one call, over
// operands and a KV cache held here between the steps of one loop.
// A part of the fused CPU kernel: one translation unit, the parts concatenated in the order of
// csrc/cpu/parts.txt (see prelude.h); it uses what the parts before it define.

// ------------------------------------------------------------------------------------------------ decode tokens
// A step of decode_loop._StackSession (through decode_session_step, below): x = embed[ids] (nn.Embedding's forward:
// the rows copied), the rotary rows of `position` (cos and sin the tables [positions, r], every sequence at that
// position) or cos and sin as decode_stack takes them ([N or 1, 1, r], position -1), decode_stack (no mask: every
// key), then, where `final_norm`, the final layer norm (ATen's kernel, the values of torch.layer_norm over the last
// dimension, as nn.LayerNorm). In Python these were four ATen calls around decode_stack (the embedding, two rotary
// rows, the norm): each took 5-30 us right after the LM head, whose 50-100 MB stream evicts their code and data from
// the caches, where the same calls take 2-5 us warm (MF-small bfloat16 on the 2-vCPU Zen 4 of docs/performance.md:
// the embedding 24-45 us, the norm 22-35 us, per step). A token outside [0, embeddings) writes nothing and returns an
// empty output and no keys or values (a 1-D output, where a step's is [N, hidden]): the caller declines the step, and
// the module path raises its error.
std::tuple<at::Tensor, std::vector<at::Tensor>, std::vector<at::Tensor>> decode_tokens(
    const at::Tensor& ids, const at::Tensor& embed, at::TensorList keys, at::TensorList values, const at::Tensor& cos,
    const at::Tensor& sin, int64_t position, int64_t num_heads, double scaling,
    const c10::List<std::optional<at::Tensor>>& tensors, at::ArrayRef<double> floats, at::IntArrayRef ints,
    at::IntArrayRef owned, bool final_norm, const std::optional<at::Tensor>& norm_weight,
    const std::optional<at::Tensor>& norm_bias, double norm_eps) {
  const char* op = "memoryformer.decode_tokens";
  TORCH_CHECK(ids.dim() == 2 && ids.size(1) == 1 && ids.scalar_type() == at::kLong && ids.device().is_cpu(), op,
              ": ids must be one int64 token per sequence [N, 1] on the CPU, got ", ids.sizes(), " ",
              ids.scalar_type());
  TORCH_CHECK(embed.dim() == 2 && embed.device().is_cpu() && embed.stride(1) == 1, op, ": the embedding must be a CPU "
              "matrix [embeddings, hidden] with contiguous rows, got ", embed.sizes(), " strides ", embed.strides());
  const int64_t N = ids.size(0), V = embed.size(0), d = embed.size(1);
  const at::Tensor tokens = ids.contiguous();
  const int64_t* t = tokens.data_ptr<int64_t>();
  for (int64_t n = 0; n < N; ++n)
    if (t[n] < 0 || t[n] >= V) return {at::empty({0}, embed.options()), {}, {}};
  at::Tensor x = at::empty({N, d}, embed.options());
  const int64_t row = d * static_cast<int64_t>(embed.element_size());
  const char* from = static_cast<const char*>(embed.data_ptr());
  for (int64_t n = 0; n < N; ++n)
    std::memcpy(static_cast<char*>(x.data_ptr()) + n * row, from + t[n] * embed.stride(0) * embed.element_size(), row);
  at::Tensor c = cos, s = sin;
  if (position >= 0) {
    TORCH_CHECK(cos.dim() == 2 && sin.sizes() == cos.sizes() && position < cos.size(0), op, ": with a position, cos "
                "and sin must be the rotary tables [positions, r] holding it, got ", cos.sizes(), " and ", sin.sizes(),
                " for position ", position);
    c = cos.narrow(0, position, 1).reshape({1, 1, cos.size(1)});
    s = sin.narrow(0, position, 1).reshape({1, 1, sin.size(1)});
  }
  auto [h, new_keys, new_values] = decode_stack_op(x, keys, values, std::nullopt, c, s, num_heads, scaling, tensors,
                                                   floats, ints, owned);
  if (final_norm) h = aten_layer_norm(h, norm_weight, norm_bias, norm_eps);
  return {h, std::move(new_keys), std::move(new_values)};
}

// ------------------------------------------------------------------------------------------------ decode sessions
// decode_tokens's operands (per layer 12 tensors, 5 floats and 9 ints, decode_stack's) and the layers' keys and
// values, held here from decode_session_open to decode_session_close, so that a step passes its tokens alone: the
// operand lists cost 18 us (MF-small, 144 tensors) to 37 us (MF-base) per call to convert, warm, and the keys and
// values it returned as many Python objects again, which the loop then stored into the cache's layers. The loop
// (decode_loop.py) takes the keys and values at the close and stores them into its cache then: only transformers' own
// callbacks run between the steps, which read nothing of the cache. Sessions are numbered per process; each is run
// by one loop at a time.
struct DecodeSession {
  at::Tensor embed, cos, sin;
  std::vector<at::Tensor> keys, values;
  c10::List<std::optional<at::Tensor>> tensors;
  std::vector<double> floats;
  std::vector<int64_t> ints, owned;
  int64_t num_heads = 0;
  double scaling = 1.0;
  bool final_norm = false;
  std::optional<at::Tensor> norm_weight, norm_bias, head_weight, head_bias;
  double norm_eps = 0.0;
};

struct DecodeSessions {
  std::mutex m;
  std::map<int64_t, std::shared_ptr<DecodeSession>> open;
  int64_t next = 1;
};

DecodeSessions& decode_sessions() {
  static DecodeSessions sessions;
  return sessions;
}

// A session over the cache's keys and values (the views decode_stack returned last for their buffers, so that a
// step may grow them in place), the embedding, the rotary tables cos and sin [positions, r], decode_stack's operands,
// the final norm and, for greedy search, the LM head (its weight [vocabulary, hidden] and bias: each step then ends
// with linear_rows_argmax, the logits and their argmax in one pass); returns its number.
int64_t decode_session_open_op(const at::Tensor& embed, at::TensorList keys, at::TensorList values,
                               const at::Tensor& cos, const at::Tensor& sin, int64_t num_heads, double scaling,
                               const c10::List<std::optional<at::Tensor>>& tensors, at::ArrayRef<double> floats,
                               at::IntArrayRef ints, bool final_norm, const std::optional<at::Tensor>& norm_weight,
                               const std::optional<at::Tensor>& norm_bias, double norm_eps,
                               const std::optional<at::Tensor>& head_weight,
                               const std::optional<at::Tensor>& head_bias) {
  TORCH_CHECK(keys.size() == values.size(), "memoryformer.decode_session_open: ", keys.size(), " layers of keys, ",
              values.size(), " of values");
  auto s = std::make_shared<DecodeSession>();
  s->embed = embed;
  s->cos = cos;
  s->sin = sin;
  s->keys = keys.vec();
  s->values = values.vec();
  s->tensors = tensors.copy();
  s->floats = floats.vec();
  s->ints = ints.vec();
  s->owned.assign(keys.size(), 1);
  s->num_heads = num_heads;
  s->scaling = scaling;
  s->final_norm = final_norm;
  s->norm_weight = norm_weight;
  s->norm_bias = norm_bias;
  s->norm_eps = norm_eps;
  s->head_weight = head_weight;
  s->head_bias = head_bias;
  DecodeSessions& all = decode_sessions();
  std::lock_guard<std::mutex> lock(all.m);
  const int64_t id = all.next++;
  all.open.emplace(id, std::move(s));
  return id;
}

std::shared_ptr<DecodeSession> decode_session(const char* op, int64_t id, bool close) {
  DecodeSessions& all = decode_sessions();
  std::lock_guard<std::mutex> lock(all.m);
  const auto it = all.open.find(id);
  TORCH_CHECK(it != all.open.end(), op, ": no open decode session ", id, " (closed already, or never opened)");
  auto s = it->second;
  if (close) all.open.erase(it);
  return s;
}

// One step of session `id` for `ids` [N, 1]: at `position` of the session's rotary tables, or (position -1) at the
// rows cos and sin [N, 1, r]. Returns decode_tokens's output [N, hidden] and no tokens (an empty tensor), or, for a
// session with the LM head, the logits [N, vocabulary] and their argmax [N]; a 1-D empty output where a token lies
// outside the vocabulary (nothing written: the session's keys and values stay the last step's).
std::tuple<at::Tensor, at::Tensor> decode_session_step_op(int64_t id, const at::Tensor& ids, int64_t position,
                                                          const std::optional<at::Tensor>& cos,
                                                          const std::optional<at::Tensor>& sin) {
  const char* op = "memoryformer.decode_session_step";
  const auto s = decode_session(op, id, false);
  TORCH_CHECK((position >= 0) != (cos.has_value() && sin.has_value()), op, ": give a position of the session's rotary "
              "tables or the rows cos and sin (position -1), got position ", position);
  auto [h, keys, values] = decode_tokens(ids, s->embed, s->keys, s->values, cos ? *cos : s->cos, sin ? *sin : s->sin,
                                         position, s->num_heads, s->scaling, s->tensors, s->floats, s->ints, s->owned,
                                         s->final_norm, s->norm_weight, s->norm_bias, s->norm_eps);
  if (h.dim() != 2) return {h, at::empty({0}, ids.options())};
  s->keys = std::move(keys);
  s->values = std::move(values);
  if (s->head_weight.has_value()) return linear_rows_argmax_op(h, *s->head_weight, s->head_bias);
  return {h, at::empty({0}, ids.options())};
}

// Ends session `id`: its layers' keys and values as its last step left them.
std::tuple<std::vector<at::Tensor>, std::vector<at::Tensor>> decode_session_close_op(int64_t id) {
  const auto s = decode_session("memoryformer.decode_session_close", id, true);
  return {std::move(s->keys), std::move(s->values)};
}
