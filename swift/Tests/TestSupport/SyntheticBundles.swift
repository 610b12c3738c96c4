import Foundation

/// The bundle layouts the exporter produces, at toy sizes. Every number
/// here is chosen to be distinct where a mix-up would otherwise go unnoticed
/// (vocab 64, hidden 16, block 4, prefill chunk 8, ring 16, context 32).
extension SyntheticExport {
    public enum Size {
        public static let vocab: Int64 = 64
        public static let contextLength: Int64 = 32
        public static let hidden: Int64 = 16
        public static let drafterHidden: Int64 = 16
        public static let headDim: Int64 = 8
        public static let kvHeads: Int64 = 1
        public static let slidingWindow: Int64 = 8
        public static let ringCapacity: Int64 = 16
        public static let blockSize: Int64 = 4
        public static let prefillChunk: Int64 = 8
        public static let slidingLayers: Int64 = 3
        public static let globalLayers: Int64 = 1
        public static let drafterLayers: Int64 = 2
    }

    private typealias T = TensorSpec

    private static func kvStates(prefix: String, layers: Int64, capacity: Int64) -> [TensorSpec] {
        ["KeyCache", "ValueCache"].map {
            T(prefix + $0, [layers, Size.kvHeads, capacity, Size.headDim], T.float16)
        }
    }

    private static var targetStates: [TensorSpec] {
        kvStates(prefix: "global", layers: Size.globalLayers, capacity: Size.contextLength)
            + kvStates(prefix: "sliding", layers: Size.slidingLayers, capacity: Size.ringCapacity)
    }

    private static var drafterStates: [TensorSpec] {
        kvStates(prefix: "sliding", layers: Size.drafterLayers, capacity: Size.ringCapacity)
    }

    private static func tokenInputs(_ length: Int64) -> [TensorSpec] {
        [T("input_ids", [1, length], T.int32), T("position_ids", [length], T.int32)]
    }

    private static func target(fused: Bool) -> PackageSpec {
        var mainOutputs = [T("logits", [1, Size.blockSize, Size.vocab], T.float16)]
        if fused { mainOutputs.append(T("drafter_features", [1, Size.blockSize, Size.drafterHidden], T.float16)) }
        let main = FunctionSpec(name: "main", inputs: tokenInputs(Size.blockSize), outputs: mainOutputs, states: targetStates)
        let prefill = FunctionSpec(name: "prefill", inputs: tokenInputs(Size.prefillChunk),
                                   outputs: [T("logits", [1, 1, Size.vocab], T.float16)], states: targetStates)
        return PackageSpec(path: "target.mlpackage", functions: [main, prefill], isMultiFunction: true, defaultFunction: "main")
    }

    /// `draft` of a DFlash2 drafter also outputs `draft_tokens`, int32 [1, block - 1].
    private static func dflashDrafter(draftTokens: Bool) -> PackageSpec {
        let injectKV = FunctionSpec(
            name: "inject_kv",
            inputs: [T("features", [1, Size.prefillChunk, Size.drafterHidden], T.float16),
                     T("position_ids", [Size.prefillChunk], T.int32)],
            outputs: [T("last_injected_position", [1], T.int32)], states: drafterStates)
        var draftOutputs = [T("logits", [1, Size.blockSize, Size.vocab], T.float16)]
        if draftTokens { draftOutputs.append(T("draft_tokens", [1, Size.blockSize - 1], T.int32)) }
        let draft = FunctionSpec(name: "draft", inputs: tokenInputs(Size.blockSize), outputs: draftOutputs,
                                 states: drafterStates)
        return PackageSpec(path: "dflash_drafter.mlpackage", functions: [injectKV, draft], isMultiFunction: true,
                           defaultFunction: "draft")
    }

    private static var ringDrafter: PackageSpec {
        let main = FunctionSpec(name: "main", inputs: tokenInputs(Size.blockSize),
                                outputs: [T("logits", [1, Size.blockSize, Size.vocab], T.float16)], states: drafterStates)
        return PackageSpec(path: "ring_drafter.mlpackage", functions: [main], isMultiFunction: false, defaultFunction: "main")
    }

    // MARK: metadata.json

    private static func stateEntries(_ states: [TensorSpec]) -> [[String: Any]] {
        states.map { state in
            [
                "name": state.name,
                "kind": state.name.hasPrefix("global") ? "global_kv" : "sliding_kv",
                "role": state.name.hasSuffix("KeyCache") ? "key" : "value",
                "shape": state.shape.map(Int.init),
                "dtype": "float16",
                "layers": Int(state.shape[0]),
                "kv_heads": Int(state.shape[1]),
                "capacity": Int(state.shape[2]),
                "head_dim": Int(state.shape[3]),
            ]
        }
    }

    private static func assetEntry(_ package: PackageSpec, kind: String, roles: [String: String]) -> [String: Any] {
        var functions: [String: Any] = [:]
        for function in package.functions {
            functions[function.name] = [
                "role": roles[function.name] ?? "decode",
                "query_length": Int(function.inputs.first?.shape.dropFirst().first ?? function.inputs.first?.shape.first ?? 1),
                "inputs": function.inputs.map(\.name),
                "outputs": function.outputs.map(\.name),
            ]
        }
        return [
            "path": package.path,
            "kind": kind,
            "default_function": package.defaultFunction,
            "functions": functions,
            "states": stateEntries(package.functions.first?.states ?? []),
        ]
    }

    /// `speculative_decoding.dflash2` of the DFlash2 bundle: every number distinct and inside its
    /// bounds (kernel <= block 4, group divides drafter hidden 16, top_k <= vocab 64).
    public static var dflash2Settings: [String: Any] {
        [
            "conv_kernel_size": 3,
            "conv_group_size": 4,
            "selector_rank": 6,
            "selector_top_k": 5,
            "selector_decoding": "greedy",
            "output_multiplier": 0.5,
            "final_logit_softcapping": 20.0,
        ]
    }

    private static func metadata(targetKind: String, drafterRole: String, drafterKind: String, drafter: PackageSpec,
                                 target: PackageSpec) -> [String: Any] {
        let drafterRoles = ["inject_kv": "inject_kv", "draft": "draft", "main": "decode"]
        var speculative: [String: Any] = [
            "drafter_kind": drafterKind,
            "block_size": Int(Size.blockSize),
            "mask_token_id": maskTokenID,
            "target_layer_ids": [1, 2],
            "drafter_hidden_size": Int(Size.drafterHidden),
            "num_draft_tokens": Int(Size.blockSize) - 1,
            "shared_embeddings": true,
            "drafter": [
                "num_hidden_layers": Int(Size.drafterLayers),
                "num_attention_heads": 2,
                "num_key_value_heads": Int(Size.kvHeads),
                "head_dim": Int(Size.headDim),
                "sliding_window": Int(Size.slidingWindow),
            ],
        ]
        if drafterKind == "dflash2" { speculative["dflash2"] = dflash2Settings }
        return [
            // dflash2 is new in schema version 2; the others keep the oldest version they fit.
            "schema_version": drafterKind == "dflash2" ? 2 : 1,
            "generator": ["name": "museflash", "version": "0.1.0"],
            "model_name": "muse-glimmer-demo",
            "vocab_size": Int(Size.vocab),
            "context_length": Int(Size.contextLength),
            "compute_precision": "float16",
            "target": [
                "num_hidden_layers": 4,
                "hidden_size": Int(Size.hidden),
                "num_attention_heads": 2,
                "num_key_value_heads": Int(Size.kvHeads),
                "head_dim": Int(Size.headDim),
                "sliding_window": Int(Size.slidingWindow),
                "layer_types": ["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"],
                "final_logit_softcapping": 30.0,
            ] as [String: Any],
            "assets": [
                "target": assetEntry(target, kind: targetKind, roles: ["main": "decode", "prefill": "prefill"]),
                drafterRole: assetEntry(drafter, kind: drafterRole, roles: drafterRoles),
            ],
            "speculative_decoding": speculative,
            "source": ["checkpoint": "builtin:demo", "drafter_checkpoint": "builtin:demo"],
        ]
    }

    /// A fused target (main + prefill, global and sliding caches) with a
    /// DFlash drafter (inject_kv + draft sharing its sliding caches).
    public static func fusedTargetWithDFlashDrafter() -> SyntheticExport {
        let target = target(fused: true)
        let drafter = dflashDrafter(draftTokens: false)
        return SyntheticExport(
            metadata: metadata(targetKind: "fused_target", drafterRole: "dflash_drafter", drafterKind: "dflash",
                               drafter: drafter, target: target),
            packages: ["target": target, "dflash_drafter": drafter])
    }

    /// Like `fusedTargetWithDFlashDrafter`, with a DFlash2 drafter: `speculative_decoding.dflash2`
    /// set and `draft` also outputting `draft_tokens`.
    public static func fusedTargetWithDFlash2Drafter() -> SyntheticExport {
        let target = target(fused: true)
        let drafter = dflashDrafter(draftTokens: true)
        return SyntheticExport(
            metadata: metadata(targetKind: "fused_target", drafterRole: "dflash_drafter", drafterKind: "dflash2",
                               drafter: drafter, target: target),
            packages: ["target": target, "dflash_drafter": drafter])
    }

    /// A plain target with a single-function ring drafter.
    public static func targetWithRingDrafter() -> SyntheticExport {
        let target = target(fused: false)
        let drafter = ringDrafter
        return SyntheticExport(
            metadata: metadata(targetKind: "target", drafterRole: "ring_drafter", drafterKind: "ring",
                               drafter: drafter, target: target),
            packages: ["target": target, "ring_drafter": drafter])
    }
}

/// A private directory per test, removed by the caller.
public enum ScratchDirectory {
    public static func make() throws -> URL {
        let url = FileManager.default.temporaryDirectory
            .appendingPathComponent("museflash-contract-\(UUID().uuidString)", isDirectory: true)
        try FileManager.default.createDirectory(at: url, withIntermediateDirectories: true)
        return url
    }

    public static func remove(_ url: URL) {
        try? FileManager.default.removeItem(at: url)
    }
}
