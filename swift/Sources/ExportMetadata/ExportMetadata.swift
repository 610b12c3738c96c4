/// `metadata.json`, schema versions 1, 2 and 3, as docs/metadata.md defines it (2 adds
/// `compression`; a version-1 document is one without it). 3 adds no key but changes the
/// rules: assets may share a package (the fused target and the DFlash drafter are one
/// multifunction package, every weight stored once; see `packages`), the DFlash drafter's
/// states are `drafterKeyCache`/`drafterValueCache`, and `compression.groups[i].packages` names
/// only package owners.
///
/// Compatibility rules (shared with the Python reader, python/museflash/bundle.py):
/// `schema_version` is the major version, and a version not in `supportedSchemaVersions` is
/// rejected (`isSchemaVersionSupported`); object keys the schema does not name are ignored at
/// every level, so later additive fields still decode; enumerated names (the `ContractName`
/// enums below) are closed, so an unknown one is a decoding error naming its key path.
public struct ExportMetadata: Codable, Equatable, Sendable {
    public static let supportedSchemaVersions = [1, 2, 3]
    /// The first schema version with `compression`.
    public static let compressionSchemaVersion = 2
    /// The first schema version in which assets may share a package (`packages`).
    public static let sharedPackageSchemaVersion = 3

    public var schemaVersion: Int
    public var generator: Generator
    public var modelName: String
    public var vocabSize: Int
    public var contextLength: Int
    public var computePrecision: String
    public var target: TargetSettings
    public var assets: [AssetRole: Asset]
    public var speculativeDecoding: SpeculativeDecoding?
    public var source: Source
    /// Nil (null or absent) when the target checkpoint had no tokenizer.
    public var tokenizer: Tokenizer?
    /// Nil (null or absent) when every weight is stored fp16.
    public var compression: Compression?
    /// How `main` and `prefill` write the global KV caches; nil (null or absent, bundles written
    /// before the field) is `.blend`. Every strategy computes the same, so a runtime needs it
    /// only to check the bundle (docs/kv-write.md).
    public var kvWrite: KVWrite?

    /// `kvWrite`, absent meaning the blend.
    public var kvWriteStrategy: KVWrite { kvWrite ?? .blend }

    enum CodingKeys: String, CodingKey {
        case schemaVersion = "schema_version"
        case generator
        case modelName = "model_name"
        case vocabSize = "vocab_size"
        case contextLength = "context_length"
        case computePrecision = "compute_precision"
        case target
        case assets
        case speculativeDecoding = "speculative_decoding"
        case source
        case tokenizer
        case compression
        case kvWrite = "kv_write"
    }

    public struct Generator: Codable, Equatable, Sendable {
        public var name: String
        public var version: String
    }

    public struct TargetSettings: Codable, Equatable, Sendable {
        public var numHiddenLayers: Int
        public var hiddenSize: Int
        public var numAttentionHeads: Int
        public var numKeyValueHeads: Int
        public var headDim: Int
        public var slidingWindow: Int
        /// One per layer.
        public var layerTypes: [LayerType]
        public var finalLogitSoftcapping: Double?

        enum CodingKeys: String, CodingKey {
            case numHiddenLayers = "num_hidden_layers"
            case hiddenSize = "hidden_size"
            case numAttentionHeads = "num_attention_heads"
            case numKeyValueHeads = "num_key_value_heads"
            case headDim = "head_dim"
            case slidingWindow = "sliding_window"
            case layerTypes = "layer_types"
            case finalLogitSoftcapping = "final_logit_softcapping"
        }
    }

    public struct Asset: Codable, Equatable, Sendable {
        /// Relative to the export directory. From schema version 3 several assets may name the
        /// same package (see `ExportMetadata.packages`).
        public var path: String
        public var kind: AssetKind
        /// One of `functions`. The package's default function is its owner's.
        public var defaultFunction: FunctionName
        /// This asset's functions only, also in a package it shares.
        public var functions: [FunctionName: Function]
        /// Shared by every function of this asset (in a shared package, not by the other
        /// assets' functions).
        public var states: [State]
        /// Smaller context buckets, ascending, each with its own copies of some `functions`
        /// (docs/buckets.md); nil (absent) when the asset has none.
        public var buckets: [ContextBucket]?
        /// The target's one-token copy of a multi-token `main`, for steps that decode with the
        /// target alone: the Core ML function `decode` (and `decode_<context>` in each bucket
        /// listing it); nil (absent) when there is none. Kept out of `functions` so that readers
        /// which predate it ignore it.
        public var decode: Function?
        /// The target's verify of a token tree of `queryLength` nodes (docs/trees.md): main's
        /// inputs and `tree_mask`, main's outputs; the Core ML function `tree` (and
        /// `tree_<context>` in each bucket with a `tree`); nil (absent) when there is none.
        public var tree: Function?

        enum CodingKeys: String, CodingKey {
            case path, kind
            case defaultFunction = "default_function"
            case functions, states, buckets, decode, tree
        }

        /// The functions over the whole capacity: `functions`, and `decode` and `tree` when
        /// there are.
        public var ownFunctions: [FunctionName: Function] {
            var own = functions
            if let decode { own[.decode] = decode }
            if let tree { own[.tree] = tree }
            return own
        }

        /// Slots of this asset's states of `kind` (nil when it has none).
        public func capacity(_ kind: StateKind) -> Int? {
            states.first { $0.kind == kind }?.capacity
        }

        /// Every Core ML function of this asset: each bucket's, smallest bucket first, then
        /// those over the whole capacity (in `FunctionName` order). The one table the engine
        /// and check-contract read, as python/museflash/bundle.py `Asset.function_table`.
        public var functionTable: [FunctionEntry] {
            let ordered = FunctionName.allCases
            var rows: [FunctionEntry] = []
            for bucket in buckets ?? [] {
                let functions = bucket.allFunctions
                for name in ordered { if let spec = functions[name] {
                    rows.append(FunctionEntry(name: ContextBucket.functionName(name, context: bucket.context),
                                              function: name, context: bucket.context, spec: spec))
                } }
            }
            let own = ownFunctions
            for name in ordered { if let spec = own[name] {
                rows.append(FunctionEntry(name: name.rawValue, function: name, context: nil, spec: spec))
            } }
            return rows
        }

        /// Slots of the asset's largest states: the target's global caches, a full-attention
        /// drafter's ring (as long as the context). What a context bucket slices.
        public var contextCapacity: Int? { states.map(\.capacity).max() }

        /// The function `name` of the smallest bucket holding `lastPosition` (a call's last
        /// position), or the one over the whole capacity; nil when the asset has no such
        /// function, or has buckets and the position is past its context-sized caches.
        public func pick(_ name: FunctionName, lastPosition: Int) -> FunctionEntry? {
            if buckets?.isEmpty == false, let capacity = contextCapacity, lastPosition >= capacity { return nil }
            return functionTable.first { $0.function == name && ($0.context.map { lastPosition < $0 } ?? true) }
        }

        /// Why the function table breaks the contract (buckets not ascending or outside the
        /// capacity, a bucket function that differs from the asset's own, a `decode` that is
        /// not a one-token copy of `main` or is listed among `functions`); nil when it keeps it.
        public var bucketProblem: String? {
            if functions[.decode] != nil {
                return "`decode` is listed among the functions; it belongs under the asset's `decode` key, which older readers ignore"
            }
            if functions[.tree] != nil || (buckets ?? []).contains(where: { $0.functions[.tree] != nil }) {
                return "`tree` is listed among the functions; it belongs under the `tree` key, which older readers ignore"
            }
            if let decode {
                guard let main = functions[.main], decode == Function(role: main.role, queryLength: 1, inputs: main.inputs, outputs: main.outputs) else {
                    return "decode is not a one-token copy of main"
                }
            }
            if let tree {
                guard let main = functions[.main], tree.queryLength >= 2,
                      tree == Function(role: .tree, queryLength: tree.queryLength, inputs: main.inputs + [.treeMask], outputs: main.outputs) else {
                    return "tree is not main's verify with a tree_mask over 2 or more nodes"
                }
            }
            let contexts = (buckets ?? []).map(\.context)
            guard contexts == Array(Set(contexts)).sorted() else {
                return "bucket contexts \(contexts) are not strictly ascending"
            }
            let capacity = contextCapacity
            for bucket in buckets ?? [] {
                guard let capacity, bucket.context > 0, bucket.context < capacity else {
                    return "the bucket of \(bucket.context) slots is not inside the context-sized caches' capacity (\(capacity.map(String.init) ?? "none"))"
                }
                for (name, spec) in bucket.allFunctions where ownFunctions[name] != spec {
                    return "the bucket of \(bucket.context) slots has a function \(name.rawValue) that differs from (or is missing among) the asset's own"
                }
            }
            return nil
        }
    }

    /// Functions that attend to the global caches' first `context` slots only and write only
    /// there: a call whose last position is below `context` may run one of them instead of the
    /// function of the same name over the whole capacity, with the same result.
    public struct ContextBucket: Codable, Equatable, Sendable {
        public var context: Int
        public var functions: [FunctionName: Function]
        /// The asset's `tree` in this bucket (`tree_<context>`); nil (absent) when it has none.
        public var tree: Function?

        public init(context: Int, functions: [FunctionName: Function], tree: Function? = nil) {
            self.context = context
            self.functions = functions
            self.tree = tree
        }

        /// `functions`, and `tree` when there is one.
        public var allFunctions: [FunctionName: Function] {
            var all = functions
            if let tree { all[.tree] = tree }
            return all
        }

        /// The Core ML name of `function` in the bucket of `context` slots: `<name>_<context>`.
        public static func functionName(_ function: FunctionName, context: Int) -> String {
            "\(function.rawValue)_\(context)"
        }
    }

    /// One row of an asset's function table: a Core ML function of its package, what it
    /// computes, and the global cache slots it attends to (nil: the whole capacity).
    public struct FunctionEntry: Equatable, Sendable {
        public var name: String
        public var function: FunctionName
        public var context: Int?
        public var spec: Function
    }

    public struct Function: Codable, Equatable, Sendable {
        public var role: FunctionRole
        public var queryLength: Int
        /// In order.
        public var inputs: [InputName]
        /// In order.
        public var outputs: [OutputName]

        enum CodingKeys: String, CodingKey {
            case role
            case queryLength = "query_length"
            case inputs, outputs
        }
    }

    public struct State: Codable, Equatable, Sendable {
        public var name: StateName
        public var kind: StateKind
        public var role: StateRole
        /// The exact Core ML state shape: `[layers, kv_heads, capacity, head_dim]`,
        /// possibly preceded by 1s.
        public var shape: [Int]
        public var dtype: String
        public var layers: Int
        public var kvHeads: Int
        public var capacity: Int
        public var headDim: Int

        enum CodingKeys: String, CodingKey {
            case name, kind, role, shape, dtype, layers
            case kvHeads = "kv_heads"
            case capacity
            case headDim = "head_dim"
        }
    }

    public struct SpeculativeDecoding: Codable, Equatable, Sendable {
        public var drafterKind: DrafterKind
        public var blockSize: Int
        public var maskTokenId: Int
        public var targetLayerIds: [Int]
        public var drafterHiddenSize: Int
        public var numDraftTokens: Int
        public var sharedEmbeddings: Bool
        public var drafter: DrafterSettings
        /// The DFlash2 drafter's settings; nil (null or absent) for every other drafter kind.
        public var dflash2: DFlash2Settings?

        enum CodingKeys: String, CodingKey {
            case drafterKind = "drafter_kind"
            case blockSize = "block_size"
            case maskTokenId = "mask_token_id"
            case targetLayerIds = "target_layer_ids"
            case drafterHiddenSize = "drafter_hidden_size"
            case numDraftTokens = "num_draft_tokens"
            case sharedEmbeddings = "shared_embeddings"
            case drafter
            case dflash2
        }
    }

    public struct DrafterSettings: Codable, Equatable, Sendable {
        public var numHiddenLayers: Int
        public var numAttentionHeads: Int
        public var numKeyValueHeads: Int
        public var headDim: Int
        public var slidingWindow: Int

        enum CodingKeys: String, CodingKey {
            case numHiddenLayers = "num_hidden_layers"
            case numAttentionHeads = "num_attention_heads"
            case numKeyValueHeads = "num_key_value_heads"
            case headDim = "head_dim"
            case slidingWindow = "sliding_window"
        }
    }

    /// `speculative_decoding.dflash2`: what a DFlash2 drafter adds to a DFlash one. Its `draft`
    /// also outputs `draft_tokens`, the greedy path of its candidate selector.
    public struct DFlash2Settings: Codable, Equatable, Sendable {
        /// At most `block_size`.
        public var convKernelSize: Int
        /// Divides `drafter_hidden_size`.
        public var convGroupSize: Int
        public var selectorRank: Int
        /// At most `vocab_size`.
        public var selectorTopK: Int
        public var selectorDecoding: SelectorDecoding
        /// Finite and positive.
        public var outputMultiplier: Double
        /// The drafter's logit soft cap, positive; nil (null) for none.
        public var finalLogitSoftcapping: Double?

        public init(convKernelSize: Int, convGroupSize: Int, selectorRank: Int, selectorTopK: Int,
                    selectorDecoding: SelectorDecoding, outputMultiplier: Double, finalLogitSoftcapping: Double?) {
            self.convKernelSize = convKernelSize
            self.convGroupSize = convGroupSize
            self.selectorRank = selectorRank
            self.selectorTopK = selectorTopK
            self.selectorDecoding = selectorDecoding
            self.outputMultiplier = outputMultiplier
            self.finalLogitSoftcapping = finalLogitSoftcapping
        }

        enum CodingKeys: String, CodingKey {
            case convKernelSize = "conv_kernel_size"
            case convGroupSize = "conv_group_size"
            case selectorRank = "selector_rank"
            case selectorTopK = "selector_top_k"
            case selectorDecoding = "selector_decoding"
            case outputMultiplier = "output_multiplier"
            case finalLogitSoftcapping = "final_logit_softcapping"
        }
    }

    public struct Source: Codable, Equatable, Sendable {
        public var checkpoint: String
        /// The schema does not say whether this key is present when no
        /// drafter was exported, so its absence is accepted.
        public var drafterCheckpoint: String?

        enum CodingKeys: String, CodingKey {
            case checkpoint
            case drafterCheckpoint = "drafter_checkpoint"
        }
    }
}

extension ExportMetadata {
    /// The target checkpoint's Hugging Face tokenizer files, copied into the export.
    public struct Tokenizer: Codable, Equatable, Sendable {
        /// Relative to the export directory; `tokenizer.json` first.
        public var files: [String]
        /// Ids the tokenizer can produce, added tokens included; equals the bundle's `vocab_size`.
        public var vocabSize: Int
        /// Special token text -> id.
        public var specialTokens: [String: Int]
        /// Ids that end a reply (eos and the chat template's end-of-turn token); nil in
        /// bundles written before the field existed.
        public var endOfTurnIds: [Int]?

        public init(files: [String], vocabSize: Int, specialTokens: [String: Int], endOfTurnIds: [Int]? = nil) {
            self.files = files
            self.vocabSize = vocabSize
            self.specialTokens = specialTokens
            self.endOfTurnIds = endOfTurnIds
        }

        enum CodingKeys: String, CodingKey {
            case files
            case vocabSize = "vocab_size"
            case specialTokens = "special_tokens"
            case endOfTurnIds = "end_of_turn_ids"
        }
    }
}

extension ExportMetadata {
    /// How the weights are stored when not all fp16 (python/museflash/bundle.py `Compression`).
    public struct Compression: Codable, Equatable, Sendable {
        /// Nil for rules from --compression-config.
        public var preset: CompressionPreset?
        /// In order: the first rule whose `match` fits a checkpoint tensor's name decides it.
        public var rules: [CompressionRule]
        public var groups: [CompressedGroup]
        /// Streamed weights no rule compressed, kept fp16.
        public var fp16Tensors: Int
        public var fp16Bytes: Int
        /// A weight is compressed only when it is 2-D with at least this many elements; smaller
        /// ones stay fp16 whatever the rules. Nil (null or absent) when the exporter did not
        /// record it.
        public var minCompressibleElements: Int?

        public init(preset: CompressionPreset?, rules: [CompressionRule], groups: [CompressedGroup],
                    fp16Tensors: Int, fp16Bytes: Int, minCompressibleElements: Int? = nil) {
            self.preset = preset
            self.rules = rules
            self.groups = groups
            self.fp16Tensors = fp16Tensors
            self.fp16Bytes = fp16Bytes
            self.minCompressibleElements = minCompressibleElements
        }

        enum CodingKeys: String, CodingKey {
            case preset, rules, groups
            case fp16Tensors = "fp16_tensors"
            case fp16Bytes = "fp16_bytes"
            case minCompressibleElements = "min_compressible_elements"
        }
    }

    /// One rule of `compression.rules`.
    public struct CompressionRule: Codable, Equatable, Sendable {
        /// An fnmatch glob over checkpoint tensor names.
        public var match: String
        public var mode: CompressionMode
        /// 4 or 8; nil for mode none.
        public var bits: Int?
        /// linear: elements per scale along the input axis; nil: one scale per output channel.
        public var blockSize: Int?
        /// palettize: output channels sharing one look-up table.
        public var groupSize: Int?

        public init(match: String, mode: CompressionMode, bits: Int? = nil, blockSize: Int? = nil,
                    groupSize: Int? = nil) {
            self.match = match
            self.mode = mode
            self.bits = bits
            self.blockSize = blockSize
            self.groupSize = groupSize
        }

        enum CodingKeys: String, CodingKey {
            case match, mode, bits
            case blockSize = "block_size"
            case groupSize = "group_size"
        }
    }

    /// The weights one rule compressed alike, and what storing them costs.
    public struct CompressedGroup: Codable, Equatable, Sendable {
        /// Index in `rules` of the rule these weights matched.
        public var rule: Int
        /// linear or palettize.
        public var mode: CompressionMode
        /// Bits per stored element: int4/int8 data (linear), uint4/uint8 indices (palettize).
        public var bits: Int
        /// linear: elements per fp16 scale along the input axis (scale `[O, I / block_size]`);
        /// nil: per output channel (scale `[O, 1]`).
        public var blockSize: Int?
        /// palettize: output channels per look-up table (lut `[O / group_size, 1, 2^bits, 1]`).
        public var groupSize: Int?
        /// Unique checkpoint weights in the group.
        public var tensors: Int
        /// Their size in fp16.
        public var bytesBefore: Int
        /// Their size as stored, each counted once.
        public var bytesAfter: Int
        /// What each package stores of them, keyed by the package's owner role
        /// (`ExportMetadata.packages`): a package shared by several assets appears once.
        public var packages: [AssetRole: StoredCount]

        public init(rule: Int, mode: CompressionMode, bits: Int, blockSize: Int? = nil, groupSize: Int? = nil,
                    tensors: Int, bytesBefore: Int, bytesAfter: Int, packages: [AssetRole: StoredCount]) {
            self.rule = rule
            self.mode = mode
            self.bits = bits
            self.blockSize = blockSize
            self.groupSize = groupSize
            self.tensors = tensors
            self.bytesBefore = bytesBefore
            self.bytesAfter = bytesAfter
            self.packages = packages
        }

        enum CodingKeys: String, CodingKey {
            case rule, mode, bits
            case blockSize = "block_size"
            case groupSize = "group_size"
            case tensors
            case bytesBefore = "bytes_before"
            case bytesAfter = "bytes_after"
            case packages
        }
    }

    /// What one package stores of a group.
    public struct StoredCount: Codable, Equatable, Sendable {
        /// Distinct weights of the group in the package.
        public var tensors: Int
        /// Their payload bytes in the package's weight file: data plus fp16 scales or look-up tables.
        public var bytes: Int

        public init(tensors: Int, bytes: Int) {
            self.tensors = tensors
            self.bytes = bytes
        }
    }
}

extension ExportMetadata {
    public var isSchemaVersionSupported: Bool {
        Self.supportedSchemaVersions.contains(schemaVersion)
    }

    /// Whether assets may name the same package (schema version 3 and later).
    public var allowsSharedPackages: Bool {
        schemaVersion >= Self.sharedPackageSchemaVersion
    }
}

extension ExportMetadata {
    /// One package file of the export and the assets stored in it.
    public struct Package: Equatable, Sendable {
        /// `assets.<role>.path` of its assets.
        public var path: String
        /// Every role whose asset is stored in it, in pipeline order; the first is the owner.
        public var roles: [AssetRole]

        public init(path: String, roles: [AssetRole]) {
            self.path = path
            self.roles = roles
        }

        /// The first role, in pipeline order, whose asset names the package: its default
        /// function is the package's, and `compression.groups[i].packages` counts the package
        /// under this role.
        public var owner: AssetRole { roles[0] }

        /// Whether more than one asset is stored in it.
        public var isShared: Bool { roles.count > 1 }
    }

    /// The distinct packages, in pipeline order of their owners. From schema version 3 the
    /// assets naming the same `path` (the same string, as python/museflash/bundle.py
    /// `package_owners` compares them) are one package; before, every asset is a package of its
    /// own, whatever its path.
    public var packages: [Package] {
        var result: [Package] = []
        for role in AssetRole.allCases {
            guard let asset = assets[role] else { continue }
            if allowsSharedPackages, let index = result.firstIndex(where: { $0.path == asset.path }) {
                result[index].roles.append(role)
            } else {
                result.append(Package(path: asset.path, roles: [role]))
            }
        }
        return result
    }

    /// The package `role`'s asset is stored in, or nil when `assets` has no such role.
    public func package(of role: AssetRole) -> Package? {
        packages.first { $0.roles.contains(role) }
    }
}

// MARK: Closed sets of names; each raw value is the spelling in the bundle.

/// A name from a closed set of the bundle contract. Decoding an unknown spelling fails with the
/// key path and the known spellings; `description` is the spelling itself.
public protocol ContractName: RawRepresentable, Hashable, Codable, Sendable, CaseIterable,
    CustomStringConvertible where RawValue == String {
    /// What the names are, for errors: `asset kind`.
    static var meaning: String { get }
}

extension ContractName {
    public var description: String { rawValue }

    public init(from decoder: Decoder) throws {
        let container = try decoder.singleValueContainer()
        let spelling = try container.decode(String.self)
        guard let name = Self(rawValue: spelling) else {
            throw DecodingError.dataCorruptedError(in: container, debugDescription: Self.unknown(spelling))
        }
        self = name
    }

    static func unknown(_ spelling: String) -> String {
        "unknown \(meaning) \"\(spelling)\"; expected one of \(allCases.map(\.rawValue).joined(separator: ", "))"
    }
}

extension ExportMetadata {
    /// Keys of `assets`, in pipeline order (which decides a shared package's owner). The package
    /// is `<role>.mlpackage`, except that from schema version 3 the DFlash drafter shares the
    /// fused target's `target.mlpackage`.
    public enum AssetRole: String, Codable, Sendable, CaseIterable, ContractName {
        case target
        case dflashDrafter = "dflash_drafter"
        case ringDrafter = "ring_drafter"
        public static let meaning = "asset role"
    }

    public enum AssetKind: String, Codable, Sendable, CaseIterable, ContractName {
        /// `main` outputs `logits` and `drafter_features`.
        case fusedTarget = "fused_target"
        /// `main` outputs `logits` only.
        case target
        case dflashDrafter = "dflash_drafter"
        case ringDrafter = "ring_drafter"
        public static let meaning = "asset kind"
    }

    public enum FunctionName: String, Codable, Sendable, CaseIterable, ContractName {
        case main
        case prefill
        case injectKV = "inject_kv"
        case draft
        case decode
        /// The target's verify of a token tree (docs/trees.md), under `Asset.tree`.
        case tree
        public static let meaning = "function name"
    }

    public enum FunctionRole: String, Codable, Sendable, CaseIterable, ContractName {
        case decode
        case prefill
        case injectKV = "inject_kv"
        case draft
        /// The target's verify of a token tree: node i at RoPE position `position_ids[i]`,
        /// written at `position_ids[0] + i`, seeing the cache and the nodes `tree_mask[i]` names.
        case tree
        public static let meaning = "function role"
    }

    public enum InputName: String, Codable, Sendable, CaseIterable, ContractName {
        case inputIDs = "input_ids"
        case positionIDs = "position_ids"
        case features
        /// `tree`: [N, N] int32, 1 where node i sees node j (itself and its ancestors).
        case treeMask = "tree_mask"
        public static let meaning = "input name"
    }

    public enum OutputName: String, Codable, Sendable, CaseIterable, ContractName {
        case logits
        case drafterFeatures = "drafter_features"
        case lastInjectedPosition = "last_injected_position"
        /// A DFlash2 `draft`'s greedy candidate-selector path.
        case draftTokens = "draft_tokens"
        public static let meaning = "output name"
    }

    public enum StateName: String, Codable, Sendable, CaseIterable, ContractName {
        /// The target's full-attention layers.
        case globalKeyCache
        case globalValueCache
        /// The target's sliding layers; the ring drafter's (and before schema version 3 the
        /// DFlash drafter's) cache.
        case slidingKeyCache
        case slidingValueCache
        /// The DFlash drafter's cache (schema version 3: it shares the target's package, so
        /// its states need names of their own).
        case drafterKeyCache
        case drafterValueCache
        public static let meaning = "state name"

        /// The kind a state of this name has (python/museflash/bundle.py `StateName.kind`).
        public var kind: StateKind {
            switch self {
            case .globalKeyCache, .globalValueCache: return .globalKV
            case .slidingKeyCache, .slidingValueCache, .drafterKeyCache, .drafterValueCache: return .slidingKV
            }
        }

        /// The role a state of this name has.
        public var role: StateRole {
            switch self {
            case .globalKeyCache, .slidingKeyCache, .drafterKeyCache: return .key
            case .globalValueCache, .slidingValueCache, .drafterValueCache: return .value
            }
        }
    }

    /// The target's states for `layerTypes` (python/museflash/bundle.py `target_states`): the
    /// key/value pair of each layer kind present, global first, and no state for a kind without
    /// layers. A target of full-attention layers only has globalKeyCache and globalValueCache.
    public static func targetStateNames(layerTypes: [LayerType]) -> [StateName] {
        let present = Set(layerTypes)
        return (present.contains(.fullAttention) ? [StateName.globalKeyCache, .globalValueCache] : [])
            + (present.contains(.slidingAttention) ? [StateName.slidingKeyCache, .slidingValueCache] : [])
    }

    public enum StateKind: String, Codable, Sendable, CaseIterable, ContractName {
        /// Absolute position `p` in slot `p`.
        case globalKV = "global_kv"
        /// A ring: absolute position `p` in slot `p % capacity`.
        case slidingKV = "sliding_kv"
        public static let meaning = "state kind"
    }

    public enum StateRole: String, Codable, Sendable, CaseIterable, ContractName {
        case key
        case value
        public static let meaning = "state role"
    }

    public enum DrafterKind: String, Codable, Sendable, CaseIterable, ContractName {
        case dflash
        /// A DFlash drafter whose `draft` also outputs `draft_tokens`; settings in
        /// `speculative_decoding.dflash2`.
        case dflash2
        case ring
        public static let meaning = "drafter kind"

        /// The `assets` key of the drafter's package (python/museflash/bundle.py `drafter_role`).
        public var assetRole: AssetRole {
            switch self {
            case .dflash, .dflash2: return .dflashDrafter
            case .ring: return .ringDrafter
            }
        }
    }

    /// How a DFlash2 drafter's candidate selector picks its path.
    public enum SelectorDecoding: String, Codable, Sendable, CaseIterable, ContractName {
        case greedy
        public static let meaning = "selector decoding"
    }

    /// How the bundle's RMSNorms are written (`fp16_range.norm`, docs/fp16.md); a runtime
    /// needs nothing of it, so the metadata reader does not decode the audit's block.
    public enum NormForm: String, Codable, Sendable, CaseIterable, ContractName {
        case maxAbs = "max_abs"
        case plain
        public static let meaning = "norm form"
    }

    /// How the target's global layers write their caches (`kv_write`, docs/kv-write.md).
    public enum KVWrite: String, Codable, Sendable, CaseIterable, ContractName {
        /// A one-hot blend over each whole layer cache: O(capacity) per call.
        case blend
        /// One `slice_update` per cache and layer at the runtime position: O(query length).
        case slice
        public static let meaning = "KV write strategy"
    }

    public enum LayerType: String, Codable, Sendable, CaseIterable, ContractName {
        case slidingAttention = "sliding_attention"
        case fullAttention = "full_attention"
        public static let meaning = "layer type"
    }

    public enum CompressionMode: String, Codable, Sendable, CaseIterable, ContractName {
        /// `constexpr_blockwise_shift_scale`: symmetric integers times fp16 scales.
        case linear
        /// `constexpr_blockwise_shift_scale` with an offset: (unsigned integers - fp16 offsets)
        /// times fp16 scales, each block over its own minimum to maximum.
        case affine
        /// `constexpr_lut_to_dense`: indices into fp16 look-up tables.
        case palettize
        /// fp16 (a rule only).
        case none
        public static let meaning = "compression mode"
    }

    public enum CompressionPreset: String, Codable, Sendable, CaseIterable, ContractName {
        case eightBit = "8bit"
        case fourBit = "4bit"
        case palettize4
        public static let meaning = "compression preset"
    }
}

// MARK: Objects keyed by names

/// Any key of a JSON object, for objects keyed by a `ContractName`.
private struct NameKey: CodingKey {
    var stringValue: String
    var intValue: Int? { nil }
    init(stringValue: String) { self.stringValue = stringValue }
    init?(intValue: Int) { nil }
}

extension KeyedDecodingContainer {
    /// An object whose keys are all names of `Name`; an unknown key fails, naming its path.
    fileprivate func decodeObject<Name: ContractName, Value: Decodable>(
        _ type: [Name: Value].Type, forKey key: Key
    ) throws -> [Name: Value] {
        let object = try nestedContainer(keyedBy: NameKey.self, forKey: key)
        var result: [Name: Value] = [:]
        for member in object.allKeys {
            guard let name = Name(rawValue: member.stringValue) else {
                throw DecodingError.dataCorruptedError(forKey: member, in: object,
                                                       debugDescription: Name.unknown(member.stringValue))
            }
            result[name] = try object.decode(Value.self, forKey: member)
        }
        return result
    }
}

extension KeyedEncodingContainer {
    fileprivate mutating func encodeObject<Name: ContractName, Value: Encodable>(
        _ value: [Name: Value], forKey key: Key
    ) throws {
        var object = nestedContainer(keyedBy: NameKey.self, forKey: key)
        for (name, member) in value.sorted(by: { $0.key.rawValue < $1.key.rawValue }) {
            try object.encode(member, forKey: NameKey(stringValue: name.rawValue))
        }
    }
}

extension ExportMetadata {
    public init(from decoder: Decoder) throws {
        let container = try decoder.container(keyedBy: CodingKeys.self)
        schemaVersion = try container.decode(Int.self, forKey: .schemaVersion)
        generator = try container.decode(Generator.self, forKey: .generator)
        modelName = try container.decode(String.self, forKey: .modelName)
        vocabSize = try container.decode(Int.self, forKey: .vocabSize)
        contextLength = try container.decode(Int.self, forKey: .contextLength)
        computePrecision = try container.decode(String.self, forKey: .computePrecision)
        target = try container.decode(TargetSettings.self, forKey: .target)
        assets = try container.decodeObject([AssetRole: Asset].self, forKey: .assets)
        speculativeDecoding = try container.decodeIfPresent(SpeculativeDecoding.self, forKey: .speculativeDecoding)
        source = try container.decode(Source.self, forKey: .source)
        tokenizer = try container.decodeIfPresent(Tokenizer.self, forKey: .tokenizer)
        compression = try container.decodeIfPresent(Compression.self, forKey: .compression)
        kvWrite = try container.decodeIfPresent(KVWrite.self, forKey: .kvWrite)
    }

    public func encode(to encoder: Encoder) throws {
        var container = encoder.container(keyedBy: CodingKeys.self)
        try container.encode(schemaVersion, forKey: .schemaVersion)
        try container.encode(generator, forKey: .generator)
        try container.encode(modelName, forKey: .modelName)
        try container.encode(vocabSize, forKey: .vocabSize)
        try container.encode(contextLength, forKey: .contextLength)
        try container.encode(computePrecision, forKey: .computePrecision)
        try container.encode(target, forKey: .target)
        try container.encodeObject(assets, forKey: .assets)
        try container.encodeIfPresent(speculativeDecoding, forKey: .speculativeDecoding)
        try container.encode(source, forKey: .source)
        try container.encodeIfPresent(tokenizer, forKey: .tokenizer)
        try container.encodeIfPresent(compression, forKey: .compression)
        try container.encodeIfPresent(kvWrite, forKey: .kvWrite)
    }
}

extension ExportMetadata.Asset {
    public init(from decoder: Decoder) throws {
        let container = try decoder.container(keyedBy: CodingKeys.self)
        path = try container.decode(String.self, forKey: .path)
        kind = try container.decode(ExportMetadata.AssetKind.self, forKey: .kind)
        defaultFunction = try container.decode(ExportMetadata.FunctionName.self, forKey: .defaultFunction)
        functions = try container.decodeObject([ExportMetadata.FunctionName: ExportMetadata.Function].self,
                                               forKey: .functions)
        states = try container.decode([ExportMetadata.State].self, forKey: .states)
        buckets = try container.decodeIfPresent([ExportMetadata.ContextBucket].self, forKey: .buckets)
        decode = try container.decodeIfPresent(ExportMetadata.Function.self, forKey: .decode)
        tree = try container.decodeIfPresent(ExportMetadata.Function.self, forKey: .tree)
    }

    public func encode(to encoder: Encoder) throws {
        var container = encoder.container(keyedBy: CodingKeys.self)
        try container.encode(path, forKey: .path)
        try container.encode(kind, forKey: .kind)
        try container.encode(defaultFunction, forKey: .defaultFunction)
        try container.encodeObject(functions, forKey: .functions)
        try container.encode(states, forKey: .states)
        try container.encodeIfPresent(buckets, forKey: .buckets)
        try container.encodeIfPresent(decode, forKey: .decode)
        try container.encodeIfPresent(tree, forKey: .tree)
    }
}

extension ExportMetadata.ContextBucket {
    enum CodingKeys: String, CodingKey { case context, functions, tree }

    public init(from decoder: Decoder) throws {
        let container = try decoder.container(keyedBy: CodingKeys.self)
        context = try container.decode(Int.self, forKey: .context)
        functions = try container.decodeObject([ExportMetadata.FunctionName: ExportMetadata.Function].self,
                                               forKey: .functions)
        tree = try container.decodeIfPresent(ExportMetadata.Function.self, forKey: .tree)
    }

    public func encode(to encoder: Encoder) throws {
        var container = encoder.container(keyedBy: CodingKeys.self)
        try container.encode(context, forKey: .context)
        try container.encodeObject(functions, forKey: .functions)
        try container.encodeIfPresent(tree, forKey: .tree)
    }
}

extension ExportMetadata.CompressedGroup {
    public init(from decoder: Decoder) throws {
        let container = try decoder.container(keyedBy: CodingKeys.self)
        rule = try container.decode(Int.self, forKey: .rule)
        mode = try container.decode(ExportMetadata.CompressionMode.self, forKey: .mode)
        bits = try container.decode(Int.self, forKey: .bits)
        blockSize = try container.decodeIfPresent(Int.self, forKey: .blockSize)
        groupSize = try container.decodeIfPresent(Int.self, forKey: .groupSize)
        tensors = try container.decode(Int.self, forKey: .tensors)
        bytesBefore = try container.decode(Int.self, forKey: .bytesBefore)
        bytesAfter = try container.decode(Int.self, forKey: .bytesAfter)
        packages = try container.decodeObject([ExportMetadata.AssetRole: ExportMetadata.StoredCount].self,
                                              forKey: .packages)
    }

    public func encode(to encoder: Encoder) throws {
        var container = encoder.container(keyedBy: CodingKeys.self)
        try container.encode(rule, forKey: .rule)
        try container.encode(mode, forKey: .mode)
        try container.encode(bits, forKey: .bits)
        try container.encodeIfPresent(blockSize, forKey: .blockSize)
        try container.encodeIfPresent(groupSize, forKey: .groupSize)
        try container.encode(tensors, forKey: .tensors)
        try container.encode(bytesBefore, forKey: .bytesBefore)
        try container.encode(bytesAfter, forKey: .bytesAfter)
        try container.encodeObject(packages, forKey: .packages)
    }
}
