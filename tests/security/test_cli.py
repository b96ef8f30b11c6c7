"""`murmura keys` and `murmura certs`, and the one-line errors of the security flags."""

from __future__ import annotations

import ipaddress
import os
import stat

import pytest
from cryptography import x509

from murmura.cli import main
from murmura.protocols.identity import NodeKey, load_public_keys


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_keys_new_writes_a_private_key_and_its_public_line(tmp_path, capsys) -> None:
    assert main(["keys", "new", "--out", str(tmp_path / "node.key")]) == 0
    out = capsys.readouterr().out
    key = NodeKey.load(tmp_path / "node.key")
    assert mode(tmp_path / "node.key") == 0o600
    assert f"client id  {key.client_id}" in out and key.public_hex in out
    assert load_public_keys(tmp_path / "node.key.pub") == {key.public_bytes}
    assert main(["keys", "new", "--out", str(tmp_path / "node.key")]) == 2
    assert "already exists" in capsys.readouterr().err


def test_certs_make_a_ca_and_server_and_client_certificates(tmp_path, capsys) -> None:
    ca, srv, cli = tmp_path / "ca", tmp_path / "srv", tmp_path / "cli"
    assert main(["certs", "init", "--out", str(ca)]) == 0
    assert main(["certs", "server", "--ca", str(ca), "--host", "agg.example,10.0.0.5",
                 "--out", str(srv)]) == 0
    assert main(["certs", "client", "--ca", str(ca), "--name", "lab-7", "--out", str(cli)]) == 0
    for key in (ca / "ca.key", srv / "server.key", cli / "lab-7.key"):
        assert mode(key) == 0o600, key
    cert = x509.load_pem_x509_certificate((srv / "server.crt").read_bytes())
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert sans.get_values_for_type(x509.DNSName) == ["agg.example"]
    assert sans.get_values_for_type(x509.IPAddress) == [ipaddress.ip_address("10.0.0.5")]
    ca_cert = x509.load_pem_x509_certificate((ca / "ca.crt").read_bytes())
    assert cert.issuer == ca_cert.subject
    capsys.readouterr()
    assert main(["certs", "init", "--out", str(ca)]) == 2  # never overwrites
    assert "already exists" in capsys.readouterr().err
    assert main(["certs", "server", "--ca", str(tmp_path / "nope"), "--out", str(srv)]) == 2
    assert "cannot read CA certificate" in capsys.readouterr().err


def test_security_mistakes_are_one_line_errors(tmp_path, capsys) -> None:
    assert main(["server", "--address", "0.0.0.0:0"]) == 2
    assert "refusing to serve plaintext on 0.0.0.0:0" in capsys.readouterr().err
    assert main(["server", "--tls-cert", str(tmp_path / "x.crt"), "--tls-key",
                 str(tmp_path / "x.key")]) == 2
    assert "cannot read certificate" in capsys.readouterr().err
    assert main(["server", "--client-ca", "ca.crt"]) == 2
    assert "needs tls_cert" in capsys.readouterr().err
    assert main(["client", "--server", "10.0.0.1:50051"]) == 2
    assert "refusing to talk plaintext to 10.0.0.1:50051" in capsys.readouterr().err
    assert main(["client", "--key", str(tmp_path / "missing.key")]) == 2
    assert "cannot read key file" in capsys.readouterr().err
    assert main(["client", "--tls-ca", str(tmp_path / "ca.crt")]) == 2
    assert "cannot read CA certificate" in capsys.readouterr().err
    assert main(["server", "--role", "leaf", "--upstream", "10.0.0.1:50051"]) == 2
    assert "plaintext upstream link" in capsys.readouterr().err


@pytest.mark.parametrize("sub,flags", [
    ("server", ["--tls-cert", "--tls-key", "--client-ca", "--insecure", "--allowed-keys",
                "--upstream-tls-ca", "--key"]),
    ("client", ["--key", "--tls-ca", "--tls-cert", "--tls-key", "--insecure"]),
])
def test_security_flags_have_help(sub, flags, capsys) -> None:
    with pytest.raises(SystemExit):
        main([sub, "--help"])
    out = " ".join(capsys.readouterr().out.split())
    for flag in flags:
        assert flag in out, flag
    assert "murmura keys new" in out or "murmura certs" in out
