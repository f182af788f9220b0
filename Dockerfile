# Switchyard gateway image: `python -m gateway --config /etc/switchyard/config.yaml`.
# Build: docker build -t switchyard:0.1.0 .
FROM python:3.11-slim AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY gateway ./gateway
COPY routers ./routers
COPY handlers ./handlers
COPY k8s ./k8s
COPY enginesim ./enginesim
# only Switchyard's own wheel: its dependencies come from requirements.lock in the final stage
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

FROM python:3.11-slim
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
RUN groupadd --system --gid 10001 switchyard \
 && useradd --system --uid 10001 --gid switchyard --no-create-home --shell /usr/sbin/nologin switchyard
# exact versions with their hashes (requirements.lock, `make lock`), then the gateway without resolving again
COPY requirements.lock /tmp/requirements.lock
RUN pip install --no-cache-dir --require-hashes -r /tmp/requirements.lock && rm /tmp/requirements.lock
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir --no-deps /wheels/*.whl && rm -rf /wheels
USER 10001:10001
EXPOSE 8888
ENTRYPOINT ["python", "-m", "gateway"]
CMD ["--config", "/etc/switchyard/config.yaml"]
