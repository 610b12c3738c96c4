#if canImport(CoreML)
import CoreML
import Foundation
import MLPackage

// UNTESTED: written on Linux, where Core ML does not exist and this file is
// compiled out. It feeds the runtime's own view of each package into the same
// properties as the spec reader, so app developers get the same verdict from
// the real runtime: `ContractChecker(loadInterface: CoreMLInterfaceLoader.load)`.
@available(macOS 15.0, iOS 18.0, *)
public enum CoreMLInterfaceLoader {
    /// Function names and the ML program's operations come from the spec (Core ML offers no
    /// synchronous way to list them); everything else about each function comes from Core ML.
    public static func load(packageURL: URL) throws -> PackageInterface {
        let package = try MLPackage.open(at: packageURL)
        let specInterface = PackageInterface(package: package)
        let compiledURL = try MLModel.compileModel(at: packageURL)
        defer { try? FileManager.default.removeItem(at: compiledURL) }

        var functions: [FunctionDescription] = []
        var stateFailures: [String: String] = [:]
        var userDefined: [String: String] = [:]
        for name in specInterface.functionNames {
            let configuration = MLModelConfiguration()
            configuration.computeUnits = .cpuOnly
            if package.isMultiFunction { configuration.functionName = name }
            let model = try MLModel(contentsOf: compiledURL, configuration: configuration)
            let description = model.modelDescription
            let byName = { (features: [String: MLFeatureDescription]) in
                features.values.sorted { $0.name < $1.name }.map(feature)
            }
            let function = FunctionDescription(name: name, inputs: byName(description.inputDescriptionsByName),
                                               outputs: byName(description.outputDescriptionsByName),
                                               states: byName(description.stateDescriptionsByName))
            functions.append(function)
            if let failure = stateFailure(model: model, states: function.states) {
                stateFailures[name] = failure
            }
            if let metadata = description.metadata[.creatorDefinedKey] as? [String: String] {
                userDefined = metadata
            }
        }
        return PackageInterface(url: packageURL, functions: functions,
                                defaultFunctionName: specInterface.defaultFunctionName,
                                userDefinedMetadata: userDefined, stateCreationFailures: stateFailures,
                                program: specInterface.program, modelURL: specInterface.modelURL,
                                specificationVersion: specInterface.specificationVersion)
    }

    /// Makes the function's state and checks every buffer has the declared
    /// shape, which is what the app relies on when it shares one state.
    private static func stateFailure(model: MLModel, states: [FeatureDescription]) -> String? {
        guard !states.isEmpty else { return nil }
        let state = model.makeState()
        var problems: [String] = []
        for declared in states {
            let expected = declared.type.multiArray?.shape ?? []
            state.withMultiArray(for: declared.name) { buffer in
                let actual = buffer.shape.map(\.int64Value)
                if actual != expected { problems.append("\(declared.name) buffer is \(actual), declared \(expected)") }
            }
        }
        return problems.isEmpty ? nil : problems.joined(separator: "; ")
    }

    private static func feature(_ description: MLFeatureDescription) -> FeatureDescription {
        let type: FeatureType
        switch description.type {
        case .multiArray:
            if let constraint = description.multiArrayConstraint {
                type = .multiArray(arrayType(constraint))
            } else {
                type = .unknown(fieldNumber: nil)
            }
        case .state:
            if let constraint = description.stateConstraint {
                type = .state(MultiArrayType(shape: constraint.bufferShape.map(\.int64Value),
                                             dataType: ArrayDataType(rawValue: Int32(constraint.dataType.rawValue))))
            } else {
                type = .state(nil)
            }
        case .int64: type = .int64
        case .double: type = .double
        case .string: type = .string
        case .image: type = .image
        case .dictionary: type = .dictionary
        case .sequence: type = .sequence
        default: type = .unknown(fieldNumber: nil)
        }
        return FeatureDescription(name: description.name, type: type, isOptional: description.isOptional)
    }

    /// MLMultiArrayDataType's raw values are the spec's ArrayDataType values.
    private static func arrayType(_ constraint: MLMultiArrayConstraint) -> MultiArrayType {
        var array = MultiArrayType(shape: constraint.shape.map(\.int64Value),
                                   dataType: ArrayDataType(rawValue: Int32(constraint.dataType.rawValue)))
        let flexibility = constraint.shapeConstraint
        switch flexibility.type {
        case .range:
            // Assumed: location = lower bound, length = upper - lower + 1.
            array.shapeRange = flexibility.sizeRangeForDimension.map { value in
                let range = value.rangeValue
                return SizeRange(lowerBound: UInt64(range.location),
                                 upperBound: range.length == NSNotFound ? -1 : Int64(range.location + range.length - 1))
            }
        case .enumerated:
            array.enumeratedShapes = flexibility.enumeratedShapes.map { $0.map(\.int64Value) }
        default:
            break
        }
        return array
    }
}
#endif
