"""Run one model-written shell command confined to a directory (Linux only).

    python sandbox.py [limits] DIR -- bash -c COMMAND

Run it as the leader of a new session and kill that process group on timeout (``tools.run_confined`` does).
Before it execs the command, this process stacks these layers on itself:

1. Namespaces: a new network namespace (only a loopback that is down), and a new PID namespace whose first
   process is the command, so that when it dies the kernel kills everything it started, ``setsid`` or not.
2. Resource limits: CPU seconds, file size, address space, number of processes, no core dumps.
3. Privileges: no capabilities (emptied before exec; ``no_new_privs`` keeps exec from granting any). As
   root, the real uid becomes nobody (the kernel never applies RLIMIT_NPROC to real uid 0) while the
   effective uid stays 0, so the copy, owned by root and maybe under ``/root``, stays reachable.
4. Landlock: read + execute beneath the system directories, a few ``/etc`` files and ``/dev/null``;
   everything beneath DIR; nothing else. With ABI >= 4 no TCP bind/connect; with ABI >= 6 no signals or
   abstract UNIX sockets out of the sandbox.
5. seccomp: ``socket`` and ``io_uring_setup`` fail (named UNIX sockets are outside Landlock's reach), and so
   do ``setreuid``/``setresuid`` (which could take the real uid back to 0).

Without Landlock it refuses (exit code 125), rather than run the command unconfined. Imports only the
standard library, and is run as a file, so that starting it does not import the package.
"""

import argparse
import ctypes
import errno
import os
import platform
import resource
import signal
import sys

REFUSED = 125
"""Exit code when the sandbox cannot be built: the command did not run."""
NOBODY = 65534

libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long

# --- Landlock (include/uapi/linux/landlock.h). The syscall numbers are the same on every architecture.
SYS_LANDLOCK_CREATE_RULESET, SYS_LANDLOCK_ADD_RULE, SYS_LANDLOCK_RESTRICT_SELF = 444, 445, 446
LANDLOCK_CREATE_RULESET_VERSION = 1 << 0
LANDLOCK_RULE_PATH_BENEATH = 1
# Filesystem rights, bit by bit: EXECUTE, WRITE_FILE, READ_FILE, READ_DIR, REMOVE_DIR, REMOVE_FILE, MAKE_CHAR,
# MAKE_DIR, MAKE_REG, MAKE_SOCK, MAKE_FIFO, MAKE_BLOCK, MAKE_SYM (ABI 1), REFER (ABI 2), TRUNCATE (ABI 3),
# IOCTL_DEV (ABI 5).
FS_EXECUTE, FS_WRITE_FILE, FS_READ_FILE, FS_READ_DIR = 1 << 0, 1 << 1, 1 << 2, 1 << 3
FS_TRUNCATE, FS_IOCTL_DEV = 1 << 14, 1 << 15
FS_FILE_RIGHTS = FS_EXECUTE | FS_WRITE_FILE | FS_READ_FILE | FS_TRUNCATE | FS_IOCTL_DEV
"""The only rights a rule on a single file (not a directory) may carry."""
NET_BIND_TCP, NET_CONNECT_TCP = 1 << 0, 1 << 1  # ABI 4
SCOPE_ABSTRACT_UNIX_SOCKET, SCOPE_SIGNAL = 1 << 0, 1 << 1  # ABI 6

READ_ONLY_TREES = ["/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"]
READ_ONLY_FILES = [
    "/etc/ld.so.cache",
    "/etc/ld.so.conf",
    "/etc/ld.so.conf.d",
    "/etc/localtime",
    "/etc/nsswitch.conf",
    "/etc/passwd",
    "/etc/group",
    "/dev/zero",
    "/dev/urandom",
    "/dev/random",
]


class RulesetAttr(ctypes.Structure):
    """struct landlock_ruleset_attr: ABI 1-3 read only the first field, ABI 4-5 the first two."""

    _fields_ = [
        ("handled_access_fs", ctypes.c_uint64),
        ("handled_access_net", ctypes.c_uint64),
        ("scoped", ctypes.c_uint64),
    ]


class PathBeneathAttr(ctypes.Structure):
    """struct landlock_path_beneath_attr, packed: 12 bytes."""

    _pack_ = 1
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


# --- seccomp (include/uapi/linux/seccomp.h, filter.h, audit.h).
PR_SET_NO_NEW_PRIVS, PR_SET_PDEATHSIG, PR_CAPBSET_DROP, PR_SET_SECCOMP = 38, 1, 24, 22
PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL = 47, 4
SECCOMP_MODE_FILTER = 2
SECCOMP_RET_ALLOW, SECCOMP_RET_ERRNO = 0x7FFF0000, 0x00050000
BPF_LD_W_ABS, BPF_JEQ_K, BPF_JGE_K, BPF_RET_K = 0x20, 0x15, 0x35, 0x06
X32_SYSCALL_BIT = 0x40000000
IO_URING_SETUP = 425  # same on every architecture
# platform.machine() -> (AUDIT_ARCH_*, socket, setreuid, setresuid)
SECCOMP_ARCHES = {"x86_64": (0xC000003E, 41, 113, 117), "aarch64": (0xC00000B7, 198, 145, 147)}


class SockFilter(ctypes.Structure):
    """struct sock_filter: one classic-BPF instruction."""

    _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8), ("k", ctypes.c_uint32)]


class SockFprog(ctypes.Structure):
    """struct sock_fprog: a BPF program."""

    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(SockFilter))]


# --- namespaces (include/uapi/linux/sched.h); capabilities (include/uapi/linux/capability.h).
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
LINUX_CAPABILITY_VERSION_3 = 0x20080522


class CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


class SandboxError(RuntimeError):
    """The sandbox could not be built, so the command must not run."""


def _check(result: int, what: str) -> int:
    if result < 0:
        code = ctypes.get_errno()
        raise SandboxError(f"{what}: {os.strerror(code)}")
    return result


def landlock_abi() -> int:
    """The kernel's Landlock ABI version; 0 when Landlock is missing or disabled."""
    version = libc.syscall(SYS_LANDLOCK_CREATE_RULESET, None, ctypes.c_size_t(0), LANDLOCK_CREATE_RULESET_VERSION)
    return max(0, version)


def enter_namespaces() -> bool:
    """Unshare the network and PID namespaces (through a user namespace when not root); False if impossible."""
    for flags in (CLONE_NEWNET | CLONE_NEWPID, CLONE_NEWUSER | CLONE_NEWNET | CLONE_NEWPID):
        if libc.unshare(flags) == 0:
            return True
    return False


def limit_resources(cpu_s: int, file_mb: int, memory_mb: int, max_processes: int) -> None:
    """Lower the RLIMITs. NPROC counts every task of the real uid, so it is set above today's total."""
    tasks_now = int(_read("/proc/loadavg").split()[3].split("/")[1])  # "0.5 0.4 0.3 RUNNING/TOTAL LAST_PID"
    limits = {
        resource.RLIMIT_CPU: cpu_s,
        resource.RLIMIT_FSIZE: file_mb << 20,
        resource.RLIMIT_AS: memory_mb << 20,
        resource.RLIMIT_NPROC: tasks_now + max_processes,
        resource.RLIMIT_CORE: 0,
    }
    for kind, value in limits.items():
        _, hard = resource.getrlimit(kind)
        value = value if hard == resource.RLIM_INFINITY else min(value, hard)
        resource.setrlimit(kind, (value, value))


def drop_privileges() -> None:
    """No capabilities now or after exec; as root, real uid nobody (see the module docstring)."""
    _check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(PR_SET_NO_NEW_PRIVS)")
    if _capabilities("CapEff"):  # root, or a new user namespace: empty the bounding set too
        for cap in range(int(_read("/proc/sys/kernel/cap_last_cap")) + 1):
            _check(libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0), f"prctl(PR_CAPBSET_DROP, {cap})")
    _check(libc.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0), "prctl(PR_CAP_AMBIENT_CLEAR_ALL)")
    if os.geteuid() == 0:
        os.setgroups([])
        os.setresuid(NOBODY, 0, 0)
    _check(libc.capset(ctypes.byref(CapHeader(LINUX_CAPABILITY_VERSION_3, 0)), (CapData * 2)()), "capset")
    held = {name: _capabilities(name) for name in ("CapEff", "CapPrm", "CapInh", "CapAmb")}
    if any(held.values()) or (os.geteuid() == 0 and _capabilities("CapBnd")):
        raise SandboxError(f"capabilities left after dropping them: {held}")


def _capabilities(name: str) -> int:
    """A capability mask of this process from /proc/self/status (``CapEff``, ``CapBnd``, ...)."""
    for line in _read("/proc/self/status").splitlines():
        if line.startswith(name + ":"):
            return int(line.split()[1], 16)
    raise SandboxError(f"/proc/self/status has no {name}")


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


def restrict_filesystem_and_network(root: str, abi: int) -> None:
    """Landlock: read-only system files, read-write ``root``, no TCP (ABI >= 4), scoped IPC (ABI >= 6)."""
    handled_fs = (1 << {1: 13, 2: 14, 3: 15, 4: 15}.get(abi, 16)) - 1
    attr = RulesetAttr(handled_access_fs=handled_fs)
    size = 8
    if abi >= 4:
        attr.handled_access_net, size = NET_BIND_TCP | NET_CONNECT_TCP, 16
    if abi >= 6:
        attr.scoped, size = SCOPE_ABSTRACT_UNIX_SOCKET | SCOPE_SIGNAL, 24
    ruleset = _check(
        libc.syscall(SYS_LANDLOCK_CREATE_RULESET, ctypes.byref(attr), ctypes.c_size_t(size), 0),
        "landlock_create_ruleset",
    )
    read = FS_EXECUTE | FS_READ_FILE | FS_READ_DIR
    rules = [(path, read) for path in READ_ONLY_TREES + READ_ONLY_FILES]
    rules += [("/dev/null", FS_READ_FILE | FS_WRITE_FILE | FS_TRUNCATE), (root, handled_fs)]
    for path, access in rules:
        try:
            fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
        except FileNotFoundError:
            continue
        if not os.path.isdir(path):
            access &= FS_FILE_RIGHTS
        rule = PathBeneathAttr(allowed_access=access & handled_fs, parent_fd=fd)
        _check(
            libc.syscall(SYS_LANDLOCK_ADD_RULE, ruleset, LANDLOCK_RULE_PATH_BENEATH, ctypes.byref(rule), 0),
            f"landlock_add_rule({path})",
        )
        os.close(fd)
    _check(libc.syscall(SYS_LANDLOCK_RESTRICT_SELF, ruleset, 0), "landlock_restrict_self")
    os.close(ruleset)


def deny_sockets_and_uid_changes() -> bool:
    """seccomp: the listed syscalls, and every syscall of a foreign ABI, fail with EACCES. False on an
    architecture this table does not know (the other layers still apply)."""
    if platform.machine() not in SECCOMP_ARCHES:
        return False
    arch, *denied = SECCOMP_ARCHES[platform.machine()]
    denied.append(IO_URING_SETUP)
    deny = SECCOMP_RET_ERRNO | errno.EACCES
    # Instruction i jumps jt/jf instructions forward from i + 1; the last instruction is the deny.
    program = [(BPF_LD_W_ABS, 0, 0, 4), (BPF_JEQ_K, 0, len(denied) + 3, arch)]  # seccomp_data.arch
    program += [(BPF_LD_W_ABS, 0, 0, 0), (BPF_JGE_K, len(denied) + 1, 0, X32_SYSCALL_BIT)]  # seccomp_data.nr
    program += [(BPF_JEQ_K, len(denied) - i, 0, nr) for i, nr in enumerate(denied)]
    program += [(BPF_RET_K, 0, 0, SECCOMP_RET_ALLOW), (BPF_RET_K, 0, 0, deny)]
    filters = (SockFilter * len(program))(*(SockFilter(*instruction) for instruction in program))
    fprog = SockFprog(len(program), filters)
    _check(libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(fprog), 0, 0), "prctl(PR_SET_SECCOMP)")
    return True


def scrubbed_environment(root: str) -> dict[str, str]:
    """The command's whole environment: no inherited variable (API keys) survives."""
    return {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "HOME": root,
        "TMPDIR": root,
        "PWD": root,
        "LANG": "C.UTF-8",
        "LC_ALL": "C.UTF-8",
        "TERM": "dumb",
        "PYTHONDONTWRITEBYTECODE": "1",
    }


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="sandbox.py", description=__doc__.splitlines()[0])
    parser.add_argument("--cpu-s", type=int, default=11, help="CPU seconds per process")
    parser.add_argument("--file-mb", type=int, default=16, help="largest file a process may write")
    parser.add_argument("--memory-mb", type=int, default=2048, help="address space per process")
    parser.add_argument("--max-processes", type=int, default=256, help="new processes allowed")
    parser.add_argument("root", help="the only directory the command may write, and its working directory")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- PROGRAM ARGS...")
    args = parser.parse_args(argv)
    if args.command[:1] == ["--"]:
        args.command = args.command[1:]
    if not args.command:
        parser.error("no command after DIR --")
    return args


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    root = os.path.realpath(args.root)
    abi = landlock_abi()
    if abi < 1:
        print("sandbox: Landlock is not available on this kernel; refusing to run the command", file=sys.stderr)
        return REFUSED
    os.chdir(root)
    if enter_namespaces():  # the next child is PID 1 of the new namespace: this process waits for it
        child = os.fork()
        if child:
            _, status = os.waitpid(child, 0)
            code = os.waitstatus_to_exitcode(status)
            return code if code >= 0 else 128 - code
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)  # if this waiting parent dies, so does the command
    try:
        limit_resources(args.cpu_s, args.file_mb, args.memory_mb, args.max_processes)
        drop_privileges()
        restrict_filesystem_and_network(root, abi)
        deny_sockets_and_uid_changes()
    except (SandboxError, OSError) as e:
        print(f"sandbox: {e}; refusing to run the command", file=sys.stderr)
        os._exit(REFUSED)
    try:
        os.execve(_which(args.command[0]), args.command, scrubbed_environment(root))
    except OSError as e:
        print(f"sandbox: cannot run {args.command[0]}: {e}", file=sys.stderr)
        os._exit(127)


def _which(program: str) -> str:
    if "/" in program:
        return program
    for directory in ("/usr/bin", "/bin"):
        if os.access(os.path.join(directory, program), os.X_OK):
            return os.path.join(directory, program)
    return program


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
