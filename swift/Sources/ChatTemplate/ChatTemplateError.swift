/// A template the renderer refuses or fails on: one line naming the problem and the template line.
public struct ChatTemplateError: Error, CustomStringConvertible, Equatable {
    public enum Kind: Equatable, Sendable {
        /// Not valid Jinja (what jinja2 would refuse too).
        case syntax
        /// Valid Jinja outside the subset this renderer implements; `construct` names it,
        /// e.g. "{% macro %}", "filter map", "function strftime_now()".
        case unsupported(construct: String)
        /// Rendering failed (an undefined value used, a type error, ...).
        case runtime
        /// The template called `raise_exception(message)`.
        case raised(message: String)
    }

    public let kind: Kind
    /// The template line (1-based) of the problem.
    public let line: Int
    /// The problem, without the line.
    public let message: String

    public var description: String {
        let text = "chat template line \(line): \(message)"
        return text.split(whereSeparator: \.isNewline).joined(separator: " ")
    }

    static func syntax(_ message: String, line: Int) -> ChatTemplateError {
        ChatTemplateError(kind: .syntax, line: line, message: message)
    }

    static func unsupported(_ construct: String, line: Int) -> ChatTemplateError {
        ChatTemplateError(kind: .unsupported(construct: construct), line: line,
                          message: "\(construct) is not supported by museflash's renderer; fix: remove it from "
                              + "the template or render prompts yourself")
    }

    static func runtime(_ message: String, line: Int) -> ChatTemplateError {
        ChatTemplateError(kind: .runtime, line: line, message: message)
    }

    static func raised(_ message: String, line: Int) -> ChatTemplateError {
        ChatTemplateError(kind: .raised(message: message), line: line,
                          message: "the template refused the conversation: \(message)")
    }
}
