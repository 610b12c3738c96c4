/// `metadata.json`, schema version 1, as docs/metadata.md defines it. Keys
/// the schema does not name are ignored, so later additive fields still decode.
public struct ExportMetadata: Codable, Equatable, Sendable {
    public static let supportedSchemaVersions = [1]

    public var schemaVersion: Int
    public var generator: Generator
    public var modelName: String
    public var vocabSize: Int
    public var contextLength: Int
    public var computePrecision: String
    public var target: TargetSettings
    /// Asset role (`target`, `dflash_drafter`, `ring_drafter`) -> asset.
    public var assets: [String: Asset]
    public var speculativeDecoding: SpeculativeDecoding?
    public var source: Source

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
        /// `sliding_attention` or `full_attention`, one per layer.
        public var layerTypes: [String]
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
        /// Relative to the export directory.
        public var path: String
        /// `fused_target`, `target`, `dflash_drafter` or `ring_drafter`.
        public var kind: String
        public var defaultFunction: String
        public var functions: [String: Function]
        /// Shared by every function of the package.
        public var states: [State]

        enum CodingKeys: String, CodingKey {
            case path, kind
            case defaultFunction = "default_function"
            case functions, states
        }
    }

    public struct Function: Codable, Equatable, Sendable {
        /// `decode`, `prefill`, `inject_kv` or `draft`.
        public var role: String
        public var queryLength: Int
        public var inputs: [String]
        public var outputs: [String]

        enum CodingKeys: String, CodingKey {
            case role
            case queryLength = "query_length"
            case inputs, outputs
        }
    }

    public struct State: Codable, Equatable, Sendable {
        public var name: String
        /// `global_kv` or `sliding_kv`.
        public var kind: String
        /// `key` or `value`.
        public var role: String
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
        /// `dflash` or `ring`.
        public var drafterKind: String
        public var blockSize: Int
        public var maskTokenId: Int
        public var targetLayerIds: [Int]
        public var drafterHiddenSize: Int
        public var numDraftTokens: Int
        public var sharedEmbeddings: Bool
        public var drafter: DrafterSettings

        enum CodingKeys: String, CodingKey {
            case drafterKind = "drafter_kind"
            case blockSize = "block_size"
            case maskTokenId = "mask_token_id"
            case targetLayerIds = "target_layer_ids"
            case drafterHiddenSize = "drafter_hidden_size"
            case numDraftTokens = "num_draft_tokens"
            case sharedEmbeddings = "shared_embeddings"
            case drafter
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
    public enum AssetRole {
        public static let target = "target"
        public static let dflashDrafter = "dflash_drafter"
        public static let ringDrafter = "ring_drafter"
    }

    public enum AssetKind {
        public static let fusedTarget = "fused_target"
        public static let target = "target"
        public static let dflashDrafter = "dflash_drafter"
        public static let ringDrafter = "ring_drafter"
    }

    public enum StateKind {
        public static let globalKV = "global_kv"
        public static let slidingKV = "sliding_kv"
    }

    public enum LayerType {
        public static let slidingAttention = "sliding_attention"
        public static let fullAttention = "full_attention"
    }

    public var isSchemaVersionSupported: Bool {
        Self.supportedSchemaVersions.contains(schemaVersion)
    }
}
