import Foundation

// ML programs and weight files for synthetic packages, and the compressed export built from
// them. Field numbers and enum values are written out literally (checked against coremltools
// 9.0's MIL_pb2 and MILBlob's BlobDataType.hpp) rather than taken from the module under test.

/// Test-side encoder for MIL.proto messages.
public enum MILBytes {
    // MIL.proto DataType values.
    public static let float16: Int64 = 10
    public static let int4: Int64 = 25
    public static let int8: Int64 = 21
    public static let int32: Int64 = 23
    public static let uint4: Int64 = 35
    public static let uint8: Int64 = 31

    public static let weightFileName = "@model_path/weights/weight.bin"

    public static func tensorType(_ dataType: Int64, _ shape: [Int64]) -> [UInt8] {
        SpecBytes.int(1, dataType)                                        // TensorType.dataType
            + SpecBytes.int(2, Int64(shape.count))                        // TensorType.rank
            + shape.flatMap {
                SpecBytes.message(3, SpecBytes.message(1, SpecBytes.int(1, $0)))  // dimensions -> constant -> size
            }
    }

    public static func valueType(_ tensor: [UInt8]) -> [UInt8] {
        SpecBytes.message(1, tensor)                                      // ValueType.tensorType
    }

    public static func blobValue(_ dataType: Int64, _ shape: [Int64], offset: UInt64,
                                 fileName: String = weightFileName) -> [UInt8] {
        SpecBytes.message(2, valueType(tensorType(dataType, shape)))      // Value.type
            + SpecBytes.message(5, SpecBytes.string(1, fileName)          // Value.blobFileValue.fileName
                                + SpecBytes.int(2, Int64(offset)))        // Value.blobFileValue.offset
    }

    /// An int32 scalar given inline; its contents are never read.
    public static var immediateScalar: [UInt8] {
        SpecBytes.message(2, valueType(tensorType(int32, [])))           // Value.type
            + SpecBytes.message(3, SpecBytes.message(1,                   // Value.immediateValue.tensor
                SpecBytes.message(3, SpecBytes.packed(1, [1]))))          // TensorValue.ints.values
    }

    public static func namedValueType(_ name: String, _ dataType: Int64, _ shape: [Int64]) -> [UInt8] {
        SpecBytes.string(1, name) + SpecBytes.message(2, valueType(tensorType(dataType, shape)))
    }

    /// A map entry (key 1, value 2).
    public static func entry(_ key: String, _ value: [UInt8]) -> [UInt8] {
        SpecBytes.string(1, key) + SpecBytes.message(2, value)
    }

    public enum Binding {
        case name(String)
        case value([UInt8])
    }

    public static func operation(_ type: String, inputs: [(String, [Binding])] = [], outputs: [[UInt8]],
                                 attributes: [(String, [UInt8])] = [], blocks: [[UInt8]] = []) -> [UInt8] {
        SpecBytes.string(1, type)                                         // Operation.type
            + inputs.flatMap { name, bindings in
                SpecBytes.message(2, entry(name, bindings.flatMap { binding -> [UInt8] in  // Operation.inputs
                    switch binding {
                    case .name(let text): return SpecBytes.message(1, SpecBytes.string(1, text))  // Argument.arguments: Binding.name
                    case .value(let value): return SpecBytes.message(1, SpecBytes.message(2, value))  // Binding.value
                    }
                }))
            }
            + outputs.flatMap { SpecBytes.message(3, $0) }                // Operation.outputs
            + blocks.flatMap { SpecBytes.message(4, $0) }                 // Operation.blocks
            + attributes.flatMap { SpecBytes.message(5, entry($0.0, $0.1)) }  // Operation.attributes
    }

    public static func block(operations: [[UInt8]], outputs: [String] = []) -> [UInt8] {
        operations.flatMap { SpecBytes.message(3, $0) }                  // Block.operations
            + outputs.flatMap { SpecBytes.string(2, $0) }                 // Block.outputs
    }

    public static func function(opset: String = "CoreML8", block: [UInt8], inputs: [[UInt8]] = []) -> [UInt8] {
        inputs.flatMap { SpecBytes.message(1, $0) }                       // Function.inputs
            + SpecBytes.string(2, opset)                                  // Function.opset
            + SpecBytes.message(3, entry(opset, block))                   // Function.block_specializations
    }

    public static func program(_ functions: [(String, [UInt8])]) -> [UInt8] {
        SpecBytes.int(1, 1)                                               // Program.version
            + functions.flatMap { SpecBytes.message(2, entry($0.0, $0.1)) }  // Program.functions
    }
}

/// A weight.bin as MILBlob writes it: a 64-byte file header (blob count, version 2), then per
/// blob a 64-byte header (sentinel, dtype, size, data offset) and its data, each 64-aligned.
public struct WeightFileBuilder {
    // MILBlob BlobDataType values.
    public static let float16: UInt32 = 1
    public static let uint8: UInt32 = 3
    public static let int8: UInt32 = 4
    public static let int4: UInt32 = 8
    public static let uint4: UInt32 = 11

    public private(set) var bytes: [UInt8] = Self.little(UInt32(0)) + Self.little(UInt32(2)) + Array(repeating: 0, count: 56)
    public private(set) var count: UInt32 = 0

    public init() {}

    public static func little<T: FixedWidthInteger>(_ value: T) -> [UInt8] {
        (0..<MemoryLayout<T>.size).map { UInt8(truncatingIfNeeded: value >> ($0 * 8)) }
    }

    /// Appends a blob of `size` data bytes and returns the offset of its header.
    public mutating func append(dataType: UInt32, size: Int) -> UInt64 {
        let offset = UInt64(bytes.count)
        let header = Self.little(UInt32(0xDEAD_BEEF)) + Self.little(dataType) + Self.little(UInt64(size))
            + Self.little(offset + 64)
        bytes += header + Array(repeating: 0, count: 64 - header.count)
        bytes += (0..<size).map { UInt8(truncatingIfNeeded: $0 &* 31 &+ Int(count)) }
        bytes += Array(repeating: 0, count: (64 - bytes.count % 64) % 64)
        count += 1
        bytes.replaceSubrange(0..<4, with: Self.little(count))
        return offset
    }
}

/// One weight of a package's program: an fp16 `const` or a compressed constexpr op.
public struct WeightSpec {
    public enum Storage: Equatable {
        case fp16
        case linear(bits: Int, blockSize: Int?)
        /// Unsigned data with an fp16 offset beside each scale.
        case affine(bits: Int, blockSize: Int?)
        case palettize(bits: Int, groupSize: Int)
    }

    /// The op's output name.
    public var name: String
    /// The checkpoint tensor it comes from (metadata only: a weight two packages share has one key).
    public var key: String
    /// `[O, I]`.
    public var shape: [Int64]
    public var storage: Storage
    /// Index of the metadata rule that decided it (metadata only); nil for fp16.
    public var rule: Int?

    public init(_ name: String, key: String, _ shape: [Int64], _ storage: Storage, rule: Int? = nil) {
        self.name = name
        self.key = key
        self.shape = shape
        self.storage = storage
        self.rule = rule
    }

    /// MIL and blob dtypes of the data (indices), nil for fp16.
    public var dataType: (mil: Int64, blob: UInt32)? {
        switch storage {
        case .fp16: return nil
        case .linear(let bits, _): return bits == 4 ? (MILBytes.int4, WeightFileBuilder.int4) : (MILBytes.int8, WeightFileBuilder.int8)
        case .affine(let bits, _), .palettize(let bits, _): return bits == 4 ? (MILBytes.uint4, WeightFileBuilder.uint4) : (MILBytes.uint8, WeightFileBuilder.uint8)
        }
    }

    /// The scale (`[O, I / block]`, `[O, 1]` per channel) or look-up table (`[O / group, 1, 2^bits, 1]`) shape.
    public var sideShape: [Int64]? {
        switch storage {
        case .fp16: return nil
        case .linear(_, let block), .affine(_, let block): return [shape[0], block.map { shape[1] / Int64($0) } ?? 1]
        case .palettize(let bits, let group): return [shape[0] / Int64(group), 1, 1 << Int64(bits), 1]
        }
    }

    public var bits: Int? {
        switch storage {
        case .fp16: return nil
        case .linear(let bits, _), .affine(let bits, _), .palettize(let bits, _): return bits
        }
    }

    public var elements: Int { Int(shape[0] * shape[1]) }
    public var dataBytes: Int { (elements * (bits ?? 16) + 7) / 8 }
    public var sideBytes: Int { 2 * Int(sideShape?.reduce(1, *) ?? 0) }
    /// The offsets of an affine weight (the scales' shape), nil otherwise.
    public var offsetBytes: Int? {
        if case .affine = storage { return sideBytes }
        return nil
    }
    /// What the exporter counts as its stored bytes: data plus scales (and offsets) or look-up
    /// table (fp16: its data).
    public var storedBytes: Int { bits == nil ? 2 * elements : dataBytes + sideBytes + (offsetBytes ?? 0) }

    var opType: String? {
        switch storage {
        case .fp16: return nil
        case .linear, .affine: return "constexpr_blockwise_shift_scale"
        case .palettize: return "constexpr_lut_to_dense"
        }
    }

    var inputNames: (data: String, side: String) {
        if case .palettize = storage { return ("indices", "lut") }
        return ("data", "scale")
    }
}

extension PackageSpec {
    /// Where each weight's blobs are in weight.bin.
    public struct BlobOffsets {
        public var data: UInt64?
        public var side: UInt64?
        public var offset: UInt64?
        /// The fp16 blob of a weight stored (in some function) as a plain const.
        public var fp16: UInt64?
    }

    public struct Storage {
        /// The body of `Model.mlProgram`; empty when the package has no weights.
        public var program: [UInt8]
        public var weightFile: [UInt8]
        /// Weight name -> its blobs.
        public var offsets: [String: BlobOffsets]
    }

    /// The ML program and weight file of `weights`; every function uses the same blobs.
    public func storage() -> Storage {
        guard !weights.isEmpty else { return Storage(program: [], weightFile: [], offsets: [:]) }
        var file = WeightFileBuilder()
        var offsets: [String: BlobOffsets] = [:]
        for weight in weights {
            var blobs = BlobOffsets()
            if let dataType = weight.dataType {
                blobs.data = file.append(dataType: dataType.blob, size: weight.dataBytes)
                blobs.side = file.append(dataType: WeightFileBuilder.float16, size: weight.sideBytes)
                if let bytes = weight.offsetBytes {
                    blobs.offset = file.append(dataType: WeightFileBuilder.float16, size: bytes)
                }
            }
            if weight.storage == .fp16 || functions.contains(where: { $0.plainWeights.contains(weight.name) }) {
                blobs.fp16 = file.append(dataType: WeightFileBuilder.float16, size: 2 * weight.elements)
            }
            offsets[weight.name] = blobs
        }
        let program = MILBytes.program(functions.map { function in
            let used = weights.filter { function.weightNames?.contains($0.name) ?? true }
            var operations: [[UInt8]] = [
                MILBytes.operation("const", outputs: [MILBytes.namedValueType("axis_0", MILBytes.int32, [])],
                                   attributes: [("val", MILBytes.immediateScalar)]),
            ]
            for weight in used {
                let blobs = offsets[weight.name]!
                let opName = function.opNames[weight.name] ?? weight.name
                let output = MILBytes.namedValueType(opName, MILBytes.float16, weight.shape)
                if let type = weight.opType, !function.plainWeights.contains(weight.name),
                   let dataType = weight.dataType, let side = weight.sideShape {
                    let names = weight.inputNames
                    operations.append(MILBytes.operation(type, inputs: [
                        (names.data, [.value(MILBytes.blobValue(dataType.mil, weight.shape, offset: blobs.data!))]),
                        (names.side, [.value(MILBytes.blobValue(MILBytes.float16, side, offset: blobs.side!))]),
                    ] + (blobs.offset.map { [("offset", [.value(MILBytes.blobValue(MILBytes.float16, side, offset: $0))])] } ?? []),
                    outputs: [output]))
                } else {
                    operations.append(MILBytes.operation("const", outputs: [output], attributes: [
                        ("val", MILBytes.blobValue(MILBytes.float16, weight.shape, offset: blobs.fp16!)),
                    ]))
                }
                operations.append(MILBytes.operation("matmul", inputs: [
                    ("x", [.name(function.inputs.first?.name ?? "x")]), ("y", [.name(opName)]),
                ], outputs: [MILBytes.namedValueType(opName + "_product", MILBytes.float16, [1, weight.shape[0]])]))
            }
            let inputs = function.inputs.map { MILBytes.namedValueType($0.name, MILBytes.int32, $0.shape) }
            let block = MILBytes.block(operations: operations, outputs: function.outputs.map(\.name))
            return (function.name, MILBytes.function(block: block, inputs: inputs))
        })
        return Storage(program: program, weightFile: file.bytes, offsets: offsets)
    }
}

// MARK: The compressed export

extension SyntheticExport {
    /// Linear int8 per channel for the embedding and the head (two groups the ops cannot tell
    /// apart), palettized down projections, linear int4 in blocks of 8 for the rest.
    public static let compressionRules: [[String: Any]] = [
        ["match": "*embed_tokens.weight", "mode": "linear", "bits": 8, "block_size": NSNull(), "group_size": NSNull()],
        ["match": "lm_head.weight", "mode": "linear", "bits": 8, "block_size": NSNull(), "group_size": NSNull()],
        ["match": "*mlp.down_proj*", "mode": "palettize", "bits": 4, "block_size": NSNull(), "group_size": 4],
        ["match": "*", "mode": "linear", "bits": 4, "block_size": 8, "group_size": NSNull()],
    ]

    private static let hidden = Size.hidden

    public static var compressedTargetWeights: [WeightSpec] {
        [
            WeightSpec("p_embed_tokens_weight", key: "embed_tokens.weight", [Size.vocab, hidden], .linear(bits: 8, blockSize: nil), rule: 0),
            WeightSpec("p_layers_0_self_attn_q_proj_weight", key: "layers.0.self_attn.q_proj.weight", [hidden, hidden], .fp16),
            WeightSpec("p_layers_0_mlp_gate_proj_weight", key: "layers.0.mlp.gate_proj.weight", [2 * hidden, hidden],
                       .linear(bits: 4, blockSize: 8), rule: 3),
            WeightSpec("p_layers_0_mlp_up_proj_weight", key: "layers.0.mlp.up_proj.weight", [2 * hidden, hidden],
                       .linear(bits: 4, blockSize: 8), rule: 3),
            WeightSpec("p_layers_0_mlp_down_proj_weight", key: "layers.0.mlp.down_proj.weight", [hidden, 2 * hidden],
                       .palettize(bits: 4, groupSize: 4), rule: 2),
            WeightSpec("p_lm_head_weight", key: "lm_head.weight", [Size.vocab, hidden], .linear(bits: 8, blockSize: nil), rule: 1),
        ]
    }

    /// The separate drafter package's weights (before schema version 3): it stores its own copy
    /// of the target's embedding (the same checkpoint key); `inject_kv` uses only `p_fc_weight`.
    public static var compressedDrafterWeights: [WeightSpec] {
        [
            WeightSpec("p_embed_tokens_weight", key: "embed_tokens.weight", [Size.vocab, hidden], .linear(bits: 8, blockSize: nil), rule: 0),
            WeightSpec("p_fc_weight", key: "drafter/fc.weight", [hidden, 2 * hidden], .linear(bits: 4, blockSize: 8), rule: 3),
            WeightSpec("p_layers_0_mlp_down_proj_weight", key: "drafter/layers.0.mlp.down_proj.weight", [hidden, 2 * hidden],
                       .palettize(bits: 4, groupSize: 4), rule: 2),
        ]
    }

    /// The weights only the drafter has, which the package it shares with the target (schema
    /// version 3) stores besides the target's; the embedding and the head are the target's,
    /// stored once.
    public static var compressedDrafterOwnWeights: [WeightSpec] {
        [
            WeightSpec("p_fc_weight", key: "drafter/fc.weight", [hidden, 2 * hidden], .linear(bits: 4, blockSize: 8), rule: 3),
            WeightSpec("p_drafter_layers_0_mlp_down_proj_weight", key: "drafter/layers.0.mlp.down_proj.weight",
                       [hidden, 2 * hidden], .palettize(bits: 4, groupSize: 4), rule: 2),
        ]
    }

    /// `fusedTargetWithDFlashDrafter` (schema 3: one package) with its weights stored as
    /// `compressionRules` say, and metadata.json declaring them under the owner `target`. `main`
    /// and `prefill` use the target's weights, `inject_kv` only `p_fc_weight`, `draft` the
    /// target's embedding and head and the drafter's own weights.
    public static func compressedFusedTargetWithDFlashDrafter() -> SyntheticExport {
        var export = fusedTargetWithDFlashDrafter()
        let targetNames = compressedTargetWeights.map(\.name)
        export.packages["target"]?.weights = compressedTargetWeights + compressedDrafterOwnWeights
        for name in ["main", "prefill"] {
            export.editFunction(role: "target", name) { $0.weightNames = targetNames }
        }
        export.editFunction(role: "dflash_drafter", "inject_kv") { $0.weightNames = ["p_fc_weight"] }
        export.editFunction(role: "dflash_drafter", "draft") {
            $0.weightNames = ["p_embed_tokens_weight", "p_lm_head_weight"] + compressedDrafterOwnWeights.map(\.name)
        }
        export.declareCompression()
        return export
    }

    /// `fusedTargetWithSeparateDFlashDrafter` (schema 2: a package per asset) with its weights
    /// stored as `compressionRules` say: the embedding is stored by both packages.
    public static func compressedFusedTargetWithSeparateDFlashDrafter() -> SyntheticExport {
        var export = fusedTargetWithSeparateDFlashDrafter(schemaVersion: 2)
        export.packages["target"]?.weights = compressedTargetWeights
        export.packages["dflash_drafter"]?.weights = compressedDrafterWeights
        export.editFunction(role: "dflash_drafter", "inject_kv") { $0.weightNames = ["p_fc_weight"] }
        export.declareCompression()
        return export
    }

    /// Sets metadata.json's `compression` to what the packages' weights are (as the exporter
    /// counts them: per group of rule and scheme, distinct checkpoint keys; per package under
    /// its key in `packages`, the owner role).
    public mutating func declareCompression(preset: String? = nil) {
        struct Group {
            var rule: Int
            var weight: WeightSpec
            var unique: [String: (before: Int, after: Int)] = [:]
            var packages: [String: (tensors: Int, bytes: Int)] = [:]
        }
        var groups: [Group] = []
        var fp16: [String: Int] = [:]
        for role in packages.keys.sorted() {
            for weight in packages[role]!.weights {
                guard let rule = weight.rule, weight.storage != .fp16 else {
                    fp16[weight.key] = 2 * weight.elements
                    continue
                }
                var index = groups.firstIndex { $0.rule == rule && $0.weight.storage == weight.storage }
                if index == nil {
                    groups.append(Group(rule: rule, weight: weight))
                    index = groups.count - 1
                }
                groups[index!].unique[weight.key] = (2 * weight.elements, weight.storedBytes)
                let (tensors, bytes) = groups[index!].packages[role] ?? (0, 0)
                groups[index!].packages[role] = (tensors + 1, bytes + weight.storedBytes)
            }
        }
        groups.sort { $0.rule < $1.rule }
        setMetadata(["compression"], to: [
            "preset": preset ?? NSNull(),
            "rules": Self.compressionRules,
            "groups": groups.map { group -> [String: Any] in
                var scheme: [String: Any] = ["block_size": NSNull(), "group_size": NSNull()]
                switch group.weight.storage {
                case .linear(let bits, let block), .affine(let bits, let block):
                    if case .affine = group.weight.storage { scheme["mode"] = "affine" } else { scheme["mode"] = "linear" }
                    scheme["bits"] = bits
                    scheme["block_size"] = block ?? NSNull()
                case .palettize(let bits, let size):
                    scheme["mode"] = "palettize"
                    scheme["bits"] = bits
                    scheme["group_size"] = size
                case .fp16:
                    break
                }
                return scheme.merging([
                    "rule": group.rule,
                    "tensors": group.unique.count,
                    "bytes_before": group.unique.values.map(\.before).reduce(0, +),
                    "bytes_after": group.unique.values.map(\.after).reduce(0, +),
                    "packages": group.packages.mapValues { ["tensors": $0.tensors, "bytes": $0.bytes] },
                ]) { first, _ in first }
            },
            "fp16_tensors": fp16.count,
            "fp16_bytes": fp16.values.reduce(0, +),
        ] as [String: Any])
    }

    /// Edits `compression.groups[index]` of metadata.json (every package embeds the same text).
    public mutating func editCompressionGroup(_ index: Int, _ edit: (inout [String: Any]) -> Void) {
        var compression = metadata["compression"] as! [String: Any]
        var groups = compression["groups"] as! [[String: Any]]
        edit(&groups[index])
        compression["groups"] = groups
        metadata["compression"] = compression
    }

    /// The index of the group of `rule` in metadata.json.
    public func compressionGroupIndex(rule: Int) -> Int {
        let groups = (metadata["compression"] as! [String: Any])["groups"] as! [[String: Any]]
        return groups.firstIndex { $0["rule"] as? Int == rule }!
    }

    /// Edits weight `name` of the package `role`'s asset is stored in.
    public mutating func editWeight(role: String, _ name: String, _ edit: (inout WeightSpec) -> Void) {
        let key = packageKey(role: role)
        guard var package = packages[key], let index = package.weights.firstIndex(where: { $0.name == name }) else {
            preconditionFailure("no weight \(name) in \(role)")
        }
        edit(&package.weights[index])
        packages[key] = package
    }
}
