import ExportMetadata
import MLPackage

/// `target.kv_write`: the target's `main` and `prefill` (and each context bucket's, `main_64`)
/// write their global KV caches the way metadata.json's `kv_write` says (docs/kv-write.md),
/// judged from the ML program itself.
///
/// A position-indexed write is a `slice_update` whose `begin` is computed at run time (bound to
/// a value no `const` op produces) and whose `x` has a global cache's shape. `slice` writes each
/// global layer's keys and values that way, so each function has 2 per global layer; `blend`
/// writes with a one-hot blend and has none. Either mismatch fails by function name: a bundle
/// whose graph is not what its metadata says would be timed, or shipped, as the other strategy.
extension LoadedBundle {
    func kvWriteProperties() -> [PropertyResult] {
        [targetKVWrite()]
    }

    func targetKVWrite() -> PropertyResult {
        evaluate("\(AssetRole.target).kv_write") {
            let strategy = metadata.kvWriteStrategy
            let package = try package(.target)
            guard let program = package.program else {
                return "not an ML program: no graph to judge"
            }
            let globalShapes = Set((metadata.assets[.target]?.states ?? [])
                .filter { $0.kind == .globalKV }.map { $0.shape.map(UInt64.init) })
            let globalLayers = metadata.target.layerTypes.filter { $0 == .fullAttention }.count
            let expected = strategy == .slice ? 2 * globalLayers : 0
            var problems = Problems()
            var counts: [String] = []
            for name in targetGraphFunctions {
                // A function the package lacks is package.functions' and function_map's to report.
                guard let function = program.functions.first(where: { $0.name == name }),
                      let block = function.block else { continue }
                let found = Self.positionIndexedWrites(in: block, into: globalShapes)
                counts.append("\(name) \(found)")
                problems.require(found == expected,
                                 "metadata.json says kv_write \(strategy) but \(name) has \(found) position-indexed "
                                 + "slice_update of the global caches, not \(expected) (\(strategy == .slice ? "2 per global layer" : "the blend has none")); "
                                 + "re-export with --kv-write \(strategy), or use the metadata.json the export wrote")
            }
            return try problems.verdict("\(strategy): " + counts.joined(separator: ", ")
                                        + " position-indexed writes of the global caches")
        }
    }

    /// `slice_update`s in `block` whose `begin` is a run-time value and whose `x` has one of `shapes`.
    static func positionIndexedWrites(in block: MILBlock, into shapes: Set<[UInt64]>) -> Int {
        let operations = block.allOperations
        var constants = Set<String>()
        for operation in operations where operation.type == "const" {
            for output in operation.outputs { constants.insert(output.name) }
        }
        var types: [String: [UInt64]] = [:]
        for operation in operations {
            for output in operation.outputs { types[output.name] = output.tensorType?.shape }
        }
        for input in block.inputs { types[input.name] = input.tensorType?.shape }
        return operations.filter { operation in
            guard operation.type == "slice_update",
                  case .name(let begin)? = operation.input(named: "begin")?.first,
                  !constants.contains(begin),
                  case .name(let x)? = operation.input(named: "x")?.first,
                  let shape = types[x] ?? nil else { return false }
            return shapes.contains(shape)
        }.count
    }
}
