/// A value a chat template reads (`messages`, `bos_token`, ...): what JSON holds, with an
/// object's keys in the order they were written, as in a Python dict.
public indirect enum ChatValue: Equatable, Sendable {
    case null
    case bool(Bool)
    case int(Int)
    case double(Double)
    case string(String)
    case array([ChatValue])
    case object(ChatObject)
}

/// A JSON object whose keys keep their insertion order (a Python dict).
public struct ChatObject: Equatable, Sendable {
    public private(set) var keys: [String] = []
    private var storage: [String: ChatValue] = [:]

    public init() {}

    public init(_ pairs: [(String, ChatValue)]) {
        for (key, value) in pairs { self[key] = value }
    }

    public subscript(key: String) -> ChatValue? {
        get { storage[key] }
        set {
            if let newValue {
                if storage.updateValue(newValue, forKey: key) == nil { keys.append(key) }
            } else if storage.removeValue(forKey: key) != nil {
                keys.removeAll { $0 == key }
            }
        }
    }

    public var pairs: [(key: String, value: ChatValue)] { keys.map { ($0, storage[$0]!) } }
}

extension ChatValue: ExpressibleByStringLiteral, ExpressibleByIntegerLiteral, ExpressibleByFloatLiteral,
    ExpressibleByBooleanLiteral, ExpressibleByArrayLiteral, ExpressibleByDictionaryLiteral, ExpressibleByNilLiteral {
    public init(stringLiteral value: String) { self = .string(value) }
    public init(integerLiteral value: Int) { self = .int(value) }
    public init(floatLiteral value: Double) { self = .double(value) }
    public init(booleanLiteral value: Bool) { self = .bool(value) }
    public init(arrayLiteral elements: ChatValue...) { self = .array(elements) }
    public init(dictionaryLiteral elements: (String, ChatValue)...) { self = .object(ChatObject(elements)) }
    public init(nilLiteral: ()) { self = .null }
}

/// A message as most conversations have it: {"role", "content"}, in that order.
public struct ChatMessage: Equatable, Sendable {
    public var role: String
    public var content: String

    public init(role: String, content: String) {
        self.role = role
        self.content = content
    }

    public var value: ChatValue { ["role": .string(role), "content": .string(content)] }
}

extension ChatValue {
    /// Parses JSON text (RFC 8259) keeping each object's key order; a repeated key keeps its first
    /// position and its last value, as Python's json.loads does.
    public static func parseJSON(_ text: String) throws -> ChatValue {
        var parser = JSONReader(scalars: Array(text.unicodeScalars))
        parser.skipSpace()
        let value = try parser.value(depth: 0)
        parser.skipSpace()
        guard parser.position == parser.scalars.count else { throw parser.failure("unexpected text after the value") }
        return value
    }
}

/// What `ChatValue.parseJSON` throws: the problem and its offset.
public struct ChatJSONError: Error, CustomStringConvertible {
    public var description: String
}

private struct JSONReader {
    let scalars: [Unicode.Scalar]
    var position = 0

    func failure(_ message: String) -> ChatJSONError {
        ChatJSONError(description: "invalid JSON at character \(position): \(message)")
    }

    var current: Unicode.Scalar? { position < scalars.count ? scalars[position] : nil }

    mutating func skipSpace() {
        while let scalar = current, scalar == " " || scalar == "\t" || scalar == "\n" || scalar == "\r" { position += 1 }
    }

    mutating func expect(_ word: String) throws {
        for scalar in word.unicodeScalars {
            guard current == scalar else { throw failure("expected \(word)") }
            position += 1
        }
    }

    mutating func value(depth: Int) throws -> ChatValue {
        guard depth < 512 else { throw failure("nested too deeply") }
        guard let scalar = current else { throw failure("unexpected end of input") }
        switch scalar {
        case "{":
            position += 1
            var object = ChatObject()
            skipSpace()
            if current == "}" { position += 1; return .object(object) }
            while true {
                skipSpace()
                guard current == "\"" else { throw failure("expected a string key") }
                let key = try string()
                skipSpace()
                try expect(":")
                skipSpace()
                object[key] = try value(depth: depth + 1)
                skipSpace()
                if current == "," { position += 1; continue }
                try expect("}")
                return .object(object)
            }
        case "[":
            position += 1
            var items: [ChatValue] = []
            skipSpace()
            if current == "]" { position += 1; return .array(items) }
            while true {
                skipSpace()
                items.append(try value(depth: depth + 1))
                skipSpace()
                if current == "," { position += 1; continue }
                try expect("]")
                return .array(items)
            }
        case "\"": return .string(try string())
        case "t": try expect("true"); return .bool(true)
        case "f": try expect("false"); return .bool(false)
        case "n": try expect("null"); return .null
        default: return try number()
        }
    }

    mutating func hex4() throws -> UInt32 {
        guard position + 4 <= scalars.count, let code = UInt32(String(String.UnicodeScalarView(scalars[position..<position + 4])), radix: 16) else {
            throw failure("bad \\u escape")
        }
        position += 4
        return code
    }

    mutating func string() throws -> String {
        position += 1
        var out = String.UnicodeScalarView()
        while true {
            guard let scalar = current else { throw failure("unterminated string") }
            position += 1
            switch scalar {
            case "\"": return String(out)
            case "\\":
                guard let escape = current else { throw failure("unterminated string") }
                position += 1
                switch escape {
                case "\"", "\\", "/": out.append(escape)
                case "b": out.append("\u{08}")
                case "f": out.append("\u{0C}")
                case "n": out.append("\n")
                case "r": out.append("\r")
                case "t": out.append("\t")
                case "u":
                    var code = try hex4()
                    if (0xD800..<0xDC00).contains(code), current == "\\", position + 1 < scalars.count, scalars[position + 1] == "u" {
                        position += 2
                        let low = try hex4()
                        guard (0xDC00..<0xE000).contains(low) else { throw failure("unpaired surrogate") }
                        code = 0x10000 + ((code - 0xD800) << 10) + (low - 0xDC00)
                    }
                    guard let decoded = Unicode.Scalar(code) else { throw failure("unpaired surrogate") }
                    out.append(decoded)
                default: throw failure("bad escape \\\(escape)")
                }
            default:
                guard scalar.value >= 0x20 else { throw failure("control character in a string") }
                out.append(scalar)
            }
        }
    }

    mutating func number() throws -> ChatValue {
        let start = position
        var isInteger = true
        if current == "-" { position += 1 }
        func digits() -> Int {
            let from = position
            while let scalar = current, ("0"..."9").contains(scalar) { position += 1 }
            return position - from
        }
        guard digits() > 0 else { throw failure("unexpected character") }
        if current == "." {
            position += 1
            isInteger = false
            guard digits() > 0 else { throw failure("bad number") }
        }
        if current == "e" || current == "E" {
            position += 1
            isInteger = false
            if current == "+" || current == "-" { position += 1 }
            guard digits() > 0 else { throw failure("bad number") }
        }
        let text = String(String.UnicodeScalarView(scalars[start..<position]))
        if isInteger, let integer = Int(text) { return .int(integer) }
        guard let double = Double(text) else { throw failure("bad number \(text)") }
        return .double(double)
    }
}
