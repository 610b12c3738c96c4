import Foundation
import ExportMetadata
import MLPackage

typealias CompressionMode = ExportMetadata.CompressionMode
typealias CompressedGroup = ExportMetadata.CompressedGroup

/// How the weights are stored (metadata.json `compression`, schema version 2), judged against
/// each package's ML program and its weight file.
///
/// A compressed weight is an iOS18 constexpr op in place of a `const` op, with two inline inputs
/// in blobs of the weight file: the data (or indices) and the fp16 scales (or look-up tables).
/// The package does not name the checkpoint tensor a weight came from, so an op belongs to a
/// group by what it is: op type, data dtype and the shape of its scales or look-up tables.
/// Groups that the ops cannot tell apart (say two int8 per-channel rules) are compared together.
///
/// Without `compression`, only `<role>.compression.ops_declared` runs: it fails when a package
/// holds any constexpr op. Blob headers of the weight file are read (64 bytes each, never the
/// data) only when compression is declared.
///
/// The `<role>.compression.*` properties run once per distinct package, named by its owner
/// role (`ExportMetadata.Package.owner`), which is also the key of its counts in
/// `groups[i].packages`: a package the fused target and the DFlash drafter share (schema
/// version 3) is `target`, and its counts cover every weight of both, each once.
extension LoadedBundle {
    func compressionProperties() -> [PropertyResult] {
        guard let compression = metadata.compression else {
            return owners.map(undeclaredCompression)
        }
        var results = [compressionMetadata(compression)]
        for role in owners {
            let analysis = Result { try CompressionAnalysis(package(role), groups: compression.groups) }
            results += [
                compressionOpsDeclared(role, compression, analysis),
                compressionStoredCompressed(role, compression, analysis),
                compressionBytes(role, compression, analysis),
                compressionFunctionsAgree(role, analysis),
            ]
        }
        return results
    }

    // MARK: Properties

    /// Without `compression` in metadata.json, no package may rebuild a weight from a constexpr op.
    func undeclaredCompression(_ role: AssetRole) -> PropertyResult {
        evaluate("\(role).compression.ops_declared") {
            let analysis = try CompressionAnalysis(package(role), groups: [])
            guard analysis.uses.isEmpty else {
                let names = analysis.uses.map { "\($0.label) (\($0.opType))" }
                throw Violation(detail: "metadata.json declares no compression, but \(analysis.uses.count) weight "
                                + "op\(analysis.uses.count == 1 ? " is a constexpr op" : "s are constexpr ops"): "
                                + "\(capped(names)); declare them under compression (schema_version "
                                + "\(ExportMetadata.compressionSchemaVersion)) or store them as fp16 consts")
            }
            return "no constexpr ops, and metadata.json declares no compression"
        }
    }

    /// The groups are well formed and agree with the assets: a group is linear or palettize, with
    /// 4 or 8 bits, a block size only for linear and a group size for palettize; it names a rule
    /// and listed assets, each the owner of its package (a role stored in a package another
    /// role owns is counted under the owner); per package it stores at most what the group
    /// holds, and together the packages store at least all of it. `compression` needs
    /// schema_version 2.
    func compressionMetadata(_ compression: ExportMetadata.Compression) -> PropertyResult {
        evaluate("metadata.compression") {
            var problems = Problems()
            problems.require(metadata.schemaVersion >= ExportMetadata.compressionSchemaVersion,
                             "schema_version \(metadata.schemaVersion) has no compression "
                             + "(it is new in \(ExportMetadata.compressionSchemaVersion))")
            for (index, group) in compression.groups.enumerated() {
                let label = "groups[\(index)]"
                problems.require(compression.rules.indices.contains(group.rule),
                                 "\(label).rule \(group.rule) is not an index of rules (\(compression.rules.count) rules)")
                problems.require(group.mode != .none, "\(label).mode is none; a group holds compressed weights")
                problems.require([4, 8].contains(group.bits), "\(label).bits is \(group.bits), not 4 or 8")
                switch group.mode {
                case .linear, .affine:
                    problems.require(group.groupSize == nil, "\(label) is \(group.mode) but has group_size \(group.groupSize ?? 0)")
                    if let block = group.blockSize {
                        problems.require(block >= 1, "\(label).block_size is \(block)")
                    }
                case .palettize:
                    problems.require(group.blockSize == nil, "\(label) is palettize but has block_size \(group.blockSize ?? 0)")
                    problems.require((group.groupSize ?? 0) >= 1,
                                     "\(label) is palettize but group_size is \(group.groupSize.map(String.init) ?? "null")")
                case .none:
                    break
                }
                for (role, stored) in group.packages.sorted(by: { $0.key.rawValue < $1.key.rawValue }) {
                    problems.require(metadata.assets[role] != nil, "\(label).packages names \(role), which assets does not list")
                    if let file = packageFile(of: role), file.owner != role {
                        problems.add("\(label).packages names \(role), whose asset is stored in \(file.path), owned by "
                                     + "\(file.owner): a shared package is counted once, under its owner")
                    }
                    problems.require(stored.tensors <= group.tensors && stored.bytes <= group.bytesAfter,
                                     "\(label).packages.\(role) stores \(stored.tensors) weights in \(stored.bytes) bytes, "
                                     + "more than the group's \(group.tensors) in \(group.bytesAfter)")
                }
                let tensors = group.packages.values.map(\.tensors).reduce(0, +)
                let bytes = group.packages.values.map(\.bytes).reduce(0, +)
                problems.require(tensors >= group.tensors && bytes >= group.bytesAfter,
                                 "\(label).packages store \(tensors) weights in \(bytes) bytes together, "
                                 + "less than the group's \(group.tensors) in \(group.bytesAfter)")
            }
            let stored = compression.groups.map(\.tensors).reduce(0, +)
            return try problems.verdict("\(compression.groups.count) groups of \(stored) compressed weights "
                                        + "(\(compression.preset.map { "preset \($0)" } ?? "rules from --compression-config")), "
                                        + "\(compression.fp16Tensors) fp16")
        }
    }

    /// Every constexpr op of every function is a declared group's op: its type, its data dtype
    /// and the shape of its scales or look-up tables are those of some group's mode, bits and
    /// block or group size.
    func compressionOpsDeclared(_ role: AssetRole, _ compression: ExportMetadata.Compression,
                                _ analysis: Result<CompressionAnalysis, Error>) -> PropertyResult {
        evaluate("\(role).compression.ops_declared") {
            let analysis = try analysis.get()
            var problems = Problems()
            if analysis.program == nil && compression.groups.contains(where: { $0.packages[role] != nil }) {
                problems.add("the package is not an ML program, so it cannot store the weights metadata.json declares")
            }
            var malformed: [String] = []
            var undeclared: [String] = []
            for use in analysis.uses {
                if !use.problems.isEmpty {
                    malformed.append("\(use.label): \(use.problems.joined(separator: ", "))")
                } else if use.groups.isEmpty {
                    undeclared.append("\(use.label) (\(use.summary)) is \(use.impliedScheme), but the declared "
                                      + "\(use.mode.map(\.rawValue) ?? "?") groups are "
                                      + Self.schemes(compression.groups.filter { $0.mode == use.mode }))
                }
            }
            if !malformed.isEmpty { problems.add("\(malformed.count) malformed constexpr ops: \(capped(malformed))") }
            if !undeclared.isEmpty { problems.add("\(undeclared.count) ops of no declared group: \(capped(undeclared))") }
            let types = Dictionary(grouping: analysis.uses, by: \.opType).map { "\($0.value.count) \($0.key)" }.sorted()
            return try problems.verdict(analysis.uses.isEmpty ? "no constexpr ops"
                                        : "\(types.joined(separator: ", ")), each of a declared group")
        }
    }

    /// Per group, the package stores as many distinct compressed weights (distinct data blobs) as
    /// `groups[i].packages.<role>.tensors` says: a weight stored as a plain fp16 const instead
    /// leaves its group short.
    func compressionStoredCompressed(_ role: AssetRole, _ compression: ExportMetadata.Compression,
                                     _ analysis: Result<CompressionAnalysis, Error>) -> PropertyResult {
        evaluate("\(role).compression.stored_compressed") {
            let analysis = try analysis.get()
            var problems = Problems()
            var summary: [String] = []
            for pool in analysis.pools {
                let declared = pool.groups.map { compression.groups[$0].packages[role]?.tensors ?? 0 }.reduce(0, +)
                let stored = pool.weights.count
                let label = Self.groupsText(pool.groups, of: compression)
                if declared != 0 || stored != 0 { summary.append("\(label): \(stored)") }
                guard declared != stored else { continue }
                var message = "\(label): metadata.json declares \(declared) \(role) weights, the package stores \(stored) compressed"
                let minimum = compression.minCompressibleElements
                let candidates = analysis.fp16Weights(ofAtLeast: minimum)
                if stored < declared, !candidates.isEmpty {
                    let which = minimum.map { "fp16 consts of at least \($0) elements" } ?? "2-D fp16 consts"
                    message += " (\(which), which might be the others: \(capped(candidates.map(\.label))))"
                }
                problems.add(message)
            }
            if !analysis.unmatched.isEmpty {
                problems.add("\(analysis.unmatched.count) compressed weights match no declared group "
                             + "(\(capped(analysis.unmatched.map { analysis.uses[$0.uses[0]].label }))); "
                             + "see \(role).compression.ops_declared")
            }
            return try problems.verdict(summary.isEmpty ? "no compressed weights declared or stored"
                                        : "distinct compressed weights as declared, " + summary.joined(separator: "; "))
        }
    }

    /// The payload of each compressed weight (its data blob and its scale or look-up table blob,
    /// sizes from the blob headers) fits its tensor's dtype and shape, and per group and in total
    /// equals `groups[i].packages.<role>.bytes`.
    func compressionBytes(_ role: AssetRole, _ compression: ExportMetadata.Compression,
                          _ analysis: Result<CompressionAnalysis, Error>) -> PropertyResult {
        evaluate("\(role).compression.bytes") {
            let analysis = try analysis.get()
            let headers = try analysis.readHeaders()
            var problems = Problems()
            var unreadable: [String] = []
            var misfit: [String] = []
            // Data blob -> payload bytes, for weights whose headers are all good.
            var payload: [MILBlobReference: UInt64] = [:]
            for weight in analysis.weights {
                let use = analysis.uses[weight.uses[0]]
                guard use.data != nil, use.side != nil else { continue }
                var total: UInt64 = 0
                var good = true
                for (input, tensor) in use.blobs {
                    switch headers[tensor.blob] {
                    case .failure(let error)?:
                        unreadable.append("\(use.label) \(input): \(error)")
                        good = false
                    case .success(let header)?:
                        if let problem = tensor.misfit(header) {
                            misfit.append("\(use.label) \(input) at offset \(tensor.blob.offset): \(problem)")
                            good = false
                        }
                        total += header.size
                    case nil:
                        good = false
                    }
                }
                if good { payload[weight.data] = total }
            }
            if !unreadable.isEmpty { problems.add("\(unreadable.count) blobs unreadable: \(capped(unreadable))") }
            if !misfit.isEmpty { problems.add("\(misfit.count) blobs disagree with their tensors: \(capped(misfit))") }

            var summary: [String] = []
            var measuredTotal: UInt64 = 0
            var complete = true
            for pool in analysis.pools {
                let declared = pool.groups.map { compression.groups[$0].packages[role]?.bytes ?? 0 }.reduce(0, +)
                let sizes = pool.weights.map { payload[$0.data] }
                let label = Self.groupsText(pool.groups, of: compression)
                guard sizes.allSatisfy({ $0 != nil }) else {
                    complete = false
                    problems.add("\(label): not compared with the declared \(declared) bytes, some blobs are unreadable")
                    continue
                }
                let measured = sizes.map { $0! }.reduce(0, +)
                measuredTotal += measured
                if declared != 0 || measured != 0 { summary.append("\(label): \(measured)") }
                problems.require(measured == UInt64(max(declared, 0)),
                                 "\(label): metadata.json declares \(declared) \(role) bytes, the blob headers "
                                 + "give \(measured)")
            }
            for weight in analysis.unmatched {
                if let size = payload[weight.data] { measuredTotal += size } else { complete = false }
            }
            let declaredTotal = compression.groups.map { $0.packages[role]?.bytes ?? 0 }.reduce(0, +)
            if complete {
                problems.require(measuredTotal == UInt64(max(declaredTotal, 0)),
                                 "in total metadata.json declares \(declaredTotal) \(role) bytes of compressed weights, "
                                 + "the blob headers give \(measuredTotal)")
            }
            return try problems.verdict(summary.isEmpty ? "no compressed weights declared or stored"
                                        : "\(measuredTotal) payload bytes as declared, " + summary.joined(separator: "; "))
        }
    }

    /// Every op that rebuilds the same data blob, in any function, is the same op: type, output,
    /// data and scale or look-up table (dtype, shape and blob) alike. A weight that one function
    /// rebuilds from a constexpr op is not a plain const in another function of the same asset
    /// (matched by output name, which the exporter keeps across the functions of one model; in a
    /// package the target and the DFlash drafter share, the two models may name different
    /// weights alike, so the target's functions are not compared with the drafter's by name).
    func compressionFunctionsAgree(_ role: AssetRole, _ analysis: Result<CompressionAnalysis, Error>) -> PropertyResult {
        evaluate("\(role).compression.functions_agree") {
            let analysis = try analysis.get()
            // Function name -> the asset listing it, bucket functions included (nil: a package of
            // its own, or no asset).
            var assetOf: [String: AssetRole] = [:]
            if let file = packageFile(of: role), file.isShared {
                for member in file.roles {
                    for name in metadata.functionNames(of: member) { assetOf[name] = member }
                }
            }
            var problems = Problems()
            var disagreements: [String] = []
            var shared = 0
            for weight in analysis.weights {
                let uses = weight.uses.map { analysis.uses[$0] }
                if Set(uses.map(\.function)).count > 1 { shared += 1 }
                let first = uses[0]
                for use in uses.dropFirst() where use.signature != first.signature {
                    disagreements.append("the blob at offset \(weight.data.offset) is \(first.summary) in \(first.label) "
                                         + "but \(use.summary) in \(use.label)")
                }
            }
            var plain: [String] = []
            let compressedByName = Dictionary(grouping: analysis.uses, by: \.name)
            for const in analysis.fp16Weights {
                guard let other = compressedByName[const.name]?.first(where: {
                    $0.function != const.function && assetOf[$0.functionName] == assetOf[const.functionName]
                }) else { continue }
                plain.append("\(const.label) is a plain fp16 const but \(other.label) is \(other.opType)")
            }
            if !disagreements.isEmpty { problems.add("\(disagreements.count) ops disagree: \(capped(disagreements))") }
            if !plain.isEmpty { problems.add("\(plain.count) weights compressed in one function only: \(capped(plain))") }
            return try problems.verdict("\(analysis.weights.count) compressed weights, \(shared) of them used by several "
                                        + "functions, rebuilt alike wherever used")
        }
    }

    // MARK: Descriptions

    /// `groups 0, 1 (linear int8 per output channel)`.
    static func groupsText(_ indices: [Int], of compression: ExportMetadata.Compression) -> String {
        let schemes = Array(Set(indices.map { schemeText(compression.groups[$0]) })).sorted()
        return "group\(indices.count == 1 ? "" : "s") \(indices.map(String.init).joined(separator: ", ")) "
            + "(\(schemes.joined(separator: "; ")))"
    }

    static func schemes(_ groups: [CompressedGroup]) -> String {
        let texts = Array(Set(groups.map(schemeText))).sorted()
        return texts.isEmpty ? "none" : texts.joined(separator: ", ")
    }

    /// `linear int4 block_size 32`, `affine uint4 block_size 32`, `palettize uint4 group_size 32`.
    static func schemeText(_ group: CompressedGroup) -> String {
        let type = CompressionScheme.dataType(mode: group.mode, bits: group.bits).map { "\($0)".lowercased() }
            ?? "\(group.bits)-bit"
        switch group.mode {
        case .linear, .affine:
            return "\(group.mode.rawValue) \(type) " + (group.blockSize.map { "block_size \($0)" } ?? "per output channel")
        case .palettize:
            return "palettize \(type) group_size \(group.groupSize.map(String.init) ?? "null")"
        case .none:
            return "none"
        }
    }
}

/// At most `limit` items, then how many more.
func capped(_ items: [String], limit: Int = 5) -> String {
    items.count <= limit ? items.joined(separator: "; ")
        : items.prefix(limit).joined(separator: "; ") + "; and \(items.count - limit) more"
}

/// The data a compressed weight of a group has, and the shape of its scales or look-up tables.
enum CompressionScheme {
    /// bundle.py COMPRESSION_OPS: the op of each mode and its inputs: the data, the fp16 side
    /// tensor (scale or look-up table) and, for affine, the fp16 offset of the scale's shape.
    static let ops: [CompressionMode: (type: String, data: String, side: String, offset: String?)] = [
        .linear: ("constexpr_blockwise_shift_scale", "data", "scale", nil),
        .affine: ("constexpr_blockwise_shift_scale", "data", "scale", "offset"),
        .palettize: ("constexpr_lut_to_dense", "indices", "lut", nil),
    ]
    static let constexprPrefix = "constexpr_"

    /// The mode whose op this is: linear and affine share an op type, and an affine op is the one
    /// with an offset input.
    static func mode(of operation: MILOperation) -> CompressionMode? {
        let candidates = ops.filter { $0.value.type == operation.type }
        guard candidates.count > 1 else { return candidates.first?.key }
        let hasOffset = operation.input(named: "offset") != nil
        return candidates.first { ($0.value.offset != nil) == hasOffset }?.key
    }

    /// linear: signed int4/int8 data; affine: unsigned uint4/uint8 data; palettize: unsigned
    /// uint4/uint8 indices.
    static func dataType(mode: CompressionMode, bits: Int) -> MILDataType? {
        switch (mode, bits) {
        case (.linear, 4): return .int4
        case (.linear, 8): return .int8
        case (.affine, 4): return .uint4
        case (.affine, 8): return .uint8
        case (.palettize, 4): return .uint4
        case (.palettize, 8): return .uint8
        default: return nil
        }
    }

    /// The scale shape `[O, I / block_size]` (`[O, 1]` per output channel) or look-up table shape
    /// `[O / group_size, 1, 2^bits, 1]` of a weight `[O, I]`, or nil when the size does not divide.
    static func sideShape(of group: CompressedGroup, weight shape: [UInt64]) -> [UInt64]? {
        guard shape.count == 2 else { return nil }
        let (rows, columns) = (shape[0], shape[1])
        switch group.mode {
        case .linear, .affine:
            guard let block = group.blockSize else { return [rows, 1] }
            guard block > 0, columns % UInt64(block) == 0 else { return nil }
            return [rows, columns / UInt64(block)]
        case .palettize:
            guard let size = group.groupSize, size > 0, rows % UInt64(size) == 0,
                  [4, 8].contains(group.bits) else { return nil }
            return [rows / UInt64(size), 1, 1 << UInt64(group.bits), 1]
        case .none:
            return nil
        }
    }
}

/// An inline input of a constexpr op: a tensor in a blob of a weight file.
struct BlobTensor: Equatable {
    var dataType: MILDataType
    var shape: [UInt64]
    var blob: MILBlobReference

    var text: String { "\(dataType) \(describe(shape.map { Int64(clamping: $0) }))" }

    /// Why `header` cannot hold this tensor, or nil when it can.
    func misfit(_ header: BlobHeader) -> String? {
        if header.dataType.milDataType != dataType {
            return "the blob stores \(header.dataType), the op says \(dataType)"
        }
        guard let elements = MILTensorType(dimensions: shape.map(MILDimension.constant)).elementCount,
              let bits = dataType.bitWidth, let expected = BlobHeader.packedSize(elements: elements, bits: bits) else {
            return "\(text) has no size in bytes"
        }
        if header.size != expected {
            return "the blob holds \(header.size) bytes, \(text) takes \(expected)"
        }
        return nil
    }
}

/// What the compression properties look at in one package, read once.
struct CompressionAnalysis {
    /// One constexpr op (a weight as a function rebuilds it).
    struct Use {
        /// The function's label (its name, with the opset when it has several specializations).
        var function: String
        /// The function's name.
        var functionName: String
        /// The op's output name.
        var name: String
        var opType: String
        var mode: CompressionMode?
        var output: [UInt64]?
        var data: BlobTensor?
        var side: BlobTensor?
        /// An affine op's offsets (the scale's shape).
        var offset: BlobTensor?
        /// Why the op is not a well-formed compressed weight.
        var problems: [String] = []
        /// Indices of the groups whose op it is.
        var groups: [Int] = []

        var label: String { "\(function).\(name)" }
        var dataInput: String { mode.flatMap { CompressionScheme.ops[$0]?.data } ?? "data" }
        var sideInput: String { mode.flatMap { CompressionScheme.ops[$0]?.side } ?? "side" }
        var offsetInput: String { mode.flatMap { CompressionScheme.ops[$0]?.offset } ?? "offset" }

        /// The op's blob inputs, by input name: data, side and (affine) offset.
        var blobs: [(String, BlobTensor)] {
            [(dataInput, data), (sideInput, side), (offsetInput, offset)].compactMap { input, tensor in
                tensor.map { (input, $0) }
            }
        }

        var summary: String {
            guard data != nil, side != nil else { return opType }
            return "\(opType) " + blobs.map { "\($0.0) \($0.1.text)" }.joined(separator: ", ")
        }

        /// Everything functions must agree on.
        var signature: String {
            "\(summary) -> \(output.map { "\($0)" } ?? "?") @"
                + blobs.map { "\($0.1.blob.offset)" }.joined(separator: "/")
        }

        /// What the shapes say about the scheme, for a use of no declared group.
        var impliedScheme: String {
            guard let mode = mode, let data = data, let side = side, let output = output, output.count == 2 else {
                return "unknown"
            }
            switch mode {
            case .linear, .affine:
                let bits = data.dataType.bitWidth.map { "\(mode == .affine ? "u" : "")int\($0)" } ?? "\(data.dataType)"
                guard side.shape.count == 2, side.shape[0] == output[0], side.shape[1] > 0,
                      output[1] % side.shape[1] == 0 else {
                    return "\(mode) \(bits) with scale \(describe(side.shape.map { Int64(clamping: $0) })) fitting no block size"
                }
                return "\(mode) \(bits) " + (side.shape[1] == 1 ? "per output channel" : "block_size \(output[1] / side.shape[1])")
            case .palettize:
                let bits = data.dataType.bitWidth.map { "uint\($0)" } ?? "\(data.dataType)"
                guard side.shape.count == 4, side.shape[0] > 0, output[0] % side.shape[0] == 0 else {
                    return "palettize \(bits) with lut \(describe(side.shape.map { Int64(clamping: $0) })) fitting no group size"
                }
                return "palettize \(bits) group_size \(output[0] / side.shape[0]) with \(side.shape[2]) entries"
            case .none:
                return "none"
            }
        }
    }

    /// A distinct compressed weight: its data blob and the uses rebuilding it.
    struct Weight {
        var data: MILBlobReference
        var uses: [Int]
    }

    /// Groups the ops cannot tell apart, and the weights that belong to them.
    struct Pool {
        var groups: [Int]
        var weights: [Weight]
    }

    /// A 2-D fp16 `const` weight.
    struct PlainWeight {
        var function: String
        var functionName: String
        var name: String
        var shape: [UInt64]
        var blob: MILBlobReference
        var label: String { "\(function).\(name) \(describe(shape.map { Int64(clamping: $0) }))" }
    }

    let package: PackageInterface
    var program: MLProgram? { package.program }
    private(set) var uses: [Use] = []
    /// In order of first use.
    private(set) var weights: [Weight] = []
    private(set) var pools: [Pool] = []
    /// Weights of no declared group (malformed ops included).
    private(set) var unmatched: [Weight] = []
    /// Every 2-D fp16 const of every function.
    private(set) var fp16Weights: [PlainWeight] = []

    /// The distinct 2-D fp16 consts of at least `minimum` elements (metadata.json's
    /// `compression.min_compressible_elements`: the smallest the exporter compresses; nil, when
    /// the bundle does not record it: every size).
    func fp16Weights(ofAtLeast minimum: Int?) -> [PlainWeight] {
        var seen = Set<MILBlobReference>()
        return fp16Weights.filter {
            MILTensorType(dimensions: $0.shape.map(MILDimension.constant)).elementCount ?? .max >= UInt64(max(0, minimum ?? 0))
                && seen.insert($0.blob).inserted
        }
    }

    init(_ package: PackageInterface, groups: [CompressedGroup]) throws {
        self.package = package
        for function in package.program?.functions ?? [] {
            for specialization in function.blockSpecializations {
                let label = function.blockSpecializations.count == 1 ? function.name
                    : "\(function.name)[\(specialization.opset)]"
                for operation in specialization.block.allOperations {
                    if operation.type.hasPrefix(CompressionScheme.constexprPrefix) {
                        uses.append(Self.use(operation, function: label, functionName: function.name, groups: groups))
                    } else if operation.type == "const", let value = operation.attributes["val"], value.blob != nil,
                              let tensor = value.tensorType, tensor.dataType == .float16,
                              let shape = tensor.shape, shape.count == 2 {
                        fp16Weights.append(PlainWeight(function: label, functionName: function.name,
                                                       name: operation.outputs.first?.name ?? "?",
                                                       shape: shape, blob: value.blob!))
                    }
                }
            }
        }

        var byData: [MILBlobReference: Int] = [:]
        for (index, use) in uses.enumerated() {
            guard let data = use.data else {
                // Malformed: a weight of its own, of no group.
                unmatched.append(Weight(data: MILBlobReference(fileName: "", offset: 0), uses: [index]))
                continue
            }
            if let existing = byData[data.blob] {
                weights[existing].uses.append(index)
            } else {
                byData[data.blob] = weights.count
                weights.append(Weight(data: data.blob, uses: [index]))
            }
        }

        // Groups some weight could belong to both of are compared together (union-find).
        var parent = Array(groups.indices)
        func root(_ group: Int) -> Int {
            var node = group
            while parent[node] != node { node = parent[node] }
            return node
        }
        for weight in weights {
            let candidates = uses[weight.uses[0]].groups
            for other in candidates.dropFirst() { parent[root(other)] = root(candidates[0]) }
        }
        var poolOfRoot: [Int: Int] = [:]
        for group in groups.indices {
            let top = root(group)
            if let pool = poolOfRoot[top] {
                pools[pool].groups.append(group)
            } else {
                poolOfRoot[top] = pools.count
                pools.append(Pool(groups: [group], weights: []))
            }
        }
        for weight in weights {
            if let first = uses[weight.uses[0]].groups.first, let pool = poolOfRoot[root(first)] {
                pools[pool].weights.append(weight)
            } else {
                unmatched.append(weight)
            }
        }
    }

    private static func use(_ operation: MILOperation, function: String, functionName: String,
                            groups: [CompressedGroup]) -> Use {
        let mode = CompressionScheme.mode(of: operation)
        var use = Use(function: function, functionName: functionName, name: operation.outputs.first?.name ?? "?",
                      opType: operation.type, mode: mode)
        guard let mode = mode, let op = CompressionScheme.ops[mode] else {
            use.problems.append("op type \(operation.type) is not one a compression group stores "
                                + "(\(CompressionScheme.ops.values.map(\.type).sorted().joined(separator: " or ")))")
            return use
        }
        if operation.outputs.count != 1 {
            use.problems.append("it has \(operation.outputs.count) outputs, not 1")
        }
        if let output = operation.outputs.first?.tensorType, output.dataType == .float16,
           let shape = output.shape, shape.count == 2 {
            use.output = shape
        } else {
            use.problems.append("its output is not a 2-D fp16 tensor")
        }
        let names = operation.inputs.map(\.name).sorted()
        let expected = ([op.data, op.side] + (op.offset.map { [$0] } ?? [])).sorted()
        if names != expected {
            use.problems.append("its inputs are \(names), not exactly \(expected.joined(separator: ", "))")
        }
        func tensor(_ input: String) -> BlobTensor? {
            guard let arguments = operation.input(named: input), arguments.count == 1,
                  let value = arguments[0].value, let blob = value.blob, let type = value.tensorType,
                  let shape = type.shape else {
                if operation.input(named: input) != nil {
                    use.problems.append("input \(input) is not one inline tensor in a weight file blob")
                }
                return nil
            }
            return BlobTensor(dataType: type.dataType, shape: shape, blob: blob)
        }
        use.data = tensor(op.data)
        use.side = tensor(op.side)
        if let side = use.side, side.dataType != .float16 {
            use.problems.append("\(op.side) is \(side.dataType), not FLOAT16")
        }
        if let name = op.offset {
            use.offset = tensor(name)
            if let offset = use.offset, offset.dataType != .float16 {
                use.problems.append("\(name) is \(offset.dataType), not FLOAT16")
            }
            if let offset = use.offset, let side = use.side, offset.shape != side.shape {
                use.problems.append("\(name) \(offset.text) is not the shape of \(op.side) \(side.text)")
            }
        }
        if let data = use.data, let output = use.output, data.shape != output {
            use.problems.append("\(op.data) \(data.text) is not the output's shape \(describe(output.map { Int64(clamping: $0) }))")
        }
        guard use.problems.isEmpty, let data = use.data, let side = use.side, let output = use.output else { return use }
        use.groups = groups.indices.filter { index in
            let group = groups[index]
            return group.mode == mode
                && CompressionScheme.dataType(mode: mode, bits: group.bits) == data.dataType
                && CompressionScheme.sideShape(of: group, weight: output) == side.shape
        }
        return use
    }

    /// The headers of every blob the compressed weights name, each file opened once. A file
    /// that cannot be opened or resolved fails the property that asked.
    func readHeaders() throws -> [MILBlobReference: Result<BlobHeader, WeightFileError>] {
        var offsetsByFile: [String: Set<UInt64>] = [:]
        for use in uses {
            for (_, tensor) in use.blobs {
                offsetsByFile[tensor.blob.fileName, default: []].insert(tensor.blob.offset)
            }
        }
        guard !offsetsByFile.isEmpty else { return [:] }
        guard let modelURL = package.modelURL else {
            throw Violation(detail: "not checked: the package's model spec file is not known, so its weight files are not either")
        }
        var headers: [MILBlobReference: Result<BlobHeader, WeightFileError>] = [:]
        for (fileName, offsets) in offsetsByFile.sorted(by: { $0.key < $1.key }) {
            do {
                let url = try WeightFile.url(forBlobFile: fileName, modelURL: modelURL, packageURL: package.url)
                for (offset, header) in try WeightFile.readHeaders(at: offsets, of: url) {
                    headers[MILBlobReference(fileName: fileName, offset: offset)] = header
                }
            } catch let error as WeightFileError {
                throw Violation(detail: "\(error)")
            }
        }
        return headers
    }
}
