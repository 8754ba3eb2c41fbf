#!/usr/bin/env bash
# Submit a Relax run to a running Ray cluster with `ray job submit`.
#
#   RAY_ADDRESS=http://HEAD:8265 bash scripts/submit-job.sh --output-dir /shared/runs/demo [relax-train flags...]
#
# Every argument goes to relax-train unchanged. The job's driver (the controller) runs on the head node;
# Ray hands it RAY_ADDRESS, so relax-train joins the cluster instead of starting its own (see
# relax/core/controller.py), and the roles are placed over the cluster's nodes.
#
# Settings (environment variables):
#   RAY_ADDRESS          the cluster's dashboard address (default http://127.0.0.1:8265)
#   RELAX_JOB_ID         the submission id (default relax-<UTC time>); `ray job stop/logs/status ID` use it
#   RELAX_WORKING_DIR    folder uploaded as the job's working dir (default: this checkout, so the cluster runs
#                        this code and finds configs/env.yaml); "none" uploads nothing and runs the Relax
#                        installed on the nodes (e.g. the docker/ image)
#   RELAX_TRAIN          the entrypoint command (default relax-train; e.g. "python -m relax.entrypoints.train")
#   RELAX_STOP_WAIT_S    seconds `ray job stop` waits after SIGTERM before SIGKILL (default 60; Ray's own
#                        default of 3 s can cut Relax's shutdown of engines and roles short)
#   RELAX_NO_WAIT=1      return after submitting instead of following the logs until the job ends
#
# --output-dir must be an absolute path on storage that every node and the submitting machine can read
# (a shared filesystem): roles on other nodes write logs and checkpoints there and read the model from it.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"

output_dir=""
prev=""
for arg in "$@"; do
  case "$arg" in
    --output-dir=*) output_dir="${arg#--output-dir=}" ;;
    --output_dir=*) output_dir="${arg#--output_dir=}" ;;
  esac
  if [ "$prev" = "--output-dir" ] || [ "$prev" = "--output_dir" ]; then output_dir="$arg"; fi
  prev="$arg"
done
if [ -z "$output_dir" ]; then
  echo "submit-job.sh: give --output-dir ABSOLUTE_PATH (on storage every node can read and write)" >&2
  exit 2
fi
case "$output_dir" in
  /*) ;;
  *) echo "submit-job.sh: --output-dir $output_dir must be absolute: the job runs in Ray's working dir," \
          "on another machine, not here" >&2
     exit 2 ;;
esac

RAY_BIN="${RAY_BIN:-ray}"
ADDRESS="${RAY_ADDRESS:-http://127.0.0.1:8265}"
JOB_ID="${RELAX_JOB_ID:-relax-$(date -u +%Y%m%d-%H%M%S)}"
WORKING_DIR="${RELAX_WORKING_DIR:-$ROOT}"
STOP_WAIT="${RELAX_STOP_WAIT_S:-60}"
read -r -a TRAIN <<< "${RELAX_TRAIN:-relax-train}"

# Only the stop grace period goes into the job's runtime env: Relax sets the workers' variables itself
# (built-in defaults < configs/env.yaml < --train-env-vars), and Ray refuses to start a driver whose
# ray.init names a variable that the job's runtime env names too.
RUNTIME_ENV="{\"env_vars\": {\"RAY_JOB_STOP_WAIT_TIME_S\": \"${STOP_WAIT}\"}}"
ARGS=(job submit --address "$ADDRESS" --submission-id "$JOB_ID" --runtime-env-json "$RUNTIME_ENV")
if [ "$WORKING_DIR" != "none" ]; then
  ARGS+=(--working-dir "$WORKING_DIR")
fi
if [ "${RELAX_NO_WAIT:-0}" = 1 ]; then
  ARGS+=(--no-wait)
fi

echo "submitting $JOB_ID to $ADDRESS (output $output_dir)" >&2
echo "stop it with: $RAY_BIN job stop --address $ADDRESS $JOB_ID" >&2
exec "$RAY_BIN" "${ARGS[@]}" -- "${TRAIN[@]}" "$@"
