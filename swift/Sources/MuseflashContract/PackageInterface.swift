import Foundation
import ExportMetadata
import MLPackage

/// What the contract inspects of one package: its functions as the device
/// sees them. Built either from the spec (everywhere) or from Core ML itself
/// (Apple platforms), so both sources are judged by the same properties.
public struct PackageInterface: Sendable, Equatable {
    public var url: URL
    /// A single-function package appears as one function named `main`.
    public var functions: [FunctionDescription]
    public var defaultFunctionName: String
    public var userDefinedMetadata: [String: String]
    /// Function name -> why the runtime could not create its state; only the
    /// Core ML source fills this.
    public var stateCreationFailures: [String: String]
    /// The ML program's operations (how the weights are stored), from the spec; nil when the
    /// package is not an ML program.
    public var program: MLProgram?
    /// The model spec file, against which the program's `@model_path/...` weight files resolve.
    public var modelURL: URL?
    /// `Model.specificationVersion` of the spec; nil when the source does not say.
    public var specificationVersion: Int?

    public init(url: URL, functions: [FunctionDescription], defaultFunctionName: String,
                userDefinedMetadata: [String: String], stateCreationFailures: [String: String] = [:],
                program: MLProgram? = nil, modelURL: URL? = nil, specificationVersion: Int? = nil) {
        self.url = url
        self.functions = functions
        self.defaultFunctionName = defaultFunctionName
        self.userDefinedMetadata = userDefinedMetadata
        self.stateCreationFailures = stateCreationFailures
        self.program = program
        self.modelURL = modelURL
        self.specificationVersion = specificationVersion
    }

    /// Core ML's name for the function of a package that declares none, which the contract
    /// also uses for the single-function ring drafter.
    public static let singleFunctionName = ExportMetadata.FunctionName.main.rawValue

    public func function(named name: String) -> FunctionDescription? {
        functions.first { $0.name == name }
    }

    public var functionNames: [String] { functions.map(\.name) }
}

extension PackageInterface {
    /// coremltools writes a multifunction program's interface under
    /// `description.functions`, and a single-function one at the top level of
    /// the description with no default function name.
    public init(package: MLPackage) {
        let description = package.description
        if description.functions.isEmpty {
            let main = FunctionDescription(name: Self.singleFunctionName, inputs: description.inputs,
                                           outputs: description.outputs, states: description.states)
            self.init(url: package.url, functions: [main], defaultFunctionName: Self.singleFunctionName,
                      userDefinedMetadata: package.userDefinedMetadata,
                      program: package.specification.program, modelURL: package.modelURL,
                      specificationVersion: package.specificationVersion)
        } else {
            self.init(url: package.url, functions: description.functions,
                      defaultFunctionName: description.defaultFunctionName,
                      userDefinedMetadata: package.userDefinedMetadata,
                      program: package.specification.program, modelURL: package.modelURL,
                      specificationVersion: package.specificationVersion)
        }
    }

    /// Reads only Manifest.json and the spec, never the weights (the compression properties
    /// read blob headers later, and only when metadata.json declares compression).
    public static func fromSpecification(at url: URL) throws -> PackageInterface {
        PackageInterface(package: try MLPackage.open(at: url))
    }
}

extension FunctionDescription {
    public func input(named name: String) -> FeatureDescription? { inputs.first { $0.name == name } }
    public func output(named name: String) -> FeatureDescription? { outputs.first { $0.name == name } }
    public func state(named name: String) -> FeatureDescription? { states.first { $0.name == name } }

    public func input(_ name: ExportMetadata.InputName) -> FeatureDescription? { input(named: name.rawValue) }
    public func output(_ name: ExportMetadata.OutputName) -> FeatureDescription? { output(named: name.rawValue) }
}
