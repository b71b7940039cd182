"""A throwaway PKI made at test time with `cryptography`: a CA, a server certificate for 127.0.0.1/localhost,
client certificates whose common names are tenants, and a rogue CA the sidecar does not trust."""
from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


def _key():
    return ec.generate_private_key(ec.SECP256R1())


def _pem_key(key) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _now():
    return datetime.datetime.now(datetime.timezone.utc)


@dataclass
class CA:
    key: object
    cert: x509.Certificate

    @classmethod
    def create(cls, cn: str) -> "CA":
        key = _key()
        cert = (x509.CertificateBuilder().subject_name(_name(cn)).issuer_name(_name(cn))
                .public_key(key.public_key()).serial_number(x509.random_serial_number())
                .not_valid_before(_now() - datetime.timedelta(minutes=5))
                .not_valid_after(_now() + datetime.timedelta(days=1))
                .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
                .sign(key, hashes.SHA256()))
        return cls(key, cert)

    @property
    def pem(self) -> bytes:
        return self.cert.public_bytes(serialization.Encoding.PEM)

    def issue(self, cn: str, server: bool, dns_names: tuple[str, ...] = ()) -> tuple[bytes, bytes]:
        """(certificate PEM, key PEM); a server certificate is for localhost, 127.0.0.1 and `dns_names`."""
        key = _key()
        b = (x509.CertificateBuilder().subject_name(_name(cn)).issuer_name(self.cert.subject)
             .public_key(key.public_key()).serial_number(x509.random_serial_number())
             .not_valid_before(_now() - datetime.timedelta(minutes=5))
             .not_valid_after(_now() + datetime.timedelta(days=1))
             .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True))
        if server:
            b = (b.add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"),
                                                              *(x509.DNSName(n) for n in dns_names),
                                                              x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                                 critical=False)
                 .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False))
        else:
            b = b.add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
        cert = b.sign(self.key, hashes.SHA256())
        return cert.public_bytes(serialization.Encoding.PEM), _pem_key(key)


@dataclass
class PKI:
    dir: Path
    ca: CA
    rogue: CA

    @property
    def ca_file(self) -> str:
        return str(self.dir / "ca.pem")

    @property
    def server_cert(self) -> str:
        return str(self.dir / "server.pem")

    @property
    def server_key(self) -> str:
        return str(self.dir / "server.key")

    def client(self, tenant: str, rogue: bool = False) -> tuple[bytes, bytes]:
        return (self.rogue if rogue else self.ca).issue(tenant, server=False)


def make_pki(directory: Path) -> PKI:
    directory.mkdir(parents=True, exist_ok=True)
    ca, rogue = CA.create("promptcache test CA"), CA.create("rogue CA")
    (directory / "ca.pem").write_bytes(ca.pem)
    cert, key = ca.issue("promptcache-sidecar", server=True)
    (directory / "server.pem").write_bytes(cert)
    (directory / "server.key").write_bytes(key)
    return PKI(directory, ca, rogue)
