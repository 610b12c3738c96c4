#!/usr/bin/env bash
# Runs the discovery fixture and checks that exactly the tests in expected_tests.txt ran, then
# checks that discovery refuses a module with a test it cannot run instead of skipping it.
set -euo pipefail
fixture="$1" expected="$2" discovery="$3" rejected_graph="$4"
fail() { echo "FAIL: $*" >&2; exit 1; }

log="${TEST_TMPDIR:-/tmp}/fixture.log"
"$fixture" >"$log" 2>&1 || { cat "$log"; fail "the discovery fixture failed"; }
ran="$(sed -n "s/^Test Case '\([^']*\)' passed.*/\1/p" "$log" | sort)"
if ! diff <(sort "$expected") <(echo "$ran"); then
  cat "$log"
  fail "the tests that ran (>) differ from expected_tests.txt (<)"
fi
count="$(grep -c . "$expected")"
grep -q "Executed $count tests, with 0 failures" "$log" || { cat "$log"; fail "expected $count tests to run"; }
echo "discovery fixture: the $count expected tests ran"

errors="${TEST_TMPDIR:-/tmp}/rejected.err"
if "$discovery" rejected_fixture "$rejected_graph" "${TEST_TMPDIR:-/tmp}/rejected_main.swift" 2>"$errors"; then
  fail "discovery accepted a private test method and a test class it cannot identify"
fi
for fragment in "RejectedTests.testPrivate" "is private" "class ForeignSubclass" "inherits from Foundation.NSObject"; do
  grep -qF "$fragment" "$errors" || { cat "$errors"; fail "the discovery error does not mention: $fragment"; }
done
echo "rejected fixture: refused with"
cat "$errors"
