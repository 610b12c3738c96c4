import ExportMetadata
import MLPackage

/// `target.norm_form`: the target's `main` and `prefill` (and each context bucket's, `main_64`)
/// write their RMSNorms in the form metadata.json's `fp16_range.norm` records (docs/fp16.md),
/// judged from the ML program itself, as //:verify judges it (python/museflash/checks/norm_form.py).
///
/// Every norm ends in `rsqrt(mean(y * y) + eps)` (the square a `mul` or a `pow`). In the
/// `max_abs` form `y` is `real_div(x, maximum(reduce_max(abs(x)), 1))`; in the `plain` form `y`
/// is the norm's input itself. A record that names the other form would have the bundle's
/// fp16 safety described wrongly to whoever reads it, so the mismatch fails by function name.
///
/// The same property holds each function to `fp16_range.folded_norms`: a norm the export's
/// audit folds multiplies its factor `rsqrt(...) / m` by its constant weight before the input,
/// `x * (f * w)` (python/museflash/checks/norm_form.py, `folded_norm_count`). The count of such
/// norms in `main` and `prefill` must be the number the record lists (none when it is absent).
extension LoadedBundle {
    func normFormProperties() -> [PropertyResult] {
        [targetNormForm()]
    }

    func targetNormForm() -> PropertyResult {
        evaluate("\(AssetRole.target).norm_form") {
            let package = try package(.target)
            guard case .object(let top) = metadataJSON, case .object(let range)? = top["fp16_range"] else {
                return "metadata.json records no fp16_range: no norm form to compare"
            }
            let known = ExportMetadata.NormForm.allCases.map(\.rawValue)
            guard case .string(let text)? = range["norm"], let recorded = ExportMetadata.NormForm(rawValue: text) else {
                throw Violation(detail: "metadata.json fp16_range.norm is \(range["norm"].map { "\($0)" } ?? "missing"), "
                                + "not one of \(known); use the metadata.json the export wrote")
            }
            guard let program = package.program else {
                return "not an ML program: no graph to judge"
            }
            let recordedFolds: Int
            switch range["folded_norms"] {
            case nil, .null?: recordedFolds = 0
            case .array(let folds)?: recordedFolds = folds.count
            case let other?:
                throw Violation(detail: "metadata.json fp16_range.folded_norms is \(other), not a list; use the "
                                + "metadata.json the export wrote")
            }
            var problems = Problems()
            var found: [String] = []
            for name in targetGraphFunctions {
                // A function the package lacks is package.functions' and function_map's to report.
                guard let function = program.functions.first(where: { $0.name == name }),
                      let block = function.block else { continue }
                let forms = Self.normForms(in: block)
                let form = Self.singleForm(forms)
                let folds = Self.foldedNormCount(in: block)
                found.append("\(name) \(forms.values.reduce(0, +)) norms \(form), \(folds) folded")
                problems.require(form == recorded.rawValue,
                                 "metadata.json says fp16_range.norm \(recorded.rawValue) but \(name)'s graph writes "
                                 + "its norms in the \(form) form (\(Self.tally(forms))); the record does not describe "
                                 + "this bundle: re-export it, or use the metadata.json the export wrote")
                problems.require(folds == recordedFolds,
                                 "metadata.json fp16_range.folded_norms lists \(recordedFolds) norms but \(name)'s graph "
                                 + "folds the weight into the factor in \(folds); the record does not describe this "
                                 + "bundle: re-export it, or use the metadata.json the export wrote")
            }
            return try problems.verdict("\(recorded.rawValue): " + found.joined(separator: ", "))
        }
    }

    /// How many of `block`'s norms are written in each form (NormForm raw values), and
    /// "unknown" for an `rsqrt` that matches neither pattern.
    static func normForms(in block: MILBlock) -> [String: Int] {
        let operations = block.allOperations
        var producer: [String: MILOperation] = [:]
        for operation in operations {
            for output in operation.outputs { producer[output.name] = operation }
        }
        func made(_ operation: MILOperation?, _ argument: String) -> MILOperation? {
            guard case .name(let name)? = operation?.input(named: argument)?.first else { return nil }
            return producer[name]
        }
        var forms: [String: Int] = [:]
        for rsqrt in operations where rsqrt.type == "rsqrt" {
            var mean = made(rsqrt, "x")
            if mean?.type == "add" {
                mean = [made(mean, "x"), made(mean, "y")].compactMap { $0 }.first { $0.type == "reduce_mean" }
            }
            guard let mean, mean.type == "reduce_mean",
                  let square = made(mean, "x"), square.type == "pow" || square.type == "mul",
                  let y = made(square, "x") else {
                forms["unknown", default: 0] += 1
                continue
            }
            let divisor = y.type == "real_div" ? made(y, "y") : nil
            let peak = divisor?.type == "maximum"
                && [made(divisor, "x"), made(divisor, "y")].contains { $0?.type == "reduce_max" }
            let form: ExportMetadata.NormForm = peak ? .maxAbs : .plain
            forms[form.rawValue, default: 0] += 1
        }
        return forms
    }

    /// How many of `block`'s norms multiply the row's factor (the `real_div` of their `rsqrt`)
    /// by a constant before the input: the fold, which only the max_abs form writes.
    static func foldedNormCount(in block: MILBlock) -> Int {
        let operations = block.allOperations
        var producer: [String: MILOperation] = [:]
        var consumers: [String: [MILOperation]] = [:]
        for operation in operations {
            for output in operation.outputs { producer[output.name] = operation }
            for input in operation.inputs {
                for case .name(let name) in input.arguments { consumers[name, default: []].append(operation) }
            }
        }
        func isConstant(_ binding: MILBinding?) -> Bool {
            switch binding {
            case .value?: return true
            case .name(let name)?: return producer[name]?.type == "const"
            default: return false
            }
        }
        func timesConstant(_ name: String) -> Bool {
            consumers[name, default: []].contains { mul in
                mul.type == "mul" && ["x", "y"].contains { argument in
                    let binding = mul.input(named: argument)?.first
                    return binding != .name(name) && isConstant(binding)
                }
            }
        }
        return operations.filter { rsqrt in
            rsqrt.type == "rsqrt" && rsqrt.outputs.contains { output in
                consumers[output.name, default: []].contains { factor in
                    factor.type == "real_div" && factor.outputs.contains { timesConstant($0.name) }
                }
            }
        }.count
    }

    /// The one form every norm is written in; "mixed" or "none" otherwise.
    static func singleForm(_ forms: [String: Int]) -> String {
        switch forms.count {
        case 0: return "none"
        case 1: return forms.keys.first!
        default: return "mixed"
        }
    }

    static func tally(_ forms: [String: Int]) -> String {
        forms.isEmpty ? "no rsqrt" : forms.sorted { $0.key < $1.key }.map { "\($0.value) \($0.key)" }.joined(separator: ", ")
    }
}
