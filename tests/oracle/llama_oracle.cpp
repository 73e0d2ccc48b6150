// The test oracle: llama.cpp itself (libllama from the npm package tools/install_deps.sh
// --llamacpp installs), driven through its C API. Built only where that is installed; the interop
// tests compare cputrain with what it prints.
//
//   llama_oracle logits MODEL OUT [lora=ADAPTER] TOKEN...
//                                             every position's logits, float32, n x vocab, to
//                                             OUT; with a LoRA adapter file, at scale 1
//   llama_oracle tokenize MODEL TEXT_FILE [special]
//                                             the token ids of the file's text (no BOS), one line;
//                                             with "special", special tokens in it are parsed
//   llama_oracle quantize IN OUT TYPE         llama_model_quantize to q8_0, q4_0, q5_0, q5_1,
//   q4_k_m or q5_k_m llama_oracle generate MODEL N THREADS     N greedy tokens after BOS; prints
//   the ids, then the
//                                             load seconds and the tokens/s after the first
//   llama_oracle chat TEMPLATE MESSAGES [prompt]
//                                             llama_chat_apply_template's text, to stdout, of the
//                                             messages (MESSAGES: role \x1f content records, each
//                                             ending \x1e) with TEMPLATE, a file of a Jinja
//                                             template's text or a built-in name; with "prompt",
//                                             the assistant's turn begun
//
// Logits use an F32 KV cache and no flash attention, one batch holding the whole sequence.
#include <ggml-backend.h>
#include <llama.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

namespace {

[[noreturn]] void fail(const std::string& message) {
  std::fprintf(stderr, "llama_oracle: %s\n", message.c_str());
  std::exit(1);
}

void quiet(ggml_log_level level, const char* text, void*) {
  if (level >= GGML_LOG_LEVEL_ERROR) std::fputs(text, stderr);
}

llama_model* load(const char* path) {
  llama_model_params params = llama_model_default_params();
  params.progress_callback = [](float, void*) { return true; };
  llama_model* model = llama_model_load_from_file(path, params);
  if (model == nullptr) fail(std::string("cannot load ") + path);
  return model;
}

llama_context* context(llama_model* model, int n_ctx, int threads) {
  llama_context_params params = llama_context_default_params();
  params.n_ctx = static_cast<uint32_t>(n_ctx);
  params.n_batch = static_cast<uint32_t>(n_ctx);
  params.n_ubatch = static_cast<uint32_t>(n_ctx);
  params.n_seq_max = 1;
  params.n_threads = threads;
  params.n_threads_batch = threads;
  params.type_k = GGML_TYPE_F32;
  params.type_v = GGML_TYPE_F32;
  params.flash_attn_type = LLAMA_FLASH_ATTN_TYPE_DISABLED;
  params.no_perf = true;
  llama_context* ctx = llama_init_from_model(model, params);
  if (ctx == nullptr) fail("cannot create a context");
  return ctx;
}

int logits(int argc, char** argv) {
  if (argc < 5) fail("logits MODEL OUT [lora=ADAPTER] TOKEN...");
  llama_model* model = load(argv[2]);
  int first = 4;
  llama_adapter_lora* adapter = nullptr;
  if (std::string(argv[4]).starts_with("lora=")) {
    adapter = llama_adapter_lora_init(model, argv[4] + 5);
    if (adapter == nullptr) fail(std::string("cannot load the adapter ") + (argv[4] + 5));
    ++first;
  }
  std::vector<llama_token> tokens;
  for (int i = first; i < argc; ++i) tokens.push_back(std::atoi(argv[i]));
  const int n = static_cast<int>(tokens.size());
  llama_context* ctx = context(model, n < 16 ? 16 : n, 2);
  if (adapter) {
    float scale = 1.0f;
    if (llama_set_adapters_lora(ctx, &adapter, 1, &scale) != 0) fail("llama_set_adapters_lora");
  }
  llama_batch batch = llama_batch_init(n, 0, 1);
  for (int i = 0; i < n; ++i) {
    batch.token[i] = tokens[static_cast<size_t>(i)];
    batch.pos[i] = i;
    batch.n_seq_id[i] = 1;
    batch.seq_id[i][0] = 0;
    batch.logits[i] = 1;
  }
  batch.n_tokens = n;
  if (llama_decode(ctx, batch) != 0) fail("llama_decode failed");
  const int vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));
  std::ofstream out(argv[3], std::ios::binary);
  for (int i = 0; i < n; ++i)
    out.write(reinterpret_cast<const char*>(llama_get_logits_ith(ctx, i)),
              static_cast<std::streamsize>(sizeof(float) * static_cast<size_t>(vocab)));
  if (!out) fail(std::string("cannot write ") + argv[3]);
  llama_batch_free(batch);
  llama_free(ctx);
  llama_model_free(model);
  return 0;
}

int tokenize(int argc, char** argv) {
  if (argc != 4 && argc != 5) fail("tokenize MODEL TEXT_FILE [special]");
  const bool special = argc == 5 && std::string(argv[4]) == "special";
  llama_model_params params = llama_model_default_params();
  params.vocab_only = true;
  llama_model* model = llama_model_load_from_file(argv[2], params);
  if (model == nullptr) fail(std::string("cannot load ") + argv[2]);
  std::ifstream in(argv[3], std::ios::binary);
  std::stringstream text;
  text << in.rdbuf();
  const std::string s = text.str();
  const llama_vocab* vocab = llama_model_get_vocab(model);
  std::vector<llama_token> ids(s.size() + 16);
  const int n = llama_tokenize(vocab, s.data(), static_cast<int32_t>(s.size()), ids.data(),
                               static_cast<int32_t>(ids.size()), false, special);
  if (n < 0) fail("llama_tokenize failed");
  for (int i = 0; i < n; ++i) std::printf("%s%d", i ? " " : "", ids[static_cast<size_t>(i)]);
  std::printf("\n");
  llama_model_free(model);
  return 0;
}

int quantize(int argc, char** argv) {
  if (argc != 5) fail("quantize IN OUT q8_0|q4_0|q5_0|q5_1|q4_k_m|q5_k_m|mxfp4_moe");
  llama_model_quantize_params params = llama_model_quantize_default_params();
  const std::string type = argv[4];
  if (type == "q8_0")
    params.ftype = LLAMA_FTYPE_MOSTLY_Q8_0;
  else if (type == "q4_0")
    params.ftype = LLAMA_FTYPE_MOSTLY_Q4_0;
  else if (type == "q5_0")
    params.ftype = LLAMA_FTYPE_MOSTLY_Q5_0;
  else if (type == "q5_1")
    params.ftype = LLAMA_FTYPE_MOSTLY_Q5_1;
  else if (type == "q4_k_m")
    params.ftype = LLAMA_FTYPE_MOSTLY_Q4_K_M;
  else if (type == "q5_k_m")
    params.ftype = LLAMA_FTYPE_MOSTLY_Q5_K_M;
  else if (type == "mxfp4_moe")  // a mixture's experts MXFP4, the rest Q8_0
    params.ftype = LLAMA_FTYPE_MOSTLY_MXFP4_MOE;
  else
    fail("unknown type " + type);
  params.nthread = 2;
  params.allow_requantize = true;  // a Q8_0 file in (benchmarks/make_model.py's mixtures)
  if (llama_model_quantize(argv[2], argv[3], &params) != 0) fail("llama_model_quantize failed");
  return 0;
}

int generate(int argc, char** argv) {
  if (argc != 5) fail("generate MODEL N THREADS");
  const auto loading = std::chrono::steady_clock::now();
  llama_model* model = load(argv[2]);
  const int n = std::atoi(argv[3]);
  llama_context* ctx = context(model, n + 8, std::atoi(argv[4]));
  const llama_vocab* vocab = llama_model_get_vocab(model);
  const int n_vocab = llama_vocab_n_tokens(vocab);
  llama_token token = llama_vocab_bos(vocab);
  const double load_seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - loading).count();
  auto start = std::chrono::steady_clock::now();
  for (int i = 0; i < n; ++i) {
    if (i == 1) start = std::chrono::steady_clock::now();  // the rate after the first token
    if (llama_decode(ctx, llama_batch_get_one(&token, 1)) != 0) fail("llama_decode failed");
    const float* l = llama_get_logits_ith(ctx, -1);
    llama_token best = 0;
    for (int v = 1; v < n_vocab; ++v)
      if (l[v] > l[best]) best = v;
    token = best;
    std::printf("%s%d", i ? " " : "", token);
  }
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::printf("\n%.3f %.3f\n", load_seconds, (n - 1) / seconds);
  llama_free(ctx);
  llama_model_free(model);
  return 0;
}

std::string read_file(const char* path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) fail(std::string("cannot read ") + path);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

int chat(int argc, char** argv) {
  if (argc != 4 && argc != 5) fail("chat TEMPLATE MESSAGES [prompt]");
  std::ifstream probe(argv[2]);
  const std::string tmpl = probe ? read_file(argv[2]) : std::string(argv[2]);
  const std::string records = read_file(argv[3]);
  std::vector<std::string> roles, contents;
  for (size_t pos = 0; pos < records.size();) {
    const size_t unit = records.find('\x1f', pos), end = records.find('\x1e', pos);
    if (unit == std::string::npos || end == std::string::npos || unit > end)
      fail("MESSAGES: role \\x1f content \\x1e records");
    roles.push_back(records.substr(pos, unit - pos));
    contents.push_back(records.substr(unit + 1, end - unit - 1));
    pos = end + 1;
  }
  std::vector<llama_chat_message> chat;
  for (size_t i = 0; i < roles.size(); ++i) chat.push_back({roles[i].c_str(), contents[i].c_str()});
  const bool prompt = argc == 5 && std::string(argv[4]) == "prompt";
  std::vector<char> buf(records.size() * 4 + 4096);
  int32_t n = llama_chat_apply_template(tmpl.c_str(), chat.data(), chat.size(), prompt, buf.data(),
                                        static_cast<int32_t>(buf.size()));
  if (n > static_cast<int32_t>(buf.size())) {
    buf.resize(static_cast<size_t>(n));
    n = llama_chat_apply_template(tmpl.c_str(), chat.data(), chat.size(), prompt, buf.data(), n);
  }
  if (n < 0) fail("llama_chat_apply_template does not know the template");
  std::fwrite(buf.data(), 1, static_cast<size_t>(n), stdout);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) fail("logits | tokenize | quantize | generate | chat");
  llama_log_set(quiet, nullptr);
  ggml_backend_load_all_from_path(LLAMA_ORACLE_BACKENDS);
  llama_backend_init();
  const std::string mode = argv[1];
  int rc = 1;
  if (mode == "logits")
    rc = logits(argc, argv);
  else if (mode == "tokenize")
    rc = tokenize(argc, argv);
  else if (mode == "quantize")
    rc = quantize(argc, argv);
  else if (mode == "generate")
    rc = generate(argc, argv);
  else if (mode == "chat")
    rc = chat(argc, argv);
  else
    fail("unknown mode " + mode);
  llama_backend_free();
  return rc;
}
