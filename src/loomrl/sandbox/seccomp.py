"""A seccomp-BPF deny-list for ``bwrap --seccomp FD``, assembled here without libseccomp.

The filter kills the process on a foreign architecture (no x32/i386 tricks), returns
``EPERM`` for system calls a sandbox never needs (mount, ptrace, kernel modules, keyrings,
bpf, perf, io_uring, namespace creation ...), ``ENOSYS`` for ``clone3`` (so libc falls back
to ``clone``, whose flags the filter can inspect), rejects ``clone`` with any
``CLONE_NEW*`` flag, and lets ``socket``/``socketpair`` create only an allow-list of
address families (unix, IPv4, IPv6, netlink route): ``AF_VSOCK``, ``AF_PACKET``,
``AF_ALG`` and the rest get ``EAFNOSUPPORT`` (vsock would reach the hypervisor whatever
the network namespace says). Only x86_64 is supported; elsewhere ``build_filter`` returns ``None``
and the caller logs that seccomp is skipped.
"""

from __future__ import annotations

import errno
import platform
import struct

AUDIT_ARCH_X86_64 = 0xC000003E
X32_SYSCALL_BIT = 0x40000000
RET_KILL_PROCESS = 0x80000000
RET_ALLOW = 0x7FFF0000
RET_ERRNO = 0x00050000
CLONE_NEW_FLAGS = 0x7E020000  # NEWNS|NEWCGROUP|NEWUTS|NEWIPC|NEWUSER|NEWPID|NEWNET

LD_W_ABS, JEQ_K, JGE_K, JSET_K, RET_K = 0x20, 0x15, 0x35, 0x45, 0x06
SYS_CLONE, SYS_CLONE3, SYS_SOCKET, SYS_SOCKETPAIR = 56, 435, 41, 53
ARG0_LOW, ARG2_LOW = 16, 32  # offsets of the low 32 bits of args[0] and args[2]
AF_UNIX, AF_INET, AF_INET6, AF_NETLINK = 1, 2, 10, 16
ALLOWED_SOCKET_FAMILIES = (AF_UNIX, AF_INET, AF_INET6)  # plus netlink route, checked apart

# name -> x86_64 number. Calls an unprivileged sandboxed program has no business making.
DENIED_SYSCALLS_X86_64: dict[str, int] = {
    "ptrace": 101,
    "syslog": 103,
    "iopl": 172,
    "ioperm": 173,
    "personality": 135,
    "pivot_root": 155,
    "adjtimex": 159,
    "chroot": 161,
    "acct": 163,
    "settimeofday": 164,
    "mount": 165,
    "umount2": 166,
    "swapon": 167,
    "swapoff": 168,
    "reboot": 169,
    "sethostname": 170,
    "setdomainname": 171,
    "init_module": 175,
    "delete_module": 176,
    "quotactl": 179,
    "lookup_dcookie": 212,
    "clock_settime": 227,
    "kexec_load": 246,
    "add_key": 248,
    "request_key": 249,
    "keyctl": 250,
    "unshare": 272,
    "perf_event_open": 298,
    "fanotify_init": 300,
    "name_to_handle_at": 303,
    "open_by_handle_at": 304,
    "clock_adjtime": 305,
    "setns": 308,
    "process_vm_readv": 310,
    "process_vm_writev": 311,
    "kcmp": 312,
    "finit_module": 313,
    "kexec_file_load": 320,
    "bpf": 321,
    "userfaultfd": 323,
    "io_uring_setup": 425,
    "io_uring_enter": 426,
    "io_uring_register": 427,
    "open_tree": 428,
    "move_mount": 429,
    "fsopen": 430,
    "fsconfig": 431,
    "fsmount": 432,
    "fspick": 433,
    "mount_setattr": 442,
    "mq_open": 240,  # POSIX message queues would outlive an exec (RLIMIT_MSGQUEUE=0 too)
}


def _insn(code: int, jt: int, jf: int, k: int) -> bytes:
    return struct.pack("=HBBI", code, jt, jf, k)


class _Program:
    """A tiny BPF assembler: forward jumps to named labels, resolved by ``assemble``."""

    def __init__(self) -> None:
        self.items: list[tuple] = []
        self.labels: dict[str, int] = {}

    def label(self, name: str) -> None:
        self.labels[name] = len(self.items)

    def load(self, offset: int) -> None:
        self.items.append((LD_W_ABS, None, None, offset))

    def jump(self, op: int, k: int, true: str | None, false: str | None = None) -> None:
        self.items.append((op, true, false, k))  # None: fall through to the next insn

    def ret(self, value: int) -> None:
        self.items.append((RET_K, None, None, value))

    def assemble(self) -> bytes:
        out = []
        for pos, (code, true, false, k) in enumerate(self.items):
            offsets = [0 if t is None else self.labels[t] - (pos + 1) for t in (true, false)]
            assert all(0 <= o < 256 for o in offsets), "seccomp jump out of range"
            out.append(_insn(code, offsets[0], offsets[1], k))
        return b"".join(out)


def build_filter() -> bytes | None:
    """The BPF program as bytes (``struct sock_filter[]``), or None on unsupported machines."""
    if platform.machine() != "x86_64":
        return None
    p = _Program()
    p.load(4)  # arch
    p.jump(JEQ_K, AUDIT_ARCH_X86_64, None, "kill")
    p.load(0)  # syscall number
    p.jump(JGE_K, X32_SYSCALL_BIT, "eperm")
    p.jump(JEQ_K, SYS_CLONE, "clone")
    p.jump(JEQ_K, SYS_CLONE3, "enosys")
    p.jump(JEQ_K, SYS_SOCKET, "socket")
    p.jump(JEQ_K, SYS_SOCKETPAIR, "socket")
    for nr in sorted(DENIED_SYSCALLS_X86_64.values()):
        p.jump(JEQ_K, nr, "eperm")
    p.ret(RET_ALLOW)  # BPF only jumps forward: the blocks below end in their own returns
    p.label("clone")
    p.load(ARG0_LOW)  # clone flags (low 32 bits of args[0])
    p.jump(JSET_K, CLONE_NEW_FLAGS, "eperm", "allow")
    p.label("socket")  # an allow-list of address families (args[0])
    p.load(ARG0_LOW)
    for family in ALLOWED_SOCKET_FAMILIES:
        p.jump(JEQ_K, family, "allow")
    p.jump(JEQ_K, AF_NETLINK, None, "eafnosupport")
    p.load(ARG2_LOW)  # netlink: only NETLINK_ROUTE (protocol 0), for getaddrinfo/ifaddrs
    p.jump(JEQ_K, 0, "allow", "eafnosupport")
    p.label("allow")
    p.ret(RET_ALLOW)
    p.label("kill")
    p.ret(RET_KILL_PROCESS)
    p.label("eperm")
    p.ret(RET_ERRNO | errno.EPERM)
    p.label("enosys")
    p.ret(RET_ERRNO | errno.ENOSYS)
    p.label("eafnosupport")
    p.ret(RET_ERRNO | errno.EAFNOSUPPORT)
    return p.assemble()
