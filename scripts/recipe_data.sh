#!/usr/bin/env bash
# Target-written conversations kept in the repository's history, outside the working tree.
#
# Generating conversations takes GPU time, and a GPU machine may not outlive the run (a lent
# machine, a preemptible node). Each generation run's new rows are kept as one "data commit":
# a commit of its own (no parent) holding recipe-data/<NAME>/conversations.jsonl.xz and
# manifest.json, joined to the current branch by a merge that keeps the branch's files (`git merge
# -s ours`). The working tree stays small, a clone carries every export, and the exports of many
# runs concatenate into one training set (docs/recipe-smollm2.md, "Data that outlives a machine").
#
#   bash scripts/recipe_data.sh store NAME FILE.jsonl [NOTE]   keep FILE's rows (a run's new rows)
#   bash scripts/recipe_data.sh list                          the kept exports, oldest first
#   bash scripts/recipe_data.sh restore DIR                   every export's .jsonl.xz into DIR,
#                                                             checked against its manifest
#   bash scripts/recipe_data.sh rows FILE.jsonl               rows of FILE no export holds yet (by id)
#
# Restore writes DIR/<k>-<NAME>.jsonl.xz (k = 001, 002, ... in the order kept), so
# `xz -dc DIR/*.jsonl.xz > gen-0.jsonl` rebuilds the whole set in order; `generate` then resumes
# that file and skips every row it already holds.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
MARK="recipe data:"
die() { echo "recipe_data: $*" >&2; exit 2; }

data_commits() {  # the data commits reachable from HEAD, oldest first
  git log HEAD --reverse --format=%H --grep="^$MARK " 2>/dev/null || true
}

name_of() { git ls-tree --name-only "$1" recipe-data/ | head -n 1 | sed 's|^recipe-data/||'; }

known_ids() {  # every row id of every export, one per line
  local c
  for c in $(data_commits); do
    git show "$c:recipe-data/$(name_of "$c")/conversations.jsonl.xz" | xz -dc |
      python3 -c 'import json, sys; [print(json.loads(line)["id"]) for line in sys.stdin if line.strip()]'
  done
}

cmd_rows() {  # FILE: its rows whose id no export holds, in file order
  local file=$1
  [ -f "$file" ] || die "$file: no such file"
  known_ids | python3 -c '
import json, sys
known = set(line.rstrip("\n") for line in sys.stdin)
with open(sys.argv[1], encoding="utf-8") as f:
    for n, line in enumerate(f, 1):
        if not line.strip():
            continue
        try:
            row_id = json.loads(line)["id"]
        except (json.JSONDecodeError, KeyError, TypeError):
            print(f"recipe_data: {sys.argv[1]}:{n}: not a generated row (no id)", file=sys.stderr)
            sys.exit(2)
        if row_id not in known:
            sys.stdout.write(line if line.endswith("\n") else line + "\n")
' "$file"
}

cmd_store() {  # NAME FILE [NOTE]
  local name=$1 file=$2 note=${3:-}
  [[ $name =~ ^[A-Za-z0-9][A-Za-z0-9._-]*$ ]] || die "NAME '$name': letters, digits, '.', '_' and '-' only"
  [ -f "$file" ] || die "$file: no such file"
  for c in $(data_commits); do [ "$(name_of "$c")" != "$name" ] || die "an export named $name is kept already"; done
  [ -z "$(git status --porcelain --untracked-files=no)" ] || die "commit or stash your changes first"
  local tmp; tmp=$(mktemp -d); trap 'rm -rf "$tmp"' RETURN
  cmd_rows "$file" > "$tmp/rows.jsonl"
  local rows; rows=$(grep -c . "$tmp/rows.jsonl" || true)
  [ "$rows" -gt 0 ] || die "$file: every row is kept already"
  xz -9 -T0 -c "$tmp/rows.jsonl" > "$tmp/conversations.jsonl.xz"
  python3 - "$tmp" "$name" "$rows" "$note" <<'PY'
import datetime, hashlib, json, sys
tmp, name, rows, note = sys.argv[1:]
data = open(f"{tmp}/conversations.jsonl.xz", "rb").read()
manifest = {"name": name, "date": datetime.date.today().isoformat(), "rows": int(rows),
            "sha256_xz": hashlib.sha256(data).hexdigest(), "note": note}
open(f"{tmp}/manifest.json", "w").write(json.dumps(manifest, indent=2) + "\n")
PY
  local index="$tmp/index" tree commit
  export GIT_INDEX_FILE=$index
  git read-tree --empty
  for f in conversations.jsonl.xz manifest.json; do
    git update-index --add --cacheinfo "100644,$(git hash-object -w "$tmp/$f"),recipe-data/$name/$f"
  done
  tree=$(git write-tree); unset GIT_INDEX_FILE
  commit=$(git commit-tree "$tree" -m "$MARK $name ($rows conversations)${note:+: $note}")
  git merge -q -s ours --allow-unrelated-histories --no-edit \
    -m "keep the $name conversations in history (scripts/recipe_data.sh restore)" "$commit"
  echo "kept $rows conversations as $name ($(du -h "$tmp/conversations.jsonl.xz" | cut -f1) xz) in $commit"
}

cmd_list() {
  local c
  for c in $(data_commits); do git show "$c:recipe-data/$(name_of "$c")/manifest.json" | tr -d '\n'; echo; done |
    python3 -c "$(cat <<'PY'
import json, sys
manifests = [json.loads(line) for line in sys.stdin if line.strip()]
for k, m in enumerate(manifests, 1):
    print(f"{k:>3}  {m['date']}  {m['name']:<32} {m['rows']:>8,} rows  {m.get('note', '')}")
print(f"{sum(m['rows'] for m in manifests):,} rows in {len(manifests)} export(s)")
PY
)"
}

cmd_restore() {  # DIR
  local dir=$1 c k=0 name want got
  mkdir -p "$dir"
  for c in $(data_commits); do
    k=$((k + 1)); name=$(name_of "$c")
    local dest; dest=$dir/$(printf %03d $k)-$name.jsonl.xz
    git show "$c:recipe-data/$name/conversations.jsonl.xz" > "$dest.tmp"
    want=$(git show "$c:recipe-data/$name/manifest.json" | python3 -c 'import json, sys; print(json.load(sys.stdin)["sha256_xz"])')
    got=$(sha256sum "$dest.tmp" | cut -d' ' -f1)
    [ "$want" = "$got" ] || { rm -f "$dest.tmp"; die "$name: sha256 $got, its manifest says $want"; }
    mv "$dest.tmp" "$dest"
    echo "restored $dest"
  done
  [ "$k" -gt 0 ] || die "no exports kept in this repository's history"
}

case ${1:-} in
  store) [ $# -ge 3 ] || die "usage: store NAME FILE.jsonl [NOTE]"; cmd_store "$2" "$3" "${4:-}" ;;
  list) cmd_list ;;
  restore) [ $# -eq 2 ] || die "usage: restore DIR"; cmd_restore "$2" ;;
  rows) [ $# -eq 2 ] || die "usage: rows FILE.jsonl"; cmd_rows "$2" ;;
  *) sed -n '2,21p' "$0" >&2; exit 2 ;;
esac
