import ProtoWire

// Decoding of `Model.mlProgram` (MIL.proto). As for the interface, unknown fields are skipped,
// a repeated singular message merges into the earlier one, a oneof member replaces the other
// members, and a map key given twice keeps its last value.

extension MLProgram {
    /// Control flow nests blocks inside operations; deeper nesting than this is not a real
    /// program but input built to exhaust the stack.
    public static let maximumBlockDepth = 32

    mutating func merge(from buffer: ProtoBuffer) throws {
        try buffer.forEachField { field in
            typealias Number = SpecFieldNumbers.Program
            switch field.fieldNumber {
            case Number.version:
                version = try field.int64()
            case Number.functions:
                var name = ""
                var body: [ProtoBuffer] = []
                try field.message().forEachField { entry in
                    switch entry.fieldNumber {
                    case SpecFieldNumbers.MapEntry.key: name = try entry.string()
                    case SpecFieldNumbers.MapEntry.value: body.append(try entry.message())
                    default: break
                    }
                }
                var function = MILFunction(name: name)
                for part in body { try function.merge(from: part) }
                if let index = functions.firstIndex(where: { $0.name == name }) {
                    functions[index] = function
                } else {
                    functions.append(function)
                }
            default:
                break
            }
        }
    }
}

extension MILFunction {
    mutating func merge(from buffer: ProtoBuffer) throws {
        try buffer.forEachField { field in
            typealias Number = SpecFieldNumbers.Function
            switch field.fieldNumber {
            case Number.inputs:
                inputs.append(try MILNamedValueType(decoding: field.message()))
            case Number.opset:
                opset = try field.string()
            case Number.blockSpecializations:
                var key = ""
                var block = MILBlock()
                try field.message().forEachField { entry in
                    switch entry.fieldNumber {
                    case SpecFieldNumbers.MapEntry.key: key = try entry.string()
                    case SpecFieldNumbers.MapEntry.value: try block.merge(from: entry.message(), depth: 0)
                    default: break
                    }
                }
                let specialization = MILBlockSpecialization(opset: key, block: block)
                if let index = blockSpecializations.firstIndex(where: { $0.opset == key }) {
                    blockSpecializations[index] = specialization
                } else {
                    blockSpecializations.append(specialization)
                }
            default:
                break
            }
        }
    }
}

extension MILBlock {
    mutating func merge(from buffer: ProtoBuffer, depth: Int) throws {
        guard depth <= MLProgram.maximumBlockDepth else {
            throw SpecDecodingError.nestingTooDeep(
                offset: buffer.range.lowerBound,
                reason: "blocks nested in operations more than \(MLProgram.maximumBlockDepth) deep")
        }
        try buffer.forEachField { field in
            typealias Number = SpecFieldNumbers.Block
            switch field.fieldNumber {
            case Number.inputs: inputs.append(try MILNamedValueType(decoding: field.message()))
            case Number.outputs: outputs.append(try field.string())
            case Number.operations:
                var operation = MILOperation()
                try operation.merge(from: field.message(), depth: depth)
                operations.append(operation)
            default: break
            }
        }
    }
}

extension MILOperation {
    mutating func merge(from buffer: ProtoBuffer, depth: Int) throws {
        try buffer.forEachField { field in
            typealias Number = SpecFieldNumbers.Operation
            switch field.fieldNumber {
            case Number.type:
                type = try field.string()
            case Number.inputs:
                var name = ""
                var arguments: [MILBinding] = []
                try field.message().forEachField { entry in
                    switch entry.fieldNumber {
                    case SpecFieldNumbers.MapEntry.key:
                        name = try entry.string()
                    case SpecFieldNumbers.MapEntry.value:
                        // Argument has one repeated field, so a repeated value appends.
                        try entry.message().forEachField { argument in
                            guard argument.fieldNumber == SpecFieldNumbers.Argument.arguments else { return }
                            arguments.append(try MILBinding(decoding: argument.message()))
                        }
                    default:
                        break
                    }
                }
                let input = MILInput(name: name, arguments: arguments)
                if let index = inputs.firstIndex(where: { $0.name == name }) {
                    inputs[index] = input
                } else {
                    inputs.append(input)
                }
            case Number.outputs:
                outputs.append(try MILNamedValueType(decoding: field.message()))
            case Number.blocks:
                var block = MILBlock()
                try block.merge(from: field.message(), depth: depth + 1)
                blocks.append(block)
            case Number.attributes:
                var name = ""
                var value = MILValue()
                try field.message().forEachField { entry in
                    switch entry.fieldNumber {
                    case SpecFieldNumbers.MapEntry.key: name = try entry.string()
                    case SpecFieldNumbers.MapEntry.value: try value.merge(from: entry.message())
                    default: break
                    }
                }
                attributes[name] = value
            default:
                break
            }
        }
    }
}

extension MILBinding {
    init(decoding buffer: ProtoBuffer) throws {
        self = .unset
        try buffer.forEachField { field in
            typealias Number = SpecFieldNumbers.Binding
            switch field.fieldNumber {
            case Number.name:
                self = .name(try field.string())
            case Number.value:
                var value = self.value ?? MILValue()
                try value.merge(from: field.message())
                self = .value(value)
            default:
                break
            }
        }
    }
}

extension MILNamedValueType {
    init(decoding buffer: ProtoBuffer) throws {
        self.init(name: "")
        try buffer.forEachField { field in
            switch field.fieldNumber {
            case SpecFieldNumbers.NamedValueType.name: name = try field.string()
            case SpecFieldNumbers.NamedValueType.type: try MILValueType.merge(&type, from: field.message())
            default: break
            }
        }
    }
}

extension MILValueType {
    static func merge(_ type: inout MILValueType?, from buffer: ProtoBuffer) throws {
        try buffer.forEachField { field in
            switch field.fieldNumber {
            case SpecFieldNumbers.ValueType.tensorType:
                var tensor = type?.tensorType ?? MILTensorType()
                try tensor.merge(from: field.message())
                type = .tensor(tensor)
            case SpecFieldNumbers.ValueType.stateType:
                var wrapped: MILValueType? = type?.stateTensorType.map { .tensor($0) }
                try field.message().forEachField { member in
                    if member.fieldNumber == SpecFieldNumbers.StateType.wrappedType {
                        try MILValueType.merge(&wrapped, from: member.message())
                    }
                }
                if let tensor = wrapped?.tensorType {
                    type = .state(tensor)
                } else {
                    type = .other(fieldNumber: field.fieldNumber)
                }
            default:
                // Another member of the oneof (list, tuple, dictionary, state) or a newer one.
                if field.wireType == .lengthDelimited {
                    type = .other(fieldNumber: field.fieldNumber)
                }
            }
        }
    }
}

extension MILTensorType {
    mutating func merge(from buffer: ProtoBuffer) throws {
        try buffer.forEachField { field in
            typealias Number = SpecFieldNumbers.TensorType
            switch field.fieldNumber {
            case Number.dataType: dataType = MILDataType(rawValue: try field.enumRawValue())
            case Number.rank: rank = try field.int64()
            case Number.dimensions: dimensions.append(try MILDimension(decoding: field.message()))
            default: break
            }
        }
    }
}

extension MILDimension {
    init(decoding buffer: ProtoBuffer) throws {
        // Neither member set: a dimension nothing is known about.
        self = .unknown(variadic: false)
        try buffer.forEachField { field in
            typealias Number = SpecFieldNumbers.Dimension
            switch field.fieldNumber {
            case Number.constant:
                var size: UInt64 = 0
                if case .constant(let earlier) = self { size = earlier }
                try field.message().forEachField { member in
                    if member.fieldNumber == Number.constantSize { size = try member.uint64() }
                }
                self = .constant(size)
            case Number.unknown:
                var variadic = false
                if case .unknown(let earlier) = self { variadic = earlier }
                try field.message().forEachField { member in
                    if member.fieldNumber == Number.unknownVariadic { variadic = try member.bool() }
                }
                self = .unknown(variadic: variadic)
            default:
                break
            }
        }
    }
}

extension MILValue {
    mutating func merge(from buffer: ProtoBuffer) throws {
        try buffer.forEachField { field in
            typealias Number = SpecFieldNumbers.Value
            switch field.fieldNumber {
            case Number.type:
                try MILValueType.merge(&type, from: field.message())
            case Number.immediateValue:
                var tensor: MILTensorValue?
                try field.message().forEachField { member in
                    if member.fieldNumber == SpecFieldNumbers.ImmediateValue.tensor {
                        tensor = try MILTensorValue(decoding: member.message(), earlier: tensor)
                    } else if member.wireType == .lengthDelimited {
                        tensor = nil  // a tuple, list or dictionary replaces the oneof
                    }
                }
                storage = .immediate
                immediateTensor = tensor
            case Number.blobFileValue:
                var reference = blob ?? MILBlobReference(fileName: "", offset: 0)
                try field.message().forEachField { member in
                    switch member.fieldNumber {
                    case SpecFieldNumbers.BlobFileValue.fileName: reference.fileName = try member.string()
                    case SpecFieldNumbers.BlobFileValue.offset: reference.offset = try member.uint64()
                    default: break
                    }
                }
                storage = .blobFile(reference)
                immediateTensor = nil
            default:
                break
            }
        }
    }
}

extension MILTensorValue {
    /// Decodes a `TensorValue`; a repeated member of the same kind appends (the repeated field
    /// inside it is repeated), another member replaces it (oneof).
    init?(decoding buffer: ProtoBuffer, earlier: MILTensorValue?) throws {
        var value = earlier
        try buffer.forEachField { field in
            typealias Number = SpecFieldNumbers.TensorValue
            guard field.wireType == .lengthDelimited else { return }
            let body = try field.message()
            switch field.fieldNumber {
            case Number.floats:
                var values: [Float] = []
                if case .floats(let old)? = value { values = old }
                try body.forEachField { member in
                    guard member.fieldNumber == Number.values else { return }
                    values += try member.packedFixed32().map { Float(bitPattern: $0) }
                }
                value = .floats(values)
            case Number.doubles:
                var values: [Double] = []
                if case .doubles(let old)? = value { values = old }
                try body.forEachField { member in
                    guard member.fieldNumber == Number.values else { return }
                    values += try member.packedFixed64().map { Double(bitPattern: $0) }
                }
                value = .doubles(values)
            case Number.ints:
                var values: [Int32] = []
                if case .ints(let old)? = value { values = old }
                try body.forEachField { member in
                    guard member.fieldNumber == Number.values else { return }
                    values += try member.packedVarints().map { Int32(truncatingIfNeeded: $0) }
                }
                value = .ints(values)
            case Number.longInts:
                var values: [Int64] = []
                if case .longInts(let old)? = value { values = old }
                try body.forEachField { member in
                    guard member.fieldNumber == Number.values else { return }
                    values += try member.packedVarints().map { Int64(bitPattern: $0) }
                }
                value = .longInts(values)
            case Number.bools:
                var values: [Bool] = []
                if case .bools(let old)? = value { values = old }
                try body.forEachField { member in
                    guard member.fieldNumber == Number.values else { return }
                    values += try member.packedVarints().map { $0 != 0 }
                }
                value = .bools(values)
            case Number.strings:
                var values: [String] = []
                if case .strings(let old)? = value { values = old }
                try body.forEachField { member in
                    guard member.fieldNumber == Number.values else { return }
                    values.append(try member.string())
                }
                value = .strings(values)
            case Number.bytes:
                var bytes: [UInt8] = []
                try body.forEachField { member in
                    if member.fieldNumber == Number.values { bytes = try member.bytes() }
                }
                value = .bytes(bytes)
            default:
                break
            }
        }
        guard let value = value else { return nil }
        self = value
    }
}
