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
                _ = try field.message()
                storage = .immediate
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
            default:
                break
            }
        }
    }
}
