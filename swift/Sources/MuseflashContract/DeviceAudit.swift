import Foundation

/// The Neural Engine audit (`check-contract --device iphone|mac|gpu`, docs/ane.md): the rules
/// the projects that run LLMs on Apple's Neural Engine report, each checked on the bundle's
/// files and graphs. Apple publishes no list of the Neural Engine's limits, so every rule is a
/// report with a source (docs/ane.md names it), not a law; the first run on a Mac confirms them.
///
/// Unlike the contract's properties, a rule has a verdict per device: the same 1.5 GB weight
/// file FAILs on an iPhone and passes on a Mac, and the GPU layout (today's bundle) is held only
/// to the rules that are not the Neural Engine's own (`AuditRule.devices`).
public enum AuditDevice: String, CaseIterable, Sendable, Codable {
    case iphone, mac, gpu

    /// The accepted values of `--device`, as the refusal names them.
    public static var acceptedValues: String { allCases.map(\.rawValue).joined(separator: ", ") }
}

public enum AuditStatus: String, Sendable, Codable, Comparable {
    case pass = "PASS"
    case warn = "WARN"
    case fail = "FAIL"
    /// The rule is the Neural Engine's and the device is the GPU (`AuditRule.devices`).
    case notApplicable = "N/A"

    private var rank: Int {
        switch self {
        case .notApplicable: return 0
        case .pass: return 1
        case .warn: return 2
        case .fail: return 3
        }
    }

    public static func < (lhs: AuditStatus, rhs: AuditStatus) -> Bool { lhs.rank < rhs.rank }
}

/// The rules, in the order the audit reports them. The raw value is the id a report and a test
/// name; `section` is the heading of docs/ane.md that gives the rule, its thresholds and sources.
public enum AuditRule: String, CaseIterable, Sendable, Codable {
    case weightFile = "ane.weight_file"
    case statesPerFunction = "ane.states_per_function"
    case stateDataType = "ane.state_dtype"
    case stateWidth = "ane.state_width"
    case fixedShapes = "ane.fixed_shapes"
    case specificationVersion = "ane.spec_version"
    case kvWrite = "ane.kv_write"
    case readAfterWrite = "ane.read_after_write"
    case outputWriteSource = "ane.output_write_source"
    case rank = "ane.rank"
    case cpuOps = "ane.cpu_ops"
    case topk = "ane.topk"
    case largeDimensions = "ane.large_dims"

    /// The anchor of the rule's section in docs/ane.md.
    public var section: String {
        switch self {
        case .weightFile: return "weight-file-size"
        case .statesPerFunction: return "states-per-function"
        case .stateDataType: return "state-data-type"
        case .stateWidth: return "state-width"
        case .fixedShapes: return "fixed-shapes"
        case .specificationVersion: return "specification-version"
        case .kvWrite: return "kv-writes"
        case .readAfterWrite: return "read-after-write"
        case .outputWriteSource: return "output-as-write-source"
        case .rank: return "tensor-rank"
        case .cpuOps: return "ops-on-the-cpu"
        case .topk: return "topk-over-65536"
        case .largeDimensions: return "dimensions-above-16384"
        }
    }

    public var source: String { "docs/ane.md#\(section)" }

    /// The devices the rule judges; on the others its status is N/A. The Neural Engine's own
    /// rules do not judge the GPU layout; what holds for every compute unit (the converter's
    /// bugs, the states' type, the specification version) and the GPU's own crash reports
    /// (`ane.kv_write`, `ane.topk`) do.
    public var devices: Set<AuditDevice> {
        switch self {
        case .stateDataType, .specificationVersion, .readAfterWrite, .outputWriteSource, .kvWrite, .topk:
            return Set(AuditDevice.allCases)
        case .weightFile, .statesPerFunction, .stateWidth, .fixedShapes, .rank, .cpuOps, .largeDimensions:
            return [.iphone, .mac]
        }
    }

    /// The rules that do not judge `device` (N/A on it).
    public static func notApplicable(on device: AuditDevice) -> [AuditRule] {
        allCases.filter { !$0.devices.contains(device) }
    }
}

/// One rule's verdict on a bundle: a status per device, the figure found (`value`, and `figure`
/// for people) and where it was found (`detail`).
public struct AuditFinding: Sendable, Equatable {
    public var rule: AuditRule
    public var statuses: [AuditDevice: AuditStatus]
    /// The rule's measure: bytes, a count, a rank or a size (docs/ane.md says which per rule).
    public var value: Int64
    public var figure: String
    public var detail: String

    /// `statuses` for the rule's devices; N/A on the others whatever is given.
    public init(rule: AuditRule, value: Int64, figure: String, detail: String,
                statuses: [AuditDevice: AuditStatus]) {
        self.rule = rule
        self.value = value
        self.figure = figure
        self.detail = detail
        var all: [AuditDevice: AuditStatus] = [:]
        for device in AuditDevice.allCases {
            all[device] = rule.devices.contains(device) ? statuses[device] ?? .pass : .notApplicable
        }
        self.statuses = all
    }

    /// One status for every device the rule judges.
    public init(rule: AuditRule, value: Int64, figure: String, detail: String, status: AuditStatus) {
        self.init(rule: rule, value: value, figure: figure, detail: detail,
                  statuses: Dictionary(uniqueKeysWithValues: AuditDevice.allCases.map { ($0, status) }))
    }

    public func status(on device: AuditDevice) -> AuditStatus {
        statuses[device] ?? .notApplicable
    }

    /// `FAIL ane.rank: 5; detail [docs/ane.md#tensor-rank]` for one device, or all three.
    public func line(device: AuditDevice?) -> String {
        let verdict = device.map { self.status(on: $0).rawValue.padding(toLength: 4, withPad: " ", startingAt: 0) }
            ?? AuditDevice.allCases.map { "\($0.rawValue) \(self.status(on: $0).rawValue)" }.joined(separator: " | ")
        return "  \(verdict) \(rule.rawValue): \(figure); \(detail) [\(rule.source)]"
    }
}

/// Every rule's finding on one bundle, in `AuditRule` order.
public struct DeviceAudit: Sendable, Equatable {
    public var findings: [AuditFinding]
    /// Packages metadata.json lists that could not be audited, with the reason (the contract's
    /// `metadata.assets_exist` fails for them).
    public var unchecked: [String]

    public init(findings: [AuditFinding] = [], unchecked: [String] = []) {
        self.findings = findings
        self.unchecked = unchecked
    }

    public func finding(_ rule: AuditRule) -> AuditFinding? {
        findings.first { $0.rule == rule }
    }

    public func status(_ rule: AuditRule, on device: AuditDevice) -> AuditStatus? {
        finding(rule)?.status(on: device)
    }

    public func failures(on device: AuditDevice) -> [AuditRule] {
        findings.filter { $0.status(on: device) == .fail }.map(\.rule)
    }

    public func count(_ status: AuditStatus, on device: AuditDevice) -> Int {
        findings.filter { $0.status(on: device) == status }.count
    }

    /// The audit's lines for `device`, or for every device without one.
    public func lines(device: AuditDevice?) -> [String] {
        var lines: [String]
        if let device = device {
            lines = ["Neural Engine audit for --device \(device) (each rule and its sources: docs/ane.md)"]
        } else {
            lines = ["Neural Engine audit, every device (each rule and its sources: docs/ane.md; "
                     + "--device iphone|mac|gpu exits 1 on a FAIL)"]
        }
        lines += unchecked.map { "  not audited: \($0)" }
        lines += findings.map { $0.line(device: device) }
        if let device = device {
            let notApplicable = AuditRule.notApplicable(on: device)
            var total = "\(device): \(count(.pass, on: device)) PASS, \(count(.warn, on: device)) WARN, "
                + "\(count(.fail, on: device)) FAIL"
            if !notApplicable.isEmpty {
                total += ", \(notApplicable.count) N/A (the Neural Engine's own: "
                    + notApplicable.map(\.rawValue).joined(separator: ", ") + ")"
            }
            lines.append(total)
        }
        return lines
    }
}

// MARK: JSON (`--format json`, fields in docs/ane.md)

/// What `check-contract --format json` prints: the contract's properties and the audit's rules,
/// the same verdicts as the text, for tools.
struct ContractJSON: Encodable {
    struct Property: Encodable {
        var name: String
        var holds: Bool
        var detail: String
    }

    struct Contract: Encodable {
        var passed: Int
        var failed: Int
        var properties: [Property]
    }

    struct Rule: Encodable {
        var id: String
        var status: AuditStatus?
        var statuses: [String: AuditStatus]
        var value: Int64
        var figure: String
        var detail: String
        var source: String

        func encode(to encoder: Encoder) throws {
            var container = encoder.container(keyedBy: CodingKeys.self)
            try container.encode(id, forKey: .id)
            try container.encode(status, forKey: .status)  // null without --device
            try container.encode(statuses, forKey: .statuses)
            try container.encode(value, forKey: .value)
            try container.encode(figure, forKey: .figure)
            try container.encode(detail, forKey: .detail)
            try container.encode(source, forKey: .source)
        }

        enum CodingKeys: String, CodingKey {
            case id, status, statuses, value, figure, detail, source
        }
    }

    struct Audit: Encodable {
        var rules: [Rule]
        var notApplicable: [String]
        var unchecked: [String]

        enum CodingKeys: String, CodingKey {
            case rules
            case notApplicable = "not_applicable"
            case unchecked
        }
    }

    var exportDir: String
    var device: AuditDevice?
    var status: Int32
    var contract: Contract
    var audit: Audit

    enum CodingKeys: String, CodingKey {
        case exportDir = "export_dir"
        case device, status, contract, audit
    }

    func encode(to encoder: Encoder) throws {
        var container = encoder.container(keyedBy: CodingKeys.self)
        try container.encode(exportDir, forKey: .exportDir)
        try container.encode(device, forKey: .device)  // null without --device
        try container.encode(status, forKey: .status)
        try container.encode(contract, forKey: .contract)
        try container.encode(audit, forKey: .audit)
    }

    init(report: ContractReport, device: AuditDevice?, status: Int32) {
        exportDir = report.exportDirectory.path
        self.device = device
        self.status = status
        contract = Contract(passed: report.passedCount, failed: report.failedCount,
                            properties: report.results.map { Property(name: $0.name, holds: $0.holds, detail: $0.detail) })
        audit = Audit(
            rules: report.audit.findings.map { finding in
                Rule(id: finding.rule.rawValue, status: device.map(finding.status(on:)),
                     statuses: Dictionary(uniqueKeysWithValues: finding.statuses.map { ($0.key.rawValue, $0.value) }),
                     value: finding.value, figure: finding.figure, detail: finding.detail, source: finding.rule.source)
            },
            notApplicable: device.map { AuditRule.notApplicable(on: $0).map(\.rawValue) } ?? [],
            unchecked: report.audit.unchecked)
    }

    func text() throws -> String {
        let encoder = JSONEncoder()
        encoder.outputFormatting = [.prettyPrinted, .sortedKeys, .withoutEscapingSlashes]
        return String(decoding: try encoder.encode(self), as: UTF8.self) + "\n"
    }
}
