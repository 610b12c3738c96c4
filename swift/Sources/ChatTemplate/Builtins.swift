/// The filters, tests, global functions and methods the renderer implements, each as jinja2
/// (and Python underneath it) computes it; `Supported` lists their names.

import Foundation

enum Builtins {
    static let stringMethods: Set<String> = ["strip", "lstrip", "rstrip", "startswith", "endswith", "split", "upper",
                                             "lower", "replace", "title"]
    static let dictMethods: Set<String> = ["items", "keys", "values", "get"]
    /// jinja2's sandbox limit on range().
    static let maxRange = 100_000

    /// Positional and keyword arguments matched to `names`, Python's way.
    static func bind(_ what: String, _ positional: [Value], _ keywords: [(String, Value)], _ names: [String],
                     line: Int) throws -> [Value?] {
        guard positional.count <= names.count else {
            throw ChatTemplateError.runtime("\(what) takes at most \(names.count) argument(s), got \(positional.count)", line: line)
        }
        var bound: [Value?] = positional.map { $0 } + Array(repeating: nil, count: names.count - positional.count)
        for (key, value) in keywords {
            guard let position = names.firstIndex(of: key) else {
                throw ChatTemplateError.runtime("\(what) got an unexpected keyword argument '\(key)'", line: line)
            }
            guard bound[position] == nil else {
                throw ChatTemplateError.runtime("\(what) got multiple values for argument '\(key)'", line: line)
            }
            bound[position] = value
        }
        return bound
    }

    private static func text(_ value: Value?, _ what: String, line: Int) throws -> String? {
        switch value {
        case nil, .none?: return nil
        case .string(let text)?: return text
        case let other?: throw ChatTemplateError.runtime("\(what) must be a string or None, not \(other.typeName)", line: line)
        }
    }

    private static func integer(_ value: Value?, _ what: String, line: Int) throws -> Int? {
        switch value {
        case nil, .none?: return nil
        case .int(let number)?: return number
        case .bool(let flag)?: return flag ? 1 : 0
        case let other?: throw ChatTemplateError.runtime("\(what) must be an integer, not \(other.typeName)", line: line)
        }
    }

    // MARK: filters

    static func filter(_ name: String, _ value: Value, _ positional: [Value], _ keywords: [(String, Value)],
                       line: Int) throws -> Value {
        let what = "filter \(name)"
        func arguments(_ names: [String]) throws -> [Value?] { try bind(what, positional, keywords, names, line: line) }
        switch name {
        case "safe":
            _ = try arguments([])
            return value
        case "trim":
            let chars = try text(try arguments(["chars"])[0], "trim's chars", line: line)
            return .string(strip(value.pythonString, chars: chars, left: true, right: true))
        case "tojson":
            let indentValue = try arguments(["indent"])[0]
            var indent: String?
            switch indentValue {
            case nil, .none?: indent = nil
            case .string(let text)?: indent = text
            case .int, .bool: indent = String(repeating: " ", count: max(0, try integer(indentValue, "indent", line: line)!))
            case let other?: throw ChatTemplateError.runtime("tojson's indent must be an integer or a string, not \(other.typeName)", line: line)
            }
            return .string(try json(value, indent: indent, level: 0, line: line))
        case "length", "count":
            _ = try arguments([])
            return .int(try length(value, line: line))
        case "first":
            _ = try arguments([])
            return try iterate(value, line: line).first ?? .undefined(hint: "No first item, sequence was empty.")
        case "last":
            _ = try arguments([])
            return try iterate(value, line: line).last ?? .undefined(hint: "No last item, sequence was empty.")
        case "join":
            let bound = try arguments(["d", "attribute"])
            let separator = bound[0].map(\.pythonString) ?? ""
            var items = try iterate(value, line: line)
            if let attribute = bound[1] {
                items = try items.map { try attributeOf($0, attribute, line: line) }
            }
            return .string(items.map(\.pythonString).joined(separator: separator))
        case "default", "d":
            let bound = try arguments(["default_value", "boolean"])
            if value.isUndefined || (bound[1]?.truthy ?? false) && !value.truthy {
                return bound[0] ?? .string("")
            }
            return value
        case "lower":
            _ = try arguments([])
            return .string(value.pythonString.lowercased())
        case "upper":
            _ = try arguments([])
            return .string(value.pythonString.uppercased())
        case "capitalize":
            _ = try arguments([])
            return .string(capitalize(value.pythonString))
        case "title":
            _ = try arguments([])
            return .string(jinjaTitle(value.pythonString))
        case "string":
            _ = try arguments([])
            return .string(value.pythonString)
        case "int":
            let bound = try arguments(["default", "base"])
            return try toInt(value, fallback: bound[0] ?? .int(0), base: try integer(bound[1], "int's base", line: line) ?? 10, line: line)
        case "list":
            _ = try arguments([])
            return .list(try iterate(value, line: line))
        case "reverse":
            _ = try arguments([])
            if case .string(let text) = value { return .string(String(String.UnicodeScalarView(text.unicodeScalars.reversed()))) }
            return .list(try iterate(value, line: line).reversed())
        case "items":
            _ = try arguments([])
            switch value {
            case .undefined: return .list([])
            case .dict(let map): return .list(map.pairs.map { .tuple([.string($0.0), $0.1]) })
            default: throw ChatTemplateError.runtime("Can only get item pairs from a mapping.", line: line)
            }
        case "replace":
            let bound = try arguments(["old", "new", "count"])
            guard let old = bound[0], let new = bound[1] else {
                throw ChatTemplateError.runtime("filter replace needs the old and the new text", line: line)
            }
            return .string(replace(value.pythonString, old.pythonString, new.pythonString,
                                   count: try integer(bound[2], "replace's count", line: line) ?? -1))
        default:
            throw ChatTemplateError.unsupported("filter \(name)", line: line)
        }
    }

    /// jinja2's attribute lookup for `join(attribute=...)`: an item first, then an attribute.
    private static func attributeOf(_ value: Value, _ key: Value, line: Int) throws -> Value {
        switch (value, key) {
        case (.dict(let map), .string(let name)): return map[name] ?? .undefined(hint: "'dict object' has no attribute '\(name)'")
        case (.list(let items), .int(let index)), (.tuple(let items), .int(let index)):
            let resolved = index < 0 ? index + items.count : index
            return resolved >= 0 && resolved < items.count ? items[resolved] : .undefined(hint: "no item \(index)")
        case (.string(let text), .int(let index)):
            let scalars = Array(text.unicodeScalars)
            let resolved = index < 0 ? index + scalars.count : index
            return resolved >= 0 && resolved < scalars.count ? .string(String(scalars[resolved])) : .undefined(hint: "no item \(index)")
        case (.undefined(let hint), _): throw ChatTemplateError.runtime(hint, line: line)
        default: return .undefined(hint: "'\(value.typeName) object' has no attribute \(key.pythonRepr)")
        }
    }

    private static func toInt(_ value: Value, fallback: Value, base: Int, line: Int) throws -> Value {
        switch value {
        case .undefined(let hint): throw ChatTemplateError.runtime(hint, line: line)
        case .bool(let flag): return .int(flag ? 1 : 0)
        case .int(let number): return .int(number)
        case .double(let number):
            if number.isNaN { return fallback }
            guard number.isFinite else { throw ChatTemplateError.runtime("cannot convert float infinity to integer", line: line) }
            guard let truncated = Int(exactly: number.rounded(.towardZero)) else {
                throw ChatTemplateError.runtime("integer overflow converting \(pythonFloat(number))", line: line)
            }
            return .int(truncated)
        case .string(let text):
            var digits = strip(text, chars: nil, left: true, right: true)
            var negative = false
            if digits.hasPrefix("-") || digits.hasPrefix("+") {
                negative = digits.hasPrefix("-")
                digits.removeFirst()
            }
            let lowered = digits.lowercased()
            if base == 16, lowered.hasPrefix("0x") { digits.removeFirst(2) }
            if base == 8, lowered.hasPrefix("0o") { digits.removeFirst(2) }
            if base == 2, lowered.hasPrefix("0b") { digits.removeFirst(2) }
            let clean = digits.replacingOccurrences(of: "_", with: "")
            if !digits.hasPrefix("_"), !digits.hasSuffix("_"), !digits.contains("__"), !clean.isEmpty,
               clean.unicodeScalars.allSatisfy({ $0.isASCII && $0.properties.isASCIIHexDigit }),
               let number = Int(clean, radix: base) {
                return .int(negative ? -number : number)
            }
            let floatText = strip(text, chars: nil, left: true, right: true).replacingOccurrences(of: "_", with: "")
            if let number = Double(floatText), !floatText.isEmpty {
                if number.isNaN { return fallback }
                guard number.isFinite else { throw ChatTemplateError.runtime("cannot convert float infinity to integer", line: line) }
                if let truncated = Int(exactly: number.rounded(.towardZero)) { return .int(truncated) }
            }
            return fallback
        default:
            return fallback
        }
    }

    // MARK: tests

    static func test(_ name: String, _ value: Value, _ arguments: [Value], line: Int) throws -> Bool {
        guard arguments.isEmpty else { throw ChatTemplateError.runtime("test \(name) takes no argument", line: line) }
        switch name {
        case "defined": return !value.isUndefined
        case "undefined": return value.isUndefined
        case "none": if case .none = value { return true }; return false
        case "string": return value.isString
        case "number": return value.number != nil
        case "integer": if case .int = value { return true }; return false
        case "float": return value.isDouble
        case "boolean": if case .bool = value { return true }; return false
        case "true": if case .bool(true) = value { return true }; return false
        case "false": if case .bool(false) = value { return true }; return false
        case "mapping": if case .dict = value { return true }; return false
        case "iterable", "sequence":
            switch value {
            case .undefined, .string, .list, .tuple, .dict: return true
            case .loop: return name == "iterable"
            default: return false
            }
        case "odd", "even":
            if case .undefined(let hint) = value { throw ChatTemplateError.runtime(hint, line: line) }
            let remainder: Double
            switch value.number {
            case .int(let number)?: remainder = Double(((number % 2) + 2) % 2)
            case .double(let number)?:
                var modulo = fmod(number, 2)
                if modulo < 0 { modulo += 2 }
                remainder = modulo
            case nil: throw ChatTemplateError.runtime("test \(name) needs a number, not \(value.typeName)", line: line)
            }
            return name == "odd" ? remainder == 1 : remainder == 0
        default:
            throw ChatTemplateError.unsupported("test \(name)", line: line)
        }
    }

    // MARK: functions and methods

    static func function(_ name: String, _ positional: [Value], _ keywords: [(String, Value)], line: Int) throws -> Value {
        switch name {
        case "namespace":
            guard positional.count <= 1 else { throw ChatTemplateError.runtime("namespace() takes at most one dict", line: line) }
            var attributes = OrderedMap()
            if let first = positional.first {
                guard case .dict(let map) = first else {
                    throw ChatTemplateError.runtime("namespace() takes a dict, not \(first.typeName)", line: line)
                }
                attributes = map
            }
            for (key, value) in keywords { attributes[key] = value }
            return .namespace(Namespace(attributes))
        case "raise_exception":
            let message = try bind("raise_exception()", positional, keywords, ["message"], line: line)[0]
            throw ChatTemplateError.raised(message?.pythonString ?? "", line: line)
        case "range":
            guard keywords.isEmpty, (1...3).contains(positional.count) else {
                throw ChatTemplateError.runtime("range() takes 1 to 3 integers", line: line)
            }
            let numbers = try positional.map { value -> Int in
                guard case .int(let number)? = value.number, !value.isDouble else {
                    throw ChatTemplateError.runtime("range() takes integers, not \(value.typeName)", line: line)
                }
                return number
            }
            let (start, stop, step) = numbers.count == 1 ? (0, numbers[0], 1)
                : (numbers[0], numbers[1], numbers.count == 3 ? numbers[2] : 1)
            guard step != 0 else { throw ChatTemplateError.runtime("range() arg 3 must not be zero", line: line) }
            let values = stride(from: start, to: stop, by: step)
            guard values.underestimatedCount <= maxRange, (step > 0 ? (stop - start) / step : (start - stop) / -step) <= maxRange else {
                throw ChatTemplateError.runtime("range too big, the sandbox blocks ranges larger than MAX_RANGE (\(maxRange))", line: line)
            }
            return .list(values.map { .int($0) })
        default:
            throw ChatTemplateError.unsupported("function \(name)()", line: line)
        }
    }

    static func method(_ name: String, of object: Value, _ positional: [Value], _ keywords: [(String, Value)],
                       line: Int) throws -> Value {
        let what = "\(name)()"
        func arguments(_ names: [String]) throws -> [Value?] { try bind(what, positional, keywords, names, line: line) }
        func fail() -> ChatTemplateError {
            .runtime("'\(object.typeName) object' has no attribute '\(name)'", line: line)
        }
        if case .string(let string) = object {
            switch name {
            case "strip", "lstrip", "rstrip":
                let chars = try text(try arguments(["chars"])[0], "\(name)'s chars", line: line)
                return .string(strip(string, chars: chars, left: name != "rstrip", right: name != "lstrip"))
            case "startswith", "endswith":
                guard let affix = try arguments(["affix"])[0] else {
                    throw ChatTemplateError.runtime("\(what) takes one argument", line: line)
                }
                let candidates: [Value]
                switch affix {
                case .string: candidates = [affix]
                case .tuple(let items): candidates = items
                default: throw ChatTemplateError.runtime("\(name) first arg must be str or a tuple of str, not \(affix.typeName)", line: line)
                }
                let scalars = Array(string.unicodeScalars)
                for candidate in candidates {
                    guard case .string(let text) = candidate else {
                        throw ChatTemplateError.runtime("tuple for \(name) must only contain str, not \(candidate.typeName)", line: line)
                    }
                    let part = Array(text.unicodeScalars)
                    if part.count <= scalars.count,
                       name == "startswith" ? scalars.prefix(part.count).elementsEqual(part) : scalars.suffix(part.count).elementsEqual(part) {
                        return .bool(true)
                    }
                }
                return .bool(false)
            case "split":
                let bound = try arguments(["sep", "maxsplit"])
                let separator = try text(bound[0], "split's sep", line: line)
                if separator?.unicodeScalars.isEmpty == true { throw ChatTemplateError.runtime("empty separator", line: line) }
                return .list(split(string, separator: separator, maxSplit: try integer(bound[1], "maxsplit", line: line) ?? -1).map { .string($0) })
            case "upper":
                _ = try arguments([])
                return .string(string.uppercased())
            case "lower":
                _ = try arguments([])
                return .string(string.lowercased())
            case "title":
                _ = try arguments([])
                return .string(pythonTitle(string))
            case "replace":
                let bound = try arguments(["old", "new", "count"])
                guard case .string(let old)? = bound[0], case .string(let new)? = bound[1] else {
                    throw ChatTemplateError.runtime("replace() takes two strings", line: line)
                }
                return .string(replace(string, old, new, count: try integer(bound[2], "replace's count", line: line) ?? -1))
            default: throw fail()
            }
        }
        if case .dict(let map) = object {
            switch name {
            case "items":
                _ = try arguments([])
                return .list(map.pairs.map { .tuple([.string($0.0), $0.1]) })
            case "keys":
                _ = try arguments([])
                return .list(map.keys.map { .string($0) })
            case "values":
                _ = try arguments([])
                return .list(map.values)
            case "get":
                let bound = try arguments(["key", "default"])
                guard let key = bound[0] else { throw ChatTemplateError.runtime("get() takes a key", line: line) }
                if case .string(let text) = key, let value = map[text] { return value }
                return bound[1] ?? .none
            default: throw fail()
            }
        }
        throw fail()
    }

    // MARK: Python semantics

    static func iterate(_ value: Value, line: Int) throws -> [Value] {
        switch value {
        case .undefined: return []
        case .list(let items), .tuple(let items): return items
        case .dict(let map): return map.keys.map { .string($0) }
        case .string(let text): return text.unicodeScalars.map { .string(String($0)) }
        default: throw ChatTemplateError.runtime("'\(value.typeName)' object is not iterable", line: line)
        }
    }

    static func length(_ value: Value, line: Int) throws -> Int {
        switch value {
        case .undefined: return 0
        case .string(let text): return text.unicodeScalars.count
        case .list(let items), .tuple(let items): return items.count
        case .dict(let map): return map.count
        default: throw ChatTemplateError.runtime("object of type '\(value.typeName)' has no len()", line: line)
        }
    }

    static func equal(_ left: Value, _ right: Value) -> Bool {
        if let a = left.number, let b = right.number {
            if case .int(let x) = a, case .int(let y) = b { return x == y }
            return a.double == b.double
        }
        switch (left, right) {
        case (.undefined, .undefined), (.none, .none): return true
        case (.string(let x), .string(let y)): return x.unicodeScalars.elementsEqual(y.unicodeScalars)
        case (.list(let x), .list(let y)), (.tuple(let x), .tuple(let y)):
            return x.count == y.count && zip(x, y).allSatisfy { equal($0, $1) }
        case (.dict(let x), .dict(let y)):
            return x.count == y.count && x.pairs.allSatisfy { key, value in y[key].map { equal(value, $0) } ?? false }
        case (.namespace(let x), .namespace(let y)): return x === y
        default: return false
        }
    }

    static func less(_ left: Value, _ right: Value, op: String, line: Int) throws -> Bool {
        if let a = left.number, let b = right.number {
            if case .int(let x) = a, case .int(let y) = b { return x < y }
            return a.double < b.double
        }
        switch (left, right) {
        case (.string(let x), .string(let y)):
            return x.unicodeScalars.lexicographicallyPrecedes(y.unicodeScalars) { $0.value < $1.value }
        case (.list(let x), .list(let y)), (.tuple(let x), .tuple(let y)):
            for (a, b) in zip(x, y) where !equal(a, b) { return try less(a, b, op: op, line: line) }
            return x.count < y.count
        default:
            throw ChatTemplateError.runtime("'\(op)' not supported between instances of '\(left.typeName)' and '\(right.typeName)'", line: line)
        }
    }

    /// `item in container`.
    static func contains(_ container: Value, _ item: Value, line: Int) throws -> Bool {
        switch container {
        case .undefined: return false
        case .string(let text):
            guard case .string(let part) = item else {
                throw ChatTemplateError.runtime("'in <string>' requires string as left operand, not \(item.typeName)", line: line)
            }
            return find(Array(text.unicodeScalars), Array(part.unicodeScalars), from: 0) != nil
        case .list(let items), .tuple(let items): return items.contains { equal($0, item) }
        case .dict(let map):
            if case .string(let key) = item { return map[key] != nil }
            return false
        default:
            throw ChatTemplateError.runtime("argument of type '\(container.typeName)' is not iterable", line: line)
        }
    }

    /// json.dumps(value, ensure_ascii=False, indent=indent), key order as inserted.
    static func json(_ value: Value, indent: String?, level: Int, line: Int) throws -> String {
        switch value {
        case .none: return "null"
        case .bool(let flag): return flag ? "true" : "false"
        case .int(let number): return String(number)
        case .double(let number):
            if number.isNaN { return "NaN" }
            if number.isInfinite { return number < 0 ? "-Infinity" : "Infinity" }
            return pythonFloat(number)
        case .string(let text): return jsonString(text)
        case .list(let items), .tuple(let items):
            if items.isEmpty { return "[]" }
            let parts = try items.map { try json($0, indent: indent, level: level + 1, line: line) }
            return wrap(parts, "[", "]", indent: indent, level: level)
        case .dict(let map):
            if map.count == 0 { return "{}" }
            let parts = try map.pairs.map { jsonString($0.0) + ": " + (try json($0.1, indent: indent, level: level + 1, line: line)) }
            return wrap(parts, "{", "}", indent: indent, level: level)
        default:
            throw ChatTemplateError.runtime("Object of type \(value.typeName) is not JSON serializable", line: line)
        }
    }

    private static func wrap(_ parts: [String], _ open: String, _ close: String, indent: String?, level: Int) -> String {
        guard let indent else { return open + parts.joined(separator: ", ") + close }
        let inner = "\n" + String(repeating: indent, count: level + 1)
        return open + inner + parts.joined(separator: "," + inner) + "\n" + String(repeating: indent, count: level) + close
    }

    static func jsonString(_ text: String) -> String {
        var out = String.UnicodeScalarView()
        out.append("\"")
        for scalar in text.unicodeScalars {
            switch scalar {
            case "\"": out.append(contentsOf: "\\\"".unicodeScalars)
            case "\\": out.append(contentsOf: "\\\\".unicodeScalars)
            case "\n": out.append(contentsOf: "\\n".unicodeScalars)
            case "\r": out.append(contentsOf: "\\r".unicodeScalars)
            case "\t": out.append(contentsOf: "\\t".unicodeScalars)
            case "\u{08}": out.append(contentsOf: "\\b".unicodeScalars)
            case "\u{0C}": out.append(contentsOf: "\\f".unicodeScalars)
            default:
                if scalar.value < 0x20 {
                    let hex = String(scalar.value, radix: 16)
                    out.append(contentsOf: ("\\u" + String(repeating: "0", count: 4 - hex.count) + hex).unicodeScalars)
                } else {
                    out.append(scalar)
                }
            }
        }
        out.append("\"")
        return String(out)
    }

    // MARK: strings, by Unicode scalar as Python indexes them

    static func find(_ haystack: [Unicode.Scalar], _ needle: [Unicode.Scalar], from start: Int) -> Int? {
        if needle.isEmpty { return start <= haystack.count ? start : nil }
        guard haystack.count >= needle.count else { return nil }
        var index = start
        while index + needle.count <= haystack.count {
            if haystack[index] == needle[0] && haystack[index..<(index + needle.count)].elementsEqual(needle) { return index }
            index += 1
        }
        return nil
    }

    static func strip(_ text: String, chars: String?, left: Bool, right: Bool) -> String {
        let scalars = Array(text.unicodeScalars)
        let set = chars.map { Set($0.unicodeScalars) }
        let strips = { (scalar: Unicode.Scalar) in set?.contains(scalar) ?? isPythonSpace(scalar) }
        var start = 0
        var end = scalars.count
        if left { while start < end && strips(scalars[start]) { start += 1 } }
        if right { while end > start && strips(scalars[end - 1]) { end -= 1 } }
        return String(String.UnicodeScalarView(scalars[start..<end]))
    }

    static func split(_ text: String, separator: String?, maxSplit: Int) -> [String] {
        let scalars = Array(text.unicodeScalars)
        func string(_ range: Range<Int>) -> String { String(String.UnicodeScalarView(scalars[range])) }
        var parts: [String] = []
        var remaining = maxSplit < 0 ? Int.max : maxSplit
        guard let separator else {
            // CPython's split_whitespace.
            var index = 0
            while remaining > 0 {
                while index < scalars.count && isPythonSpace(scalars[index]) { index += 1 }
                if index == scalars.count { break }
                let start = index
                while index < scalars.count && !isPythonSpace(scalars[index]) { index += 1 }
                parts.append(string(start..<index))
                remaining -= 1
            }
            if index < scalars.count {
                while index < scalars.count && isPythonSpace(scalars[index]) { index += 1 }
                if index != scalars.count { parts.append(string(index..<scalars.count)) }
            }
            return parts
        }
        let needle = Array(separator.unicodeScalars)
        var start = 0
        while remaining > 0, let found = find(scalars, needle, from: start) {
            parts.append(string(start..<found))
            start = found + needle.count
            remaining -= 1
        }
        parts.append(string(start..<scalars.count))
        return parts
    }

    static func replace(_ text: String, _ old: String, _ new: String, count: Int) -> String {
        let scalars = Array(text.unicodeScalars)
        let needle = Array(old.unicodeScalars)
        let replacement = Array(new.unicodeScalars)
        var out: [Unicode.Scalar] = []
        var remaining = count < 0 ? Int.max : count
        if needle.isEmpty {
            if remaining > 0 { out += replacement; remaining -= 1 }
            for scalar in scalars {
                out.append(scalar)
                if remaining > 0 { out += replacement; remaining -= 1 }
            }
            return String(String.UnicodeScalarView(out))
        }
        var start = 0
        while remaining > 0, let found = find(scalars, needle, from: start) {
            out += scalars[start..<found]
            out += replacement
            start = found + needle.count
            remaining -= 1
        }
        out += scalars[start...]
        return String(String.UnicodeScalarView(out))
    }

    /// Python's str.capitalize: the first character in title case, the rest in lower case.
    static func capitalize(_ text: String) -> String {
        guard let first = text.unicodeScalars.first else { return "" }
        return first.properties.titlecaseMapping + String(String.UnicodeScalarView(text.unicodeScalars.dropFirst())).lowercased()
    }

    /// Python's str.title: title case after a character without case, lower case after one with it.
    static func pythonTitle(_ text: String) -> String {
        var out = ""
        var previousCased = false
        for scalar in text.unicodeScalars {
            out += previousCased ? scalar.properties.lowercaseMapping : scalar.properties.titlecaseMapping
            previousCased = scalar.properties.isCased
        }
        return out
    }

    /// jinja2's title filter: each run between `-`, whitespace, `(`, `{`, `[` and `<` upper-cased
    /// at its first character and lower-cased after it.
    static func jinjaTitle(_ text: String) -> String {
        let separators: Set<Unicode.Scalar> = ["-", "(", "{", "[", "<"]
        let isSeparator = { (scalar: Unicode.Scalar) in separators.contains(scalar) || isPythonSpace(scalar) }
        var out = ""
        var chunk: [Unicode.Scalar] = []
        var chunkIsSeparator = false
        func flush() {
            guard let first = chunk.first else { return }
            out += first.properties.uppercaseMapping + String(String.UnicodeScalarView(chunk.dropFirst())).lowercased()
            chunk.removeAll()
        }
        for scalar in text.unicodeScalars {
            let separator = isSeparator(scalar)
            if separator != chunkIsSeparator { flush(); chunkIsSeparator = separator }
            chunk.append(scalar)
        }
        flush()
        return out
    }
}
