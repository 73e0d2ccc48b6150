// The data pipeline: corpus listing and document splitting, the tokenizer's exact round trip,
// the token cache and its split, window sampling, and reuse of prepared data.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <set>

#include "engine/batch_sampler.h"
#include "engine/corpus.h"
#include "engine/data_pipeline.h"
#include "engine/error.h"
#include "engine/hash.h"
#include "engine/token_dataset.h"
#include "engine/tokenizer.h"

namespace cputrain {
namespace {
namespace fs = std::filesystem;

void write(const fs::path& path, const std::string& text) {
  fs::create_directories(path.parent_path());
  std::ofstream(path, std::ios::binary) << text;
}

std::string read(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

// A fresh, empty folder per test.
fs::path temp_dir(const std::string& name) {
  const fs::path dir = fs::path(::testing::TempDir()) / ("cputrain_data_" + name + "_" +
                                                         std::to_string(::getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir);
  return dir;
}

// A few hundred varied English-like documents, generated.
std::vector<std::string> synthetic_documents(int n) {
  const char* subjects[] = {"The cat", "A programmer", "My neighbour", "The old king", "Nobody"};
  const char* verbs[] = {"writes", "reads", "forgets", "remembers", "sings about", "eats"};
  const char* objects[] = {"the moon", "a long letter", "seven apples", "the river at night",
                           "an unfinished poem", "the compiler"};
  std::vector<std::string> docs;
  for (int i = 0; i < n; ++i) {
    std::string d;
    for (int s = 0; s < 1 + i % 4; ++s) {
      d += subjects[(i + s) % 5];
      d += ' ';
      d += verbs[(i * 7 + s) % 6];
      d += ' ';
      d += objects[(i * 3 + s * 5) % 6];
      d += (i + s) % 3 ? ".\n" : "!\n\t-- " + std::to_string(1900 + i) + "\n";
    }
    docs.push_back(d);
  }
  return docs;
}

TEST(Corpus, ListsRegularFilesSkippingIndexesHiddenAndLinks) {
  const fs::path dir = temp_dir("list");
  write(dir / "b", "two\n");
  write(dir / "a", "one\n");
  write(dir / "a.dat", "index");
  write(dir / ".hidden", "secret");
  write(dir / ".git" / "config", "x");
  write(dir / "sub" / "c", "three\n");
  fs::create_symlink(dir / "a", dir / "a.u8");
  const std::vector<std::string> files = list_corpus_files(dir.string());
  EXPECT_EQ(files, (std::vector<std::string>{(dir / "a").string(), (dir / "b").string(),
                                             (dir / "sub" / "c").string()}));
  EXPECT_EQ(list_corpus_files((dir / "b").string()),
            std::vector<std::string>{(dir / "b").string()});
  EXPECT_THROW(list_corpus_files((dir / "missing").string()), UserError);
  const fs::path empty = temp_dir("empty");
  write(empty / "x.dat", "index");
  EXPECT_THROW(list_corpus_files(empty.string()), UserError);
}

TEST(Corpus, SplitsDocumentsAtPercentLines) {
  EXPECT_EQ(split_documents("one\nline\n%\ntwo\n%\n  \n%\nthree"),
            (std::vector<std::string>{"one\nline\n", "two\n", "three"}));
  EXPECT_EQ(split_documents("no separators\n50% off\n"),
            std::vector<std::string>{"no separators\n50% off\n"});
  EXPECT_EQ(split_documents("a\r\n%\r\nb\n"), (std::vector<std::string>{"a\r\n", "b\n"}));
  EXPECT_TRUE(split_documents("%\n%\n").empty());
}

TEST(Corpus, FingerprintChangesWithContent) {
  const fs::path dir = temp_dir("fingerprint");
  write(dir / "a", "one\n");
  const std::vector<std::string> files = list_corpus_files(dir.string());
  const uint64_t before = corpus_fingerprint(files);
  EXPECT_EQ(corpus_fingerprint(files), before);
  write(dir / "a", "one more\n");
  EXPECT_NE(corpus_fingerprint(files), before);
}

class TokenizerTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new fs::path(temp_dir("tokenizer"));
    tokenizer_ = new Tokenizer(
        Tokenizer::train(synthetic_documents(300), 400, (*dir_ / "tok.model").string()));
  }
  static void TearDownTestSuite() {
    delete tokenizer_;
    delete dir_;
  }
  static fs::path* dir_;
  static Tokenizer* tokenizer_;
};
fs::path* TokenizerTest::dir_ = nullptr;
Tokenizer* TokenizerTest::tokenizer_ = nullptr;

TEST_F(TokenizerTest, RoundTripsAnyTextExactly) {
  const Tokenizer& t = *tokenizer_;
  EXPECT_LE(t.vocab_size(), 400);
  EXPECT_GT(t.vocab_size(), Tokenizer::kMinVocab - 50);
  const std::vector<std::string> texts = {"Hello,\n  world!\n", "The cat writes the moon.", "  leading and trailing  ",
        "naïve ☃ café", "tabs\tand\n\nblank lines\n", std::string("\x01\xff\xfe raw", 7), ""};
  for (const std::string& text : texts) {
    const std::vector<int32_t> ids = t.encode(text);
    for (int32_t id : ids) {
      ASSERT_GE(id, 0);
      ASSERT_LT(id, t.vocab_size());
      ASSERT_NE(id, Tokenizer::kUnk) << text;  // byte fallback: nothing is unknown
    }
    if (text.find('\xff') == std::string::npos) {  // invalid UTF-8 cannot decode exactly
      EXPECT_EQ(t.decode(ids), text);
    }
  }
  // Frequent training text compresses well below one token per byte.
  const std::string common = "The cat writes the moon.\n";
  EXPECT_LT(t.encode(common).size(), common.size() / 2);
}

TEST_F(TokenizerTest, LoadGivesTheSameTokenizer) {
  const Tokenizer loaded = Tokenizer::load((*dir_ / "tok.model").string());
  EXPECT_EQ(loaded.vocab_size(), tokenizer_->vocab_size());
  EXPECT_EQ(loaded.model_bytes(), tokenizer_->model_bytes());
  const std::string text = "My neighbour sings about seven apples!\n";
  EXPECT_EQ(loaded.encode(text), tokenizer_->encode(text));
  EXPECT_EQ(loaded.bos_id(), 1);
}

TEST_F(TokenizerTest, BadInputIsAUserError) {
  EXPECT_THROW(Tokenizer::load((*dir_ / "missing.model").string()), UserError);
  write(*dir_ / "garbage.model", "not a model");
  EXPECT_THROW(Tokenizer::load((*dir_ / "garbage.model").string()), UserError);
  EXPECT_THROW(Tokenizer::train(synthetic_documents(10), 100, (*dir_ / "small.model").string()),
               UserError);
  EXPECT_FALSE(fs::exists(*dir_ / "small.model"));
}

TEST_F(TokenizerTest, CacheHoldsEveryDocumentSplitAtBoundaries) {
  const std::vector<std::string> docs = synthetic_documents(57);
  const std::string cache = (*dir_ / "tokens.bin").string();
  const TokenCacheKey key{11, 22, 400};
  const TokenDataset built = TokenDataset::build(docs, *tokenizer_, cache, key);
  // Expected streams: BOS + tokens per document; every tenth document is validation.
  std::vector<int32_t> train, val;
  for (size_t i = 0; i < docs.size(); ++i) {
    std::vector<int32_t>& dst = i % 10 == 9 ? val : train;
    dst.push_back(Tokenizer::kBos);
    const std::vector<int32_t> ids = tokenizer_->encode(docs[i]);
    dst.insert(dst.end(), ids.begin(), ids.end());
  }
  const TokenDataset opened = TokenDataset::open(cache);
  for (const TokenDataset* d : {&built, &opened}) {
    EXPECT_EQ(std::vector<int32_t>(d->train_tokens().begin(), d->train_tokens().end()), train);
    EXPECT_EQ(std::vector<int32_t>(d->val_tokens().begin(), d->val_tokens().end()), val);
    EXPECT_EQ(d->key(), key);
    EXPECT_EQ(d->train_documents(), 52);
    EXPECT_EQ(d->val_documents(), 5);
  }
  EXPECT_EQ(opened.val_tokens()[0], Tokenizer::kBos);
  const double share = static_cast<double>(val.size()) / (train.size() + val.size());
  EXPECT_GT(share, 0.05);
  EXPECT_LT(share, 0.15);
}

TEST_F(TokenizerTest, DamagedCacheIsAUserError) {
  const std::string cache = (*dir_ / "damaged.bin").string();
  TokenDataset::build(synthetic_documents(20), *tokenizer_, cache, {1, 2, 3});
  const std::string bytes = read(cache);
  write(cache, bytes.substr(0, bytes.size() - 3));
  EXPECT_THROW(TokenDataset::open(cache), UserError);
  write(cache, bytes.substr(0, 10));
  EXPECT_THROW(TokenDataset::open(cache), UserError);
  std::string bad_magic = bytes;
  bad_magic[0] = 'X';
  write(cache, bad_magic);
  EXPECT_THROW(TokenDataset::open(cache), UserError);
  EXPECT_THROW(TokenDataset::open((*dir_ / "none.bin").string()), UserError);
}

std::vector<int32_t> counting_stream(int32_t n) {
  std::vector<int32_t> t(n);
  for (int32_t i = 0; i < n; ++i) t[i] = i;
  return t;
}

TEST(BatchSampler, WindowsAreSeededShiftedAndIndependentOfGrouping) {
  const std::vector<int32_t> tokens = counting_stream(1000);
  const int64_t ctx = 16, rows = 6;
  std::vector<int32_t> in(rows * ctx), tgt(rows * ctx);
  sample_windows(tokens, ctx, 7, 3, 0, rows, in.data(), tgt.data());
  std::set<int32_t> starts;
  for (int64_t r = 0; r < rows; ++r) {
    const int32_t start = in[r * ctx];
    starts.insert(start);
    ASSERT_GE(start, 0);
    ASSERT_LE(start + ctx, 999);
    for (int64_t t = 0; t < ctx; ++t) {
      ASSERT_EQ(in[r * ctx + t], start + t);
      ASSERT_EQ(tgt[r * ctx + t], start + t + 1);
    }
  }
  EXPECT_GT(starts.size(), 4u);  // rows differ

  // Rows 0-5 in one call equal rows 0-1, 2-3 and 4-5 in three calls.
  std::vector<int32_t> in2(rows * ctx), tgt2(rows * ctx);
  for (int64_t first = 0; first < rows; first += 2)
    sample_windows(tokens, ctx, 7, 3, first, 2, in2.data() + first * ctx,
                   tgt2.data() + first * ctx);
  EXPECT_EQ(in, in2);
  EXPECT_EQ(tgt, tgt2);

  std::vector<int32_t> other_step(rows * ctx), other_seed(rows * ctx), scratch(rows * ctx);
  sample_windows(tokens, ctx, 7, 4, 0, rows, other_step.data(), scratch.data());
  sample_windows(tokens, ctx, 8, 3, 0, rows, other_seed.data(), scratch.data());
  EXPECT_NE(in, other_step);
  EXPECT_NE(in, other_seed);

  // The shortest usable stream has exactly one window.
  const std::vector<int32_t> tiny = counting_stream(ctx + 1);
  sample_windows(tiny, ctx, 1, 1, 0, 1, in.data(), tgt.data());
  EXPECT_EQ(in[0], 0);
  EXPECT_EQ(tgt[ctx - 1], ctx);
  EXPECT_THROW(sample_windows(counting_stream(ctx), ctx, 1, 1, 0, 1, in.data(), tgt.data()),
               std::invalid_argument);
}

TEST(BatchSampler, EvaluationWindowsTileTheStream) {
  const std::vector<int32_t> tokens = counting_stream(50);
  EXPECT_EQ(eval_window_count(tokens, 16), 3);  // needs 16 * 3 + 1 = 49 tokens
  EXPECT_EQ(eval_window_count(counting_stream(48), 16), 2);
  EXPECT_EQ(eval_window_count(counting_stream(16), 16), 0);
  std::vector<int32_t> in(2 * 16), tgt(2 * 16);
  eval_windows(tokens, 16, 1, 2, in.data(), tgt.data());
  for (int t = 0; t < 32; ++t) {
    EXPECT_EQ(in[t], 16 + t);
    EXPECT_EQ(tgt[t], 17 + t);
  }
  EXPECT_THROW(eval_windows(tokens, 16, 2, 2, in.data(), tgt.data()), std::invalid_argument);
}

TEST(DataPipeline, ReusesPreparedDataAndRebuildsWhenInputsChange) {
  const fs::path dir = temp_dir("pipeline");
  const fs::path corpus = dir / "corpus";
  std::string text;
  for (const std::string& d : synthetic_documents(200)) text += d + "%\n";
  write(corpus / "quotes", text);
  const fs::path run = dir / "run";
  fs::create_directories(run);

  const PreparedData first = prepare_data(corpus.string(), 350, run.string());
  EXPECT_FALSE(first.reused);
  EXPECT_EQ(first.dataset.train_documents() + first.dataset.val_documents(), 200);
  const auto stamp = fs::last_write_time(run / "tokens.bin");

  const PreparedData second = prepare_data(corpus.string(), 350, run.string());
  EXPECT_TRUE(second.reused);
  EXPECT_EQ(fs::last_write_time(run / "tokens.bin"), stamp);
  EXPECT_TRUE(std::equal(first.dataset.train_tokens().begin(), first.dataset.train_tokens().end(),
                         second.dataset.train_tokens().begin(),
                         second.dataset.train_tokens().end()));

  const PreparedData other_vocab = prepare_data(corpus.string(), 330, run.string());
  EXPECT_FALSE(other_vocab.reused);
  EXPECT_LE(other_vocab.tokenizer.vocab_size(), 330);

  write(corpus / "more", "An entirely new document about gardening.\n");
  const PreparedData grown = prepare_data(corpus.string(), 330, run.string());
  EXPECT_FALSE(grown.reused);
  EXPECT_EQ(grown.dataset.train_documents() + grown.dataset.val_documents(), 201);

  // A damaged cache is rebuilt, not trusted.
  write(run / "tokens.bin", "garbage");
  const PreparedData rebuilt = prepare_data(corpus.string(), 330, run.string());
  EXPECT_FALSE(rebuilt.reused);
  EXPECT_EQ(rebuilt.dataset.train_documents() + rebuilt.dataset.val_documents(), 201);
}

}  // namespace
}  // namespace cputrain
