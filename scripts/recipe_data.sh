#!/usr/bin/env bash
# Target-written conversations kept in the repository's history, outside the working tree.
#
# Generating conversations takes GPU time, and a GPU machine may not outlive the run (a rented
# or preemptible node). Each generation run's new rows are kept as one "data commit":
# a commit of its own (no parent) holding recipe-data/<NAME>/conversations.jsonl.xz and
# manifest.json, joined to the current branch by a merge that keeps the branch's files (`git merge
# -s ours`). The working tree stays small, a clone carries every export, and the exports of many
# runs concatenate into one training set (docs/recipe-smollm2.md, "Kept data and drafters").
#
#   bash scripts/recipe_data.sh store NAME FILE.jsonl [NOTE]   keep FILE's rows (a run's new rows)
#   bash scripts/recipe_data.sh list                          the kept exports, oldest first
#   bash scripts/recipe_data.sh restore DIR                   every export's .jsonl.xz into DIR,
#                                                             checked against its manifest
#   bash scripts/recipe_data.sh rows FILE.jsonl               rows of FILE no export holds yet (by id)
#   bash scripts/recipe_data.sh store-drafter NAME DIR [NOTE] keep a trained drafter (DIR: a run's
#                                                             final/, config.json + model.safetensors)
#   bash scripts/recipe_data.sh restore-drafter DIR [NAME]    the current drafter (or NAME) into DIR
#                                                             (a new folder, or one an earlier restore made)
#
# Drafters are kept the same way (recipe-drafter/<NAME>/: its files and a manifest with their
# sha256), so a drafter trained on a short-lived machine outlives it and starts the next stage of
# a long run (`--drafter.init_from DIR`); ~39 MB each for SmolLM2's, so keep the stages worth
# resuming. The current drafter, the one the README's numbers were measured with, is named below
# (CURRENT_DRAFTER): restore-drafter gives it unless told another, so a stage kept since does not
# replace it by being newer. RECIPE_CURRENT_DRAFTER=NAME names another for one command, and
# RECIPE_CURRENT_DRAFTER= (empty) means the newest kept drafter.
#
# Restore writes DIR/<k>-<NAME>.jsonl.xz (k = 001, 002, ... in the order kept), so
# `xz -dc DIR/*.jsonl.xz > gen-0.jsonl` rebuilds the whole set in order; `generate` then resumes
# that file and skips every row it already holds.
#
# Names (NAME, and every file name a drafter folder or a manifest holds) are letters, digits, '.',
# '_' and '-', not starting with '.': no path, no '..', no whitespace. restore-drafter builds the
# drafter in a temporary folder beside DIR, checks every file against its manifest, and only then
# renames it into place; it replaces only a folder an earlier restore-drafter made (its
# .recipe-drafter file), never one it did not make.
set -euo pipefail
die() { echo "recipe_data: $*" >&2; exit 2; }
top=$(git rev-parse --show-toplevel 2> /dev/null) || die "not inside a git repository: run it in a clone of this project"
cd "$top"
MARK="recipe data:"
DRAFTER_MARK="recipe drafter:"
RESTORED=.recipe-drafter  # in a folder restore-drafter made: the drafter's name and commit
NAME_RE='^[A-Za-z0-9_][A-Za-z0-9._-]*$'
CURRENT_DRAFTER=${RECIPE_CURRENT_DRAFTER-2026-12-06-smollm2-fourth-stage-full-data}

valid_name() { [[ $1 =~ $NAME_RE ]]; }
check_name() {  # WHAT NAME: one line naming what is wrong with a name
  valid_name "$2" || die "$1 '$2': letters, digits, '.', '_' and '-' only, not starting with '.' (no path, no spaces)"
}
shallow_hint() {  # a shallow clone holds no kept export or drafter: the merges' other parents are cut off
  [ "$(git rev-parse --is-shallow-repository 2> /dev/null)" = true ] &&
    echo "; this clone is shallow (git clone --depth): run 'git fetch --unshallow' to fetch the history they live in"
  true
}

data_commits() {  # the data commits reachable from HEAD, oldest first
  git log HEAD --reverse --format=%H --grep="^$MARK " 2>/dev/null || true
}
drafter_commits() {  # the kept drafters' commits, oldest first
  git log HEAD --reverse --format=%H --grep="^$DRAFTER_MARK " 2>/dev/null || true
}

name_of() {  # COMMIT [PREFIX]: the name a kept export's (or drafter's) commit holds, checked
  local name
  name=$(git ls-tree --name-only "$1" "${2:-recipe-data}/" | head -n 1 | sed "s|^${2:-recipe-data}/||")
  valid_name "$name" || die "commit $1 keeps '$name', not a valid name: a commit this script did not write"
  echo "$name"
}

# commit_beside DIR PREFIX MESSAGE MERGE_MESSAGE FILE...: DIR's FILEs as PREFIX/<FILE> in a commit
# of its own (no parent), joined to the branch by a merge that keeps the branch's files; prints the commit
commit_beside() {
  local dir=$1 prefix=$2 message=$3 merge_message=$4 f tree commit; shift 4
  export GIT_INDEX_FILE=$dir/.index
  git read-tree --empty
  for f in "$@"; do
    git update-index --add --cacheinfo "100644,$(git hash-object -w "$dir/$f"),$prefix/$f"
  done
  tree=$(git write-tree); unset GIT_INDEX_FILE
  commit=$(git commit-tree "$tree" -m "$message")
  git merge -q -s ours --allow-unrelated-histories --no-edit -m "$merge_message" "$commit"
  echo "$commit"
}

known_ids() {  # every row id of every export, one per line
  local c
  for c in $(data_commits); do
    git show "$c:recipe-data/$(name_of "$c")/conversations.jsonl.xz" | xz -dc |
      python3 -c 'import json, sys; [print(json.loads(line)["id"]) for line in sys.stdin if line.strip()]'
  done
}

cmd_rows() {  # FILE: its rows whose id no export holds, in file order (nothing printed if a row is bad)
  local file=$1
  [ -f "$file" ] || die "$file: no such file"
  known_ids | python3 -c '
import json, sys
known = set(line.rstrip("\n") for line in sys.stdin)
out = []
with open(sys.argv[1], encoding="utf-8", errors="surrogateescape") as f:
    lines = f.readlines()
for n, line in enumerate(lines, 1):
    if not line.strip():
        continue
    try:
        row_id = json.loads(line)["id"]
    except (json.JSONDecodeError, KeyError, TypeError):
        if n == len(lines) and not line.endswith("\n"):
            sys.exit(f"recipe_data: {sys.argv[1]}:{n}: a torn last line (no newline: a run stopped while writing "
                     f"it); rerun generate on the file (it drops the line and resumes), then again")
        sys.exit(f"recipe_data: {sys.argv[1]}:{n}: not a generated row (no id)")
    if row_id not in known:
        out.append(line if line.endswith("\n") else line + "\n")
sys.stdout.write("".join(out))
' "$file" || exit 2
}

cmd_store() {  # NAME FILE [NOTE]
  local name=$1 file=$2 note=${3:-}
  check_name NAME "$name"
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
  local commit
  commit=$(commit_beside "$tmp" "recipe-data/$name" "$MARK $name ($rows conversations)${note:+: $note}" \
    "keep the $name conversations in history (scripts/recipe_data.sh restore)" conversations.jsonl.xz manifest.json)
  echo "kept $rows conversations as $name ($(du -h "$tmp/conversations.jsonl.xz" | cut -f1) xz) in $commit"
}

cmd_list() {
  local c
  [ -n "$(data_commits)$(drafter_commits)" ] || { echo "nothing kept in this repository's history$(shallow_hint)"; return; }
  for c in $(data_commits); do git show "$c:recipe-data/$(name_of "$c")/manifest.json" | tr -d '\n'; echo; done |
    python3 -c "$(cat <<'PY'
import json, sys
manifests = [json.loads(line) for line in sys.stdin if line.strip()]
for k, m in enumerate(manifests, 1):
    print(f"{k:>3}  {m['date']}  {m['name']:<32} {m['rows']:>8,} rows  {m.get('note', '')}")
print(f"{sum(m['rows'] for m in manifests):,} rows in {len(manifests)} export(s)")
PY
)"
  for c in $(drafter_commits); do git show "$c:recipe-drafter/$(name_of "$c" recipe-drafter)/manifest.json" | tr -d '\n'; echo; done |
    python3 -c "$(cat <<'PY'
import json, sys
for m in (json.loads(line) for line in sys.stdin if line.strip()):
    mark = " (current)" if m["name"] == sys.argv[1] else ""
    print(f"drafter  {m['date']}  {m['name']:<32} {m['bytes'] / 1e6:>6.1f} MB  {m.get('note', '')}{mark}")
PY
)" "$CURRENT_DRAFTER"
}

cmd_restore() {  # DIR
  local dir=$1 c k=0 name want got
  [ -n "$dir" ] || die "DIR is empty: name the folder to restore into"
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
  [ "$k" -gt 0 ] || die "no exports kept in this repository's history$(shallow_hint)"
}

cmd_store_drafter() {  # NAME DIR [NOTE]
  local name=$1 dir=$2 note=${3:-} c f
  check_name NAME "$name"
  for f in config.json model.safetensors; do
    [ -f "$dir/$f" ] || die "$dir/$f: no such file (a drafter folder holds config.json and model.safetensors)"
  done
  for f in "$dir"/*; do  # every file kept must come back by its name: refused now, not at restore
    [ -f "$f" ] && ! valid_name "$(basename "$f")" &&
      die "$f: a file name restore cannot give back (letters, digits, '.', '_' and '-' only, not starting with '.'): rename it or move it out"
  done
  for c in $(drafter_commits); do [ "$(name_of "$c" recipe-drafter)" != "$name" ] || die "a drafter named $name is kept already"; done
  [ -z "$(git status --porcelain --untracked-files=no)" ] || die "commit or stash your changes first"
  local tmp files=(); tmp=$(mktemp -d); trap 'rm -rf "$tmp"' RETURN
  for f in "$dir"/*; do [ -f "$f" ] && cp "$f" "$tmp/" && files+=("$(basename "$f")"); done
  python3 - "$tmp" "$name" "$note" "${files[@]}" <<'PY'
import datetime, hashlib, json, os, sys
tmp, name, note, *names = sys.argv[1:]
files = {f: hashlib.sha256(open(os.path.join(tmp, f), "rb").read()).hexdigest() for f in sorted(names)}
size = sum(os.path.getsize(os.path.join(tmp, f)) for f in names)
manifest = {"name": name, "date": datetime.date.today().isoformat(), "bytes": size, "files": files, "note": note}
open(os.path.join(tmp, "manifest.json"), "w").write(json.dumps(manifest, indent=2) + "\n")
PY
  local commit
  commit=$(commit_beside "$tmp" "recipe-drafter/$name" "$DRAFTER_MARK $name${note:+: $note}" \
    "keep the $name drafter in history (scripts/recipe_data.sh restore-drafter)" "${files[@]}" manifest.json)
  echo "kept the drafter $dir as $name in $commit"
}

cmd_restore_drafter() {  # DIR [NAME]: NAME, else the current drafter (else the newest), its files checked against its manifest
  local dir=$1 want=${2:-$CURRENT_DRAFTER} c found= name
  dir=${dir%"${dir##*[!/]}"}  # DIR/ is DIR
  [ -n "$dir" ] || die "DIR '$1': name the folder to restore into"
  [ -z "$want" ] || check_name NAME "$want"
  if [ -e "$dir" ] || [ -L "$dir" ]; then  # replaced only when an earlier restore made it
    [ -d "$dir" ] && [ ! -L "$dir" ] && [ -f "$dir/$RESTORED" ] ||
      die "$dir exists and was not made by restore-drafter (no $RESTORED in it): name a new folder; nothing there is replaced"
  fi
  for c in $(drafter_commits); do
    name=$(name_of "$c" recipe-drafter)
    [ -z "$want" ] || [ "$name" = "$want" ] && found=$c
  done
  [ -n "$found" ] || die "no drafter${want:+ named $want} kept in this repository's history$(shallow_hint)"
  name=$(name_of "$found" recipe-drafter)
  local parent base tmp old f sha files
  parent=$(dirname "$dir") base=$(basename "$dir")
  mkdir -p "$parent"
  tmp=$(mktemp -d "$parent/.$base.restore-XXXXXX")  # beside DIR: the rename into place is atomic
  trap "rm -rf $(printf %q "$tmp")" EXIT  # whatever stops the restore, no half-written folder stays
  git show "$found:recipe-drafter/$name/manifest.json" > "$tmp/$RESTORED" 2> /dev/null \
    || die "$name: its commit $found has no manifest.json"
  files=$(python3 -c '
import json, re, sys
ok = re.compile(sys.argv[2])
try:
    files = json.load(open(sys.argv[1]))["files"]
    assert isinstance(files, dict) and files
except Exception:
    sys.exit(f"recipe_data: {sys.argv[3]}: its manifest.json lists no files")
for f, h in files.items():
    if not ok.match(f) or not re.fullmatch(r"[0-9a-f]{64}", str(h)):
        sys.exit(f"recipe_data: {sys.argv[3]}: its manifest names {f!r} (sha256 {h!r}): not a file name or "
                 f"checksum this script writes; nothing was restored")
    print(f, h)
' "$tmp/$RESTORED" "$NAME_RE" "$name") || exit 2
  while read -r f sha; do
    git show "$found:recipe-drafter/$name/$f" > "$tmp/$f" 2> /dev/null \
      || die "$name/$f: listed in its manifest, missing from its commit $found"
    [ "$(sha256sum "$tmp/$f" | cut -d' ' -f1)" = "$sha" ] || die "$name/$f: sha256 differs from its manifest"
  done <<< "$files"
  printf '{"name": "%s", "commit": "%s"}\n' "$name" "$found" > "$tmp/$RESTORED"
  if [ -d "$dir" ]; then  # an earlier restore: parked, the new one renamed in, then the parked one removed
    old=$(mktemp -d "$parent/.$base.old-XXXXXX")
    mv "$dir" "$old/drafter"
    mv "$tmp" "$dir" || { mv "$old/drafter" "$dir"; rm -rf "$old"; die "$dir: the restored drafter could not be moved in; the earlier one is back"; }
    rm -rf "$old"
  else
    mv "$tmp" "$dir"
  fi
  trap - EXIT
  echo "restored the drafter $name into $dir"
}

case ${1:-} in
  store) [ $# -ge 3 ] || die "usage: store NAME FILE.jsonl [NOTE]"; cmd_store "$2" "$3" "${4:-}" ;;
  list) cmd_list ;;
  restore) [ $# -eq 2 ] || die "usage: restore DIR"; cmd_restore "$2" ;;
  rows) [ $# -eq 2 ] || die "usage: rows FILE.jsonl"; cmd_rows "$2" ;;
  store-drafter) [ $# -ge 3 ] || die "usage: store-drafter NAME DIR [NOTE]"; cmd_store_drafter "$2" "$3" "${4:-}" ;;
  restore-drafter) [ $# -ge 2 ] || die "usage: restore-drafter DIR [NAME]"; cmd_restore_drafter "$2" "${3:-}" ;;
  *) sed -n '2,/^set /{/^#/p}' "$0" >&2; exit 2 ;;
esac
