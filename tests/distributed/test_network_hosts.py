"""Ranks on separate hosts: two network namespaces joined by a veth pair stand for two machines.
Rank 0 runs in one, rank 1 in the other, with MASTER_ADDR at rank 0's veth address and
GLOO_SOCKET_IFNAME naming each host's interface; the job gives the parameters of a loopback
run. Then the faults, one case each: the link taken down mid-training (both ranks exit within
the collective timeout plus a few seconds, naming the lost peer; the newest checkpoint stays
valid and resumes to the uninterrupted parameters), delay and loss with netem where the kernel
has it (the job finishes; the step-time cost is printed), and rank 0's host unreachable during
the rendezvous (rank 1 says so within the rendezvous timeout). Every address lives inside the
two namespaces, and every run is bounded in time. Skipped, with the reason, where namespaces
cannot be made (not root, or the kernel refuses them)."""
import json
import os
import pathlib
import subprocess
import time

import pytest

from run_files import digest, steps_written

BIN = pathlib.Path(os.environ.get("XPM_BIN_DIR", "build/bin"))
DATA = os.environ.get("XPM_DATA_DIR", "data/brown")
WORK = pathlib.Path(os.environ.get("XPM_WORK_DIR", "/tmp")) / "xpm_network_hosts"
STEPS = 24
COLLECTIVE_TIMEOUT_S = 8
RENDEZVOUS_TIMEOUT_S = 6
LONG_RENDEZVOUS_TIMEOUT_S = 300  # a failing rank must not wait for the store this long
PORT = 29611  # inside rank 0's namespace: no other process there can hold it
SUBNET = "10.213.7"


def ip(*args, check=True):
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


class Hosts:
    """Two namespaces, host0 (10.213.7.1 on xpm0) and host1 (10.213.7.2 on xpm1), one veth pair."""

    def __init__(self):
        tag = str(os.getpid())
        self.names = [f"xpm-host0-{tag}", f"xpm-host1-{tag}"]
        self.interfaces = ["xpm0", "xpm1"]
        self.addresses = [f"{SUBNET}.1", f"{SUBNET}.2"]
        ends = [f"xpv{tag[-8:]}a", f"xpv{tag[-8:]}b"]
        for name in self.names:
            ip("netns", "add", name)
        ip("link", "add", ends[0], "type", "veth", "peer", "name", ends[1])
        for name, end, interface, address in zip(self.names, ends, self.interfaces, self.addresses):
            ip("link", "set", end, "netns", name)
            ip("-n", name, "link", "set", end, "name", interface)
            ip("-n", name, "addr", "add", f"{address}/30", "dev", interface)
            ip("-n", name, "link", "set", interface, "up")
            ip("-n", name, "link", "set", "lo", "up")

    def link(self, host, state):
        ip("-n", self.names[host], "link", "set", self.interfaces[host], state)

    def remove(self):
        for name in self.names:
            ip("netns", "del", name, check=False)


def namespaces_refused():
    """Why namespaces cannot be made here, or None."""
    if os.geteuid() != 0:
        return "not root: creating network namespaces needs CAP_SYS_ADMIN"
    probe = f"xpm-probe-{os.getpid()}"
    try:
        made = ip("netns", "add", probe, check=False)
    except FileNotFoundError:
        return "no 'ip' command (Debian package iproute2)"
    if made.returncode != 0:
        return "the kernel refused a network namespace: " + made.stderr.strip()
    ip("netns", "del", probe, check=False)
    return None


@pytest.fixture(scope="module")
def hosts():
    reason = namespaces_refused()
    if reason:
        pytest.skip("network namespaces unavailable, the separate-host cases are skipped: " + reason)
    made = Hosts()
    yield made
    made.remove()


def train_arguments(run_dir, *extra, rendezvous_timeout_s=LONG_RENDEZVOUS_TIMEOUT_S):
    return [str(BIN / "xpm-train"), "--data-dir", DATA, "--run-dir", str(run_dir), "--max-steps", str(STEPS),
            "--outer-batch-size", "16", "--threads", "1", "--memory-cap-factor", "2.0", "--dropout", "0",
            "--max-validation-sentences", "100", "--validate-every", "8", "--warmup-steps", "2",
            "--checkpoint-every-steps", "4", "--collective-timeout-s", str(COLLECTIVE_TIMEOUT_S),
            "--rendezvous-timeout-s", str(rendezvous_timeout_s),
            "--memory-model-cache", str(WORK / "cache"), "--quiet", *extra]


def start_ranks(hosts, run_dir, *extra, rendezvous_timeout_s=LONG_RENDEZVOUS_TIMEOUT_S):
    """Rank 0 on host0, rank 1 on host1; returns the two processes."""
    processes = []
    for rank in (0, 1):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                   MASTER_ADDR=hosts.addresses[0], MASTER_PORT=str(PORT),
                   GLOO_SOCKET_IFNAME=hosts.interfaces[rank])
        arguments = train_arguments(run_dir, *extra, rendezvous_timeout_s=rendezvous_timeout_s)
        processes.append(subprocess.Popen(["ip", "netns", "exec", hosts.names[rank], *arguments], env=env,
                                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
    return processes


def finish(processes, timeout_s=300):
    """(exit codes, stderr texts, seconds until the last exited)."""
    started = time.monotonic()
    codes, errors = [], []
    for process in processes:
        try:
            _, err = process.communicate(timeout=max(1, timeout_s - (time.monotonic() - started)))
        except subprocess.TimeoutExpired:
            for other in processes:
                other.kill()
            pytest.fail("a rank still ran after %d s: it hangs" % timeout_s)
        codes.append(process.returncode)
        errors.append(err)
    return codes, errors, time.monotonic() - started


def fresh(name):
    run_dir = WORK / name
    subprocess.run(["rm", "-rf", str(run_dir)], check=True)
    return run_dir


@pytest.fixture(scope="module")
def loopback(remove_when_module_passed):
    """final_parameters.pt of the same job at --nproc 2 on loopback, and its train_s."""
    WORK.mkdir(parents=True, exist_ok=True)
    run_dir = remove_when_module_passed(fresh("loopback"))
    done = subprocess.run(train_arguments(run_dir, "--nproc", "2"), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return digest(run_dir / "final_parameters.pt"), json.loads((run_dir / "summary.json").read_text())


def test_ranks_on_two_hosts_train_like_loopback(hosts, loopback, remove_when_passed):
    run_dir = remove_when_passed(fresh("two-hosts"))
    codes, errors, _ = finish(start_ranks(hosts, run_dir))
    assert codes == [0, 0], errors
    summary = json.loads((run_dir / "summary.json").read_text())
    print(f"two hosts: {summary['train_s'] / STEPS * 1000:.1f} ms per step, loopback "
          f"{loopback[1]['train_s'] / STEPS * 1000:.1f} ms")
    assert summary["world_size"] == 2 and summary["finished"] is True
    assert digest(run_dir / "final_parameters.pt") == loopback[0]


def test_a_cut_link_ends_both_ranks_within_the_collective_timeout(hosts, loopback, remove_when_passed):
    run_dir = remove_when_passed(fresh("cut-link"))
    processes = start_ranks(hosts, run_dir)
    deadline = time.monotonic() + 240
    while steps_written(run_dir) < 6:
        assert all(p.poll() is None for p in processes), [p.stderr.read() for p in processes]
        assert time.monotonic() < deadline, "the job did not reach step 6"
        time.sleep(0.05)
    hosts.link(1, "down")
    cut = time.monotonic()
    try:
        codes, errors, _ = finish(processes, timeout_s=COLLECTIVE_TIMEOUT_S + 60)
    finally:
        hosts.link(1, "up")
    detect_s = time.monotonic() - cut
    print(f"cut link: both ranks exited {detect_s:.1f} s after the cut (collective timeout {COLLECTIVE_TIMEOUT_S} s)")
    for err in errors:
        print("  " + next((line for line in err.splitlines() if "error:" in line), "(no error line)"))
    assert codes[0] != 0 and codes[1] != 0, errors
    assert detect_s < COLLECTIVE_TIMEOUT_S + 15, errors
    assert "rank 1" in errors[0], errors[0]  # rank 0 names the peer it lost
    assert "rank 0" in errors[1], errors[1]
    # The newest checkpoint is whole: the two hosts resume from it to the uninterrupted result.
    codes, errors, _ = finish(start_ranks(hosts, run_dir, "--resume"))
    assert codes == [0, 0], errors
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["resumed_from_step"] >= 4
    assert digest(run_dir / "final_parameters.pt") == loopback[0]


def netem_refused(hosts):
    for host in (0, 1):
        added = subprocess.run(["ip", "netns", "exec", hosts.names[host], "tc", "qdisc", "add", "dev",
                                hosts.interfaces[host], "root", "netem", "delay", "5ms", "1ms", "loss", "1%"],
                               capture_output=True, text=True, timeout=30)
        if added.returncode != 0:
            return added.stderr.strip() or "tc failed"
    return None


def test_delay_and_loss_slow_the_job_but_it_finishes(hosts, loopback, remove_when_passed):
    reason = netem_refused(hosts)
    if reason:
        pytest.skip("tc netem is not available in this kernel (" + reason + "): the delay and loss case is skipped")
    try:
        run_dir = remove_when_passed(fresh("netem"))
        codes, errors, _ = finish(start_ranks(hosts, run_dir))
    finally:
        for host in (0, 1):
            subprocess.run(["ip", "netns", "exec", hosts.names[host], "tc", "qdisc", "del", "dev",
                            hosts.interfaces[host], "root"], capture_output=True, timeout=30)
    assert codes == [0, 0], errors
    summary = json.loads((run_dir / "summary.json").read_text())
    print(f"netem 5 ms +- 1 ms, 1 % loss each way: {summary['train_s'] / STEPS * 1000:.1f} ms per step vs "
          f"{loopback[1]['train_s'] / STEPS * 1000:.1f} ms on loopback")
    assert digest(run_dir / "final_parameters.pt") == loopback[0]


def test_rank_0_host_lost_during_rendezvous_is_reported_within_the_rendezvous_timeout(hosts, remove_when_passed):
    run_dir = remove_when_passed(fresh("no-rendezvous"))
    hosts.link(0, "down")
    try:
        codes, errors, elapsed_s = finish(start_ranks(hosts, run_dir, rendezvous_timeout_s=RENDEZVOUS_TIMEOUT_S),
                                         timeout_s=RENDEZVOUS_TIMEOUT_S + 60)
    finally:
        hosts.link(0, "up")
    print(f"rank 0's host unreachable: both ranks exited after {elapsed_s:.1f} s "
          f"(rendezvous timeout {RENDEZVOUS_TIMEOUT_S} s)")
    for err in errors:
        print("  " + next((line for line in err.splitlines() if "error:" in line), "(no error line)"))
    assert codes[0] != 0 and codes[1] != 0, errors
    assert elapsed_s < RENDEZVOUS_TIMEOUT_S + 15, errors
    assert f"rendezvous at {hosts.addresses[0]}:{PORT} failed" in errors[1], errors[1]
