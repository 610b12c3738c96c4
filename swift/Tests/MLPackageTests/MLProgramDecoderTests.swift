import XCTest
import Foundation
import ProtoWire
import MLPackage
import TestSupport

/// `Model.mlProgram` decoding, on hand-encoded programs laid out as coremltools writes a
/// compressed export (a constexpr op whose inputs are inline values in weight file blobs).
final class MLProgramDecoderTests: XCTestCase {
    private let weights = MILBytes.weightFileName

    private func spec(program: [UInt8]) throws -> ModelSpecification {
        try ModelSpecification(serializedBytes: SpecBytes.model(version: 9, description: SpecBytes.string(21, "main"),
                                                                extra: SpecBytes.message(502, program)))
    }

    /// main: a constexpr_blockwise_shift_scale weight, a const weight, an inline scalar and a
    /// matmul using the weight by name.
    private func mainFunction(dataOffset: UInt64 = 64, unknown: [UInt8] = []) -> [UInt8] {
        let constexpr = MILBytes.operation("constexpr_blockwise_shift_scale", inputs: [
            ("data", [.value(MILBytes.blobValue(MILBytes.int4, [512, 128], offset: dataOffset) + unknown)]),
            ("scale", [.value(MILBytes.blobValue(MILBytes.float16, [512, 4], offset: 32_896))]),
        ], outputs: [MILBytes.namedValueType("p_up_weight", MILBytes.float16, [512, 128]) + unknown]) + unknown
        let const = MILBytes.operation("const", outputs: [MILBytes.namedValueType("p_q_weight", MILBytes.float16, [128, 128])],
                                       attributes: [("val", MILBytes.blobValue(MILBytes.float16, [128, 128], offset: 37_056))])
        let scalar = MILBytes.operation("const", outputs: [MILBytes.namedValueType("axis", MILBytes.int32, [])],
                                        attributes: [("val", MILBytes.immediateScalar)])
        let matmul = MILBytes.operation("matmul", inputs: [("x", [.name("input_ids")]), ("y", [.name("p_up_weight")])],
                                        outputs: [MILBytes.namedValueType("product", MILBytes.float16, [1, 512])])
        return MILBytes.function(block: MILBytes.block(operations: [constexpr, const, scalar, matmul], outputs: ["product"]) + unknown,
                                 inputs: [MILBytes.namedValueType("input_ids", MILBytes.int32, [1, 8])]) + unknown
    }

    func testDecodesFunctionsOperationsAndBlobValues() throws {
        let program = try XCTUnwrap(try spec(program: MILBytes.program([("main", mainFunction()),
                                                                        ("prefill", mainFunction())])).program)
        XCTAssertEqual(program.version, 1)
        XCTAssertEqual(program.functions.map(\.name), ["main", "prefill"])
        let main = try XCTUnwrap(program.function(named: "main"))
        XCTAssertEqual(main.opset, "CoreML8")
        XCTAssertEqual(main.inputs, [MILNamedValueType(name: "input_ids", type: .tensor(MILTensorType(
            dataType: .int32, rank: 2, dimensions: [.constant(1), .constant(8)])))])
        let block = try XCTUnwrap(main.block)
        XCTAssertEqual(block.outputs, ["product"])
        XCTAssertEqual(block.operations.map(\.type), ["constexpr_blockwise_shift_scale", "const", "const", "matmul"])

        let constexpr = block.operations[0]
        XCTAssertEqual(constexpr.inputs.map(\.name), ["data", "scale"])
        let data = try XCTUnwrap(constexpr.input(named: "data")?.first?.value)
        XCTAssertEqual(data.tensorType?.dataType, .int4)
        XCTAssertEqual(data.tensorType?.shape, [512, 128])
        XCTAssertEqual(data.tensorType?.rank, 2)
        XCTAssertEqual(data.blob, MILBlobReference(fileName: weights, offset: 64))
        XCTAssertEqual(constexpr.input(named: "scale")?.first?.value?.blob?.offset, 32_896)
        XCTAssertEqual(constexpr.outputs, [MILNamedValueType(name: "p_up_weight", type: .tensor(MILTensorType(
            dataType: .float16, rank: 2, dimensions: [.constant(512), .constant(128)])))])

        XCTAssertEqual(block.operations[1].attributes["val"]?.blob, MILBlobReference(fileName: weights, offset: 37_056))
        XCTAssertEqual(block.operations[2].attributes["val"]?.storage, .immediate)
        XCTAssertEqual(block.operations[2].attributes["val"]?.tensorType?.shape, [])
        XCTAssertEqual(block.operations[3].input(named: "y"), [.name("p_up_weight")])
    }

    func testUnknownFieldsAreSkippedInsideTheProgram() throws {
        let plain = try spec(program: MILBytes.program([("main", mainFunction())]))
        let noisy = try spec(program: MILBytes.program([("main", mainFunction(unknown: SpecBytes.unknownFields))])
                             + SpecBytes.unknownFields)
        XCTAssertEqual(noisy.program, plain.program)
    }

    /// Maps keep their last value for a repeated key; a repeated Model.mlProgram merges.
    func testMapAndMergeSemantics() throws {
        let program = try XCTUnwrap(try spec(program: MILBytes.program([
            ("main", mainFunction(dataOffset: 64)), ("draft", mainFunction()), ("main", mainFunction(dataOffset: 128)),
        ])).program)
        XCTAssertEqual(program.functions.map(\.name), ["main", "draft"])
        XCTAssertEqual(program.function(named: "main")?.block?.operations[0].input(named: "data")?.first?.value?.blob?.offset, 128)

        let bytes = SpecBytes.model(version: 9, description: SpecBytes.string(21, "main"), extra:
            SpecBytes.message(502, MILBytes.program([("main", mainFunction())]))
            + SpecBytes.message(502, MILBytes.program([("prefill", mainFunction())])))
        XCTAssertEqual(try ModelSpecification(serializedBytes: bytes).program?.functions.map(\.name), ["main", "prefill"])
        // Another member of the Model.Type oneof replaces the program.
        let replaced = bytes + SpecBytes.message(500, [])
        let spec = try ModelSpecification(serializedBytes: replaced)
        XCTAssertNil(spec.program)
        XCTAssertEqual(spec.modelTypeName, "neuralNetwork")
    }

    func testNestedBlocksAreVisitedInOrder() throws {
        func op(_ name: String) -> [UInt8] {
            MILBytes.operation("const", outputs: [MILBytes.namedValueType(name, MILBytes.float16, [2, 2])],
                               attributes: [("val", MILBytes.blobValue(MILBytes.float16, [2, 2], offset: 64))])
        }
        let inner = MILBytes.operation("cond", outputs: [], blocks: [MILBytes.block(operations: [op("c")])])
        let outer = MILBytes.operation("while_loop", outputs: [],
                                       blocks: [MILBytes.block(operations: [op("b"), inner]), MILBytes.block(operations: [op("d")])])
        let block = MILBytes.block(operations: [op("a"), outer, op("e")])
        let program = try XCTUnwrap(try spec(program: MILBytes.program([("main", MILBytes.function(block: block))])).program)
        let names = program.functions[0].block?.allOperations.map { $0.outputs.first?.name ?? $0.type }
        XCTAssertEqual(names, ["a", "while_loop", "b", "cond", "c", "d", "e"])
    }

    func testBlocksNestedTooDeepAreRejected() {
        var block = MILBytes.block(operations: [])
        for _ in 0...MLProgram.maximumBlockDepth {
            block = MILBytes.block(operations: [MILBytes.operation("cond", outputs: [], blocks: [block])])
        }
        XCTAssertThrowsError(try spec(program: MILBytes.program([("main", MILBytes.function(block: block))]))) { error in
            guard case .nestingTooDeep? = error as? SpecDecodingError else { return XCTFail("\(error)") }
        }
    }

    func testDimensionsAndDataTypes() throws {
        let variadic = SpecBytes.message(3, SpecBytes.message(2, SpecBytes.int(1, 1)))  // dimensions: unknown { variadic }
        let type = SpecBytes.int(1, 35) + SpecBytes.int(2, 2) + SpecBytes.message(3, SpecBytes.message(1, SpecBytes.int(1, 4)))
            + variadic
        let output = SpecBytes.string(1, "x") + SpecBytes.message(2, MILBytes.valueType(type))
        let block = MILBytes.block(operations: [MILBytes.operation("identity", outputs: [output])])
        let program = try XCTUnwrap(try spec(program: MILBytes.program([("main", MILBytes.function(block: block))])).program)
        let tensor = try XCTUnwrap(program.functions[0].block?.operations[0].outputs[0].tensorType)
        XCTAssertEqual(tensor.dataType, .uint4)
        XCTAssertEqual(tensor.dimensions, [.constant(4), .unknown(variadic: true)])
        XCTAssertNil(tensor.shape)
        XCTAssertNil(tensor.elementCount)
        XCTAssertEqual(MILDataType(rawValue: 99), .unrecognized(99))
        for raw: Int32 in [10, 21, 25, 31, 35, 99] {
            XCTAssertEqual(MILDataType(rawValue: raw).rawValue, raw)
        }
        XCTAssertEqual(MILDataType.int4.bitWidth, 4)
        XCTAssertEqual(MILDataType.uint8.bitWidth, 8)
        XCTAssertEqual(MILDataType.float16.description, "FLOAT16")
    }

    func testEveryTruncationOfAProgramThrowsTypedErrorOrDecodes() {
        let bytes = SpecBytes.model(version: 9, description: SpecBytes.string(21, "main"),
                                    extra: SpecBytes.message(502, MILBytes.program([("main", mainFunction())])))
        for length in 0..<bytes.count {
            do {
                _ = try ModelSpecification(serializedBytes: Array(bytes[0..<length]))
            } catch {
                XCTAssertTrue(error is SpecDecodingError, "prefix of \(length) bytes: unexpected error type \(error)")
            }
        }
    }
}

/// Blob headers of weight files, bounds-checked, with errors naming the file and offset.
final class WeightFileTests: XCTestCase {
    private var scratch: URL!

    override func setUpWithError() throws {
        scratch = try ScratchDirectory.make()
    }

    override func tearDown() {
        ScratchDirectory.remove(scratch)
        super.tearDown()
    }

    private func write(_ bytes: [UInt8]) throws -> URL {
        let url = scratch.appendingPathComponent("weight.bin")
        try Data(bytes).write(to: url)
        return url
    }

    func testReadsHeadersWrittenAsMILBlobDoes() throws {
        var file = WeightFileBuilder()
        let int4 = file.append(dataType: WeightFileBuilder.int4, size: 5)
        let scale = file.append(dataType: WeightFileBuilder.float16, size: 128)
        let lut = file.append(dataType: WeightFileBuilder.uint4, size: 256)
        let url = try write(file.bytes)
        let headers = try WeightFile.readHeaders(at: [int4, scale, lut], of: url)
        XCTAssertEqual(try headers[int4]?.get(), BlobHeader(offset: 64, dataType: .int4, size: 5, dataOffset: 128))
        XCTAssertEqual(try headers[scale]?.get(), BlobHeader(offset: 192, dataType: .float16, size: 128, dataOffset: 256))
        XCTAssertEqual(try headers[lut]?.get().dataType, .uint4)
        XCTAssertEqual(BlobHeader.packedSize(elements: 9, bits: 4), 5)
        XCTAssertEqual(BlobDataType(rawValue: 11).milDataType, .uint4)
        XCTAssertEqual(BlobDataType(rawValue: 3).milDataType, .uint8)
        XCTAssertEqual(BlobDataType(rawValue: 4).milDataType, .int8)
        XCTAssertEqual(BlobDataType(rawValue: 99), .unrecognized(99))
    }

    func testBadOffsetsAreNamedWithTheFile() throws {
        var file = WeightFileBuilder()
        let blob = file.append(dataType: WeightFileBuilder.int8, size: 64)
        var bytes = file.bytes
        let url = try write(bytes)
        let path = url.path
        let headers = try WeightFile.readHeaders(at: [blob + 1, 64 * 100, 0, UInt64.max - 63], of: url)
        XCTAssertEqual(headers[blob + 1].flatMap { try? $0.get() }, nil)
        XCTAssertEqual(headerError(headers[blob + 1]), .misalignedHeader(path: path, offset: blob + 1))
        XCTAssertEqual(headerError(headers[6400]), .headerOutOfBounds(path: path, offset: 6400, fileSize: UInt64(bytes.count)))
        XCTAssertEqual(headerError(headers[UInt64.max - 63]),
                       .headerOutOfBounds(path: path, offset: UInt64.max - 63, fileSize: UInt64(bytes.count)))
        // The file header is no blob header.
        XCTAssertEqual(headerError(headers[0]), .badSentinel(path: path, offset: 0, found: 1))
        XCTAssertTrue("\(headerError(headers[0])!)".contains("\(path) at offset 0"))

        // A size running past the end of the file.
        bytes.replaceSubrange(Int(blob) + 8..<Int(blob) + 16, with: WeightFileBuilder.little(UInt64(1000)))
        let long = try write(bytes)
        XCTAssertEqual(headerError(try WeightFile.readHeaders(at: [blob], of: long)[blob]),
                       .dataOutOfBounds(path: path, offset: blob, dataOffset: blob + 64, size: 1000, fileSize: UInt64(bytes.count)))
        // Data that would overlap its own header.
        bytes.replaceSubrange(Int(blob) + 8..<Int(blob) + 24, with: WeightFileBuilder.little(UInt64(8)) + WeightFileBuilder.little(blob))
        let overlapping = try write(bytes)
        XCTAssertEqual(headerError(try WeightFile.readHeaders(at: [blob], of: overlapping)[blob]),
                       .dataOutOfBounds(path: path, offset: blob, dataOffset: blob, size: 8, fileSize: UInt64(bytes.count)))
    }

    private func headerError(_ result: Result<BlobHeader, WeightFileError>?) -> WeightFileError? {
        guard case .failure(let error)? = result else { return nil }
        return error
    }

    func testMissingFileAndDirectoryAreErrors() throws {
        let missing = scratch.appendingPathComponent("nope.bin")
        XCTAssertThrowsError(try WeightFile.readHeaders(at: [64], of: missing)) { error in
            XCTAssertEqual(error as? WeightFileError, .missingFile(path: missing.path))
        }
        XCTAssertThrowsError(try WeightFile.readHeaders(at: [64], of: scratch)) { error in
            guard case .unreadableFile? = error as? WeightFileError else { return XCTFail("\(error)") }
        }
    }

    func testBlobFileNamesResolveInsideThePackageOnly() throws {
        let package = scratch.appendingPathComponent("x.mlpackage")
        let model = package.appendingPathComponent("Data/com.apple.CoreML/model.mlmodel")
        try FileManager.default.createDirectory(at: model.deletingLastPathComponent().appendingPathComponent("weights"),
                                                withIntermediateDirectories: true)
        let url = try WeightFile.url(forBlobFile: "@model_path/weights/weight.bin", modelURL: model, packageURL: package)
        XCTAssertEqual(url.path, package.appendingPathComponent("Data/com.apple.CoreML/weights/weight.bin").path)
        for name in ["weights/weight.bin", "@model_path/../../../metadata.json", "@model_path//etc/passwd", "@model_path/",
                     "/tmp/weight.bin"] {
            XCTAssertThrowsError(try WeightFile.url(forBlobFile: name, modelURL: model, packageURL: package), name) { error in
                XCTAssertEqual(error as? WeightFileError, .unsupportedFileName(fileName: name))
            }
        }
        // A directory along the way that leads out of the package.
        let outside = scratch.appendingPathComponent("outside")
        try FileManager.default.createDirectory(at: outside, withIntermediateDirectories: true)
        try FileManager.default.createSymbolicLink(at: model.deletingLastPathComponent().appendingPathComponent("escape"),
                                                   withDestinationURL: outside)
        XCTAssertThrowsError(try WeightFile.url(forBlobFile: "@model_path/escape/weight.bin", modelURL: model, packageURL: package))
    }
}

/// The programs of the coremltools-made fixtures: every const weight's blob has a header that
/// agrees with the tensor the spec declares (dtype and size).
final class FixtureProgramTests: XCTestCase {
    func testConstBlobsOfCoremltoolsPackagesMatchTheirHeaders() throws {
        for name in ["Ranged.mlpackage", "Enumerated.mlpackage", "Stateful.mlpackage", "MultiFunction.mlpackage"] {
            let package = try MLPackage.open(at: FixtureLocator.url(name))
            let program = try XCTUnwrap(package.specification.program, name)
            XCTAssertEqual(program.functions.map(\.name).isEmpty, false, name)
            var tensors: [MILBlobReference: MILTensorType] = [:]
            for function in program.functions {
                let block = try XCTUnwrap(function.block, "\(name) \(function.name) has no block for opset \(function.opset)")
                XCTAssertTrue(block.operations.contains { $0.type != "const" }, "\(name) \(function.name)")
                for operation in block.allOperations where operation.type == "const" {
                    if let value = operation.attributes["val"], let blob = value.blob {
                        tensors[blob] = value.tensorType
                    }
                }
            }
            XCTAssertFalse(tensors.isEmpty, "\(name) has no weights in a blob")
            for (fileName, references) in Dictionary(grouping: tensors.keys, by: \.fileName) {
                XCTAssertEqual(fileName, "@model_path/weights/weight.bin")
                let url = try WeightFile.url(forBlobFile: fileName, modelURL: package.modelURL, packageURL: package.url)
                let headers = try WeightFile.readHeaders(at: Set(references.map(\.offset)), of: url)
                for reference in references {
                    let header = try XCTUnwrap(headers[reference.offset]).get()
                    let tensor = try XCTUnwrap(tensors[reference])
                    XCTAssertEqual(header.dataType.milDataType, tensor.dataType, "\(name) @\(reference.offset)")
                    let bits = try XCTUnwrap(tensor.dataType.bitWidth)
                    XCTAssertEqual(header.size, BlobHeader.packedSize(elements: try XCTUnwrap(tensor.elementCount), bits: bits),
                                   "\(name) @\(reference.offset)")
                }
            }
        }
    }
}
