#!/usr/bin/env bash
# Two or more builds of swift-generate on one export, timed side by side in one run: each build
# decodes the same prompt greedily, with the drafter and alone, in alternating runs; prints the
# median tokens/s and ms per main/draft call of each, and refuses when their tokens differ.
#
#   tools/benchmarks/compare_swift_builds.sh --export-dir DIR [--repeats 5] [--max-new-tokens 48] \
#       NAME=PATH/TO/swift-generate NAME=PATH/TO/swift-generate ...
#
# Used for the -Ounchecked figure of docs/swift-runtime.md. Figures drift on a shared machine:
# compare within one run only.
set -euo pipefail

export_dir="" repeats=5 new_tokens=48 builds=()
prompt='def read_lines(path):
    """Return the stripped lines of a text file."""
    with open(path) as handle:
        return [line.strip() for line in'
while (($#)); do
  case "$1" in
    --export-dir) export_dir="$2"; shift 2 ;;
    --repeats) repeats="$2"; shift 2 ;;
    --max-new-tokens) new_tokens="$2"; shift 2 ;;
    *=*) builds+=("$1"); shift ;;
    *) echo "compare_swift_builds: error: unknown argument $1; give --export-dir DIR and NAME=BINARY pairs" >&2; exit 1 ;;
  esac
done
if [[ -z "${export_dir}" || ${#builds[@]} -lt 2 ]]; then
  echo "compare_swift_builds: error: give --export-dir DIR and at least two NAME=BINARY pairs" >&2
  exit 1
fi
out="$(mktemp -d)"
trap 'rm -rf "${out}"' EXIT
for ((run = 0; run < repeats; run++)); do
  for mode in draft alone; do
    extra=()
    [[ "${mode}" == alone ]] && extra=(--no-draft)
    for build in "${builds[@]}"; do
      name="${build%%=*}" binary="${build#*=}"
      "${binary}" --export-dir "${export_dir}" --prompt "${prompt}" --max-new-tokens "${new_tokens}" \
        --format json --no-compare "${extra[@]}" > "${out}/${name}.${mode}.${run}.json"
    done
  done
done
python3 - "${out}" "${repeats}" "${builds[@]}" <<'PY'
import json, statistics, sys
out, repeats, builds = sys.argv[1], int(sys.argv[2]), [b.split("=", 1)[0] for b in sys.argv[3:]]
rows, tokens = {}, {}
for name in builds:
    for mode in ("draft", "alone"):
        reports = [json.load(open(f"{out}/{name}.{mode}.{r}.json")) for r in range(repeats)]
        tokens.setdefault(mode, set()).add(tuple(reports[0]["tokens"]))
        rows.setdefault(f"tokens/s, {'with the drafter' if mode == 'draft' else 'target alone'}", {})[name] = \
            statistics.median(r["tokens_per_second"] for r in reports)
        for function in ("main", "draft"):
            times = [r["functions"][function]["ms_per_call"] for r in reports if function in r["functions"]]
            if times:
                rows.setdefault(f"ms per {function} call, {mode}", {})[name] = statistics.median(times)
if any(len(t) != 1 for t in tokens.values()):
    sys.exit("compare_swift_builds: the builds decode different tokens; fix that before timing them")
base = builds[0]
print(f"median of {repeats} alternating runs; last column: each build against {base}")
print("| figure | " + " | ".join(builds) + " | change |")
print("| --- |" + " --- |" * (len(builds) + 1))
for figure, values in rows.items():
    change = ", ".join(f"{(values[b] / values[base] - 1) * 100:+.1f}%" for b in builds[1:])
    print(f"| {figure} | " + " | ".join(f"{values[b]:.2f}" for b in builds) + f" | {change} |")
PY
