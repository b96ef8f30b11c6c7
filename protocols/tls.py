"""TLS for Murmura's gRPC links: a small CA, server and client certificates, credentials.

``murmura certs init|server|client`` call :func:`make_ca`, :func:`make_server_cert` and
:func:`make_client_cert`; servers and clients (and later gossip peers) turn the files into
gRPC credentials with :func:`server_credentials` and :func:`channel_credentials`. Plaintext is
only for loopback addresses (:func:`is_loopback`) unless a user asks for it explicitly.

Keys are ECDSA P-256 (fast, supported by every gRPC TLS stack); private key files are written
with mode 0600 and never overwritten.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import socket
import ssl
from dataclasses import dataclass
from pathlib import Path

import grpc
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

__all__ = [
    "CA_CERT",
    "CA_KEY",
    "ClientTls",
    "TlsError",
    "channel_credentials",
    "handshake_failure",
    "is_loopback",
    "is_loopback_host",
    "make_ca",
    "make_client_cert",
    "make_server_cert",
    "server_credentials",
    "spoken_protocol",
]

CA_CERT = "ca.crt"
CA_KEY = "ca.key"
CA_DAYS = 3650
LEAF_DAYS = 825


class TlsError(ValueError):
    """A certificate or key file is missing, unreadable, malformed or does not match."""


def is_loopback(address: str) -> bool:
    """True for ``HOST:PORT`` addresses on this machine only (127.0.0.0/8, ::1, localhost)."""
    return is_loopback_host(address.rsplit(":", 1)[0] if ":" in address else address)


def is_loopback_host(host: str) -> bool:
    """True for a host name or address (no port) of this machine only."""
    host = host.strip("[]").lower()
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _read(path: str | Path, what: str) -> bytes:
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise TlsError(f"cannot read {what} {path}: {exc.strerror}") from None
    if b"-----BEGIN" not in data:
        raise TlsError(f"{what} {path} is not a PEM file")
    return data


def _load_cert(path: str | Path, what: str) -> x509.Certificate:
    data = _read(path, what)
    try:
        return x509.load_pem_x509_certificate(data)
    except ValueError:
        raise TlsError(f"{what} {path} is not a PEM certificate") from None


def _load_key(path: str | Path, what: str) -> ec.EllipticCurvePrivateKey:
    data = _read(path, what)
    try:
        key = serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError):
        raise TlsError(f"{what} {path} is not an unencrypted PEM private key") from None
    return key  # type: ignore[return-value]


def _check_pair(cert_path: str | Path, key_path: str | Path) -> tuple[bytes, bytes]:
    """The PEM bytes of a certificate and its key, after checking that they belong together."""
    cert = _load_cert(cert_path, "certificate")
    key = _load_key(key_path, "private key")
    pub = serialization.PublicFormat.SubjectPublicKeyInfo
    if (cert.public_key().public_bytes(serialization.Encoding.PEM, pub)
            != key.public_key().public_bytes(serialization.Encoding.PEM, pub)):
        raise TlsError(f"private key {key_path} does not match certificate {cert_path}")
    return _read(cert_path, "certificate"), _read(key_path, "private key")


def server_credentials(cert: str | Path, key: str | Path,
                       client_ca: str | Path | None = None) -> grpc.ServerCredentials:
    """TLS for a server; with ``client_ca`` every client must present a certificate signed by
    it (mutual TLS)."""
    cert_pem, key_pem = _check_pair(cert, key)
    ca_pem = None
    if client_ca:
        _load_cert(client_ca, "client CA certificate")
        ca_pem = _read(client_ca, "client CA certificate")
    return grpc.ssl_server_credentials([(key_pem, cert_pem)], root_certificates=ca_pem,
                                       require_client_auth=ca_pem is not None)


@dataclass(frozen=True)
class ClientTls:
    """How a client (or a peer) reaches a TLS server: the CA that signed the server's
    certificate, and its own certificate and key when the server requires mutual TLS."""

    ca: str
    cert: str = ""
    key: str = ""

    def __post_init__(self) -> None:
        if bool(self.cert) != bool(self.key):
            raise TlsError("a client certificate needs its key and a key its certificate "
                           "(give both --tls-cert and --tls-key)")


def channel_credentials(tls: ClientTls) -> grpc.ChannelCredentials:
    _load_cert(tls.ca, "CA certificate")
    ca_pem = _read(tls.ca, "CA certificate")
    cert_pem = key_pem = None
    if tls.cert:
        cert_pem, key_pem = _check_pair(tls.cert, tls.key)
    return grpc.ssl_channel_credentials(root_certificates=ca_pem, private_key=key_pem,
                                        certificate_chain=cert_pem)


#: An HTTP/2 client's connection preface and an empty SETTINGS frame: a plaintext gRPC server
#: answers with a SETTINGS frame of its own (frame type 4, the fourth byte of its header).
_H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0])


def _host_port(address: str) -> tuple[str, int] | None:
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        return None
    return host.strip("[]") or "127.0.0.1", int(port)


def _unverified() -> ssl.SSLContext:
    """A TLS client context that verifies nothing (for probes that only look), ALPN h2."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    context.set_alpn_protocols(["h2"])
    return context


def spoken_protocol(address: str, timeout_s: float = 1.0) -> str | None:
    """``"tls"`` or ``"plaintext"``: what the gRPC server at ``address`` speaks, probed on
    two short-lived TCP connections; ``"refused"`` when nothing listens there; None if it
    cannot be told (no answer within ``timeout_s``, something else answers).

    gRPC reports a TLS mismatch only as a channel that never becomes ready (and C-core log
    lines), which reads like a server that is down; this probe lets a client name the
    mismatch and the flag that fixes it. It proves nothing about certificates: the TLS
    handshake here verifies none.
    """
    target = _host_port(address)
    if target is None:
        return None
    try:
        sock = socket.create_connection(target, timeout=timeout_s)
    except ConnectionRefusedError:
        return "refused"
    except OSError:  # no route, no answer within timeout_s: a second try would wait again
        return None
    try:
        with sock:
            sock.sendall(_H2_PREFACE)
            head = sock.recv(9)
        if len(head) >= 4 and head[3] == 4:
            return "plaintext"
    except OSError:  # closed or silent at a plaintext preface: perhaps TLS
        pass
    try:
        with socket.create_connection(target, timeout=timeout_s) as sock, \
                _unverified().wrap_socket(sock, server_hostname=target[0]):
            return "tls"
    except ssl.SSLError as exc:  # a TLS alert (e.g. mutual TLS wants a certificate): TLS
        return "tls" if "ALERT" in str(exc.reason or "").upper() else None
    except OSError:
        return None


def handshake_failure(address: str, tls: ClientTls, timeout_s: float = 2.0) -> str | None:
    """Why a TLS client with ``tls`` cannot connect to the TLS server at ``address``, in one
    sentence that names the flag to change; None when a verified handshake succeeds (the
    failure is elsewhere) or the server cannot be reached.

    It repeats the handshake gRPC makes (the CA in ``tls.ca``, the client certificate if any,
    the address's host checked against the server certificate's names, ALPN ``h2``) with
    Python's ``ssl`` module, which, unlike a gRPC channel, says what failed: a server
    certificate another CA signed, one issued for other names, an expired one, or a server
    that wants a client certificate, or refuses the one it got.
    """
    target = _host_port(address)
    if target is None:
        return None
    host = target[0]
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.set_alpn_protocols(["h2"])
    try:
        context.load_verify_locations(cafile=tls.ca)
        if tls.cert:
            context.load_cert_chain(tls.cert, tls.key)
    except (OSError, ssl.SSLError, ValueError) as exc:
        return f"the TLS files could not be loaded ({exc}); check --tls-ca/--tls-cert/--tls-key"
    try:
        with socket.create_connection(target, timeout=timeout_s) as sock, \
                context.wrap_socket(sock, server_hostname=host) as conn:
            # With TLS 1.3 the server checks the client's certificate after the client's
            # side of the handshake is done: a server that refuses it (or its absence) closes
            # the connection, where a willing one answers the HTTP/2 preface with SETTINGS.
            conn.settimeout(timeout_s)
            try:
                conn.sendall(_H2_PREFACE)
                closed = conn.recv(1) == b""
            except TimeoutError:
                closed = False
            except (ssl.SSLError, ConnectionError):
                closed = True
        if not closed:
            return None
        if not tls.cert:
            return (f"the server at {address[:80]} requires a client certificate (mutual "
                    f"TLS): pass --tls-cert and --tls-key, signed by the CA it trusts (its "
                    f"--client-ca)")
        return (f"the server at {address[:80]} refused this client's certificate "
                f"({tls.cert}): it is not signed by the CA the server trusts (its "
                f"--client-ca), or has expired")
    except ssl.SSLCertVerificationError as exc:
        return _verify_failure(exc, address, host, tls, timeout_s)
    except ssl.SSLError as exc:
        reason = str(exc.reason or exc).upper()
        if "CERTIFICATE_REQUIRED" in reason or ("HANDSHAKE_FAILURE" in reason
                                                and not tls.cert):
            return (f"the server at {address[:80]} requires a client certificate (mutual TLS): "
                    f"pass --tls-cert and --tls-key, signed by the CA it trusts (its "
                    f"--client-ca)")
        if any(k in reason for k in ("UNKNOWN_CA", "BAD_CERTIFICATE", "DECRYPT_ERROR",
                                     "CERTIFICATE_UNKNOWN", "ACCESS_DENIED")):
            return (f"the server at {address[:80]} refused this client's certificate "
                    f"({tls.cert}): it is not signed by the CA the server trusts (its "
                    f"--client-ca), or has expired")
        return None
    except OSError:
        return None


def _verify_failure(exc: ssl.SSLCertVerificationError, address: str, host: str,
                    tls: ClientTls, timeout_s: float) -> str:
    """The sentence for a server certificate the client's CA does not verify."""
    where = address[:80]
    cert = _server_certificate(host, address, timeout_s)
    names = ""
    if cert is not None:
        try:
            san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
            listed = [str(v) for v in san.get_values_for_type(x509.DNSName)]
            listed += [str(v) for v in san.get_values_for_type(x509.IPAddress)]
            names = ", ".join(listed[:6])
        except x509.ExtensionNotFound:
            names = ""
    code = getattr(exc, "verify_code", 0)
    message = str(getattr(exc, "verify_message", "") or exc)
    if code == 62 or "hostname mismatch" in message.lower() or "ip address mismatch" in \
            message.lower():
        return (f"the server's certificate at {where} is not issued for {host!r} (it names "
                f"{names or 'other hosts'}): connect with one of those names, or issue the "
                f"server a certificate for this one (murmura certs server --ca DIR --host "
                f"{host} --out DIR)")
    if code == 10 or "expired" in message.lower():
        return f"the server's certificate at {where} has expired; issue it a new one"
    issuer = ""
    if cert is not None:
        cn = cert.issuer.get_attributes_for_oid(NameOID.COMMON_NAME)
        issuer = f" (it was issued by {str(cn[0].value)!r})" if cn else ""
    return (f"the server's certificate at {where} is not signed by the CA in --tls-ca "
            f"({tls.ca}){issuer}: pass the CA certificate that signed it "
            f"(verification said: {message[:80]})")


def _server_certificate(host: str, address: str, timeout_s: float) -> x509.Certificate | None:
    """The server's certificate, read without verifying it (to name what it says)."""
    target = _host_port(address)
    if target is None:
        return None
    try:
        with socket.create_connection(target, timeout=timeout_s) as sock, \
                _unverified().wrap_socket(sock, server_hostname=host) as conn:
            der = conn.getpeercert(binary_form=True)
    except (OSError, ssl.SSLError):
        return None
    return x509.load_der_x509_certificate(der) if der else None


# -- making certificates ----------------------------------------------------------------------

def _write_private(path: Path, key: ec.EllipticCurvePrivateKey) -> None:
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                            serialization.NoEncryption())
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        raise TlsError(f"{path} already exists; not overwriting a key") from None
    with os.fdopen(fd, "wb") as f:
        f.write(pem)


def _write_cert(path: Path, cert: x509.Certificate) -> None:
    if path.exists():
        raise TlsError(f"{path} already exists; not overwriting a certificate")
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "murmura"),
                      x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.timezone.utc)


def make_ca(out: str | Path, *, name: str = "murmura CA") -> tuple[Path, Path]:
    """A new certificate authority in ``out``: ``ca.crt`` (share it) and ``ca.key`` (keep it)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    key = ec.generate_private_key(ec.SECP256R1())
    now = _now()
    cert = (x509.CertificateBuilder().subject_name(_name(name)).issuer_name(_name(name))
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=CA_DAYS))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True,
                                         crl_sign=True, content_commitment=False,
                                         key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, encipher_only=False,
                                         decipher_only=False), critical=True)
            .sign(key, hashes.SHA256()))
    _write_cert(out / CA_CERT, cert)
    _write_private(out / CA_KEY, key)
    return out / CA_CERT, out / CA_KEY


def _issue(ca_dir: str | Path, out: str | Path, stem: str, common_name: str,
           sans: list[x509.GeneralName], usage: x509.ObjectIdentifier) -> tuple[Path, Path]:
    ca_dir, out = Path(ca_dir), Path(out)
    ca_cert = _load_cert(ca_dir / CA_CERT, "CA certificate")
    ca_key = _load_key(ca_dir / CA_KEY, "CA key")
    out.mkdir(parents=True, exist_ok=True)
    key = ec.generate_private_key(ec.SECP256R1())
    now = _now()
    builder = (x509.CertificateBuilder().subject_name(_name(common_name))
               .issuer_name(ca_cert.subject).public_key(key.public_key())
               .serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5))
               .not_valid_after(now + datetime.timedelta(days=LEAF_DAYS))
               .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
               .add_extension(x509.ExtendedKeyUsage([usage]), critical=False))
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    cert = builder.sign(ca_key, hashes.SHA256())
    _write_cert(out / f"{stem}.crt", cert)
    _write_private(out / f"{stem}.key", key)
    return out / f"{stem}.crt", out / f"{stem}.key"


def make_server_cert(ca_dir: str | Path, out: str | Path, hosts: list[str]
                     ) -> tuple[Path, Path]:
    """``server.crt`` / ``server.key`` valid for every name and IP address in ``hosts``."""
    if not hosts:
        raise TlsError("a server certificate needs at least one host name or IP address")
    sans: list[x509.GeneralName] = []
    for host in hosts:
        try:
            sans.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            sans.append(x509.DNSName(host))
    return _issue(ca_dir, out, "server", hosts[0], sans, ExtendedKeyUsageOID.SERVER_AUTH)


def make_client_cert(ca_dir: str | Path, out: str | Path, name: str) -> tuple[Path, Path]:
    """``NAME.crt`` / ``NAME.key``: a client certificate for mutual TLS."""
    if not name or "/" in name or name.startswith("."):
        raise TlsError(f"client name must be a plain file name, got {name[:40]!r}")
    return _issue(ca_dir, out, name, name, [], ExtendedKeyUsageOID.CLIENT_AUTH)
