#include "tools/grpo_rewards.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <fcntl.h>
#include <fmt/format.h>
#include <pcre2.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstring>
#include <optional>

namespace cputrain {
namespace {

using json = nlohmann::json;

// A compiled PCRE2 pattern (UTF-8).
class Regex {
 public:
  Regex(const std::string& pattern, const std::string& flag) {
    int error = 0;
    PCRE2_SIZE offset = 0;
    code_ = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(),
                          PCRE2_UTF | PCRE2_UCP, &error, &offset, nullptr);
    if (!code_) {
      PCRE2_UCHAR message[256];
      pcre2_get_error_message(error, message, sizeof(message));
      throw UserError(flag + " '" + pattern + "': " + reinterpret_cast<const char*>(message) +
                      " (at offset " + std::to_string(offset) + ")");
    }
    data_ = pcre2_match_data_create_from_pattern(code_, nullptr);
    uint32_t n = 0;
    pcre2_pattern_info(code_, PCRE2_INFO_CAPTURECOUNT, &n);
    group_ = n > 0 ? 1 : 0;
  }
  ~Regex() {
    pcre2_match_data_free(data_);
    pcre2_code_free(code_);
  }
  Regex(const Regex&) = delete;
  Regex& operator=(const Regex&) = delete;
  // The last match in `text` (its first group where the pattern has one, else the match), or
  // nullopt; `any` stops at the first.
  std::optional<std::string> last(const std::string& text, bool any = false) const {
    std::optional<std::string> found;
    PCRE2_SIZE start = 0;
    const int group = group_;
    while (start <= text.size()) {
      const int rc = pcre2_match(code_, reinterpret_cast<PCRE2_SPTR>(text.data()), text.size(),
                                 start, 0, data_, nullptr);
      if (rc < 0) break;
      const PCRE2_SIZE* v = pcre2_get_ovector_pointer(data_);
      if (v[2 * group] != PCRE2_UNSET)
        found = text.substr(v[2 * group], v[2 * group + 1] - v[2 * group]);
      else
        found = std::string();
      if (any) break;
      start = v[1] > v[0] ? v[1] : v[0] + 1;
    }
    return found;
  }

 private:
  pcre2_code* code_ = nullptr;
  pcre2_match_data* data_ = nullptr;
  int group_ = 0;  // the ovector pair reported: the first group where there is one
};

// A number as written: digits with commas between thousands, a sign, decimals.
constexpr const char* kNumber = R"(-?[0-9][0-9,]*(?:\.[0-9]+)?)";

std::optional<double> as_number(std::string s) {
  std::erase(s, ',');
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.pop_back();
  size_t i = 0;
  while (i < s.size() && std::isspace(static_cast<unsigned char>(s[i]))) ++i;
  s = s.substr(i);
  if (s.empty()) return std::nullopt;
  char* end = nullptr;
  errno = 0;
  const double v = std::strtod(s.c_str(), &end);
  if (end != s.c_str() + s.size() || errno != 0 || !std::isfinite(v)) return std::nullopt;
  return v;
}

std::string trimmed(const std::string& s) {
  size_t a = 0, b = s.size();
  while (a < b && std::isspace(static_cast<unsigned char>(s[a]))) ++a;
  while (b > a && std::isspace(static_cast<unsigned char>(s[b - 1]))) --b;
  return s.substr(a, b - a);
}

// A field as text: a string as it is, a number or anything else as JSON writes it.
std::string field_text(const json& v) {
  return v.is_string() ? v.get<std::string>() : v.dump();
}

// A completion's text for a message, short: its first 60 characters, as JSON writes a string.
std::string excerpt(const std::string& text) {
  const std::string s = text.size() > 60 ? text.substr(0, 60) + "..." : text;
  return json(s).dump(-1, ' ', false, json::error_handler_t::replace);
}

class ExactReward final : public RewardFunction {
 public:
  ExactReward(const RewardOptions& o) : field_(o.answer_field), number_(kNumber, "exact") {
    if (!o.answer_pattern.empty())
      pattern_ = std::make_unique<Regex>(o.answer_pattern, "--answer-pattern");
  }
  void check_fields(const json& fields, const std::string& where) const override {
    if (!fields.contains(field_))
      throw UserError(where + ": no \"" + field_ + "\" field, which the exact reward reads" +
                      " (--answer-field names another)");
  }
  void score(std::span<const RewardInput> in, std::span<double> out) override {
    for (size_t i = 0; i < in.size(); ++i) {
      const std::string want = field_text(in[i].fields->at(field_));
      std::optional<std::string> got;
      if (pattern_) {
        got = pattern_->last(*in[i].completion);
      } else {
        got = number_.last(*in[i].completion);
      }
      double r = 0.0;
      if (got) {
        const std::optional<std::string> want_number =
            pattern_ ? std::optional<std::string>(want) : number_.last(want);
        const std::optional<double> a = as_number(*got);
        const std::optional<double> b = want_number ? as_number(*want_number) : std::nullopt;
        if (a && b)
          r = *a == *b ? 1.0 : 0.0;
        else
          r = trimmed(*got) == trimmed(want) ? 1.0 : 0.0;
      }
      out[i] = r;
    }
  }

 private:
  std::string field_;
  Regex number_;
  std::unique_ptr<Regex> pattern_;
};

// {FIELD} in a pattern: the field's text, quoted (\Q...\E) so that it matches as written.
class RegexReward final : public RewardFunction {
 public:
  explicit RegexReward(const RewardOptions& o) : pattern_(o.reward_pattern) {
    if (pattern_.empty())
      throw UserError("--reward regex: give --reward-pattern, the pattern a completion matches");
    // Compiled once with each field as a plain word, to refuse a bad pattern now.
    Regex check(substitute(json::object(), true), "--reward-pattern");
  }
  void check_fields(const json& fields, const std::string& where) const override {
    for (const std::string& name : names())
      if (!fields.contains(name))
        throw UserError(where + ": no \"" + name + "\" field, which --reward-pattern '" + pattern_ +
                        "' reads");
  }
  void score(std::span<const RewardInput> in, std::span<double> out) override {
    for (size_t i = 0; i < in.size(); ++i) {
      const std::string p = substitute(*in[i].fields, false);
      auto& re = cache_[p];
      if (!re) re = std::make_unique<Regex>(p, "--reward-pattern");
      out[i] = re->last(*in[i].completion, true) ? 1.0 : 0.0;
    }
  }

 private:
  std::vector<std::string> names() const {
    std::vector<std::string> n;
    for (size_t a = pattern_.find('{'); a != std::string::npos; a = pattern_.find('{', a + 1)) {
      const size_t b = pattern_.find('}', a);
      if (b == std::string::npos) break;
      const std::string name = pattern_.substr(a + 1, b - a - 1);
      if (!name.empty() &&
          name.find_first_not_of("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
                                 "0123456789_") == std::string::npos)
        n.push_back(name);
    }
    return n;
  }
  std::string substitute(const json& fields, bool placeholder) const {
    std::string p = pattern_;
    for (const std::string& name : names()) {
      std::string value = placeholder ? "x" : field_text(fields.at(name));
      // \E inside \Q...\E would end the quoting: written as \E\\E\Q.
      std::string quoted = "\\Q";
      for (size_t k = 0; k < value.size(); ++k) {
        if (value.compare(k, 2, "\\E") == 0) {
          quoted += "\\E\\\\E\\Q";
          ++k;
        } else {
          quoted += value[k];
        }
      }
      quoted += "\\E";
      const std::string key = "{" + name + "}";
      for (size_t at = p.find(key); at != std::string::npos; at = p.find(key, at + quoted.size()))
        p.replace(at, key.size(), quoted);
    }
    return p;
  }
  std::string pattern_;
  std::map<std::string, std::unique_ptr<Regex>> cache_;
};

class LengthReward final : public RewardFunction {
 public:
  explicit LengthReward(int64_t max) : max_(static_cast<double>(std::max<int64_t>(max, 1))) {}
  void score(std::span<const RewardInput> in, std::span<double> out) override {
    for (size_t i = 0; i < in.size(); ++i) out[i] = -static_cast<double>(in[i].tokens) / max_;
  }

 private:
  double max_;
};

// The reward command: one process, started with the first batch, fed a batch's lines while its
// answers are read (poll), so that neither side waits on a full pipe.
class CommandReward final : public RewardFunction {
 public:
  CommandReward(std::string command, double timeout_s, std::string log)
      : command_(std::move(command)), timeout_s_(timeout_s), log_(std::move(log)) {}
  ~CommandReward() override { stop(); }
  void score(std::span<const RewardInput> in, std::span<double> out) override {
    if (pid_ <= 0) start();
    // Output before this batch's lines are sent: more lines than the batch before was given.
    pollfd early{from_, POLLIN, 0};
    if (!pending_.empty() || (::poll(&early, 1, 0) > 0 && (early.revents & POLLIN))) {
      char buf[256];
      if (!pending_.empty() || ::read(from_, buf, sizeof(buf)) > 0)
        fail(in, 0,
             "printed more lines than the completions it was given (they came before "
             "this batch was sent)");
    }
    std::string input;
    for (const RewardInput& r : in) {
      const json line = {
          {"prompt", *r.prompt}, {"completion", *r.completion}, {"fields", *r.fields}};
      input += line.dump(-1, ' ', false, json::error_handler_t::replace) + "\n";
    }
    size_t written = 0, got = 0;
    using Clock = std::chrono::steady_clock;
    auto last = Clock::now();
    while (got < in.size()) {
      pollfd fds[2] = {{to_, POLLOUT, 0}, {from_, POLLIN, 0}};
      const bool writing = written < input.size() && to_ >= 0;
      const double left = timeout_s_ - std::chrono::duration<double>(Clock::now() - last).count();
      if (left <= 0.0)
        fail(in, got, fmt::format("gave no score within {:g} s (--reward-timeout)", timeout_s_));
      const int n = ::poll(writing ? fds : fds + 1, writing ? 2 : 1,
                           static_cast<int>(std::ceil(std::min(left, 1e6) * 1000.0)));
      if (n < 0 && errno != EINTR) fail(in, got, std::string("poll: ") + std::strerror(errno));
      if (n <= 0) continue;
      if (writing && (fds[0].revents & (POLLOUT | POLLERR | POLLHUP))) {
        const ssize_t w = ::write(to_, input.data() + written, input.size() - written);
        if (w < 0 && errno != EAGAIN && errno != EINTR) fail(in, got, ended());
        if (w > 0) written += static_cast<size_t>(w);
      }
      if (fds[1].revents & (POLLIN | POLLHUP | POLLERR)) {
        char buf[4096];
        const ssize_t r = ::read(from_, buf, sizeof(buf));
        if (r == 0) fail(in, got, ended());
        if (r < 0 && errno != EAGAIN && errno != EINTR) fail(in, got, ended());
        if (r > 0) {
          pending_.append(buf, static_cast<size_t>(r));
          last = Clock::now();
        }
        for (size_t nl = pending_.find('\n'); nl != std::string::npos; nl = pending_.find('\n')) {
          const std::string line = pending_.substr(0, nl);
          pending_.erase(0, nl + 1);
          if (got >= in.size())
            fail(in, got - 1,
                 "printed more lines than the " + std::to_string(in.size()) +
                     " completions it was given");
          const std::optional<double> v = as_number(line);
          if (!v) fail(in, got, "printed " + excerpt(line) + ", not a number");
          out[got++] = *v;
        }
      }
    }
    // A line more, there or coming at once: more answers than completions. (One later still is
    // found before the next batch is sent.)
    pollfd extra{from_, POLLIN, 0};
    if (!pending_.empty() || (::poll(&extra, 1, 20) > 0 && (extra.revents & POLLIN))) {
      char buf[256];
      const ssize_t r = pending_.empty() ? ::read(from_, buf, sizeof(buf)) : 1;
      if (r > 0)
        fail(in, in.size() - 1,
             "printed more lines than the " + std::to_string(in.size()) +
                 " completions it was given");
    }
  }

 private:
  void start() {
    int in_pipe[2], out_pipe[2];
    if (::pipe2(in_pipe, O_CLOEXEC) != 0 || ::pipe2(out_pipe, O_CLOEXEC) != 0)
      throw RewardFailure("--reward-command '" + command_ + "': cannot make a pipe");
    // A write to a command that has ended is an error to report, not a signal.
    ::signal(SIGPIPE, SIG_IGN);
    pid_ = ::fork();
    if (pid_ < 0) throw RewardFailure("--reward-command '" + command_ + "': cannot start it");
    if (pid_ == 0) {
      ::dup2(in_pipe[0], 0);
      ::dup2(out_pipe[1], 1);
      if (!log_.empty()) {
        const int err = ::open(log_.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
        if (err >= 0) ::dup2(err, 2);
      }
      ::execl("/bin/sh", "sh", "-c", command_.c_str(), static_cast<char*>(nullptr));
      ::_exit(127);
    }
    ::close(in_pipe[0]);
    ::close(out_pipe[1]);
    to_ = in_pipe[1];
    from_ = out_pipe[0];
    ::fcntl(to_, F_SETFL, ::fcntl(to_, F_GETFL) | O_NONBLOCK);
  }
  void stop() {
    if (pid_ <= 0) return;
    if (to_ >= 0) ::close(to_);
    if (from_ >= 0) ::close(from_);
    to_ = from_ = -1;
    int status = 0;
    for (int i = 0; i < 20 && ::waitpid(pid_, &status, WNOHANG) == 0; ++i) ::usleep(10000);
    if (::waitpid(pid_, &status, WNOHANG) == 0) {
      ::kill(pid_, SIGKILL);
      ::waitpid(pid_, &status, 0);
    }
    pid_ = -1;
  }
  // How the command ended, where it has.
  std::string ended() {
    int status = 0;
    for (int i = 0; i < 50 && pid_ > 0; ++i) {
      const pid_t p = ::waitpid(pid_, &status, WNOHANG);
      if (p == pid_) {
        pid_ = -1;
        if (WIFEXITED(status)) return fmt::format("ended (exit status {})", WEXITSTATUS(status));
        if (WIFSIGNALED(status)) return fmt::format("ended (signal {})", WTERMSIG(status));
      }
      ::usleep(10000);
    }
    return "closed its output";
  }
  [[noreturn]] void fail(std::span<const RewardInput> in, size_t at, const std::string& what) {
    stop();
    pending_.clear();
    const RewardInput& r = in[std::min(at, in.size() - 1)];
    throw RewardFailure(fmt::format(
        "--reward-command '{}' {} (at completion {} of {}: {}, to the prompt {}){}", command_, what,
        std::min(at, in.size() - 1) + 1, in.size(), excerpt(*r.completion),
        excerpt(r.prompt->is_string() ? r.prompt->get<std::string>() : r.prompt->dump()),
        log_.empty() ? "" : "; its stderr is in " + log_));
  }
  std::string command_;
  double timeout_s_;
  std::string log_;
  pid_t pid_ = -1;
  int to_ = -1, from_ = -1;
  std::string pending_;
};

}  // namespace

std::vector<WeightedReward> make_rewards(const RewardOptions& o) {
  std::string list = o.rewards;
  if (list.empty()) {
    if (o.command.empty())
      throw UserError(
          "--method grpo: give --reward (exact, regex, length, command: NAME[:WEIGHT],...) or "
          "--reward-command CMD");
    list = "command";
  }
  std::vector<WeightedReward> rewards;
  bool exact = false, regex = false, command = false;
  size_t start = 0;
  while (start <= list.size()) {
    const size_t comma = std::min(list.find(',', start), list.size());
    const std::string item = trimmed(list.substr(start, comma - start));
    start = comma + 1;
    if (item.empty()) throw UserError("--reward '" + o.rewards + "': an empty name");
    const size_t colon = item.find(':');
    WeightedReward w;
    w.name = item.substr(0, colon);
    if (colon != std::string::npos) {
      const std::optional<double> v = as_number(item.substr(colon + 1));
      if (!v || *v == 0.0)
        throw UserError("--reward " + item + ": the weight is a number other than 0");
      w.weight = *v;
    }
    for (const WeightedReward& r : rewards)
      if (r.name == w.name) throw UserError("--reward " + w.name + ": named twice");
    if (w.name == "exact") {
      w.function = std::make_unique<ExactReward>(o);
      exact = true;
    } else if (w.name == "regex") {
      w.function = std::make_unique<RegexReward>(o);
      regex = true;
    } else if (w.name == "length") {
      w.function = std::make_unique<LengthReward>(o.max_completion);
    } else if (w.name == "command") {
      if (o.command.empty())
        throw UserError("--reward command: give --reward-command CMD, the program that scores");
      w.function = std::make_unique<CommandReward>(o.command, o.timeout_s, o.command_log);
      command = true;
    } else {
      throw UserError("--reward " + w.name + ": not a reward (exact, regex, length, command)");
    }
    rewards.push_back(std::move(w));
    if (comma == list.size()) break;
  }
  if (!exact && !o.answer_pattern.empty())
    throw UserError("--answer-pattern is the exact reward's: add exact to --reward");
  if (!regex && !o.reward_pattern.empty())
    throw UserError("--reward-pattern is the regex reward's: add regex to --reward");
  if (!command && !o.command.empty())
    throw UserError("--reward-command: add command to --reward (" + o.rewards + ")");
  return rewards;
}

std::string rewards_text(const std::vector<WeightedReward>& rewards) {
  std::string s;
  for (const WeightedReward& r : rewards)
    s += fmt::format("{}{}:{:g}", s.empty() ? "" : ",", r.name, r.weight);
  return s;
}

}  // namespace cputrain
