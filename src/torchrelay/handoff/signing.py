"""Bundle authenticity: the bundle digest (SHA-256 of SHA256SUMS) and an SSH signature of SHA256SUMS.

SHA256SUMS proves every other byte of a bundle, so whoever knows its digest, or trusts the key that signed it,
knows the whole bundle. Signatures use `ssh-keygen -Y sign/verify` (OpenSSH >= 8.2): keys people already have,
an allowed-signers file they already know from git. ssh-keygen only ever reads bytes we hand it (SHA256SUMS on
stdin, the signature copied to a private temporary file); it never runs inside a bundle.
"""

from __future__ import annotations

import hashlib
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

from torchrelay.errors import ConfigError, IntegrityError
from torchrelay.paths.layout import SIG_FILE

NAMESPACE = "torchrelay-bundle"  # ssh-keygen -n: a signature made for anything else never verifies here
SIG_NAME = SIG_FILE  # the name lives in paths/layout.py
SIG_LIMIT = 64 << 10  # an SSH signature is a few hundred bytes
_HEX64 = re.compile(r"^[0-9a-f]{64}$")


def bundle_digest(sums: bytes) -> str:
    """The bundle digest: SHA-256 of the exact bytes of SHA256SUMS, as 64 hex digits."""
    return hashlib.sha256(sums).hexdigest()


def parse_digest(text: str) -> str:
    """A digest as a user types it (`sha256:HEX` or `HEX`, any case), or ConfigError."""
    value = text.strip().lower().removeprefix("sha256:")
    if not _HEX64.match(value):
        raise ConfigError(
            f"--expect {text!r} is not a bundle digest (64 hex digits, optionally prefixed sha256:)",
            hint="copy the BUNDLE_DIGEST line `torchrelay pack` printed",
        )
    return value


def _ssh_keygen() -> str:
    found = shutil.which("ssh-keygen")
    if found is None:
        raise ConfigError(
            "ssh-keygen is not installed; bundle signatures need it",
            hint="install OpenSSH's client (Debian/Ubuntu: apt-get install openssh-client)",
        )
    return found


def _run(args: list[str], data: bytes, cwd: str) -> subprocess.CompletedProcess[bytes]:
    try:
        return subprocess.run(args, input=data, capture_output=True, cwd=cwd, timeout=120, check=False)
    except subprocess.TimeoutExpired:
        raise ConfigError(f"{' '.join(args[:3])} did not answer within 120 s") from None


def check_key(key: Path) -> None:
    """Refuse at once (before a pack copies anything) a key file that is missing, or no ssh-keygen."""
    if not Path(key).is_file():
        raise ConfigError(
            f"--sign {key}: no such key file", hint="pass a private key, e.g. ~/.ssh/id_ed25519"
        )
    _ssh_keygen()


def sign(sums: bytes, key: Path) -> bytes:
    """An SSH signature of `sums` (namespace NAMESPACE) made with `key` (a private key, or a public key whose
    private half an ssh-agent holds)."""
    check_key(key)
    with tempfile.TemporaryDirectory(prefix="torchrelay-sign-") as work:
        out = _run([_ssh_keygen(), "-Y", "sign", "-q", "-f", str(key), "-n", NAMESPACE], sums, work)
    if out.returncode != 0 or not out.stdout.startswith(b"-----BEGIN SSH SIGNATURE-----"):
        raise ConfigError(
            f"ssh-keygen could not sign with {key}: {out.stderr.decode(errors='replace').strip()[:300]}",
            hint="is it a private key (or loaded in ssh-agent), and its passphrase given?",
        )
    return out.stdout


def verify_signature(sums: bytes, signature: bytes, allowed_signers: Path, *, source: str) -> str:
    """The principal of `allowed_signers` whose key signed `sums` in our namespace; IntegrityError otherwise."""
    if not Path(allowed_signers).is_file():
        raise ConfigError(
            f"--allowed-signers {allowed_signers}: no such file",
            hint='one line per trusted key: `NAME namespaces="torchrelay-bundle" ssh-ed25519 AAAA...`',
        )
    keygen = _ssh_keygen()
    with tempfile.TemporaryDirectory(prefix="torchrelay-verify-") as work:
        sig = Path(work) / SIG_NAME
        sig.write_bytes(signature)
        allowed = str(Path(allowed_signers).resolve())
        found = _run([keygen, "-Y", "find-principals", "-s", str(sig), "-f", allowed], b"", work)
        principals = (
            [p for p in found.stdout.decode(errors="replace").split() if p] if found.returncode == 0 else []
        )
        if not principals:
            raise IntegrityError(
                f"{source}: not signed by any key in {allowed_signers}",
                hint="the bundle was signed by someone else, or altered; get it again from its packer",
            )
        for principal in principals:
            args = [keygen, "-Y", "verify", "-f", allowed, "-I", principal, "-n", NAMESPACE, "-s", str(sig)]
            if _run(args, sums, work).returncode == 0:
                return principal
    raise IntegrityError(
        f"{source}: the signature of {', '.join(principals)} does not match SHA256SUMS",
        hint="SHA256SUMS was changed after it was signed; the bundle is not the one that was packed",
    )
