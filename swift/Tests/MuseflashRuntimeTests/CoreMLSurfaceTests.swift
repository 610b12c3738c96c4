import Foundation
import XCTest

/// CoreMLStandIn's public declarations, read from its sources, against the list the project
/// keeps from Apple's documentation (swift/Tests/CoreMLSurface/apple-coreml-surface.txt): every
/// declaration the stand-in makes public must be there with the same spelling and availability,
/// so the backend that compiles against it here compiles against Core ML on a Mac.
final class CoreMLSurfaceTests: XCTestCase {
    static let swiftRoot = URL(fileURLWithPath: #filePath).deletingLastPathComponent()
        .deletingLastPathComponent().deletingLastPathComponent()

    struct Declaration: Hashable, CustomStringConvertible {
        let type: String
        let text: String
        let availability: String
        var description: String { "\(type) | \(text) | \(availability)" }
    }

    /// Public declarations of Swift `source`, normalised to Apple's spelling: stored `let`s read
    /// as `{ get }`, settable `var`s as `{ get set }`, bodies dropped.
    static func declarations(in source: String) -> [Declaration] {
        var result: [Declaration] = []
        var type = "-", typeAvailability = "", isPublicType = false, isProtocol = false, isEnum = false
        var availability: String?
        var lines = source.components(separatedBy: "\n")[...]
        while let raw = lines.popFirst() {
            var line = raw
            // A declaration whose parameters continue on the next lines.
            while line.filter({ $0 == "(" }).count > line.filter({ $0 == ")" }).count, let next = lines.popFirst() {
                line += " " + next.trimmingCharacters(in: .whitespaces)
            }
            let trimmed = line.trimmingCharacters(in: .whitespaces)
            if trimmed.hasPrefix("@available(") {
                availability = String(trimmed.dropFirst("@available(".count).dropLast()).replacingOccurrences(of: ", *", with: "")
                continue
            }
            if line == "}" { (type, isPublicType, isProtocol, isEnum) = ("-", false, false, false); continue }
            if !line.hasPrefix(" "), let match = trimmed.firstMatch(of: #/^(public )?(final )?(class|enum|protocol|struct|extension) (\w+)/#) {
                isPublicType = match.1 != nil
                isProtocol = match.3 == "protocol"
                isEnum = match.3 == "enum"
                if isPublicType {
                    typeAvailability = availability ?? "none"
                    result.append(Declaration(type: "-", text: "\(match.3) \(match.4)", availability: typeAvailability))
                }
                type = String(match.4)
                availability = nil
                continue
            }
            // An enum's own cases, not a switch's inside a member.
            let isCase = isPublicType && isEnum && line.hasPrefix("    case ")
            let isRequirement = isProtocol && (trimmed.hasPrefix("var ") || trimmed.hasPrefix("func "))
            guard trimmed.hasPrefix("public ") || isCase || isRequirement else {
                if !trimmed.isEmpty && !trimmed.hasPrefix("//") { availability = nil }
                continue
            }
            let given = availability ?? (isCase ? typeAvailability : "none")
            availability = nil
            result.append(Declaration(type: type, text: normalised(trimmed), availability: given))
        }
        return result
    }

    static func normalised(_ declaration: String) -> String {
        var text = declaration.replacingOccurrences(of: "public ", with: "").replacingOccurrences(of: "final ", with: "")
        text = text.replacingOccurrences(of: #"\s+"#, with: " ", options: .regularExpression)
        let readOnly = text.hasPrefix("private(set) ") || text.hasPrefix("let ")
        text = text.replacingOccurrences(of: "private(set) ", with: "")
        if text.hasPrefix("let ") || text.hasPrefix("var ") || text.hasPrefix("static var ") {
            if text.hasSuffix("{ get }") || text.hasSuffix("{ get set }") { return text }
            let computed = text.contains(" {")
            var head = text.components(separatedBy: " {")[0].components(separatedBy: " = ")[0]
            if head.hasPrefix("let ") { head = "var " + head.dropFirst(4) }
            return head + (readOnly || computed ? " { get }" : " { get set }")
        }
        if text.hasPrefix("case ") { return text }
        // A type constant as Apple spells it: its type, not its value.
        if text.hasPrefix("static let ") { return text.components(separatedBy: " = ")[0] }
        return text.components(separatedBy: " {")[0]
    }

    static func standInDeclarations() throws -> [Declaration] {
        let directory = swiftRoot.appendingPathComponent("Sources/CoreMLStandIn")
        let files = try FileManager.default.contentsOfDirectory(atPath: directory.path).filter { $0.hasSuffix(".swift") }.sorted()
        XCTAssertFalse(files.isEmpty, "no stand-in sources under \(directory.path)")
        return try files.flatMap { declarations(in: try String(contentsOf: directory.appendingPathComponent($0), encoding: .utf8)) }
    }

    static func appleList() throws -> Set<Declaration> {
        let url = swiftRoot.appendingPathComponent("Tests/CoreMLSurface/apple-coreml-surface.txt")
        let lines = try String(contentsOf: url, encoding: .utf8).components(separatedBy: "\n")
        return Set(lines.compactMap { line -> Declaration? in
            guard !line.hasPrefix("#"), !line.trimmingCharacters(in: .whitespaces).isEmpty else { return nil }
            let parts = line.components(separatedBy: " | ")
            guard parts.count == 3 else { return nil }
            return Declaration(type: parts[0], text: parts[1], availability: parts[2])
        })
    }

    func testEveryStandInDeclarationIsApplesWithItsAvailability() throws {
        let standIn = try Self.standInDeclarations()
        let apple = try Self.appleList()
        XCTAssertGreaterThan(standIn.count, 40, "too few declarations read: the reader is broken")
        let foreign = standIn.filter { !apple.contains($0) }
        XCTAssertEqual(foreign, [], "declared by the stand-in but not as Apple documents them:\n" + foreign.map(\.description).joined(separator: "\n"))
    }

    /// The highest availability the stand-in states is what Package.swift's platforms must give.
    func testThePackagePlatformsCoverEveryStandInDeclaration() throws {
        func version(_ availability: String, _ platform: String) -> [Int] {
            guard let range = availability.range(of: "\(platform) ") else { return [0] }
            return availability[range.upperBound...].prefix { $0.isNumber || $0 == "." }.split(separator: ".").map { Int($0)! }
        }
        let all = try Self.standInDeclarations().map(\.availability).filter { $0 != "none" }
        XCTAssertEqual(all.map { version($0, "macOS") }.max { $0.lexicographicallyPrecedes($1) }, [15, 0])
        XCTAssertEqual(all.map { version($0, "iOS") }.max { $0.lexicographicallyPrecedes($1) }, [18, 0])
    }

    /// The reader sees what it must: a declaration with another spelling or availability.
    func testTheReaderSeesAChangedDeclaration() throws {
        let source = """
        @available(macOS 10.13, iOS 11.0, *)
        public final class MLModel: @unchecked Sendable {
            @available(macOS 15.0, iOS 18.0, *)
            public func makeState() -> MLState {
                MLState()
            }
            @available(macOS 10.13, iOS 11.0, *)
            public let modelDescription: MLModelDescription
            @available(macOS 10.14, iOS 12.0, *)
            public var computeUnits: MLComputeUnits = .all
        }
        """
        let read = Self.declarations(in: source)
        XCTAssertEqual(read.map(\.description), [
            "- | class MLModel | macOS 10.13, iOS 11.0",
            "MLModel | func makeState() -> MLState | macOS 15.0, iOS 18.0",
            "MLModel | var modelDescription: MLModelDescription { get } | macOS 10.13, iOS 11.0",
            "MLModel | var computeUnits: MLComputeUnits { get set } | macOS 10.14, iOS 12.0",
        ])
        let apple = try Self.appleList()
        XCTAssertTrue(apple.contains(read[1]))
        let older = Self.declarations(in: source.replacingOccurrences(of: "macOS 15.0, iOS 18.0", with: "macOS 14.0, iOS 17.0"))
        XCTAssertFalse(apple.contains(older[1]), "an availability Apple does not give must not pass")
    }
}
