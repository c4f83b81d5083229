"""Helpers for the weight-channel tests: a model whose bits bf16 would lose, a self-signed CA,
and a loopback TCP proxy that cuts connections mid-response and logs what clients asked for."""

from __future__ import annotations

import datetime
import ipaddress
import re
import socket
import threading
from pathlib import Path

import torch
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from envs.ports import bind_listener


def model(seed: int = 0, rows: int = 96) -> dict[str, torch.Tensor]:
    """3 shards at 8 KiB, with fp32 values bf16 cannot hold (invariant 1)."""
    g = torch.Generator().manual_seed(seed)
    return {
        "embed": torch.randn(rows, 32, generator=g),
        "w": torch.randn(64, 32, generator=g),
        "special": torch.tensor([1 + 2**-20, -0.0, 1e-45, float("nan")]),
        "ids": torch.arange(5),
    }


def same_bits(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return list(a) == list(b) and all(
        a[k].dtype == b[k].dtype and a[k].numpy().tobytes() == b[k].numpy().tobytes() for k in a
    )


def write_ca_and_cert(out: Path, host: str = "127.0.0.1") -> tuple[Path, Path, Path]:
    """A self-signed CA and a server certificate for `host` signed by it: (ca, cert, key) PEM files."""
    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "fedagent test CA")])
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                key_cert_sign=True,
                crl_sign=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, host)]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address(host))]), critical=False)
        .add_extension(x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    paths = out / "ca.pem", out / "cert.pem", out / "key.pem"
    paths[0].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths[1].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    paths[2].write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return paths


class CuttingProxy:
    """Forwards 127.0.0.1:<port> to `target`; the first `cuts` connections that ask for a shard are
    closed after `after` response bytes (a dropped connection mid-download). `requests` logs every
    request line and Range header the clients sent."""

    def __init__(self, target: tuple[str, int], cuts: int = 0, after: int = 0):
        self.target, self.cuts, self.after = target, cuts, after
        self.requests: list[str] = []
        self.response_bytes = 0
        self._lock = threading.Lock()
        self._sock = bind_listener("127.0.0.1", None)
        self.port = self._sock.getsockname()[1]
        self._threads: list[threading.Thread] = []
        self._open: list[socket.socket] = []
        self._accepting = threading.Thread(target=self._accept, daemon=True)
        self._accepting.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def ranges(self) -> list[int]:
        return [int(m) for r in self.requests for m in re.findall(r"range: bytes=(\d+)-", r, re.IGNORECASE)]

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._sock.accept()
            except OSError:
                return
            upstream = socket.create_connection(self.target)
            self._open += [client, upstream]
            state = {"cut": False}
            for args in ((client, upstream, True, state), (upstream, client, False, state)):
                t = threading.Thread(target=self._pump, args=args, daemon=True)
                t.start()
                self._threads.append(t)

    def _pump(self, src: socket.socket, dst: socket.socket, asking: bool, state: dict[str, bool]) -> None:
        sent = 0
        try:
            while data := src.recv(1 << 16):
                if asking:
                    text = data.decode("latin-1")
                    with self._lock:
                        self.requests += re.findall(
                            r"^(?:GET|PUT|POST|DELETE) [^\r\n]*(?:\r\n[^\r\n]+)*", text, re.MULTILINE
                        )
                        if "/v1/shard" in text and self.cuts > 0 and not state["cut"]:
                            self.cuts -= 1
                            state["cut"] = True
                else:
                    if state["cut"] and sent + len(data) > self.after:
                        dst.sendall(data[: max(self.after - sent, 0)])
                        break
                    sent += len(data)
                    with self._lock:
                        self.response_bytes += len(data)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self._sock.close()
        for s in self._open:
            s.close()
        for t in self._threads:
            t.join(5)
        self._accepting.join(5)
