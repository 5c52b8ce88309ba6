"""Certificates for the TLS tests, generated with ``cryptography``: a CA, a server and a client it signed,
and an unrelated CA with its own client (what a stranger would present)."""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from shardps.common.security import ChannelSecurity

#: The bearer token ``make_pki`` writes to ``token`` (with whitespace around it, which is stripped).
TOKEN = "s3cret-Token_for.tests~1"


def _certificate(cn: str, key, issuer: tuple[x509.Certificate, object] | None = None, *, ca: bool = False,
                 server: bool = False, client: bool = False) -> x509.Certificate:
    """An X.509 certificate for ``key``, signed by ``issuer`` (certificate, key), or self-signed when None."""
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (x509.CertificateBuilder().subject_name(name).issuer_name(issuer[0].subject if issuer else name)
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if ca:
        builder = builder.add_extension(x509.KeyUsage(
            digital_signature=True, content_commitment=False, key_encipherment=False, data_encipherment=False,
            key_agreement=False, key_cert_sign=True, crl_sign=True, encipher_only=False, decipher_only=False),
            critical=True)
    if server:
        builder = builder.add_extension(x509.SubjectAlternativeName(
            [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]), critical=False)
    usages = [ExtendedKeyUsageOID.SERVER_AUTH] * server + [ExtendedKeyUsageOID.CLIENT_AUTH] * client
    if usages:
        builder = builder.add_extension(x509.ExtendedKeyUsage(usages), critical=False)
    return builder.sign(issuer[1] if issuer else key, hashes.SHA256())


@dataclass(frozen=True)
class Pki:
    """Paths of PEM files: a CA, a server and a client certificate it signed, and an unrelated CA's client."""

    dir: Path

    def path(self, name: str) -> str:
        return str(self.dir / name)

    def read(self, name: str) -> bytes:
        return (self.dir / name).read_bytes()

    def security(self, client: str | None = None, token: str | None = None, ca: str = "ca.pem") -> ChannelSecurity:
        """Trust ``ca``; present ``client``'s certificate (``client``.pem and ``client``.key) when given."""
        cert = key = None
        if client:
            cert, key = self.read(f"{client}.pem"), self.read(f"{client}.key")
        return ChannelSecurity(ca=self.read(ca), cert=cert, key=key, token=token)


def make_pki(directory: Path) -> Pki:
    """Write the PEM files and the token file into ``directory``."""
    def write(name: str, cert: x509.Certificate, key) -> None:
        (directory / f"{name}.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        (directory / f"{name}.key").write_bytes(key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))

    keys = {name: ec.generate_private_key(ec.SECP256R1()) for name in ("ca", "server", "client", "rogue-ca", "rogue")}
    ca = _certificate("shardps test CA", keys["ca"], ca=True)
    rogue_ca = _certificate("some other CA", keys["rogue-ca"], ca=True)
    write("ca", ca, keys["ca"])
    write("rogue-ca", rogue_ca, keys["rogue-ca"])
    write("server", _certificate("shard", keys["server"], (ca, keys["ca"]), server=True), keys["server"])
    write("client", _certificate("worker", keys["client"], (ca, keys["ca"]), client=True), keys["client"])
    write("rogue", _certificate("worker", keys["rogue"], (rogue_ca, keys["rogue-ca"]), client=True), keys["rogue"])
    (directory / "token").write_text(f"  {TOKEN}\n")  # surrounding whitespace is stripped
    return Pki(directory)
