"""The admission webhook's serving certificate: given files, or self-signed with `cryptography`.

kopf makes a self-signed certificate only with the optional `certbuilder` package; without it the
operator would exit at start-up with the webhook on (the default). Here the same certificate
(CA:true, serverAuth, the host and listen address as SANs) is made with `cryptography`, which
the operator image has anyway (via kubernetes' dependencies); kopf then puts it in the
ValidatingWebhookConfiguration's caBundle itself.
"""

from __future__ import annotations

import datetime
import ipaddress
import urllib.parse
from collections.abc import AsyncIterator, Collection
from typing import Any, cast

import kopf
from kopf._cogs.structs.reviews import WebhookClientConfig, WebhookFn  # kopf's types, not re-exported

VALIDITY_DAYS = 365  # a fresh certificate is made at every operator start


def service_reference(config: dict[str, Any]) -> dict[str, Any]:
    """A webhook URL naming a Service (`https://NAME.NAMESPACE.svc:PORT/PATH`) as a service reference, which the
    API server resolves through the Service's endpoints: it often cannot resolve in-cluster DNS names, and the
    Kubernetes API asks for `service` rather than a `url` into the cluster. Any other URL is left as it is."""
    url = urllib.parse.urlsplit(str(config.get("url", "")))
    labels = (url.hostname or "").split(".")
    if len(labels) < 3 or labels[2] != "svc" or labels[3:] not in ([], ["cluster", "local"]):
        return config
    service = {"name": labels[0], "namespace": labels[1], "port": url.port or 443}
    if url.path.strip("/"):
        service["path"] = url.path
    return {**{k: v for k, v in config.items() if k != "url"}, "service": service}


class ServiceWebhookServer(kopf.WebhookServer):
    """kopf's WebhookServer, registered by service reference when its host names a Service."""

    async def __call__(self, fn: WebhookFn) -> AsyncIterator[WebhookClientConfig]:
        async for config in super().__call__(fn):
            yield cast(WebhookClientConfig, service_reference(dict(config)))


class SelfSignedWebhookServer(ServiceWebhookServer):
    """kopf's WebhookServer with a certificate builder that needs no `certbuilder`."""

    @staticmethod
    def build_certificate(hostnames: Collection[str], password: str | None = None) -> tuple[bytes, bytes]:
        return self_signed_certificate(hostnames, password)


def self_signed_certificate(hostnames: Collection[str], password: str | None = None) -> tuple[bytes, bytes]:
    """(certificate PEM, private key PEM) valid for `hostnames` (DNS names and IP addresses).

    As kopf's own builder: the first DNS name (else the first IP) is the common name; unspecified
    addresses such as 0.0.0.0 are left out; the certificate is its own CA (it goes into caBundle)."""
    # here, not at the top: without `cryptography` the operator still starts (can_self_sign says why no webhook)
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    dns: list[str] = []
    ips: list[ipaddress.IPv4Address | ipaddress.IPv6Address] = []
    for name in hostnames:
        try:
            ip = ipaddress.ip_address(name)
        except ValueError:
            if name and name not in dns:
                dns.append(name)
            continue
        if not ip.is_unspecified and ip not in ips:
            ips.append(ip)
    if not dns and not ips:
        raise ValueError(f"no usable host name or address for the webhook certificate in {list(hostnames)}")
    common_name = dns[0] if dns else str(ips[0])

    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name[:64])])
    now = datetime.datetime.now(datetime.timezone.utc)
    sans: list[x509.GeneralName] = [x509.DNSName(n) for n in dns] + [x509.IPAddress(ip) for ip in ips]
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))  # tolerate clock skew
        .not_valid_after(now + datetime.timedelta(days=VALIDITY_DAYS))
        .add_extension(x509.SubjectAlternativeName(sans), critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                key_encipherment=False,
                content_commitment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .sign(key, hashes.SHA256())
    )
    encryption: Any = (
        serialization.BestAvailableEncryption(password.encode()) if password else serialization.NoEncryption()
    )
    key_pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, encryption)
    return cert.public_bytes(serialization.Encoding.PEM), key_pem


def can_self_sign() -> str | None:
    """None when a self-signed certificate can be made here, else why not."""
    try:
        self_signed_certificate(["localhost"])
    except ImportError as err:
        return f"the `cryptography` package is missing ({err}); install meshjob[operator]"
    except Exception as err:  # noqa: BLE001 - any failure means: no certificate, no webhook
        return f"{type(err).__name__}: {err}"
    return None


def webhook_server(
    *, addr: str, port: int, host: str | None, cert: str | None, key: str | None, ca: str | None, logger: kopf.Logger
) -> kopf.WebhookServer | None:
    """The server kopf runs the admission webhook on; None when it cannot run (logged as a warning).

    Given files win (e.g. from cert-manager); otherwise a self-signed certificate made at start-up."""
    if cert and key:
        return ServiceWebhookServer(addr=addr, port=port, host=host, certfile=cert, pkeyfile=key, cafile=ca)
    problem = can_self_sign()
    if problem is not None:
        logger.warning(
            f"admission webhook off: no certificate given (--webhook-cert/--webhook-key) and none "
            f"can be made: {problem}. TrainingJobs are still validated by the operator "
            f"(condition Failed/InvalidSpec)."
        )
        return None
    # the API server reaches the webhook at `host`; localhost and 127.0.0.1 help local tools (curl, tests)
    return SelfSignedWebhookServer(addr=addr, port=port, host=host, extra_sans=["localhost", "127.0.0.1"])
