/// The renderer's values, with Python's semantics: what jinja2 computes with.

/// A dict with string keys in insertion order.
struct OrderedMap {
    private(set) var keys: [String] = []
    private var storage: [String: Value] = [:]

    subscript(key: String) -> Value? {
        get { storage[key] }
        set {
            if let newValue {
                if storage.updateValue(newValue, forKey: key) == nil { keys.append(key) }
            } else if storage.removeValue(forKey: key) != nil {
                keys.removeAll { $0 == key }
            }
        }
    }

    var count: Int { keys.count }
    var values: [Value] { keys.map { storage[$0]! } }
    var pairs: [(String, Value)] { keys.map { ($0, storage[$0]!) } }
}

/// jinja2's `namespace(...)`: the one object `{% set ns.x = ... %}` mutates (shared by reference).
final class Namespace {
    var attributes: OrderedMap
    init(_ attributes: OrderedMap) { self.attributes = attributes }
}

/// What `loop` holds in one iteration of a for loop.
struct LoopState {
    let index0: Int
    let length: Int
    let previous: Value?
    let next: Value?
}

indirect enum Value {
    /// jinja2's default Undefined; `hint` is the error jinja2 raises when it is used ("'x' is undefined").
    case undefined(hint: String)
    case none
    case bool(Bool)
    case int(Int)
    case double(Double)
    case string(String)
    case list([Value])
    case tuple([Value])
    case dict(OrderedMap)
    case namespace(Namespace)
    case loop(LoopState)
    /// A global function: namespace, raise_exception, range.
    case function(String)
    /// A method bound to its object, e.g. `message.items`.
    case method(Value, String)

    init(_ value: ChatValue) {
        switch value {
        case .null: self = .none
        case .bool(let flag): self = .bool(flag)
        case .int(let number): self = .int(number)
        case .double(let number): self = .double(number)
        case .string(let text): self = .string(text)
        case .array(let items): self = .list(items.map(Value.init))
        case .object(let object):
            var map = OrderedMap()
            for (key, item) in object.pairs { map[key] = Value(item) }
            self = .dict(map)
        }
    }

    var isUndefined: Bool {
        if case .undefined = self { return true }
        return false
    }

    /// Python's truth value (Undefined is false).
    var truthy: Bool {
        switch self {
        case .undefined, .none: return false
        case .bool(let flag): return flag
        case .int(let number): return number != 0
        case .double(let number): return number != 0
        case .string(let text): return !text.unicodeScalars.isEmpty
        case .list(let items), .tuple(let items): return !items.isEmpty
        case .dict(let map): return map.count > 0
        case .namespace, .loop, .function, .method: return true
        }
    }

    /// Python's type name, for error messages.
    var typeName: String {
        switch self {
        case .undefined: return "Undefined"
        case .none: return "NoneType"
        case .bool: return "bool"
        case .int: return "int"
        case .double: return "float"
        case .string: return "str"
        case .list: return "list"
        case .tuple: return "tuple"
        case .dict: return "dict"
        case .namespace: return "Namespace"
        case .loop: return "LoopContext"
        case .function: return "function"
        case .method: return "builtin_function_or_method"
        }
    }

    /// The number of a bool, int or float (bool counts as int, as in Python).
    var number: Number? {
        switch self {
        case .bool(let flag): return .int(flag ? 1 : 0)
        case .int(let value): return .int(value)
        case .double(let value): return .double(value)
        default: return nil
        }
    }

    /// Python's `str()`; Undefined prints as nothing.
    var pythonString: String {
        switch self {
        case .undefined: return ""
        case .none: return "None"
        case .bool(let flag): return flag ? "True" : "False"
        case .int(let number): return String(number)
        case .double(let number): return pythonFloat(number)
        case .string(let text): return text
        case .list(let items): return "[" + items.map(\.pythonRepr).joined(separator: ", ") + "]"
        case .tuple(let items):
            return "(" + items.map(\.pythonRepr).joined(separator: ", ") + (items.count == 1 ? ",)" : ")")
        case .dict(let map):
            return "{" + map.pairs.map { reprOfString($0.0) + ": " + $0.1.pythonRepr }.joined(separator: ", ") + "}"
        case .namespace(let namespace): return "<Namespace " + Value.dict(namespace.attributes).pythonString + ">"
        case .loop(let loop): return "<LoopContext \(loop.index0 + 1)/\(loop.length)>"
        case .function(let name): return "<function \(name)>"
        case .method(_, let name): return "<built-in method \(name)>"
        }
    }

    /// Python's `repr()`.
    var pythonRepr: String {
        switch self {
        case .string(let text): return reprOfString(text)
        case .undefined: return "Undefined"
        default: return pythonString
        }
    }
}

enum Number {
    case int(Int)
    case double(Double)

    var double: Double {
        switch self {
        case .int(let value): return Double(value)
        case .double(let value): return value
        }
    }
}

/// Python's `repr(str)`: single quotes unless the text has one and no double quote.
func reprOfString(_ text: String) -> String {
    let hasSingle = text.unicodeScalars.contains("'")
    let hasDouble = text.unicodeScalars.contains("\"")
    let quote: Unicode.Scalar = hasSingle && !hasDouble ? "\"" : "'"
    var out = String.UnicodeScalarView()
    out.append(quote)
    for scalar in text.unicodeScalars {
        switch scalar {
        case quote, "\\": out.append("\\"); out.append(scalar)
        case "\t": out.append(contentsOf: "\\t".unicodeScalars)
        case "\n": out.append(contentsOf: "\\n".unicodeScalars)
        case "\r": out.append(contentsOf: "\\r".unicodeScalars)
        default:
            if isPythonPrintable(scalar) {
                out.append(scalar)
            } else {
                let hex = String(scalar.value, radix: 16)
                let (prefix, width) = scalar.value < 0x100 ? ("\\x", 2) : scalar.value < 0x10000 ? ("\\u", 4) : ("\\U", 8)
                out.append(contentsOf: (prefix + String(repeating: "0", count: width - hex.count) + hex).unicodeScalars)
            }
        }
    }
    out.append(quote)
    return String(out)
}

/// Python's str.isprintable for one character.
func isPythonPrintable(_ scalar: Unicode.Scalar) -> Bool {
    if scalar == " " { return true }
    switch scalar.properties.generalCategory {
    case .control, .format, .surrogate, .privateUse, .unassigned, .lineSeparator, .paragraphSeparator, .spaceSeparator:
        return false
    default:
        return true
    }
}

/// Python's str.isspace for one character (what str.strip and str.split strip).
func isPythonSpace(_ scalar: Unicode.Scalar) -> Bool {
    switch scalar.value {
    case 0x09...0x0D, 0x1C...0x20, 0x85, 0xA0, 0x1680, 0x2000...0x200A, 0x2028, 0x2029, 0x202F, 0x205F, 0x3000:
        return true
    default:
        return false
    }
}

/// Python's `repr(float)`: the shortest digits that round-trip, fixed notation for exponents
/// -4 through 15, else d.ddde+XX.
func pythonFloat(_ value: Double) -> String {
    if value.isNaN { return "nan" }
    if value.isInfinite { return value < 0 ? "-inf" : "inf" }
    var text = value.description  // shortest round-trip digits
    let negative = text.hasPrefix("-")
    if negative { text.removeFirst() }
    var exponentPart = 0
    if let e = text.firstIndex(where: { $0 == "e" || $0 == "E" }) {
        exponentPart = Int(text[text.index(after: e)...]) ?? 0
        text = String(text[..<e])
    }
    let parts = text.split(separator: ".", omittingEmptySubsequences: false)
    let integerDigits = String(parts[0])
    let fraction = parts.count > 1 ? String(parts[1]) : ""
    var digits = Array(integerDigits + fraction)
    let leadingZeros = digits.prefix { $0 == "0" }.count
    digits.removeFirst(leadingZeros)
    while digits.last == "0" { digits.removeLast() }
    let sign = negative ? "-" : ""
    if digits.isEmpty { return sign + "0.0" }
    let exponent = integerDigits.count - leadingZeros - 1 + exponentPart
    if exponent >= -4 && exponent < 16 {
        if exponent >= 0 {
            let whole = digits.count > exponent + 1 ? String(digits[0...exponent]) : String(digits) + String(repeating: "0", count: exponent + 1 - digits.count)
            let rest = digits.count > exponent + 1 ? String(digits[(exponent + 1)...]) : "0"
            return sign + whole + "." + rest
        }
        return sign + "0." + String(repeating: "0", count: -exponent - 1) + String(digits)
    }
    let mantissa = digits.count > 1 ? String(digits[0]) + "." + String(digits[1...]) : String(digits[0])
    let magnitude = String(abs(exponent))
    return sign + mantissa + "e" + (exponent < 0 ? "-" : "+") + (magnitude.count < 2 ? "0" : "") + magnitude
}
