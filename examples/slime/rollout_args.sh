# The flags a slime launch script adds to point slime's default rollout at Belayer: source this file,
# then pass "${BELAYER_ARGS[@]}" to train.py / train_async.py next to the script's other *_ARGS arrays.
# examples/slime itself goes on PYTHONPATH (not examples/, whose slime/ folder would shadow slime), so
# that slime's load_function imports belayer_rollout.generate.
BELAYER_EXAMPLE_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
export PYTHONPATH="${BELAYER_EXAMPLE_DIR}${PYTHONPATH:+:${PYTHONPATH}}"

BELAYER_ARGS=(
   # one Belayer trajectory per sample, in place of slime's single-turn SGLang generate
   --custom-generate-function-path belayer_rollout.generate
   # sets args.belayer_* (where the cluster is, the RolloutSettings)
   --custom-config-path "${BELAYER_EXAMPLE_DIR}/belayer_config.yaml"
   # the task's shape and seed per sample: a metadata column with belayer_task / belayer_seed
   --metadata-key metadata
)
