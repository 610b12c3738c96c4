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

    /// The DFlash drafter's states from schema version 3 (`drafterKeyCache`, `drafterValueCache`),
    /// or before 3 and for the ring drafter `slidingKeyCache`, `slidingValueCache`.
    private static func drafterStates(prefix: String) -> [TensorSpec] {
        kvStates(prefix: prefix, layers: Size.drafterLayers, capacity: Size.ringCapacity)
    }

    /// The states of the target's functions, for tests that make a function bind them.
    public static var targetStateSpecs: [TensorSpec] { targetStates }

    private static func tokenInputs(_ length: Int64) -> [TensorSpec] {
        [T("input_ids", [1, length], T.int32), T("position_ids", [length], T.int32)]
    }

    private static func targetFunctions(fused: Bool) -> [FunctionSpec] {
        var mainOutputs = [T("logits", [1, Size.blockSize, Size.vocab], T.float16)]
        if fused { mainOutputs.append(T("drafter_features", [1, Size.blockSize, Size.drafterHidden], T.float16)) }
        let main = FunctionSpec(name: "main", inputs: tokenInputs(Size.blockSize), outputs: mainOutputs, states: targetStates)
        let prefill = FunctionSpec(name: "prefill", inputs: tokenInputs(Size.prefillChunk),
                                   outputs: [T("logits", [1, 1, Size.vocab], T.float16)], states: targetStates)
        return [main, prefill]
    }

    private static func target(fused: Bool) -> PackageSpec {
        PackageSpec(path: "target.mlpackage", functions: targetFunctions(fused: fused), isMultiFunction: true,
                    defaultFunction: "main")
    }

    /// `inject_kv` and `draft`; `draft` of a DFlash2 drafter also outputs `draft_tokens`, int32 [1, block - 1].
    private static func dflashDrafterFunctions(draftTokens: Bool, states: [TensorSpec]) -> [FunctionSpec] {
        let injectKV = FunctionSpec(
            name: "inject_kv",
            inputs: [T("features", [1, Size.prefillChunk, Size.drafterHidden], T.float16),
                     T("position_ids", [Size.prefillChunk], T.int32)],
            outputs: [T("last_injected_position", [1], T.int32)], states: states)
        var draftOutputs = [T("logits", [1, Size.blockSize, Size.vocab], T.float16)]
        if draftTokens { draftOutputs.append(T("draft_tokens", [1, Size.blockSize - 1], T.int32)) }
        let draft = FunctionSpec(name: "draft", inputs: tokenInputs(Size.blockSize), outputs: draftOutputs, states: states)
        return [injectKV, draft]
    }

    /// Before schema version 3: the DFlash drafter's own package, states `sliding*`.
    private static func separateDFlashDrafter(draftTokens: Bool) -> PackageSpec {
        PackageSpec(path: "dflash_drafter.mlpackage",
                    functions: dflashDrafterFunctions(draftTokens: draftTokens, states: drafterStates(prefix: "sliding")),
                    isMultiFunction: true, defaultFunction: "draft")
    }

    /// Schema version 3: one multifunction `target.mlpackage` with the fused target's `main` and
    /// `prefill` (default `main`, the owner's) and the DFlash drafter's `inject_kv` and `draft`
    /// over states of their own (`drafter*`).
    private static func sharedTargetAndDFlashDrafter(draftTokens: Bool) -> PackageSpec {
        PackageSpec(path: "target.mlpackage",
                    functions: targetFunctions(fused: true)
                        + dflashDrafterFunctions(draftTokens: draftTokens, states: drafterStates(prefix: "drafter")),
                    isMultiFunction: true, defaultFunction: "main")
    }

    private static var ringDrafter: PackageSpec {
        let main = FunctionSpec(name: "main", inputs: tokenInputs(Size.blockSize),
                                outputs: [T("logits", [1, Size.blockSize, Size.vocab], T.float16)],
                                states: drafterStates(prefix: "sliding"))
        return PackageSpec(path: "ring_drafter.mlpackage", functions: [main], isMultiFunction: false, defaultFunction: "main")
    }

    // MARK: metadata.json

    /// Kind and role follow the name, as python/museflash/bundle.py `StateName` derives them:
    /// `global*` caches are global, the others (`sliding*`, `drafter*`) sliding rings.
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

    /// One asset: `functions` (the asset's own, in a shared package a subset of its functions)
    /// stored in the package at `path`.
    private static func assetEntry(path: String, functions: [FunctionSpec], defaultFunction: String, kind: String,
                                   roles: [String: String]) -> [String: Any] {
        var entries: [String: Any] = [:]
        for function in functions {
            entries[function.name] = [
                "role": roles[function.name] ?? "decode",
                "query_length": Int(function.inputs.first?.shape.dropFirst().first ?? function.inputs.first?.shape.first ?? 1),
                "inputs": function.inputs.map(\.name),
                "outputs": function.outputs.map(\.name),
            ]
        }
        return [
            "path": path,
            "kind": kind,
            "default_function": defaultFunction,
            "functions": entries,
            "states": stateEntries(functions.first?.states ?? []),
        ]
    }

    private static func assetEntry(_ package: PackageSpec, kind: String, roles: [String: String]) -> [String: Any] {
        assetEntry(path: package.path, functions: package.functions, defaultFunction: package.defaultFunction,
                   kind: kind, roles: roles)
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

    private static let targetFunctionRoles = ["main": "decode", "prefill": "prefill"]
    private static let drafterFunctionRoles = ["inject_kv": "inject_kv", "draft": "draft", "main": "decode"]

    private static func metadata(schemaVersion: Int, drafterKind: String, assets: [String: Any]) -> [String: Any] {
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
            "schema_version": schemaVersion,
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
            "assets": assets,
            "speculative_decoding": speculative,
            "source": ["checkpoint": "builtin:demo", "drafter_checkpoint": "builtin:demo"],
        ]
    }

    /// Schema version 3: the fused target and the DFlash (or DFlash2) drafter in one package.
    private static func sharedDFlashExport(drafterKind: String) -> SyntheticExport {
        let package = sharedTargetAndDFlashDrafter(draftTokens: drafterKind == "dflash2")
        let target = package.functions.filter { ["main", "prefill"].contains($0.name) }
        let drafter = package.functions.filter { ["inject_kv", "draft"].contains($0.name) }
        let assets: [String: Any] = [
            "target": assetEntry(path: package.path, functions: target, defaultFunction: "main", kind: "fused_target",
                                 roles: targetFunctionRoles),
            "dflash_drafter": assetEntry(path: package.path, functions: drafter, defaultFunction: "draft",
                                         kind: "dflash_drafter", roles: drafterFunctionRoles),
        ]
        return SyntheticExport(metadata: metadata(schemaVersion: 3, drafterKind: drafterKind, assets: assets),
                               packages: ["target": package])
    }

    /// A fused target (main + prefill, global and sliding caches) and a DFlash drafter
    /// (inject_kv + draft sharing the drafter caches) in one package, schema version 3.
    public static func fusedTargetWithDFlashDrafter() -> SyntheticExport {
        sharedDFlashExport(drafterKind: "dflash")
    }

    /// Like `fusedTargetWithDFlashDrafter`, with a DFlash2 drafter: `speculative_decoding.dflash2`
    /// set and `draft` also outputting `draft_tokens`.
    public static func fusedTargetWithDFlash2Drafter() -> SyntheticExport {
        sharedDFlashExport(drafterKind: "dflash2")
    }

    /// The layout before schema version 3 (default 2; 1 also fits): the DFlash drafter in a
    /// package of its own, `dflash_drafter.mlpackage`, its states named `sliding*`.
    public static func fusedTargetWithSeparateDFlashDrafter(schemaVersion: Int = 2) -> SyntheticExport {
        let target = target(fused: true)
        let drafter = separateDFlashDrafter(draftTokens: false)
        let assets: [String: Any] = [
            "target": assetEntry(target, kind: "fused_target", roles: targetFunctionRoles),
            "dflash_drafter": assetEntry(drafter, kind: "dflash_drafter", roles: drafterFunctionRoles),
        ]
        return SyntheticExport(metadata: metadata(schemaVersion: schemaVersion, drafterKind: "dflash", assets: assets),
                               packages: ["target": target, "dflash_drafter": drafter])
    }

    /// A plain target with a single-function ring drafter, each in its package (every schema
    /// version; 1 is the oldest it fits).
    public static func targetWithRingDrafter(schemaVersion: Int = 1) -> SyntheticExport {
        let target = target(fused: false)
        let drafter = ringDrafter
        let assets: [String: Any] = [
            "target": assetEntry(target, kind: "target", roles: targetFunctionRoles),
            "ring_drafter": assetEntry(drafter, kind: "ring_drafter", roles: drafterFunctionRoles),
        ]
        return SyntheticExport(metadata: metadata(schemaVersion: schemaVersion, drafterKind: "ring", assets: assets),
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
