// The data pipeline: corpus listing and document splitting, the tokenizer's exact round trip,
// the token cache and its split, window sampling, and reuse of prepared data.
#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <set>

#include "engine/core/error.h"
#include "engine/core/hash.h"
#include "engine/data/batch_sampler.h"
#include "engine/data/corpus.h"
#include "engine/data/data_pipeline.h"
#include "engine/data/token_dataset.h"
#include "engine/text/tokenizer.h"

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
  const fs::path dir =
      fs::path(::testing::TempDir()) / ("cputrain_data_" + name + "_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir);
  return dir;
}

// A few hundred varied English-like documents, generated.
std::vector<std::string> synthetic_documents(int n) {
  const char* subjects[] = {"The cat", "A programmer", "My neighbour", "The old king", "Nobody"};
  const char* verbs[] = {"writes", "reads", "forgets", "remembers", "sings about", "eats"};
  const char* objects[] = {"the moon",           "a long letter",      "seven apples",
                           "the river at night", "an unfinished poem", "the compiler"};
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

TEST(Corpus, ReadsTheDocumentsOfEveryFileInOrder) {
  const fs::path dir = temp_dir("read");
  write(dir / "b" / "quotes", "second\n%\nthird\n%\n");
  write(dir / "b" / "quotes.dat", "\x01\x02 index");
  write(dir / "a", "first, a file without separators\n\n  and a blank line\n");
  write(dir / ".cache", "hidden\n");
  write(dir / "c", "raw \xff\xfe bytes\n%\n   \n");
  EXPECT_EQ(read_documents(dir.string()),
            (std::vector<std::string>{"first, a file without separators\n\n  and a blank line\n",
                                      "second\n", "third\n", std::string("raw \xff\xfe bytes\n")}));
  EXPECT_THROW(read_documents((dir / "nothing").string()), UserError);
}

// The corpus is its content: a copy with a new modification time, a `touch`, or the same files
// in another folder keep the fingerprint; a changed byte changes it, with size and time kept.
TEST(Corpus, FingerprintIsTheContent) {
  const fs::path dir = temp_dir("fingerprint");
  write(dir / "corpus" / "a", "one\n");
  write(dir / "corpus" / "sub" / "b", "two\n");
  const std::string corpus = (dir / "corpus").string();
  const uint64_t before = corpus_fingerprint(corpus, list_corpus_files(corpus));
  EXPECT_EQ(corpus_fingerprint(corpus, list_corpus_files(corpus)), before);
  fs::last_write_time(dir / "corpus" / "a",
                      fs::file_time_type::clock::now() + std::chrono::hours(1));
  EXPECT_EQ(corpus_fingerprint(corpus, list_corpus_files(corpus)), before);
  fs::copy(dir / "corpus", dir / "copy", fs::copy_options::recursive);
  const std::string copy = (dir / "copy").string();
  EXPECT_EQ(corpus_fingerprint(copy, list_corpus_files(copy)), before);
  // One byte changed, the size and modification time put back.
  const auto stamp = fs::last_write_time(dir / "corpus" / "a");
  write(dir / "corpus" / "a", "One\n");
  fs::last_write_time(dir / "corpus" / "a", stamp);
  EXPECT_NE(corpus_fingerprint(corpus, list_corpus_files(corpus)), before);
  // A file moved to another name is another corpus, though the bytes are the same.
  fs::rename(dir / "copy" / "sub" / "b", dir / "copy" / "sub" / "c");
  EXPECT_NE(corpus_fingerprint(copy, list_corpus_files(copy)), before);
  // A one-file corpus is its bytes, whatever its name and folder.
  write(dir / "x1", "same\n");
  write(dir / "other" / "x2", "same\n");
  const std::string x1 = (dir / "x1").string(), x2 = (dir / "other" / "x2").string();
  EXPECT_EQ(corpus_fingerprint(x1, {x1}), corpus_fingerprint(x2, {x2}));
}

// Binary files (a NUL byte near their start) and the folders the caller names are passed over,
// and said; a binary file or a folder of nothing else is refused in one line naming it.
TEST(Corpus, PassesOverBinaryFilesAndChosenFolders) {
  const fs::path dir = temp_dir("binary");
  write(dir / "a.txt", "text\n");
  write(dir / "model.bin", std::string("\x01\x00\x02", 3));
  write(dir / "run" / "train.log", "[12:00:00] a log is text\n");
  write(dir / "run" / "tokens.bin", std::string(16, '\0'));
  const CorpusFiles found = find_corpus_files(
      dir.string(), [&](const std::string& folder) { return fs::path(folder) == dir / "run"; });
  EXPECT_EQ(found.text, std::vector<std::string>{(dir / "a.txt").string()});
  EXPECT_EQ(found.binary, std::vector<std::string>{(dir / "model.bin").string()});
  EXPECT_EQ(found.skipped, std::vector<std::string>{(dir / "run").string()});
  try {
    find_corpus_files((dir / "model.bin").string());
    ADD_FAILURE() << "a binary file was taken as a corpus";
  } catch (const UserError& e) {
    EXPECT_NE(std::string(e.what()).find("not a text file"), std::string::npos) << e.what();
  }
  const fs::path binaries = temp_dir("binaries");
  write(binaries / "x.bin", std::string("\0\0", 2));
  try {
    find_corpus_files(binaries.string(), nullptr, "run/config.json: corpus " + binaries.string());
    ADD_FAILURE() << "a folder of binary files was taken as a corpus";
  } catch (const UserError& e) {
    const std::string what = e.what();
    EXPECT_EQ(what.find("run/config.json: corpus "), 0u) << what;
    EXPECT_NE(what.find("no text files (1 binary files passed over, such as"), std::string::npos)
        << what;
  }
}

// A long document is cut at paragraph breaks, else line breaks, else between characters, every
// byte kept; short ones pass as they are.
TEST(Corpus, SplitsLongDocumentsAtParagraphs) {
  std::string book;
  for (int i = 0; i < 40; ++i) book += "Paragraph " + std::to_string(i) + " says a little.\n\n";
  const std::vector<std::string> pieces = split_long_documents({"short\n", book}, 200);
  ASSERT_GT(pieces.size(), 4u);
  EXPECT_EQ(pieces[0], "short\n");
  std::string joined;
  for (size_t i = 1; i < pieces.size(); ++i) {
    EXPECT_LE(pieces[i].size(), 200u);
    if (i + 1 < pieces.size()) {
      EXPECT_TRUE(pieces[i].ends_with("\n\n")) << pieces[i];
      EXPECT_GE(pieces[i].size(), 100u);
    }
    joined += pieces[i];
  }
  EXPECT_EQ(joined, book);
  // No break at all: cut between UTF-8 characters, never inside one.
  std::string line;
  while (line.size() < 1000) line += "é☃a";
  std::string rejoined;
  for (const std::string& p : split_long_documents({line}, 100)) {
    EXPECT_LE(p.size(), 100u);
    EXPECT_NE(static_cast<unsigned char>(p[0]) & 0xC0, 0x80) << "a piece starts mid-character";
    rejoined += p;
  }
  EXPECT_EQ(rejoined, line);
  // The piece size: a twentieth of the corpus, within [1 KiB, 64 KiB].
  EXPECT_EQ(document_piece_bytes({std::string(100, 'x')}), 1024u);
  EXPECT_EQ(document_piece_bytes({std::string(200000, 'x')}), 10000u);
  EXPECT_EQ(document_piece_bytes({std::string(10000000, 'x')}), 65536u);
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
  EXPECT_GT(t.vocab_size(), 256 + 3 + 20);  // byte pieces, unk/bos/eos, and learned merges
  EXPECT_EQ(t.bos_id(), 1);
  EXPECT_EQ(t.eos_id(), 2);
  const std::vector<std::string> texts = {"Hello,\n  world!\n",
                                          "The cat writes the moon.",
                                          "  leading and trailing  ",
                                          "naïve ☃ café",
                                          "tabs\tand\n\nblank lines\n\n\n",
                                          "\r\n%\r\n",
                                          "    indented\n",
                                          ""};
  for (const std::string& text : texts) {
    const std::vector<int32_t> ids = t.encode(text);
    for (int32_t id : ids) {
      ASSERT_GE(id, 0);
      ASSERT_LT(id, t.vocab_size());
      ASSERT_NE(id, Tokenizer::kUnk) << text;  // byte fallback: nothing is unknown
      ASSERT_NE(id, t.bos_id()) << text;       // BOS only ever comes from the cache
    }
    EXPECT_EQ(t.decode(ids), text);
    EXPECT_EQ(t.decode(std::span<const int32_t>(ids)), text);
  }
  // Invalid UTF-8 (stray bytes, a cut sequence, an overlong form, a surrogate) encodes without
  // unknowns, and decodes to exactly its bytes, as valid text around it does.
  for (const std::string& text :
       {std::string("\x01\xff\xfe raw \xc3"), std::string("caf\xc3 ok \xe2\x98 x"),
        std::string("\xc0\xaf overlong, \xed\xa0\x80 surrogate, \xf4\x90\x80\x80 big"),
        std::string("  \x80 The cat writes the moon.\xff\n")}) {
    const std::vector<int32_t> ids = t.encode(text);
    for (int32_t id : ids) EXPECT_NE(id, Tokenizer::kUnk);
    EXPECT_EQ(t.decode(ids), text);
  }
  // Frequent training text compresses well below one token per byte.
  const std::string common = "The cat writes the moon.\n";
  EXPECT_LT(t.encode(common).size(), common.size() / 2);
}

TEST_F(TokenizerTest, LoadGivesTheSameTokenizer) {
  const Tokenizer loaded = Tokenizer::load((*dir_ / "tok.model").string());
  EXPECT_EQ(loaded.vocab_size(), tokenizer_->vocab_size());
  EXPECT_TRUE(loaded.model_bytes() == tokenizer_->model_bytes());
  EXPECT_TRUE(read(*dir_ / "tok.model") == tokenizer_->model_bytes());
  EXPECT_FALSE(fs::exists(*dir_ / "tok.model.tmp"));
  for (const std::string text : {"My neighbour sings about seven apples!\n", "naïve ☃\n\n  x"}) {
    EXPECT_EQ(loaded.encode(text), tokenizer_->encode(text));
    EXPECT_EQ(loaded.decode(tokenizer_->encode(text)), text);
  }
  Tokenizer moved = Tokenizer::load((*dir_ / "tok.model").string());
  Tokenizer target = std::move(moved);
  EXPECT_EQ(target.encode("The cat"), tokenizer_->encode("The cat"));
}

TEST_F(TokenizerTest, TrainingIsDeterministic) {
  const std::vector<std::string> docs = synthetic_documents(120);
  const Tokenizer a = Tokenizer::train(docs, 320, (*dir_ / "a.model").string());
  const Tokenizer b = Tokenizer::train(docs, 320, (*dir_ / "b.model").string());
  EXPECT_TRUE(a.model_bytes() == b.model_bytes());
}

TEST_F(TokenizerTest, TrainsOnLongDocumentsAndInvalidUtf8) {
  // A whole book as one document, and a 30 kB document without a line break: each longer than
  // SentencePiece accepts as one sentence, so training must cut them up.
  std::string book;
  for (int i = 0; book.size() < 100000; ++i)
    book += "Chapter " + std::to_string(i) + ": the cat and the dog go home.\n";
  std::string line;
  while (line.size() < 30000) line += "zebras, quaggas and okapis é ";
  const std::vector<std::string> docs = {book, line, "bytes \xff\xfe\x80 that are not UTF-8\n"};
  const Tokenizer t = Tokenizer::train(docs, 400, (*dir_ / "long.model").string());
  EXPECT_GT(t.vocab_size(), 300);
  for (const std::string& doc : {book, line}) {
    const std::vector<int32_t> ids = t.encode(doc);
    EXPECT_EQ(t.decode(ids), doc);
    EXPECT_LT(ids.size(), doc.size() / 2);  // both were learned from
  }
}

TEST_F(TokenizerTest, BadInputIsAUserError) {
  EXPECT_THROW(Tokenizer::load((*dir_ / "missing.model").string()), UserError);
  write(*dir_ / "garbage.model", "not a model");
  EXPECT_THROW(Tokenizer::load((*dir_ / "garbage.model").string()), UserError);
  write(*dir_ / "empty.model", "");
  EXPECT_THROW(Tokenizer::load((*dir_ / "empty.model").string()), UserError);
  EXPECT_THROW(Tokenizer::train(synthetic_documents(10), 100, (*dir_ / "small.model").string()),
               UserError);
  EXPECT_THROW(Tokenizer::train({}, 400, (*dir_ / "none.model").string()), UserError);
  EXPECT_FALSE(fs::exists(*dir_ / "small.model"));
  EXPECT_FALSE(fs::exists(*dir_ / "none.model"));
  try {
    Tokenizer::train(synthetic_documents(10), 100, (*dir_ / "small.model").string());
  } catch (const UserError& e) {
    EXPECT_NE(std::string(e.what()).find("--vocab 100"), std::string::npos) << e.what();
  }
}

// BOS + tokens of each document, in the given order.
std::vector<int32_t> expected_stream(const Tokenizer& t, const std::vector<std::string>& docs,
                                     const std::vector<size_t>& order) {
  std::vector<int32_t> out;
  for (size_t i : order) {
    out.push_back(Tokenizer::kBos);
    const std::vector<int32_t> ids = t.encode(docs[i]);
    out.insert(out.end(), ids.begin(), ids.end());
  }
  return out;
}

std::vector<int32_t> to_vector(std::span<const int32_t> s) {
  return {s.begin(), s.end()};
}

TEST_F(TokenizerTest, CacheHoldsEveryDocumentSplitAtBoundaries) {
  const std::vector<std::string> docs = synthetic_documents(57);
  const std::string cache = (*dir_ / "tokens.bin").string();
  const TokenDataset built = TokenDataset::build(docs, *tokenizer_, cache, 0x1234abcdull);
  EXPECT_FALSE(fs::exists(cache + ".tmp"));
  // Every tenth document (index 9, 19, ...) is validation.
  std::vector<size_t> train_docs, val_docs;
  for (size_t i = 0; i < docs.size(); ++i) (i % 10 == 9 ? val_docs : train_docs).push_back(i);
  const std::vector<int32_t> train = expected_stream(*tokenizer_, docs, train_docs);
  const std::vector<int32_t> val = expected_stream(*tokenizer_, docs, val_docs);
  TokenDataset opened = TokenDataset::open(cache);
  for (const TokenDataset* d : {&built, static_cast<const TokenDataset*>(&opened)}) {
    EXPECT_EQ(to_vector(d->train_tokens()), train);
    EXPECT_EQ(to_vector(d->val_tokens()), val);
    EXPECT_EQ(d->fingerprint(), 0x1234abcdull);
  }
  ASSERT_FALSE(opened.val_tokens().empty());
  EXPECT_EQ(opened.train_tokens()[0], Tokenizer::kBos);
  EXPECT_EQ(opened.val_tokens()[0], Tokenizer::kBos);
  const double share = static_cast<double>(val.size()) / (train.size() + val.size());
  EXPECT_GT(share, 0.05);
  EXPECT_LT(share, 0.15);
  // The file is the header and the tokens, nothing else.
  EXPECT_EQ(fs::file_size(cache), 8 + 3 * 8 + 4 * (train.size() + val.size()));
  EXPECT_EQ(read(cache).substr(0, 8), "CTTOK001");

  // Moving keeps the mapping alive in the new owner only.
  TokenDataset moved = std::move(opened);
  EXPECT_EQ(to_vector(moved.train_tokens()), train);
  EXPECT_TRUE(opened.train_tokens().empty());  // NOLINT(bugprone-use-after-move)
}

TEST_F(TokenizerTest, FewDocumentsStillGiveAValidationDocument) {
  const std::vector<std::string> docs = synthetic_documents(3);
  const std::string cache = (*dir_ / "few.bin").string();
  const TokenDataset three = TokenDataset::build(docs, *tokenizer_, cache, 1);
  EXPECT_EQ(to_vector(three.train_tokens()), expected_stream(*tokenizer_, docs, {0, 1}));
  EXPECT_EQ(to_vector(three.val_tokens()), expected_stream(*tokenizer_, docs, {2}));
  const TokenDataset one = TokenDataset::build({docs[0]}, *tokenizer_, cache, 1);
  EXPECT_EQ(to_vector(one.train_tokens()), expected_stream(*tokenizer_, docs, {0}));
  EXPECT_TRUE(one.val_tokens().empty());
  const TokenDataset none = TokenDataset::build({}, *tokenizer_, cache, 1);
  EXPECT_TRUE(none.train_tokens().empty());
  EXPECT_TRUE(none.val_tokens().empty());
}

TEST_F(TokenizerTest, DamagedCacheIsAUserError) {
  const std::string cache = (*dir_ / "damaged.bin").string();
  TokenDataset::build(synthetic_documents(20), *tokenizer_, cache, 7);
  const std::string bytes = read(cache);
  auto expect_rejected = [&](const std::string& content) {
    write(cache, content);
    try {
      TokenDataset::open(cache);
      ADD_FAILURE() << "accepted a damaged cache of " << content.size() << " bytes";
    } catch (const UserError& e) {
      EXPECT_NE(std::string(e.what()).find(cache), std::string::npos) << e.what();
    }
  };
  expect_rejected(bytes.substr(0, bytes.size() - 4));  // a token short
  expect_rejected(bytes.substr(0, bytes.size() - 3));  // not whole tokens
  expect_rejected(bytes + std::string(4, '\0'));       // a token too many
  expect_rejected(bytes.substr(0, 10));                // not even a header
  expect_rejected("");
  std::string bad_magic = bytes;
  bad_magic[0] = 'X';
  expect_rejected(bad_magic);
  std::string bad_split = bytes;
  const uint64_t too_many = uint64_t{1} << 40;
  std::memcpy(bad_split.data() + 16, &too_many, sizeof(too_many));  // train > total
  expect_rejected(bad_split);
  EXPECT_THROW(TokenDataset::open((*dir_ / "none.bin").string()), UserError);
  write(cache, bytes);
  EXPECT_EQ(TokenDataset::open(cache).fingerprint(), 7u);
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
  write(corpus / "quotes.dat", "index");
  const fs::path run = dir / "run";
  fs::create_directories(run);
  const fs::path model = run / "tokenizer.model", cache = run / "tokens.bin";

  const PreparedData first = prepare_data(corpus.string(), 350, run.string());
  EXPECT_FALSE(first.tokenizer_reused);
  EXPECT_FALSE(first.cache_reused);
  EXPECT_EQ(first.documents, 200);
  EXPECT_TRUE(read(model) == first.tokenizer.model_bytes());
  const auto model_stamp = fs::last_write_time(model);
  const auto cache_stamp = fs::last_write_time(cache);

  const PreparedData second = prepare_data(corpus.string(), 350, run.string());
  EXPECT_TRUE(second.tokenizer_reused);
  EXPECT_TRUE(second.cache_reused);
  EXPECT_EQ(second.documents, 200);
  EXPECT_EQ(fs::last_write_time(model), model_stamp);
  EXPECT_EQ(fs::last_write_time(cache), cache_stamp);
  EXPECT_EQ(to_vector(second.dataset.train_tokens()), to_vector(first.dataset.train_tokens()));
  EXPECT_EQ(to_vector(second.dataset.val_tokens()), to_vector(first.dataset.val_tokens()));

  // Another vocabulary: a new tokenizer and cache.
  const PreparedData other_vocab = prepare_data(corpus.string(), 330, run.string());
  EXPECT_FALSE(other_vocab.tokenizer_reused);
  EXPECT_FALSE(other_vocab.cache_reused);
  EXPECT_LE(other_vocab.tokenizer.vocab_size(), 330);
  EXPECT_TRUE(other_vocab.tokenizer.model_bytes() != first.tokenizer.model_bytes());
  EXPECT_NE(other_vocab.dataset.fingerprint(), first.dataset.fingerprint());

  // A grown corpus: the run keeps its tokenizer, the cache is rebuilt.
  write(corpus / "more", "An entirely new document about gardening.\n");
  const PreparedData grown = prepare_data(corpus.string(), 330, run.string());
  EXPECT_TRUE(grown.tokenizer_reused);
  EXPECT_FALSE(grown.cache_reused);
  EXPECT_TRUE(grown.tokenizer.model_bytes() == other_vocab.tokenizer.model_bytes());
  EXPECT_EQ(grown.documents, 201);

  // A damaged cache is rebuilt, not trusted; so is a damaged tokenizer. (Removed first: the
  // cache of `grown` is still mapped, and truncating a mapped file in place would fault it.)
  fs::remove(cache);
  write(cache, "garbage");
  const PreparedData rebuilt = prepare_data(corpus.string(), 330, run.string());
  EXPECT_FALSE(rebuilt.cache_reused);
  EXPECT_EQ(to_vector(rebuilt.dataset.train_tokens()), to_vector(grown.dataset.train_tokens()));
  write(model, "garbage");
  const PreparedData retrained = prepare_data(corpus.string(), 330, run.string());
  EXPECT_FALSE(retrained.tokenizer_reused);
  EXPECT_TRUE(read(model) == retrained.tokenizer.model_bytes());
  EXPECT_FALSE(fs::exists(run / "tokens.bin.tmp"));
  EXPECT_FALSE(fs::exists(run / "tokenizer.model.tmp"));

  // Bad input names the path or value.
  EXPECT_THROW(prepare_data((dir / "missing").string(), 330, run.string()), UserError);
  write(dir / "blank" / "a", "  \n%\n\n");
  EXPECT_THROW(prepare_data((dir / "blank").string(), 330, run.string()), UserError);
  const fs::path fresh = dir / "fresh";
  fs::create_directories(fresh);
  EXPECT_THROW(prepare_data(corpus.string(), 100, fresh.string()), UserError);
}

// A resumed run's data: its tokenizer is kept whatever the vocabulary says, a corpus whose
// content changed is refused before any file is written, and a touched or copied corpus is the
// same corpus.
TEST(DataPipeline, AResumedRunRefusesChangedContentWithoutWriting) {
  const fs::path dir = temp_dir("expect");
  const fs::path corpus = dir / "corpus.txt", run = dir / "run";
  std::string text;
  for (const std::string& d : synthetic_documents(200)) text += d + "%\n";
  write(corpus, text);
  fs::create_directories(run);
  const PreparedData first = prepare_data(corpus.string(), 350, run.string());
  const uint64_t fingerprint = first.dataset.fingerprint();
  DataOptions resume;
  resume.expect = fingerprint;
  resume.name = "run/config.json: corpus " + corpus.string();
  // Touched: the same content, the cache reused.
  fs::last_write_time(corpus, fs::file_time_type::clock::now() + std::chrono::hours(2));
  const PreparedData touched = prepare_data(corpus.string(), 999, run.string(), resume);
  EXPECT_TRUE(touched.cache_reused);
  EXPECT_EQ(touched.dataset.fingerprint(), fingerprint);
  // Changed: refused, naming the corpus as the run recorded it; tokens.bin is as it was.
  const std::string cache_before = read(run / "tokens.bin");
  const auto cache_stamp = fs::last_write_time(run / "tokens.bin");
  write(corpus, text + "A new document.\n");
  try {
    prepare_data(corpus.string(), 350, run.string(), resume);
    ADD_FAILURE() << "a changed corpus was taken for a resumed run";
  } catch (const UserError& e) {
    EXPECT_EQ(std::string(e.what()).find("run/config.json: corpus "), 0u) << e.what();
    EXPECT_NE(std::string(e.what()).find("not what the run was trained on"), std::string::npos)
        << e.what();
  }
  EXPECT_TRUE(read(run / "tokens.bin") == cache_before);
  EXPECT_EQ(fs::last_write_time(run / "tokens.bin"), cache_stamp);
  // Without the run's tokenizer a resumed run cannot go on: refused, nothing written.
  write(corpus, text);
  fs::remove(run / "tokenizer.model");
  EXPECT_THROW(prepare_data(corpus.string(), 350, run.string(), resume), UserError);
  EXPECT_FALSE(fs::exists(run / "tokenizer.model"));
}

// One large file, the commonest corpus, still gets a validation split of about a tenth.
TEST(DataPipeline, OneLargeFileHasAValidationSplit) {
  const fs::path dir = temp_dir("onefile");
  std::string book;
  for (const std::string& d : synthetic_documents(2000)) book += d + "\n";
  write(dir / "book.txt", book);
  fs::create_directories(dir / "run");
  const PreparedData data = prepare_data((dir / "book.txt").string(), 350, (dir / "run").string());
  EXPECT_GE(data.documents, 20);
  const double train = static_cast<double>(data.dataset.train_tokens().size());
  const double val = static_cast<double>(data.dataset.val_tokens().size());
  EXPECT_NEAR(val / (train + val), 0.1, 0.03);
  std::string decoded;
  for (auto split : {data.dataset.train_tokens(), data.dataset.val_tokens()}) {
    std::vector<int32_t> ids;
    for (int32_t id : split)
      if (id != data.tokenizer.bos_id()) ids.push_back(id);
    decoded += data.tokenizer.decode(ids);
  }
  EXPECT_EQ(decoded.size(), book.size());  // every byte in one split or the other
}

// The default corpus, when installed: prepared quickly at a realistic vocabulary, every
// document round-trips, and the split is about 90/10.
TEST(DataPipeline, PreparesTheFortunesCorpus) {
  const std::string fortunes = "/usr/share/games/fortunes";
  if (!fs::is_directory(fortunes)) GTEST_SKIP() << fortunes << " is not installed";
  const fs::path run = temp_dir("fortunes");
  const PreparedData data = prepare_data(fortunes, 4096, run.string());
  EXPECT_EQ(data.tokenizer.vocab_size(), 4096);
  EXPECT_GT(data.documents, 1000);
  const double train = static_cast<double>(data.dataset.train_tokens().size());
  const double val = static_cast<double>(data.dataset.val_tokens().size());
  EXPECT_NEAR(val / (train + val), 0.1, 0.03);
  int64_t mismatches = 0;
  double bytes = 0;
  for (const std::string& doc : read_documents(fortunes)) {
    mismatches += data.tokenizer.decode(data.tokenizer.encode(doc)) != doc;
    bytes += static_cast<double>(doc.size());
  }
  EXPECT_EQ(mismatches, 0);
  EXPECT_GT(bytes / (train + val), 2.5);  // bytes per token: BPE merges are doing their work
  fs::remove_all(run);
}

}  // namespace
}  // namespace cputrain
