#!/usr/bin/env bash
# Prints the workspace's longest non-test functions, longest first, as clippy's `too_many_lines`
# counts them (lines of code: no blank or comment-only lines), and fails when one is over the
# limit (the habit: functions a reader can hold, about 80 lines, never over 100 unless a table).
#
#   scripts/longest-functions.sh [LIMIT] [TOP]
#       defaults: LIMIT 100, TOP 20; every function over LIMIT is printed, even past TOP
#
# A function that is a table (metric definitions, a dispatch `match`) may exceed the limit when
# it says so: `#[allow(clippy::too_many_lines, reason = "a table: …")]`. It is then neither
# ranked nor counted; the script lists those allows at the end, so none hides unseen. Library and
# binary targets only: tests, benches, examples and `#[cfg(test)]` code are not counted.
# Exit status: 0 when none is over LIMIT, 1 when one is, 2 on a usage error or when clippy
# could not lint the workspace (its errors are printed).
#
# Caching: clippy records CLIPPY_CONF_DIR and the clippy.toml it read in each crate's dep-info,
# so cargo re-lints when either changes and otherwise replays the diagnostics it stored (the
# counts stay right). The configuration lives at a fixed path in the target directory, written
# only when its text changes, so a second run on unchanged sources takes a second. The cost: a
# later plain `cargo clippy` lints the workspace's crates again (not their dependencies).
set -euo pipefail
cd "$(dirname "$0")/.."
limit=${1:-100}
top=${2:-20}
case "$limit$top" in
  *[!0-9]*|"") echo "usage: $0 [LIMIT] [TOP] (whole numbers)" >&2; exit 2 ;;
esac

target=$(cargo metadata -q --no-deps --format-version 1 \
  | python3 -c 'import json, sys; print(json.load(sys.stdin)["target_directory"])')
# clippy reads its threshold from clippy.toml in CLIPPY_CONF_DIR: 1 reports every function.
configuration="$target/longest-functions"
mkdir -p "$configuration"
wanted='too-many-lines-threshold = 1'
if [ "$(cat "$configuration/clippy.toml" 2>/dev/null)" != "$wanted" ]; then
  echo "$wanted" > "$configuration/clippy.toml"
fi
messages=$(mktemp)
trap 'rm -f "$messages"' EXIT
# `--cap-lints warn`: a lint the workspace denies (or RUSTFLAGS="-D warnings") must not stop the
# count; only a compile error does.
status=0
CLIPPY_CONF_DIR=$configuration cargo clippy -q --workspace --lib --bins --message-format=json \
  -- --cap-lints warn -W clippy::too_many_lines > "$messages" || status=$?

result=0
python3 - "$messages" "$limit" "$top" "$status" <<'PYTHON' || result=$?
import json, re, sys
path, limit, top, status = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
functions = {}
errors = []
for line in open(path):
    try:
        message = json.loads(line)
    except json.JSONDecodeError:
        continue
    diagnostic = message.get("message") or {}
    if diagnostic.get("level") == "error":
        errors.append(diagnostic.get("rendered") or diagnostic.get("message", ""))
    if (diagnostic.get("code") or {}).get("code") != "clippy::too_many_lines":
        continue
    count = re.search(r"\((\d+)/\d+\)", diagnostic["message"])
    span = next((span for span in diagnostic["spans"] if span["is_primary"]), None)
    if count and span:
        functions[(span["file_name"], span["line_start"])] = int(count.group(1))
if status != 0 or errors:
    sys.stderr.write("".join(errors))
    print(f"cargo clippy failed (exit status {status}): no count", file=sys.stderr)
    sys.exit(2)
if not functions:
    # With a threshold of 1 every function of two lines or more is reported: none means that
    # clippy did not read the configuration or did not lint.
    print("clippy reported no function: did it read CLIPPY_CONF_DIR?", file=sys.stderr)
    sys.exit(2)
ranked = sorted(functions.items(), key=lambda item: (-item[1], item[0]))
over = [item for item in ranked if item[1] > limit]
print(f"longest functions (lines of code; limit {limit}; tables that say so are left out):")
for (file, line), lines in ranked[:max(top, len(over))]:
    mark = "  OVER" if lines > limit else ""
    print(f"{lines:5}  {file}:{line}{mark}")
print(f"{len(over)} over {limit}, of {len(ranked)} functions")
sys.exit(1 if over else 0)
PYTHON
if [ "$result" -le 1 ]; then
  # The allows that leave a function out, so that a reviewer sees every one (tests' included).
  # The lint's name alone is matched: rustfmt splits a long attribute over several lines.
  allows=$(git grep -n --untracked 'clippy::too_many_lines' -- '*.rs' || true)
  echo "left out by #[allow(clippy::too_many_lines)]: $(printf '%s' "$allows" | grep -c . || true)"
  [ -z "$allows" ] || printf '%s\n' "$allows" | sed 's/^/  /'
fi
exit "$result"
