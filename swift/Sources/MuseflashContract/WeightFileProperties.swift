import Foundation
import ExportMetadata
import MLPackage

/// `<owner>.weight_file`: the weight files a package's ML program reads exist, and every blob any
/// function references (a `const` op's value, a constexpr op's inline inputs, in every block
/// specialization) has a valid header inside its file, of the tensor's dtype, and a payload of
/// exactly the tensor's bytes that lies inside the file. A weight.bin cut short, shortened or
/// overwritten with zeros fails it by name, whatever metadata.json declares about compression;
/// Core ML would refuse to load such a package, or read garbage.
///
/// Only the 64-byte header of each blob is read (`WeightFile.readHeaders`), never the data.
/// Runs once per distinct package, named by its owner's role.
extension LoadedBundle {
    func weightFile(_ role: AssetRole) -> PropertyResult {
        evaluate("\(role).weight_file") {
            let package = try package(role)
            guard let program = package.program else {
                return "not an ML program: no weight file to read"
            }
            // Blob -> the first use of each distinct tensor stored in it.
            var uses: [MILBlobReference: [(label: String, tensor: BlobTensor?)]] = [:]
            for function in program.functions {
                for specialization in function.blockSpecializations {
                    let label = function.blockSpecializations.count == 1 ? function.name
                        : "\(function.name)[\(specialization.opset)]"
                    for operation in specialization.block.allOperations {
                        let output = operation.outputs.first?.name ?? operation.type
                        let values = operation.attributes.sorted { $0.key < $1.key }.map { ($0.key, $0.value) }
                            + operation.inputs.flatMap { input in
                                input.arguments.compactMap { $0.value }.map { (input.name, $0) } }
                        for (name, value) in values {
                            guard let blob = value.blob else { continue }
                            let tensor = value.tensorType.flatMap { type in
                                type.shape.map { BlobTensor(dataType: type.dataType, shape: $0, blob: blob) } }
                            if uses[blob]?.contains(where: { $0.tensor == tensor }) ?? false { continue }
                            uses[blob, default: []].append(("\(label).\(output) \(name)", tensor))
                        }
                    }
                }
            }
            guard !uses.isEmpty else { return "the program references no blob" }
            guard let modelURL = package.modelURL else {
                throw Violation(detail: "not checked: the package's model spec file is not known, so its weight files are not either")
            }

            var problems = Problems()
            var summary: [String] = []
            let byFile = Dictionary(grouping: uses.keys, by: \.fileName)
            for (fileName, blobs) in byFile.sorted(by: { $0.key < $1.key }) {
                let headers: [UInt64: Result<BlobHeader, WeightFileError>]
                let url: URL
                do {
                    url = try WeightFile.url(forBlobFile: fileName, modelURL: modelURL, packageURL: package.url)
                    headers = try WeightFile.readHeaders(at: Set(blobs.map(\.offset)), of: url)
                } catch {
                    problems.add("\(blobs.count) blobs unreadable: \(error)")
                    continue
                }
                var bad: [String] = []
                for blob in blobs.sorted(by: { $0.offset < $1.offset }) {
                    let users = uses[blob] ?? []
                    switch headers[blob.offset] {
                    case .failure(let error)?:
                        bad.append("\(users.first?.label ?? "?"): \(error)")
                    case .success(let header)?:
                        for use in users {
                            if let tensor = use.tensor, let problem = tensor.misfit(header) {
                                bad.append("\(use.label) at offset \(blob.offset) of \(url.path): \(problem)")
                            }
                        }
                    case nil:
                        bad.append("\(users.first?.label ?? "?") at offset \(blob.offset) of \(url.path): header not read")
                    }
                }
                if bad.isEmpty {
                    summary.append("\(fileName): \(blobs.count) blobs, each header and payload inside the file")
                } else {
                    problems.add("\(fileName) (\(url.path)): \(bad.count) of the blobs the program references "
                                 + "are not in the file as the program says: \(capped(bad))")
                }
            }
            return try problems.verdict(summary.joined(separator: "; "))
        }
    }
}
