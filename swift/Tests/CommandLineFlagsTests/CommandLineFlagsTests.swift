import CommandLineFlags
import XCTest

final class CommandLineFlagsTests: XCTestCase {
    /// Every flag and the value each took, as a tool's loop reads them.
    private func read(_ arguments: [String], valued: Set<String> = ["--a", "--b"],
                      lists: Set<String> = []) throws -> [String] {
        var flags = CommandLineFlags(arguments, suffix: " (see --help)")
        var seen: [String] = []
        while let flag = try flags.next() {
            if valued.contains(flag) {
                seen.append("\(flag)=\(try flags.value(of: flag))")
            } else if lists.contains(flag) {
                seen.append("\(flag)=\(flags.values(of: flag).joined(separator: "|"))")
            } else {
                seen.append(flag)
            }
        }
        return seen
    }

    private func failure(_ arguments: [String]) -> String? {
        do {
            _ = try read(arguments)
            return nil
        } catch let failure as CommandLineFlags.Failure {
            return failure.description
        } catch {
            return "unexpected \(error)"
        }
    }

    func testBothSpellingsGiveTheSameValues() throws {
        XCTAssertEqual(try read(["--a", "1", "--b", "x=y"]), ["--a=1", "--b=x=y"])
        XCTAssertEqual(try read(["--a=1", "--b=x=y"]), ["--a=1", "--b=x=y"])
        XCTAssertEqual(try read(["--a=", "--flag"]), ["--a=", "--flag"])
    }

    func testAValueIsTakenAsGivenEvenWhenItLooksLikeAFlag() throws {
        XCTAssertEqual(try read(["--a", "--b=2", "--c"]), ["--a=--b=2", "--c"])
    }

    /// A failure names the flag, what was wrong and the tool's suffix (the wording is free).
    private func assertNames(_ message: String?, _ parts: [String], line: UInt = #line) {
        guard let message else { return XCTFail("no failure", line: line) }
        for part in parts + ["(see --help)"] {
            XCTAssertTrue(message.contains(part), "\(message) lacks \(part)", line: line)
        }
        XCTAssertTrue(message.hasSuffix("(see --help)"), message, line: line)
    }

    func testAFlagWithoutValueRefusesOne() {
        assertNames(failure(["--no-draft=1"]), ["--no-draft", "\"1\"", "no value"])
        assertNames(failure(["--no-draft=1", "--a", "2"]), ["--no-draft", "\"1\""])
    }

    func testAMissingValueIsNamed() {
        assertNames(failure(["--b", "1", "--a"]), ["--a ", "needs a value"])
    }

    func testAListRunsToTheNextFlag() throws {
        XCTAssertEqual(try read(["--files", "p", "q", "--a", "1"], lists: ["--files"]), ["--files=p|q", "--a=1"])
        XCTAssertEqual(try read(["--files=p", "q"], lists: ["--files"]), ["--files=p|q"])
        XCTAssertEqual(try read(["--files", "--a", "1"], lists: ["--files"]), ["--files=", "--a=1"])
    }

    func testNumbersAreChecked() throws {
        var flags = CommandLineFlags(["--n=7", "--t", "0.5", "--n", "seven", "--t", "inf"])
        XCTAssertEqual(try flags.next(), "--n")
        XCTAssertEqual(try flags.integer(of: "--n"), 7)
        XCTAssertEqual(try flags.next(), "--t")
        XCTAssertEqual(try flags.number(of: "--t"), 0.5)
        XCTAssertEqual(try flags.next(), "--n")
        XCTAssertThrowsError(try flags.integer(of: "--n")) {
            XCTAssertTrue("\($0)".contains("--n") && "\($0)".contains("\"seven\""), "\($0)")
        }
        XCTAssertEqual(try flags.next(), "--t")
        XCTAssertThrowsError(try flags.number(of: "--t")) {
            XCTAssertTrue("\($0)".contains("--t") && "\($0)".contains("\"inf\""), "\($0)")
        }
        XCTAssertNil(try flags.next())
    }
}
