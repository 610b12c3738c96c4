import Foundation
@testable import MuseflashRuntime
import XCTest
#if canImport(CoreML)
import CoreML
#else
import CoreMLStandIn
#endif

/// The Core ML backend against the strict stand-in (on a Mac, Core ML itself): each way a
/// backend could rely on the stand-in being kinder than Core ML is a fault that the golden
/// comparison must catch; states are shared only between functions that declare the same ones;
/// compiled models are cached across launches; other compute units stay within a tolerance.
final class CoreMLStrictnessTests: XCTestCase {
    typealias goldens = RuntimeGoldenTests

    func backend(_ units: MLComputeUnits = .cpuOnly, cache: URL? = nil) throws -> CoreMLBackend {
        try CoreMLBackend(.init(computeUnits: units, cacheDirectory: cache ?? RuntimeGoldenTests.scratch("cache")))
    }

    /// True when decoding a speculative golden case through `backend` throws or differs from
    /// the golden (tokens, accepted drafts or call trace): the first case only, or every one
    /// until one differs (a random drafter never accepted hides damage to its inputs in most).
    func goldenNotices(_ backend: CoreMLBackend, bundle: MuseflashBundle? = nil, allCases: Bool = false) throws -> Bool {
        let speculative = try goldens.cases().filter(\.speculative)
        guard !speculative.isEmpty else { throw XCTSkip("no speculative golden case") }
        let decoder: SpeculativeDecoder
        do {
            decoder = try SpeculativeDecoder(bundle: try bundle ?? goldens.bundle(), backend: backend)
        } catch {
            return true
        }
        for golden in allCases ? speculative : [speculative[0]] {
            do {
                let result = try decoder.generate(prompt: golden.prompt, options: goldens.options(golden))
                if result.tokens != golden.tokens || result.accepted != golden.accepted || result.trace != golden.trace { return true }
            } catch {
                return true
            }
        }
        return false
    }

    /// True when a parity call of the golden file that starts from fresh states (the first
    /// prefill, the first inject_kv) gives, through `backend`, an output beyond the fp16
    /// tolerance of the Python interpreter's. Damage to an input that a weak random model's
    /// greedy tokens absorb (4-bit tiny pairs decode the same tokens whatever one position
    /// holds) still shows in its logits and features.
    func parityNotices(_ backend: CoreMLBackend) throws -> Bool {
        guard let records = try goldens.parity?.get() else { return false }
        let package = try goldens.bundle().modelURL(of: .target)
        for record in records where record.startsFromFreshStates {
            let function = try backend.loadFunction(record.ran, of: package)
            let inputs = record.inputs.mapValues { tensor -> ShapedArray in
                tensor.type.isInteger ? ShapedArray(int32: tensor.ints(), shape: tensor.shape)
                    : ShapedArray(float: tensor.floats(), shape: tensor.shape)
            }
            let outputs: [String: ShapedArray]
            do {
                outputs = try function.predict(inputs, state: try backend.makeState(for: [function]))
            } catch {
                return true
            }
            for (name, want) in record.outputs {
                guard let got = outputs[name], got.shape == want.shape else { return true }
                if want.type.isInteger {
                    if got.int32s != want.ints() { return true }
                    continue
                }
                for (x, y) in zip(got.floats, want.floats()) where x.bitPattern != y.bitPattern {
                    if goldens.fp16Excess(x, y) > 0 { return true }
                }
            }
        }
        return false
    }

    func checkFaultIsCaught(_ configure: (inout CoreMLBackend.Faults) -> Void, what: String) throws {
        let healthy = try backend()
        XCTAssertFalse(try parityNotices(healthy), "the healthy backend's fresh-state calls must match before a fault can be seen")
        XCTAssertFalse(try goldenNotices(healthy), "the healthy backend must pass before a fault can be seen")
        let broken = try backend()
        configure(&broken.faults)
        let noticed = try parityNotices(broken) || goldenNotices(broken, allCases: true)
        XCTAssertTrue(noticed, "\(what): the stand-in let it through")
    }

    // MARK: Each strictness rule catches the backend bug it exists for

    func testABackendAssumingContiguousOutputsIsCaught() throws {
        try checkFaultIsCaught({ $0.assumeContiguousOutputs = true }, what: "outputs read as contiguous")
    }

    func testABackendWritingWithStaleStridesIsCaught() throws {
        try checkFaultIsCaught({ $0.ignoreHandedStrides = true }, what: "inputs written at the strides before withUnsafeMutableBytes")
    }

    func testABackendReadingUninitialisedMemoryIsCaught() throws {
        try checkFaultIsCaught({ $0.assumeZeroFilledInputs = true }, what: "inputs assumed zero-filled")
    }

    func testABackendPassingInt64IDsIsCaught() throws {
        try checkFaultIsCaught({ $0.int64IDsAsDoubles = true }, what: "ids as a double array of Int64 values")
    }

    /// An id given as an integer feature value (what a Swift Int in the dictionary becomes) is
    /// refused by name, not converted.
    func testAnInt64FeatureValueForIDsIsRefusedByName() throws {
        let bundle = try goldens.bundle()
        let function = try backend().loadFunction("main", of: try bundle.modelURL(of: .target)) as! CoreMLFunction
        let state = function.model.makeState()
        let provider = try MLDictionaryFeatureProvider(dictionary: ["input_ids": Int64(5)])
        XCTAssertThrowsError(try function.model.prediction(from: provider, using: state)) { error in
            XCTAssertTrue("\(error)".contains("input_ids"), "\(error)")
        }
    }

    // MARK: States

    func testSharingAStateAcrossMismatchedFunctionsIsRefusedByName() throws {
        let bundle = try goldens.bundle()
        let core = try backend()
        let prefill = try core.loadFunction("prefill", of: try bundle.modelURL(of: .target))
        let draft = try core.loadFunction("draft", of: try bundle.modelURL(of: .dflashDrafter))
        let main = try core.loadFunction("main", of: try bundle.modelURL(of: .target))
        XCTAssertNoThrow(try core.makeState(for: [prefill, main]))
        XCTAssertThrowsError(try core.makeState(for: [prefill, draft])) { error in
            let text = "\(error)"
            XCTAssertTrue(text.hasPrefix("draft: ") && text.contains("state ") && text.contains("prefill"), text)
        }
        // Without the check the state is shared, and the stand-in refuses the first prediction.
        let unchecked = try backend()
        unchecked.faults.skipStateCheck = true
        let uncheckedDraft = try unchecked.loadFunction("draft", of: try bundle.modelURL(of: .dflashDrafter))
        let shared = try unchecked.makeState(for: [try unchecked.loadFunction("prefill", of: try bundle.modelURL(of: .target)), uncheckedDraft])
        var inputs: [String: ShapedArray] = [:]
        for (name, description) in (uncheckedDraft as! CoreMLFunction).model.modelDescription.inputDescriptionsByName {
            let shape = description.multiArrayConstraint!.shape.map(\.intValue)
            let count = shape.reduce(1, *)
            inputs[name] = description.multiArrayConstraint!.dataType == .int32
                ? ShapedArray(int32: [Int32](repeating: 0, count: count), shape: shape)
                : ShapedArray(float: [Float](repeating: 0, count: count), shape: shape)
        }
        XCTAssertThrowsError(try uncheckedDraft.predict(inputs, state: shared)) { error in
            XCTAssertTrue("\(error)".contains("the state passed to draft"), "\(error)")
        }
    }

    // MARK: Loading compiled models

    func testTheStandInRefusesAnUncompiledPackage() throws {
        let package = try goldens.bundle().packageURL(of: .target)
        let configuration = MLModelConfiguration()
        configuration.functionName = "main"
        XCTAssertThrowsError(try MLModel(contentsOf: package, configuration: configuration))
        let compiled = try MLModel.compileModel(at: package)
        XCTAssertEqual(compiled.pathExtension, "mlmodelc")
        XCTAssertFalse(compiled.path.hasPrefix(package.path), "the compiled model must be separate from the package")
        XCTAssertNoThrow(try MLModel(contentsOf: compiled, configuration: configuration))
    }

    func testASecondOpenReusesTheCompiledModel() throws {
        let cache = RuntimeGoldenTests.scratch("cache")
        let bundle = try goldens.bundle()
        let package = try bundle.packageURL(of: .target).standardizedFileURL.path
        let first = try backend(cache: cache)
        _ = try SpeculativeDecoder(bundle: bundle, backend: first)
        XCTAssertEqual(first.compiledModelSources[package], .compiledIntoCache)
        let entries = try FileManager.default.contentsOfDirectory(atPath: cache.path).filter { !$0.hasPrefix(".") }
        XCTAssertEqual(entries.count, 1, "one cache entry per package: \(entries)")
        let second = try backend(cache: cache)
        XCTAssertFalse(try goldenNotices(second), "a reused compiled model decodes as the golden")
        XCTAssertEqual(second.compiledModelSources[package], .cached)
        XCTAssertEqual(try FileManager.default.contentsOfDirectory(atPath: cache.path).filter { !$0.hasPrefix(".") }, entries)
    }

    /// A copy of the golden bundle's files (not Bazel's read-only links) that a test may change.
    func bundleCopy() throws -> URL {
        let source = try goldens.bundle().url.resolvingSymlinksInPath()
        let copy = RuntimeGoldenTests.scratch("bundle").appendingPathComponent("export")
        let fileManager = FileManager.default
        for relative in (fileManager.enumerator(atPath: source.path)?.allObjects as? [String] ?? []).sorted() {
            let from = source.appendingPathComponent(relative).resolvingSymlinksInPath()
            let to = copy.appendingPathComponent(relative)
            var isDirectory: ObjCBool = false
            _ = fileManager.fileExists(atPath: from.path, isDirectory: &isDirectory)
            if isDirectory.boolValue {
                try fileManager.createDirectory(at: to, withIntermediateDirectories: true)
            } else {
                try fileManager.createDirectory(at: to.deletingLastPathComponent(), withIntermediateDirectories: true)
                try fileManager.copyItem(at: from, to: to)
            }
        }
        return copy
    }

    func testAChangedPackageIsRecompiled() throws {
        let cache = RuntimeGoldenTests.scratch("cache")
        let copy = try bundleCopy()
        let bundle = try MuseflashBundle.open(copy)
        let package = try bundle.packageURL(of: .target)
        let key = package.standardizedFileURL.path
        let first = try backend(cache: cache)
        _ = try SpeculativeDecoder(bundle: bundle, backend: first)
        let before = try FileManager.default.contentsOfDirectory(atPath: cache.path)
        // A changed manifest (whitespace keeps it valid) changes the package's digest.
        let manifest = package.appendingPathComponent("Manifest.json")
        try (try Data(contentsOf: manifest) + Data("\n".utf8)).write(to: manifest)
        let second = try backend(cache: cache)
        XCTAssertFalse(try goldenNotices(second, bundle: bundle))
        XCTAssertEqual(second.compiledModelSources[key], .compiledIntoCache)
        let after = try FileManager.default.contentsOfDirectory(atPath: cache.path)
        XCTAssertEqual(after.count, 1, "the stale entry is removed: \(after)")
        XCTAssertNotEqual(after, before)
    }

    /// A bundle that ships target.mlmodelc (an app Xcode built) in place of target.mlpackage.
    func compiledOnlyBundle() throws -> URL {
        let copy = try bundleCopy()
        let package = copy.appendingPathComponent("target.mlpackage")
        let compiled = try MLModel.compileModel(at: package)
        try FileManager.default.moveItem(at: compiled, to: MuseflashBundle.compiledForm(of: package))
        try FileManager.default.removeItem(at: package)
        return copy
    }

    func testAnMlmodelcOnlyBundleOpensAndDecodes() throws {
        let copy = try compiledOnlyBundle()
        let bundle = try MuseflashBundle.open(copy)
        let core = try backend()
        XCTAssertFalse(try goldenNotices(core, bundle: bundle), "the shipped .mlmodelc decodes as the golden")
        XCTAssertEqual(core.compiledModelSources.values.first, .shipped)
        XCTAssertThrowsError(try SpeculativeDecoder(bundle: bundle, backend: InterpreterBackend())) { error in
            XCTAssertTrue("\(error)".contains("compiled Core ML model"), "\(error)")
        }
    }

    /// A compiled model of another export of the same geometry loads and runs; only its embedded
    /// metadata tells it apart. Here metadata.json changes instead of the model: the same check.
    func testAnMlmodelcFromAnotherExportIsRefusedByName() throws {
        let copy = try compiledOnlyBundle()
        let metadataURL = copy.appendingPathComponent("metadata.json")
        var object = try XCTUnwrap(JSONSerialization.jsonObject(with: Data(contentsOf: metadataURL)) as? [String: Any])
        object["model_name"] = "another export"
        try JSONSerialization.data(withJSONObject: object).write(to: metadataURL)
        let bundle = try MuseflashBundle.open(copy)
        XCTAssertThrowsError(try SpeculativeDecoder(bundle: bundle, backend: try backend())) { error in
            guard case RuntimeError.compiledModelFromAnotherExport(let path, let difference) = error else { return XCTFail("\(error)") }
            XCTAssertEqual(path, MuseflashBundle.compiledForm(of: copy.appendingPathComponent("target.mlpackage")).path)
            XCTAssertTrue(difference.contains("model_name"), difference)
            XCTAssertFalse("\(error)".contains("\n"))
        }
    }

    func testAnMlmodelcLackingAListedFunctionIsRefusedByName() throws {
        let copy = try compiledOnlyBundle()
        let bundle = try MuseflashBundle.open(copy)
        let model = try bundle.modelURL(of: .target)
        XCTAssertThrowsError(try backend().loadFunction("verify_block", of: model)) { error in
            guard case RuntimeError.compiledModelMismatch(let path, let function, _) = error else { return XCTFail("\(error)") }
            XCTAssertEqual(function, "verify_block")
            XCTAssertEqual(path, model.path)
            XCTAssertFalse("\(error)".contains("\n"))
        }
    }

    func testAnUnwritableCacheWarnsOnceAndDecodes() throws {
        // A folder below a regular file cannot be created, whoever runs the test.
        let blocker = RuntimeGoldenTests.scratch("blocked").appendingPathComponent("file")
        try Data("x".utf8).write(to: blocker)
        let cache = blocker.appendingPathComponent("cache")
        let warnings = WarningLog()
        let core = try CoreMLBackend(.init(computeUnits: .cpuOnly, cacheDirectory: cache, warn: { warnings.append($0) }))
        XCTAssertFalse(try goldenNotices(core), "decoding goes on with a temporary compile")
        XCTAssertEqual(core.compiledModelSources.values.first, .compiledTemporarily)
        XCTAssertEqual(warnings.lines.count, 1, "\(warnings.lines)")
        XCTAssertTrue(warnings.lines.first?.contains(cache.path) ?? false, "\(warnings.lines)")
        XCTAssertFalse(warnings.lines.first?.contains("\n") ?? true)
    }

    // MARK: Compute units

    /// cpuOnly is exact (testCoreMLBackendDecodesAsThePythonLoop). On the GPU and the Neural
    /// Engine fp16 accumulation differs, so a near-tie may pick another token, after which the
    /// rest differs. Tolerance: every case keeps its first 4 tokens, and over all cases at least
    /// 75% of the golden tokens come before the first difference. The stand-in ignores the units
    /// (exact everywhere); a Mac runs all three over every case.
    func testOtherComputeUnitsStayWithinTolerance() throws {
        #if canImport(CoreML)
        let units: [MLComputeUnits] = [.cpuAndGPU, .cpuAndNeuralEngine, .all]
        let all = try goldens.cases()
        #else
        // The stand-in runs every unit on the interpreter: one case keeps the check cheap.
        let units: [MLComputeUnits] = [.all]
        let all = Array(try goldens.cases().prefix(1))
        #endif
        for unit in units {
            let decoder = try SpeculativeDecoder(bundle: try goldens.bundle(), backend: try backend(unit))
            var kept = 0, total = 0
            for golden in all {
                let result = try decoder.generate(prompt: golden.prompt, options: goldens.options(golden))
                let prefix = zip(result.tokens, golden.tokens).prefix { $0 == $1 }.count
                XCTAssertGreaterThanOrEqual(prefix, min(4, golden.tokens.count), "\(golden.name) on \(unit)")
                kept += prefix
                total += golden.tokens.count
            }
            XCTAssertGreaterThanOrEqual(Double(kept), 0.75 * Double(total), "compute units \(unit)")
        }
    }
}

/// Warnings collected from the backend's `warn` (which must be Sendable).
final class WarningLog: @unchecked Sendable {
    private let lock = NSLock()
    private var stored: [String] = []
    func append(_ line: String) { lock.withLock { stored.append(line) } }
    var lines: [String] { lock.withLock { stored } }
}
