import XCTest
import Foundation
import ExportMetadata
import MuseflashContract
import TestSupport

/// A target whose layers are all full attention (Qwen3, Llama): its states are the global pair
/// only (python/museflash/bundle.py `target_states`), and the checker holds every bundle to the
/// pair of each layer kind its `target.layer_types` has.
final class GlobalOnlyTargetTests: XCTestCase {
    private static let layers = 4

    /// The synthetic DFlash bundle with its target turned global-only: four full-attention
    /// layers, no sliding window, and `main` / `prefill` binding the global pair of 4 layers.
    private func globalOnly() -> SyntheticExport {
        var export = SyntheticExport.fusedTargetWithDFlashDrafter()
        export.setMetadata(["target", "layer_types"], to: Array(repeating: "full_attention", count: Self.layers))
        export.setMetadata(["target", "sliding_window"], to: 0)
        dropSlidingStates(&export, globalLayers: Self.layers)
        return export
    }

    /// Removes the sliding pair from metadata and from the target's functions; the global
    /// pair gets `globalLayers` layers.
    private func dropSlidingStates(_ export: inout SyntheticExport, globalLayers: Int) {
        for name in ["main", "prefill"] {
            export.editFunction(role: "target", name) { function in
                function.states = function.states.filter { $0.name.hasPrefix("global") }
                for index in function.states.indices { function.states[index].shape[0] = Int64(globalLayers) }
            }
        }
        var assets = export.metadata["assets"] as? [String: Any] ?? [:]
        var target = assets["target"] as? [String: Any] ?? [:]
        let states = (target["states"] as? [[String: Any]] ?? []).filter { ($0["kind"] as? String) == "global_kv" }
        target["states"] = states.map { entry -> [String: Any] in
            var entry = entry
            var shape = entry["shape"] as? [Int] ?? []
            shape[0] = globalLayers
            entry["shape"] = shape
            entry["layers"] = globalLayers
            return entry
        }
        assets["target"] = target
        export.metadata["assets"] = assets
    }

    func testTargetStateNamesFollowTheLayerKindsPresent() {
        XCTAssertEqual(ExportMetadata.targetStateNames(layerTypes: [.fullAttention, .fullAttention]),
                       [.globalKeyCache, .globalValueCache])
        XCTAssertEqual(ExportMetadata.targetStateNames(layerTypes: [.slidingAttention, .fullAttention]),
                       [.globalKeyCache, .globalValueCache, .slidingKeyCache, .slidingValueCache])
        XCTAssertEqual(ExportMetadata.targetStateNames(layerTypes: [.slidingAttention]),
                       [.slidingKeyCache, .slidingValueCache])
    }

    func testGlobalOnlyTargetSatisfiesEveryProperty() throws {
        let report = try ContractAssertions.check(globalOnly())
        ContractAssertions.assertFailing([], in: report)
        XCTAssertEqual(report.metadata?.assets[.target]?.states.map(\.name), [.globalKeyCache, .globalValueCache])
    }

    func testTargetWithSlidingLayersButNoSlidingStatesFailsTargetStates() throws {
        var export = SyntheticExport.fusedTargetWithDFlashDrafter()
        dropSlidingStates(&export, globalLayers: 1)
        let report = try ContractAssertions.check(export)
        ContractAssertions.assertFailing(["target.states"], in: report)
        let detail = ContractAssertions.detail("target.states", in: report)
        XCTAssertTrue(detail.contains("slidingKeyCache") && detail.contains("layer_types"), detail)
    }
}
