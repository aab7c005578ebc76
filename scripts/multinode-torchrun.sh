#!/usr/bin/env bash
# multinode-torchrun.sh - run fsdp2lab on several machines without Slurm: run the SAME command on
# every node; torchrun's c10d rendezvous on HEAD (one of the nodes) assigns the node ranks.
#
#   scripts/multinode-torchrun.sh --nnodes 2 --head 10.0.0.1 -- --model gpt --epochs 3
#   scripts/multinode-torchrun.sh --nnodes 2 --head 10.0.0.1:29400 --node-rank 1 -- ...
#
# Options (before --; everything after -- goes to `fsdp2lab train`, after the defaults, so it wins):
#   --nnodes N            number of machines (required)
#   --head HOST[:PORT]    an address of the first node that every node can reach (required);
#                         PORT default 29400, open between the nodes
#   --nproc-per-node G    ranks per node (default: GPUs on this node, else 2 CPU ranks)
#   --node-rank R         static rendezvous instead of c10d: R = 0..N-1, node 0 is HEAD
#   --rdzv-id ID          c10d rendezvous id, the same on every node (default fsdp2lab)
#   --dry-run             print the command instead of running it
# Defaults added to `fsdp2lab train`: --dp-replicate N --dp-shard G (HSDP: shard inside a node,
# replicate across nodes) unless a mesh flag (--dp-replicate/--dp-shard/--tp/--pp/--strategy/
# --config) is given; --device cpu on a node without GPU.
# Environment: FSDP2LAB_PYTHON (python with fsdp2lab; default python3), and the network settings
# in docs/multinode.md (NCCL_SOCKET_IFNAME, GLOO_SOCKET_IFNAME, ...), passed through unchanged.
# Exit codes: torchrun's; 2 for bad usage.
set -euo pipefail

die() {
  printf 'multinode-torchrun: error: %s\n' "$1" >&2
  exit 2
}

NNODES='' HEAD='' NPROC='' NODE_RANK='' RDZV_ID=fsdp2lab DRY=0
while (($#)); do
  case $1 in
  --nnodes | --head | --nproc-per-node | --node-rank | --rdzv-id)
    (($# >= 2)) || die "$1 needs a value"
    case $1 in
    --nnodes) NNODES=$2 ;;
    --head) HEAD=$2 ;;
    --nproc-per-node) NPROC=$2 ;;
    --node-rank) NODE_RANK=$2 ;;
    --rdzv-id) RDZV_ID=$2 ;;
    esac
    shift 2
    ;;
  --dry-run) DRY=1 && shift ;;
  --) shift && break ;;
  -h | --help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//' && exit 0 ;;
  *) die "unknown option '$1' (fsdp2lab train arguments go after --)" ;;
  esac
done

[[ $NNODES =~ ^[1-9][0-9]*$ ]] || die "--nnodes N is required (a positive integer)"
[[ -n $HEAD ]] || die "--head HOST[:PORT] is required (an address of the first node)"
HOST=${HEAD%:*} PORT=29400
[[ $HEAD == *:* ]] && PORT=${HEAD##*:}
[[ $PORT =~ ^[0-9]+$ ]] || die "bad port in --head $HEAD"
if [[ -n $NODE_RANK ]] && ! { [[ $NODE_RANK =~ ^[0-9]+$ ]] && ((NODE_RANK < NNODES)); }; then
  die "--node-rank must be 0..$((NNODES - 1)), got '$NODE_RANK'"
fi
read -ra PY <<<"${FSDP2LAB_PYTHON:-python3}"

GPUS=0
if command -v nvidia-smi >/dev/null 2>&1; then
  GPUS=$( (nvidia-smi -L 2>/dev/null || true) | grep -c '^GPU' || true)
fi
if [[ -z $NPROC ]]; then
  NPROC=$((GPUS > 0 ? GPUS : 2))
fi
[[ $NPROC =~ ^[1-9][0-9]*$ ]] || die "--nproc-per-node must be a positive integer, got '$NPROC'"

DEFAULTS=()
((GPUS > 0)) || DEFAULTS+=(--device cpu)
mesh_given=0
for arg in "$@"; do
  case $arg in --dp-replicate* | --dp-shard* | --tp | --tp=* | --pp | --pp=* | --strategy* | --config*) mesh_given=1 ;; esac
done
((mesh_given)) || DEFAULTS+=(--dp-replicate "$NNODES" --dp-shard "$NPROC")

if [[ -n $NODE_RANK ]]; then
  RDZV=(--node-rank "$NODE_RANK" --master-addr "$HOST" --master-port "$PORT")
else
  RDZV=(--rdzv-backend c10d --rdzv-endpoint "$HOST:$PORT" --rdzv-id "$RDZV_ID")
fi
CMD=("${PY[@]}" -m torch.distributed.run --nnodes "$NNODES" --nproc-per-node "$NPROC" "${RDZV[@]}"
  -m fsdp2lab train "${DEFAULTS[@]}" "$@")

printf 'multinode-torchrun:' >&2
printf ' %q' "${CMD[@]}" >&2
printf '\n' >&2
((DRY)) && exit 0
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(($(nproc) / NPROC > 0 ? $(nproc) / NPROC : 1))}
exec "${CMD[@]}"
