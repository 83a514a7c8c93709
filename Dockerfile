# One image for the gateway and the worker; compose.yaml picks the command.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /app
COPY pyproject.toml README.md ./
COPY shared ./shared
COPY services ./services
RUN pip install . \
    && useradd --system --uid 10001 --no-create-home turnbus

USER turnbus
EXPOSE 8000
STOPSIGNAL SIGTERM
CMD ["turnbus", "gateway", "--host", "0.0.0.0", "--port", "8000"]
