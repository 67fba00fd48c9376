#!/usr/bin/env bash
# The comparison on one data identity (docs/results/compare/campaign/README.md). One
# `pipeline.tune --evaluate` run at a time on the deterministic data; after each run its
# small outputs go to $ARCH and the run joins the campaign report ($ARCH/report.json: records
# carried from report to report, each with its data identity, curve, bytes and steps per
# stage). Resumable: run it again after any stop or on a fresh machine; a run already in the
# campaign report is skipped, and the staging folder is restored from the committed copy.
#   campaign.sh           the training queue (then $ARCH/queue-extra.txt)
#   campaign.sh status    done / pending per queued run
#   campaign.sh sweep     the netem sweep (machine otherwise idle; SWEEP_RECIPES, BANDWIDTHS)
#   campaign.sh sync      copy the staging record into $COMMITTED (then commit it by hand)
#   campaign.sh report    the campaign report re-timed with the sweep into $FINAL (default
#                         $COMMITTED/../tuned), and the seeds it owes into queue-extra.txt
# Environment: REPO (the checkout whose code runs; default: this one), PY, W (work folder,
# default ~/compare_work), DATA_ROOT (default REPO/../shared/data), COMMITTED (the record in
# the repository to restore from; default REPO/docs/results/compare/campaign), SWEEP (the
# sweep's netem.json for `report`, relative to REPO, as the report records it; default the
# synced docs/results/compare/campaign/netem/netem.json), FINAL.
# Writes only under $W; copying $ARCH into the repository and committing is by hand.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
REPO=${REPO:-$(cd "$HERE/../../../.." && pwd)}
PY=${PY:-$REPO/.venv/bin/python}
W=${W:-$HOME/compare_work}
DATA_ROOT=${DATA_ROOT:-$REPO/../shared/data}
DATA=$W/data/seq64
OUT=$W/out
ARCH=$W/archive
COMMITTED=${COMMITTED:-$REPO/docs/results/compare/campaign}
SOURCE=docs/results/compare/tuned/report.json   # chosen settings: its "tuning" section
TOK=d7c1b96053298b6943bc37d192bc9c8a8cee8a98cf5265542cddb4667a93f254
SHARDS=8d34a37ae1a71493180cc24ec8818a1597256c3fc41af1acefa9b64d18f14475
# --nodes of the recipes tuned with nodes as workers (the tuning records' "nodes")
declare -A NODES=([diloco_node]=2 [streaming_diloco_node]=2 [onebit_lamb_node]=2
  [slowmo_node]=2 [co2_node]=2 [lamb_node]=2 [hybrid_onebit_lamb_node]=2)
# round length (tau) each local-step recipe was tuned to / runs at; inner optimizers
declare -A TAU=([slowmo]=16 [local_sgd]=8 [co2]=4 [slowmo_node]=8 [co2_node]=4 [diloco]=8
  [diloco_int4]=8 [diloco_node]=4 [streaming_diloco]=12 [streaming_diloco_int4]=12
  [streaming_diloco_node]=12)
declare -A INNER=([slowmo_node]=adamw [co2_node]=adamw)
ALL=lamb,onebit_lamb,adamw,onebit_adam,zero_one_adam,powersgd,hybrid_onebit_lamb,onebit_lamb_overlap,lamb_node,onebit_lamb_node,hybrid_onebit_lamb_node,slowmo,slowmo_node,local_sgd,co2,co2_node,diloco,diloco_int4,diloco_node,streaming_diloco,streaming_diloco_int4,streaming_diloco_node,decentlam,dmsgd

queue() {  # "recipe seed", in launch order
  local s r
  # P1: the records on the earlier vocabulary, again on this data (leaders of the tuned
  # report first: slowmo, powersgd, streaming_diloco_node, adamw)
  for s in 2 3; do
    for r in slowmo powersgd streaming_diloco_node adamw onebit_lamb onebit_adam local_sgd \
             onebit_lamb_node hybrid_onebit_lamb diloco_node co2 decentlam zero_one_adam; do
      echo "$r $s"; done
  done
  # P5: seeds the ranking asks for after the sweep, "recipe seed" per line (# comments)
  if [ -f "$ARCH/queue-extra.txt" ]; then grep -v '^ *#' "$ARCH/queue-extra.txt" | grep . || true; fi
}

restore() {
  mkdir -p "$OUT" "$ARCH/evaluation" "$ARCH/runs" "$W/logs"
  if [ ! -f "$ARCH/report.json" ] && [ -f "$COMMITTED/report.json" ]; then
    cp -a "$COMMITTED/." "$ARCH/"
  fi
}

prepare_data() {
  if [ ! -f "$DATA/manifest.json" ]; then
    mkdir -p "$W/data"
    # the data stage is deterministic (about 35 s); the identity is checked below
    (cd "$REPO" && "$PY" -m pipeline run --config configs/experiments/parity.yaml \
      workdir="$W/prep" "data.overrides=[data_root=$DATA_ROOT]" --stages data) </dev/null
    cp -a "$W/prep/data/." "$W/data/"
  fi
  (cd "$REPO" && "$PY" - "$DATA" "$TOK" "$SHARDS" <<'EOF'
import sys
from pathlib import Path
from pipeline.tuning import data_identity
got = data_identity(Path(sys.argv[1]))
want = {"tokenizer_sha256": sys.argv[2], "shards_sha256": sys.argv[3]}
if got != want:
    sys.exit(f"{sys.argv[1]}: data identity {got} is not the campaign's {want}")
print("[campaign] data identity ok:", sys.argv[1])
EOF
  )
}

in_report() {  # recipe seed -> 0 when the staged campaign report holds that run
  [ -f "$ARCH/report.json" ] || return 1
  "$PY" - "$ARCH/report.json" "$1" "$2" </dev/null <<'EOF'
import json, sys
runs = json.load(open(sys.argv[1]))["runs"]
sys.exit(0 if any(r["name"] == sys.argv[2] and str(r["seed"]) == sys.argv[3] for r in runs) else 1)
EOF
}

# the tuned report's netem files: the campaign report carries them until the new sweep
# re-times every record (--retime)
NETEM_OLD="--netem docs/results/2026-11-27-joint-netem-sweep/netem.json
 --netem docs/results/2026-11-27-tuned-slowmo-co2/netem.json
 --netem docs/results/2026-11-27-tuned-local-sgd/netem.json
 --netem docs/results/2026-11-28-netem-onebit-variants/netem-new-recipes.json"
OLD_VOCAB="onebit_lamb diloco_node streaming_diloco_node onebit_adam adamw decentlam hybrid_onebit_lamb powersgd onebit_lamb_node slowmo co2 local_sgd zero_one_adam"

base_report() {  # the tuned report's records on this data: LAMB (its data references) and 10
  [ -f "$ARCH/report.json" ] && return 0
  local n drops=""
  for n in lamb $OLD_VOCAB; do drops="$drops --drop $n"; done
  (cd "$REPO" && "$PY" -c "import json; r = json.load(open('$SOURCE')); \
json.dump([v for k, v in r['tuning'].items() if k in '$OLD_VOCAB'.split()], \
open('$W/tuning_records.json', 'w'), indent=1)")
  rm -rf "$W/report.next"
  (cd "$REPO" && "$PY" -m pipeline.reports.compare --prior "$SOURCE" $drops $NETEM_OLD \
    --tuning "$W/tuning_records.json" --out "$W/report.next") </dev/null
  cp "$W/report.next/report.json" "$W/report.next/report.md" "$W/report.next"/*.png "$ARCH/"
}

add_to_report() {  # recipe seed run_dir: the run joins the campaign report
  local r=$1 s=$2 dir=$3 next=$W/report.next
  rm -rf "$next"
  (cd "$REPO" && "$PY" -m pipeline.reports.compare --prior "$ARCH/report.json" \
    --run "$r=$dir" $NETEM_OLD --out "$next") </dev/null
  cp "$next/report.json" "$next/report.md" "$ARCH/"
  cp "$next"/*.png "$ARCH/" 2>/dev/null || true
}

run_one() {  # recipe seed
  local r=$1 s=$2 nodes=${NODES[$1]:-1}
  local dir=$OUT/$r/$r-eval-seed$s t0
  t0=$(date +%s)
  echo "[campaign] $(date -u +%FT%TZ) start $r seed $s (--nodes $nodes)"
  (cd "$REPO" && "$PY" -m pipeline.tune --config configs/pretrain/parity.yaml --data "$DATA" \
    --recipes "$r" --evaluate "$SOURCE" --eval-seeds "$s" --nproc 4 --nodes "$nodes" \
    --out "$OUT") </dev/null
  cp "$OUT/$r/evaluation.json" "$ARCH/evaluation/$r-seed$s.json"
  (cd "$REPO" && "$PY" -m pipeline.reports.archive "$dir" "$ARCH/runs/$r-seed$s" --every 50) </dev/null
  add_to_report "$r" "$s" "$dir"
  echo "[campaign] $(date -u +%FT%TZ) done $r seed $s ($(( ($(date +%s) - t0) / 60 )) min)" \
    | tee -a "$ARCH/campaign.log"
}

sweep() {  # one interleaved bench.netem invocation, --repeats 2; needs root, nothing else running
  local names=${SWEEP_RECIPES:-$ALL} taus=4 inner="" n
  for n in ${names//,/ }; do
    if [ -n "${TAU[$n]:-}" ] && [ "${TAU[$n]}" != 4 ]; then taus="$taus,$n=${TAU[$n]}"; fi
    if [ -n "${INNER[$n]:-}" ]; then inner="${inner:+$inner,}$n=${INNER[$n]}"; fi
  done
  mkdir -p "$ARCH/netem" "$W/logs"
  (cd "$REPO" && "$PY" -m bench.netem --data-root "$DATA_ROOT" \
    --bandwidths "${BANDWIDTHS:-25,10000}" --world-sizes 4 --ranks-per-host 2 --repeats 2 \
    --strategies "$names" --outer-every "$taus" ${inner:+--inner "$inner"} --topologies ring \
    --out "$W/netem") </dev/null 2>&1 | tee "$W/logs/netem.log"
  cp "$W/netem/netem.json" "$W/netem/netem.png" "$ARCH/netem/"
}

report() {  # the re-timed report, then "recipe seed" lines for the seeds the ranking asks for
  local sweep=${SWEEP:-docs/results/compare/campaign/netem/netem.json}
  local final=${FINAL:-$COMMITTED/../tuned}
  [ -f "$REPO/$sweep" ] || {
    echo "no sweep at $REPO/$sweep: run campaign.sh sweep, then sync" >&2; exit 1; }
  local plan=configs/compare/groups.yaml  # the pre-registered margin and seed count
  local prior="$ARCH/report.json"
  if cmp -s "$ARCH/report.json" "$COMMITTED/report.json"; then  # synced: name the clone's copy
    prior=$(realpath --relative-to="$REPO" "$COMMITTED/report.json")
  fi
  (cd "$REPO" && "$PY" -m pipeline.reports.compare --prior "$prior" --retime \
    --netem "$sweep" --preregistered "$plan" --out "$final") </dev/null
  (cd "$REPO" && "$PY" -m pipeline.reports.ranking --report "$final/report.json" \
    --preregistered "$plan" --json) </dev/null > "$W/owed.json"
  # a seed queued by an earlier look stays queued until it has run: no recipe leaves the
  # queue because an interim look put it behind (the groups are read when none is owed)
  # (the new queue replaces the old one only once it is whole)
  touch "$ARCH/queue-extra.txt"
  "$PY" - "$final/report.json" "$W/owed.json" "$ARCH/queue-extra.txt" \
    > "$ARCH/queue-extra.txt.new" <<'EOF'
import json, sys
report = json.load(open(sys.argv[1]))
runs, want = report["runs"], report["groups_preregistration"]["seeds"]
owed = json.load(open(sys.argv[2]))
done = {(r["name"], int(r["seed"])) for r in runs}
print(f"# seeds the ranking of {sys.argv[1]} asks for: {want} per owing recipe, in rounds;"
      " with the seeds an earlier look queued that have not run")
lines = set()
for line in open(sys.argv[3]):
    if line.strip() and not line.lstrip().startswith("#"):
        name, seed = line.split()
        if (name, int(seed)) not in done:
            lines.add((int(seed), name))
for entry in owed:
    have = {int(r["seed"]) for r in runs if r["name"] == entry["name"]}
    seed = 2
    while len(have) < want:
        if seed not in have:
            have.add(seed)
            lines.add((seed, entry["name"]))
        seed += 1
for seed, name in sorted(lines):  # one seed of every owing recipe, then the next
    print(name, seed)
EOF
  mv "$ARCH/queue-extra.txt.new" "$ARCH/queue-extra.txt"
  echo "[campaign] report: $final; owed seeds: $ARCH/queue-extra.txt"
  cat "$ARCH/queue-extra.txt"
}

restore
mapfile -t ITEMS < <(queue)
case "${1:-run}" in
  status)
    for item in "${ITEMS[@]}"; do
      read -r r s <<<"$item"
      if in_report "$r" "$s"; then echo "done    $r $s"; else echo "pending $r $s"; fi
    done ;;
  sweep) sweep ;;
  report) report ;;
  sync)
    mkdir -p "$COMMITTED/evaluation" "$COMMITTED/runs"
    cp "$ARCH/report.json" "$COMMITTED/"
    if [ -f "$ARCH/campaign.log" ]; then cp "$ARCH/campaign.log" "$COMMITTED/"; fi
    if [ -f "$ARCH/queue-extra.txt" ]; then cp "$ARCH/queue-extra.txt" "$COMMITTED/"; fi
    cp -r "$ARCH/evaluation/." "$COMMITTED/evaluation/"
    cp -r "$ARCH/runs/." "$COMMITTED/runs/"
    if [ -d "$ARCH/netem" ]; then cp -r "$ARCH/netem" "$COMMITTED/"; fi
    echo "[campaign] staged record copied to $COMMITTED" ;;
  run)
    prepare_data
    base_report
    for item in "${ITEMS[@]}"; do
      read -r r s <<<"$item"
      in_report "$r" "$s" && continue
      run_one "$r" "$s"
    done
    echo "[campaign] queue done" ;;
  *) echo "usage: $0 [run|status|sweep|sync|report]" >&2; exit 2 ;;
esac
