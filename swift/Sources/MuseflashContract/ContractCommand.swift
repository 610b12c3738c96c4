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
        usage: check-contract --export-dir DIR [--device iphone|mac|gpu] [--format text|json]

        Checks a museflash export directory (metadata.json plus its .mlpackage bundles) against
        the device-side contract and prints one PASS/FAIL line per property, then audits it
        against the Neural Engine's known rules: one PASS/WARN/FAIL line per rule, with the
        figure found and its source in docs/ane.md.

          --export-dir DIR  the export directory; a relative path resolves against
                            $BUILD_WORKING_DIRECTORY when set (bazel run), else the current directory
          --device D        iphone or mac: the Neural Engine's rules for that device, and a rule
                            that FAILs fails the run; gpu: the GPU layout's rules (the Neural
                            Engine's own are N/A). Without it every device's verdict is reported
                            and only the contract decides the exit status.
          --format F        text (default) or json: the same verdicts as one JSON object
          -h, --help        show this help

        Exit status: 0 all properties hold (and with --device no rule FAILs), 1 some property
        fails or a rule FAILs on --device, 2 bad usage or unreadable input.
        """

    public static func run(arguments: [String], environment: [String: String],
                           currentDirectory: String = FileManager.default.currentDirectoryPath,
                           checker: ContractChecker = ContractChecker()) -> Outcome {
        var exportDirectory: String?
        var device: AuditDevice?
        var json = false
        var flags = CommandLineFlags(arguments)
        do {
            while let argument = try flags.next() {
                switch argument {
                case "-h", "--help":
                    return Outcome(status: 0, standardOutput: usage + "\n", standardError: "")
                case "--export-dir":
                    exportDirectory = try flags.value(of: argument)
                case "--device":
                    let value = try flags.value(of: argument)
                    guard let known = AuditDevice(rawValue: value) else {
                        return usageError("--device \(value) is not a device this audit knows; "
                                          + "accepted values: \(AuditDevice.acceptedValues)")
                    }
                    device = known
                case "--format":
                    let value = try flags.value(of: argument)
                    guard ["text", "json"].contains(value) else {
                        return usageError("--format \(value) is not a format; accepted values: text, json")
                    }
                    json = value == "json"
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
        let auditFails = device.map { !report.audit.failures(on: $0).isEmpty } ?? false
        let status: Int32 = report.allHold && !auditFails ? 0 : 1
        if json {
            do {
                return Outcome(status: status, standardOutput: try ContractJSON(report: report, device: device, status: status).text(),
                               standardError: "")
            } catch {
                return Outcome(status: 2, standardOutput: "", standardError: "check-contract: \(oneLine(error))\n")
            }
        }
        let lines = report.summaryLines + [""] + report.verdictLines + [""] + report.audit.lines(device: device)
        return Outcome(status: status, standardOutput: lines.joined(separator: "\n") + "\n", standardError: "")
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
