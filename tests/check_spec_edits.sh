#!/usr/bin/env bash
# Edits to a downstream project's specs rebuild with `cmake --build` alone: each edit changes the set of
# variants, and the rebuilt program must register exactly the new set and pass its reference check.
#   check_spec_edits.sh <installed kvforge prefix> <work dir>
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
prefix="$1" work="$2"
rm -rf "$work" && mkdir -p "$work"
cp -r "$here/consumer" "$work/src"
layouts="$work/src/specs/layouts" models="$work/src/specs/models"
# Unoptimized, as tests/check_consumer.sh: this checks what rebuilds, and the results on a few tokens.
cmake -S "$work/src" -B "$work/build" -G Ninja -DCMAKE_BUILD_TYPE=Debug -DCMAKE_CXX_FLAGS_DEBUG=-O0 -DCMAKE_PREFIX_PATH="$prefix" >/dev/null

# step <what> <checked f32/bf16 variants> <every registered name, space-separated>
step() {
  local what="$1" checked="$2" want="$3" got
  cmake --build "$work/build" --target consumer >"$work/build.log" 2>&1 || { cat "$work/build.log"; echo "spec edits: $what: the rebuild failed"; exit 1; }
  got=$("$work/build/consumer" "$checked" | awk '/^registered:/ {print $2}' | sort | tr '\n' ' ' | sed 's/ $//')
  [ "$got" = "$want" ] || { echo "spec edits: $what: registered [$got], expected [$want]"; exit 1; }
  echo "spec edits: $what: rebuilt, registers $want"
}

step "as written" 2 "consumer_paged.odd_model.bf16 consumer_paged.odd_model.fp32"
sed -i 's/dtypes: \[fp32, bf16\]/dtypes: [fp32, bf16, fp16]/' "$layouts/consumer_paged.yaml"
step "a dtype added" 2 "consumer_paged.odd_model.bf16 consumer_paged.odd_model.fp16 consumer_paged.odd_model.fp32"
sed 's/^name: odd_model/name: wide_model/; s/^head_dim: 24/head_dim: 40/' "$models/odd_model.yaml" >"$models/wide_model.yaml"
sed -i 's/models: \[odd_model\]/models: [odd_model, wide_model]/' "$layouts/consumer_paged.yaml"
step "a model added" 4 "consumer_paged.odd_model.bf16 consumer_paged.odd_model.fp16 consumer_paged.odd_model.fp32 consumer_paged.wide_model.bf16 consumer_paged.wide_model.fp16 consumer_paged.wide_model.fp32"
rm "$models/odd_model.yaml"
sed -i 's/models: \[odd_model, wide_model\]/models: [wide_model]/' "$layouts/consumer_paged.yaml"
step "a model removed" 2 "consumer_paged.wide_model.bf16 consumer_paged.wide_model.fp16 consumer_paged.wide_model.fp32"
sed 's/^name: consumer_paged/name: renamed_paged/' "$layouts/consumer_paged.yaml" >"$layouts/renamed_paged.yaml"
rm "$layouts/consumer_paged.yaml"
sed -i 's/consumer_paged.odd_model.fp32/renamed_paged.wide_model.fp32/' "$work/src/transfer.cpp"
step "a layout renamed" 2 "renamed_paged.wide_model.bf16 renamed_paged.wide_model.fp16 renamed_paged.wide_model.fp32"
