"""Certificates and keys of the test control plane, made with the ``openssl`` command.

One certificate authority signs the API server's serving certificate (valid for 127.0.0.1 and
``localhost``) and one client certificate per component; the Kubernetes user of a client
certificate is its CN and its groups are its O fields (``system:masters`` is the superuser
group that the API server's RBAC bootstrap binds to ``cluster-admin``). A separate RSA key pair
signs and verifies service account tokens. Keys are ECDSA P-256 (fast to make), except the
service account key, which is RSA as most clusters use.
"""

from __future__ import annotations

import dataclasses
import pathlib
import subprocess

CA = "ca"
SERVICE_ACCOUNT_KEY = "sa"


@dataclasses.dataclass(frozen=True)
class ClientIdentity:
    """A client certificate's Kubernetes identity: ``user`` (CN) and ``groups`` (O)."""

    user: str
    groups: tuple[str, ...] = ()


def _openssl(*args: str, cwd: pathlib.Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def _subject(identity: ClientIdentity) -> str:
    return "".join(f"/O={group}" for group in identity.groups) + f"/CN={identity.user}"


def make_ca(directory: pathlib.Path) -> None:
    """Write ``ca.crt``/``ca.key`` (the cluster CA) and ``sa.key``/``sa.pub`` into ``directory``.

    Raises:
        subprocess.CalledProcessError: openssl failed.
    """
    directory.mkdir(parents=True, exist_ok=True)
    _openssl(
        "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
        "-keyout", f"{CA}.key", "-out", f"{CA}.crt", "-days", "3650",
        "-subj", "/CN=kvpilot-test-cluster-ca",
        cwd=directory,
    )  # fmt: skip
    _openssl("genrsa", "-out", f"{SERVICE_ACCOUNT_KEY}.key", "2048", cwd=directory)
    _openssl(
        "rsa", "-in", f"{SERVICE_ACCOUNT_KEY}.key", "-pubout", "-out", f"{SERVICE_ACCOUNT_KEY}.pub",
        cwd=directory,
    )  # fmt: skip


def _signed(
    directory: pathlib.Path, name: str, subject: str, extensions: list[str]
) -> tuple[pathlib.Path, pathlib.Path]:
    _openssl(
        "req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
        "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", subject,
        cwd=directory,
    )  # fmt: skip
    (directory / f"{name}.ext").write_text("\n".join(extensions) + "\n")
    _openssl(
        "x509", "-req", "-in", f"{name}.csr", "-CA", f"{CA}.crt", "-CAkey", f"{CA}.key",
        "-CAcreateserial", "-out", f"{name}.crt", "-days", "3650", "-extfile", f"{name}.ext",
        cwd=directory,
    )  # fmt: skip
    return directory / f"{name}.crt", directory / f"{name}.key"


def make_serving_cert(
    directory: pathlib.Path, name: str, ips: list[str], dns: list[str]
) -> tuple[pathlib.Path, pathlib.Path]:
    """A server certificate for the given IP and DNS names; returns (cert, key) paths."""
    alt = ",".join([*(f"IP:{ip}" for ip in ips), *(f"DNS:{d}" for d in dns)])
    return _signed(
        directory,
        name,
        f"/CN={name}",
        [
            "basicConstraints=CA:FALSE",
            "keyUsage=digitalSignature,keyEncipherment",
            "extendedKeyUsage=serverAuth",
            f"subjectAltName={alt}",
        ],
    )


def make_client_cert(
    directory: pathlib.Path, name: str, identity: ClientIdentity
) -> tuple[pathlib.Path, pathlib.Path]:
    """A client certificate for ``identity``; returns (cert, key) paths."""
    return _signed(
        directory,
        name,
        _subject(identity),
        [
            "basicConstraints=CA:FALSE",
            "keyUsage=digitalSignature,keyEncipherment",
            "extendedKeyUsage=clientAuth",
        ],
    )
