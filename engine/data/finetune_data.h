// Fine-tuning data: JSON Lines of examples in the shapes people write them, rendered into token
// ids with the tokens the loss falls on.
//   {"text": ...}                                   all of it
//   {"prompt": ..., "completion": ...}              the completion
//   {"instruction": ..., "input": ..., "output": ...}  (Alpaca; input optional) the output
//   {"messages": [{"role": ..., "content": ...}, ...]}  the assistant's replies
// Chat is rendered with the chat template (engine/text/chat_template.h); so is Alpaca where there
// is one (instruction and input as the user's message), else Alpaca's own prompt. Text, completions
// and outputs end with EOS, so the model learns to stop; a reply ends with its template's marker.
#pragma once

#include <array>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "engine/core/ops.h"
#include "engine/data/batch_sampler.h"
#include "engine/text/chat_template.h"

namespace cputrain {

class Tokenizer;

enum class ExampleShape { Text, PromptCompletion, Alpaca, Chat };
inline constexpr int kExampleShapes = 4;
// "text", "prompt/completion", "alpaca", "chat".
const char* example_shape_name(ExampleShape shape);

struct FinetuneExample {
  std::vector<int32_t> tokens;  // BOS first where the tokenizer begins texts with it
  std::vector<uint8_t> target;  // per token, 1 where predicting it counts (never the first)
  int64_t line = 0;             // in the file, from 1
};

struct FinetuneDataOptions {
  // The chat template (the model's or --chat-template); chat examples need one.
  std::optional<ChatTemplate> chat;
  bool train_on_prompt = false;  // every token after the first is a target
  int64_t max_tokens = 0;        // longer examples are cut to this many (0: not cut)
  // A line longer than this is refused before it is read whole (0: any): what the memory limit
  // lets one example's text, JSON and tokens hold at once.
  int64_t max_line_bytes = 0;
  // The examples' tokens and targets may hold at most this many bytes (0: any): a file whose
  // examples hold more is refused as soon as they do.
  int64_t max_data_bytes = 0;
};

struct FinetuneData {
  std::vector<FinetuneExample> examples;
  std::array<int64_t, kExampleShapes> shapes{};  // examples of each shape
  int64_t truncated = 0;                         // examples cut to max_tokens
  int64_t dropped = 0;                           // examples with no target left once cut
  int64_t tokens = 0;
  int64_t targets = 0;
};

// Reads `path`: one JSON object a line (blank lines pass). A UserError "PATH:LINE: what is wrong"
// for a line that is not a JSON object, has none of the shapes' fields or a field of the wrong
// type, an empty reply, a role other than system, user and assistant, a chat without an
// assistant reply (unless train_on_prompt), or a chat where no template is known; and for a file
// that cannot be read or holds no example.
FinetuneData read_finetune_jsonl(const std::string& path, const Tokenizer& tokenizer,
                                 const FinetuneDataOptions& options);

// Examples packed into rows of `ctx` positions, whole examples one after another: an example of
// n tokens takes n - 1 positions (its inputs; its targets are the tokens after them). Best fit
// over the examples longest first, so that little but some rows' tails is padding. Examples must
// be of 2 .. ctx + 1 tokens.
struct PackedRow {
  std::vector<int32_t> examples;  // indices, in the row's order
  int64_t positions = 0;          // taken, at most ctx
};
std::vector<PackedRow> pack_examples(const std::vector<FinetuneExample>& examples, int64_t ctx);
// The same over units of `sizes` positions (1 .. ctx each): each row lists its units' indices.
std::vector<PackedRow> pack_units(const std::vector<int64_t>& sizes, int64_t ctx);

// How a fine-tune's steps take its rows: `per_step` a step, in an order shuffled anew each epoch
// (RowOrder). By epoch, each epoch takes epoch_steps() steps, its last the rows left of it and
// for the rest empty rows (no target: the step's loss is over its targets), so that E epochs are
// E passes over the data; else the steps run on through the epochs' sequence.
struct RowPlan {
  int64_t rows = 0, per_step = 1;
  bool by_epoch = true;
  int64_t epoch_steps() const { return (rows + per_step - 1) / per_step; }
  // The steps of `epochs` passes over the rows, at least 1.
  int64_t steps_for(double epochs) const;
  // The passes over the rows `steps` steps make.
  double epochs_of(int64_t steps) const;
};

// The rows of a fine-tune's steps as `plan` takes them, and the (batch, ctx) i32 buffers a
// micro-batch is written into, made where the source is built (after the trainer, as the memory
// budget makes them).
class StepRows {
 public:
  StepRows(std::vector<PackedRow> rows, int64_t ctx, int64_t batch, const RowPlan& plan,
           uint64_t seed);
  // Step `step`'s rows (1-based), kept until the next call.
  std::span<const PackedRow* const> take(int64_t step);
  std::span<const PackedRow* const> last() const { return step_; }
  const Tensor& inputs() const { return inputs_; }
  const Tensor& targets() const { return targets_; }

 private:
  std::vector<PackedRow> rows_;
  RowOrder order_;
  RowPlan plan_;
  PackedRow empty_;  // a row of no example
  Tensor inputs_, targets_;
  std::vector<const PackedRow*> step_;
};

// Writes `rows` as a (rows.size(), ctx) batch: each example's inputs and targets (-1 where a
// token is no target), then `pad` with no target to the row's end; `packing` gets each row's
// sequence lengths (a padding tail is a sequence of its own). Returns the count of targets.
int64_t fill_packed_batch(std::span<const PackedRow* const> rows,
                          const std::vector<FinetuneExample>& examples, int64_t ctx, int32_t pad,
                          int32_t* inputs, int32_t* targets, Packing& packing);

// The targets of the examples in `rows` (every token marked a target but an example's first).
int64_t count_targets(std::span<const PackedRow* const> rows,
                      const std::vector<FinetuneExample>& examples);
// The most targets any `batch` of `rows` holds together: those of the batch rows with the most.
int64_t most_targets(const std::vector<PackedRow>& rows,
                     const std::vector<FinetuneExample>& examples, int64_t batch);

}  // namespace cputrain
