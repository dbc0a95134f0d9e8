"""The local cluster's own services, in one process `meshjob cluster up` starts: Prometheus run as the Prometheus
Operator would run it (meshjob_cluster.prometheus) and the storage provisioner (meshjob_cluster.provisioner).

`python -m meshjob_cluster.daemon --kubeconfig K --dir D --claims C --prometheus-port P`
"""

from __future__ import annotations

import argparse
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import kubernetes

from meshjob_cluster.prometheus import refresh
from meshjob_cluster.provisioner import provision


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m meshjob_cluster.daemon", description=__doc__)
    parser.add_argument("--kubeconfig", required=True)
    parser.add_argument("--dir", type=Path, required=True, help="Prometheus' folder (config, targets, data)")
    parser.add_argument("--claims", type=Path, required=True, help="the folder of every claim's volume")
    parser.add_argument("--prometheus-port", type=int, required=True)
    parser.add_argument("--every", type=float, default=2.0, help="seconds between refreshes")
    args = parser.parse_args(argv)
    binary = shutil.which("prometheus")
    if binary is None:
        print("meshjob cluster: the `prometheus` binary is missing: apt-get install prometheus", file=sys.stderr)
        return 2
    args.dir.mkdir(parents=True, exist_ok=True)
    api = kubernetes.config.new_client_from_config(config_file=args.kubeconfig)
    refresh(api, args.dir)
    url = f"http://127.0.0.1:{args.prometheus_port}"
    with open(args.dir / "prometheus.log", "ab") as log:
        server = subprocess.Popen(
            [
                binary,
                f"--config.file={args.dir / 'prometheus.yml'}",
                f"--storage.tsdb.path={args.dir / 'data'}",
                f"--web.listen-address=127.0.0.1:{args.prometheus_port}",
                "--web.enable-lifecycle",
                "--log.level=warn",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    stopping = False

    def stop(signum: int, frame: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    try:
        while not stopping and server.poll() is None:
            time.sleep(args.every)
            try:
                for claim in provision(api, args.claims):
                    print(f"provisioned a volume for claim {claim}", flush=True)
                if refresh(api, args.dir):
                    urllib.request.urlopen(urllib.request.Request(f"{url}/-/reload", method="POST"), timeout=10)
            except (OSError, kubernetes.client.ApiException) as err:  # the API server restarting: try again
                print(f"refresh: {err}", file=sys.stderr, flush=True)
    finally:
        server.terminate()
        try:
            server.wait(20)
        except subprocess.TimeoutExpired:
            server.kill()
    return 0


if __name__ == "__main__":
    sys.exit(main())
