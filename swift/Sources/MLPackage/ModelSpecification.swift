/// The parts of a Core ML `Model` protobuf that describe its interface, and for an ML
/// program its operations (`MLProgram`: op types, value types and blob references, never
/// inline tensor contents). Weight files are not read here.
public struct ModelSpecification: Sendable, Equatable {
    public var specificationVersion: Int
    public var description: ModelDescription
    public var isUpdatable: Bool
    /// Field number of the member of `Model.Type` that was present (502 for an
    /// ML program), or nil if none was.
    public var modelTypeFieldNumber: Int?
    /// The ML program, when `Model.mlProgram` is the member present.
    public var program: MLProgram?

    public init(
        specificationVersion: Int = 0,
        description: ModelDescription = ModelDescription(),
        isUpdatable: Bool = false,
        modelTypeFieldNumber: Int? = nil,
        program: MLProgram? = nil
    ) {
        self.specificationVersion = specificationVersion
        self.description = description
        self.isUpdatable = isUpdatable
        self.modelTypeFieldNumber = modelTypeFieldNumber
        self.program = program
    }

    /// Name of the `Model.Type` oneof member, e.g. "mlProgram".
    public var modelTypeName: String? {
        modelTypeFieldNumber.flatMap { SpecFieldNumbers.modelTypeNames[$0] }
    }
}

public struct ModelDescription: Sendable, Equatable {
    public var inputs: [FeatureDescription]
    public var outputs: [FeatureDescription]
    public var states: [FeatureDescription]
    public var functions: [FunctionDescription]
    public var defaultFunctionName: String
    public var predictedFeatureName: String
    public var predictedProbabilitiesName: String
    public var metadata: Metadata

    public init(
        inputs: [FeatureDescription] = [],
        outputs: [FeatureDescription] = [],
        states: [FeatureDescription] = [],
        functions: [FunctionDescription] = [],
        defaultFunctionName: String = "",
        predictedFeatureName: String = "",
        predictedProbabilitiesName: String = "",
        metadata: Metadata = Metadata()
    ) {
        self.inputs = inputs
        self.outputs = outputs
        self.states = states
        self.functions = functions
        self.defaultFunctionName = defaultFunctionName
        self.predictedFeatureName = predictedFeatureName
        self.predictedProbabilitiesName = predictedProbabilitiesName
        self.metadata = metadata
    }

    public func function(named name: String) -> FunctionDescription? {
        functions.first { $0.name == name }
    }

    /// The function Core ML runs when none is named: the declared default of a
    /// multifunction model, or nil for a single-function model.
    public var defaultFunction: FunctionDescription? {
        defaultFunctionName.isEmpty ? nil : function(named: defaultFunctionName)
    }
}

public struct FunctionDescription: Sendable, Equatable {
    public var name: String
    public var inputs: [FeatureDescription]
    public var outputs: [FeatureDescription]
    public var states: [FeatureDescription]
    public var predictedFeatureName: String
    public var predictedProbabilitiesName: String

    public init(
        name: String = "",
        inputs: [FeatureDescription] = [],
        outputs: [FeatureDescription] = [],
        states: [FeatureDescription] = [],
        predictedFeatureName: String = "",
        predictedProbabilitiesName: String = ""
    ) {
        self.name = name
        self.inputs = inputs
        self.outputs = outputs
        self.states = states
        self.predictedFeatureName = predictedFeatureName
        self.predictedProbabilitiesName = predictedProbabilitiesName
    }
}

public struct FeatureDescription: Sendable, Equatable {
    public var name: String
    public var shortDescription: String
    public var type: FeatureType
    public var isOptional: Bool

    public init(name: String, type: FeatureType, shortDescription: String = "", isOptional: Bool = false) {
        self.name = name
        self.type = type
        self.shortDescription = shortDescription
        self.isOptional = isOptional
    }
}

public enum FeatureType: Sendable, Equatable {
    case int64
    case double
    case string
    case image
    case dictionary
    case sequence
    case multiArray(MultiArrayType)
    /// A Core ML state; its array type is nil only in a malformed spec.
    case state(MultiArrayType?)
    /// A `FeatureType.Type` member this reader does not know (its field
    /// number), or nil when no member was set at all.
    case unknown(fieldNumber: Int?)

    public var multiArray: MultiArrayType? {
        switch self {
        case .multiArray(let array): return array
        case .state(let array): return array
        default: return nil
        }
    }
}

public struct MultiArrayType: Sendable, Equatable {
    public var shape: [Int64]
    public var dataType: ArrayDataType
    /// Set when the array accepts any shape within per-dimension bounds.
    public var shapeRange: [SizeRange]?
    /// Set when the array accepts one of a fixed list of shapes.
    public var enumeratedShapes: [[Int64]]?

    public init(
        shape: [Int64] = [],
        dataType: ArrayDataType = .invalid,
        shapeRange: [SizeRange]? = nil,
        enumeratedShapes: [[Int64]]? = nil
    ) {
        self.shape = shape
        self.dataType = dataType
        self.shapeRange = shapeRange
        self.enumeratedShapes = enumeratedShapes
    }
}

public struct SizeRange: Sendable, Equatable {
    public var lowerBound: UInt64
    /// Core ML writes -1 for "no upper bound".
    public var upperBound: Int64

    public init(lowerBound: UInt64, upperBound: Int64) {
        self.lowerBound = lowerBound
        self.upperBound = upperBound
    }

    public var isUnbounded: Bool { upperBound < 0 }
}

/// `ArrayFeatureType.ArrayDataType`; the raw values encode the element kind
/// in the high half and the bit width in the low half.
public enum ArrayDataType: Sendable, Equatable, CustomStringConvertible {
    case invalid
    case float32
    case double
    case int32
    case int8
    case float16
    /// A value added to Core ML after this reader was written; proto3 enums are open.
    case unrecognized(Int32)

    public init(rawValue: Int32) {
        switch rawValue {
        case 0: self = .invalid          // ArrayDataType.INVALID_ARRAY_DATA_TYPE
        case 65568: self = .float32      // ArrayDataType.FLOAT32 = 0x10000 | 32
        case 65600: self = .double       // ArrayDataType.DOUBLE = 0x10000 | 64
        case 131104: self = .int32       // ArrayDataType.INT32 = 0x20000 | 32
        case 131080: self = .int8        // ArrayDataType.INT8 = 0x20000 | 8
        case 65552: self = .float16      // ArrayDataType.FLOAT16 = 0x10000 | 16
        default: self = .unrecognized(rawValue)
        }
    }

    public var rawValue: Int32 {
        switch self {
        case .invalid: return 0
        case .float32: return 65568
        case .double: return 65600
        case .int32: return 131104
        case .int8: return 131080
        case .float16: return 65552
        case .unrecognized(let value): return value
        }
    }

    /// The enum value's name as spelled in FeatureTypes.proto.
    public var description: String {
        switch self {
        case .invalid: return "INVALID_ARRAY_DATA_TYPE"
        case .float32: return "FLOAT32"
        case .double: return "DOUBLE"
        case .int32: return "INT32"
        case .int8: return "INT8"
        case .float16: return "FLOAT16"
        case .unrecognized(let value): return "UNRECOGNIZED(\(value))"
        }
    }
}

public struct Metadata: Sendable, Equatable {
    public var shortDescription: String
    public var versionString: String
    public var author: String
    public var license: String
    public var userDefined: [String: String]

    public init(
        shortDescription: String = "",
        versionString: String = "",
        author: String = "",
        license: String = "",
        userDefined: [String: String] = [:]
    ) {
        self.shortDescription = shortDescription
        self.versionString = versionString
        self.author = author
        self.license = license
        self.userDefined = userDefined
    }
}
