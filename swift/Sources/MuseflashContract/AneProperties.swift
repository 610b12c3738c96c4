import Foundation
import ExportMetadata
import MLPackage

/// The Neural Engine audit's rules (`DeviceAudit`, docs/ane.md), read off each distinct package
/// once: its weight files' sizes, its functions' interfaces (states, inputs) and its ML program's
/// operations. Nothing here changes the contract's verdict; `check-contract --device` decides
/// what a FAIL does.
///
/// coremltools saves a `coreml_update_state` as a `write_state` of the state followed at once by
/// a `read_state` of it (the update's result), so a "write" below is a `write_state` (or an
/// unsaved `coreml_update_state`), and the `read_state` right after it is part of the write.
extension LoadedBundle {
    struct AuditedPackage {
        var file: PackageFile
        var interface: PackageInterface
    }

    /// The packages that were read, each once, in pipeline order.
    var auditedPackages: [AuditedPackage] {
        packageFiles.compactMap { file in packages[file.owner].map { AuditedPackage(file: file, interface: $0) } }
    }

    func deviceAudit() -> DeviceAudit {
        let audited = auditedPackages
        let unchecked = packageFiles.filter { packages[$0.owner] == nil }
            .map { "\($0.path) (\(missing[$0.owner] ?? "not read"))" }
        let graphs = audited.flatMap { package in
            (package.interface.program?.functions ?? []).compactMap { function in
                function.block.map { ProgramFunction(label: label(function.name, of: package, among: audited),
                                                     function: function, block: $0) }
            }
        }
        return DeviceAudit(findings: [
            weightFileFinding(audited),
            statesPerFunctionFinding(audited),
            stateDataTypeFinding(audited),
            stateWidthFinding(audited),
            fixedShapesFinding(audited),
            specificationVersionFinding(audited),
            Self.kvWriteFinding(graphs),
            Self.readAfterWriteFinding(graphs),
            Self.outputWriteSourceFinding(graphs),
            Self.rankFinding(graphs),
            Self.cpuOpsFinding(graphs),
            Self.topkFinding(graphs),
            Self.largeDimensionsFinding(graphs),
        ], unchecked: unchecked)
    }

    /// `main` in a bundle of one package, `dflash_drafter.mlpackage:draft` beside others.
    private func label(_ function: String, of package: AuditedPackage, among all: [AuditedPackage]) -> String {
        all.count == 1 ? function : "\(package.file.path):\(function)"
    }

    private func functionLabels(_ audited: [AuditedPackage]) -> [(label: String, function: FunctionDescription)] {
        audited.flatMap { package in
            package.interface.functions.map { (label($0.name, of: package, among: audited), $0) }
        }
    }

    // MARK: Files and interfaces

    static let iphoneWeightFileLimit: Int64 = 1_000_000_000
    static let weightFileLimit: Int64 = 2_147_483_648

    func weightFileFinding(_ audited: [AuditedPackage]) -> AuditFinding {
        var files: [(label: String, bytes: Int64)] = []
        var unreadable: [String] = []
        for package in audited {
            guard let program = package.interface.program, let modelURL = package.interface.modelURL else { continue }
            for name in Self.blobFileNames(program).sorted() {
                let label = "\(package.file.path) \(name.replacingOccurrences(of: "@model_path/", with: ""))"
                do {
                    let url = try WeightFile.url(forBlobFile: name, modelURL: modelURL, packageURL: package.interface.url)
                    let attributes = try FileManager.default.attributesOfItem(atPath: url.path)
                    files.append((label, (attributes[.size] as? NSNumber)?.int64Value ?? 0))
                } catch {
                    unreadable.append(label)
                }
            }
        }
        let largest = files.max { $0.bytes < $1.bytes }
        let bytes = largest?.bytes ?? 0
        var detail = files.isEmpty ? "no package stores a weight file"
            : files.map { "\($0.label) \(Self.bytesText($0.bytes))" }.joined(separator: ", ")
        if !unreadable.isEmpty { detail += "; not measured (see <owner>.weight_file): " + unreadable.joined(separator: ", ") }
        detail += "; at most 1 GB a file on iphone, 2 GiB (2147483648 bytes) on mac"
        return AuditFinding(rule: .weightFile, value: bytes,
                            figure: largest.map { "largest \(Self.bytesText($0.bytes))" } ?? "none", detail: detail,
                            statuses: [.iphone: bytes > Self.iphoneWeightFileLimit ? .fail : .pass,
                                       .mac: bytes > Self.weightFileLimit ? .fail : .pass])
    }

    /// Every weight file the program names (a `const` op's value, a constexpr op's inline inputs).
    static func blobFileNames(_ program: MLProgram) -> Set<String> {
        var names = Set<String>()
        for function in program.functions {
            for specialization in function.blockSpecializations {
                for operation in specialization.block.allOperations {
                    for value in operation.attributes.values { if let blob = value.blob { names.insert(blob.fileName) } }
                    for input in operation.inputs {
                        for case .value(let value) in input.arguments { if let blob = value.blob { names.insert(blob.fileName) } }
                    }
                }
            }
        }
        return names
    }

    func statesPerFunctionFinding(_ audited: [AuditedPackage]) -> AuditFinding {
        let counts = functionLabels(audited).map { ($0.label, $0.function.states.count) }
        let most = counts.map(\.1).max() ?? 0
        let detail = counts.isEmpty ? "no function" : Self.grouped(counts.map { ($0.0, "\($0.1)") })
            + " states; 1 is safe, more FAIL on iphone, 2 WARN and 3 or more FAIL on mac"
        return AuditFinding(rule: .statesPerFunction, value: Int64(most), figure: "at most \(most) a function",
                            detail: detail,
                            statuses: [.iphone: most > 1 ? .fail : .pass,
                                       .mac: most >= 3 ? .fail : most == 2 ? .warn : .pass])
    }

    /// Each distinct state of each package (functions sharing a state declare it alike; the
    /// contract's `<role>.states` holds them to that).
    private func distinctStates(_ audited: [AuditedPackage]) -> [(label: String, type: MultiArrayType?)] {
        var seen = Set<String>()
        var states: [(String, MultiArrayType?)] = []
        for package in audited {
            for function in package.interface.functions {
                for state in function.states {
                    let label = audited.count == 1 ? state.name : "\(package.file.path):\(state.name)"
                    if seen.insert(label).inserted { states.append((label, state.type.multiArray)) }
                }
            }
        }
        return states
    }

    func stateDataTypeFinding(_ audited: [AuditedPackage]) -> AuditFinding {
        let states = distinctStates(audited)
        let other = states.filter { $0.type?.dataType != .float16 }
        let detail = other.isEmpty ? "\(states.count) states, every one fp16"
            : other.map { "\($0.label) \($0.type.map { $0.dataType.shortName } ?? "no array type")" }.joined(separator: ", ")
                + " (Core ML states are fp16 only)"
        return AuditFinding(rule: .stateDataType, value: Int64(other.count),
                            figure: "\(other.count) of \(states.count) states not fp16", detail: detail,
                            status: other.isEmpty ? .pass : .fail)
    }

    func stateWidthFinding(_ audited: [AuditedPackage]) -> AuditFinding {
        let states = distinctStates(audited)
        let odd = states.filter { ($0.type?.shape.last ?? 0) % 32 != 0 }
        let widths = Set(states.compactMap { $0.type?.shape.last }).sorted().map(String.init).joined(separator: ", ")
        let detail = odd.isEmpty ? "\(states.count) states, last dimensions \(widths)"
            : odd.map { "\($0.label) \($0.type.map { describe($0.shape) } ?? "?")" }.joined(separator: ", ")
                + " (last dimension not a multiple of 32; one report, so a WARN)"
        return AuditFinding(rule: .stateWidth, value: Int64(odd.count),
                            figure: "\(odd.count) of \(states.count) states", detail: detail,
                            status: odd.isEmpty ? .pass : .warn)
    }

    func fixedShapesFinding(_ audited: [AuditedPackage]) -> AuditFinding {
        var flexible: [String] = []
        var features = 0
        for (label, function) in functionLabels(audited) {
            for feature in function.inputs + function.states {
                features += 1
                guard let array = feature.type.multiArray else { continue }
                let ranges = array.shapeRange.map { !$0.isEmpty } ?? false
                let shapes = (array.enumeratedShapes?.count ?? 0) > 1
                if ranges || shapes { flexible.append("\(label) \(feature.name) \(describe(array))") }
            }
        }
        let detail = flexible.isEmpty ? "\(features) inputs and states, every shape fixed"
            : capped(flexible) + " (a range or enumerated shape keeps the model off the Neural Engine)"
        return AuditFinding(rule: .fixedShapes, value: Int64(flexible.count), figure: "\(flexible.count) flexible",
                            detail: detail, status: flexible.isEmpty ? .pass : .fail)
    }

    func specificationVersionFinding(_ audited: [AuditedPackage]) -> AuditFinding {
        var versions: [(String, Int?)] = []
        var problems: [String] = []
        var unknown = false
        for package in audited {
            let version = package.interface.specificationVersion
            versions.append((package.file.path, version))
            let needs = package.interface.functions.count > 1 || package.interface.functions.contains { !$0.states.isEmpty }
            guard needs else { continue }
            if let version = version {
                if version < 9 { problems.append("\(package.file.path) is version \(version)") }
            } else {
                unknown = true
            }
        }
        let lowest = versions.compactMap(\.1).min() ?? 0
        var detail = versions.map { "\($0.0) \($0.1.map(String.init) ?? "unknown")" }.joined(separator: ", ")
        if !problems.isEmpty { detail += "; states and multifunction need 9 or later (iOS 18, macOS 15): " + problems.joined(separator: ", ") }
        return AuditFinding(rule: .specificationVersion, value: Int64(lowest), figure: "lowest \(lowest)", detail: detail,
                            status: !problems.isEmpty ? .fail : unknown ? .warn : .pass)
    }

    // MARK: Helpers

    /// `main, prefill: 4; draft: 2`: labels with equal values together, in first-seen order,
    /// each group's labels capped.
    static func grouped(_ pairs: [(String, String)], limit: Int = 6) -> String {
        var order: [String] = []
        var labels: [String: [String]] = [:]
        for (label, value) in pairs {
            if labels[value] == nil { order.append(value) }
            labels[value, default: []].append(label)
        }
        return order.map { value in
            let names = labels[value]!
            let shown = names.prefix(limit).joined(separator: ", ")
            return (names.count > limit ? "\(shown) and \(names.count - limit) more" : shown) + ": " + value
        }.joined(separator: "; ")
    }

    static func bytesText(_ bytes: Int64) -> String {
        let value = Double(bytes)
        if value >= 1e9 { return String(format: "%.2f GB", value / 1e9) }
        if value >= 1e6 { return String(format: "%.1f MB", value / 1e6) }
        if value >= 1e3 { return String(format: "%.1f KB", value / 1e3) }
        return "\(bytes) B"
    }
}
