# Image of the sandbox *server*, built offline by `verl-agent sandbox up` (verl_agent/sandbox/image.py):
# the runner image (debootstrap Debian, python3) plus, from the build machine, the verl_agent sandbox
# package and the Python distributions it imports (the docker SDK among them). No registry, no pip.
ARG BASE_IMAGE=verl-agent-sandbox-runner:latest
FROM ${BASE_IMAGE}
LABEL org.opencontainers.image.title="verl-agent sandbox server"
USER 0:0
COPY site-packages /opt/verl-agent/site-packages
ENV PYTHONPATH=/opt/verl-agent/site-packages PYTHONDONTWRITEBYTECODE=1
WORKDIR /opt/verl-agent
# Root only to reach the Docker socket; the code it runs goes to runner containers (uid 10001, no network).
ENTRYPOINT ["/usr/bin/python3", "-m", "verl_agent.sandbox.cli", "serve", "--backend", "docker"]
