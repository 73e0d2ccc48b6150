#include "engine/text/chat_template.h"

#include "engine/core/error.h"

namespace cputrain {
namespace {

constexpr std::string_view kNames[] = {"chatml", "llama3", "llama2", "mistral",
                                       "zephyr", "phi3",   "gemma",  "gemma4"};

std::string trimmed(const std::string& s) {
  const char* space = " \t\n\r\f\v";
  const size_t first = s.find_first_not_of(space);
  if (first == std::string::npos) return "";
  return s.substr(first, s.find_last_not_of(space) - first + 1);
}

// Appends a piece, joining it to the last where both are of one kind.
void put(std::vector<ChatPiece>& out, std::string text, bool markers, bool reply) {
  if (text.empty()) return;
  if (!out.empty() && out.back().markers == markers && out.back().reply == reply) {
    out.back().text += text;
    return;
  }
  out.push_back({std::move(text), markers, reply});
}

}  // namespace

std::string_view chat_family_name(ChatFamily family) {
  return kNames[static_cast<int>(family)];
}

std::string chat_family_names() {
  std::string names;
  for (std::string_view n : kNames) {
    if (!names.empty()) names += ", ";
    names += n;
  }
  return names;
}

std::optional<ChatTemplate> detect_chat_template(std::string_view jinja, const std::string& eos) {
  const auto has = [&](std::string_view marker) {
    return jinja.find(marker) != std::string_view::npos;
  };
  ChatTemplate t;
  if (has("<|im_start|>")) {
    t.family = ChatFamily::ChatMl;
    return t;
  }
  if (has("<|start_header_id|>") && has("<|end_header_id|>")) {
    t.family = ChatFamily::Llama3;
    return t;
  }
  if (has("[INST]")) {
    if (has("[SYSTEM_PROMPT]")) return std::nullopt;  // Mistral's v7
    if (has("' [INST] ' + system_message") || has("[AVAILABLE_TOOLS]")) {
      // Mistral's v3 tokenizer; v1's leading spaces and tekken's lack of them are others.
      if (has(" [INST]") || has("\"[INST]\"")) return std::nullopt;
      t.family = ChatFamily::Mistral;
      return t;
    }
    t.family = ChatFamily::Llama2;
    // As llama.cpp reads them: stripping, where asked, goes without BOS in the history.
    t.system_block = has("<<SYS>>");
    t.strip = has("content.strip()");
    t.bos_in_history = !t.strip && has("bos_token + '[INST]");
    return t;
  }
  if (has("<|assistant|>") && has("<|end|>")) {
    t.family = ChatFamily::Phi3;
    return t;
  }
  if (has("<|turn>") && has("<turn|>")) {
    t.family = ChatFamily::Gemma4;
    return t;
  }
  if (has("<start_of_turn>")) {
    t.family = ChatFamily::Gemma;
    return t;
  }
  if (has("<|user|>") && !has("<|end|>") &&
      (has("<|endoftext|>") || (has("<|assistant|>") && has("eos_token")))) {
    t.family = ChatFamily::Zephyr;
    t.end = has("<|endoftext|>") ? "<|endoftext|>" : eos;
    return t;
  }
  return std::nullopt;
}

ChatTemplate chat_template_named(const std::string& name, const std::string& flag,
                                 const std::string& eos) {
  for (size_t i = 0; i < std::size(kNames); ++i) {
    if (name != kNames[i]) continue;
    ChatTemplate t;
    t.family = static_cast<ChatFamily>(i);
    // llama2 by name: with <<SYS>> and BOS before each later [INST] (llama.cpp's llama2-sys-bos).
    if (t.family == ChatFamily::Llama2) t.bos_in_history = true;
    if (t.family == ChatFamily::Zephyr && !eos.empty()) t.end = eos;
    return t;
  }
  throw UserError(flag + " " + name + ": no such chat template (there are " + chat_family_names() +
                  ")");
}

std::vector<ChatPiece> render_chat(const ChatTemplate& t, std::span<const ChatMessage> messages,
                                   bool generation_prompt) {
  std::vector<ChatPiece> out;
  const auto marker = [&](std::string text) { put(out, std::move(text), true, false); };
  switch (t.family) {
    case ChatFamily::ChatMl:
      for (const ChatMessage& m : messages) {
        const bool reply = m.role == "assistant";
        marker("<|im_start|>" + m.role + "\n");
        put(out, m.content, false, reply);
        put(out, "<|im_end|>", true, reply);
        marker("\n");
      }
      if (generation_prompt) marker("<|im_start|>assistant\n");
      break;
    case ChatFamily::Llama3:
      for (const ChatMessage& m : messages) {
        const bool reply = m.role == "assistant";
        marker("<|start_header_id|>" + m.role + "<|end_header_id|>\n\n");
        put(out, trimmed(m.content), false, reply);
        put(out, "<|eot_id|>", true, reply);
      }
      if (generation_prompt) marker("<|start_header_id|>assistant<|end_header_id|>\n\n");
      break;
    case ChatFamily::Llama2: {
      bool in_turn = true;
      marker("[INST] ");
      for (const ChatMessage& m : messages) {
        const std::string content = t.strip ? trimmed(m.content) : m.content;
        if (!in_turn) {
          in_turn = true;
          marker(t.bos_in_history ? "<s>[INST] " : "[INST] ");
        }
        if (m.role == "system") {
          if (t.system_block) marker("<<SYS>>\n");
          put(out, content, false, false);
          marker(t.system_block ? "\n<</SYS>>\n\n" : "\n");
        } else if (m.role == "user") {
          put(out, content, false, false);
          marker(" [/INST]");
        } else {
          put(out, content, false, true);
          put(out, "</s>", true, true);
          in_turn = false;
        }
      }
      break;
    }
    case ChatFamily::Mistral: {
      bool in_turn = false;
      for (const ChatMessage& m : messages) {
        if (!in_turn) {
          marker("[INST] ");
          in_turn = true;
        }
        if (m.role == "system") {
          put(out, m.content, false, false);
          marker("\n\n");
        } else if (m.role == "user") {
          put(out, m.content, false, false);
          marker("[/INST]");
        } else {
          std::string reply(1, ' ');
          reply += trimmed(m.content);
          put(out, std::move(reply), false, true);
          put(out, "</s>", true, true);
          in_turn = false;
        }
      }
      break;
    }
    case ChatFamily::Zephyr:
    case ChatFamily::Phi3:
      for (const ChatMessage& m : messages) {
        const bool reply = m.role == "assistant";
        marker("<|" + m.role + "|>\n");
        put(out, m.content, false, reply);
        put(out, t.family == ChatFamily::Phi3 ? "<|end|>" : t.end, true, reply);
        marker("\n");
      }
      if (generation_prompt) marker("<|assistant|>\n");
      break;
    case ChatFamily::Gemma: {
      // No system turn: its text opens the next user turn. The assistant is "model".
      std::string system;
      for (const ChatMessage& m : messages) {
        if (m.role == "system") {
          system += trimmed(m.content);
          continue;
        }
        const bool reply = m.role == "assistant";
        marker("<start_of_turn>" + (reply ? std::string("model") : m.role) + "\n");
        if (!system.empty() && !reply) {
          put(out, system + "\n\n", false, false);
          system.clear();
        }
        put(out, trimmed(m.content), false, reply);
        put(out, "<end_of_turn>", true, reply);
        marker("\n");
      }
      if (generation_prompt) marker("<start_of_turn>model\n");
      break;
    }
    case ChatFamily::Gemma4:
      // Every message a turn of its role's, its content trimmed; the assistant is "model". The
      // next reply opens with an empty thought channel, as the template writes it with thinking
      // off.
      for (const ChatMessage& m : messages) {
        const bool reply = m.role == "assistant";
        marker("<|turn>" + (reply ? std::string("model") : m.role) + "\n");
        put(out, trimmed(m.content), false, reply);
        put(out, "<turn|>", true, reply);
        marker("\n");
      }
      if (generation_prompt) marker("<|turn>model\n<|channel>thought\n<channel|>");
      break;
  }
  return out;
}

std::string render_chat_text(const ChatTemplate& tmpl, std::span<const ChatMessage> messages,
                             bool generation_prompt) {
  std::string text;
  for (const ChatPiece& p : render_chat(tmpl, messages, generation_prompt)) text += p.text;
  return text;
}

}  // namespace cputrain
