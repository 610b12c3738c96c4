/// A checkpoint's chat template (tokenizer_config.json `chat_template`), rendered as transformers'
/// `apply_chat_template` renders it: jinja2 with trim_blocks and lstrip_blocks, `tojson`,
/// `raise_exception`, `messages`, `add_generation_prompt` and the special tokens by role.
///
/// The supported subset (docs: python/museflash/checkpoint/chat_template.py lists the same names):
/// `for` (with `loop.*`, an `if` filter and `else`), `if`/`elif`/`else`, `set` (also `ns.x`),
/// `{% raw %}`, comments, whitespace control; literals, lists, dicts, tuples, attribute, item and
/// slice access, arithmetic, `~`, comparisons, `in`, `and`/`or`/`not`, inline if, the `Supported`
/// filters, tests, functions and methods. Anything else is refused by `init`, naming it.
///
///     let template = try ChatTemplate(source)
///     let text = try template.render(messages: [ChatMessage(role: "user", content: "Hi")],
///                                    addGenerationPrompt: true, variables: ["bos_token": "<s>"])
public struct ChatTemplate {
    public let source: String
    private let body: [Statement]

    /// Parses `source`; throws a ChatTemplateError for invalid Jinja or a construct outside the subset.
    public init(_ source: String) throws {
        self.source = source
        body = try Parser.parse(try Lexer.tokenize(source))
    }

    /// Renders with `context` as the template's variables.
    public func render(context: [String: ChatValue]) throws -> String {
        let evaluator = Evaluator(context: context.mapValues(Value.init))
        try evaluator.run(body)
        return evaluator.output
    }

    /// Renders `messages` (objects, usually {"role", "content"}); `variables` are the special
    /// tokens by role (`bos_token`, `eos_token`, ...).
    public func render(messages: [ChatValue], addGenerationPrompt: Bool,
                       variables: [String: String] = [:]) throws -> String {
        var context = variables.mapValues(ChatValue.string)
        context["messages"] = .array(messages)
        context["add_generation_prompt"] = .bool(addGenerationPrompt)
        return try render(context: context)
    }

    public func render(messages: [ChatMessage], addGenerationPrompt: Bool,
                       variables: [String: String] = [:]) throws -> String {
        try render(messages: messages.map(\.value), addGenerationPrompt: addGenerationPrompt, variables: variables)
    }
}
