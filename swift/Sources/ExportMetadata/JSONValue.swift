/// A parsed JSON value, for comparing two JSON texts by meaning: key order,
/// whitespace and number spelling (`1` vs `1.0`) do not matter.
public indirect enum JSONValue: Codable, Equatable, Sendable, CustomStringConvertible {
    case null
    case bool(Bool)
    case integer(Int64)
    case number(Double)
    case string(String)
    case array([JSONValue])
    case object([String: JSONValue])

    public init(from decoder: Decoder) throws {
        let container = try decoder.singleValueContainer()
        if container.decodeNil() {
            self = .null
        } else if let value = try? container.decode(Bool.self) {
            self = .bool(value)
        } else if let value = try? container.decode(Int64.self) {
            self = .integer(value)
        } else if let value = try? container.decode(Double.self) {
            self = .number(value)
        } else if let value = try? container.decode(String.self) {
            self = .string(value)
        } else if let value = try? container.decode([JSONValue].self) {
            self = .array(value)
        } else if let value = try? container.decode([String: JSONValue].self) {
            self = .object(value)
        } else {
            throw DecodingError.dataCorruptedError(in: container, debugDescription: "not a JSON value")
        }
    }

    public func encode(to encoder: Encoder) throws {
        var container = encoder.singleValueContainer()
        switch self {
        case .null: try container.encodeNil()
        case .bool(let value): try container.encode(value)
        case .integer(let value): try container.encode(value)
        case .number(let value): try container.encode(value)
        case .string(let value): try container.encode(value)
        case .array(let values): try container.encode(values)
        case .object(let members): try container.encode(members)
        }
    }

    public static func == (lhs: JSONValue, rhs: JSONValue) -> Bool {
        switch (lhs, rhs) {
        case (.null, .null): return true
        case (.bool(let a), .bool(let b)): return a == b
        case (.integer(let a), .integer(let b)): return a == b
        case (.number(let a), .number(let b)): return a == b
        case (.integer(let a), .number(let b)), (.number(let b), .integer(let a)): return Double(a) == b
        case (.string(let a), .string(let b)): return a == b
        case (.array(let a), .array(let b)): return a == b
        case (.object(let a), .object(let b)): return a == b
        default: return false
        }
    }

    public var description: String {
        switch self {
        case .null: return "null"
        case .bool(let value): return String(value)
        case .integer(let value): return String(value)
        case .number(let value): return String(value)
        case .string(let value): return "\"\(value)\""
        case .array(let values): return "[" + values.map(\.description).joined(separator: ", ") + "]"
        case .object(let members):
            return "{" + members.keys.sorted().map { "\"\($0)\": \(members[$0]!.description)" }.joined(separator: ", ") + "}"
        }
    }

    /// Key paths (`a.b[2]`) where two values differ, at most `limit` of them,
    /// so a mismatch report points at the field instead of dumping both texts.
    public func differences(from other: JSONValue, path: String = "", limit: Int = 5) -> [String] {
        var found: [String] = []
        collectDifferences(from: other, path: path, limit: limit, into: &found)
        return found
    }

    private func collectDifferences(from other: JSONValue, path: String, limit: Int, into found: inout [String]) {
        guard found.count < limit else { return }
        let here = path.isEmpty ? "<root>" : path
        switch (self, other) {
        case (.object(let a), .object(let b)):
            for key in Set(a.keys).union(b.keys).sorted() {
                let child = path.isEmpty ? key : "\(path).\(key)"
                switch (a[key], b[key]) {
                case (let x?, let y?): x.collectDifferences(from: y, path: child, limit: limit, into: &found)
                case (_?, nil): found.append("\(child) only in the first")
                case (nil, _?): found.append("\(child) only in the second")
                default: break
                }
                if found.count >= limit { return }
            }
        case (.array(let a), .array(let b)) where a.count == b.count:
            for (index, pair) in zip(a, b).enumerated() {
                pair.0.collectDifferences(from: pair.1, path: "\(path)[\(index)]", limit: limit, into: &found)
                if found.count >= limit { return }
            }
        default:
            if self != other { found.append("\(here): \(self) vs \(other)") }
        }
    }
}
