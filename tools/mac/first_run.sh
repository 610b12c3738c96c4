#!/usr/bin/env bash
# The first run of museflash on a Mac, in one command (docs/mac.md): builds the package with
# SwiftPM, exports the demo (or takes an export), runs swift-generate --backend coreml on every
# compute unit against the interpreter's tokens, times draft lengths, and settles the two
# behaviours Apple does not document: one MLState serving two functions, and the memory of
# several functions of one package loaded side by side (coremltools#2351). It also runs each KV
# write strategy (docs/kv-write.md) on every compute unit: whether `slice` runs at all (a
# runtime-indexed slice_update crashes on Apple's 2026 betas), its tokens and its ms per main
# call against `blend`. Prints one Markdown report to paste into an issue.
#
#   tools/mac/first_run.sh [--export-dir DIR] [--slice-export-dir DIR] [--memory-export-dir DIR]
#       [--report FILE]
#
# --export-dir: an export to use (e.g. one made on Linux with ./bazelw run //:export -- ...);
#   default: export the demo pair with ./bazelw into a temporary folder.
# --slice-export-dir: the same pair exported with --kv-write slice, timed against --export-dir
#   (export both at a long --max-context-length, e.g. 4096, to see the write cost); default:
#   exported with the demo when the script exports it, else that table is skipped.
# --memory-export-dir: a larger export for the memory question (the demo's 5.8 MB of weights
#   is lost in the process's own memory); default: the same export.
set -euo pipefail

fail() { echo "first_run: error: $*" >&2; exit 1; }

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
export_dir="" slice_dir="" memory_dir="" report=""
while (($#)); do
  case "$1" in
    --export-dir) export_dir="${2:?}"; shift 2 ;;
    --slice-export-dir) slice_dir="${2:?}"; shift 2 ;;
    --memory-export-dir) memory_dir="${2:?}"; shift 2 ;;
    --report) report="${2:?}"; shift 2 ;;
    -h|--help) sed -n '2,21p' "${BASH_SOURCE[0]}"; exit 0 ;;
    *) fail "unknown argument $1; usage: tools/mac/first_run.sh [--export-dir DIR] [--slice-export-dir DIR] [--memory-export-dir DIR] [--report FILE]" ;;
  esac
done
[[ "$(uname -s)" == Darwin ]] || fail "this is the Mac's first run and needs macOS 15 with Core ML; this machine is $(uname -s)"
command -v swift >/dev/null || fail "no swift on PATH; install Xcode 16 or later (swift 6)"

work="$(mktemp -d)"
trap 'rm -rf "${work}"' EXIT
log() { echo "first_run: $*" >&2; }

log "building swift/ with SwiftPM (release)"
(cd "${repo}/swift" && swift build -c release --product swift-generate >&2) || fail "swift build failed; see above"
generate="${repo}/swift/.build/release/swift-generate"

if [[ -z "${export_dir}" ]]; then
  export_dir="${work}/exported"
  log "exporting the demo pair into ${export_dir}"
  # With context buckets of 64 and 128 slots: the prompt and its 64 new tokens cross both, so
  # functions of three buckets read what the others wrote into the one state (docs/buckets.md).
  "${repo}/bazelw" run //:export -- --fused-target --dflash-drafter --context-buckets 64,128 --output-dir "${export_dir}" >&2 \
    || fail "the demo export failed; export on Linux (./bazelw run //:export -- --fused-target --dflash-drafter) and pass --export-dir DIR"
  if [[ -z "${slice_dir}" ]]; then
    slice_dir="${work}/exported-slice"
    log "exporting the demo pair with --kv-write slice into ${slice_dir}"
    "${repo}/bazelw" run //:export -- --fused-target --dflash-drafter --kv-write slice --output-dir "${slice_dir}" >&2 \
      || fail "the demo's slice export failed; export it on Linux with --kv-write slice and pass --slice-export-dir DIR"
  fi
fi
[[ -f "${export_dir}/metadata.json" ]] || fail "${export_dir} has no metadata.json; pass the directory ./bazelw run //:export wrote"
[[ -z "${slice_dir}" || -f "${slice_dir}/metadata.json" ]] || fail "${slice_dir} has no metadata.json; pass the directory ./bazelw run //:export -- --kv-write slice wrote"
memory_dir="${memory_dir:-${export_dir}}"

prompt_ids="1,40,41,42,43,44,45,46,47,48,49,50,51,52,53,54,55,56,57,58,59,60,61,62,63,64,65,66,67,68,69,70,71,72,73,74,75,76,77,78"
cache="${work}/compiled-models"
run() {  # run NAME ARGS...: swift-generate's JSON report into ${work}/NAME.json
  local name="$1"; shift
  run_on "${export_dir}" "${name}" "$@"
}
run_on() {  # run_on DIR NAME ARGS...: as run, on the export in DIR
  local dir="$1" name="$2"; shift 2
  "${generate}" --export-dir "${dir}" --prompt-ids "${prompt_ids}" --max-new-tokens 64 \
    --format json --no-compare "$@" > "${work}/${name}.json" 2> "${work}/${name}.err" \
    || { local status=$?  # a crash (a signal) prints nothing: its status says what happened
         echo "{\"error\": $(python3 -c 'import json,sys; print(json.dumps(f"exit status {sys.argv[2]}: " + open(sys.argv[1]).read().strip()))' "${work}/${name}.err" "${status}")}" > "${work}/${name}.json"; }
}

# The chain (--no-tree) where the report's columns time main; the engine's own choice below.
log "interpreter reference"
run interpreter --backend interpreter --no-tree
for units in cpu gpu ane all; do
  log "Core ML, --compute-units ${units} (first launch compiles, second reuses the cache)"
  run "coreml-${units}-first" --backend coreml --compute-units "${units}" --model-cache "${cache}" --no-tree
  run "coreml-${units}" --backend coreml --compute-units "${units}" --model-cache "${cache}" --no-tree
done
for k in 1 3 5 7; do
  log "draft length ${k}"
  run "draft-${k}" --backend coreml --compute-units all --model-cache "${cache}" --num-draft-tokens "${k}"
  run "draft-${k}-interpreter" --backend interpreter --num-draft-tokens "${k}"
done
run target-alone --backend coreml --compute-units all --model-cache "${cache}" --no-draft
log "the step the engine chooses by measured cost (docs/trees.md)"
run chosen --backend coreml --compute-units all --model-cache "${cache}"
run chosen-interpreter --backend interpreter
for budget in 2 4 8; do
  log "tree budget ${budget} (docs/trees.md: rows moved through MLState.withMultiArray)"
  run "tree-${budget}" --backend coreml --compute-units all --model-cache "${cache}" --tree-budget "${budget}"
  run "tree-${budget}-interpreter" --backend interpreter --tree-budget "${budget}"
done
if [[ -n "${slice_dir}" ]]; then
  for strategy in blend slice; do
    dir="${export_dir}"; [[ "${strategy}" == slice ]] && dir="${slice_dir}"
    log "KV write ${strategy}: the target alone on every compute unit"
    run_on "${dir}" "kv-${strategy}-interpreter" --backend interpreter --no-draft
    for units in cpu gpu ane all; do
      run_on "${dir}" "kv-${strategy}-${units}" --backend coreml --compute-units "${units}" --model-cache "${cache}" --no-draft
    done
  done
fi
log "memory of the functions loaded side by side"
for backend in interpreter coreml; do
  "${generate}" --export-dir "${memory_dir}" --memory-probe --backend "${backend}" --compute-units all \
    --model-cache "${cache}" > "${work}/memory-${backend}.json" 2> "${work}/memory-${backend}.err" \
    || echo '{"error": "the memory probe failed"}' > "${work}/memory-${backend}.json"
done

python3 - "${work}" "$(sw_vers -productVersion 2>/dev/null || echo '?')" "$(uname -m)" "$(sysctl -n machdep.cpu.brand_string 2>/dev/null || echo '?')" "$(git -C "${repo}" rev-parse --short HEAD 2>/dev/null || echo '?')" > "${work}/report.md" <<'PY'
import json, sys
work, macos, arch, chip, commit = sys.argv[1:6]
def load(name):
    try:
        return json.load(open(f"{work}/{name}.json"))
    except (OSError, ValueError) as error:
        return {"error": str(error)}
ref = load("interpreter")
print(f"## museflash first run on a Mac\n\nmacOS {macos}, {arch}, {chip}, commit {commit}; demo export, "
      f"40-token prompt, 64 new tokens, greedy.\n")
print("| compute units | tokens equal the interpreter's | tokens/s | ms per main | ms per draft | open, first launch (s) | open, cached (s) | compiled model |")
print("| --- | --- | --- | --- | --- | --- | --- | --- |")
agree = {}
for units in ("cpu", "gpu", "ane", "all"):
    first, again = load(f"coreml-{units}-first"), load(f"coreml-{units}")
    if "error" in again or "error" in first:
        print(f"| {units} | error: {again.get('error') or first.get('error')} | | | | | | |")
        continue
    same = again["tokens"] == ref.get("tokens")
    prefix = next((i for i, (a, b) in enumerate(zip(again["tokens"], ref.get("tokens", []))) if a != b), len(again["tokens"]))
    agree[units] = same
    ms = lambda r, f: r["functions"].get(f, {}).get("ms_per_call", 0)
    print(f"| {units} | {'yes' if same else f'no, first difference at token {prefix}'} | {again['tokens_per_second']:.1f} | "
          f"{ms(again, 'main'):.2f} | {ms(again, 'draft'):.2f} | {first['open_seconds']:.3f} | {again['open_seconds']:.3f} | "
          f"{', '.join(first['compiled_models'].values())} then {', '.join(again['compiled_models'].values())} |")
print("\n| draft length | Core ML (all) tokens/s | tokens per target call | interpreter tokens/s | same tokens |")
print("| --- | --- | --- | --- | --- |")
for k in (1, 3, 5, 7):
    c, i = load(f"draft-{k}"), load(f"draft-{k}-interpreter")
    if "error" in c or "error" in i:
        print(f"| {k} | error: {c.get('error') or i.get('error')} | | | |")
        continue
    print(f"| {k} | {c['tokens_per_second']:.1f} | {c['tokens_per_target_call']:.2f} | {i['tokens_per_second']:.1f} | {'yes' if c['tokens'] == i['tokens'] else 'no'} |")
alone = load("target-alone")
if "error" not in alone:
    print(f"| target alone | {alone['tokens_per_second']:.1f} | 1.00 | | |")
print("\n**Tree verification** (docs/trees.md; greedy, so every row must give the interpreter's tokens: "
      "a difference means the rows moved through MLState.withMultiArray did not reach the next prediction):\n")
print("| tree budget | Core ML (all) tokens/s | tokens per target call | ms per tree | tokens equal the interpreter's | rows moved |")
print("| --- | --- | --- | --- | --- | --- |")
for budget in (2, 4, 8):
    c, i = load(f"tree-{budget}"), load(f"tree-{budget}-interpreter")
    if "error" in c or "error" in i:
        print(f"| {budget} | error: {c.get('error') or i.get('error')} | | | | |")
        continue
    print(f"| {budget} | {c['tokens_per_second']:.1f} | {c['tokens_per_target_call']:.2f} | "
          f"{c['functions'].get('tree', {}).get('ms_per_call', 0):.2f} | {'yes' if c['tokens'] == i['tokens'] else 'no'} | {c['moved_rows']} |")
chosen, chosen_ref = load("chosen"), load("chosen-interpreter")
if "error" in chosen or "error" in chosen_ref:
    print(f"\n**The step the engine chooses**: error: {chosen.get('error') or chosen_ref.get('error')}")
else:
    steps = lambda r: ", ".join(f"{kind} {count}" for kind, count in sorted(r["steps"].items()))
    print(f"\n**The step the engine chooses** (StepPlanner, docs/trees.md; no budget given): Core ML (all) "
          f"{chosen['tokens_per_second']:.1f} tokens/s, steps {steps(chosen)}, tokens equal the interpreter's: "
          f"{'yes' if chosen['tokens'] == chosen_ref['tokens'] else 'no'}; its figures: {chosen.get('plan')}. "
          f"The interpreter chose {steps(chosen_ref)}.")
print("\n**KV write strategies** (docs/kv-write.md; the target alone, so every call is `main`):\n")
blend_ref = load("kv-blend-interpreter")
if "error" in blend_ref and "No such file" in blend_ref["error"]:
    print("not timed: pass --slice-export-dir DIR (the same pair exported with --kv-write slice).")
else:
    print("| strategy | compute units | runs | tokens equal blend's on the interpreter | ms per main |")
    print("| --- | --- | --- | --- | --- |")
    for strategy in ("blend", "slice"):
        for units in ("interpreter", "cpu", "gpu", "ane", "all"):
            r = load(f"kv-{strategy}-{units}")
            if "error" in r:
                print(f"| {strategy} | {units} | no: {r['error'][:200]} | | |")
                continue
            same = "yes" if r["tokens"] == blend_ref.get("tokens") else "no"
            print(f"| {strategy} | {units} | yes | {same} | {r['functions'].get('main', {}).get('ms_per_call', 0):.2f} |")
state = agree.get("cpu")
print("\n**One state serving two functions** (the state `prefill`'s model makes, passed to `main`; "
      "`inject_kv`'s to `draft`): " + ("works: on cpuOnly the tokens equal the interpreter's, which they "
      "cannot if `main` did not read what `prefill` wrote." if state else
      "NOT settled as working: cpuOnly tokens differ from the interpreter's or Core ML refused; "
      "see the errors above (the fix: one package per state set, docs/swift-runtime.md)."))
for backend in ("interpreter", "coreml"):
    probe = load(f"memory-{backend}")
    if "error" in probe:
        print(f"\n**Memory, {backend}**: {probe['error']}")
        continue
    steps = probe["after_each_load"]
    base = probe["resident_bytes_before"]
    growth = ", ".join(f"{s['function']} +{(s['resident_bytes'] - (steps[i - 1]['resident_bytes'] if i else base)) / 1e6:.1f} MB"
                       for i, s in enumerate(steps))
    later = sum(s["resident_bytes"] - steps[i - 1]["resident_bytes"] for i, s in enumerate(steps) if i)
    copies = later / max(probe["weight_bytes"], 1)
    print(f"\n**Memory, {backend}** (weights {probe['weight_bytes'] / 1e6:.1f} MB): resident set grows by {growth} as "
          f"the functions load one after another; the {len(steps) - 1} after the first add {later / 1e6:.1f} MB, "
          f"{copies:.2f}x the weights ({len(steps) - 1}x would be a copy per function, coremltools#2351; "
          "near 0: shared, or loaded lazily at the first prediction).")
PY
cat "${work}/report.md"
if [[ -n "${report}" ]]; then cp "${work}/report.md" "${report}"; fi
