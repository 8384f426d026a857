#!/usr/bin/env bash
# Two node agents in two network namespaces joined by one veth pair. Run under `unshare -r -n`:
#   netns_nodes.sh STATE_DIR NODE_A NODE_B PYTHON
# NODE_A runs in this namespace on 10.77.0.1 (veth va), NODE_B in a child namespace on 10.77.0.2
# (vb). Both reach Redis through its unix socket (RINGQ_REDIS_URL), which no namespace cuts.
# Writes STATE_DIR/pids: "<pid in namespace A> <pid in namespace B>" once both agents started.
set -euo pipefail
state=$1 node_a=$2 node_b=$3 python=$4
ip link set lo up
unshare -n -- sleep infinity &
holder=$!
while [ "$(readlink /proc/$holder/ns/net)" = "$(readlink /proc/$$/ns/net)" ]; do sleep 0.05; done
ip link add va type veth peer name vb netns "$holder"
ip addr add 10.77.0.1/24 dev va
ip link set va up
nsenter -t "$holder" -n sh -c 'ip link set lo up && ip addr add 10.77.0.2/24 dev vb && ip link set vb up'
"$python" -m cli.main node --name "$node_a" --address 10.77.0.1 --memory-limit 4 \
  >"$state/$node_a.log" 2>&1 &
agent_a=$!
nsenter -t "$holder" -n "$python" -m cli.main node --name "$node_b" --address 10.77.0.2 \
  --memory-limit 4 >"$state/$node_b.log" 2>&1 &
agent_b=$!
trap 'kill $agent_a $agent_b 2>/dev/null; wait $agent_a $agent_b; kill $holder' EXIT
echo "$$ $holder" >"$state/pids"
wait $agent_a $agent_b
