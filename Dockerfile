# syntax=docker/dockerfile:1.7
# meshjob images. Three targets:
#   docker build --target operator     -t meshjob/operator:0.1.0 .      # kopf operator, no torch
#   docker build --target trainer      -t meshjob/trainer:0.1.0 .       # trainer worker, torch 2.13.0 CPU
#   docker build --target trainer-cuda -t meshjob/trainer-cuda:0.1.0 .  # the same worker, torch 2.13.0 CUDA
# The Helm chart's default images are the first two tags. All run as the non-root user 10001.

ARG PYTHON_IMAGE=python:3.11.7-slim-bookworm

# ---- base: interpreter, non-root user, quiet pip ----
FROM ${PYTHON_IMAGE} AS base
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
RUN groupadd --gid 10001 meshjob \
 && useradd --uid 10001 --gid 10001 --no-create-home --home-dir /nonexistent --shell /usr/sbin/nologin meshjob
WORKDIR /app

# ---- build: one wheel per distribution: meshjob (plan layer), meshjob-operator, meshjob-trainer ----
FROM base AS build
RUN pip install setuptools==84.2.1 wheel==0.45.1
COPY pyproject.toml README.md ./
COPY meshjob/ meshjob/
COPY operator/ operator/
COPY trainer/ trainer/
RUN pip wheel --no-deps --no-build-isolation --wheel-dir /wheels . ./operator ./trainer

# ---- operator: `meshjob operator` (kopf), no torch ----
# Third-party packages come from the index, pinned, in a layer of their own (a code change rebuilds only the
# last one); meshjob's own wheels only from the build stage (--no-index), so no name of ours is ever looked up
# on a public index. cryptography: the webhook's self-signed certificate.
FROM base AS operator
RUN pip install kopf==1.45.2 kubernetes==37.0.2 prometheus-client==0.26.0 cryptography==48.0.0 \
      aiohttp==3.14.5 pyyaml==6.0.3 rich==15.0.0
# COPY, not a RUN bind-mounting the build stage: a COPY layer is cached by the wheels' content, so changed code
# is installed again (buildah caches such a RUN by its text alone, and fails to mount a stage built from cache).
COPY --from=build /wheels /tmp/wheels
RUN pip install --no-index --find-links /tmp/wheels meshjob==0.1.0 meshjob-operator==0.1.0 \
 && pip check && rm -rf /tmp/wheels
USER 10001:10001
EXPOSE 9401 8080
ENTRYPOINT ["meshjob"]
CMD ["operator"]

# ---- trainer: `meshjob worker`, one process per device (torch CPU wheel) ----
# No Kubernetes client: trainers need no API access (the operator reads their progress from their metrics).
FROM base AS trainer
# The CPU-only wheel index: torch from the default index pulls the multi-GB CUDA build.
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
RUN pip install --index-url "$TORCH_INDEX_URL" torch==2.13.0 \
 && pip install numpy==2.4.6 prometheus-client==0.26.0 pyyaml==6.0.3 rich==15.0.0
# spec.model.init: Hugging Face weights (a layer of its own: the torch layer above stays cached)
RUN pip install safetensors==0.8.0
COPY --from=build /wheels /tmp/wheels
RUN pip install --no-index --find-links /tmp/wheels meshjob==0.1.0 meshjob-trainer==0.1.0 torch==2.13.0 \
 && pip check && rm -rf /tmp/wheels
# The README job's token files (spec.data.path examples/data/..., relative to this WORKDIR): 400 KB.
# A real corpus goes on a volume mounted into the pods instead (spec.data.path: /data/train.bin).
COPY examples/data/shakespeare-train.bin examples/data/shakespeare-val.bin examples/data/
# A user's model (spec.model.kind: custom, spec.model.entrypoint: "package.module:build"): build an image
# FROM this one that installs the package, e.g.
#   FROM meshjob/trainer:0.1.0
#   COPY conv_lm/ /opt/models/conv_lm/
#   ENV PYTHONPATH=/opt/models                # or: RUN pip install my-models==1.2.3
# and name it in spec.image; `meshjob plan` and every worker check the entry point before training.
USER 10001:10001
EXPOSE 9400
ENTRYPOINT ["meshjob"]
CMD ["worker"]

# ---- trainer-cuda: the same worker with torch's CUDA wheel (NCCL between devices; see README) ----
# The wheel brings the CUDA runtime and NCCL as pip packages; the node provides only the driver (the
# NVIDIA container runtime mounts it). Another CUDA build: --build-arg TORCH_CUDA_INDEX_URL=.../whl/cu128.
FROM base AS trainer-cuda
ARG TORCH_CUDA_INDEX_URL=https://download.pytorch.org/whl/cu130
RUN pip install --index-url "$TORCH_CUDA_INDEX_URL" torch==2.13.0 \
 && pip install numpy==2.4.6 prometheus-client==0.26.0 pyyaml==6.0.3 rich==15.0.0
# spec.model.init: Hugging Face weights (a layer of its own: the torch layer above stays cached)
RUN pip install safetensors==0.8.0
COPY --from=build /wheels /tmp/wheels
RUN pip install --no-index --find-links /tmp/wheels meshjob==0.1.0 meshjob-trainer==0.1.0 torch==2.13.0 \
 && pip check && rm -rf /tmp/wheels
USER 10001:10001
EXPOSE 9400
ENTRYPOINT ["meshjob"]
CMD ["worker"]
