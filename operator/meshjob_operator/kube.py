"""A small async Kubernetes client (aiohttp, raw JSON) for the operator's own calls.

kopf brings its own client for watching and for its handlers' patches; the reconciler needs
plain CRUD on pods, services, configmaps, nodes and the job, on plain dicts (the bodies render.py
builds, the bodies kopf hands over). Why not a generated client: operator/README.md ("API client").
Credentials are the kubernetes package's (kubeconfig incl. exec plugins, or the in-cluster
service account) and are asked for on every request, so a rotated in-cluster token is picked up.
API errors say whether they pass by themselves (409/429/5xx) or need someone to act (the rest).
"""

from __future__ import annotations

import asyncio
import json
import os
import ssl
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp
import kopf
import kubernetes  # only for reading the credentials, as kopf does

from meshjob_operator import names

MERGE_PATCH = "application/merge-patch+json"
JSON_PATCH = "application/json-patch+json"
TEMPORARY_CODES = frozenset({409, 429, 500, 502, 503, 504})


class ApiError(Exception):
    def __init__(self, status: int, method: str, path: str, message: str, reason: str = ""):
        self.status, self.method, self.path, self.message = status, method, path, message
        self.reason = reason or f"HTTP{status}"  # the API's Status.reason: Forbidden, Invalid, ...
        super().__init__(f"{method} {path}: HTTP {status}: {message}")

    @property
    def temporary(self) -> bool:
        """409 (conflict), 429 and 5xx pass by themselves; anything else needs someone to act."""
        return self.status in TEMPORARY_CODES


def load_configuration(kubeconfig: str | None = None) -> Any:
    """kubernetes.client.Configuration: in-cluster service account, else the kubeconfig file.

    An explicit `kubeconfig` (or $KUBECONFIG read now, not at import) wins over in-cluster.
    """
    config = kubernetes.client.Configuration()
    path = kubeconfig or os.environ.get("KUBECONFIG")
    if path:
        kubernetes.config.load_kube_config(config_file=path, client_configuration=config)
        return config
    try:
        kubernetes.config.load_incluster_config(client_configuration=config)
    except kubernetes.config.ConfigException:
        kubernetes.config.load_kube_config(client_configuration=config)
    return config


def _bearer(config: Any) -> str | None:
    token = config.get_api_key_with_prefix("authorization", alias="BearerToken")  # one call: one refresh check
    if not token:
        return None
    return token if " " in token else f"Bearer {token}"


def kopf_connection(kubeconfig: str | None = None) -> kopf.ConnectionInfo:
    """The same credentials for kopf's own client (its login handler)."""
    config = load_configuration(kubeconfig)
    scheme, token = (None, None)
    bearer = _bearer(config)
    if bearer:
        scheme, token = bearer.split(" ", 1)
    return kopf.ConnectionInfo(
        server=config.host,
        ca_path=config.ssl_ca_cert,
        insecure=not config.verify_ssl,
        scheme=scheme,
        token=token,
        certificate_path=config.cert_file,
        private_key_path=config.key_file,
    )


def _auth_headers(config: Any) -> dict[str, str]:
    """The Authorization header now: kubernetes' refresh hook re-reads a rotated token (in-cluster,
    exec plugins) when it is due, so this is called per request rather than once."""
    bearer = _bearer(config)
    return {"Authorization": bearer} if bearer else {}


@dataclass
class Connection:
    server: str
    ssl_context: ssl.SSLContext | bool  # aiohttp's ssl=: True its default (and plain http), else this context
    headers: Callable[[], dict[str, str]]  # per request: tokens rotate

    @classmethod
    def load(cls, kubeconfig: str | None = None) -> Connection:
        config = load_configuration(kubeconfig)
        context: ssl.SSLContext | bool = True
        if config.host.startswith("https"):
            context = ssl.create_default_context(cafile=config.ssl_ca_cert if config.verify_ssl else None)
            if not config.verify_ssl:  # insecure-skip-tls-verify: no check of the server (a client cert still goes)
                context.check_hostname = False
                context.verify_mode = ssl.CERT_NONE
            if config.cert_file:
                context.load_cert_chain(config.cert_file, config.key_file)
        return cls(server=config.host.rstrip("/"), ssl_context=context, headers=lambda: _auth_headers(config))


def _api_error(status: int, method: str, path: str, text: str) -> ApiError:
    """The API server's Status (message and reason) as an ApiError; any other body as the message."""
    try:
        body = json.loads(text)
    except ValueError:
        body = None
    if not isinstance(body, dict):
        return ApiError(status, method, path, text[:500])
    return ApiError(status, method, path, str(body.get("message", text))[:500], str(body.get("reason") or ""))


class Kube:
    """CRUD on the resources the operator touches; paths are built here, bodies elsewhere."""

    def __init__(self, connection: Connection, *, concurrency: int = 16):
        self._conn = connection
        self._session: aiohttp.ClientSession | None = None
        self._limit = asyncio.Semaphore(concurrency)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            connector = aiohttp.TCPConnector(ssl=self._conn.ssl_context, limit=64)
            self._session = aiohttp.ClientSession(
                base_url=None, connector=connector, timeout=aiohttp.ClientTimeout(total=30)
            )
        return self._session

    async def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        content_type: str = "application/json",
        params: Mapping[str, str] | None = None,
    ) -> Any:
        data = None if body is None else json.dumps(body)
        headers = self._conn.headers()
        if body is not None:
            headers["Content-Type"] = content_type
        async with self._limit:
            try:
                async with self._http().request(
                    method, self._conn.server + path, data=data, headers=headers, params=params
                ) as resp:
                    text = await resp.text()
                    if resp.status >= 400:
                        raise _api_error(resp.status, method, path, text)
                    return json.loads(text) if text else None
            except aiohttp.ClientError as err:  # connection refused/reset: the server may come back
                raise ApiError(503, method, path, f"connection error: {err}") from err

    # --- paths ---------------------------------------------------------------------------
    @staticmethod
    def _core(namespace: str, plural: str, name: str = "") -> str:
        return f"/api/v1/namespaces/{namespace}/{plural}" + (f"/{name}" if name else "")

    @staticmethod
    def _job_path(namespace: str, name: str) -> str:
        return f"/apis/{names.GROUP}/{names.VERSION}/namespaces/{namespace}/{names.PLURAL}/{name}"

    # --- jobs ----------------------------------------------------------------------------
    async def get_job(self, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            return await self.request("GET", self._job_path(namespace, name))
        except ApiError as err:
            if err.status == 404:
                return None
            raise

    async def patch_job_status(self, namespace: str, name: str, status: Mapping[str, Any]) -> None:
        """Merge-patch the status subresource (the main resource where the CRD has none)."""
        body = {"status": dict(status)}
        try:
            await self.request("PATCH", self._job_path(namespace, name) + "/status", body, content_type=MERGE_PATCH)
        except ApiError as err:
            if err.status != 404:
                raise
            await self.request("PATCH", self._job_path(namespace, name), body, content_type=MERGE_PATCH)

    async def delete_job(self, namespace: str, name: str) -> None:
        await self.delete(self._job_path(namespace, name), propagation="Background")

    # --- children ------------------------------------------------------------------------
    async def list_pods(self, namespace: str, job: str) -> list[dict[str, Any]]:
        path = self._core(namespace, "pods")
        found = await self.request("GET", path, params={"labelSelector": f"{names.JOB_LABEL}={job}"})
        items = (found or {}).get("items") or []
        # filter here too: some servers (kmock) ignore label selectors
        return [
            p
            for p in items
            if (p.get("metadata", {}).get("labels") or {}).get(names.JOB_LABEL) == job
            and p.get("metadata", {}).get("namespace", namespace) == namespace
        ]

    async def list_running_pods(self) -> list[dict[str, Any]]:
        """Every pod of the cluster not terminated yet (what holds devices on nodes)."""
        found = await self.request(
            "GET", "/api/v1/pods", params={"fieldSelector": "status.phase!=Succeeded,status.phase!=Failed"}
        )
        return [
            p
            for p in (found or {}).get("items") or []  # again here: kmock ignores field selectors
            if (p.get("status") or {}).get("phase") not in ("Succeeded", "Failed")
        ]

    async def list_nodes(self) -> list[dict[str, Any]]:
        return ((await self.request("GET", "/api/v1/nodes")) or {}).get("items") or []

    async def namespace_labels(self, name: str) -> dict[str, str]:
        """A Namespace's labels ({} when there is no such namespace)."""
        try:
            found = await self.request("GET", f"/api/v1/namespaces/{name}")
        except ApiError as err:
            if err.status == 404:
                return {}
            raise
        return dict(((found or {}).get("metadata") or {}).get("labels") or {})

    async def get(self, namespace: str, plural: str, name: str) -> dict[str, Any] | None:
        try:
            return await self.request("GET", self._core(namespace, plural, name))
        except ApiError as err:
            if err.status == 404:
                return None
            raise

    async def create_if_absent(self, body: Mapping[str, Any], plural: str, path: str | None = None) -> bool:
        """POST the body; True when created, False when it already existed (409 AlreadyExists)."""
        meta = body["metadata"]
        path = path or self._core(meta["namespace"], plural)
        try:
            await self.request("POST", path, body)
            return True
        except ApiError as err:
            if err.status == 409:
                return False
            raise

    async def patch(
        self, namespace: str, plural: str, name: str, body: Any, *, content_type: str = MERGE_PATCH
    ) -> None:
        """A merge patch (a mapping), or a JSON patch (a list of operations, content_type JSON_PATCH)."""
        await self.request("PATCH", self._core(namespace, plural, name), body, content_type=content_type)

    async def delete(self, path: str, *, propagation: str | None = None) -> bool:
        """DELETE; True when deleted (or being deleted), False when already gone."""
        body = {"kind": "DeleteOptions", "apiVersion": "v1"}
        if propagation:
            body["propagationPolicy"] = propagation
        try:
            await self.request("DELETE", path, body)
            return True
        except ApiError as err:
            if err.status == 404:
                return False
            raise

    async def delete_pod(self, namespace: str, name: str) -> bool:
        return await self.delete(self._core(namespace, "pods", name))

    # --- authorization -------------------------------------------------------------------
    async def may_create_pods(self, userinfo: Mapping[str, Any], namespace: str) -> tuple[bool, str]:
        """A SubjectAccessReview: may the requester of an admission request (its userInfo) create pods in
        the namespace? (allowed, the authorizer's reason)."""
        spec = {
            "user": userinfo.get("username", ""),
            "groups": list(userinfo.get("groups") or []),
            "uid": userinfo.get("uid", ""),
            "extra": dict(userinfo.get("extra") or {}),
            "resourceAttributes": {"namespace": namespace, "verb": "create", "resource": "pods"},
        }
        review = await self.request(
            "POST",
            "/apis/authorization.k8s.io/v1/subjectaccessreviews",
            {"apiVersion": "authorization.k8s.io/v1", "kind": "SubjectAccessReview", "spec": spec},
        )
        status = (review or {}).get("status") or {}
        return bool(status.get("allowed")), str(status.get("reason") or "")
