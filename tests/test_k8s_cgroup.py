"""A process's pod from its /proc/<pid>/cgroup (fixture files of every runtime/driver/cgroup-version form), and
the pod manager's cgroup authorizer built on it."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from gemini.k8s.cgroup import CgroupAuthorizer, CgroupError, parse_proc_cgroup, read_proc_cgroup

FIXTURES = Path(__file__).parent / "k8s_fixtures" / "cgroup"
UID = "5f0c2a1e-8d3b-4c7a-9e21-0b6d4f3a7c19"
OTHER_UID = "9a1b2c3d-4e5f-4a6b-8c7d-0e1f2a3b4c5d"
CID = "3c9f1e0b7a2d4e6f8a1b2c3d4e5f60718293a4b5c6d7e8f90a1b2c3d4e5f6071"

IN_POD = {
    "v2-systemd-containerd.txt": CID,
    "v2-systemd-crio.txt": CID,
    "v2-cgroupfs-containerd-guaranteed.txt": CID,
    "v2-cgroupfs-crio.txt": CID,
    "v2-systemd-other-cgroupns.txt": CID,
    "v2-systemd-cgroup-root-kind.txt": CID,
    "v1-cgroupfs-containerd.txt": CID,
    "v1-systemd-crio.txt": CID,
    "v2-systemd-crio-conmon.txt": None,      # CRI-O's monitor sits in the pod's cgroup, in no container
}


def text(name: str) -> str:
    return (FIXTURES / name).read_text()


@pytest.mark.parametrize("name", sorted(IN_POD))
def test_every_runtime_and_driver_form_names_the_pod(name):
    ident = parse_proc_cgroup(text(name))
    assert ident is not None, name
    assert ident.pod_uid == UID, name       # systemd slices spell the UID with underscores: given back with dashes
    assert ident.container_id == IN_POD[name], name


def test_static_pod_uid_without_dashes():
    ident = parse_proc_cgroup(text("v2-cgroupfs-static-pod.txt"))
    assert ident is not None and ident.pod_uid == "0123456789abcdef0123456789abcdef"


@pytest.mark.parametrize("name", ["none-user-session.txt", "none-system-service.txt", "none-root.txt",
                                  "none-decoy-pod-outside-kubepods.txt"])
def test_processes_outside_pods_have_no_pod(name):
    assert parse_proc_cgroup(text(name)) is None


def test_a_file_naming_two_pods_is_an_error():
    with pytest.raises(CgroupError, match="two pods"):
        parse_proc_cgroup(text("bad-two-pods.txt"))


def test_a_malformed_file_is_an_error():
    with pytest.raises(CgroupError, match="line 1"):
        parse_proc_cgroup(text("bad-malformed.txt"))


def test_read_proc_cgroup_reads_a_proc_tree(tmp_path):
    (tmp_path / "4242").mkdir()
    (tmp_path / "4242" / "cgroup").write_text(text("v2-systemd-containerd.txt"))
    assert parse_proc_cgroup(read_proc_cgroup(4242, tmp_path)).pod_uid == UID
    with pytest.raises(CgroupError, match="cannot read"):
        read_proc_cgroup(4343, tmp_path)


def test_own_process_is_read_from_the_real_proc():
    # This machine's own cgroup parses (whatever it is: in a pod or not), so the reader works on a real kernel.
    import os
    parse_proc_cgroup(read_proc_cgroup(os.getpid()))


# --- the authorizer -----------------------------------------------------------------------------------------------

@dataclass
class Creds:
    pid: int
    uid: int = 1000
    gid: int = 1000


def authorizer_over(files: dict[int, str], pod_uid: str = UID) -> CgroupAuthorizer:
    def read(pid: int) -> str:
        if pid not in files:
            raise CgroupError(f"cannot read /proc/{pid}/cgroup: No such file or directory")
        return text(files[pid])
    return CgroupAuthorizer(pod_uid, "team-a/train", read_cgroup=read)


def test_authorizer_admits_only_its_own_pod_whatever_the_hello_says():
    auth = authorizer_over({10: "v2-systemd-containerd.txt", 11: "bad-two-pods.txt",
                            12: "none-user-session.txt", 13: "v1-systemd-crio.txt"})
    assert auth.authorize(Creds(10), "anything") is None
    assert auth.authorize(Creds(13), "anything") is None
    # the same process is refused by the group of another pod, even when it names that group
    other = authorizer_over({10: "v2-systemd-containerd.txt"}, pod_uid=OTHER_UID)
    refusal = other.authorize(Creds(10), "alloc-of-the-other-pod")
    assert refusal is not None and "another pod" in refusal and UID in refusal
    assert "two pods" in auth.authorize(Creds(11), "x")
    assert "not in a Kubernetes pod" in auth.authorize(Creds(12), "x")
    assert "cannot tell the pod" in auth.authorize(Creds(99), "x")       # gone before it could be read
    assert "hostPID" in auth.authorize(Creds(0), "x")                    # SO_PEERCRED could not map the pid


def test_authorizer_accepts_the_uid_in_systemd_spelling():
    # a UID handed over with underscores (as read off a slice name) still means the same pod
    auth = authorizer_over({10: "v2-cgroupfs-crio.txt"}, pod_uid=UID.replace("-", "_").upper())
    assert auth.authorize(Creds(10), "g") is None
