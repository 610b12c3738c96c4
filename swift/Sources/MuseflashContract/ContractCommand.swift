import CommandLineFlags
import Foundation

/// The `check-contract` command line, kept in the library so tests can run it
/// in-process; the executable only forwards to `run` and exits.
public enum ContractCommand {
    public struct Outcome: Equatable, Sendable {
        /// 0: every property holds; 1: violations; 2: bad usage or unreadable input.
        public var status: Int32
        public var standardOutput: String
        public var standardError: String
    }

    public static let usage = """
        usage: check-contract --export-dir DIR

        Checks a museflash export directory (metadata.json plus its .mlpackage bundles) against
        the device-side contract and prints one PASS/FAIL line per property.

          --export-dir DIR  the export directory; a relative path resolves against
                            $BUILD_WORKING_DIRECTORY when set (bazel run), else the current directory
          -h, --help        show this help

        Exit status: 0 all properties hold, 1 some property fails, 2 bad usage or unreadable input.
        """

    public static func run(arguments: [String], environment: [String: String],
                           currentDirectory: String = FileManager.default.currentDirectoryPath,
                           checker: ContractChecker = ContractChecker()) -> Outcome {
        var exportDirectory: String?
        var flags = CommandLineFlags(arguments)
        do {
            while let argument = try flags.next() {
                switch argument {
                case "-h", "--help":
                    return Outcome(status: 0, standardOutput: usage + "\n", standardError: "")
                case "--export-dir":
                    exportDirectory = try flags.value(of: argument)
                default:
                    return usageError("unexpected argument \(argument)")
                }
            }
        } catch {
            return usageError("\(error)")
        }
        guard let path = exportDirectory, !path.isEmpty else { return usageError("--export-dir is required") }

        let url = resolve(path, environment: environment, currentDirectory: currentDirectory)
        let report: ContractReport
        do {
            report = try checker.check(exportDirectory: url)
        } catch {
            return Outcome(status: 2, standardOutput: "", standardError: "check-contract: \(oneLine(error))\n")
        }
        let text = (report.summaryLines + [""] + report.verdictLines).joined(separator: "\n") + "\n"
        return Outcome(status: report.allHold ? 0 : 1, standardOutput: text, standardError: "")
    }

    /// `bazel run` starts the tool inside its runfiles tree, so a relative
    /// path means relative to where the user typed the command.
    static func resolve(_ path: String, environment: [String: String], currentDirectory: String) -> URL {
        if path.hasPrefix("/") { return URL(fileURLWithPath: path, isDirectory: true).standardizedFileURL }
        let base = environment["BUILD_WORKING_DIRECTORY"].flatMap { $0.isEmpty ? nil : $0 } ?? currentDirectory
        return URL(fileURLWithPath: base, isDirectory: true).appendingPathComponent(path).standardizedFileURL
    }

    private static func usageError(_ message: String) -> Outcome {
        Outcome(status: 2, standardOutput: "", standardError: "check-contract: \(message) (see --help)\n")
    }

    private static func oneLine(_ error: Error) -> String {
        String(describing: error).split(whereSeparator: \.isNewline).joined(separator: " ")
    }
}
