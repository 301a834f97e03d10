"""Draft sources (:mod:`duo_vllm.sources.base`); importing a module registers its source."""

from duo_vllm.sources import lookup  # noqa: F401
