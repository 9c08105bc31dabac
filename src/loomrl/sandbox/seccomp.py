"""A seccomp-BPF deny-list for ``bwrap --seccomp FD``, assembled here without libseccomp.

The filter kills the process on a foreign architecture (no x32/i386 tricks), returns
``EPERM`` for system calls a sandbox never needs (mount, ptrace, kernel modules, keyrings,
bpf, perf, io_uring, namespace creation ...), ``ENOSYS`` for ``clone3`` (so libc falls back
to ``clone``, whose flags the filter can inspect) and rejects ``clone`` with any
``CLONE_NEW*`` flag. Only x86_64 is supported; elsewhere ``build_filter`` returns ``None``
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
SYS_CLONE, SYS_CLONE3 = 56, 435

# name -> x86_64 number. Calls an unprivileged sandboxed program has no business making.
DENIED_SYSCALLS_X86_64: dict[str, int] = {
    "ptrace": 101, "syslog": 103, "iopl": 172, "ioperm": 173, "personality": 135,
    "pivot_root": 155, "adjtimex": 159, "chroot": 161, "acct": 163, "settimeofday": 164,
    "mount": 165, "umount2": 166, "swapon": 167, "swapoff": 168, "reboot": 169,
    "sethostname": 170, "setdomainname": 171, "init_module": 175, "delete_module": 176,
    "quotactl": 179, "lookup_dcookie": 212, "clock_settime": 227, "kexec_load": 246,
    "add_key": 248, "request_key": 249, "keyctl": 250, "unshare": 272,
    "perf_event_open": 298, "fanotify_init": 300, "name_to_handle_at": 303,
    "open_by_handle_at": 304, "clock_adjtime": 305, "setns": 308, "process_vm_readv": 310,
    "process_vm_writev": 311, "kcmp": 312, "finit_module": 313, "kexec_file_load": 320,
    "bpf": 321, "userfaultfd": 323, "io_uring_setup": 425, "io_uring_enter": 426,
    "io_uring_register": 427, "open_tree": 428, "move_mount": 429, "fsopen": 430,
    "fsconfig": 431, "fsmount": 432, "fspick": 433, "mount_setattr": 442,
}  # fmt: skip


def _insn(code: int, jt: int, jf: int, k: int) -> bytes:
    return struct.pack("=HBBI", code, jt, jf, k)


def build_filter() -> bytes | None:
    """The BPF program as bytes (``struct sock_filter[]``), or None on unsupported machines."""
    if platform.machine() != "x86_64":
        return None
    denied = sorted(DENIED_SYSCALLS_X86_64.values())
    # Layout: header (5) | clone check (3) | clone3 (1) | deny list (n) | allow, eperm, enosys
    n = len(denied)
    allow = 9 + n
    eperm, enosys = allow + 1, allow + 2

    def jump(src: int, dst: int) -> int:
        offset = dst - (src + 1)
        assert 0 <= offset < 256, "seccomp jump out of range"
        return offset

    prog = [
        _insn(LD_W_ABS, 0, 0, 4),  # 0: arch
        _insn(JEQ_K, 1, 0, AUDIT_ARCH_X86_64),  # 1
        _insn(RET_K, 0, 0, RET_KILL_PROCESS),  # 2
        _insn(LD_W_ABS, 0, 0, 0),  # 3: nr
        _insn(JGE_K, jump(4, eperm), 0, X32_SYSCALL_BIT),  # 4
        _insn(JEQ_K, 0, jump(5, 8), SYS_CLONE),  # 5
        _insn(LD_W_ABS, 0, 0, 16),  # 6: clone flags (low 32 bits of args[0])
        _insn(JSET_K, jump(7, eperm), jump(7, allow), CLONE_NEW_FLAGS),  # 7
        _insn(JEQ_K, jump(8, enosys), 0, SYS_CLONE3),  # 8
    ]
    for i, nr in enumerate(denied):
        pos = 9 + i
        prog.append(_insn(JEQ_K, jump(pos, eperm), 0, nr))
    prog += [
        _insn(RET_K, 0, 0, RET_ALLOW),
        _insn(RET_K, 0, 0, RET_ERRNO | errno.EPERM),
        _insn(RET_K, 0, 0, RET_ERRNO | errno.ENOSYS),
    ]
    return b"".join(prog)
