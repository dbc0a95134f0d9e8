"""`meshjob operator`: run the kopf operator with meshjob's flags.

The same handlers as `kopf run -m meshjob_operator.handlers`."""

from __future__ import annotations

import argparse
import asyncio
import os
import socket

from meshjob.spec.api import OPERATOR_METRICS_PORT

HELP = "the Kubernetes operator (kopf)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    scope = parser.add_mutually_exclusive_group()
    scope.add_argument(
        "--namespace",
        "-n",
        action="append",
        default=[],
        metavar="NS",
        help="watch this namespace (repeatable; globs like 'team-*' work)",
    )
    scope.add_argument("--all-namespaces", "-A", action="store_true", help="watch the whole cluster (the default)")
    parser.add_argument(
        "--liveness", metavar="URL", default=None, help="serve a liveness probe, e.g. http://0.0.0.0:8080/healthz"
    )
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=OPERATOR_METRICS_PORT,
        metavar="PORT",
        help=f"Prometheus metrics port (0: off; default {OPERATOR_METRICS_PORT})",
    )
    parser.add_argument(
        "--peering",
        metavar="NAME",
        default=None,
        help="KopfPeering name: replicas with the same name never act at once",
    )
    parser.add_argument("--priority", type=int, default=0, help="peering priority (the highest one acts)")
    parser.add_argument("--standalone", action="store_true", help="no peering at all")
    parser.add_argument("--no-webhook", dest="webhook", action="store_false", help="no validating admission webhook")
    parser.add_argument("--webhook-addr", default="0.0.0.0", help="webhook listen address")
    parser.add_argument("--webhook-port", type=int, default=9443, help="webhook listen port")
    parser.add_argument(
        "--webhook-host",
        default=None,
        help="host name the API server uses to reach the webhook (its certificate's name)",
    )
    parser.add_argument(
        "--webhook-cert",
        default=None,
        help="webhook serving certificate (PEM; default: a self-signed one made at start-up)",
    )
    parser.add_argument("--webhook-key", default=None, help="webhook serving key (PEM; with --webhook-cert)")
    parser.add_argument("--webhook-ca", default=None, help="CA bundle the API server trusts the webhook by (PEM)")
    parser.add_argument(
        "--allowed-image",
        action="append",
        default=[],
        metavar="PATTERN",
        help="run only images matching this glob, e.g. 'registry.example.com/ml/*' (repeatable; "
        "default: any image); refused by the webhook and by the operator",
    )
    parser.add_argument(
        "--plan-timeout",
        type=float,
        default=60.0,
        metavar="SECONDS",
        help="planning a job runs in a child process; one that takes longer is stopped, and the job waits "
        "Pending (condition PlanningDelayed) and is planned again after a backoff, with a longer limit (default 60)",
    )
    parser.add_argument(
        "--plan-concurrency",
        type=int,
        default=None,
        metavar="N",
        help="jobs planned at once, each in its own process; others wait for a place (default: the CPU count)",
    )
    parser.add_argument("--kubeconfig", default=None, help="kubeconfig file (default: in-cluster, then $KUBECONFIG)")
    parser.add_argument("--verbose", "-v", action="store_true", help="debug logging")


def _check(args: argparse.Namespace) -> None:
    for name in ("metrics_port", "webhook_port"):
        value = getattr(args, name)
        if not 0 <= value <= 65535 or (name == "webhook_port" and value == 0):
            raise SystemExit(
                f"meshjob operator: --{name.replace('_', '-')}={value} is invalid: a TCP port 1-65535"
                + (" (or 0 for off)" if name == "metrics_port" else "")
            )
    if bool(args.webhook_cert) != bool(args.webhook_key):
        given = "--webhook-cert" if args.webhook_cert else "--webhook-key"
        raise SystemExit(
            f"meshjob operator: {given} needs its partner: give both --webhook-cert and --webhook-key "
            "(or neither, for a self-signed certificate)"
        )
    if not args.plan_timeout > 0:
        raise SystemExit(f"meshjob operator: --plan-timeout={args.plan_timeout} is invalid: seconds > 0")
    if args.plan_concurrency is not None and args.plan_concurrency < 1:
        raise SystemExit(f"meshjob operator: --plan-concurrency={args.plan_concurrency} is invalid: at least 1")
    if args.peering and args.standalone:
        raise SystemExit("meshjob operator: --peering and --standalone exclude each other")


def run(args: argparse.Namespace) -> int:
    _check(args)
    # here, not at the top: `meshjob operator --help` and bad flags need neither kopf (a second to import) nor
    # the handlers (importing them registers them with kopf)
    import kopf
    from kopf._core.engines.peering import Identity  # the type of kopf.operator's identity (not re-exported)

    from meshjob_operator.handlers import STATE, OperatorConfig
    from meshjob_operator.reconcile import ALLOWED_IMAGES_ENV

    if args.kubeconfig:
        os.environ["KUBECONFIG"] = args.kubeconfig  # kopf's own login reads it too
    if args.allowed_image:  # read by validate() in the webhook and the reconciler
        os.environ[ALLOWED_IMAGES_ENV] = ",".join(args.allowed_image)
    STATE.config = OperatorConfig(
        metrics_port=args.metrics_port or None,
        webhook=args.webhook,
        webhook_addr=args.webhook_addr,
        webhook_port=args.webhook_port,
        webhook_host=args.webhook_host,
        webhook_cert=args.webhook_cert,
        webhook_key=args.webhook_key,
        webhook_ca=args.webhook_ca,
        kubeconfig=args.kubeconfig,
        peering=args.peering,
        plan_timeout_s=args.plan_timeout,
        **({"plan_concurrency": args.plan_concurrency} if args.plan_concurrency else {}),
    )
    kopf.configure(verbose=args.verbose)
    asyncio.run(
        kopf.operator(
            clusterwide=not args.namespace,
            namespaces=args.namespace,
            liveness_endpoint=args.liveness,
            peering_name=args.peering,
            priority=args.priority,
            standalone=True if args.standalone else None,
            # its pod's name: kopf's default looks the user up in the passwd database, which has no entry
            # for a uid the cluster chose (runAsUser) and then fails to start
            identity=Identity(f"{socket.gethostname()}-{os.getpid()}"),
        )
    )
    return 0
