/// Runs the parsed template: jinja2's scoping (each loop iteration a fresh scope, `if` none),
/// Python's operators and conversions, jinja2's Undefined.

import Foundation

final class Evaluator {
    private var frames: [[String: Value]]
    private(set) var output = ""

    init(context: [String: Value]) { frames = [context] }

    // MARK: statements

    func run(_ statements: [Statement]) throws {
        for statement in statements {
            switch statement {
            case .text(let text):
                output += text
            case .output(let expression):
                output += try evaluate(expression).pythonString
            case .assign(let target, let expression, let line):
                try bind(target, try evaluate(expression), line: line)
            case .conditional(let branches, let otherwise):
                var done = false
                for (test, body) in branches where try evaluate(test).truthy {
                    try run(body)
                    done = true
                    break
                }
                if !done { try run(otherwise) }
            case .forLoop(let target, let iterable, let condition, let body, let otherwise, let line):
                let items = try iterate(try evaluate(iterable), line: iterable.line)
                var kept: [Value] = []
                if let condition {
                    for item in items {
                        frames.append([:])
                        defer { frames.removeLast() }
                        try bind(target, item, line: line)
                        if try evaluate(condition).truthy { kept.append(item) }
                    }
                } else {
                    kept = items
                }
                if kept.isEmpty {
                    frames.append([:])
                    defer { frames.removeLast() }
                    try run(otherwise)
                    continue
                }
                for (position, item) in kept.enumerated() {
                    let loop = LoopState(index0: position, length: kept.count,
                                         previous: position > 0 ? kept[position - 1] : nil,
                                         next: position + 1 < kept.count ? kept[position + 1] : nil)
                    frames.append(["loop": .loop(loop)])
                    defer { frames.removeLast() }
                    try bind(target, item, line: line)
                    try run(body)
                }
            }
        }
    }

    private func bind(_ target: Target, _ value: Value, line: Int) throws {
        switch target {
        case .name(let name):
            frames[frames.count - 1][name] = value
        case .attribute(let name, let attribute):
            guard case .namespace(let namespace) = lookup(name) else {
                throw ChatTemplateError.runtime("cannot assign attribute on non-namespace object \(name)", line: line)
            }
            namespace.attributes[attribute] = value
        case .tuple(let targets):
            let items = try iterate(value, line: line)
            guard items.count == targets.count else {
                throw ChatTemplateError.runtime(items.count > targets.count
                    ? "too many values to unpack (expected \(targets.count))"
                    : "not enough values to unpack (expected \(targets.count), got \(items.count))", line: line)
            }
            for (target, item) in zip(targets, items) { try bind(target, item, line: line) }
        }
    }

    private func lookup(_ name: String) -> Value {
        for frame in frames.reversed() {
            if let value = frame[name] { return value }
        }
        if Supported.functions.contains(name) { return .function(name) }
        return .undefined(hint: "'\(name)' is undefined")
    }

    // MARK: expressions

    func evaluate(_ expression: Expr) throws -> Value {
        let line = expression.line
        switch expression.kind {
        case .constant(let value): return value
        case .name(let name): return lookup(name)
        case .list(let items): return .list(try items.map(evaluate))
        case .tuple(let items): return .tuple(try items.map(evaluate))
        case .dict(let pairs):
            var map = OrderedMap()
            for (keyExpression, valueExpression) in pairs {
                let key = try evaluate(keyExpression)
                guard case .string(let text) = key else {
                    throw ChatTemplateError.runtime("dict keys other than strings (\(key.pythonRepr)) are not supported", line: line)
                }
                map[text] = try evaluate(valueExpression)
            }
            return .dict(map)
        case .attribute(let object, let name):
            return try attribute(try evaluate(object), name, line: line)
        case .item(let object, let key):
            return try item(try evaluate(object), try evaluate(key), line: line)
        case .slice(let object, let start, let stop, let step):
            let value = try evaluate(object)
            func bound(_ expression: Expr?) throws -> Int? {
                guard let expression else { return nil }
                let value = try evaluate(expression)
                if case .none = value { return nil }
                guard case .int(let number)? = value.number.map({ $0 }), !(value.isDouble) else {
                    throw ChatTemplateError.runtime("slice indices must be integers or None, not \(value.typeName)", line: line)
                }
                return number
            }
            return try slice(value, try bound(start), try bound(stop), try bound(step), line: line)
        case .binary(let op, let left, let right):
            return try binary(op, try evaluate(left), try evaluate(right), line: line)
        case .concat(let items):
            return .string(try items.map { try evaluate($0).pythonString }.joined())
        case .compare(let first, let operations):
            var left = try evaluate(first)
            for (op, rightExpression) in operations {
                let right = try evaluate(rightExpression)
                guard try compare(op, left, right, line: line) else { return .bool(false) }
                left = right
            }
            return .bool(true)
        case .and(let left, let right):
            let value = try evaluate(left)
            return value.truthy ? try evaluate(right) : value
        case .or(let left, let right):
            let value = try evaluate(left)
            return value.truthy ? value : try evaluate(right)
        case .not(let operand):
            return .bool(!(try evaluate(operand).truthy))
        case .negate(let operand):
            let value = try evaluate(operand)
            try requireDefined(value, line: line)
            switch value.number {
            case .int(let number)?:
                guard number != Int.min else { throw ChatTemplateError.runtime("integer overflow", line: line) }
                return .int(-number)
            case .double(let number)?: return .double(-number)
            case nil: throw ChatTemplateError.runtime("bad operand type for unary -: '\(value.typeName)'", line: line)
            }
        case .plus(let operand):
            let value = try evaluate(operand)
            try requireDefined(value, line: line)
            switch value.number {
            case .int(let number)?: return .int(number)
            case .double(let number)?: return .double(number)
            case nil: throw ChatTemplateError.runtime("bad operand type for unary +: '\(value.typeName)'", line: line)
            }
        case .conditional(let test, let then, let otherwise):
            if try evaluate(test).truthy { return try evaluate(then) }
            guard let otherwise else { return .undefined(hint: "the inline if expression on line \(line) evaluated to false and no else section was defined") }
            return try evaluate(otherwise)
        case .test(let subject, let name, let arguments):
            let value = try evaluate(subject)
            return .bool(try Builtins.test(name, value, try arguments.map(evaluate), line: line))
        case .filter(let subject, let name, let arguments, let keywords):
            let value = try evaluate(subject)
            return try Builtins.filter(name, value, try arguments.map(evaluate),
                                       try keywords.map { ($0.0, try evaluate($0.1)) }, line: line)
        case .call(let callee, let arguments, let keywords):
            let positional = { try arguments.map(self.evaluate) }
            let named = { try keywords.map { ($0.0, try self.evaluate($0.1)) } }
            if case .attribute(let objectExpression, let name) = callee.kind {
                let object = try evaluate(objectExpression)
                try requireDefined(object, line: line)
                return try Builtins.method(name, of: object, try positional(), try named(), line: line)
            }
            let function = try evaluate(callee)
            switch function {
            case .function(let name): return try Builtins.function(name, try positional(), try named(), line: line)
            case .method(let object, let name): return try Builtins.method(name, of: object, try positional(), try named(), line: line)
            case .undefined(let hint): throw ChatTemplateError.runtime(hint, line: line)
            default: throw ChatTemplateError.runtime("'\(function.typeName)' object is not callable", line: line)
            }
        }
    }

    // MARK: access

    private func attribute(_ object: Value, _ name: String, line: Int) throws -> Value {
        switch object {
        case .undefined(let hint):
            throw ChatTemplateError.runtime(hint, line: line)
        case .dict(let map):
            if Builtins.dictMethods.contains(name) { return .method(object, name) }
            return map[name] ?? .undefined(hint: "'dict object' has no attribute '\(name)'")
        case .string:
            if Builtins.stringMethods.contains(name) { return .method(object, name) }
        case .namespace(let namespace):
            if let value = namespace.attributes[name] { return value }
        case .loop(let loop):
            switch name {
            case "index": return .int(loop.index0 + 1)
            case "index0": return .int(loop.index0)
            case "revindex": return .int(loop.length - loop.index0)
            case "revindex0": return .int(loop.length - loop.index0 - 1)
            case "first": return .bool(loop.index0 == 0)
            case "last": return .bool(loop.index0 == loop.length - 1)
            case "length": return .int(loop.length)
            case "depth": return .int(1)
            case "depth0": return .int(0)
            case "previtem":
                return loop.previous ?? .undefined(hint: "there is no previous item")
            case "nextitem":
                return loop.next ?? .undefined(hint: "there is no next item")
            default: break
            }
        default:
            break
        }
        return .undefined(hint: "'\(object.typeName) object' has no attribute '\(name)'")
    }

    private func item(_ object: Value, _ key: Value, line: Int) throws -> Value {
        let missing = Value.undefined(hint: "'\(object.typeName) object' has no item \(key.pythonRepr)")
        switch object {
        case .undefined(let hint):
            throw ChatTemplateError.runtime(hint, line: line)
        case .dict(let map):
            if case .string(let text) = key {
                if let value = map[text] { return value }
                if Builtins.dictMethods.contains(text) { return .method(object, text) }
            }
            return missing
        case .list(let items), .tuple(let items):
            guard case .int(let position)? = key.number, !key.isDouble else {
                if case .string(let name) = key { return try attribute(object, name, line: line) }
                return missing
            }
            let resolved = position < 0 ? position + items.count : position
            return resolved >= 0 && resolved < items.count ? items[resolved] : missing
        case .string(let text):
            guard case .int(let position)? = key.number, !key.isDouble else {
                if case .string(let name) = key { return try attribute(object, name, line: line) }
                return missing
            }
            let scalars = Array(text.unicodeScalars)
            let resolved = position < 0 ? position + scalars.count : position
            return resolved >= 0 && resolved < scalars.count ? .string(String(scalars[resolved])) : missing
        default:
            if case .string(let name) = key { return try attribute(object, name, line: line) }
            return missing
        }
    }

    private func slice(_ object: Value, _ start: Int?, _ stop: Int?, _ step: Int?, line: Int) throws -> Value {
        let step = step ?? 1
        guard step != 0 else { throw ChatTemplateError.runtime("slice step cannot be zero", line: line) }
        func indices(count: Int) -> [Int] {
            // Python's slice.indices.
            func clamp(_ value: Int?, default fallback: Int) -> Int {
                guard var value else { return fallback }
                if value < 0 {
                    value += count
                    if value < 0 { value = step < 0 ? -1 : 0 }
                } else if value >= count {
                    value = step < 0 ? count - 1 : count
                }
                return value
            }
            let first = clamp(start, default: step < 0 ? count - 1 : 0)
            let end = clamp(stop, default: step < 0 ? -1 : count)
            return Array(stride(from: first, to: end, by: step))
        }
        switch object {
        case .undefined(let hint): throw ChatTemplateError.runtime(hint, line: line)
        case .list(let items): return .list(indices(count: items.count).map { items[$0] })
        case .tuple(let items): return .tuple(indices(count: items.count).map { items[$0] })
        case .string(let text):
            let scalars = Array(text.unicodeScalars)
            var out = String.UnicodeScalarView()
            for index in indices(count: scalars.count) { out.append(scalars[index]) }
            return .string(String(out))
        default:
            throw ChatTemplateError.runtime("'\(object.typeName)' object is not subscriptable", line: line)
        }
    }

    // MARK: operators

    private func requireDefined(_ value: Value, line: Int) throws {
        if case .undefined(let hint) = value { throw ChatTemplateError.runtime(hint, line: line) }
    }

    private func binary(_ op: String, _ left: Value, _ right: Value, line: Int) throws -> Value {
        try requireDefined(left, line: line)
        try requireDefined(right, line: line)
        func unsupported() -> ChatTemplateError {
            .runtime("unsupported operand type(s) for \(op): '\(left.typeName)' and '\(right.typeName)'", line: line)
        }
        func overflow() -> ChatTemplateError { .runtime("integer overflow in \(op)", line: line) }
        if let a = left.number, let b = right.number {
            if case .int(let x) = a, case .int(let y) = b {
                switch op {
                case "+": let (r, o) = x.addingReportingOverflow(y); if o { throw overflow() }; return .int(r)
                case "-": let (r, o) = x.subtractingReportingOverflow(y); if o { throw overflow() }; return .int(r)
                case "*": let (r, o) = x.multipliedReportingOverflow(by: y); if o { throw overflow() }; return .int(r)
                case "/":
                    guard y != 0 else { throw ChatTemplateError.runtime("division by zero", line: line) }
                    return .double(Double(x) / Double(y))
                case "//", "%":
                    guard y != 0 else { throw ChatTemplateError.runtime("integer division or modulo by zero", line: line) }
                    if x == Int.min && y == -1 { throw overflow() }
                    var quotient = x / y
                    var remainder = x % y
                    if remainder != 0 && ((remainder < 0) != (y < 0)) {
                        quotient -= 1
                        remainder += y
                    }
                    return .int(op == "//" ? quotient : remainder)
                case "**":
                    if y < 0 { return .double(pow(Double(x), Double(y))) }
                    var result = 1
                    var base = x
                    var exponent = y
                    while exponent > 0 {
                        if exponent & 1 == 1 {
                            let (r, o) = result.multipliedReportingOverflow(by: base); if o { throw overflow() }; result = r
                        }
                        exponent >>= 1
                        if exponent > 0 { let (r, o) = base.multipliedReportingOverflow(by: base); if o { throw overflow() }; base = r }
                    }
                    return .int(result)
                default: throw unsupported()
                }
            }
            let x = a.double, y = b.double
            switch op {
            case "+": return .double(x + y)
            case "-": return .double(x - y)
            case "*": return .double(x * y)
            case "/":
                guard y != 0 else { throw ChatTemplateError.runtime("float division by zero", line: line) }
                return .double(x / y)
            case "//":
                guard y != 0 else { throw ChatTemplateError.runtime("float floor division by zero", line: line) }
                return .double(floorDivide(x, y))
            case "%":
                guard y != 0 else { throw ChatTemplateError.runtime("float modulo", line: line) }
                return .double(pythonModulo(x, y))
            case "**": return .double(pow(x, y))
            default: throw unsupported()
            }
        }
        switch (op, left, right) {
        case ("+", .string(let x), .string(let y)): return .string(x + y)
        case ("+", .list(let x), .list(let y)): return .list(x + y)
        case ("+", .tuple(let x), .tuple(let y)): return .tuple(x + y)
        case ("*", .string(let text), _), ("*", _, .string(let text)):
            guard case .int(let count)? = (left.isString ? right : left).number, !(left.isString ? right : left).isDouble else { throw unsupported() }
            return .string(String(repeating: text, count: max(0, count)))
        case ("*", .list(let items), _), ("*", _, .list(let items)):
            guard case .int(let count)? = (left.isList ? right : left).number, !(left.isList ? right : left).isDouble else { throw unsupported() }
            return .list(Array(repeatElement(items, count: max(0, count)).joined()))
        case ("%", .string, _):
            throw ChatTemplateError.runtime("printf-style % formatting of strings is not supported by museflash's renderer; "
                                            + "fix: use ~ or the replace filter", line: line)
        default:
            throw unsupported()
        }
    }

    private func floorDivide(_ x: Double, _ y: Double) -> Double {
        // Python's float floor division: (x - x % y) / y, rounded.
        let modulo = pythonModulo(x, y)
        var quotient = (x - modulo) / y
        if quotient != 0 {
            let floorQuotient = quotient.rounded(.down)
            if quotient - floorQuotient > 0.5 { quotient = floorQuotient + 1 } else { quotient = floorQuotient }
        } else {
            quotient = (x / y < 0) ? -0.0 : 0.0
        }
        return quotient
    }

    private func pythonModulo(_ x: Double, _ y: Double) -> Double {
        var modulo = fmod(x, y)
        if modulo != 0 {
            if (y < 0) != (modulo < 0) { modulo += y }
        } else {
            modulo = y < 0 ? -0.0 : 0.0
        }
        return modulo
    }

    private func compare(_ op: String, _ left: Value, _ right: Value, line: Int) throws -> Bool {
        switch op {
        case "==": return Builtins.equal(left, right)
        case "!=": return !Builtins.equal(left, right)
        case "in": return try Builtins.contains(right, left, line: line)
        case "notin": return !(try Builtins.contains(right, left, line: line))
        default:
            try requireDefined(left, line: line)
            try requireDefined(right, line: line)
            switch op {
            case "<": return try Builtins.less(left, right, op: op, line: line)
            case ">": return try Builtins.less(right, left, op: op, line: line)
            case "<=": return try !Builtins.less(right, left, op: op, line: line)
            default: return try !Builtins.less(left, right, op: op, line: line)
            }
        }
    }

    func iterate(_ value: Value, line: Int) throws -> [Value] {
        try Builtins.iterate(value, line: line)
    }
}

extension Value {
    var isDouble: Bool {
        if case .double = self { return true }
        return false
    }

    var isString: Bool {
        if case .string = self { return true }
        return false
    }

    var isList: Bool {
        if case .list = self { return true }
        return false
    }
}
