import ExportMetadata
import Foundation
@testable import MuseflashRuntime

/// A bundle without packages: metadata for a 6-token vocabulary and blocks of 4, served by
/// `MarkovBackend`, numpy-free stand-ins of the four functions (as tests/python/test_sampling.py
/// uses): a Markov target whose next-token logits depend only on the previous token, and a
/// drafter that drafts every block position from the anchor alone.
enum StandIn {
    static let vocab = 6
    static let block = 4
    static let mask: Int32 = 6

    /// `treeNodes` > 0: the target has a `tree` function of that many nodes too.
    static func bundle(contextLength: Int = 1 << 30, drafter: Bool = true, treeNodes: Int = 0) throws -> MuseflashBundle {
        let function = { (role: String, query: Int, inputs: [String], outputs: [String]) -> [String: Any] in
            ["role": role, "query_length": query, "inputs": inputs, "outputs": outputs]
        }
        var object: [String: Any] = [
            "schema_version": 3, "generator": ["name": "museflash", "version": "test"], "model_name": "markov",
            "vocab_size": vocab, "context_length": contextLength, "compute_precision": "float16",
            "target": ["num_hidden_layers": 1, "hidden_size": 1, "num_attention_heads": 1, "num_key_value_heads": 1,
                       "head_dim": 1, "sliding_window": 4, "layer_types": ["full_attention"], "final_logit_softcapping": NSNull()],
            "assets": [
                "target": ["path": "target.mlpackage", "kind": "fused_target", "default_function": "main", "states": [],
                           "functions": ["main": function("decode", block, ["input_ids", "position_ids"], ["logits", "drafter_features"]),
                                         "prefill": function("prefill", block, ["input_ids", "position_ids"], ["logits", "drafter_features"])]],
                "dflash_drafter": ["path": "target.mlpackage", "kind": "dflash_drafter", "default_function": "draft", "states": [],
                                   "functions": ["inject_kv": function("inject_kv", block, ["features", "position_ids"], ["last_injected_position"]),
                                                 "draft": function("draft", block, ["input_ids", "position_ids"], ["logits"])]],
            ],
            "speculative_decoding": ["drafter_kind": "dflash", "block_size": block, "mask_token_id": Int(mask), "target_layer_ids": [0],
                                     "drafter_hidden_size": 1, "num_draft_tokens": block - 1, "shared_embeddings": true,
                                     "drafter": ["num_hidden_layers": 1, "num_attention_heads": 1, "num_key_value_heads": 1,
                                                 "head_dim": 1, "sliding_window": 4]],
            "source": ["checkpoint": "test"],
        ]
        if treeNodes > 0 {
            var assets = object["assets"] as! [String: Any]
            var target = assets["target"] as! [String: Any]
            target["tree"] = function("tree", treeNodes, ["input_ids", "position_ids", "tree_mask"], ["logits", "drafter_features"])
            assets["target"] = target
            object["assets"] = assets
        }
        if !drafter {
            object["speculative_decoding"] = NSNull()
            var assets = object["assets"] as! [String: Any]
            assets["dflash_drafter"] = nil
            object["assets"] = assets
        }
        let data = try JSONSerialization.data(withJSONObject: object)
        return MuseflashBundle(url: URL(fileURLWithPath: "/nonexistent"), metadata: try ExportMetadata.decode(from: data),
                               padTokenID: 0, eosTokenID: nil)
    }

    /// A fixed pseudo-normal value per index (Box-Muller over the runtime's own generator).
    static func normals(_ count: Int, seed: UInt64) -> [Double] {
        var generator = SeededGenerator(seed: seed)
        return (0..<count).map { _ in
            let u = max(generator.uniform(), 1e-300), v = generator.uniform()
            return (-2 * Foundation.log(u)).squareRoot() * Foundation.cos(2 * Double.pi * v)
        }
    }

    /// Target logits [previous token][next token], with a likely successor for each token.
    static let logits: [[Double]] = {
        let values = normals(vocab * vocab, seed: 7)
        return (0..<vocab).map { a in (0..<vocab).map { b in values[a * vocab + b] + (b == (a + 1) % vocab ? 2 : 0) } }
    }()

    /// Drafter rows [anchor][block position][token]: close guesses the target's rows along the
    /// likely path (plus small noise); wrong negates them.
    static func drafterTable(close: Bool) -> [[[Double]]] {
        let noise = normals(vocab * block * vocab, seed: 11)
        return (0..<vocab).map { anchor in
            (0..<block).map { j in
                guard j > 0 else { return [Double](repeating: 0, count: vocab) }
                let row = logits[(anchor + j - 1) % vocab]
                return (0..<vocab).map { t in close ? row[t] + 0.1 * noise[(anchor * block + j) * vocab + t] : -row[t] }
            }
        }
    }
}

final class MarkovBackend: InferenceBackend {
    let name = "markov"
    let table: [[[Double]]]

    init(close: Bool) { table = StandIn.drafterTable(close: close) }

    func loadFunction(_ function: String, of package: URL) throws -> any BackendFunction {
        MarkovFunction(name: function, table: table)
    }

    func makeState(for functions: [any BackendFunction]) throws -> any BackendState { NoState() }
    func checkSameStates(_ functions: [any BackendFunction]) throws {}
    func functionNames(of package: URL) throws -> [String]? { nil }
}

final class NoState: BackendState {
    func reset() throws {}
    func moveRows(_ moves: [(from: Int, to: Int)], inStates names: [String]) throws {}
}

final class MarkovFunction: BackendFunction {
    let name: String
    let table: [[[Double]]]

    init(name: String, table: [[[Double]]]) {
        self.name = name
        self.table = table
    }

    func predict(_ inputs: [String: ShapedArray], state: any BackendState) throws -> [String: ShapedArray] {
        let vocab = StandIn.vocab
        let ids = inputs["input_ids"]?.int32s ?? []
        let rows: [[Double]]
        switch name {
        case "prefill": rows = [StandIn.logits[Int(ids.last!)]]
        // A Markov row depends on its own token only, whatever a tree node's ancestors are.
        case "main", "tree": rows = ids.map { StandIn.logits[Int($0)] }
        case "draft": rows = table[Int(ids[0])]
        default: return [:]
        }
        var outputs = ["logits": ShapedArray(float: rows.flatMap { $0.map(Float.init) }, shape: [1, rows.count, vocab])]
        if name != "draft" {
            outputs["drafter_features"] = ShapedArray(float: [Float](repeating: 0, count: ids.count), shape: [1, ids.count, 1])
        }
        return outputs
    }
}
