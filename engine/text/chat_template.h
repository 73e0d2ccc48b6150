// Chat templates: the common families a model's chat template (tokenizer.chat_template, Jinja)
// belongs to, recognised by the markers in its text, each rendered as llama.cpp renders it, with
// the assistant's replies marked so that a fine-tune's loss can fall on them alone.
//   chatml   <|im_start|>role\n...<|im_end|>\n              Qwen, SmolLM
//   llama3   <|start_header_id|>role<|end_header_id|>\n\n...<|eot_id|>
//   llama2   [INST] <<SYS>>\n...\n<</SYS>>\n\n... [/INST]...</s>  Llama 2, Mistral v0.1/v0.2
//   mistral  [INST] ...[/INST] ...</s>                        Mistral's v3 tokenizer
//   zephyr   <|user|>\n...EOS\n<|assistant|>\n...EOS\n        Zephyr, TinyLlama chat
//   phi3     <|user|>\n...<|end|>\n<|assistant|>\n...<|end|>\n  Phi-3, Phi-4
//   gemma    <start_of_turn>user\n...<end_of_turn>\n<start_of_turn>model\n...  Gemma (the system
//            message opens the first user turn)
//   gemma4   <|turn>role\n...<turn|>\n (the assistant "model")  Gemma 4: a system turn of its
//            own; the next reply begins after an empty thought channel (thinking off)
#pragma once

#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace cputrain {

enum class ChatFamily { ChatMl, Llama3, Llama2, Mistral, Zephyr, Phi3, Gemma, Gemma4 };

struct ChatTemplate {
  ChatFamily family = ChatFamily::ChatMl;
  // llama2: a system message in <<SYS>> (else it leads the first user message), BOS before each
  // [INST] after the first, and messages stripped of surrounding whitespace.
  bool system_block = true;
  bool bos_in_history = false;
  bool strip = false;
  // zephyr: what ends each message (the model's EOS).
  std::string end = "<|endoftext|>";
};

// "chatml", "llama3", "llama2", "mistral", "zephyr", "phi3", "gemma", "gemma4".
std::string_view chat_family_name(ChatFamily family);
std::string chat_family_names();

// The family of a Jinja chat template, from its markers; nullopt where it is none of them.
// `eos` is the model's EOS text (zephyr's message end).
std::optional<ChatTemplate> detect_chat_template(std::string_view jinja, const std::string& eos);
// --chat-template NAME: a UserError naming `flag` and listing the names for another.
ChatTemplate chat_template_named(const std::string& name, const std::string& flag,
                                 const std::string& eos);

struct ChatMessage {
  std::string role;  // "system", "user" or "assistant"
  std::string content;
};

// A piece of a rendered conversation: the template's own markers (special tokens to parse) or a
// message's content (text only, so a message cannot forge a marker); `reply` for what the
// assistant says, its content and the marker that ends it.
struct ChatPiece {
  std::string text;
  bool markers = false;
  bool reply = false;
};

// The conversation's pieces, and with `generation_prompt` what begins the assistant's next reply.
// The roles are system, user and assistant (the caller checks them).
std::vector<ChatPiece> render_chat(const ChatTemplate& tmpl, std::span<const ChatMessage> messages,
                                   bool generation_prompt);
// Their texts, joined.
std::string render_chat_text(const ChatTemplate& tmpl, std::span<const ChatMessage> messages,
                             bool generation_prompt);

}  // namespace cputrain
