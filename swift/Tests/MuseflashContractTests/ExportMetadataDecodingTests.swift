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
        XCTAssertEqual(metadata.schemaVersion, 3)
        XCTAssertEqual(ExportMetadata.supportedSchemaVersions, [1, 2, 3])
        XCTAssertTrue(metadata.isSchemaVersionSupported)
        XCTAssertEqual(metadata.assets[.target]?.path, "target.mlpackage")
        XCTAssertEqual(metadata.assets[.dflashDrafter]?.path, "target.mlpackage")
        XCTAssertEqual(metadata.generator.name, "museflash")
        XCTAssertEqual(metadata.generator.version, "0.1.0")
        XCTAssertEqual(metadata.vocabSize, 64)
        XCTAssertEqual(metadata.contextLength, 32)
        XCTAssertEqual(metadata.target.layerTypes.count, 4)
        XCTAssertEqual(metadata.target.finalLogitSoftcapping, 30.0)
        XCTAssertEqual(metadata.target.layerTypes, [.slidingAttention, .slidingAttention, .slidingAttention, .fullAttention])
        XCTAssertEqual(Set(metadata.assets.keys), [.target, .dflashDrafter])
        XCTAssertEqual(metadata.assets[.target]?.kind, .fusedTarget)
        XCTAssertEqual(metadata.assets[.target]?.functions[.prefill]?.role, .prefill)
        XCTAssertEqual(metadata.assets[.target]?.functions[.main]?.outputs, [.logits, .drafterFeatures])
        let drafter = try XCTUnwrap(metadata.assets[.dflashDrafter])
        XCTAssertEqual(drafter.kind, .dflashDrafter)
        XCTAssertEqual(drafter.defaultFunction, .draft)
        XCTAssertEqual(drafter.functions[.injectKV]?.role, .injectKV)
        XCTAssertEqual(drafter.functions[.injectKV]?.queryLength, 8)
        XCTAssertEqual(drafter.functions[.injectKV]?.inputs, [.features, .positionIDs])
        XCTAssertEqual(drafter.functions[.injectKV]?.outputs, [.lastInjectedPosition])
        XCTAssertEqual(drafter.functions[.draft]?.inputs, [.inputIDs, .positionIDs])
        XCTAssertEqual(drafter.states.map(\.name), [.drafterKeyCache, .drafterValueCache])
        XCTAssertEqual(drafter.states.map(\.kind), [.slidingKV, .slidingKV])
        XCTAssertEqual(drafter.states.map(\.role), [.key, .value])
        XCTAssertEqual(drafter.states.first?.kvHeads, 1)
        XCTAssertEqual(drafter.states.first?.shape, [2, 1, 16, 8])
        let speculative = try XCTUnwrap(metadata.speculativeDecoding)
        XCTAssertEqual(speculative.drafterKind, .dflash)
        XCTAssertEqual(speculative.blockSize, 4)
        XCTAssertEqual(speculative.targetLayerIds, [1, 2])
        XCTAssertEqual(speculative.drafter.slidingWindow, 8)
        XCTAssertTrue(speculative.sharedEmbeddings)
        XCTAssertEqual(metadata.source.checkpoint, "builtin:demo")
    }

    /// A document of an older version (the drafter in its own package) decodes as before.
    func testSchemaVersionTwoWithSeparatePackagesDecodes() throws {
        let data = Data(try SyntheticExport.fusedTargetWithSeparateDFlashDrafter(schemaVersion: 2).metadataText().utf8)
        let metadata = try ExportMetadata.decode(from: data)
        XCTAssertEqual(metadata.schemaVersion, 2)
        XCTAssertTrue(metadata.isSchemaVersionSupported)
        XCTAssertFalse(metadata.allowsSharedPackages)
        XCTAssertEqual(metadata.assets[.dflashDrafter]?.path, "dflash_drafter.mlpackage")
        XCTAssertEqual(metadata.assets[.dflashDrafter]?.states.map(\.name), [.slidingKeyCache, .slidingValueCache])
        XCTAssertEqual(metadata.packages.map(\.owner), [.target, .dflashDrafter])
    }

    /// A version this reader does not know decodes (when it still fits) but is not supported.
    func testSchemaVersionFourIsNotSupported() throws {
        let metadata = try ExportMetadata.decode(from: try metadataData { $0.setMetadata(["schema_version"], to: 4) })
        XCTAssertEqual(metadata.schemaVersion, 4)
        XCTAssertFalse(metadata.isSchemaVersionSupported)
        XCTAssertEqual(try ExportMetadata.decodeSchemaVersion(from: try metadataData { $0.setMetadata(["schema_version"], to: 4) }), 4)
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

    /// Enumerated names are closed: an unknown one fails decoding, naming its key path.
    func testUnknownNameIsRejectedNamingItsPath() throws {
        let cases: [(keyPath: [String], value: Any, reported: String)] = [
            (["assets", "target", "kind"], "fused", "assets.target.kind"),
            (["assets", "target", "default_function"], "generate", "assets.target.default_function"),
            (["assets", "target", "functions", "main", "role"], "verify", "assets.target.functions.main.role"),
            (["assets", "target", "functions", "main", "inputs"], ["input_ids", "token_ids"],
             "assets.target.functions.main.inputs[1]"),
            (["assets", "dflash_drafter", "functions", "inject_kv", "outputs"], ["done"],
             "assets.dflash_drafter.functions.inject_kv.outputs[0]"),
            (["speculative_decoding", "drafter_kind"], "eagle", "speculative_decoding.drafter_kind"),
            (["target", "layer_types"], ["sliding_attention", "linear_attention"], "target.layer_types[1]"),
            (["assets", "medusa_drafter"], ["path": "medusa.mlpackage"], "assets.medusa_drafter"),
            (["assets", "target", "functions", "verify"], ["role": "decode"], "assets.target.functions.verify"),
        ]
        for (keyPath, value, reported) in cases {
            let error = try decodingError { $0.setMetadata(keyPath, to: value) }
            guard case .invalidValue(_, let path, let reason)? = error else {
                XCTFail("\(reported): \(String(describing: error))")
                continue
            }
            XCTAssertEqual(path, reported)
            XCTAssertTrue(reason.hasPrefix("unknown "), reason)
        }
    }

    func testUnknownStateNamesKindsAndRolesAreRejected() throws {
        for (key, value) in [("name", "ringCache"), ("kind", "paged_kv"), ("role", "query")] {
            let error = try decodingError { export in
                var target = (export.metadata["assets"] as! [String: Any])["target"] as! [String: Any]
                var states = target["states"] as! [[String: Any]]
                states[2][key] = value
                target["states"] = states
                export.setMetadata(["assets", "target"], to: target)
            }
            guard case .invalidValue(_, let path, let reason)? = error else { XCTFail("\(key): \(String(describing: error))"); continue }
            XCTAssertEqual(path, "assets.target.states[2].\(key)")
            XCTAssertTrue(reason.contains("\"\(value)\""), reason)
        }
    }

    /// Unknown keys of every object with fixed keys are ignored, so a later additive field still
    /// decodes. (Objects keyed by names, `assets` and `functions`, are closed like the names.)
    func testUnknownKeysAreIgnoredAtEveryLevel() throws {
        let plain = try ExportMetadata.decode(from: try metadataData())
        let extended = try ExportMetadata.decode(from: try metadataData { export in
            for object in [[], ["generator"], ["target"], ["assets", "target"], ["assets", "dflash_drafter"],
                           ["assets", "target", "functions", "main"], ["speculative_decoding"],
                           ["speculative_decoding", "drafter"], ["source"]] {
                export.setMetadata(object + ["added_later"], to: ["nested": [1, 2]])
            }
            var target = (export.metadata["assets"] as! [String: Any])["target"] as! [String: Any]
            var states = target["states"] as! [[String: Any]]
            states[0]["added_later"] = true
            target["states"] = states
            export.setMetadata(["assets", "target"], to: target)
        })
        XCTAssertEqual(extended, plain)
    }

    /// Encoding gives back the JSON that was decoded (nil optionals are left out).
    func testEncodingRoundTrips() throws {
        let decode = { (data: Data) in try JSONDecoder().decode(JSONValue.self, from: data) }
        let older = Data(try SyntheticExport.fusedTargetWithSeparateDFlashDrafter(schemaVersion: 2).metadataText().utf8)
        for data in [try metadataData(), try metadataData { try! $0.addTokenizer() }, older] {
            let encoded = try JSONEncoder().encode(try ExportMetadata.decode(from: data))
            XCTAssertEqual(try decode(encoded), try decode(data))
        }
    }

    func testTokenizerDecodes() throws {
        XCTAssertNil(try ExportMetadata.decode(from: try metadataData()).tokenizer)
        XCTAssertNil(try ExportMetadata.decode(from: try metadataData { $0.setMetadata(["tokenizer"], to: NSNull()) }).tokenizer)
        let tokenizer = try XCTUnwrap(try ExportMetadata.decode(from: try metadataData { try! $0.addTokenizer() }).tokenizer)
        XCTAssertEqual(tokenizer, ExportMetadata.Tokenizer(files: ["tokenizer.json", "tokenizer_config.json"],
                                                           vocabSize: 64, specialTokens: ["<mask>": 63]))
        let extended = try ExportMetadata.decode(from: try metadataData {
            try! $0.addTokenizer()
            $0.setMetadata(["tokenizer", "added_later"], to: ["nested": [1, 2]])
        })
        XCTAssertEqual(extended.tokenizer, tokenizer)
    }

    func testMalformedTokenizerIsNamedByItsPath() throws {
        let missing = try decodingError {
            try! $0.addTokenizer()
            $0.removeMetadata(["tokenizer", "vocab_size"])
        }
        XCTAssertEqual(missing, .missingKey(path: "metadata.json", keyPath: "tokenizer.vocab_size"))
        let wrongType = try decodingError {
            try! $0.addTokenizer()
            $0.setMetadata(["tokenizer", "special_tokens", "<mask>"], to: "63")
        }
        guard case .wrongType(_, let keyPath, _)? = wrongType else { return XCTFail("\(String(describing: wrongType))") }
        XCTAssertEqual(keyPath, "tokenizer.special_tokens.<mask>")
    }

    func testFractionInAnIntegerFieldIsNamed() throws {
        let error = try decodingError { $0.setMetadata(["assets", "target", "functions", "main", "query_length"], to: 4.5) }
        guard case .invalidValue(_, let keyPath, _)? = error else { return XCTFail("\(String(describing: error))") }
        XCTAssertEqual(keyPath, "assets.target.functions.main.query_length")
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
