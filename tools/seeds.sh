#!/usr/bin/env bash
# Every Hypothesis test at several seeds: a property whose verdict depends on the seed (a strategy
# that reads state Hypothesis does not control, an example only some seeds reach) fails at one of
# them. Not part of CI: it runs the Hypothesis tests (the @given tests and the state machines,
# which Hypothesis's pytest plugin marks "hypothesis") once a seed, in the default profile's
# sizes, with no example database, so that no seed's run replays what an earlier one found.
#
#   bash tools/seeds.sh                   seeds 0 to 4
#   bash tools/seeds.sh 5 6               those seeds
#   bash tools/seeds.sh -- -k machine     seeds 0 to 4, pytest's selection narrowed further
#
# It prints each seed's summary line as it ends, then all of them; exits 1 if any seed failed.
set -uo pipefail
cd "$(dirname "$0")/.."
seeds=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do seeds+=("$1"); shift; done
[ $# -gt 0 ] && shift  # the "--"
[ ${#seeds[@]} -eq 0 ] && seeds=(0 1 2 3 4)
summaries=() status=0
for seed in "${seeds[@]}"; do
    log=$(mktemp)
    cmd=(python -m pytest -q -m hypothesis --hypothesis-profile seeds --hypothesis-seed="$seed"
         -p no:cacheprovider "$@")
    echo "+ ${cmd[*]}"
    "${cmd[@]}" 2>&1 | tee "$log"
    [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
    summaries+=("seed $seed: $(grep -E '(passed|failed|error)' "$log" | tail -1)")
    echo "${summaries[-1]}"
    rm -f "$log"
done
printf '%s\n' "${summaries[@]}"
exit $status
