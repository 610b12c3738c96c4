/// Splits a template into data and tag tokens as jinja2's lexer does with trim_blocks and
/// lstrip_blocks on: newlines normalised to \n, one trailing newline dropped, `{%-`/`-%}` (and the
/// `{{`/`{#` forms) strip whitespace, `{%+`/`+%}` keep it, comments dropped, `{% raw %}` kept verbatim.

enum TokenKind: Equatable {
    case data(String)
    case variableBegin, variableEnd, blockBegin, blockEnd
    case name(String)
    case string(String)
    case integer(Int)
    case float(Double)
    case op(String)
}

struct Token {
    var kind: TokenKind
    var line: Int
}

struct Lexer {
    private var source: [Unicode.Scalar]
    private var position = 0
    private var line = 1
    /// Whether the last match ended with a newline (jinja2's `line_starting`).
    private var lineStarting = true
    private var tokens: [Token] = []

    static func tokenize(_ text: String) throws -> [Token] {
        var lexer = Lexer(source: normalise(text))
        try lexer.run()
        return lexer.tokens
    }

    private init(source: [Unicode.Scalar]) { self.source = source }

    private static func normalise(_ text: String) -> [Unicode.Scalar] {
        var out: [Unicode.Scalar] = []
        let scalars = Array(text.unicodeScalars)
        var index = 0
        while index < scalars.count {
            let scalar = scalars[index]
            if scalar == "\r" {
                out.append("\n")
                if index + 1 < scalars.count, scalars[index + 1] == "\n" { index += 1 }
            } else {
                out.append(scalar)
            }
            index += 1
        }
        if out.last == "\n" { out.removeLast() }
        return out
    }

    private func at(_ offset: Int) -> Unicode.Scalar? {
        let index = position + offset
        return index < source.count ? source[index] : nil
    }

    private func matches(_ text: String, at index: Int) -> Bool {
        var cursor = index
        for scalar in text.unicodeScalars {
            guard cursor < source.count, source[cursor] == scalar else { return false }
            cursor += 1
        }
        return true
    }

    private func skipSpace(from index: Int) -> Int {
        var cursor = index
        while cursor < source.count, isPythonSpace(source[cursor]) { cursor += 1 }
        return cursor
    }

    private func newlines(_ slice: ArraySlice<Unicode.Scalar>) -> Int { slice.reduce(0) { $0 + ($1 == "\n" ? 1 : 0) } }

    private enum Opener { case variable, block, comment, raw(end: Int) }

    /// At `index`: `{% raw %}` (with its whitespace control), the end of its match.
    private func rawBegin(at index: Int) -> Int? {
        guard matches("{%", at: index) else { return nil }
        var cursor = index + 2
        if cursor < source.count, source[cursor] == "-" || source[cursor] == "+" { cursor += 1 }
        cursor = skipSpace(from: cursor)
        guard matches("raw", at: cursor) else { return nil }
        cursor = skipSpace(from: cursor + 3)
        if matches("-%}", at: cursor) { return skipSpace(from: cursor + 3) }
        if matches("%}", at: cursor) { return cursor + 2 }
        return nil
    }

    /// Data before a tag as jinja2's OptionalLStrip leaves it.
    private func stripped(_ text: ArraySlice<Unicode.Scalar>, sign: Unicode.Scalar?, isVariable: Bool) -> ArraySlice<Unicode.Scalar> {
        if sign == "-" {
            var end = text.endIndex
            while end > text.startIndex, isPythonSpace(text[end - 1]) { end -= 1 }
            return text[text.startIndex..<end]
        }
        if sign != "+" && !isVariable {
            let lineStart = (text.lastIndex(of: "\n").map { $0 + 1 }) ?? text.startIndex
            if lineStart > text.startIndex || lineStarting {
                let rest = text[lineStart...]
                if !rest.isEmpty && rest.allSatisfy(isPythonSpace) { return text[text.startIndex..<lineStart] }
            }
        }
        return text
    }

    private mutating func emit(_ kind: TokenKind, line: Int) { tokens.append(Token(kind: kind, line: line)) }

    private mutating func emitData(_ text: ArraySlice<Unicode.Scalar>, line: Int) {
        if !text.isEmpty { emit(.data(String(String.UnicodeScalarView(text))), line: line) }
    }

    private mutating func run() throws {
        while position < source.count {
            // The next tag opener: the earliest {{, {% or {#.
            var index = position
            var opener: Opener?
            while index + 1 < source.count {
                if source[index] == "{" {
                    let next = source[index + 1]
                    if next == "%" {
                        if let end = rawBegin(at: index) { opener = .raw(end: end) } else { opener = .block }
                        break
                    }
                    if next == "{" { opener = .variable; break }
                    if next == "#" { opener = .comment; break }
                }
                index += 1
            }
            guard let opener else {
                emitData(source[position...], line: line)
                return
            }
            let signIndex = index + 2
            let sign: Unicode.Scalar? = signIndex < source.count && (source[signIndex] == "-" || source[signIndex] == "+")
                ? source[signIndex] : nil
            var isVariable = false
            if case .variable = opener { isVariable = true }
            let text = source[position..<index]
            emitData(stripped(text, sign: sign, isVariable: isVariable), line: line)
            line += newlines(text)
            position = signIndex + (sign == nil ? 0 : 1)
            lineStarting = false
            switch opener {
            case .comment: try comment()
            case .variable:
                emit(.variableBegin, line: line)
                try inside(block: false)
            case .block:
                emit(.blockBegin, line: line)
                try inside(block: true)
            case .raw(let end):
                line += newlines(source[position..<end])
                lineStarting = end > 0 && source[end - 1] == "\n"
                position = end
                try raw()
            }
        }
    }

    private mutating func comment() throws {
        let startLine = line
        var index = position
        while index + 1 < source.count, !(source[index] == "#" && source[index + 1] == "}") { index += 1 }
        guard index + 1 < source.count else { throw ChatTemplateError.syntax("missing end of comment tag #}", line: startLine) }
        var end = index + 2
        if index > position && source[index - 1] == "-" {
            end = skipSpace(from: end)
        } else if index > position && source[index - 1] == "+" {
        } else if end < source.count && source[end] == "\n" {
            end += 1
        }
        line += newlines(source[position..<end])
        lineStarting = source[end - 1] == "\n"
        position = end
    }

    private mutating func raw() throws {
        let startLine = line
        var index = position
        while index + 1 < source.count {
            if source[index] == "{" && source[index + 1] == "%" {
                var cursor = index + 2
                var sign: Unicode.Scalar?
                if cursor < source.count, source[cursor] == "-" || source[cursor] == "+" { sign = source[cursor]; cursor += 1 }
                cursor = skipSpace(from: cursor)
                if matches("endraw", at: cursor) {
                    cursor = skipSpace(from: cursor + 6)
                    var end: Int?
                    if matches("+%}", at: cursor) {
                        end = cursor + 3
                    } else if matches("-%}", at: cursor) {
                        end = skipSpace(from: cursor + 3)
                    } else if matches("%}", at: cursor) {
                        end = cursor + 2
                        if end! < source.count && source[end!] == "\n" { end! += 1 }
                    }
                    if let end {
                        let text = source[position..<index]
                        emitData(stripped(text, sign: sign, isVariable: false), line: line)
                        line += newlines(source[position..<end])
                        lineStarting = source[end - 1] == "\n"
                        position = end
                        return
                    }
                }
            }
            index += 1
        }
        throw ChatTemplateError.syntax("missing end of raw directive {% endraw %}", line: startLine)
    }

    /// The tokens of a `{{ }}` or `{% %}` tag, through its end.
    private mutating func inside(block: Bool) throws {
        var balance: [Unicode.Scalar] = []
        let startLine = line
        while true {
            if balance.isEmpty {
                if block {
                    if matches("+%}", at: position) {
                        position += 3
                        emit(.blockEnd, line: line)
                        return
                    }
                    if matches("-%}", at: position) || matches("%}", at: position) {
                        let dash = source[position] == "-"
                        var end = position + (dash ? 3 : 2)
                        if dash { end = skipSpace(from: end) } else if end < source.count && source[end] == "\n" { end += 1 }
                        emit(.blockEnd, line: line)
                        line += newlines(source[position..<end])
                        lineStarting = source[end - 1] == "\n"
                        position = end
                        return
                    }
                } else if matches("-}}", at: position) || matches("}}", at: position) {
                    let dash = source[position] == "-"
                    let end = dash ? skipSpace(from: position + 3) : position + 2
                    emit(.variableEnd, line: line)
                    line += newlines(source[position..<end])
                    lineStarting = source[end - 1] == "\n"
                    position = end
                    return
                }
            }
            guard let scalar = at(0) else {
                throw ChatTemplateError.syntax("unexpected end of template inside a tag opened here; close it with "
                                               + (block ? "%}" : "}}"), line: startLine)
            }
            if isPythonSpace(scalar) {
                let end = skipSpace(from: position)
                line += newlines(source[position..<end])
                position = end
                continue
            }
            if let number = try number() {
                emit(number, line: line)
                continue
            }
            if scalar == "_" || scalar.properties.isAlphabetic && scalar.isASCII {
                var end = position
                while end < source.count, source[end] == "_" || source[end].isASCII && (source[end].properties.isAlphabetic || ("0"..."9").contains(source[end])) {
                    end += 1
                }
                emit(.name(String(String.UnicodeScalarView(source[position..<end]))), line: line)
                position = end
                continue
            }
            if scalar == "'" || scalar == "\"" {
                try string(quote: scalar)
                continue
            }
            let two = position + 1 < source.count ? String(String.UnicodeScalarView(source[position...(position + 1)])) : ""
            if ["//", "**", "==", "!=", ">=", "<="].contains(two) {
                emit(.op(two), line: line)
                position += 2
                continue
            }
            let single = String(scalar)
            guard "-+/*%~[](){}><=.:|,;".unicodeScalars.contains(scalar) else {
                throw ChatTemplateError.syntax("unexpected character '\(single)' inside a tag", line: line)
            }
            switch scalar {
            case "{": balance.append("}")
            case "(": balance.append(")")
            case "[": balance.append("]")
            case "}", ")", "]":
                guard let expected = balance.popLast() else {
                    throw ChatTemplateError.syntax("unexpected '\(single)'", line: line)
                }
                guard expected == scalar else {
                    throw ChatTemplateError.syntax("unexpected '\(single)', expected '\(String(expected))'", line: line)
                }
            default: break
            }
            emit(.op(single), line: line)
            position += 1
        }
    }

    private func isDigit(_ index: Int) -> Bool { index < source.count && ("0"..."9").contains(source[index]) }

    /// `(\d+_)*\d+` from `index`: its end, or nil.
    private func digitRun(_ index: Int) -> Int? {
        guard isDigit(index) else { return nil }
        var cursor = index
        while true {
            while isDigit(cursor) { cursor += 1 }
            if cursor < source.count, source[cursor] == "_", isDigit(cursor + 1) { cursor += 1; continue }
            return cursor
        }
    }

    /// A float or integer literal at the position, as jinja2's float_re and integer_re read them.
    private mutating func number() throws -> TokenKind? {
        guard isDigit(position) else { return nil }
        let source = self.source
        let start = position
        func text(_ end: Int) -> String { String(String.UnicodeScalarView(source[start..<end])).replacingUnderscores() }
        // float_re: digits, then an exponent (after an optional fraction) or a fraction.
        if position == 0 || source[position - 1] != ".", let whole = digitRun(position) {
            var end: Int?
            var cursor = whole
            if cursor < source.count, source[cursor] == ".", let fraction = digitRun(cursor + 1) { cursor = fraction; end = fraction }
            if cursor < source.count, source[cursor] == "e" || source[cursor] == "E" {
                var exponent = cursor + 1
                if exponent < source.count, source[exponent] == "+" || source[exponent] == "-" { exponent += 1 }
                if let exponentEnd = digitRun(exponent) { end = exponentEnd }
            }
            if let end {
                guard let value = Double(text(end)) else { throw ChatTemplateError.syntax("bad float literal", line: line) }
                position = end
                return .float(value)
            }
        }
        // integer_re: 0b/0o/0x, [1-9](_?\d)*, 0(_?0)*.
        let lower = at(1).map { Character($0).lowercased() }
        if at(0) == "0", let prefix = lower, ["b", "o", "x"].contains(prefix) {
            let radix = prefix == "b" ? 2 : prefix == "o" ? 8 : 16
            var cursor = position + 2
            while cursor < source.count {
                if source[cursor] == "_", cursor + 1 < source.count, Int(String(source[cursor + 1]), radix: radix) != nil { cursor += 2; continue }
                if Int(String(source[cursor]), radix: radix) != nil { cursor += 1; continue }
                break
            }
            if cursor > position + 2 {
                let digits = String(String.UnicodeScalarView(source[(position + 2)..<cursor])).replacingUnderscores()
                guard let value = Int(digits, radix: radix) else { throw ChatTemplateError.syntax("integer literal too large", line: line) }
                position = cursor
                return .integer(value)
            }
        }
        var cursor = position + 1
        let zero = source[position] == "0"
        while cursor < source.count {
            let digit = zero ? source[cursor] == "0" : isDigit(cursor)
            if digit { cursor += 1; continue }
            if source[cursor] == "_", cursor + 1 < source.count, zero ? source[cursor + 1] == "0" : isDigit(cursor + 1) { cursor += 2; continue }
            break
        }
        guard let value = Int(text(cursor)) else { throw ChatTemplateError.syntax("integer literal too large", line: line) }
        position = cursor
        return .integer(value)
    }

    /// A quoted string literal, decoded as Python's unicode-escape codec decodes it.
    private mutating func string(quote: Unicode.Scalar) throws {
        let startLine = line
        var cursor = position + 1
        var out = String.UnicodeScalarView()
        func hex(_ count: Int) throws -> Unicode.Scalar {
            guard cursor + count <= source.count,
                  let code = UInt32(String(String.UnicodeScalarView(source[cursor..<(cursor + count)])), radix: 16),
                  let scalar = Unicode.Scalar(code) else {
                throw ChatTemplateError.syntax("bad \\x, \\u or \\U escape in a string literal", line: startLine)
            }
            cursor += count
            return scalar
        }
        while true {
            guard cursor < source.count else {
                throw ChatTemplateError.syntax("unterminated string literal", line: startLine)
            }
            let scalar = source[cursor]
            cursor += 1
            if scalar == quote { break }
            if scalar == "\n" { line += 1 }
            guard scalar == "\\" else { out.append(scalar); continue }
            guard cursor < source.count else { throw ChatTemplateError.syntax("unterminated string literal", line: startLine) }
            let escape = source[cursor]
            cursor += 1
            switch escape {
            case "\n": line += 1
            case "\\", "'", "\"": out.append(escape)
            case "a": out.append("\u{07}")
            case "b": out.append("\u{08}")
            case "f": out.append("\u{0C}")
            case "n": out.append("\n")
            case "r": out.append("\r")
            case "t": out.append("\t")
            case "v": out.append("\u{0B}")
            case "x": out.append(try hex(2))
            case "u": out.append(try hex(4))
            case "U": out.append(try hex(8))
            case "0"..."7":
                var code = escape.value - 48
                var taken = 1
                while taken < 3, cursor < source.count, ("0"..."7").contains(source[cursor]) {
                    code = code * 8 + source[cursor].value - 48
                    cursor += 1
                    taken += 1
                }
                out.append(Unicode.Scalar(code)!)
            case "N":
                throw ChatTemplateError.unsupported("the \\N{...} escape", line: startLine)
            default:
                out.append("\\")
                out.append(escape)
            }
        }
        emit(.string(String(out)), line: startLine)
        position = cursor
    }
}

private extension String {
    func replacingUnderscores() -> String { String(unicodeScalars.filter { $0 != "_" }.map(Character.init)) }
}
