import ProtoWire

/// Why a serialized `Model` could not be read.
public enum SpecDecodingError: Error, Sendable, Equatable, CustomStringConvertible {
    case wire(ProtoWireError)
    /// A field every real Core ML spec carries was absent (named as Message.field).
    case missingField(String)
    /// Messages nested deeper than any real spec (at the nested message's absolute offset).
    case nestingTooDeep(offset: Int, reason: String)

    public var description: String {
        switch self {
        case .wire(let error): return "protobuf error: \(error)"
        case .missingField(let field): return "required field \(field) is missing"
        case .nestingTooDeep(let offset, let reason): return "at byte \(offset): \(reason)"
        }
    }
}

extension ModelSpecification {
    /// Decodes the interface of a serialized Core ML `Model`, and of an ML program its
    /// functions and operations (`MLProgram`). Unknown fields (including every other kind of
    /// network) are skipped, never fatal. Singular
    /// message fields that repeat are merged, as protobuf requires.
    public init(serializedBytes bytes: [UInt8]) throws {
        self.init()
        var sawDescription = false
        do {
            try ProtoBuffer(bytes).forEachField { field in
                typealias Number = SpecFieldNumbers.Model
                switch field.fieldNumber {
                case Number.specificationVersion:
                    specificationVersion = Int(try field.int32())
                case Number.description:
                    sawDescription = true
                    try description.merge(from: try field.message())
                case Number.isUpdatable:
                    isUpdatable = try field.bool()
                case Number.mlProgram:
                    // A oneof member: a repeat merges, another member replaces it.
                    modelTypeFieldNumber = Number.mlProgram
                    var merged = program ?? MLProgram()
                    try merged.merge(from: field.message())
                    program = merged
                case let number where SpecFieldNumbers.modelTypeNames[number] != nil:
                    modelTypeFieldNumber = number
                    program = nil
                default:
                    break
                }
            }
        } catch let error as ProtoWireError {
            throw SpecDecodingError.wire(error)
        }
        // An empty or cut-at-a-field-boundary file is still valid protobuf;
        // these checks catch it instead of yielding a silent empty model.
        guard specificationVersion > 0 else {
            throw SpecDecodingError.missingField("Model.specificationVersion")
        }
        guard sawDescription else {
            throw SpecDecodingError.missingField("Model.description")
        }
    }
}

extension ModelDescription {
    mutating func merge(from buffer: ProtoBuffer) throws {
        try buffer.forEachField { field in
            typealias Number = SpecFieldNumbers.ModelDescription
            switch field.fieldNumber {
            case Number.input: inputs.append(try FeatureDescription(decoding: field.message()))
            case Number.output: outputs.append(try FeatureDescription(decoding: field.message()))
            case Number.state: states.append(try FeatureDescription(decoding: field.message()))
            case Number.functions: functions.append(try FunctionDescription(decoding: field.message()))
            case Number.defaultFunctionName: defaultFunctionName = try field.string()
            case Number.predictedFeatureName: predictedFeatureName = try field.string()
            case Number.predictedProbabilitiesName: predictedProbabilitiesName = try field.string()
            case Number.metadata: try metadata.merge(from: field.message())
            default: break
            }
        }
    }
}

extension FunctionDescription {
    init(decoding buffer: ProtoBuffer) throws {
        self.init()
        try buffer.forEachField { field in
            typealias Number = SpecFieldNumbers.FunctionDescription
            switch field.fieldNumber {
            case Number.name: name = try field.string()
            case Number.input: inputs.append(try FeatureDescription(decoding: field.message()))
            case Number.output: outputs.append(try FeatureDescription(decoding: field.message()))
            case Number.state: states.append(try FeatureDescription(decoding: field.message()))
            case Number.predictedFeatureName: predictedFeatureName = try field.string()
            case Number.predictedProbabilitiesName: predictedProbabilitiesName = try field.string()
            default: break
            }
        }
    }
}

extension Metadata {
    mutating func merge(from buffer: ProtoBuffer) throws {
        try buffer.forEachField { field in
            typealias Number = SpecFieldNumbers.Metadata
            switch field.fieldNumber {
            case Number.shortDescription: shortDescription = try field.string()
            case Number.versionString: versionString = try field.string()
            case Number.author: author = try field.string()
            case Number.license: license = try field.string()
            case Number.userDefined:
                let (key, value) = try Self.decodeMapEntry(field.message())
                userDefined[key] = value
            default: break
            }
        }
    }

    /// A missing key or value means the empty string, and a later entry for
    /// the same key wins, matching protobuf map semantics.
    private static func decodeMapEntry(_ buffer: ProtoBuffer) throws -> (String, String) {
        var key = ""
        var value = ""
        try buffer.forEachField { field in
            switch field.fieldNumber {
            case SpecFieldNumbers.MapEntry.key: key = try field.string()
            case SpecFieldNumbers.MapEntry.value: value = try field.string()
            default: break
            }
        }
        return (key, value)
    }
}

extension FeatureDescription {
    init(decoding buffer: ProtoBuffer) throws {
        self.init(name: "", type: .unknown(fieldNumber: nil))
        try buffer.forEachField { field in
            typealias Number = SpecFieldNumbers.FeatureDescription
            switch field.fieldNumber {
            case Number.name: name = try field.string()
            case Number.shortDescription: shortDescription = try field.string()
            case Number.type: try mergeType(from: field.message())
            default: break
            }
        }
    }

    /// `FeatureType.Type` is a oneof: a later member replaces an earlier one,
    /// while a repeat of the same member merges into it.
    private mutating func mergeType(from buffer: ProtoBuffer) throws {
        try buffer.forEachField { field in
            typealias Number = SpecFieldNumbers.FeatureType
            switch field.fieldNumber {
            case Number.int64Type: _ = try field.message(); type = .int64
            case Number.doubleType: _ = try field.message(); type = .double
            case Number.stringType: _ = try field.message(); type = .string
            case Number.imageType: _ = try field.message(); type = .image
            case Number.dictionaryType: _ = try field.message(); type = .dictionary
            case Number.sequenceType: _ = try field.message(); type = .sequence
            case Number.multiArrayType:
                var array: MultiArrayType
                if case .multiArray(let existing) = type { array = existing } else { array = MultiArrayType() }
                try array.merge(from: field.message())
                type = .multiArray(array)
            case Number.stateType:
                var arrayType: MultiArrayType?
                if case .state(let existing) = type { arrayType = existing }
                try field.message().forEachField { stateField in
                    guard stateField.fieldNumber == SpecFieldNumbers.StateFeatureType.arrayType else { return }
                    var array = arrayType ?? MultiArrayType()
                    try array.merge(from: stateField.message())
                    arrayType = array
                }
                type = .state(arrayType)
            case Number.isOptional:
                isOptional = try field.bool()
            default:
                // A oneof member from a newer spec: remember which, skip its body.
                if field.wireType == .lengthDelimited {
                    type = .unknown(fieldNumber: field.fieldNumber)
                }
            }
        }
    }
}

extension MultiArrayType {
    mutating func merge(from buffer: ProtoBuffer) throws {
        try buffer.forEachField { field in
            typealias Number = SpecFieldNumbers.ArrayFeatureType
            switch field.fieldNumber {
            case Number.shape:
                shape.append(contentsOf: try field.packedVarints().map { Int64(bitPattern: $0) })
            case Number.dataType:
                dataType = ArrayDataType(rawValue: try field.enumRawValue())
            case Number.enumeratedShapes:
                // ShapeFlexibility is a oneof, so choosing one form clears the other.
                var shapes = enumeratedShapes ?? []
                try field.message().forEachField { shapesField in
                    guard shapesField.fieldNumber == SpecFieldNumbers.EnumeratedShapes.shapes else { return }
                    shapes.append(try Self.decodeShape(shapesField.message()))
                }
                enumeratedShapes = shapes
                shapeRange = nil
            case Number.shapeRange:
                var ranges = shapeRange ?? []
                try field.message().forEachField { rangeField in
                    guard rangeField.fieldNumber == SpecFieldNumbers.ShapeRange.sizeRanges else { return }
                    ranges.append(try Self.decodeSizeRange(rangeField.message()))
                }
                shapeRange = ranges
                enumeratedShapes = nil
            default:
                break
            }
        }
    }

    private static func decodeShape(_ buffer: ProtoBuffer) throws -> [Int64] {
        var dimensions: [Int64] = []
        try buffer.forEachField { field in
            guard field.fieldNumber == SpecFieldNumbers.Shape.shape else { return }
            dimensions.append(contentsOf: try field.packedVarints().map { Int64(bitPattern: $0) })
        }
        return dimensions
    }

    private static func decodeSizeRange(_ buffer: ProtoBuffer) throws -> SizeRange {
        var range = SizeRange(lowerBound: 0, upperBound: 0)
        try buffer.forEachField { field in
            switch field.fieldNumber {
            case SpecFieldNumbers.SizeRange.lowerBound: range.lowerBound = try field.uint64()
            case SpecFieldNumbers.SizeRange.upperBound: range.upperBound = try field.int64()
            default: break
            }
        }
        return range
    }
}
