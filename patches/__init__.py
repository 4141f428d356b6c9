"""Adaptations of third-party code (vLLM, vLLM-Ascend, Megatron-Bridge); nothing else patches them."""

#: the weight-transfer backend name delta-sync registers with vLLM
BACKEND_NAME = "delta_sync"
