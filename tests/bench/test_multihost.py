"""The multi-host rehearsal's CI subset (bench/multihost.py): three hosts in their own network
and mount namespaces, Redis on host a over TCP with a password, node agents on b and c each with
a private RINGQ_HOME; a ring-2 over b and c gives the single node's answer, and a wrong password
or --address stops `ringq node` at start with one line. Needs root (network namespaces, tmpfs
mounts): skipped with the reason elsewhere."""

import pytest

from bench import multihost
from bench.multihost_hosts import namespaces_unavailable


@pytest.fixture(scope="module")
def cluster():
    if why := namespaces_unavailable():
        pytest.skip(why)
    with multihost.Hosts() as hosts:
        running = multihost.Cluster(hosts)
        running.start()
        yield running


@pytest.mark.slow
def test_ring2_over_two_hosts_answers_as_single(cluster):
    detail = multihost.ring2_same_as_single(cluster)
    assert "ring-2 on ['b', 'c']" in detail


@pytest.mark.slow
def test_a_wrong_password_or_address_stops_the_node_at_start(cluster):
    detail = multihost.bad_start(cluster)
    assert "refuses the password" in detail and "not an address of this machine" in detail
