# Image of the sandbox *server* (the runner image is ./Dockerfile). Needs a Python base image, i.e. a
# reachable registry; on offline machines run the server on the host instead: `verl-agent sandbox serve`.
ARG PYTHON_IMAGE=python:3.11-slim
FROM ${PYTHON_IMAGE}
WORKDIR /app
COPY . /app
RUN pip install --no-cache-dir torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu \
 && pip install --no-cache-dir -e /app
CMD ["python", "-m", "verl_agent.sandbox.cli", "serve", "--backend", "docker", "--host", "127.0.0.1", "--port", "8080"]
