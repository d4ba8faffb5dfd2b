# The arm64 check's emulated boards: qemu's binfmt handler, cached Debian arm64 roots, and commands run inside them.
"""Everything here runs as root on an x86 host: binfmt_misc gets qemu-aarch64 registered (with the F flag, so a
chroot needs no qemu binary inside), `debootstrap` builds a minimal Debian arm64 root per release once, cached
outside the clone under CACHE/<release>-<hash of its package list>, and each command runs in a private mount
namespace (`unshare -m`) that mounts /proc, /sys, /dev and the work folder (and any shared one) into the root and binds an ARM
/proc/cpuinfo with the board's CPU part over qemu's (which would show the host's x86 one), so nothing leaks when the
command ends or dies."""

from __future__ import annotations

import hashlib
import os
import shlex
import shutil
import ssl
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

CACHE = Path(os.environ.get("EDGE_FAL_ARM64_CACHE", "/var/cache/edge-fal-arm64"))
MIRROR = "http://deb.debian.org/debian"
PACKAGES = ("python3", "python3-venv", "ca-certificates")
BINFMT = Path("/proc/sys/fs/binfmt_misc")
QEMU_CONF = Path("/usr/lib/binfmt.d/qemu-aarch64.conf")
CA_INSIDE = "/etc/ssl/certs/ca-certificates.crt"
DEBOOTSTRAP_ATTEMPTS = 2
PATH_INSIDE = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


class Died(Exception):
    """Something the check ran failed: the one line that says which board, release or step, and what."""


@dataclass(frozen=True)
class Board:
    """A board the check emulates: qemu's CPU model, the boards built on that core, its /proc/cpuinfo CPU part."""

    cpu: str
    boards: str
    part: str

    @property
    def name(self) -> str:
        """How the verdict names it, e.g. 'cortex-a53 (Pi Zero 2 W / Pi 3)'."""
        return f"{self.cpu} ({self.boards})"

    def cpuinfo(self, cores: int = 4) -> str:
        """An ARM /proc/cpuinfo of `cores` cores of this CPU part, as the board's kernel writes it."""
        core = (
            "BogoMIPS\t: 108.00\nFeatures\t: fp asimd evtstrm crc32 cpuid\nCPU implementer\t: 0x41\n"
            f"CPU architecture: 8\nCPU variant\t: 0x0\nCPU part\t: {self.part}\nCPU revision\t: 4\n"
        )
        return "".join(f"processor\t: {number}\n{core}\n" for number in range(cores))


BOARDS = (Board("cortex-a53", "Pi Zero 2 W / Pi 3", "0xd03"), Board("cortex-a72", "Pi 4", "0xd08"))
RELEASES = {"bookworm": "3.11", "trixie": "3.13"}


def binfmt_problem() -> str | None:
    """Registers qemu-aarch64 with binfmt_misc (mounting it first if needed); None when arm64 programs can run, else
    why they cannot (the check then skips)."""
    if not (BINFMT / "status").exists():
        mounted = subprocess.run(["mount", "-t", "binfmt_misc", "binfmt_misc", str(BINFMT)], capture_output=True)
        if mounted.returncode != 0 or not (BINFMT / "status").exists():
            return "binfmt_misc is not available and cannot be mounted"
    if (BINFMT / "status").read_text().strip() != "enabled":
        return "binfmt_misc is disabled"
    if not (BINFMT / "qemu-aarch64").exists():
        if not QEMU_CONF.exists():
            return f"{QEMU_CONF} is missing (qemu-user-static is not installed)"
        line = QEMU_CONF.read_text().strip()
        flags = line.rsplit(":", 1)[1]
        line = line if "F" in flags else line + "F"  # F: the interpreter is opened now, so chroots need no copy
        try:
            (BINFMT / "register").write_text(line)
        except OSError as error:
            return f"qemu-aarch64 cannot be registered with binfmt_misc ({error.strerror})"
    return None


def host_ca_bundle() -> Path:
    """The certificates this host trusts (a proxy's too, where one inspects TLS): pip inside trusts the same."""
    return Path(os.environ.get("SSL_CERT_FILE") or ssl.get_default_verify_paths().cafile or CA_INSIDE)


def root_key(release: str) -> str:
    """The cache key of a release's root: the release and a hash of what it is built from."""
    recipe = "\n".join([release, MIRROR, *PACKAGES]).encode()
    return f"{release}-{hashlib.sha256(recipe).hexdigest()[:12]}"


def ensure_root(release: str, log: Path) -> tuple[Path, float]:
    """The release's arm64 root under CACHE, built by debootstrap when not cached (into a temporary folder renamed
    when complete, so a killed build leaves nothing half-made behind its key); returns it and the seconds spent."""
    root = CACHE / root_key(release)
    if (root / ".complete").exists():
        return root, 0.0
    started = time.monotonic()
    building = CACHE / f".{root.name}.building"
    CACHE.mkdir(parents=True, exist_ok=True)
    command = [
        *("nice", "-n", "10", "debootstrap", "--arch=arm64", "--variant=minbase", f"--include={','.join(PACKAGES)}"),
        *(release, str(building), MIRROR),
    ]
    for _ in range(DEBOOTSTRAP_ATTEMPTS):  # a dropped download is the likely failure: try again from scratch
        shutil.rmtree(building, ignore_errors=True)
        with open(log, "ab") as stream:
            if subprocess.run(command, stdout=stream, stderr=subprocess.STDOUT).returncode == 0:
                break
    else:
        raise Died(f"{release}: debootstrap failed {DEBOOTSTRAP_ATTEMPTS} times (see {log})")
    (building / ".complete").write_text(root.name + "\n")
    shutil.rmtree(root, ignore_errors=True)
    building.rename(root)
    for stale in CACHE.glob(f"{release}-*"):
        if stale != root:
            shutil.rmtree(stale, ignore_errors=True)
    return root, time.monotonic() - started


@dataclass(frozen=True)
class Emulated:
    """One emulated board running one release's root: runs commands inside it with its CPU pinned."""

    root: Path
    board: Board
    work: Path
    shared: tuple[Path, ...] = ()

    def command(self, argv: list[str], env: dict[str, str] | None = None) -> list[str]:
        """The host command that runs argv in the root on this board: a private mount namespace with /proc (and
        the board's cpuinfo over it), /sys, /dev, the work and shared folders at their own paths, then chroot."""
        cpuinfo = self.work / f"cpuinfo-{self.board.cpu}"
        cpuinfo.write_text(self.board.cpuinfo())
        inside = {"PATH": PATH_INSIDE, "HOME": "/root", "LANG": "C.UTF-8", "QEMU_CPU": self.board.cpu}
        inside |= {"PIP_CERT": CA_INSIDE, "SSL_CERT_FILE": CA_INSIDE, **(env or {})}
        mounts = [
            f"mount -t proc proc {self.root}/proc",
            f"mount --bind {cpuinfo} {self.root}/proc/cpuinfo",
            f"mount -t sysfs sysfs {self.root}/sys",
            f"mount --bind {host_ca_bundle()} {self.root}{CA_INSIDE}",
            f"mount --rbind /dev {self.root}/dev",
            *(
                f"mkdir -p {self.root}{path} && mount --bind {path} {self.root}{path}"
                for path in (self.work, *self.shared)
            ),
        ]
        run = shlex.join(
            ["exec", "chroot", str(self.root), "env", "-i", *(f"{k}={v}" for k, v in inside.items()), *argv]
        )
        return ["unshare", "--mount", "--propagation", "private", "sh", "-ec", "; ".join([*mounts, run])]

    def run(
        self, argv: list[str], log: Path, env: dict[str, str] | None = None, timeout: float = 900
    ) -> subprocess.CompletedProcess[str]:
        """Runs argv inside (nice 10): its stdout returned, its stderr appended to `log`; Died past `timeout`."""
        with open(log, "a") as stream:
            try:
                return subprocess.run(
                    ["nice", "-n", "10", *self.command(argv, env)],
                    stdout=subprocess.PIPE,
                    stderr=stream,
                    text=True,
                    timeout=timeout,
                )
            except subprocess.TimeoutExpired:
                raise Died(f"{self.board.name}: {shlex.join(argv)[:120]} ran over {timeout:.0f}s") from None

    def start(self, argv: list[str], log: Path, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        """Starts argv inside (nice 10), its output appended to `log`."""
        with open(log, "ab") as stream:
            return subprocess.Popen(
                ["nice", "-n", "10", *self.command(argv, env)], stdout=stream, stderr=subprocess.STDOUT
            )
