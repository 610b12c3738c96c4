// Writes the XCTMain list of a test module from the symbol graph the compiler emitted for it
// (swiftc -emit-symbol-graph), so the list is what the compiler sees, not what a text scan finds.
//
// usage: xctest_discovery MODULE SYMBOL_GRAPH_DIR OUTPUT_MAIN_SWIFT
//
// A test is an instance method whose base name starts with `test`, that takes no arguments and
// returns Void, on a class that inherits from XCTest.XCTestCase directly or through classes of the
// same module. Methods declared in extensions count (the graph lists them as members of the
// class); inherited test methods run again in every subclass, as XCTest does on Apple platforms.
// Fails, naming the methods, when a test could not be run rather than skipping it: a private or
// fileprivate test method, a test-named method on a class whose superclass comes from another
// module (it cannot be told to be an XCTestCase), or a module with no tests at all.
import Foundation

struct SymbolGraph: Decodable {
    struct Fragment: Decodable {
        var kind: String
        var spelling: String
    }

    struct Symbol: Decodable {
        struct Kind: Decodable { var identifier: String }
        struct Identifier: Decodable { var precise: String }
        struct Signature: Decodable {
            struct Parameter: Decodable { var name: String }
            var parameters: [Parameter]?
            var returns: [Fragment]?
        }
        struct Location: Decodable {
            struct Position: Decodable { var line: Int }
            var uri: String
            var position: Position
        }

        var kind: Kind
        var identifier: Identifier
        var pathComponents: [String]
        var accessLevel: String
        var functionSignature: Signature?
        var declarationFragments: [Fragment]?
        var location: Location?
    }

    struct Relationship: Decodable {
        var kind: String
        var source: String
        var target: String
        var targetFallback: String?
    }

    var symbols: [Symbol]
    var relationships: [Relationship]
}

struct DiscoveryError: Error, CustomStringConvertible {
    var description: String
}

struct TestMethod {
    var name: String
    var isAsync: Bool
}

struct TestCase {
    /// Swift spelling of the class, e.g. `Outer.InnerTests`.
    var typeName: String
    var methods: [TestMethod]
}

let xcTestCaseUSR = "s:6XCTest0A4CaseC"

func location(_ symbol: SymbolGraph.Symbol) -> String {
    guard let location = symbol.location else { return "" }
    let file = location.uri.hasPrefix("file://") ? String(location.uri.dropFirst("file://".count)) : location.uri
    return " (\(file):\(location.position.line + 1))"
}

/// `test...` instance methods taking no arguments and returning Void, whatever their access level.
func testShaped(_ symbol: SymbolGraph.Symbol) -> TestMethod? {
    guard symbol.kind.identifier == "swift.method", let title = symbol.pathComponents.last,
          title.hasPrefix("test"), title.hasSuffix("()"),
          (symbol.functionSignature?.parameters ?? []).isEmpty else { return nil }
    let returns = (symbol.functionSignature?.returns ?? []).map(\.spelling).joined()
    guard ["", "()", "Void", "Swift.Void"].contains(returns) else { return nil }
    let isAsync = (symbol.declarationFragments ?? []).contains { $0.kind == "keyword" && $0.spelling == "async" }
    return TestMethod(name: String(title.dropLast(2)), isAsync: isAsync)
}

func discover(_ graph: SymbolGraph, module: String) throws -> [TestCase] {
    let symbols = Dictionary(graph.symbols.map { ($0.identifier.precise, $0) }, uniquingKeysWith: { first, _ in first })
    var superclass: [String: (usr: String, fallback: String?)] = [:]
    var members: [String: [String]] = [:]
    for relationship in graph.relationships {
        switch relationship.kind {
        case "inheritsFrom": superclass[relationship.source] = (relationship.target, relationship.targetFallback)
        case "memberOf": members[relationship.target, default: []].append(relationship.source)
        default: break
        }
    }

    enum Ancestry { case testCase, notTestCase, unknown(String) }
    func ancestry(_ usr: String) -> Ancestry {
        var current = usr
        var seen: Set<String> = []
        while let parent = superclass[current], seen.insert(current).inserted {
            if parent.usr == xcTestCaseUSR || parent.fallback == "XCTest.XCTestCase" { return .testCase }
            guard symbols[parent.usr] != nil else { return .unknown(parent.fallback ?? parent.usr) }
            current = parent.usr
        }
        return .notTestCase
    }

    /// Own test-shaped methods first, then inherited ones a subclass does not override.
    func testMethods(of usr: String) -> [(method: TestMethod, symbol: SymbolGraph.Symbol)] {
        var found: [(method: TestMethod, symbol: SymbolGraph.Symbol)] = []
        var current: String? = usr
        while let classUSR = current, symbols[classUSR] != nil {
            for member in members[classUSR, default: []] {
                guard let symbol = symbols[member], let method = testShaped(symbol),
                      !found.contains(where: { $0.method.name == method.name }) else { continue }
                found.append((method, symbol))
            }
            current = superclass[classUSR]?.usr
        }
        return found
    }

    var cases: [TestCase] = []
    var problems: [String] = []
    for symbol in graph.symbols where symbol.kind.identifier == "swift.class" {
        let usr = symbol.identifier.precise
        let typeName = symbol.pathComponents.joined(separator: ".")
        let methods = testMethods(of: usr)
        switch ancestry(usr) {
        case .notTestCase:
            continue
        case .unknown(let parent):
            if !methods.isEmpty {
                problems.append("class \(typeName)\(location(symbol)) inherits from \(parent), which is declared in "
                                + "another module, and has test methods \(methods.map(\.method.name)); derive it from "
                                + "XCTestCase or from a base class in \(module)")
            }
        case .testCase:
            for (method, methodSymbol) in methods where ["private", "fileprivate"].contains(methodSymbol.accessLevel) {
                problems.append("\(typeName).\(method.name)\(location(methodSymbol)) is \(methodSymbol.accessLevel); "
                                + "make it internal so the test runner can call it, or rename it")
            }
            if !methods.isEmpty {
                cases.append(TestCase(typeName: typeName, methods: methods.map(\.method).sorted { $0.name < $1.name }))
            }
        }
    }
    if cases.isEmpty {
        problems.append("no XCTestCase subclass of \(module) has a test method")
    }
    guard problems.isEmpty else {
        throw DiscoveryError(description: problems.map { "xctest_discovery: \(module): \($0)" }.joined(separator: "\n"))
    }
    return cases.sorted { $0.typeName < $1.typeName }
}

func mainSource(module: String, cases: [TestCase]) -> String {
    let count = cases.reduce(0) { $0 + $1.methods.count }
    var lines = [
        "// Generated by //tools/swift:xctest_discovery from the symbol graph of \(module): "
            + "\(cases.count) test classes, \(count) test methods.",
        "import XCTest",
        "@testable import \(module)",
        "",
        "XCTMain([",
    ]
    for testCase in cases {
        lines.append("    testCase([")
        for method in testCase.methods {
            let reference = "\(testCase.typeName).\(method.name)"
            lines.append("        (\"\(method.name)\", \(method.isAsync ? "asyncTest(\(reference))" : reference)),")
        }
        lines.append("    ] as [(String, (\(testCase.typeName)) -> () throws -> Void)]),")
    }
    lines.append("])")
    return lines.joined(separator: "\n") + "\n"
}

func run(_ arguments: [String]) throws {
    guard arguments.count == 3 else {
        throw DiscoveryError(description: "usage: xctest_discovery MODULE SYMBOL_GRAPH_DIR OUTPUT_MAIN_SWIFT")
    }
    let (module, directory, output) = (arguments[0], arguments[1], arguments[2])
    let graphURL = URL(fileURLWithPath: directory).appendingPathComponent("\(module).symbols.json")
    let graph = try JSONDecoder().decode(SymbolGraph.self, from: Data(contentsOf: graphURL))
    let cases = try discover(graph, module: module)
    try Data(mainSource(module: module, cases: cases).utf8).write(to: URL(fileURLWithPath: output))
}

do {
    try run(Array(CommandLine.arguments.dropFirst()))
} catch {
    FileHandle.standardError.write(Data("\(error)\n".utf8))
    exit(1)
}
