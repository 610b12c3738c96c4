import XCTest
import Foundation
import ExportMetadata
import TestSupport

final class ExportMetadataDecodingTests: XCTestCase {
    private func metadataData(_ edit: (inout SyntheticExport) -> Void = { _ in }) throws -> Data {
        var export = SyntheticExport.fusedTargetWithDFlashDrafter()
        edit(&export)
        return Data(try export.metadataText().utf8)
    }

    private func decodingError(_ edit: (inout SyntheticExport) -> Void) throws -> ExportMetadataError? {
        do {
            _ = try ExportMetadata.decode(from: try metadataData(edit), path: "metadata.json")
            XCTFail("decoding succeeded")
            return nil
        } catch let error as ExportMetadataError {
            return error
        }
    }

    func testValidMetadataDecodesEveryField() throws {
        let metadata = try ExportMetadata.decode(from: try metadataData())
        XCTAssertEqual(metadata.schemaVersion, 1)
        XCTAssertEqual(ExportMetadata.supportedSchemaVersions, [1])
        XCTAssertEqual(metadata.generator.name, "museflash")
        XCTAssertEqual(metadata.generator.version, "0.1.0")
        XCTAssertEqual(metadata.vocabSize, 64)
        XCTAssertEqual(metadata.contextLength, 32)
        XCTAssertEqual(metadata.target.layerTypes.count, 4)
        XCTAssertEqual(metadata.target.finalLogitSoftcapping, 30.0)
        let drafter = try XCTUnwrap(metadata.assets["dflash_drafter"])
        XCTAssertEqual(drafter.kind, "dflash_drafter")
        XCTAssertEqual(drafter.defaultFunction, "draft")
        XCTAssertEqual(drafter.functions["inject_kv"]?.queryLength, 8)
        XCTAssertEqual(drafter.functions["draft"]?.inputs, ["input_ids", "position_ids"])
        XCTAssertEqual(drafter.states.first?.kvHeads, 1)
        XCTAssertEqual(drafter.states.first?.shape, [2, 1, 16, 8])
        let speculative = try XCTUnwrap(metadata.speculativeDecoding)
        XCTAssertEqual(speculative.blockSize, 4)
        XCTAssertEqual(speculative.targetLayerIds, [1, 2])
        XCTAssertEqual(speculative.drafter.slidingWindow, 8)
        XCTAssertTrue(speculative.sharedEmbeddings)
        XCTAssertEqual(metadata.source.checkpoint, "builtin:demo")
    }

    func testNullAndAbsentOptionalsDecode() throws {
        let withNulls = try ExportMetadata.decode(from: try metadataData {
            $0.setMetadata(["speculative_decoding"], to: NSNull())
            $0.setMetadata(["target", "final_logit_softcapping"], to: NSNull())
            $0.removeMetadata(["source", "drafter_checkpoint"])
        })
        XCTAssertNil(withNulls.speculativeDecoding)
        XCTAssertNil(withNulls.target.finalLogitSoftcapping)
        XCTAssertNil(withNulls.source.drafterCheckpoint)
    }

    func testMissingKeyIsNamedByItsPath() throws {
        let error = try decodingError { $0.removeMetadata(["speculative_decoding", "drafter", "head_dim"]) }
        XCTAssertEqual(error, .missingKey(path: "metadata.json", keyPath: "speculative_decoding.drafter.head_dim"))
    }

    func testWrongTypeInsideAnArrayIsNamedByItsPath() throws {
        let error = try decodingError {
            var states = ($0.metadata["assets"] as! [String: Any])["target"] as! [String: Any]
            var entries = states["states"] as! [[String: Any]]
            entries[1]["kv_heads"] = "one"
            states["states"] = entries
            $0.setMetadata(["assets", "target"], to: states)
        }
        guard case .wrongType(_, let keyPath, let expected)? = error else { return XCTFail("\(String(describing: error))") }
        XCTAssertEqual(keyPath, "assets.target.states[1].kv_heads")
        XCTAssertEqual(expected, "an integer")
        XCTAssertTrue(error!.description.contains("assets.target.states[1].kv_heads"))
    }

    func testInvalidJSONIsReported() throws {
        XCTAssertThrowsError(try ExportMetadata.decode(from: Data("{\"schema_version\": 1,".utf8))) { error in
            guard case .invalidJSON? = error as? ExportMetadataError else { return XCTFail("\(error)") }
        }
        XCTAssertThrowsError(try ExportMetadata.decode(from: Data([0xFF, 0xFE, 0x00, 0x7B])))
        XCTAssertThrowsError(try ExportMetadata.decode(from: Data("[1]".utf8)))
    }

    func testJSONValuesCompareByMeaning() throws {
        let decode = { (text: String) in try JSONDecoder().decode(JSONValue.self, from: Data(text.utf8)) }
        XCTAssertEqual(try decode("{\"a\": 1, \"b\": [true, null, \"x\"]}"), try decode("{\"b\":[true,null,\"x\"],\"a\":1.0}"))
        XCTAssertNotEqual(try decode("{\"a\": 1}"), try decode("{\"a\": true}"))
        XCTAssertNotEqual(try decode("{\"a\": 1}"), try decode("{\"a\": 1, \"b\": 2}"))
        XCTAssertEqual(try decode("{\"a\": {\"b\": [1, 2]}}").differences(from: try decode("{\"a\": {\"b\": [1, 3]}}")),
                       ["a.b[1]: 2 vs 3"])
    }
}
