// llama.cpp's chat layer (common/chat, vendored in native/third_party) as the engine uses it: the
// template's tool-call format, its grammar and triggers, and the parser of what a model wrote in
// that format. Everything crosses as JSON text, in llama-server's field names, so the Python side
// reads one shape whatever the format.
#pragma once

#include <memory>
#include <string>

struct common_chat_templates;
struct common_chat_parser_params;

namespace sk {

class ChatLayer {
public:
    // `source`: the template text (never empty: the caller resolves built-in names and fallbacks),
    // with the BOS and EOS texts the template may print. Throws InvalidRequestError when llama.cpp's
    // jinja engine cannot read the template.
    ChatLayer(const std::string & source, const std::string & bos, const std::string & eos);
    ~ChatLayer();
    ChatLayer(const ChatLayer &) = delete;
    ChatLayer & operator=(const ChatLayer &) = delete;

    // `request`: {"messages", "tools", "tool_choice": auto|required|none, "parallel_tool_calls",
    // "add_generation_prompt", "enable_thinking", "reasoning_format", "chat_template_kwargs"}.
    // Returns {"format", "prompt", "grammar", "grammar_lazy", "grammar_triggers": [{"type", "value",
    // "token"}], "preserved_tokens", "additional_stops", "generation_prompt", "parser",
    // "supports_thinking", "thinking_start_tag", "thinking_end_tags"}. Throws InvalidRequestError
    // for what the template or its format cannot take.
    std::string apply(const std::string & request) const;

private:
    std::unique_ptr<common_chat_templates, void (*)(common_chat_templates *)> templates_;
};

// A model's output read in the format a ChatLayer::apply reported, as llama-server reads it.
class ChatParser {
public:
    // `format`, `parser`, `generation_prompt`: from apply's result; `reasoning_format`: none | auto |
    // deepseek | deepseek-legacy. Throws InvalidRequestError on a parser text it cannot load.
    ChatParser(const std::string & format, const std::string & parser, const std::string & generation_prompt,
               const std::string & reasoning_format, bool parse_tool_calls);
    ~ChatParser();
    ChatParser(const ChatParser &) = delete;
    ChatParser & operator=(const ChatParser &) = delete;

    // The message in `text` as {"content", "reasoning_content", "tool_calls": [{"name", "arguments",
    // "id"}]}; `partial` while the output is still growing. Throws InvalidRequestError when the
    // text is not in the format (llama.cpp fails the request then; the caller decides).
    std::string parse(const std::string & text, bool partial) const;

private:
    std::unique_ptr<common_chat_parser_params> params_;
};

}  // namespace sk
