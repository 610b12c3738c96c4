// swift-tools-version:5.9
// Mirrors the Bazel build: one module per directory, no outside dependencies.
import PackageDescription

let package = Package(
    name: "museflash",
    // The Core ML backend needs multifunction models and states (MLModelConfiguration.functionName,
    // MLState): macOS 15 / iOS 18. Declared here rather than as @available on every caller, so an
    // app's build states it once (docs/mac.md); tests/apple checks it stays.
    platforms: [.macOS("15.0"), .iOS("18.0")],
    products: [
        .library(name: "ProtoWire", targets: ["ProtoWire"]),
        .library(name: "MLPackage", targets: ["MLPackage"]),
        .library(name: "ExportMetadata", targets: ["ExportMetadata"]),
        .library(name: "MuseflashContract", targets: ["MuseflashContract"]),
        .library(name: "MILInterpreter", targets: ["MILInterpreter"]),
        // What an app depends on: the speculative-decoding engine and its backends.
        .library(name: "MuseflashRuntime", targets: ["MuseflashRuntime"]),
        .executable(name: "swift-generate", targets: ["swift-generate"]),
        .executable(name: "check-contract", targets: ["check-contract"]),
    ],
    targets: [
        .target(name: "ProtoWire"),
        // The Swift tools' one command-line reader (--flag value and --flag=value alike).
        .target(name: "CommandLineFlags"),
        .testTarget(name: "CommandLineFlagsTests", dependencies: ["CommandLineFlags"]),
        .target(name: "MLPackage", dependencies: ["ProtoWire"]),
        .target(name: "ExportMetadata"),
        .target(name: "MuseflashContract", dependencies: ["CommandLineFlags", "ExportMetadata", "MLPackage"]),
        // Runs a package's ML program on any platform (the interpreter backend, and what the
        // Core ML stand-in runs on Linux). No unsafe flags in any library: SwiftPM refuses them in
        // a package an app depends on by version (tests/apple checks it).
        .target(name: "MILInterpreter", dependencies: ["MLPackage"]),
        // Core ML's API as the runtime's CoreMLBackend uses it, over the interpreter; Linux only
        // (Apple platforms build the backend against the real framework).
        .target(name: "CoreMLStandIn", dependencies: ["MILInterpreter"]),
        .target(name: "MuseflashRuntime",
                dependencies: ["ChatTemplate", "ExportMetadata", "MLPackage", "MILInterpreter", "MuseflashTokenizer",
                               .target(name: "CoreMLStandIn", condition: .when(platforms: [.linux]))]),
        .executableTarget(name: "swift-generate", dependencies: ["ChatTemplate", "CommandLineFlags", "MuseflashRuntime"]),
        // Bazel and plain swiftc call this module CheckContract; main.swift never names its own module.
        .executableTarget(name: "check-contract", dependencies: ["MuseflashContract"]),
        // Test-only helpers (spec encoder, synthetic export bundles); no tests of its own.
        .target(name: "TestSupport", path: "Tests/TestSupport"),
        .testTarget(name: "ProtoWireTests", dependencies: ["ProtoWire", "TestSupport"]),
        .testTarget(
            name: "MLPackageTests",
            dependencies: ["MLPackage", "ProtoWire", "TestSupport"],
            // Fixtures are located via #filePath or MUSEFLASH_FIXTURES_DIR,
            // not as SwiftPM resources, so plain swiftc builds find them too.
            exclude: ["Fixtures"]
        ),
        .testTarget(
            name: "MuseflashContractTests",
            dependencies: ["MuseflashContract", "ExportMetadata", "MLPackage", "TestSupport"]
        ),
        // The next three, and MuseflashTokenizerTests' ParityTests, need files Bazel builds, named
        // by environment variables (see each test's doc comment); without them run
        // `swift test --skip ContractOnExportTests --skip MetadataExamplesTests
        // --skip RuntimeGoldenTests --skip MuseflashTokenizerTests.ParityTests`.
        // Needs MUSEFLASH_EXPORT_DIR.
        .testTarget(
            name: "ContractOnExportTests",
            dependencies: ["MuseflashContract", "ExportMetadata"]
        ),
        .testTarget(name: "MuseflashRuntimeTests", dependencies: ["MuseflashRuntime", "ExportMetadata", "MILInterpreter"]),
        // Needs MUSEFLASH_EXPORT_DIR and MUSEFLASH_GOLDENS (tests/runtime); skips without them.
        .testTarget(
            name: "RuntimeGoldenTests",
            dependencies: ["MuseflashRuntime", "MILInterpreter",
                           .target(name: "CoreMLStandIn", condition: .when(platforms: [.linux]))]
        ),
        // Needs MUSEFLASH_METADATA_EXAMPLES (bazel build //python:metadata_examples).
        .testTarget(
            name: "MetadataExamplesTests",
            dependencies: ["ExportMetadata"]
        ),
        // Byte-level BPE and WordLevel tokenizers from the bundle's tokenizer.json (docs/tokenizer.md).
        .target(name: "MuseflashTokenizer"),
        // Its parity tests need MUSEFLASH_TOKENIZER_GOLDENS (bazel build //python:tokenizer_goldens).
        .testTarget(name: "MuseflashTokenizerTests", dependencies: ["MuseflashTokenizer"]),
        // Chat templates (the Jinja subset they use), rendered as transformers renders them.
        .target(name: "ChatTemplate"),
        .testTarget(name: "ChatTemplateTests", dependencies: ["ChatTemplate"]),
        // `swift run swift-tokenize --export-dir DIR --prompt TEXT`; Bazel calls the module SwiftTokenize.
        .executableTarget(name: "swift-tokenize", dependencies: ["ChatTemplate", "CommandLineFlags", "MuseflashTokenizer", "ExportMetadata"]),
    ]
)
