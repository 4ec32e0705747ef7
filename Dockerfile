# The image kiln's Kubernetes target runs: `kiln serve` in the Rollout's pods, the router
# (`python -m kiln.deploy.router_process`) and the `kiln verify` init container. `kiln deploy render`
# names it deploy.kubernetes.image:image_tag, by default kiln:<kiln's version>, so build it with that tag:
#
#   docker build -t kiln:0.1.0 .
#
# kiln is installed from constraints.txt's exact pins, as `make install` and CI install it: torch's
# CPU wheel (2.13.0+cpu) from PyTorch's index, since PyPI's Linux wheel is the CUDA build. The build
# context is the checkout (.dockerignore lets in pyproject.toml, constraints.txt and the six package
# folders). It runs as an unprivileged user (uid 10001, numeric so that `runAsNonRoot` can check it).
#
# The engine a pod serves is not in this image: build one FROM it per engine, e.g.
#
#   FROM kiln:0.1.0
#   COPY --chown=10001:10001 engine/ /models/engine/
#
# (/models/engine is deploy.kubernetes.model_path's default). It serves the Python backends; llama.cpp
# engines need kiln's llama.cpp build, compiled for the CPU it runs on (core/llama_cpp_build.py), which
# this image does not hold.
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
# The venv's pip and kiln first on PATH once `python -m venv` made them (before, `python` is the image's).
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PATH=/opt/kiln/bin:$PATH
WORKDIR /src
COPY . .
RUN python -m venv /opt/kiln \
    && pip install --no-cache-dir -c constraints.txt \
         --extra-index-url https://download.pytorch.org/whl/cpu . \
    && kiln --help > /dev/null

FROM ${PYTHON_IMAGE}
RUN useradd --uid 10001 --user-group --create-home --home-dir /home/kiln --shell /usr/sbin/nologin kiln
COPY --from=build /opt/kiln /opt/kiln
# Offline: an engine folder holds what it serves. kiln's cache and home go under $HOME (~/.cache/kiln,
# ~/.local/share/kiln).
ENV PATH=/opt/kiln/bin:$PATH \
    HOME=/home/kiln \
    PYTHONUNBUFFERED=1 \
    HF_HUB_OFFLINE=1 \
    HF_DATASETS_OFFLINE=1 \
    MLFLOW_DISABLE_TELEMETRY=true
USER 10001
WORKDIR /home/kiln
EXPOSE 8000
ENTRYPOINT ["kiln"]
# A listener beyond loopback: kiln serve refuses it unless $KILN_API_KEY holds a key
# (docker run -e KILN_API_KEY=... -v <engine>:/models/engine:ro -p 8000:8000 kiln:0.1.0).
CMD ["serve", "/models/engine", "--host", "0.0.0.0", "--port", "8000"]
