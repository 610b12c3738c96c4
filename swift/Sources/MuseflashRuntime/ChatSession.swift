import ChatTemplate
import ExportMetadata
import Foundation

/// Conversations as `--messages` files spell them (ChatMessage is the template module's).
extension ChatMessage {
    public static let roles = ["system", "user", "assistant"]

    /// A `--messages` file's conversation: a non-empty JSON list of {"role", "content"}
    /// objects with a user message among them; a bad one is one line naming the problem.
    public static func conversation(fromJSON data: Data, source: String) throws -> [ChatMessage] {
        let raw: Any
        do {
            raw = try JSONSerialization.jsonObject(with: data)
        } catch {
            throw RuntimeError.badOption(reason: "\(source) is not JSON; give a list of {\"role\", \"content\"} objects")
        }
        guard let list = raw as? [Any] else {
            throw RuntimeError.badOption(reason: "\(source): expected a JSON list of {\"role\", \"content\"} objects")
        }
        guard !list.isEmpty else {
            throw RuntimeError.badOption(reason: "\(source): the list of messages is empty; give at least one user message")
        }
        var messages: [ChatMessage] = []
        for (index, item) in list.enumerated() {
            guard let object = item as? [String: Any] else {
                throw RuntimeError.badOption(reason: "\(source): message \(index) is not an object with \"role\" and \"content\"")
            }
            guard let role = object["role"] as? String, roles.contains(role) else {
                throw RuntimeError.badOption(reason: "\(source): message \(index) has role \(object["role"].map { "\($0)" } ?? "none"); roles are \(roles.joined(separator: ", "))")
            }
            guard let content = object["content"] as? String else {
                throw RuntimeError.badOption(reason: "\(source): message \(index) (\(role)) has no string \"content\"")
            }
            messages.append(ChatMessage(role: role, content: content))
        }
        guard messages.contains(where: { $0.role == "user" }) else {
            throw RuntimeError.badOption(reason: "\(source): no user message; a reply answers a user message")
        }
        return messages
    }

    /// The user messages a scripted conversation replies to: each one no assistant message
    /// directly follows ([user, assistant, user]: the last; [user, user]: both).
    public static func replyPoints(_ messages: [ChatMessage]) -> [Int] {
        messages.indices.filter { index in
            messages[index].role == "user" && (index + 1 == messages.count || messages[index + 1].role != "assistant")
        }
    }
}

/// What a conversation does when its history outgrows the context.
public enum ContextPolicy: String, Sendable, CaseIterable {
    /// Stop with one line naming the limit.
    case refuse
    /// Drop the oldest turns after the system prompt until it fits; the session then prefills
    /// again from where the history changed.
    case dropOldest = "drop-oldest"
}

/// One reply of a conversation.
public struct ChatTurn: Sendable {
    /// The whole rendered history this reply continues.
    public var promptIDs: [Int32]
    /// The reply, its end-of-turn token included when it ended on one.
    public var tokens: [Int32]
    /// The reply as it joins the history.
    public var text: String
    /// Ids of `promptIDs` this turn computed (the rest were held in the caches).
    public var prefilledTokens: Int
    public var timeToFirstTokenSeconds: Double
    public var seconds: Double
    public var result: GenerationResult
    /// The oldest messages `dropOldest` dropped before this turn.
    public var droppedMessages: Int
}

/// A conversation over one SpeculativeDecoder whose caches (the target's KV caches and the
/// drafter's ring) live from turn to turn, as the Python loop's runtime/chat.py Chat does:
/// each turn renders the whole history with the chat template (`render`, add_generation_prompt
/// on), tokenizes it without adding special tokens (`encode`), and decodes with
/// `keepingCaches`, so only the ids after the longest prefix the caches hold are prefilled; a
/// history that parts from them earlier rewinds both caches together. A reply ends at one of
/// `stopTokenIDs` (metadata.json `tokenizer.end_of_turn_ids`) or after maxNewTokens; its text
/// (`decode`, without the end-of-turn token) joins the history as the assistant's message.
public final class ChatSession {
    public let decoder: SpeculativeDecoder
    public private(set) var messages: [ChatMessage] = []
    public var options: GenerationOptions
    public let onContextFull: ContextPolicy
    private let render: ([ChatMessage]) throws -> String
    private let encode: (String) throws -> [Int32]
    private let decode: ([Int32]) -> String

    public init(decoder: SpeculativeDecoder, options: GenerationOptions, stopTokenIDs: Set<Int32>,
                system: String? = nil, onContextFull: ContextPolicy = .refuse,
                render: @escaping ([ChatMessage]) throws -> String,
                encode: @escaping (String) throws -> [Int32],
                decode: @escaping ([Int32]) -> String) throws {
        guard !stopTokenIDs.isEmpty else {
            throw RuntimeError.badOption(reason: "the bundle names no end-of-turn token (metadata.json tokenizer.end_of_turn_ids, or an eos_token); a reply would never end: re-export with this museflash")
        }
        self.decoder = decoder
        self.options = options
        self.options.stopTokenIDs.formUnion(stopTokenIDs)
        self.onContextFull = onContextFull
        self.render = render
        self.encode = encode
        self.decode = decode
        if let system { messages.append(ChatMessage(role: "system", content: system)) }
    }

    /// The rendered history's ids, dropping the oldest turns first under `dropOldest`.
    private func prompt() throws -> (ids: [Int32], dropped: Int) {
        var dropped = 0
        while true {
            let ids = try encode(try render(messages))
            let needed = ids.count + options.maxNewTokens + decoder.blockSize - 1
            if needed <= decoder.contextLength { return (ids, dropped) }
            let first = messages.firstIndex { $0.role != "system" }
            guard onContextFull == .dropOldest, let first, first < messages.count - 1 else {
                let advice = onContextFull == .dropOldest
                    ? "start a new conversation or ask for fewer --max-new-tokens"
                    : "start a new conversation, ask for fewer --max-new-tokens, or pass --on-context-full drop-oldest"
                throw RuntimeError.badOption(reason: "the conversation (\(ids.count) tokens) and --max-new-tokens \(options.maxNewTokens) need \(needed) positions but the export's context_length is \(decoder.contextLength); \(advice)")
            }
            // Whole turns go: a user message with the assistant reply after it.
            let count = messages[first].role == "user" && first + 1 < messages.count - 1
                && messages[first + 1].role == "assistant" ? 2 : 1
            messages.removeSubrange(first..<(first + count))
            dropped += count
        }
    }

    /// The reply to the history as it stands (its last message a user's); it joins the history.
    public func reply(onText: ((String) -> Void)? = nil) throws -> ChatTurn {
        guard let last = messages.last, last.role == "user" else {
            throw RuntimeError.badOption(reason: "a reply answers a user message; the history ends with \(messages.last?.role ?? "nothing")")
        }
        let clock = ContinuousClock()
        let start = clock.now
        let (ids, dropped) = try prompt()
        var firstToken: Double?
        var stream = ReplyStream(decode: decode, stops: options.stopTokenIDs)
        let result = try decoder.generate(prompt: ids, options: options, keepingCaches: true) { tokens in
            if firstToken == nil { firstToken = (clock.now - start).seconds }
            if let onText { onText(stream.push(tokens)) }
        }
        let seconds = (clock.now - start).seconds
        let text = decode(result.tokens.filter { !options.stopTokenIDs.contains($0) })
        messages.append(ChatMessage(role: "assistant", content: text))
        return ChatTurn(promptIDs: ids, tokens: result.tokens, text: text,
                        prefilledTokens: ids.count - result.reusedTokens,
                        timeToFirstTokenSeconds: firstToken ?? seconds, seconds: seconds,
                        result: result, droppedMessages: dropped)
    }

    /// A user message and the reply to it.
    public func say(_ content: String, onText: ((String) -> Void)? = nil) throws -> ChatTurn {
        messages.append(ChatMessage(role: "user", content: content))
        return try reply(onText: onText)
    }

    /// A scripted conversation (`--messages`): its messages join the history in order, and each
    /// user message no assistant message follows gets a reply (`ChatMessage.replyPoints`).
    public func run(script: [ChatMessage], onText: ((String) -> Void)? = nil,
                    onTurn: ((ChatTurn) -> Void)? = nil) throws -> [ChatTurn] {
        if !messages.isEmpty, script.first?.role == "system" {
            throw RuntimeError.badOption(reason: "--system and a system message in --messages both set the system prompt; give one")
        }
        let wanted = Set(ChatMessage.replyPoints(script))
        var turns: [ChatTurn] = []
        for (index, message) in script.enumerated() {
            messages.append(message)
            if wanted.contains(index) {
                let turn = try reply(onText: onText)
                turns.append(turn)
                onTurn?(turn)
            }
        }
        return turns
    }
}

/// The reply's text as tokens arrive: the decoded text grows, and what it adds is handed on,
/// minus a trailing incomplete character; nothing from an end-of-turn token on.
struct ReplyStream {
    let decode: ([Int32]) -> String
    let stops: Set<Int32>
    var tokens: [Int32] = []
    var shown = ""
    var ended = false

    mutating func push(_ ids: [Int32]) -> String {
        guard !ended else { return "" }
        for id in ids {
            if stops.contains(id) { ended = true; break }
            tokens.append(id)
        }
        var text = decode(tokens)
        if !ended { while text.hasSuffix("\u{FFFD}") { text.removeLast() } }
        guard text.hasPrefix(shown) else { return "" }
        let added = String(text.dropFirst(shown.count))
        shown = text
        return added
    }
}

extension MuseflashBundle {
    /// The bundle's chat template (`chat_template.jinja`, else tokenizer_config.json
    /// `chat_template`, as Python's read_chat_template finds it) and the special tokens it may
    /// name (bos_token, eos_token, unk_token, pad_token); a template outside the renderer's
    /// subset is refused naming the construct.
    public func chatTemplate() throws -> (template: ChatTemplate, variables: [String: String]) {
        let config = Self.tokenizerConfig(in: url)
        let file = url.appendingPathComponent(BundleContract.chatTemplateFileName)
        let source: String
        if let data = FileManager.default.contents(atPath: file.path) {
            guard let text = String(data: data, encoding: .utf8) else {
                throw RuntimeError.badOption(reason: "\(file.path) is not UTF-8 text; re-export")
            }
            source = text
        } else if let text = config["chat_template"] {
            source = text
        } else {
            throw RuntimeError.badOption(reason: "\(url.path) has no chat template (tokenizer_config.json chat_template or chat_template.jinja); export an instruct checkpoint that has one, or pass --prompt")
        }
        let template: ChatTemplate
        do {
            template = try ChatTemplate(source)
        } catch {
            throw RuntimeError.badOption(reason: "\(url.path)'s \(error)")
        }
        let variables = config.filter { ["bos_token", "eos_token", "unk_token", "pad_token"].contains($0.key) }
        return (template, variables)
    }

    /// The ids that end a reply: metadata.json `tokenizer.end_of_turn_ids`, else (bundles
    /// written before it) the eos token.
    public var endOfTurnIDs: Set<Int32> {
        if let ids = metadata.tokenizer?.endOfTurnIds, !ids.isEmpty { return Set(ids.map { Int32($0) }) }
        return eosTokenID.map { [$0] } ?? []
    }
}

extension ChatSession {
    /// A conversation over `decoder`'s bundle with its own chat template and tokenizer.
    public convenience init(decoder: SpeculativeDecoder, text: BundleText, options: GenerationOptions,
                            system: String? = nil, onContextFull: ContextPolicy = .refuse) throws {
        let bundle = decoder.bundle
        let (template, variables) = try bundle.chatTemplate()
        let tokenizer = text.tokenizer
        try self.init(decoder: decoder, options: options, stopTokenIDs: bundle.endOfTurnIDs, system: system,
                      onContextFull: onContextFull,
                      render: { messages in
                          do {
                              return try template.render(messages: messages, addGenerationPrompt: true, variables: variables)
                          } catch {
                              throw RuntimeError.badOption(reason: "the chat template cannot render the conversation: \(error)")
                          }
                      },
                      encode: { tokenizer.encode($0) },
                      decode: { tokenizer.decode($0, skipSpecialTokens: true) })
    }
}
