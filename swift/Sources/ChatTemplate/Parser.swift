/// The template as statements and expressions, parsed with jinja2's grammar and precedence;
/// anything outside the supported subset is refused here, naming it.

/// What the renderer implements; python/museflash/checkpoint/chat_template.py mirrors these lists.
enum Supported {
    static let filters: Set<String> = [
        "capitalize", "count", "d", "default", "first", "int", "items", "join", "last", "length", "list",
        "lower", "replace", "reverse", "safe", "string", "title", "tojson", "trim", "upper",
    ]
    static let tests: Set<String> = [
        "boolean", "defined", "even", "false", "float", "integer", "iterable", "mapping", "none", "number",
        "odd", "sequence", "string", "true", "undefined",
    ]
    static let functions: Set<String> = ["namespace", "raise_exception", "range"]
    static let methods: Set<String> = [
        "endswith", "get", "items", "keys", "lower", "lstrip", "replace", "rstrip", "split", "startswith",
        "strip", "title", "upper", "values",
    ]
    /// Jinja tags outside the subset, refused by name.
    static let refusedTags: Set<String> = [
        "macro", "call", "filter", "include", "import", "from", "extends", "block", "with", "autoescape",
        "do", "break", "continue", "trans", "pluralize",
    ]
}

final class Expr {
    indirect enum Kind {
        case constant(Value)
        case name(String)
        case list([Expr])
        case tuple([Expr])
        case dict([(Expr, Expr)])
        case attribute(Expr, String)
        case item(Expr, Expr)
        case slice(Expr, Expr?, Expr?, Expr?)
        /// + - * / // % **
        case binary(String, Expr, Expr)
        case concat([Expr])
        /// == != < <= > >= in notin, chained as in Python.
        case compare(Expr, [(String, Expr)])
        case and(Expr, Expr)
        case or(Expr, Expr)
        case not(Expr)
        case negate(Expr)
        case plus(Expr)
        case conditional(test: Expr, then: Expr, otherwise: Expr?)
        case test(Expr, String, [Expr])
        case filter(Expr, String, [Expr], [(String, Expr)])
        case call(Expr, [Expr], [(String, Expr)])
    }

    let kind: Kind
    let line: Int

    init(_ kind: Kind, line: Int) {
        self.kind = kind
        self.line = line
    }
}

indirect enum Target {
    case name(String)
    case attribute(String, String)
    case tuple([Target])
}

indirect enum Statement {
    case text(String)
    case output(Expr)
    case forLoop(target: Target, iterable: Expr, condition: Expr?, body: [Statement], otherwise: [Statement], line: Int)
    case conditional(branches: [(Expr, [Statement])], otherwise: [Statement])
    case assign(Target, Expr, line: Int)
}

struct Parser {
    private let tokens: [Token]
    private var index = 0

    static func parse(_ tokens: [Token]) throws -> [Statement] {
        var parser = Parser(tokens: tokens)
        let (body, end) = try parser.statements(until: [])
        if let end { throw ChatTemplateError.syntax("unexpected {% \(end) %}", line: parser.line) }
        return body
    }

    private init(tokens: [Token]) { self.tokens = tokens }

    private var current: TokenKind? { index < tokens.count ? tokens[index].kind : nil }
    private var line: Int { index < tokens.count ? tokens[index].line : (tokens.last?.line ?? 1) }

    private func look(_ offset: Int = 1) -> TokenKind? {
        index + offset < tokens.count ? tokens[index + offset].kind : nil
    }

    private func isName(_ word: String, _ kind: TokenKind? = nil) -> Bool {
        if case .name(let name) = kind ?? current { return name == word }
        return false
    }

    private func isOp(_ op: String, _ kind: TokenKind? = nil) -> Bool {
        if case .op(let text) = kind ?? current { return text == op }
        return false
    }

    private mutating func skipName(_ word: String) -> Bool {
        guard isName(word) else { return false }
        index += 1
        return true
    }

    private mutating func skipOp(_ op: String) -> Bool {
        guard isOp(op) else { return false }
        index += 1
        return true
    }

    private func describe(_ kind: TokenKind?) -> String {
        switch kind {
        case nil: return "end of template"
        case .data: return "template data"
        case .variableBegin: return "'{{'"
        case .variableEnd: return "'}}'"
        case .blockBegin: return "'{%'"
        case .blockEnd: return "'%}'"
        case .name(let name): return "'\(name)'"
        case .string: return "a string"
        case .integer(let value): return "'\(value)'"
        case .float(let value): return "'\(value)'"
        case .op(let op): return "'\(op)'"
        }
    }

    private func fail(_ expected: String) -> ChatTemplateError {
        .syntax("expected \(expected), got \(describe(current))", line: line)
    }

    private mutating func expectOp(_ op: String) throws {
        guard skipOp(op) else { throw fail("'\(op)'") }
    }

    private mutating func expectName() throws -> String {
        guard case .name(let name) = current else { throw fail("a name") }
        index += 1
        return name
    }

    private mutating func expectBlockEnd() throws {
        guard current == .blockEnd else { throw fail("'%}'") }
        index += 1
    }

    // MARK: statements

    /// Statements up to a block tag named in `ends` (left unread but for its `{%`), or the end.
    private mutating func statements(until ends: Set<String>) throws -> ([Statement], String?) {
        var body: [Statement] = []
        while let kind = current {
            switch kind {
            case .data(let text):
                body.append(.text(text))
                index += 1
            case .variableBegin:
                index += 1
                let expression = try tuple(conditional: true)
                guard current == .variableEnd else { throw fail("'}}'") }
                index += 1
                body.append(.output(expression))
            case .blockBegin:
                let tagLine = tokens[index].line
                index += 1
                guard case .name(let tag) = current else { throw fail("a tag name") }
                if ends.contains(tag) { return (body, tag) }
                index += 1
                switch tag {
                case "for": body.append(try forLoop(line: tagLine))
                case "if": body.append(try conditional())
                case "set": body.append(try assignment(line: tagLine))
                default:
                    if Supported.refusedTags.contains(tag) {
                        throw ChatTemplateError.unsupported("{% \(tag) %}", line: tagLine)
                    }
                    throw ChatTemplateError.syntax("unknown tag {% \(tag) %}", line: tagLine)
                }
            default:
                throw ChatTemplateError.syntax("unexpected \(describe(kind))", line: line)
            }
        }
        return (body, nil)
    }

    private mutating func forLoop(line tagLine: Int) throws -> Statement {
        let target = try assignTarget(extraEnd: "in")
        guard skipName("in") else { throw fail("'in'") }
        let iterable = try tuple(conditional: false, extraEnd: "recursive")
        var condition: Expr?
        if skipName("if") { condition = try expression(conditional: true) }
        if isName("recursive") { throw ChatTemplateError.unsupported("{% for ... recursive %}", line: line) }
        try expectBlockEnd()
        let (body, end) = try statements(until: ["endfor", "else"])
        var otherwise: [Statement] = []
        guard let end else { throw ChatTemplateError.syntax("{% for %} without {% endfor %}", line: tagLine) }
        index += 1
        try expectBlockEnd()
        if end == "else" {
            let (elseBody, close) = try statements(until: ["endfor"])
            guard close != nil else { throw ChatTemplateError.syntax("{% for %} without {% endfor %}", line: tagLine) }
            index += 1
            try expectBlockEnd()
            otherwise = elseBody
        }
        return .forLoop(target: target, iterable: iterable, condition: condition, body: body, otherwise: otherwise, line: tagLine)
    }

    private mutating func conditional() throws -> Statement {
        let openLine = line
        var branches: [(Expr, [Statement])] = []
        var test = try tuple(conditional: false)
        while true {
            try expectBlockEnd()
            let (body, end) = try statements(until: ["elif", "else", "endif"])
            branches.append((test, body))
            guard let end else { throw ChatTemplateError.syntax("{% if %} without {% endif %}", line: openLine) }
            index += 1
            switch end {
            case "elif":
                test = try tuple(conditional: false)
            case "else":
                try expectBlockEnd()
                let (elseBody, close) = try statements(until: ["endif"])
                guard close != nil else { throw ChatTemplateError.syntax("{% if %} without {% endif %}", line: openLine) }
                index += 1
                try expectBlockEnd()
                return .conditional(branches: branches, otherwise: elseBody)
            default:
                try expectBlockEnd()
                return .conditional(branches: branches, otherwise: [])
            }
        }
    }

    private mutating func assignment(line tagLine: Int) throws -> Statement {
        let target: Target
        if case .name(let name) = current, isOp(".", look()) {
            index += 2
            target = .attribute(name, try expectName())
        } else {
            target = try assignTarget(extraEnd: nil)
        }
        guard skipOp("=") else {
            if current == .blockEnd { throw ChatTemplateError.unsupported("{% set %} block", line: tagLine) }
            throw fail("'='")
        }
        let value = try tuple(conditional: true)
        try expectBlockEnd()
        return .assign(target, value, line: tagLine)
    }

    /// A name, or names separated by commas (optionally parenthesised), as a loop or set target.
    private mutating func assignTarget(extraEnd: String?) throws -> Target {
        func one(_ parser: inout Parser) throws -> Target {
            if parser.skipOp("(") {
                let inner = try parser.assignTarget(extraEnd: nil)
                try parser.expectOp(")")
                return inner
            }
            let name = try parser.expectName()
            guard !["true", "false", "True", "False", "none", "None"].contains(name) else {
                throw ChatTemplateError.syntax("cannot assign to \(name)", line: parser.line)
            }
            return .name(name)
        }
        var targets = [try one(&self)]
        var isTuple = false
        while skipOp(",") {
            isTuple = true
            if current == .blockEnd || isOp(")") || isOp("=") || (extraEnd.map { isName($0) } ?? false) { break }
            targets.append(try one(&self))
        }
        return isTuple ? .tuple(targets) : targets[0]
    }

    // MARK: expressions

    private func isTupleEnd(_ extraEnd: String?) -> Bool {
        if current == .variableEnd || current == .blockEnd || isOp(")") { return true }
        if let extraEnd, isName(extraEnd) { return true }
        return false
    }

    /// jinja2's parse_tuple: one expression, or a tuple of comma-separated ones.
    private mutating func tuple(conditional: Bool, extraEnd: String? = nil, explicitParentheses: Bool = false) throws -> Expr {
        let startLine = line
        var items: [Expr] = []
        var isTuple = false
        while true {
            if !items.isEmpty { try expectOp(",") }
            if isTupleEnd(extraEnd) { break }
            items.append(try expression(conditional: conditional))
            if isOp(",") { isTuple = true } else { break }
        }
        if !isTuple {
            if let only = items.first { return only }
            if !explicitParentheses { throw fail("an expression") }
        }
        return Expr(.tuple(items), line: startLine)
    }

    private mutating func expression(conditional: Bool) throws -> Expr {
        guard conditional else { return try or() }
        var node = try or()
        while isName("if") {
            let ifLine = line
            index += 1
            let test = try or()
            var otherwise: Expr?
            if skipName("else") { otherwise = try expression(conditional: true) }
            node = Expr(.conditional(test: test, then: node, otherwise: otherwise), line: ifLine)
        }
        return node
    }

    private mutating func or() throws -> Expr {
        var left = try and()
        while isName("or") {
            let opLine = line
            index += 1
            left = Expr(.or(left, try and()), line: opLine)
        }
        return left
    }

    private mutating func and() throws -> Expr {
        var left = try not()
        while isName("and") {
            let opLine = line
            index += 1
            left = Expr(.and(left, try not()), line: opLine)
        }
        return left
    }

    private mutating func not() throws -> Expr {
        if isName("not") {
            let opLine = line
            index += 1
            return Expr(.not(try not()), line: opLine)
        }
        return try compare()
    }

    private mutating func compare() throws -> Expr {
        let startLine = line
        let first = try math1()
        var operations: [(String, Expr)] = []
        while true {
            if case .op(let op) = current, ["==", "!=", "<", "<=", ">", ">="].contains(op) {
                index += 1
                operations.append((op, try math1()))
            } else if skipName("in") {
                operations.append(("in", try math1()))
            } else if isName("not"), isName("in", look()) {
                index += 2
                operations.append(("notin", try math1()))
            } else {
                break
            }
        }
        return operations.isEmpty ? first : Expr(.compare(first, operations), line: startLine)
    }

    private mutating func math1() throws -> Expr {
        var left = try concat()
        while case .op(let op) = current, op == "+" || op == "-" {
            let opLine = line
            index += 1
            left = Expr(.binary(op, left, try concat()), line: opLine)
        }
        return left
    }

    private mutating func concat() throws -> Expr {
        let startLine = line
        var items = [try math2()]
        while skipOp("~") { items.append(try math2()) }
        return items.count == 1 ? items[0] : Expr(.concat(items), line: startLine)
    }

    private mutating func math2() throws -> Expr {
        var left = try power()
        while case .op(let op) = current, ["*", "/", "//", "%"].contains(op) {
            let opLine = line
            index += 1
            left = Expr(.binary(op, left, try power()), line: opLine)
        }
        return left
    }

    private mutating func power() throws -> Expr {
        var left = try unary(withFilter: true)
        while isOp("**") {
            let opLine = line
            index += 1
            left = Expr(.binary("**", left, try unary(withFilter: true)), line: opLine)
        }
        return left
    }

    private mutating func unary(withFilter: Bool) throws -> Expr {
        let startLine = line
        var node: Expr
        if skipOp("-") {
            node = Expr(.negate(try unary(withFilter: false)), line: startLine)
        } else if skipOp("+") {
            node = Expr(.plus(try unary(withFilter: false)), line: startLine)
        } else {
            node = try primary()
        }
        node = try postfix(node)
        if withFilter { node = try filterExpression(node) }
        return node
    }

    private mutating func primary() throws -> Expr {
        let startLine = line
        switch current {
        case .name(let name):
            index += 1
            switch name {
            case "true", "True": return Expr(.constant(.bool(true)), line: startLine)
            case "false", "False": return Expr(.constant(.bool(false)), line: startLine)
            case "none", "None": return Expr(.constant(.none), line: startLine)
            default: return Expr(.name(name), line: startLine)
            }
        case .string(let text):
            index += 1
            var joined = text
            while case .string(let more) = current {
                joined += more
                index += 1
            }
            return Expr(.constant(.string(joined)), line: startLine)
        case .integer(let value):
            index += 1
            return Expr(.constant(.int(value)), line: startLine)
        case .float(let value):
            index += 1
            return Expr(.constant(.double(value)), line: startLine)
        case .op("("):
            index += 1
            let node = try tuple(conditional: true, explicitParentheses: true)
            try expectOp(")")
            return node
        case .op("["):
            index += 1
            var items: [Expr] = []
            while !isOp("]") {
                if !items.isEmpty { try expectOp(",") }
                if isOp("]") { break }
                items.append(try expression(conditional: true))
            }
            try expectOp("]")
            return Expr(.list(items), line: startLine)
        case .op("{"):
            index += 1
            var pairs: [(Expr, Expr)] = []
            while !isOp("}") {
                if !pairs.isEmpty { try expectOp(",") }
                if isOp("}") { break }
                let key = try expression(conditional: true)
                try expectOp(":")
                pairs.append((key, try expression(conditional: true)))
            }
            try expectOp("}")
            return Expr(.dict(pairs), line: startLine)
        default:
            throw ChatTemplateError.syntax("unexpected \(describe(current))", line: startLine)
        }
    }

    private mutating func postfix(_ start: Expr) throws -> Expr {
        var node = start
        while true {
            if isOp(".") || isOp("[") {
                node = try subscripted(node)
            } else if isOp("(") {
                node = try call(node)
            } else {
                return node
            }
        }
    }

    private mutating func filterExpression(_ start: Expr) throws -> Expr {
        var node = start
        while true {
            if isOp("|") {
                node = try filter(node)
            } else if isName("is") {
                node = try test(node)
            } else if isOp("(") {
                node = try call(node)
            } else {
                return node
            }
        }
    }

    private mutating func subscripted(_ node: Expr) throws -> Expr {
        let startLine = line
        if skipOp(".") {
            switch current {
            case .name(let name):
                index += 1
                return Expr(.attribute(node, name), line: startLine)
            case .integer(let value):
                index += 1
                return Expr(.item(node, Expr(.constant(.int(value)), line: startLine)), line: startLine)
            default:
                throw fail("a name after '.'")
            }
        }
        try expectOp("[")
        var arguments: [Expr] = []
        var sliceArguments: (Expr?, Expr?, Expr?)?
        while !isOp("]") {
            if !arguments.isEmpty || sliceArguments != nil { try expectOp(",") }
            // jinja2's parse_subscribed: an expression, or start:stop:step with any part left out.
            var start: Expr?
            if !isOp(":") {
                let expression = try expression(conditional: true)
                if !isOp(":") {
                    arguments.append(expression)
                    continue
                }
                start = expression
            }
            index += 1  // the first ':'
            var stop: Expr?
            if !isOp(":") && !isOp("]") && !isOp(",") { stop = try expression(conditional: true) }
            var step: Expr?
            if skipOp(":") {
                if !isOp("]") && !isOp(",") { step = try expression(conditional: true) }
            }
            sliceArguments = (start, stop, step)
        }
        try expectOp("]")
        if let (start, stop, step) = sliceArguments {
            guard arguments.isEmpty else { throw ChatTemplateError.unsupported("a subscript with several slices", line: startLine) }
            return Expr(.slice(node, start, stop, step), line: startLine)
        }
        guard !arguments.isEmpty else { throw fail("a subscript") }
        let key = arguments.count == 1 ? arguments[0] : Expr(.tuple(arguments), line: startLine)
        return Expr(.item(node, key), line: startLine)
    }

    /// `(args, name=value)` of a call, filter or test.
    private mutating func callArguments() throws -> ([Expr], [(String, Expr)]) {
        try expectOp("(")
        var arguments: [Expr] = []
        var keywords: [(String, Expr)] = []
        var needComma = false
        while !isOp(")") {
            if needComma {
                try expectOp(",")
                if isOp(")") { break }
            }
            if isOp("*") || isOp("**") {
                throw ChatTemplateError.unsupported("*args or **kwargs in a call", line: line)
            }
            if case .name(let key) = current, isOp("=", look()) {
                index += 2
                keywords.append((key, try expression(conditional: true)))
            } else {
                guard keywords.isEmpty else {
                    throw ChatTemplateError.syntax("a positional argument after a keyword argument", line: line)
                }
                arguments.append(try expression(conditional: true))
            }
            needComma = true
        }
        try expectOp(")")
        return (arguments, keywords)
    }

    private mutating func call(_ callee: Expr) throws -> Expr {
        let startLine = line
        switch callee.kind {
        case .name(let name):
            guard Supported.functions.contains(name) else {
                throw ChatTemplateError.unsupported("function \(name)()", line: startLine)
            }
        case .attribute(_, let name):
            guard Supported.methods.contains(name) else {
                throw ChatTemplateError.unsupported("method .\(name)()", line: startLine)
            }
        default:
            throw ChatTemplateError.unsupported("a call of a computed value", line: startLine)
        }
        let (arguments, keywords) = try callArguments()
        return Expr(.call(callee, arguments, keywords), line: startLine)
    }

    private mutating func filter(_ start: Expr) throws -> Expr {
        var node = start
        while skipOp("|") {
            let startLine = line
            var name = try expectName()
            while skipOp(".") { name += "." + (try expectName()) }
            guard Supported.filters.contains(name) else {
                throw ChatTemplateError.unsupported("filter \(name)", line: startLine)
            }
            var arguments: [Expr] = []
            var keywords: [(String, Expr)] = []
            if isOp("(") { (arguments, keywords) = try callArguments() }
            node = Expr(.filter(node, name, arguments, keywords), line: startLine)
        }
        return node
    }

    private mutating func test(_ subject: Expr) throws -> Expr {
        let startLine = line
        index += 1  // 'is'
        let negated = skipName("not")
        var name = try expectName()
        while skipOp(".") { name += "." + (try expectName()) }
        guard Supported.tests.contains(name) else {
            throw ChatTemplateError.unsupported("test \(name)", line: startLine)
        }
        var arguments: [Expr] = []
        if isOp("(") {
            let (positional, keywords) = try callArguments()
            guard keywords.isEmpty else { throw ChatTemplateError.runtime("test \(name) takes no keyword arguments", line: startLine) }
            arguments = positional
        } else if let kind = current, !isName("else", kind), !isName("or", kind), !isName("and", kind) {
            var startsPrimary = false
            switch kind {
            case .name, .string, .integer, .float: startsPrimary = true
            case .op(let op): startsPrimary = op == "(" || op == "[" || op == "{"
            default: break
            }
            if startsPrimary {
                if isName("is") { throw ChatTemplateError.syntax("you cannot chain multiple tests with is", line: line) }
                arguments = [try postfix(try primary())]
            }
        }
        let node = Expr(.test(subject, name, arguments), line: startLine)
        return negated ? Expr(.not(node), line: startLine) : node
    }
}
