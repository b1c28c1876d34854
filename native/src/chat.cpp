#include "chat.h"

#include "errors.h"

#include <chat.h>

#include <exception>

namespace sk {

namespace {

using json = common_json;

common_chat_format format_from_name(const std::string & name) {
    for (int f = 0; f < COMMON_CHAT_FORMAT_COUNT; f++) {
        if (name == common_chat_format_name(common_chat_format(f))) return common_chat_format(f);
    }
    throw InvalidRequestError("unknown chat format '" + name + "'");
}

const char * trigger_type_name(common_grammar_trigger_type t) {
    switch (t) {
        case COMMON_GRAMMAR_TRIGGER_TYPE_TOKEN: return "token";
        case COMMON_GRAMMAR_TRIGGER_TYPE_WORD: return "word";
        case COMMON_GRAMMAR_TRIGGER_TYPE_PATTERN: return "pattern";
        case COMMON_GRAMMAR_TRIGGER_TYPE_PATTERN_FULL: return "pattern_full";
    }
    return "unknown";
}

json strings(const std::vector<std::string> & items) {
    json out = json::array();
    for (const auto & s : items) out.push_back(s);
    return out;
}

// llama.cpp reports what it cannot take as std::exception of several kinds (invalid_argument,
// runtime_error, its JSON and jinja errors): all of them describe the request or the template.
template <typename F> auto as_request_error(const char * what, F && f) -> decltype(f()) {
    try {
        return f();
    } catch (const NativeError &) {
        throw;
    } catch (const std::exception & e) {
        throw InvalidRequestError(std::string(what) + ": " + e.what());
    }
}

}  // namespace

ChatLayer::ChatLayer(const std::string & source, const std::string & bos, const std::string & eos)
    : templates_(nullptr, common_chat_templates_free) {
    as_request_error("llama.cpp's chat layer cannot read the template", [&] {
        templates_.reset(common_chat_templates_init(nullptr, source, bos, eos).release());
        return 0;
    });
}

ChatLayer::~ChatLayer() = default;

std::string ChatLayer::apply(const std::string & request) const {
    return as_request_error("llama.cpp's chat layer refused the conversation", [&] {
        const json body = json::parse(request);
        common_chat_templates_inputs in;
        in.messages = common_chat_msgs_parse_oaicompat(body.value("messages", json::array()));
        in.tools = common_chat_tools_parse_oaicompat(body.value("tools", json::array()));
        in.tool_choice = common_chat_tool_choice_parse_oaicompat(body.value("tool_choice", std::string("auto")));
        in.parallel_tool_calls = body.value("parallel_tool_calls", false);
        in.add_generation_prompt = body.value("add_generation_prompt", true);
        in.enable_thinking = body.value("enable_thinking", true);
        in.reasoning_format = common_reasoning_format_from_name(body.value("reasoning_format", std::string("auto")));
        const json kwargs = body.value("chat_template_kwargs", json::object());
        for (const auto & item : kwargs.items()) in.chat_template_kwargs[item.key()] = item.value().dump();

        const common_chat_params p = common_chat_templates_apply(templates_.get(), in);
        json triggers = json::array();
        for (const auto & t : p.grammar_triggers) {
            triggers.push_back(json::object({{"type", trigger_type_name(t.type)}, {"value", t.value}, {"token", t.token}}));
        }
        json out = json::object();
        out["format"] = common_chat_format_name(p.format);
        out["prompt"] = p.prompt;
        out["grammar"] = p.grammar;
        out["grammar_lazy"] = p.grammar_lazy;
        out["grammar_triggers"] = triggers;
        out["preserved_tokens"] = strings(p.preserved_tokens);
        out["additional_stops"] = strings(p.additional_stops);
        out["generation_prompt"] = p.generation_prompt;
        out["parser"] = p.parser;
        out["supports_thinking"] = p.supports_thinking;
        out["thinking_start_tag"] = p.thinking_start_tag;
        out["thinking_end_tags"] = strings(p.thinking_end_tags);
        return out.dump();
    });
}

ChatParser::ChatParser(const std::string & format, const std::string & parser, const std::string & generation_prompt,
                       const std::string & reasoning_format, bool parse_tool_calls)
    : params_(std::make_unique<common_chat_parser_params>()) {
    params_->format = format_from_name(format);
    params_->generation_prompt = generation_prompt;
    params_->parse_tool_calls = parse_tool_calls;
    as_request_error("llama.cpp's chat layer cannot load the parser", [&] {
        params_->reasoning_format = common_reasoning_format_from_name(reasoning_format);
        if (!parser.empty()) params_->parser.load(parser);
        return 0;
    });
}

ChatParser::~ChatParser() = default;

std::string ChatParser::parse(const std::string & text, bool partial) const {
    return as_request_error("the output is not in the template's format", [&] {
        const common_chat_msg msg = common_chat_parse(text, partial, *params_);
        json calls = json::array();
        for (const auto & c : msg.tool_calls) {
            calls.push_back(json::object({{"name", c.name}, {"arguments", c.arguments}, {"id", c.id}}));
        }
        json out = json::object();
        out["content"] = msg.content;
        out["reasoning_content"] = msg.reasoning_content;
        out["tool_calls"] = calls;
        return out.dump();
    });
}

}  // namespace sk
