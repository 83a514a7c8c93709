# One image for the gateway and the worker; compose.yaml picks the command.
# BASE_IMAGE: any Python 3.11+ image with venv and pip. Without registry access,
# docker/build-base-images.sh builds turnbus-local/python:3.11 from Debian's packages.
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PATH=/opt/turnbus/bin:$PATH

WORKDIR /app
# Dependencies first, from pyproject.toml alone: a source change reuses this layer.
COPY pyproject.toml README.md ./
RUN python3 -m venv /opt/turnbus \
    && python3 -c 'import tomllib; p = tomllib.load(open("pyproject.toml", "rb")); print("\n".join(p["build-system"]["requires"] + p["project"]["dependencies"]))' > /tmp/requirements.txt \
    && pip install -r /tmp/requirements.txt \
    && rm /tmp/requirements.txt \
    && useradd --system --uid 10001 --no-create-home turnbus
COPY shared ./shared
COPY services ./services
RUN pip install --no-deps --no-build-isolation . && rm -rf build ./*.egg-info

USER turnbus
EXPOSE 8000
# Exec form: turnbus is PID 1 and gets SIGTERM itself. The worker finishes in-flight
# turns within TURNBUS_SHUTDOWN_GRACE_MS; give the runtime's stop timeout more than that.
STOPSIGNAL SIGTERM
CMD ["turnbus", "gateway", "--host", "0.0.0.0", "--port", "8000"]
